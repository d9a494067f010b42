"""The ``deepcompile-pass-gc`` and ``deepcompile-one-rank-profile`` patches, on DeepSpeed's own
``run_opt_passes`` and on real gloo process groups.

* The passes run with what was alive at their start frozen: DeepSpeed's collections between
  passes still free the cycles a pass made (a tensor in one is gone by the next pass), nothing
  stays frozen after the passes (also when one raises), and objects frozen before the passes
  are frozen through them and unfrozen after.
* DeepCompile's profiling module reduces over a group of one rank without a collective (the
  tensor is the result already) and over two ranks as before: values, group given by position or
  name, a one-rank subgroup of a two-rank world, an asynchronous call, the barrier.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Dict, List

import pytest
import torch

from ds_z3native.compat import deepcompile_profiling as profiling
from ds_z3native.compat.registry import all_patches
from helpers.dist import run_ranks

pytestmark = pytest.mark.deepspeed


def test_both_patches_are_registered_for_every_supported_release() -> None:
    by_name = {p.name: p for p in all_patches()}
    assert by_name["deepcompile-pass-gc"].wraps == ("deepspeed.compile.backend:run_opt_passes",)
    assert "deepspeed.compile.profilers.graph_profile:dist" in \
        by_name["deepcompile-one-rank-profile"].wraps
    for name in ("deepcompile-pass-gc", "deepcompile-one-rank-profile"):
        assert str(by_name[name].first) == "0.19.0" and by_name[name].last is None


# ---- deepcompile-pass-gc ------------------------------------------------------------------------

class _Cycle:
    """An object in a reference cycle, holding a tensor: freed by a collection only."""

    def __init__(self) -> None:
        self.me = self
        self.tensor = torch.ones(1024)


def _run_passes(passes: List[Callable[..., Any]]) -> None:
    """DeepSpeed's ``run_opt_passes`` over ``passes`` (each returns None: no graph change, so no
    memory profile runs), as DeepCompile's backend calls it."""
    from deepspeed.compile import backend

    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    backend.run_opt_passes(passes, graph, 0, [(0, True)], {}, lambda: (), 0.0, None, False)


def _passes_seeing(seen: Dict[str, Any]) -> List[Callable[..., Any]]:
    def make_garbage(*_: Any) -> None:
        seen["freeze_count"] = gc.get_freeze_count()
        seen["cycle"] = weakref.ref(_Cycle())  # garbage the moment this pass returns

    def look(*_: Any) -> None:
        seen["cycle_alive_at_next_pass"] = seen["cycle"]() is not None

    return [make_garbage, look]


_OLDER: List[Any] = []  # a cycle made before the passes, dropped during them


def _passes_dropping_an_older_cycle(seen: Dict[str, Any]) -> List[Callable[..., Any]]:
    _OLDER.append(_Cycle())
    seen["older"] = weakref.ref(_OLDER[0])

    def drop(*_: Any) -> None:
        _OLDER.clear()

    def look(*_: Any) -> None:
        seen["older_alive_at_next_pass"] = seen["older"]() is not None

    return [drop, look]


def _frozen_passes_on_a_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """DeepSpeed's passes on a rank of its own, before and with the patch: what a pass saw, and
    what stayed frozen after the passes."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.compile import backend  # noqa: F401  (imported: the patch wraps it at once)

    out: Dict[str, Any] = {}
    seen: Dict[str, Any] = {}
    _run_passes(_passes_seeing(seen))
    out["unpatched"] = dict(seen, cycle=None, after=gc.get_freeze_count())
    seen = {}
    _run_passes(_passes_dropping_an_older_cycle(seen))
    out["unpatched_older_alive_at_next_pass"] = seen["older_alive_at_next_pass"]
    undo = profiling.patch_pass_gc()
    try:
        seen = {}
        _run_passes(_passes_seeing(seen))
        out["patched"] = dict(seen, cycle=None, after=gc.get_freeze_count())
        seen = {}
        _run_passes(_passes_dropping_an_older_cycle(seen))
        out["older_alive_at_next_pass"] = seen["older_alive_at_next_pass"]
        gc.collect()
        out["older_alive_after"] = seen["older"]() is not None

        def nested(*_: Any) -> None:
            _run_passes([lambda *_: None])
            out["frozen_after_nested_passes"] = gc.get_freeze_count()

        _run_passes([nested])
        out["after_nested"] = gc.get_freeze_count()

        def fail(*_: Any) -> None:
            out["frozen_in_failing_pass"] = gc.get_freeze_count()
            raise RuntimeError("pass failed")

        try:
            _run_passes([fail])
        except RuntimeError as e:
            out["raised"] = str(e)
        out["after_failure"] = gc.get_freeze_count()

        gc.collect()
        gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            seen = {}
            _run_passes(_passes_seeing(seen))
            out["callers"] = dict(seen, cycle=None, frozen=frozen, after=gc.get_freeze_count())
        finally:
            gc.unfreeze()
        out["stats"] = profiling.pass_gc_stats()
    finally:
        undo()
    return out


@pytest.fixture(scope="module")
def passes() -> Dict[str, Any]:
    (out,) = run_ranks(_frozen_passes_on_a_rank, 1, timeout=240)
    return out


def test_without_the_patch_the_passes_run_unfrozen(passes: Dict[str, Any]) -> None:
    """What the tests below tell apart: DeepSpeed's own passes run with nothing frozen."""
    assert passes["unpatched"]["freeze_count"] == 0
    assert not passes["unpatched"]["cycle_alive_at_next_pass"]


