"""Multi-rank gloo scenarios of the native op, run once per world size and shared by the tests.

``gloo_results(world_size)`` spawns ``world_size`` real gloo ranks (``helpers.dist.run_ranks``)
once per test process and returns, per scenario, what the ranks observed next to what
torch.distributed computed in the same ranks: spawning ranks costs seconds, so the gather,
reduce, ZeRO-1/2 and contract checks share one spawn. A scenario that raises on a rank is
reported as ``{"error": traceback}`` and the next scenario still runs.

Every value compared is computed twice: by ds_z3native and by torch.distributed
(``all_gather_into_tensor`` / ``all_reduce`` then divide) or plain arithmetic, never hard-coded.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

from helpers.native_rt import compile_config, padded_full, per_rank

__all__ = ["gloo_results", "scenario", "Z3_PARAMS", "Z12_NUMELS", "GARBAGE", "KEPT",
           "REDUCE_GROUPS"]

GRAPH = 0
GARBAGE = 555.0  # written where a correct implementation must write zeros or real values
# ds_id -> (shape, frozen, persistent), reduced in this order. Odd numels at world sizes 2 and 3,
# one param with fewer elements than ranks, one larger than the reduce bucket (BUCKET elements).
# With BUCKET = 32, 10 (7 elements) and 11 share a bucket at both world sizes: a slot of numel
# elements instead of the padded length would make 10's reduce-scatter read 11's gradient into
# the last rank's padding; 12 ends its bucket, so it would read past the filled region.
Z3_PARAMS: Dict[int, Tuple[Tuple[int, ...], bool, bool]] = {
    10: ((7,), False, False),
    11: ((3, 5), False, False),
    12: ((1,), False, False),
    13: ((2, 2), True, False),   # frozen
    14: ((5,), True, True),      # frozen, persistent
    15: ((4, 3), False, True),   # trainable, persistent
    16: ((11,), False, False),
    17: ((5, 7), False, False),  # 35 elements > BUCKET: gets a bucket of its own
}
BUCKET = 32
Z12_NUMELS = (5, 7, 4, 9)
_cache: Dict[int, Dict[str, Any]] = {}


def _full(ds_id: int, shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + ds_id))


def _grad(tag: int, ds_id: int, shape: Tuple[int, ...], rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100000 * tag + 100 * ds_id + rank)
    return torch.randn(shape, generator=g)


def _shard_with_garbage_padding(full: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    n = per_rank(full.numel(), ws)
    padded = padded_full(full, ws)
    padded[full.numel():] = GARBAGE  # whatever sits there must never reach the gathered param
    return padded[rank * n:(rank + 1) * n].clone()


def _dist_mean(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = t.detach().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _dist_gather(shard: torch.Tensor, numel: int, shape: Tuple[int, ...]) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    return out[:numel].view(shape)


def _expected_grad_shard(mean_full: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    n = per_rank(mean_full.numel(), ws)
    return padded_full(mean_full, ws)[rank * n:(rank + 1) * n]


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "<no error>"


# ------------------------------------------------------------------------------- scenarios

def _z3(rank: int, ws: int) -> Dict[str, Any]:
    """Gathers (plain, prefetched, other dtype), two windows of gradient accumulation and a
    fresh window that overwrites, persistence, frozen params: ours next to torch.distributed."""
    import torch.distributed as dist

    import ds_z3native

    m = ds_z3native.native()
    m.init(dist.new_group(backend="gloo"), compile_config(), BUCKET)
    shards, bufs, fulls = {}, {}, {}
    for ds_id, (shape, frozen, persistent) in Z3_PARAMS.items():
        fulls[ds_id] = _full(ds_id, shape)
        shards[ds_id] = _shard_with_garbage_padding(fulls[ds_id], rank, ws)
        buf = torch.Tensor() if frozen else torch.zeros(per_rank(fulls[ds_id].numel(), ws))
        m.register_z3_param(ds_id, list(shape), shards[ds_id], buf, persistent, torch.float32)
        if not frozen:
            bufs[ds_id] = buf
    m.register_graph_z3(GRAPH, list(Z3_PARAMS))
    out: Dict[str, Any] = {"gather": {}, "gather_bf16": {}, "prefetched": {}, "frozen_flags": {}}
    # A grad buffer one element short of ceil(numel / world_size) (hardening H3).
    n11 = per_rank(15, ws)
    out["small_buffer_error"] = _error(lambda: m.register_z3_param(
        99, [15], torch.zeros(n11), torch.zeros(n11 - 1), False, torch.float32))
    ph = torch.empty(0)

    m.reset_comm_stats()
    for ds_id, (shape, frozen, persistent) in Z3_PARAMS.items():
        ref = _dist_gather(shards[ds_id], fulls[ds_id].numel(), shape)
        got = torch.ops.dc.wait_allgather(torch.ops.dc.allgather_param(ph, GRAPH, ds_id),
                                          GRAPH, ds_id)
        out["gather"][ds_id] = (got.clone(), ref, fulls[ds_id])
        torch.ops.dc.release_param(got, GRAPH, ds_id, 1)
        out["frozen_flags"][ds_id] = (m.is_param_frozen(ds_id), frozen)
    out["gather_calls"] = m.comm_stats()["allgather_calls"]
    # Another dtype, through the kwarg DeepSpeed's mixed-precision graphs use.
    ref16 = _dist_gather(shards[11].to(torch.bfloat16), 15, (3, 5))
    got16 = torch.ops.dc.allgather_param(ph, GRAPH, 11, dtype=torch.bfloat16)
    out["gather_bf16"] = (got16.clone(), ref16)
    torch.ops.dc.release_param(got16, GRAPH, 11, 1)
    # Prefetch in one group, then the gathers find valid copies.
    ids = [10, 12, 16, 17]
    torch.ops.dc.prefetch_params_fused(GRAPH, [ph] * len(ids), ids)
    m.reset_comm_stats()
    for ds_id in ids:
        got = torch.ops.dc.wait_allgather(torch.ops.dc.allgather_param(ph, GRAPH, ds_id),
                                          GRAPH, ds_id)
        out["prefetched"][ds_id] = (got.clone(), fulls[ds_id])
        torch.ops.dc.release_param(got, GRAPH, ds_id, 1)
    out["gathers_after_prefetch"] = m.comm_stats()["allgather_calls"]

    # Gradients: window 1 = two micro-steps (start_backward(False), then (True)), window 2
    # overwrites. Buffers hold garbage before the first reduction: it must be overwritten.
    for buf in bufs.values():
        buf.fill_(GARBAGE)
    trainable = list(bufs)
    m.reset_comm_stats()
    expected: Dict[int, torch.Tensor] = {i: torch.zeros(0) for i in trainable}
    results: Dict[str, Dict[int, Any]] = {}
    for window, (update, tag) in enumerate([(False, 1), (True, 2), (True, 3)]):
        m.start_backward(update)
        deps = []
        for ds_id in trainable:
            g = _grad(tag, ds_id, Z3_PARAMS[ds_id][0], rank)
            deps.append(torch.ops.dc.reduce_grad(g, GRAPH, ds_id))
            mean = _expected_grad_shard(_dist_mean(g), rank, ws)
            expected[ds_id] = mean if window != 1 else expected[ds_id] + mean
        torch.ops.dc.end_backward(deps, GRAPH, True)
        results[f"window{window}"] = {i: (bufs[i].clone(), expected[i].clone()) for i in trainable}
    out["reduce"] = results
    out["reduce_stats"] = m.comm_stats()
    out["n_trainable"] = len(trainable)
    out["padding"] = {i: (per_rank(fulls[i].numel(), ws), fulls[i].numel()) for i in trainable}

    # A gradient for a frozen param: refused on every rank, no collective issued.
    m.reset_comm_stats()
    m.start_backward(True)
    out["frozen_error"] = _error(lambda: torch.ops.dc.reduce_grad(torch.ones(2, 2), GRAPH, 13))
    torch.ops.dc.end_backward([None], GRAPH, True)
    out["frozen_stats"] = m.comm_stats()

    # After an optimizer step the trainable persistent param is gathered again (new values),
    # the frozen persistent one never.
    shards[15].add_(1.0)
    fulls[15] = fulls[15] + 1.0
    m.reset_comm_stats()
    got = torch.ops.dc.allgather_param(ph, GRAPH, 15)
    out["persistent_regathered"] = (got.clone(), fulls[15], m.comm_stats()["allgather_calls"])
    got = torch.ops.dc.allgather_param(ph, GRAPH, 14)
    out["frozen_persistent"] = (got.clone(), fulls[14], m.comm_stats()["allgather_calls"])
    m.cleanup()
    return out


def _dist_reduce_scatter_mean(g: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the mean over ranks of ``g`` (zero-padded to the ZeRO-3 layout),
    by torch.distributed's reduce-scatter (``reduce_scatter_single``, torch 2.13's name for
    ``reduce_scatter_tensor``, where torch has it)."""
    import torch.distributed as dist

    ws = dist.get_world_size()
    full = padded_full(g, ws)
    out = torch.empty(full.numel() // ws, dtype=full.dtype)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    reduce_scatter(out, full)
    return out / ws


# ds_ids (of Z3_PARAMS) gather_persistent hands out together: trainable and frozen, odd sizes,
# one larger than the bucket; 14 and 15 are registered persistent, the others set so.
KEPT = [17, 13, 10, 15, 14, 11]
# reduce_grads groups of one backward: 10 twice in the first (its gradients add up); 17 fills
# more than a bucket, in the middle of the second.
REDUCE_GROUPS = [[10, 11, 12, 10], [16, 17, 15]]


def _grouped(rank: int, ws: int) -> Dict[str, Any]:
    """ds_z3native's own ops, each rank its own data: gather_persistent (before and after an
    optimizer step) next to torch.distributed's all_gather_into_tensor of the same shards,
    reduce_grads over two micro-steps next to its reduce-scatter of the same gradients,
    and the gathered state each param is left in by its last release_param."""
    import torch.distributed as dist

    import ds_z3native
    from ds_z3native.compat.deepcompile_persistent import gather_persistent_op
    from ds_z3native.compat.deepcompile_reduce_group import reduce_grads_op

    gather_persistent, reduce_grads = gather_persistent_op(), reduce_grads_op()
    m = ds_z3native.native()
    m.init(dist.new_group(backend="gloo"), compile_config(), BUCKET)
    shards, bufs, fulls = {}, {}, {}
    for ds_id, (shape, frozen, persistent) in Z3_PARAMS.items():
        fulls[ds_id] = _full(ds_id, shape) * (ds_id % 5 + 1)
        shards[ds_id] = _shard_with_garbage_padding(fulls[ds_id], rank, ws)
        buf = torch.Tensor() if frozen else torch.full((per_rank(fulls[ds_id].numel(), ws),),
                                                       GARBAGE)
        m.register_z3_param(ds_id, list(shape), shards[ds_id], buf, persistent, torch.float32)
        if not frozen:
            bufs[ds_id] = buf
    m.register_graph_z3(GRAPH, list(Z3_PARAMS))
    ph = torch.empty(0)
    out: Dict[str, Any] = {}

    # Each param gathered, used and released by its last user: what stays gathered.
    released = {}
    for ds_id, (shape, frozen, persistent) in Z3_PARAMS.items():
        got = torch.ops.dc.wait_allgather(torch.ops.dc.allgather_param(ph, GRAPH, ds_id),
                                          GRAPH, ds_id)
        torch.ops.dc.release_param(got, GRAPH, ds_id, 1)
        released[ds_id] = (m.param_state(ds_id)["gathered"], frozen, persistent)
    out["released"] = released

    def gathered(tag: str, dtypes: List[Any]) -> None:
        m.reset_comm_stats()
        got = gather_persistent(GRAPH, [ph] * len(KEPT), KEPT, dtypes)
        calls = m.comm_stats()["allgather_calls"]
        rows = {}
        for i, ds_id in enumerate(KEPT):
            dtype = dtypes[i] if dtypes and dtypes[i] is not None else torch.float32
            ref = _dist_gather(shards[ds_id].to(dtype), fulls[ds_id].numel(),
                               Z3_PARAMS[ds_id][0])
            rows[ds_id] = (got[i].clone(), ref, fulls[ds_id].to(dtype))
        out[tag] = {"values": rows, "allgather_calls": calls}

    for ds_id in KEPT:
        m.set_persistent(ds_id)
    gathered("kept", [])
    gathered("kept_again", [])
    # An optimizer step: the backward that updates ends, then the shards change in place
    # (padding included: it must stay out of the gathered values).
    m.start_backward(True)
    torch.ops.dc.end_backward([None], GRAPH, False)
    for ds_id, (shape, frozen, persistent) in Z3_PARAMS.items():
        if not frozen:
            shards[ds_id].mul_(-2.0).add_(0.25)
            fulls[ds_id] = fulls[ds_id] * -2.0 + 0.25
    gathered("after_step", [])
    gathered("after_step_bf16", [torch.bfloat16 if i % 2 else None for i in range(len(KEPT))])
    out["n_trainable_kept"] = sum(1 for i in KEPT if not Z3_PARAMS[i][1])

    # Two micro-steps of one accumulation window, every gradient through reduce_grads; the
    # expected buffers through torch.distributed's reduce-scatter of the same gradients.
    trainable = sorted(bufs)
    expected = {i: torch.zeros(per_rank(fulls[i].numel(), ws)) for i in trainable}
    m.reset_comm_stats()
    for update, tag in ((False, 31), (True, 32)):
        m.start_backward(update)
        deps = []
        for g_index, group in enumerate(REDUCE_GROUPS):
            grads = []
            for k, ds_id in enumerate(group):
                g = _grad(tag + 10 * k + 100 * g_index, ds_id, Z3_PARAMS[ds_id][0], rank)
                expected[ds_id] = expected[ds_id] + _dist_reduce_scatter_mean(g)
                grads.append(g)
            deps.append(reduce_grads(GRAPH, grads, group))
        torch.ops.ds_z3native.end_backward(deps, GRAPH, True)
    out["reduced"] = {i: (bufs[i].clone(), expected[i]) for i in trainable
                      if any(i in g for g in REDUCE_GROUPS)}
    out["reduce_stats"] = m.comm_stats()
    m.cleanup()
    return out


def _z12_layout(ws: int) -> List[List[Tuple[int, int, int]]]:
    """DeepSpeed's ZeRO-1/2 flat partitioning of Z12_NUMELS: per rank, (param index, offset in
    the param, count) of every param overlapping the rank's partition."""
    total = sum(Z12_NUMELS)
    part = per_rank(total, ws)
    layout: List[List[Tuple[int, int, int]]] = []
    for r in range(ws):
        lo, hi, start, mine = r * part, (r + 1) * part, 0, []
        for i, n in enumerate(Z12_NUMELS):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                mine.append((i, a - start, b - a))
            start += n
        layout.append(mine)
    return layout


def _z12(rank: int, ws: int) -> Dict[str, Any]:
    """ZeRO-2 (reduce every micro-step, buffers given at registration) and ZeRO-1 (local sum,
    one reduction per window, buffers handed over with update_param_grad_buffer)."""
    import torch.distributed as dist

    import ds_z3native

    m = ds_z3native.native()
    m.init(dist.new_group(backend="gloo"), compile_config(), BUCKET)
    params = [torch.nn.Parameter(torch.randn(n)) for n in Z12_NUMELS]
    mine = {i: (off, cnt) for i, off, cnt in _z12_layout(ws)[rank]}
    out: Dict[str, Any] = {}
    for stage in (2, 1):
        ids = [100 * stage + i for i in range(len(params))]
        bufs: Dict[int, torch.Tensor] = {}
        first = True
        for i, p in enumerate(params):
            if i in mine:
                off, cnt = mine[i]
                # DeepSpeed passes the offset of the first param in the partition only.
                assert off == 0 or first
                bufs[i] = torch.zeros(cnt)
                m.register_param(ids[i], p.shape, p, bufs[i] if stage == 2 else torch.empty(0),
                                 int(off))
                first = False
            else:
                m.register_param(ids[i], p.shape, p, torch.empty([0], dtype=p.dtype), 0)
        gid = 10 + stage
        (m.register_graph_z2 if stage == 2 else m.register_graph_z1)(gid, ids)
        m.reset_comm_stats()
        sums = [torch.zeros(n) for n in Z12_NUMELS]
        for update, tag in ((False, 7), (True, 8)):
            if stage == 1:  # as DeepSpeed's ZeRO-1 pre-backward hook does
                for i in mine:
                    m.update_param_grad_buffer(ids[i], bufs[i] if update else torch.empty(0),
                                               mine[i][0] if update else 0)
            m.start_backward(update)
            for i in range(len(params)):
                g = _grad(tag, i, (Z12_NUMELS[i],), rank)
                torch.ops.dc.reduce_grad(g, gid, ids[i])
                sums[i] += _dist_mean(g)
            torch.ops.dc.end_backward([None], gid)
        out[f"z{stage}"] = {i: (bufs[i].clone(), sums[i][off:off + cnt].clone())
                            for i, (off, cnt) in mine.items()}
        out[f"z{stage}_allreduces"] = m.comm_stats()["allreduce_calls"]
    m.cleanup()
    return out


def _contract(rank: int, ws: int) -> Dict[str, Any]:
    """The issue's "Done when" script: DeepSpeed's contract functions only, checked by
    arithmetic (no torch.distributed reference)."""
    import torch.distributed as dist

    import ds_z3native

    dc = ds_z3native.native()
    numel, frozen_numel = 2 * ws + 1, ws + 2  # never divisible by ws
    n = per_rank(numel, ws)
    full = torch.arange(numel, dtype=torch.float32) * 0.5 - 1.0
    shard = padded_full(full, ws)[rank * n:(rank + 1) * n].clone()
    fn = per_rank(frozen_numel, ws)
    frozen_full = torch.arange(frozen_numel, dtype=torch.float32) + 100.0
    frozen_shard = padded_full(frozen_full, ws)[rank * fn:(rank + 1) * fn].clone()
    grad_buf = torch.empty(n)

    dc.init(dist.new_group(backend="gloo"), compile_config(), 1 << 10)
    dc.register_z3_param(1, [numel], shard, grad_buf, False, torch.float32)
    dc.register_z3_param(2, [frozen_numel], frozen_shard, torch.Tensor(), False, torch.float32)
    dc.register_graph_z3(0, [1, 2])
    out: Dict[str, Any] = {}
    gathered = {}
    for ds_id in (1, 2):
        t = torch.ops.dc.allgather_param(torch.empty(0), 0, ds_id)
        t = torch.ops.dc.wait_allgather(t, 0, ds_id)
        gathered[ds_id] = t.clone()
        torch.ops.dc.release_param(t, 0, ds_id, 1)
    out["gathered"] = (gathered[1], full, gathered[2], frozen_full)

    dc.start_backward(True)
    grad = full * (rank + 1)  # mean over ranks: full * (ws + 1) / 2
    deps = [torch.ops.dc.reduce_grad(grad, 0, 1)]
    torch.ops.dc.end_backward(deps, 0, True)
    mean_full = full * (ws + 1) / 2
    out["reduced"] = (grad_buf.clone(), padded_full(mean_full, ws)[rank * n:(rank + 1) * n])

    dc.start_backward(True)
    out["frozen_error"] = _error(lambda: torch.ops.dc.reduce_grad(frozen_full, 0, 2))
    out["unknown_error"] = _error(lambda: torch.ops.dc.reduce_grad(full, 0, 4242))
    out["unknown_graph_error"] = _error(lambda: torch.ops.dc.allgather_param(torch.empty(0), 77, 1))
    torch.ops.dc.end_backward([None], 0, True)
    dc.cleanup()
    dc.cleanup()
    out["initialized_after_cleanup"] = dc.is_initialized()
    return out


SCENARIOS = {"z3": _z3, "z12": _z12, "contract": _contract, "grouped": _grouped}


def _all_scenarios(rank: int, ws: int) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = {"value": fn(rank, ws)}
        except Exception:  # noqa: BLE001 - reported per scenario to the parent
            results[name] = {"error": traceback.format_exc()}
            try:
                import ds_z3native

                ds_z3native.native().cleanup()
            except Exception:  # noqa: BLE001
                pass
    return results


def gloo_results(world_size: int) -> List[Dict[str, Any]]:
    """Per-rank scenario results at ``world_size`` gloo ranks (spawned once per process)."""
    if world_size not in _cache:
        from helpers.dist import run_ranks

        _cache[world_size] = run_ranks(_all_scenarios, world_size, timeout=240)
    return _cache[world_size]


def scenario(world_size: int, name: str) -> List[Any]:
    """One scenario's per-rank values; fails with the rank's traceback if it raised."""
    values = []
    for rank, results in enumerate(gloo_results(world_size)):
        r = results[name]
        if "error" in r:
            raise AssertionError(f"scenario {name!r} failed on rank {rank} of {world_size}:\n"
                                 f"{r['error']}")
        values.append(r["value"])
    return values
