"""A short end-to-end check of the native layer: N gloo ranks (processes) drive the dc op the way
DeepSpeed's compiled graph does — gather params of odd sizes, reduce gradients to the mean, and
refuse a gradient for a frozen param with an error naming it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List

from .launch import RanksFailed, run_ranks

__all__ = ["Check", "run_selftest"]

log = logging.getLogger(__name__)

# (ds_id, shape, frozen): odd sizes so every shard but the first carries padding at world size 2 and 3.
_PARAMS = [(0, (5, 3), False), (1, (7,), False), (2, (4, 4), True), (3, (1,), False)]


@dataclass
class Check:
    """One verdict line of the self-test."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class _RankResult:
    checks: List[Check] = field(default_factory=list)


def _rank(rank: int, world: int) -> _RankResult:
    """One rank's checks; an exception ends them with a failed check naming it."""
    import torch
    import torch.distributed as dist

    from . import native

    res = _RankResult()

    def check(name: str, ok: bool, detail: str = "") -> None:
        res.checks.append(Check(name, bool(ok), detail))

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dc = native()
        config = SimpleNamespace(double_buffer=True, free_activation_threshold=0)
        dc.init(dist.group.WORLD, config, 32)
        gen = torch.Generator().manual_seed(1234)
        full: Dict[int, torch.Tensor] = {}
        buffers: Dict[int, torch.Tensor] = {}
        for ds_id, shape, frozen in _PARAMS:
            t = torch.randn(shape, generator=gen)
            full[ds_id] = t
            per = -(-t.numel() // world)
            padded = torch.cat([t.flatten(), t.new_zeros(per * world - t.numel())])
            buffers[ds_id] = torch.empty(0 if frozen else per)
            dc.register_z3_param(ds_id, list(shape), padded[rank * per:(rank + 1) * per].clone(),
                                 buffers[ds_id], False, torch.float32)
        dc.register_graph_z3(0, [p[0] for p in _PARAMS])
        check("frozen flag from an empty grad buffer", dc.is_param_frozen(2) and not dc.is_param_frozen(0))

        exact = True
        for ds_id, _, _ in _PARAMS:
            gathered = torch.ops.dc.allgather_param(torch.empty(0), 0, ds_id)
            torch.ops.dc.wait_allgather(gathered, 0, ds_id)
            exact &= torch.equal(gathered, full[ds_id])
            torch.ops.dc.release_param(gathered, 0, ds_id, 1)
        check("allgather returns every param exactly", exact)

        dc.start_backward(True)
        for ds_id, shape, frozen in _PARAMS:
            if not frozen:
                torch.ops.dc.reduce_grad(torch.full(shape, float(rank + 1)), 0, ds_id)
        torch.ops.dc.end_backward(None, 0, True)
        mean = (world + 1) / 2
        good = True
        for ds_id, shape, frozen in _PARAMS:
            if frozen:
                continue
            n = full[ds_id].numel()
            per = -(-n // world)
            valid = max(0, min(per, n - rank * per))
            good &= bool(torch.all(buffers[ds_id][:valid] == mean))
            good &= bool(torch.all(buffers[ds_id][valid:] == 0))
        check(f"reduce_grad averages over {world} ranks (padding stays zero)", good)

        before = dc.comm_stats()["reduce_scatter_calls"]
        try:
            torch.ops.dc.reduce_grad(torch.ones(4, 4), 0, 2)
            check("a gradient for a frozen param is refused", False, "no error raised")
        except RuntimeError as e:
            named = "ds_id 2" in str(e)
            issued = dc.comm_stats()["reduce_scatter_calls"] - before
            check("a gradient for a frozen param is refused", named and issued == 0,
                  str(e).splitlines()[0][:120])
        try:
            torch.ops.dc.allgather_param(torch.empty(0), 0, 999)
            check("an unknown ds_id is refused", False, "no error raised")
        except RuntimeError as e:
            check("an unknown ds_id is refused", "999" in str(e), str(e).splitlines()[0][:120])
        dc.cleanup()
        dc.cleanup()
        check("cleanup twice", not dc.is_initialized())
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        res.checks.append(Check("rank ran to the end", False, f"{type(e).__name__}: {e}"))
    return res


def run_selftest(world_size: int = 2, timeout: float = 120.0) -> List[Check]:
    """Run the self-test on ``world_size`` gloo ranks; returns rank 0's checks plus agreement."""
    start = time.monotonic()
    try:
        results = run_ranks(_rank, world_size, timeout=timeout, name="ds-z3native-selftest-rank")
    except RanksFailed as e:
        return [Check("ranks finished", False, e.first.summary)]
    checks = list(results[0].checks)
    agree = all([(c.name, c.ok) for c in r.checks] == [(c.name, c.ok) for c in checks] for r in results)
    checks.append(Check(f"all {world_size} ranks agree", agree))
    log.info("self-test took %.1f s", time.monotonic() - start)
    return checks
