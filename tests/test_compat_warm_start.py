"""The ``deepcompile-warm-start`` patch's decisions, and the ``deepcompile-sourceless-symbols``
patch that lets inductor's cache serve a warm start the re-plan's graphs.

The end-to-end runs (a second run compiling the re-plan at step 0, a store of another job, two
ranks taking the manifest's kept-gathered params) are in tests/test_deepcompile_cpu_warm_start.py; on a GPU,
tests/gpu/test_profile_store_gpu.py. Here: which schedules a warm start takes, what a cycle is
labelled before and after a fall-back, what the first profile decides, and the manifests.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import torch

import ds_z3native
from ds_z3native.compat import deepcompile_profile_store as store
from ds_z3native.compat import deepcompile_warm_start as warm
from ds_z3native.compat.deepcompile_graph_ids import patch_sourceless_symbols, sourceless_name

pytestmark = pytest.mark.deepspeed


def _passes() -> Any:
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile

    first = [zero3_compile.add_z3_gather_release]
    final = [zero3_compile.add_z3_gather_release, prefetch.schedule_prefetch,
             selective_gather.selective_gather]
    return first, final


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Any]:
    """DeepSpeed's backend module with its schedule and passes saved and restored, a fresh warm
    start state, and a profile store in ``tmp_path``."""
    from deepspeed.compile import backend as module

    saved = (module.remaining_schedule, module.next_passes)
    previous = ds_z3native.current_settings()
    ds_z3native.set_profile_store(tmp_path / "store")
    warm.reset_warm_start()
    store.reset_store_stats()
    yield module
    module.remaining_schedule, module.next_passes = saved
    ds_z3native.settings.use(previous)
    warm.reset_warm_start()
    store.reset_store_stats()


def test_deepspeeds_default_schedule_is_warm_startable_and_others_are_not() -> None:
    from deepspeed.compile.passes import offload_parameters, zero3_compile

    first, final = _passes()
    assert warm._warm_startable(deque([(0, first), (5, final)]))
    assert not warm._warm_startable(deque([(5, final)]))  # no first cycle left to skip
    assert not warm._warm_startable(deque([(0, first), (5, first)]))  # no re-plan
    offload = [zero3_compile.add_z3_gather_release, offload_parameters.offload_parameter_fwd]
    assert not warm._warm_startable(deque([(0, offload), (5, final + offload[1:])]))


def test_a_warm_cycle_is_labelled_as_the_re_plan_and_as_the_first_cycle_after_a_fall_back(
        backend: Any) -> None:
    first, final = _passes()
    passes = warm._warm_passes(first, final, with_group=True)
    backend.next_passes = passes
    backend.remaining_schedule = deque()
    warm._state.phase, warm._state.rest = "tentative", [(5, final)]
    assert store.cycle_label() == store.cycle_label(final) == \
        "add_z3_gather_release,schedule_prefetch,selective_gather"
    warm._state.fall_back("test")
    assert store.cycle_label() == store.cycle_label(first) == "add_z3_gather_release"
    assert list(backend.remaining_schedule) == [(5, final)]  # the re-plan comes back
    # The re-plan's passes do nothing in the fallen-back cycle (a graph would raise here).
    assert all(p(None, 1, [], {}, None, 0.0, {}, False) is None for p in passes[1:])
    assert warm.warm_start_stats()["fell_back"] == 1


def test_a_tentative_start_that_looked_nothing_up_falls_back_at_its_first_re_plan_pass(
        backend: Any) -> None:
    first, final = _passes()
    passes = warm._warm_passes(first, final, with_group=False)
    backend.remaining_schedule = deque()
    warm._state.phase, warm._state.rest = "tentative", [(5, final)]
    assert passes[1](None, 1, [], {}, None, 0.0, {}, False) is None
    assert warm._state.phase == "off" and list(backend.remaining_schedule) == [(5, final)]


def _graph() -> torch.fx.Graph:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    for n in gm.graph.nodes:
        n.meta["val"] = torch.empty(4)
    return gm.graph


class _Interp:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph


def _manifest(directory: Path, graph: torch.fx.Graph, early: List[int], added: List[int]) -> Path:
    path = warm.manifest_path(directory, store.profile_key("operator", graph, 1), 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "kind": "warm", "early": early, "added": added}))
    return path


def test_the_first_profile_starts_from_its_manifest_or_falls_back(
        backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, final = _passes()
    kept: List[List[int]] = []
    monkeypatch.setattr(warm, "_set_persistent", lambda ids: kept.append(list(ids)))
    backend.next_passes = warm._warm_passes(first, final, with_group=True)
    backend.remaining_schedule = deque()
    graph = _graph()
    _manifest(tmp_path / "store", graph, early=[7, 3], added=[9])
    warm._state.phase, warm._state.rest = "tentative", [(5, final)]
    warm._state.before("operator", _Interp(graph), 1)
    assert warm._state.phase == "on" and kept == [[3, 7]]  # ascending: the same on every rank
    assert list(backend.remaining_schedule) == []  # no re-plan
    # The last backward graph adds what selective_gather added in the recorded run.
    stand_in = backend.next_passes[2]
    assert stand_in(None, 11, [(12, False), (11, True)], {}, None, 0.0, {}, True) is None
    assert kept == [[3, 7], [9]]

    warm.reset_warm_start()
    kept.clear()
    other = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    for n in other.graph.nodes:
        n.meta["val"] = torch.empty(4)
    warm._state.phase, warm._state.rest = "tentative", [(5, final)]
    warm._state.before("operator", _Interp(other.graph), 1)
    assert warm._state.phase == "off" and kept == []
    assert list(backend.remaining_schedule) == [(5, final)]


def test_a_malformed_manifest_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "warm-x.rank0.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=warm.__name__):
        assert warm._load_manifest(path) is None
    assert "unreadable" in caplog.text and str(path) in caplog.text
    for record in ({"format": 1, "kind": "warm", "early": [1]},
                   {"format": 1, "kind": "warm", "early": ["1"], "added": []},
                   {"format": 2, "kind": "warm", "early": [], "added": []},
                   {"format": 1, "kind": "memory", "early": [], "added": []}):
        path.write_text(json.dumps(record))
        assert warm._load_manifest(path) is None, record
    path.write_text(json.dumps({"format": 1, "kind": "warm", "early": [2], "added": []}))
    assert warm._load_manifest(path) == {"format": 1, "kind": "warm", "early": [2], "added": []}
    assert warm._load_manifest(tmp_path / "absent.json") is None


def test_profiles_of_a_re_plan_and_of_a_first_cycle_are_stored_apart(backend: Any) -> None:
    first, final = _passes()
    graph = _graph()
    backend.next_passes = first
    key_first = store.profile_key("operator", graph, 1)
    backend.next_passes = final
    assert store.profile_key("operator", graph, 1) != key_first


def test_the_fingerprint_does_not_see_how_symbols_are_numbered() -> None:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    def graph_with(symbol_seed: int) -> torch.fx.Graph:
        mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
        for _ in range(symbol_seed):  # other tensors alive: torch names the next symbol apart
            mode.from_tensor(torch.zeros(3))
        val = mode.from_tensor(torch.zeros(5056, dtype=torch.uint8))
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = val
        g.output(x)
        return g

    a, b = graph_with(0), graph_with(16)
    assert str(a.find_nodes(op="placeholder")[0].meta["val"].shape) != \
        str(b.find_nodes(op="placeholder")[0].meta["val"].shape)
    assert store.graph_fingerprint("operator", a, []) == store.graph_fingerprint("operator", b, [])


def _symbol_after(alive: int) -> str:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
    kept = [mode.from_tensor(torch.zeros(3)) for _ in range(alive)]
    fake = mode.from_tensor(torch.zeros(5056, dtype=torch.uint8))
    del kept
    return str(fake.shape[0])


def test_a_sourceless_tensor_gets_the_same_symbol_whatever_the_mode_holds() -> None:
    unpatched = {_symbol_after(n) for n in (0, 1, 16, 17)}
    assert len(unpatched) > 1  # torch: named after the count of live fake tensors
    undo = patch_sourceless_symbols()
    try:
        assert len({_symbol_after(n) for n in (0, 1, 16, 17)}) == 1
    finally:
        undo()
    assert {_symbol_after(n) for n in (0, 1, 16, 17)} == unpatched


def test_sourceless_names_count_per_mode_dtype_and_shape() -> None:
    a, b = object.__new__(type("Mode", (), {})), object.__new__(type("Mode", (), {}))
    t = torch.zeros(2, 3)
    assert sourceless_name(a, t) == "__ds_z3native_sourceless_float32_2x3_0"
    assert sourceless_name(a, t) == "__ds_z3native_sourceless_float32_2x3_1"
    assert sourceless_name(a, torch.zeros((), dtype=torch.uint8)) == \
        "__ds_z3native_sourceless_uint8_scalar_0"
    assert sourceless_name(b, t) == "__ds_z3native_sourceless_float32_2x3_0"


def test_the_warm_start_setting_is_checked() -> None:
    previous = ds_z3native.current_settings()
    try:
        ds_z3native.set_warm_start(False)
        assert ds_z3native.current_settings().warm_start is False
        with pytest.raises(ValueError, match="set_warm_start"):
            ds_z3native.set_warm_start("no")  # type: ignore[arg-type]
        assert ds_z3native.settings.Settings.from_env(
            {ds_z3native.WARM_START_ENV: "off"}).warm_start is False
        with pytest.raises(ValueError, match=ds_z3native.WARM_START_ENV):
            ds_z3native.settings.Settings.from_env({ds_z3native.WARM_START_ENV: "2"})
    finally:
        ds_z3native.settings.use(previous)


def test_the_single_cycle_setting_is_checked_and_off_by_default() -> None:
    previous = ds_z3native.current_settings()
    try:
        assert ds_z3native.settings.Settings.from_env({}).single_cycle is False
        ds_z3native.set_single_cycle(True)
        assert ds_z3native.current_settings().single_cycle is True
        with pytest.raises(ValueError, match="set_single_cycle"):
            ds_z3native.set_single_cycle(1)  # type: ignore[arg-type]
        assert ds_z3native.settings.Settings.from_env(
            {ds_z3native.SINGLE_CYCLE_ENV: "yes"}).single_cycle is True
        with pytest.raises(ValueError, match=ds_z3native.SINGLE_CYCLE_ENV):
            ds_z3native.settings.Settings.from_env({ds_z3native.SINGLE_CYCLE_ENV: "maybe"})
    finally:
        ds_z3native.settings.use(previous)


class _Param:
    def __init__(self, ds_numel: int, trainable: bool) -> None:
        self.ds_numel, self.requires_grad = ds_numel, trainable


class _Manager:
    def __init__(self, **params: Any) -> None:
        self.params = {name: type("DSParam", (), {"param": p})() for name, (_, p) in
                       params.items()}
        self.ds_ids = {name: ds_id for name, (ds_id, _) in params.items()}


def test_the_optimizer_states_held_back_count_each_trainable_partition_once() -> None:
    lora_a, lora_b, base = _Param(10, True), _Param(7, True), _Param(1000, False)
    managers = {0: _Manager(a=(1, lora_a), w=(3, base)),
                1: _Manager(a=(1, lora_a), b=(2, lora_b))}  # lora_a in both graphs
    # Two fp32 states per element of each rank's partition (ceil(10/2) + ceil(7/2)); frozen
    # params have none.
    assert warm.optimizer_state_bytes(managers, world_size=2) == 8 * (5 + 4)
    assert warm.optimizer_state_bytes(managers, world_size=1) == 8 * 17
    assert warm.optimizer_state_bytes({0: _Manager(w=(3, base))}, world_size=1) == 0


def test_a_single_cycle_runs_selective_gather_at_its_last_backward_graph_with_memory_held(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.compile.passes import selective_gather as module

    first, final = _passes()
    seen: List[Any] = []
    held: List[int] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> Any:
        held.append(args[0])
        return real_empty(*args, **kwargs)

    def chosen(gm: Any, graph_id: int, graph_order: Any, profiles: Any, create: Any,
               budget: Any, managers: Any, bwd: bool) -> Any:
        seen.append((graph_id, bwd, list(held)))
        return None

    monkeypatch.setattr(module, "selective_gather", chosen)  # as the module holds it at the time
    monkeypatch.setattr(warm, "_device", lambda: "cpu")
    monkeypatch.setattr(torch, "empty", empty)
    passes = warm._warm_passes(first, final, with_group=False)
    persistence = passes[2]
    backend.next_passes, backend.remaining_schedule = passes, deque()
    warm._state.single = True
    warm._state.phase, warm._state.rest = "tentative", [(5, final)]
    warm._state.fall_back("no manifest")  # a single cycle instead of the first
    assert warm._state.phase == "single" and not backend.remaining_schedule  # no re-plan back
    order = [(0, True), (1, True)]  # graph 0 runs first forward: its backward comes last
    managers = {0: _Manager(a=(1, _Param(6, True)))}
    for graph_id, bwd in ((0, False), (1, True), (0, True)):
        persistence(None, graph_id, order, {}, None, 0.0, managers, bwd)
    assert seen == [(0, True, [48])]  # the last backward graph only, 2 x 4 bytes x 6 held
    assert store.cycle_label() == store.cycle_label(final)  # profiles stored as the re-plan's
    assert warm.warm_start_stats()["single_cycles"] == 1

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torch, "empty", no_room)
    persistence(None, 0, order, {}, None, 0.0, managers, True)
    assert len(seen) == 1  # no room for the optimizer's states: nothing kept gathered



def test_a_single_cycle_replaces_deepspeeds_default_schedule_only(backend: Any) -> None:
    first, final = _passes()

    def launch(global_steps: int) -> None:  # DeepSpeed's: the due entry's passes are next
        if backend.remaining_schedule and backend.remaining_schedule[0][0] == global_steps:
            backend.next_passes = backend.remaining_schedule.popleft()[1]

    launching = warm._launching_warm(launch)
    ds_z3native.set_single_cycle(True)
    # Not DeepSpeed's default schedule (no re-plan): it runs as configured.
    backend.remaining_schedule = deque([(0, first), (5, first)])
    launching(0)
    assert list(backend.remaining_schedule) == [(5, first)] and backend.next_passes == first
    assert warm.warm_start_stats()["single_cycles"] == 0
    # The default schedule, a store without this job's re-plan: one cycle of the re-plan's
    # passes at step 0, labelled as the re-plan, and nothing left to launch.
    warm.reset_warm_start()
    backend.remaining_schedule = deque([(0, first), (5, final)])
    launching(0)
    assert not backend.remaining_schedule and warm._state.phase == "single"
    assert store.cycle_label() == store.cycle_label(final)
    assert [warm._pass_name(p) for p in backend.next_passes] == [
        "add_z3_gather_release", "schedule_prefetch", "selective_gather", None]
    assert warm.warm_start_stats()["single_cycles"] == 1
    # Off (the default): DeepSpeed's two cycles.
    warm.reset_warm_start()
    ds_z3native.set_single_cycle(False)
    backend.remaining_schedule = deque([(0, first), (5, final)])
    launching(0)
    assert list(backend.remaining_schedule) == [(5, final)] and backend.next_passes == first
