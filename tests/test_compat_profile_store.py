"""The ``deepcompile-profile-store`` patch: DeepCompile's graph profiles kept between runs.

A profiler here is a ``torch.fx.Interpreter`` that writes what DeepSpeed's profilers write into
each node's meta, with a different "measurement" each run (as CUDA timings are). Recorded once,
the profile is replayed in a later run without running the graph, so the scheduler sees the
same figures; a second
profile of the same graph in one run (DeepCompile's re-plan) is kept apart and never replays the
first; ranks replay only when every rank has the profile. The all-gather benchmark DeepCompile's
prefetch pass predicts gather times from is kept and replayed the same way. End to end on a real
DeepCompile run:
tests/test_deepcompile_cpu_warm_start.py (a second run replays every profile the first recorded).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.fx as fx

from ds_z3native.compat import deepcompile_profile_store as store

from helpers.dist import run_ranks

pytestmark = pytest.mark.deepspeed

_measurements = itertools.count(1)


class _Profiler(fx.Interpreter):
    """Writes every profile key into each node's meta; each run measures other values."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.mem_record: List[tuple] = []
        self.profile_complete = True
        self.process_group = None
        self.device = torch.device("cpu")

    def run(self, *args: Any) -> Any:
        return super().run(*args)

    executed = 0  # nodes run by any profiler of this class

    def run_node(self, n: fx.Node) -> Any:
        type(self).executed += 1
        out = super().run_node(n)
        value = next(_measurements)
        for key in store.NODE_KEYS:
            n.meta[key] = value
        self.mem_record.append((n.name, value, 0, value))
        return out


_Profiler.run = store._with_store("operator", lambda interp, out: True,  # type: ignore[method-assign]
                                  store._capture_nodes, store._replay_nodes)(_Profiler.run)


