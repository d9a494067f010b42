"""The ``deepcompile-kwargs-dependencies`` and ``deepcompile-resume-schedule`` patches, on
DeepSpeed's own scheduler functions (the end-to-end runs through HF Trainer are in
tests/test_trainers.py)."""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F

import ds_z3native

pytestmark = pytest.mark.deepspeed

deepspeed = pytest.importorskip("deepspeed")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    # The shape of an HF model's evaluation graph: the mask is computed in the graph and reaches
    # SDPA by keyword.
    mask = torch.where(keep, 0.0, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


def _graph() -> Any:
    return torch.fx.symbolic_trace(_attention).graph


def _node(graph: Any, prefix: str) -> Any:
    return next(n for n in graph.nodes if n.name.startswith(prefix))


SCHEDULE_PATCHES = ("deepcompile-kwargs-dependencies", "deepcompile-resume-schedule")


@pytest.fixture(params=["installed"])
def installed(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    """install() for the test; ``weak``: without the two patches (our op still in DeepSpeed's
    loader, so nothing is JIT-built)."""
    if request.param == "weak":
        from ds_z3native.compat import registry

        every = registry.all_patches
        monkeypatch.setattr(registry, "all_patches",
                            lambda: [p for p in every() if p.name not in SCHEDULE_PATCHES])
    ds_z3native.uninstall()
    ds_z3native.install()
    try:
        yield
    finally:
        ds_z3native.uninstall()


weak = pytest.mark.parametrize("installed", ["weak"], indirect=True)


def _names(nodes: List[Any]) -> List[str]:
    return [n.name for n in nodes]


def _scheduler_view(graph: Any) -> Any:
    from deepspeed.compile import list_schedule, util

    sdpa, where = _node(graph, "scaled_dot_product"), _node(graph, "where")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # DeepSpeed's last-use analysis reads keyword arguments (the scheduler's frees rely on it).
    assert util.get_last_uses(graph)[0][where] is sdpa
    return (_names(list_schedule.filter_args(sdpa)),
            _names(list_schedule.get_node_requirements(sdpa, placeholders)))


@weak
def test_deepspeeds_scheduler_misses_a_keyword_input_without_the_patch(installed: None) -> None:
    # The weak behaviour: SDPA looks runnable before the `where` computing its mask.
    inputs, requirements = _scheduler_view(_graph())
    assert inputs == ["q", "k", "v"]
    assert requirements == ["scaled_dot_product_attention"]


def test_keyword_inputs_are_dependencies(installed: None) -> None:
    inputs, requirements = _scheduler_view(_graph())
    assert inputs == ["q", "k", "v", "where"]
    # Producers before consumers; placeholders are already scheduled.
    assert requirements == ["where", "scaled_dot_product_attention"]


def test_graphs_without_keyword_inputs_are_scheduled_as_before(installed: None) -> None:
    from deepspeed.compile import list_schedule

    def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x) + y
        b = a.view(-1) * 3
        return torch.cat([b, a.view(-1)]) + x.view(-1)

    graph = torch.fx.symbolic_trace(chain).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out = [n for n in graph.nodes if n.op == "output"][0].args[0]
    ours = _names(list_schedule.get_node_requirements(out, placeholders))
    theirs = _names(list_schedule.get_node_requirements.__wrapped__(out, placeholders))
    assert ours == theirs
    assert ours[-1] == out.name and len(ours) == len(graph.nodes) - 3  # - x, y, output
    for node in graph.nodes:
        assert list_schedule.filter_args(node) == list_schedule.filter_args.__wrapped__(node)


def test_a_deep_graph_needs_no_recursion(installed: None) -> None:
    from deepspeed.compile import list_schedule

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    first = node
    for _ in range(5000):
        node = graph.call_function(torch.relu, (node,))
    graph.output(node)
    assert len(list_schedule.get_node_requirements(node, [first])) == 5000


def _chain_graph(length: int) -> Tuple[Any, List[Any]]:
    graph = torch.fx.Graph()
    nodes = [graph.placeholder("x")]
    for _ in range(length):
        nodes.append(graph.call_function(torch.relu, (nodes[-1],)))
    graph.output(nodes[-1])
    return graph, nodes


def test_the_scheduled_set_follows_a_growing_list_and_takes_a_path_on_top_as_a_tail() -> None:
    from ds_z3native.compat.deepcompile_schedule import _Scheduled

    _, nodes = _chain_graph(6)
    seen = _Scheduled()
    scheduled = nodes[:2]
    base, tail = seen.split(scheduled)
    assert base == set(nodes[:2]) and tail == []
    scheduled.append(nodes[2])  # the scheduler appends: the same set grows
    again, tail = seen.split(scheduled)
    assert again is base and again == set(nodes[:3]) and tail == []
    # The list plus a path (a new list starting with it): its tail only, the set unchanged.
    again, tail = seen.split(scheduled + nodes[3:5])
    assert again is base and again == set(nodes[:3]) and tail == nodes[3:5]
    # A list with other nodes where the followed one had its own starts a new set.
    other, tail = seen.split([nodes[0], nodes[4], nodes[5]])
    assert other is not base and other == {nodes[0], nodes[4], nodes[5]} and tail == []


def test_requirements_on_top_of_a_path_leave_the_path_out_and_later_calls_see_it_again(
        installed: None) -> None:
    # The scheduler asks for the requirements of a node given its schedule plus a candidate
    # path (scheduled + schedule_until_ag), then again given its schedule alone: the path's
    # nodes are skipped the first time only.
    from deepspeed.compile import list_schedule

    _, nodes = _chain_graph(8)
    walk = list_schedule.get_node_requirements
    scheduled = nodes[:2]
    assert _names(walk(nodes[5], scheduled)) == _names(nodes[2:6])
    assert _names(walk(nodes[5], scheduled + nodes[2:4])) == _names(nodes[4:6])
    assert _names(walk(nodes[5], scheduled)) == _names(nodes[2:6])
    scheduled.extend(nodes[2:4])
    assert _names(walk(nodes[7], scheduled)) == _names(nodes[4:8])
    assert walk(nodes[3], scheduled) == []
    for schedule in ([nodes[0]], nodes[:2], nodes[:2] + nodes[2:5]):
        assert walk(nodes[6], schedule) == walk.__wrapped__(nodes[6], schedule)


@pytest.fixture
def schedule_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from deepspeed.compile import backend

    # Its log line asks the process group for the rank; there is none in this process.
    monkeypatch.setattr(backend, "log_rank0", lambda *args, **kwargs: None)
    saved = (backend.remaining_schedule, backend.next_passes)
    yield backend
    backend.remaining_schedule, backend.next_passes = saved


def _first_pass() -> None: ...


def _replan_pass() -> None: ...


def test_a_resumed_step_count_starts_the_schedule(installed: None, schedule_module: Any) -> None:
    backend = schedule_module
    backend.next_passes = None
    backend.init_schedule([(0, [_first_pass]), (5, [_first_pass, _replan_pass])])
    backend.launch_compile_passes(6)  # the first forward after load_checkpoint at step 6
    assert backend.next_passes == [_first_pass]
    assert [s for s, _ in backend.remaining_schedule] == [11]
    for step in (7, 8, 9, 10):
        backend.launch_compile_passes(step)
        assert backend.next_passes == [_first_pass]
    backend.launch_compile_passes(11)
    assert backend.next_passes == [_first_pass, _replan_pass]
    assert len(backend.remaining_schedule) == 0


def test_a_fresh_run_keeps_deepspeeds_schedule(installed: None, schedule_module: Any) -> None:
    backend = schedule_module
    backend.init_schedule([(0, [_first_pass]), (5, [_replan_pass])])
    for step in range(5):
        backend.launch_compile_passes(step)
        assert backend.next_passes == [_first_pass]
    backend.launch_compile_passes(5)
    assert backend.next_passes == [_replan_pass]


@weak
def test_without_the_patch_a_resumed_run_has_no_passes(installed: None, schedule_module: Any) -> None:
    backend = schedule_module
    backend.next_passes = None
    backend.init_schedule([(0, [_first_pass]), (5, [_replan_pass])])
    backend.launch_compile_passes(6)
    assert backend.next_passes is None  # run_opt_passes then iterates None: the TypeError


def test_the_engines_bound_launcher_is_the_patched_one(installed: None) -> None:
    # init_z3 binds launch_compile_passes from its own module namespace at engine.compile().
    from deepspeed.compile import backend, init_z3

    assert init_z3.launch_compile_passes is backend.launch_compile_passes
    assert backend.launch_compile_passes.__wrapped__ is not None


def test_an_uninstall_leaves_no_wrapper_bound_in_init_z3_and_a_reinstall_rebinds_it() -> None:
    # Fresh interpreter: init_z3 imported after install() takes the wrapper itself (its
    # ``from backend import launch_compile_passes`` runs after backend was patched). Uninstall
    # must put DeepSpeed's function back there too, and the next install bind its new wrapper.
    from helpers.dist import run_python

    r = run_python("""
        import ds_z3native
        ds_z3native.install()
        from deepspeed.compile import backend, init_z3
        original = backend.launch_compile_passes
        while hasattr(original, "__wrapped__"):  # two patches wrap it
            original = original.__wrapped__
        print("BOUND", init_z3.launch_compile_passes is backend.launch_compile_passes)
        ds_z3native.uninstall()
        print("RESTORED", init_z3.launch_compile_passes is original,
              backend.launch_compile_passes is original)
        ds_z3native.install()
        print("REBOUND", init_z3.launch_compile_passes is backend.launch_compile_passes,
              backend.launch_compile_passes is not original)
        """, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["BOUND"] == "True", r.stdout
    assert lines["RESTORED"] == "True True", r.stdout
    assert lines["REBOUND"] == "True True", r.stdout
