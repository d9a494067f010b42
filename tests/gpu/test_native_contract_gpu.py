"""The native op's stream contract on CUDA, end to end and at the op level.

1. fp16 DeepCompile ZeRO-3 with dynamic loss scaling, an inf in the last gradient bucket at
   chosen steps (``helpers.contract_run``'s ``inject`` model): each such step is skipped (params
   bit-identical, DeepSpeed's skipped-step counter +1, the loss scale halved), every other step
   moves every param. A sleep queued on the compute stream before each backward makes the
   reductions land well after the host has launched ZeRO-3's overflow check (the result records
   that the host got there first). The check runs on DeepSpeed's ``reduce_and_partition_stream``;
   the ``zero3-overflow-after-reductions`` patch orders it after the current stream, which
   ``end_backward`` orders after the reductions. Without the patch the check reads the partitions
   before they are written: the inf left by an injected step is read again at the next step, which
   is skipped though its gradients are finite. The same run without the patch is part of this
   file and must fail the checks. bf16 (no loss scaling) trains on the same batches like eager
   ZeRO-3.
2. The op level: gradient partitions read on another stream after ``end_backward`` (that stream
   waiting on the compute stream) hold the reduced values.
3. DeepCompile's activation offload of a dense non-contiguous saved activation trains like eager
   ZeRO-3 in fp32, bf16 and fp16.

Each training run is its own process (``tests/helpers/contract_run.py``), all started together.

On a CUDA machine with the CUDA flavour installed and DeepSpeed 0.19.8:
    python -m pytest -m gpu tests/gpu/test_native_contract_gpu.py -q -s -rA
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
import torch

from helpers.dist import run_ranks
from helpers.native_rt import compile_config, per_rank

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

STEPS = 10  # past DeepCompile's re-plan at step 5
INJECT = (2, 3, 7)  # two in a row (the scale halves twice), one after the re-plan
SLEEP_CYCLES = 200_000_000  # about 0.1 s of device time before each backward
SEEDS = (0, 1, 2)
OFFLOAD_STEPS = 8
UNORDERED = "zero3-overflow-after-reductions"

_DC = ("--mode", "deepcompile", "--native", "ours")
_EAGER = ("--mode", "eager", "--native", "deepspeed")
_INJECT = ("--model", "inject", "--steps", str(STEPS),
           "--inject-steps", ",".join(map(str, INJECT)))
_RACE = (*_INJECT, "--dtype", "fp16", "--sleep-cycles", str(SLEEP_CYCLES))
_OFFLOAD = ("--model", "noncontig", "--steps", str(OFFLOAD_STEPS))

RUNS: Dict[str, Tuple[str, ...]] = {
    **{f"fp16-dc-seed{s}": (*_DC, *_RACE, "--seed", str(s)) for s in SEEDS},
    "fp16-dc-unordered": (*_DC, *_RACE, "--seed", "0", "--skip-patch", UNORDERED),
    "fp16-eager": (*_EAGER, *_INJECT, "--dtype", "fp16", "--seed", "0"),
    "bf16-dc": (*_DC, *_INJECT, "--dtype", "bf16", "--sleep-cycles", str(SLEEP_CYCLES)),
    "bf16-eager": (*_EAGER, *_INJECT, "--dtype", "bf16"),
    **{f"offload-{d}-dc": (*_DC, *_OFFLOAD, "--dtype", d, "--offload-activation")
       for d in ("fp32", "bf16", "fp16")},
    **{f"offload-{d}-eager": (*_EAGER, *_OFFLOAD, "--dtype", d) for d in ("fp32", "bf16", "fp16")},
}

# Bounds against eager ZeRO-3 (same batches, same initial params, same skipped steps). Losses:
# relative, per step. Params: per tensor, ||ours - eager|| over how far eager training moved it
# from the initial values (an element-wise bound near Adam's step size would pass a param that
# never trained; Adam moves an element whose gradient is rounding noise by up to lr a step, in
# either direction, so a few elements may differ by several ulps). fp32: both sides in fp32 with
# TF32 off, differing in kernel choice and fusion. bf16 / fp16: the stored params round to 2^-8
# / 2^-11 relative, DeepCompile's fused kernels rounding intermediates at other points than eager.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
PARAM_REL = {"fp32": 1e-2, "bf16": 0.25, "fp16": 0.1}


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict[str, Any]]:
    from helpers.contract_run import run_together

    return run_together(RUNS)


def _trained(result: Dict[str, Any], steps: int) -> Dict[str, Any]:
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}\n{result['log_tail']}"
    assert len(result["steps"]) == steps, result["log_tail"]
    if result["args"]["native"] == "ours":
        assert result["install"]["verdict"] == "supported", result["install"]
    return result


def _as_float64(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _assert_like_eager(compiled: Dict[str, Any], eager: Dict[str, Any], dtype: str) -> None:
    losses_c = _as_float64([s["loss"] for s in compiled["steps"]])
    losses_e = _as_float64([s["loss"] for s in eager["steps"]])
    assert torch.isfinite(losses_c).all(), losses_c
    assert compiled["params"].keys() == eager["params"].keys()
    rel: Dict[str, float] = {}
    for name, values in eager["params"].items():
        init = _as_float64(eager["init_params"][name])
        assert torch.equal(_as_float64(compiled["init_params"][name]), init), name
        c, e = _as_float64(compiled["params"][name]), _as_float64(values)
        assert torch.isfinite(c).all(), name
        moved = float((e - init).norm())
        assert moved > 0, f"{name} did not train in eager ZeRO-3"
        rel[name] = float((c - e).norm()) / moved
    worst = ((losses_c - losses_e).abs() / losses_e.abs()).max().item()
    print(f"\n[{compiled['args']['model']} {dtype}] vs eager ZeRO-3: losses within {worst:.2e} "
          f"relative; params, distance over eager's move: "
          + ", ".join(f"{n} {r:.2e}" for n, r in rel.items()))
    torch.testing.assert_close(losses_c, losses_e, rtol=LOSS_RTOL[dtype], atol=0.0)
    bad = {n: r for n, r in rel.items() if not r <= PARAM_REL[dtype]}
    assert not bad, f"params farther from eager ZeRO-3 than {PARAM_REL[dtype]} of its move: {bad}"


def _check_overflow_steps(result: Dict[str, Any]) -> None:
    """Injected steps skipped (params bit-identical, counter +1, scale halved), every other step
    applied (every param moved, scale kept)."""
    for s in result["steps"]:
        where = f"step {s['step']} ({'injected' if s['injected'] else 'finite gradients'}): {s}"
        if s["injected"]:
            assert s["skipped"] == 1, where
            assert not any(s["moved"].values()), where
            assert s["loss_scale_after"] == s["loss_scale_before"] / 2, where
        else:
            assert s["skipped"] == 0, where
            assert all(s["moved"].values()), where
            assert s["loss_scale_after"] == s["loss_scale_before"], where
    assert result["skipped_steps"] == len(INJECT)


def _check_race_setup(result: Dict[str, Any]) -> None:
    """What makes the run a test of the order: the inf sits in first.weight's partition alone
    (every other reduced gradient finite), reduced in the last of several buckets, and the host
    launched the overflow check while the compute stream was still asleep before the backward
    (so before any reduction) at the injected steps and the steps after them."""
    for s in result["steps"]:
        if s["injected"]:
            assert s["nonfinite_grads"] == ["first.weight"], s
            assert s["bucket_flushes"] >= 2, s
        else:
            assert s["nonfinite_grads"] == [], s
    racing = {i for i in INJECT} | {i + 1 for i in INJECT}
    for s in result["steps"]:
        if s["step"] in racing:
            assert s["overflow_check_before_backward_ran"] == [True], (
                f"step {s['step']}: the host did not reach the overflow check before the "
                f"backward ran ({s['overflow_check_before_backward_ran']}): the sleep no longer "
                "holds the reductions back, the run would not see the order")


@pytest.mark.parametrize("seed", SEEDS)
def test_fp16_inf_in_last_bucket_skips_exactly_those_steps(runs: Dict[str, Any],
                                                           seed: int) -> None:
    result = _trained(runs[f"fp16-dc-seed{seed}"], STEPS)
    _check_race_setup(result)
    _check_overflow_steps(result)
    scales = [s["loss_scale_after"] for s in result["steps"]]
    print(f"\n[fp16 seed {seed}] skipped {[s['step'] for s in result['steps'] if s['skipped']]}, "
          f"loss scale {scales[0]:.0f} -> {scales[-1]:.0f}")
    if seed == 0:
        # The same steps skipped and the same values as eager ZeRO-3 (DeepSpeed's own code).
        eager = _trained(runs["fp16-eager"], STEPS)
        _check_overflow_steps(eager)
        _assert_like_eager(result, eager, "fp16")


def test_fp16_check_fails_without_the_overflow_order(runs: Dict[str, Any]) -> None:
    """The control: the same run with ``zero3-overflow-after-reductions`` left out fails the
    checks above. ZeRO-3's check then reads the partitions before the step's reductions write
    them; after an injected step they still hold its inf, so the next step, whose gradients are
    finite, is skipped and its scale halved. (An injected step whose inf the early read misses is
    still skipped: DeepSpeed's gradient norm, computed on the compute stream, is inf.)"""
    result = _trained(runs["fp16-dc-unordered"], STEPS)
    _check_race_setup(result)
    with pytest.raises(AssertionError):
        _check_overflow_steps(result)
    wrong = [s["step"] for s in result["steps"] if bool(s["skipped"]) != s["injected"]]
    print(f"\n[fp16 without {UNORDERED}] steps skipped or applied wrongly: {wrong}")
    assert wrong


def test_bf16_same_batches_train_finite_like_eager_zero3(runs: Dict[str, Any]) -> None:
    result = _trained(runs["bf16-dc"], STEPS)
    eager = _trained(runs["bf16-eager"], STEPS)
    for s in result["steps"]:
        assert s["skipped"] == 0 and all(s["moved"].values()) and not s["nonfinite_grads"], s
    assert result["skipped_steps"] == 0
    _assert_like_eager(result, eager, "bf16")


# -- the op level ---------------------------------------------------------------------------

GRAPH = 0
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _value(step: int, ds_id: int, rank: int) -> float:
    # Exact in bf16 and fp16 (and their mean over two ranks).
    return 8.0 * step + ds_id + rank + 0.5


def _side_stream_reads(rank: int, ws: int, dtype_name: str) -> Dict[str, Any]:
    """Backwards whose gradients come late (a long sleep queued before them on the compute
    stream); after ``end_backward``, the grad partitions read on a side stream that waits on the
    compute stream, and read by the host."""
    import torch.distributed as dist

    import ds_z3native

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dtype = DTYPES[dtype_name]
    m = ds_z3native.native()
    m.init(dist.new_group(backend="nccl"), compile_config(), 1 << 20)
    numels = {1: 1 << 22, 2: (1 << 20) + 3, 3: 5}  # several buckets, an odd size
    bufs = {i: torch.zeros(per_rank(n, ws), dtype=dtype, device=device) for i, n in numels.items()}
    for i, n in numels.items():
        m.register_z3_param(i, [n], torch.zeros(per_rank(n, ws), dtype=dtype, device=device),
                            bufs[i], False, dtype)
    m.register_graph_z3(GRAPH, list(numels))
    side = torch.cuda.Stream(device)
    out: Dict[str, Any] = {"pending_at_end_backward": [], "side": [], "host": []}
    for step in range(4):  # the first also sets up the communicator (NCCL's is made lazily)
        m.start_backward(True)
        torch.cuda._sleep(SLEEP_CYCLES)
        grads = {i: torch.full((n,), _value(step, i, rank), dtype=dtype, device=device)
                 for i, n in numels.items()}
        made = torch.cuda.Event()
        made.record()
        deps = [torch.ops.dc.reduce_grad(g, GRAPH, i) for i, g in grads.items()]
        torch.ops.dc.end_backward(deps, GRAPH, True)
        out["pending_at_end_backward"].append(not made.query())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            reads = {i: b.clone() for i, b in bufs.items()}
        done = side.record_event()
        host = {i: b.cpu() for i, b in bufs.items()}  # synchronizes the compute stream
        done.synchronize()
        out["side"].append({i: r.cpu() for i, r in reads.items()})
        out["host"].append(host)
        del grads, reads
    m.cleanup()
    return out


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ws", [1, 2])
def test_side_stream_read_after_end_backward_sees_reduced_grads(ws: int, dtype: str) -> None:
    """The optimizer's readers on other streams (ZeRO-3's overflow check runs on
    ``reduce_and_partition_stream``) order themselves after the compute stream, not after our
    reduce-scatter stream, which they cannot see. ``end_backward`` must therefore order the
    compute stream after the last reduction before it returns (without blocking the host). The
    weak behaviour, ``end_backward`` returning with the compute stream not ordered after the
    reduce-scatter stream, lets a side-stream read (and a host read, which synchronizes only the
    compute stream) see the previous step's partitions, or zeros."""
    _need_gpus(ws)
    for rank, out in enumerate(run_ranks(_side_stream_reads, ws, dtype, timeout=300)):
        # The premise: end_backward returned while the gradients were not even made yet.
        assert out["pending_at_end_backward"][1:] == [True] * 3, (rank, out)
        for step in range(4):
            for ds_id in out["side"][step]:
                mean = sum(_value(step, ds_id, r) for r in range(ws)) / ws
                for where in ("side", "host"):
                    got = out[where][step][ds_id]
                    assert got.dtype == DTYPES[dtype]
                    bad = (got != mean).nonzero()
                    assert bad.numel() == 0, (
                        f"{where} read, rank {rank}, step {step}, ds_id {ds_id}: {bad.numel()} of "
                        f"{got.numel()} elements differ from {mean}, e.g. "
                        f"{got.flatten()[bad[:4, 0]].tolist()}")


# -- activation offload -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_activation_offload_of_noncontiguous_activation_trains_like_eager(
        runs: Dict[str, Any], dtype: str) -> None:
    """DeepCompile's activation offload (``compile.offload_activation``, every eligible saved
    activation kept on the host past the re-plan) moves what ``bmm`` saves of a permuted clone,
    a dense non-contiguous tensor, through ds_z3native's offload ops (host copy contiguous,
    reloaded contiguous), and the run matches eager ZeRO-3."""
    result = _trained(runs[f"offload-{dtype}-dc"], OFFLOAD_STEPS)
    eager = _trained(runs[f"offload-{dtype}-eager"], OFFLOAD_STEPS)
    offload = result["offload"]
    noncontiguous = [a for a in offload["selected"] if not a["contiguous"]]
    assert noncontiguous, f"no non-contiguous activation offloaded: {offload['selected']}"
    counts = offload["counts"]
    assert counts["reload_nodes"] >= 1 and counts["planned_offloads"] >= 1, counts
    assert result["skipped_steps"] == 0 and eager["skipped_steps"] == 0
    print(f"\n[offload {dtype}] {counts}; non-contiguous: "
          f"{[(a['shape'], a['stride']) for a in noncontiguous]}")
    _assert_like_eager(result, eager, dtype)