def test_the_passes_run_frozen_and_their_own_cycles_are_still_freed(
        passes: Dict[str, Any]) -> None:
    seen = passes["patched"]
    assert seen["freeze_count"] > 1000  # the process's objects, frozen for the passes
    assert not seen["cycle_alive_at_next_pass"]  # DeepSpeed's collection after the pass freed it
    assert seen["after"] == 0


def test_a_cycle_older_than_the_passes_that_dies_in_them_is_freed_after_them(
        passes: Dict[str, Any]) -> None:
    """The one thing the freeze delays: DeepSpeed frees it between two passes, the patch at the
    first collection after the passes."""
    assert not passes["unpatched_older_alive_at_next_pass"]
    assert passes["older_alive_at_next_pass"] and not passes["older_alive_after"]


def test_passes_run_inside_passes_leave_the_outer_ones_frozen(passes: Dict[str, Any]) -> None:
    assert passes["frozen_after_nested_passes"] > 1000 and passes["after_nested"] == 0


def test_a_failing_pass_leaves_nothing_frozen(passes: Dict[str, Any]) -> None:
    assert passes["frozen_in_failing_pass"] > 1000 and passes["raised"] == "pass failed"
    assert passes["after_failure"] == 0


def test_a_callers_frozen_objects_are_frozen_through_the_passes_and_collectable_after(
        passes: Dict[str, Any]) -> None:
    seen = passes["callers"]
    assert seen["frozen"] > 1000
    assert seen["freeze_count"] >= seen["frozen"] - 100  # theirs and ours frozen in the passes
    assert not seen["cycle_alive_at_next_pass"]
    assert seen["after"] == 0  # unfrozen with ours: collectable again, as before their freeze
    # Five runs of the passes froze (a nested run froze nothing more); the last found objects
    # frozen before it.
    assert passes["stats"] == {"frozen": 5, "thawed": 1}


# ---- deepcompile-one-rank-profile --------------------------------------------------------------

def _reductions_on_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """On each rank: DeepSpeed's comm initialised over the gloo group, the patch applied, and the
    profiling module's ``dist`` used the ways DeepCompile's profilers use it, counting the
    reductions and barriers that reach torch.distributed."""
    import deepspeed
    import torch.distributed as tdist

    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.compile.profilers import graph_profile

    calls = {"all_reduce": 0, "barrier": 0}
    originals = {name: getattr(tdist, name) for name in calls}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    waits = [0]
    synchronize = accelerator.synchronize

    def counting_wait(*args: Any, **kwargs: Any) -> Any:
        waits[0] += 1
        return synchronize(*args, **kwargs)

    undo = profiling.patch_one_rank_profile()
    for name in calls:
        setattr(tdist, name, counting(name))
    accelerator.synchronize = counting_wait  # type: ignore[method-assign]
    try:
        dist = graph_profile.dist
        assert isinstance(dist, profiling.OneRankComm)
        out: Dict[str, Any] = {}
        world = torch.tensor([float(rank + 1)])
        dist.all_reduce(world, dist.ReduceOp.MAX)
        out["max"] = world.item()
        average = torch.tensor([float(rank + 1)])
        dist.all_reduce(average, dist.ReduceOp.AVG, group=None)
        out["avg"] = average.item()
        dist.barrier()
        out["world_calls"] = dict(calls)
        out["world_waits"] = waits[0]
        # Each rank alone in a subgroup: its reductions are its own values.
        groups = [tdist.new_group([r]) for r in range(world_size)]
        before = dict(calls)
        alone = torch.tensor([float(rank + 1)])
        dist.all_reduce(alone, dist.ReduceOp.SUM, groups[rank])  # the group by position
        dist.all_reduce(alone, op=dist.ReduceOp.SUM, group=groups[rank])
        dist.barrier(group=groups[rank])
        out["alone"] = alone.item()
        out["subgroup_calls"] = {k: calls[k] - before[k] for k in calls}
        out["subgroup_waits"] = waits[0] - out["world_waits"]
        # An asynchronous call is DeepSpeed's own, with its handle.
        handle = dist.all_reduce(torch.ones(1), dist.ReduceOp.SUM, groups[rank], True)
        handle.wait()
        out["async_calls"] = calls["all_reduce"] - before["all_reduce"]
        out["world_size"] = dist.get_world_size()  # anything else passes through
    finally:
        del accelerator.synchronize
        for name, original in originals.items():
            setattr(tdist, name, original)
        undo()
    out["restored"] = not isinstance(graph_profile.dist, profiling.OneRankComm)
    return out


def test_one_rank_reduces_without_a_collective() -> None:
    (out,) = run_ranks(_reductions_on_ranks, 1, timeout=240)
    assert out["max"] == 1.0 and out["avg"] == 1.0 and out["alone"] == 1.0
    assert out["world_calls"] == {"all_reduce": 0, "barrier": 0}
    assert out["subgroup_calls"] == {"all_reduce": 0, "barrier": 0}
    # Each barrier skipped still waits for the device, as a barrier on one rank does.
    assert out["world_waits"] == 1 and out["subgroup_waits"] == 1
    assert out["async_calls"] == 1 and out["world_size"] == 1 and out["restored"]


def test_two_ranks_reduce_as_before_and_a_one_rank_subgroup_does_not() -> None:
    outs = run_ranks(_reductions_on_ranks, 2, timeout=240)
    for rank, out in enumerate(outs):
        assert out["max"] == 2.0 and out["avg"] == 1.5
        assert out["world_calls"]["all_reduce"] == 2 and out["world_calls"]["barrier"] == 1
        assert out["alone"] == float(rank + 1)
        assert out["subgroup_calls"] == {"all_reduce": 0, "barrier": 0}
        assert out["world_waits"] == 0 and out["subgroup_waits"] == 1  # gloo's own barrier
        assert out["async_calls"] == 1 and out["world_size"] == 2 and out["restored"]
