"""The single cycle's regroup (compat.deepcompile_regroup): which compiled code AOTAutograd runs
after a graph compiled before the persistence choice is compiled again.

The end-to-end side (DeepSpeed, two gloo ranks, inductor on the CPU) is
``tests/test_deepcompile_cpu_warm_start.py::test_a_single_cycle_compiles_each_graph_once_and_a_later_run_starts_warm_from_it``;
here the decision itself, on a real FX graph holding a ``dc.allgather_param`` call and a real
tracing context, with the compiler standing in for inductor.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import pytest

torch = pytest.importorskip("torch")

from ds_z3native import _native  # noqa: E402
from ds_z3native.compat import deepcompile_regroup as regroup  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    _native.load()  # the dc ops the graphs call
    regroup.reset_regroup()
    yield
    regroup.reset_regroup()


def _graph_with_a_gather(graph_id: int = -1) -> Any:
    graph = torch.fx.Graph()
    param = graph.placeholder("param")
    x = graph.placeholder("x")
    full = graph.call_function(torch.ops.dc.allgather_param.default, (param, graph_id, 7))
    out = graph.call_function(torch.ops.aten.mul.Tensor, (full, x))
    graph.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _first(args: List[Any]) -> str:
    return "first"


_first._boxed_call = True  # type: ignore[attr-defined]


def _compiler(strides: Optional[List[Any]] = None, fails: bool = False) -> Any:
    """Stands for inductor's compiler: reports output strides into the tracing context as
    inductor does, and returns boxed code."""
    calls: List[Any] = []

    def compile_graph(gm: Any, example_inputs: List[Any]) -> Any:
        calls.append(gm)
        if fails:
            raise RuntimeError("inductor failed")
        context = torch._guards.TracingContext.try_get()
        if context is not None and context.output_strides is not None and strides is not None:
            context.output_strides.extend(strides)

        def second(args: List[Any]) -> str:
            return "second"

        second._boxed_call = True  # type: ignore[attr-defined]
        return second

    compile_graph.calls = calls  # type: ignore[attr-defined]
    return compile_graph


def _kept(compiler: Any, first_strides: Optional[List[Any]]) -> Any:
    holder = regroup.CompiledHolder(_first)
    context = torch._guards.TracingContext(None) if first_strides is not None else None
    return regroup._Kept(graph_id=123, bwd=False, gm=_graph_with_a_gather(), example_inputs=[],
                         compiler=compiler, tracing_context=context, cache_key_tag=None,
                         output_strides=first_strides, holder=holder), holder


def _grouping(monkeypatch: pytest.MonkeyPatch, changes: bool) -> List[int]:
    """The grouping pass, told which params are kept gathered (the native runtime's flags in a
    run), records the graph ids it was given."""
    seen: List[int] = []

    def group(gm: Any, graph_id: int, *args: Any, **kwargs: Any) -> Any:
        seen.append(graph_id)
        if not changes:
            return None
        node = next(n for n in gm.graph.nodes if n.target == torch.ops.dc.allgather_param.default)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        return gm

    monkeypatch.setattr(regroup, "group_persistent_gathers", group)
    return seen


def test_the_holder_runs_boxed_and_unboxed_code_and_takes_new_code() -> None:
    holder = regroup.CompiledHolder(lambda a, b: a + b)  # unboxed: AOTAutograd would box it
    assert holder._boxed_call is True and holder([2, 3]) == 5
    boxed = _compiler()(None, [])
    holder.compiled = boxed
    assert holder([1]) == "second"


def test_a_regrouped_graph_with_the_first_compiles_strides_replaces_its_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _grouping(monkeypatch, changes=True)
    compiler = _compiler(strides=[(4, 1)])
    entry, holder = _kept(compiler, first_strides=[(4, 1)])
    regroup._cycle.kept = [entry]
    regroup._regroup_kept()
    assert holder([]) == "second"
    assert seen == [-1]  # the id the graph's dc ops carry (canonical), not DeepSpeed's 123
    (compiled_gm,) = compiler.calls
    assert not any(n.target == torch.ops.dc.allgather_param.default
                   for n in compiled_gm.graph.nodes)
    # the kept copy is untouched: a second regroup would start from DeepSpeed's graph
    assert any(n.target == torch.ops.dc.allgather_param.default for n in entry.gm.graph.nodes)
    stats = regroup.regroup_stats()
    assert (stats["regrouped"], stats["declined"], stats["strides_checked"]) == (1, 0, 1)
    assert regroup._cycle.kept == []


def test_other_output_strides_keep_the_first_compile(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # AOTAutograd fitted the backward graph to the first compile's output strides.
    _grouping(monkeypatch, changes=True)
    entry, holder = _kept(_compiler(strides=[(1, 4)]), first_strides=[(4, 1)])
    regroup._cycle.kept = [entry]
    with caplog.at_level(logging.WARNING, logger=regroup.__name__):
        regroup._regroup_kept()
    assert holder([]) == "first"
    assert regroup.regroup_stats()["declined"] == 1
    assert regroup.regrouped_ids() is None  # a warm start must not assume the regrouped graph
    assert "keeps its first compile" in caplog.text and "output strides" in caplog.text


def test_a_failed_compile_keeps_the_first_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    _grouping(monkeypatch, changes=True)
    entry, holder = _kept(_compiler(fails=True), first_strides=None)
    regroup._cycle.kept = [entry]
    regroup._regroup_kept()
    assert holder([]) == "first"
    assert regroup.regroup_stats()["declined"] == 1 and regroup.regrouped_ids() is None


def test_a_graph_without_a_param_kept_gathered_is_not_compiled_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _grouping(monkeypatch, changes=False)
    compiler = _compiler()
    entry, holder = _kept(compiler, first_strides=None)
    regroup._cycle.kept = [entry]
    regroup._regroup_kept()
    assert compiler.calls == [] and holder([]) == "first"
    stats = regroup.regroup_stats()
    assert (stats["regrouped"], stats["declined"]) == (0, 0)


def test_graphs_compiled_outside_a_single_cycle_or_after_its_choice_are_not_kept() -> None:
    compiler = _compiler()
    wrapped = regroup._recording(compiler, graph_id=5, bwd=False)
    gm = _graph_with_a_gather()
    assert getattr(wrapped(gm, []), "__name__", None) == "second"  # not a holder: no cycle
    regroup.begin_single_cycle()
    held = wrapped(gm, [])
    assert isinstance(held, regroup.CompiledHolder) and regroup.regroup_stats()["kept"] == 1
    regroup.choice_made()
    regroup._cycle.kept = []
    assert not isinstance(wrapped(gm, []), regroup.CompiledHolder)


def test_the_copy_keys_inductors_cache_as_the_module_it_copies() -> None:
    # Inductor's FX-graph cache pickles the module's __dict__: the copy keeps its order.
    gm = _graph_with_a_gather()
    gm.meta["note"] = 1
    extra = dict(gm.__dict__)
    gm.__dict__.clear()
    gm.__dict__.update(reversed(list(extra.items())))  # an order a new module would not have
    copy = regroup._copy_module(gm)
    assert list(copy.__dict__) == list(gm.__dict__)
    assert copy.meta == gm.meta and copy.meta is not gm.meta
    assert copy.code == gm.code and copy.graph is not gm.graph


@pytest.mark.parametrize("kind", [tuple, list])
def test_the_regroup_compiles_with_the_inputs_as_the_first_compile_had_them(
        monkeypatch: pytest.MonkeyPatch, kind: type) -> None:
    # Inductor's FX-graph cache key hashes a tuple of example inputs as one item and a list
    # input by input. DeepSpeed hands the compiler a tuple where it replaces the ZeRO-3 params'
    # fake inputs (on CUDA); the regroup compiled a list there, and a warm start, which compiles
    # the regrouped graph first with DeepSpeed's tuple, missed the cache (seen on an H200).
    _grouping(monkeypatch, changes=True)
    received: List[Any] = []
    inner = _compiler()

    def compiler(gm: Any, example_inputs: Any) -> Any:
        received.append(example_inputs)
        return inner(gm, example_inputs)

    wrapped = regroup._recording(compiler, graph_id=5, bwd=False)
    regroup.begin_single_cycle()
    first = kind([torch.ones(2), torch.zeros(3)])
    holder = wrapped(_graph_with_a_gather(), first)
    assert isinstance(holder, regroup.CompiledHolder)
    regroup._regroup_kept()
    assert regroup.regroup_stats()["regrouped"] == 1
    again = received[-1]
    assert len(received) == 2 and type(again) is kind
    assert len(again) == len(first) and all(a is b for a, b in zip(again, first))