def _graph(graph_id: int, scale: float = 2.0) -> fx.GraphModule:
    """x * scale + graph_id, the int standing where DeepSpeed writes its graph id."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.mul, (x, scale))
    z = g.call_function(torch.add, (y, graph_id))
    g.output(z)
    return fx.GraphModule(torch.nn.Module(), g)


def _profile(gm: fx.GraphModule) -> Dict[str, float]:
    _Profiler(gm).run(torch.ones(2))
    return {n.name: n.meta["device_time"] for n in gm.graph.nodes}


@pytest.fixture
def profile_dir(tmp_path: Path, clean_settings) -> Path:
    import ds_z3native

    ds_z3native.set_profile_store(tmp_path / "profiles")
    store.reset_store_stats()
    yield tmp_path / "profiles"
    store.reset_store_stats()


def test_the_fingerprint_ignores_graph_ids_but_not_the_program() -> None:
    fp = lambda gm: store.graph_fingerprint("operator", gm.graph, ["ctx"])  # noqa: E731
    assert fp(_graph(139_872_412_000_016)) == fp(_graph(-1))
    assert fp(_graph(1)) != fp(_graph(1, scale=3))  # a float constant changes the math: kept as type
    g = _graph(1)
    for n in g.graph.nodes:
        if n.target is torch.add:
            n.target = torch.sub
    g.recompile()
    assert fp(g) != fp(_graph(1))
    assert store.graph_fingerprint("operator", _graph(1).graph, ["device A"]) != \
        store.graph_fingerprint("operator", _graph(1).graph, ["device B"])


def test_without_a_store_each_run_keeps_its_own_measurement(clean_settings) -> None:
    store.reset_store_stats()
    assert _profile(_graph(1)) != _profile(_graph(2))
    assert store.store_stats() == {"recorded": 0, "replayed": 0}


def test_a_later_run_replays_the_recorded_profile(profile_dir: Path) -> None:
    first = _profile(_graph(111))
    assert store.store_stats() == {"recorded": 1, "replayed": 0}
    files = sorted(p.name for p in profile_dir.iterdir())
    assert len(files) == 1 and files[0].startswith("operator-") and files[0].endswith("-0.rank0.json")
    store.reset_store_stats()  # a new run: other graph id, other measurement
    before = _Profiler.executed
    assert _profile(_graph(222)) == first
    assert store.store_stats() == {"recorded": 0, "replayed": 1}
    assert _Profiler.executed == before  # the graph was not run: its stored figures were used


def test_a_second_profile_in_one_run_is_kept_apart_from_the_first(profile_dir: Path) -> None:
    # DeepCompile profiles a graph again at its re-plan: that one is measured, not the first replayed.
    initial, replan = _profile(_graph(1)), _profile(_graph(1))
    assert initial != replan
    assert store.store_stats() == {"recorded": 2, "replayed": 0}
    store.reset_store_stats()
    assert (_profile(_graph(2)), _profile(_graph(2))) == (initial, replan)
    assert store.store_stats() == {"recorded": 0, "replayed": 2}


def test_an_unreadable_profile_is_measured_again_with_a_warning(profile_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    _profile(_graph(1))
    (path,) = profile_dir.iterdir()
    path.write_text("{not json")
    store.reset_store_stats()
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        _profile(_graph(1))
    assert "unreadable" in caplog.text and str(path) in caplog.text
    assert store.store_stats() == {"recorded": 1, "replayed": 0}
    assert json.loads(path.read_text())["format"] == store._FORMAT  # written anew


def test_a_stored_profile_of_other_nodes_is_not_replayed(profile_dir: Path) -> None:
    first = _profile(_graph(1))
    (path,) = profile_dir.iterdir()
    record = json.loads(path.read_text())
    record["nodes"]["extra"] = {"device_time": 1.0}
    path.write_text(json.dumps(record))
    store.reset_store_stats()
    assert _profile(_graph(1)) != first
    assert store.store_stats()["replayed"] == 0


def test_a_replayed_memory_profile_is_complete_with_its_record(profile_dir: Path) -> None:
    """DeepSpeed reads a memory profiler's ``mem_record`` and ``profile_complete`` after ``run``:
    a replayed (not run) profile sets both as the recorded run left them."""
    memory = store._with_store("memory", lambda interp, out: True, store._capture_memory,
                               store._replay_memory)

    class _Memory(_Profiler):
        run = memory(fx.Interpreter.run)

    first = _Memory(_graph(1))
    first.run(torch.ones(2))
    store.reset_store_stats()
    second = _Memory(_graph(2))
    second.profile_complete = False
    before = _Profiler.executed
    assert second.run(torch.ones(2)) is None
    assert _Profiler.executed == before
    assert second.profile_complete is True
    assert second.mem_record == first.mem_record and len(first.mem_record) == 4
    assert store.store_stats() == {"recorded": 0, "replayed": 1}


def _all_gather_benchmark(device: Any, dtype: Any, maxsize: int) -> List[tuple]:
    """Stands in for DeepSpeed's ``comm_profile.run_all_gather``: (size, duration) per size,
    each call measuring other durations."""
    return [(2**i, float(next(_measurements))) for i in range(maxsize)]


def test_all_gather_timings_are_replayed_without_running_the_benchmark(profile_dir: Path) -> None:
    calls: List[int] = []

    def benchmark(device: Any, dtype: Any, maxsize: int) -> List[tuple]:
        calls.append(maxsize)
        return _all_gather_benchmark(device, dtype, maxsize)

    timed = store._with_comm_store(benchmark)
    first = timed("cpu", torch.bfloat16, 4)
    assert calls == [4] and store.store_stats() == {"recorded": 1, "replayed": 0}
    store.reset_store_stats()
    assert timed("cpu", torch.bfloat16, 4) == first
    assert calls == [4] and store.store_stats() == {"recorded": 0, "replayed": 1}
    assert timed("cpu", torch.bfloat16, 5) != first[:5]  # another benchmark: measured
    assert calls == [4, 5]


def _profile_on_rank(rank: int, world_size: int, base: str) -> Dict[str, Any]:
    import os

    import deepspeed

    import ds_z3native

    deepspeed.init_distributed(dist_backend="gloo")
    ds_z3native.set_profile_store(os.path.join(base, f"rank{rank}-dir"))
    store.reset_store_stats()
    first = _profile(_graph(5))
    if rank == 1:  # rank 1 loses its store; rank 0 keeps its own
        import shutil

        shutil.rmtree(store.profile_store())
    store.reset_store_stats()
    second = _profile(_graph(6))
    (path,) = store.profile_store().iterdir()
    stored = {name: meta["device_time"] for name, meta in json.loads(path.read_text())["nodes"].items()}
    return {"first": first, "second": second, "stats": store.store_stats(), "stored": stored}


def test_ranks_replay_only_when_every_rank_has_the_profile(tmp_path: Path) -> None:
    # A rank replaying while another measures would schedule its collectives in another order.
    r0, r1 = run_ranks(_profile_on_rank, 2, str(tmp_path), timeout=180)
    # Rank 0 had the file but rank 1 had not: both measure, and both write this run's profile.
    assert r0["stats"] == r1["stats"] == {"recorded": 1, "replayed": 0}
    assert r0["second"] != r0["first"]
    assert r0["stored"] == r0["second"] and r1["stored"] == r1["second"]


def test_install_wraps_deepspeeds_profilers_and_uninstall_restores_them() -> None:
    import importlib

    import ds_z3native

    module = importlib.import_module(store.PROFILE_MODULE)
    comm = importlib.import_module(store.COMM_PROFILE_MODULE)
    benchmark = comm.run_all_gather
    profilers = (module.ProfilingInterpreter, module.MemoryProfilingInterpreter)
    before = tuple(cls.__dict__["run"] for cls in profilers)
    was_installed = ds_z3native.installed()
    ds_z3native.install()
    try:
        assert "deepcompile-profile-store" in ds_z3native.install().patches
        wrapped = tuple(cls.__dict__["run"] for cls in profilers)
        assert all(w is not b and w.__wrapped__ is b for w, b in zip(wrapped, before))
        assert comm.run_all_gather.__wrapped__ is benchmark
    finally:
        if not was_installed:
            ds_z3native.uninstall()
    if not was_installed:
        assert tuple(cls.__dict__["run"] for cls in profilers) == before
        assert comm.run_all_gather is benchmark
