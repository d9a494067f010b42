"""The CUDA/NCCL backend: the same gather/reduce cases through NCCL equal the CPU (gloo) results,
computed in the same process; docs/design.md's hardening row H8 (NCCL failures name the call and
the ds_id); build_info of a CUDA build.

Marked ``gpu`` (tests/conftest.py skips it without CUDA). Nothing here touches CUDA at import
time: the ranks are spawned processes (helpers.dist.run_ranks) that pick their device first.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

import pytest
import torch

from helpers.dist import run_ranks
from helpers.native_rt import compile_config, padded_full, per_rank

pytestmark = pytest.mark.gpu

GRAPH = 0
# ds_id -> (shape, frozen, persistent); odd sizes so world size 2 pads.
PARAMS: Dict[int, Tuple[Tuple[int, ...], bool, bool]] = {
    1: ((7,), False, False),
    2: ((3, 5), False, False),
    3: ((2, 2), True, False),
    4: ((5,), True, True),
    5: ((4, 3), False, True),
    6: ((9, 7), False, False),
}


def _values(tag: int, ds_id: int, shape: Tuple[int, ...], rank: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * tag + 10 * ds_id + rank))


def _run_case(m, group, device: torch.device, rank: int, ws: int) -> Dict[str, Any]:
    """Registers PARAMS on ``device``, gathers them (plain, bf16, prefetched), reduces two
    micro-steps and a fresh window; returns everything on the CPU."""
    m.init(group, compile_config(), 64)
    bufs, out = {}, {"gather": {}, "bf16": {}, "reduce": []}
    for ds_id, (shape, frozen, persistent) in PARAMS.items():
        full = _values(0, ds_id, shape, 0)
        n = per_rank(full.numel(), ws)
        shard = padded_full(full, ws)[rank * n:(rank + 1) * n].to(device)
        buf = torch.Tensor() if frozen else torch.zeros(n, device=device)
        m.register_z3_param(ds_id, list(shape), shard, buf, persistent, torch.float32)
        if not frozen:
            bufs[ds_id] = buf
    m.register_graph_z3(GRAPH, list(PARAMS))
    ph = torch.empty(0, device=device)
    for ds_id in PARAMS:
        t = torch.ops.dc.wait_allgather(torch.ops.dc.allgather_param(ph, GRAPH, ds_id), GRAPH,
                                        ds_id)
        # A copy: on the CPU .cpu() would alias the gathered buffer, which release_param frees.
        out["gather"][ds_id] = t.to("cpu", copy=True)
        torch.ops.dc.release_param(t, GRAPH, ds_id, 1)
    ids = [1, 2, 6]
    torch.ops.dc.prefetch_params_fused(GRAPH, [ph] * 3, ids, [torch.bfloat16] * 3)
    for ds_id in ids:
        t = torch.ops.dc.wait_allgather(
            torch.ops.dc.allgather_param(ph, GRAPH, ds_id, torch.bfloat16), GRAPH, ds_id)
        out["bf16"][ds_id] = t.to("cpu", copy=True)
        torch.ops.dc.release_param(t, GRAPH, ds_id, 1)
    for update, tag in ((False, 1), (True, 2), (True, 3)):
        m.start_backward(update)
        deps = [torch.ops.dc.reduce_grad(_values(tag, i, PARAMS[i][0], rank).to(device), GRAPH, i)
                for i in bufs]
        torch.ops.dc.end_backward(deps, GRAPH, True)
        out["reduce"].append({i: b.to("cpu", copy=True) for i, b in bufs.items()})
    m.start_backward(True)
    try:
        torch.ops.dc.reduce_grad(torch.ones(2, 2, device=device), GRAPH, 3)
        out["frozen_error"] = "<no error>"
    except RuntimeError as e:
        out["frozen_error"] = str(e).splitlines()[0]
    torch.ops.dc.end_backward([None], GRAPH, True)
    out["stats"] = m.comm_stats()
    out["backend"] = m.runtime_info()["collectives"]
    m.cleanup()
    return out


def _nccl_and_gloo(rank: int, ws: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    import torch.distributed as dist

    import ds_z3native

    torch.cuda.set_device(rank)
    m = ds_z3native.native()
    cpu = _run_case(m, dist.new_group(backend="gloo"), torch.device("cpu"), rank, ws)
    cuda = _run_case(m, dist.new_group(backend="nccl"), torch.device("cuda", rank), rank, ws)
    return cpu, cuda


def _unsupported_dtypes(rank: int, ws: int) -> List[Tuple[str, str]]:
    import torch.distributed as dist

    import ds_z3native

    torch.cuda.set_device(rank)
    m = ds_z3native.native()
    m.init(dist.new_group(backend="nccl"), compile_config(), 64)
    errors = []
    for ds_id, dtype in ((41, torch.bool), (42, torch.complex64)):
        m.register_z3_param(ds_id, [4 * ws], torch.zeros(4, dtype=dtype, device="cuda"), None,
                            False)
        m.register_graph_z3(ds_id, [ds_id])
        try:
            torch.ops.dc.allgather_param(torch.empty(0, device="cuda"), ds_id, ds_id)
            errors.append((str(dtype), "<no error>"))
        except RuntimeError as e:
            errors.append((str(dtype), str(e).splitlines()[0]))
    m.cleanup()
    return errors


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.parametrize("ws", [1, 2])
def test_nccl_results_equal_gloo(ws: int) -> None:
    _need_gpus(ws)
    for rank, (cpu, cuda) in enumerate(run_ranks(_nccl_and_gloo, ws, timeout=300)):
        assert cpu["backend"] == "c10d:gloo" and cuda["backend"] == "nccl"
        for ds_id, t in cpu["gather"].items():
            assert torch.equal(cuda["gather"][ds_id], t), (rank, ds_id)
            assert torch.equal(t, _values(0, ds_id, PARAMS[ds_id][0], 0)), (rank, ds_id)
        for ds_id, t in cpu["bf16"].items():
            assert cuda["bf16"][ds_id].dtype == torch.bfloat16
            assert torch.equal(cuda["bf16"][ds_id], t), (rank, ds_id)
        for window, (c, g) in enumerate(zip(cpu["reduce"], cuda["reduce"])):
            for ds_id in c:
                torch.testing.assert_close(g[ds_id], c[ds_id], msg=f"{rank} {window} {ds_id}")
        for res in (cpu, cuda):
            assert "reduce_grad" in res["frozen_error"] and "ds_id 3 " in res["frozen_error"]
        # Same collectives issued by both backends.
        for key in ("allgather_calls", "reduce_scatter_calls", "bucket_flushes"):
            assert cpu["stats"][key] == cuda["stats"][key], key


def test_h8_unsupported_dtype_names_call_and_id() -> None:
    _need_gpus(1)
    (errors,) = run_ranks(_unsupported_dtypes, 1, timeout=300)
    for (dtype, msg), ds_id in zip(errors, (41, 42)):
        assert "allgather" in msg and f"ds_id {ds_id}" in msg and "NCCL" in msg, (dtype, msg)


def test_build_info_cuda_flavour() -> None:
    import ds_z3native

    info = ds_z3native.build_info()
    assert info["flavour"] == "cuda"
    assert re.fullmatch(r"\d+\.\d+", info["cuda_version"]), info
    assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+", info["nccl_version"]), info
    assert int(info["nccl_version"].split(".")[0]) == torch.cuda.nccl.version()[0]
    assert isinstance(info["arch_list"], str)  # TORCH_CUDA_ARCH_LIST at build time, may be ""



def _reads_after_end_backward(rank: int, ws: int) -> Dict[str, Any]:
    """Backwards whose gradients come late (a long kernel before them on the compute stream):
    whether end_backward returned to the host before they existed, and what a read of the grad
    buffers queued on the compute stream right after it saw."""
    import torch.distributed as dist

    import ds_z3native

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    m = ds_z3native.native()
    m.init(dist.new_group(backend="nccl"), compile_config(), 1 << 20)
    numel = 1 << 22
    n = per_rank(numel, ws)
    bufs = {ds_id: torch.zeros(n, device=device) for ds_id in (1, 2)}
    for ds_id, buf in bufs.items():
        m.register_z3_param(ds_id, [numel], torch.zeros(n, device=device), buf, False,
                            torch.float32)
    m.register_graph_z3(GRAPH, list(bufs))
    out: Dict[str, Any] = {"returned_early": [], "reads": []}
    for step in range(4):  # the first also sets up the communicator (NCCL's is made lazily)
        m.start_backward(True)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of device time before the gradients
        grads = {i: torch.full((numel,), float(10 * step + i + rank), device=device)
                 for i in bufs}
        made = torch.cuda.Event()
        made.record()
        deps = [torch.ops.dc.reduce_grad(g, GRAPH, i) for i, g in grads.items()]
        torch.ops.dc.end_backward(deps, GRAPH, True)
        out["returned_early"].append(not made.query())
        reads = {i: b.clone() for i, b in bufs.items()}  # queued on the compute stream
        out["reads"].append({i: r.cpu() for i, r in reads.items()})
    m.cleanup()
    return out


@pytest.mark.parametrize("ws", [1, 2])
def test_end_backward_orders_the_step_after_the_reductions_without_a_host_wait(ws: int) -> None:
    """The optimizer step that follows end_backward reads the grad buffers in stream order: the
    compute stream waits for the reductions, the host does not (it goes on launching the step)."""
    _need_gpus(ws)
    for rank, out in enumerate(run_ranks(_reads_after_end_backward, ws, timeout=300)):
        assert out["returned_early"][1:] == [True] * 3, (rank, out["returned_early"])
        for step, reads in enumerate(out["reads"]):
            for ds_id, got in reads.items():
                mean = sum(10 * step + ds_id + r for r in range(ws)) / ws
                assert torch.equal(got, torch.full_like(got, mean)), (rank, step, ds_id, got)
