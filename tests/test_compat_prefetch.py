"""The ``deepcompile-prefetch-budget`` patch: DeepSpeed's own ``schedule_prefetch`` pass, run on a
DeepCompile-shaped graph (six params gathered, waited for, used and released in turn), places the
prefetches as far ahead as DeepSpeed allows without a budget, and each just before its gather with
``set_prefetch_budget(0)``.

DeepCompile plans prefetches from profiled memory and a timed all-gather, which only a CUDA run
produces (on the CPU the pass skips itself). The graph and its profile here are what DeepCompile
hands the pass, written out: no param's memory binds, and the all-gather time does not grow with
size (every fusion pays), so DeepSpeed's window holds all six gathers. The params differ in size
(1 and 2 MiB), so that a budget is met in bytes, not in a count of params: the bytes in flight
at a point of the graph are those of the params prefetched before it whose gather comes at or
after it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import pytest

from helpers.dist import run_ranks

pytestmark = pytest.mark.deepspeed

GRAPH_ID = 7
MIB = 1 << 20
PARAM_BYTES = [MIB, 2 * MIB, MIB, MIB, 2 * MIB, MIB]  # param i's gathered bytes
N_PARAMS = len(PARAM_BYTES)


def _graph() -> Any:
    import torch
    from torch.fx import Graph

    ops = torch.ops.dc
    g = Graph()
    params = [g.placeholder(f"p{i}") for i in range(N_PARAMS)]
    x = g.placeholder("x")
    for i, p in enumerate(params):
        ag = g.call_function(ops.allgather_param.default, (p, GRAPH_ID, i))
        w = g.call_function(ops.wait_allgather.default, (ag, GRAPH_ID, i))
        x = g.call_function(torch.ops.aten.add.Tensor, (x, w))
        g.call_function(ops.release_param.default, (w, GRAPH_ID, i, 1))
    g.output(x)
    return g


def _profile(graph: Any) -> SimpleNamespace:
    import torch

    nodes = list(graph.nodes)
    return SimpleNamespace(
        process_group=None, fwd_graph=graph, fwd_mem_complete=True,
        fwd_mem=[(n.name, 0, 0, 0) for n in nodes],
        fwd_time=[(n.name, 1.0, 1.0) for n in nodes],
        fwd_tensor_sizes=[(n.name, PARAM_BYTES[n.args[2]]) for n in nodes
                          if n.target is torch.ops.dc.allgather_param.default])


def _schedule(rank: int, world_size: int, install: bool, budget_mib: Optional[float]) -> Dict[str, Any]:
    """Run DeepSpeed's schedule_prefetch; for each prefetch group: its ds_ids and how many nodes
    lie between it and the gather of its first param."""
    import deepspeed
    import torch
    from torch.fx import GraphModule

    import ds_z3native

    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    # Without a JIT build of DeepSpeed's shared-memory comm op (gloo is all this needs): a build
    # waits on the extension cache's lock, which another process may hold.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    # The pass only ever runs on CUDA; DeepSpeed's CPU accelerator names its device "0", which
    # torch.device() refuses, so name the CPU device for it.
    accelerator = get_accelerator()
    accelerator.current_device = lambda: "cpu"
    ds_z3native.native()  # torch.ops.dc
    if install:
        ds_z3native.install()
    ds_z3native.set_prefetch_budget(budget_mib)
    from deepspeed.compile.passes import prefetch
    from deepspeed.compile.profilers import comm_profile

    # DeepSpeed caches its timed all-gather profile here (a CUDA measurement): size -> seconds.
    comm_profile.profile_results = [(1, 1e-3), (1 << 34, 1e-3)]
    default_window = prefetch.MAX_BUFFERED_SIZE
    graph = _graph()
    gm = GraphModule(torch.nn.Module(), graph)
    out = prefetch.schedule_prefetch(gm, GRAPH_ID, [(GRAPH_ID, False)], {GRAPH_ID: _profile(graph)},
                                     None, 0.0, None, False)
    nodes = list(out.graph.nodes)
    gathers = {n.args[2]: i for i, n in enumerate(nodes)
               if n.target is torch.ops.dc.allgather_param.default}
    groups: List[Dict[str, Any]] = []
    prefetched_at: Dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.target is torch.ops.dc.prefetch_params_fused.default:
            ids = list(n.args[2])
            groups.append({"ids": ids, "ahead": gathers[ids[0]] - i})
            prefetched_at.update({ds_id: i for ds_id in ids})
    in_flight = [sum(PARAM_BYTES[ds_id] for ds_id, at in prefetched_at.items()
                     if at < pos <= gathers[ds_id]) for pos in range(len(nodes))]
    return {"groups": groups, "window_after": prefetch.MAX_BUFFERED_SIZE,
            "default_window": default_window, "max_bytes_in_flight": max(in_flight)}


def _run(install: bool, budget_mib: Optional[float]) -> Dict[str, Any]:
    return run_ranks(_schedule, 1, install, budget_mib, env={"DS_ACCELERATOR": "cpu"},
                     timeout=240.0)[0]


def test_without_a_budget_deepspeed_prefetches_every_gather_up_front() -> None:
    r = _run(install=True, budget_mib=None)
    # One fused group of all six, placed before the first gather.
    assert [sorted(g["ids"]) for g in r["groups"]] == [list(range(N_PARAMS))]
    assert r["window_after"] == r["default_window"] == 4e9


def test_a_zero_budget_gathers_each_param_just_before_its_use() -> None:
    r = _run(install=True, budget_mib=0)
    assert [g["ids"] for g in r["groups"]] == [[i] for i in range(N_PARAMS)]
    assert all(g["ahead"] == 1 for g in r["groups"]), r["groups"]
    assert r["window_after"] == r["default_window"]  # the constant is restored after the pass


@pytest.mark.parametrize("budget_mib", [2.5, 4.5])
def test_a_budget_bounds_the_bytes_in_flight(budget_mib: float) -> None:
    # Every param is still prefetched (the window is used, not dropped), and at no point of the
    # scheduled graph do the params prefetched ahead of their gather take more than the budget.
    # DeepSpeed's pass checks its window before it adds the next gather to it, so the patch
    # gives it the budget less the graph's largest gather (with the budget itself, 2.5 MiB let
    # 4 MiB into flight).
    r = _run(install=True, budget_mib=budget_mib)
    assert sorted(i for g in r["groups"] for i in g["ids"]) == list(range(N_PARAMS))
    assert len(r["groups"]) > 1, r["groups"]
    assert 0 < r["max_bytes_in_flight"] <= budget_mib * MIB, r


def test_a_budget_under_the_largest_gather_prefetches_nothing_ahead() -> None:
    r = _run(install=True, budget_mib=max(PARAM_BYTES) / MIB - 0.5)
    assert [g["ids"] for g in r["groups"]] == [[i] for i in range(N_PARAMS)]
    assert all(g["ahead"] == 1 for g in r["groups"]), r["groups"]
    assert r["window_after"] == r["default_window"]


def test_the_budget_is_ours_deepspeed_alone_ignores_it() -> None:
    r = _run(install=False, budget_mib=0)
    assert [sorted(g["ids"]) for g in r["groups"]] == [list(range(N_PARAMS))]
    assert r["max_bytes_in_flight"] == sum(PARAM_BYTES)  # every param in flight at once


def test_bad_budgets_are_refused(clean_settings) -> None:
    import os
    import re

    import ds_z3native
    from ds_z3native.compat.deepcompile_prefetch import prefetch_budget_bytes
    from ds_z3native.settings import BUDGET_RANGE, MAX_BUDGET_MIB, PREFETCH_BUDGET_ENV, Settings

    for bad in (-1, float("nan"), "10", True, MAX_BUDGET_MIB):
        with pytest.raises(ValueError, match=re.escape(
                f"set_prefetch_budget: expected MiB in {BUDGET_RANGE} or None, got {bad!r}")):
            ds_z3native.set_prefetch_budget(bad)  # type: ignore[arg-type]
    for raw in ("lots", "-1", "nan", str(MAX_BUDGET_MIB)):
        with pytest.raises(ValueError, match=f"{PREFETCH_BUDGET_ENV}: expected MiB in .*{raw}"):
            Settings.from_env({PREFETCH_BUDGET_ENV: raw})
    assert Settings.from_env({PREFETCH_BUDGET_ENV: "1.5"}).prefetch_budget_bytes == 1572864
    assert Settings.from_env({PREFETCH_BUDGET_ENV: " "}).prefetch_budget_bytes is None
    environ = dict(os.environ)
    ds_z3native.set_prefetch_budget(1.5)
    assert prefetch_budget_bytes() == 1572864  # what the patched pass reads
    assert dict(os.environ) == environ  # kept in the settings, not in the environment
    ds_z3native.set_prefetch_budget(None)
    assert prefetch_budget_bytes() is None


def test_the_pass_reads_the_budget_at_each_call(clean_settings) -> None:
    # The patch asks the settings when DeepCompile plans, not at install: a budget set later
    # (or changed between plans) applies, and DeepSpeed's constant is restored after each call.
    from types import SimpleNamespace

    import ds_z3native
    from ds_z3native.compat.deepcompile_prefetch import _within_budget, prefetch_budget_bytes

    module = SimpleNamespace(MAX_BUFFERED_SIZE=4e9)
    seen: List[float] = []
    planned = _within_budget(lambda: seen.append(module.MAX_BUFFERED_SIZE), module,
                             prefetch_budget_bytes)
    planned()
    ds_z3native.set_prefetch_budget(2)
    planned()
    ds_z3native.set_prefetch_budget(0)
    planned()
    assert seen == [4e9, 2 * 2**20, 0] and module.MAX_BUFFERED_SIZE == 4e9
