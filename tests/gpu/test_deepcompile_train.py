"""DeepCompile ZeRO-3 training with frozen params on one GPU (and on two where the host has them),
with ds_z3native installed.

Each training run is its own process (``bench/deepcompile_run.py``): dynamo caches, the
DeepCompile handle, DeepSpeed's hooks and the native runtime are process-wide. The correctness
runs are started together (one GPU holds them all easily; the compiles are CPU-bound and
overlap); the timing runs go alone, each with fresh inductor and extension caches.

On a CUDA machine, for each DeepSpeed version:
    python -m pytest -m gpu tests/gpu/test_deepcompile_train.py -q -s
    PYTHONPATH=.cache/ds-0.19.2 python -m pytest -m gpu tests/gpu/test_deepcompile_train.py -q -s
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
from packaging.version import Version

from helpers.dc_runner import run_alone, run_together

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

STEPS = 10  # past DeepCompile's 5 warm-up steps, so prefetch and selective gather run

_DC = ("--mode", "deepcompile", "--native", "ours")
_EAGER = ("--mode", "eager", "--native", "deepspeed")
# name -> runner arguments
RUNS: Dict[str, Tuple[str, ...]] = {
    "frozen-linear-fp32-dc": (*_DC, "--model", "frozen-linear", "--dtype", "fp32"),
    "frozen-linear-fp32-eager": (*_EAGER, "--model", "frozen-linear", "--dtype", "fp32"),
    "frozen-linear-bf16-dc": (*_DC, "--model", "frozen-linear", "--dtype", "bf16"),
    "frozen-linear-bf16-eager": (*_EAGER, "--model", "frozen-linear", "--dtype", "bf16"),
    "reuse3-fp32-dc": (*_DC, "--model", "reuse3", "--dtype", "fp32"),
    "reuse3-fp32-eager": (*_EAGER, "--model", "reuse3", "--dtype", "fp32"),
    # Inductor's CUDA graphs, graph_partition at torch's default (on in torch 2.11: the graphs are
    # split at the dc ops, which are cudagraph_unsafe; where off, a graph with one is skipped)
    # and graph_partition on.
    "frozen-linear-fp32-dc-cudagraphs": (*_DC, "--model", "frozen-linear", "--dtype", "fp32",
                                         "--inductor", "triton.cudagraphs=True"),
    "frozen-linear-fp32-dc-partitions": (*_DC, "--model", "frozen-linear", "--dtype", "fp32",
                                         "--inductor", "triton.cudagraphs=True",
                                         "--inductor", "graph_partition=True"),
    "frozen-linear-unfreeze-dc": (*_DC, "--model", "frozen-linear", "--dtype", "fp32",
                                  "--unfreeze-after", "2"),
}


# World size 2 (torchrun, one GPU per rank, NCCL): each rank trains on batches of its own, and the
# ZeRO-0 eager run on the same two ranks is the reference (a reduction that skipped its
# collective would leave each rank its own gradient). Each param is sharded across the two ranks
# (odd sizes padded), gathered and reduce-scattered by NCCL.
RUNS_WS2: Dict[str, Tuple[str, ...]] = {
    "frozen-linear-fp32-dc-ws2": RUNS["frozen-linear-fp32-dc"],
    "frozen-linear-fp32-eager-ws2": RUNS["frozen-linear-fp32-eager"],
    "reuse3-fp32-dc-ws2": RUNS["reuse3-fp32-dc"],
    "reuse3-fp32-eager-ws2": RUNS["reuse3-fp32-eager"],
}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict[str, Any]]:
    everything = {name: (args, STEPS) for name, args in RUNS.items()}
    if _gpus() >= 2:
        everything.update({name: (args, STEPS) for name, args in RUNS_WS2.items()})
    return run_together(everything, nprocs={name: 2 for name in RUNS_WS2})


def _trained(result: Dict[str, Any]) -> Dict[str, Any]:
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}\n{result['log_tail']}"
    assert len(result["losses"]) == STEPS
    return result


def _deepspeed_version() -> Version:
    import deepspeed

    return Version(deepspeed.__version__.split("+")[0])


def _assert_matches(compiled: Dict[str, Any], eager: Dict[str, Any], rtol: float, atol: float) -> None:
    import torch

    losses_c = torch.tensor(compiled["losses"], dtype=torch.float64)
    losses_e = torch.tensor(eager["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses_c, losses_e, rtol=rtol, atol=atol)
    assert compiled["params"].keys() == eager["params"].keys()
    for name in eager["params"]:
        c = torch.tensor(compiled["params"][name], dtype=torch.float64)
        e = torch.tensor(eager["params"][name], dtype=torch.float64)
        torch.testing.assert_close(c, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _check_training(runs: Dict[str, Dict[str, Any]], key: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    compiled, eager = _trained(runs[f"{key}-dc"]), _trained(runs[f"{key}-eager"])
    assert compiled["install"]["verdict"] == "supported"
    # requires_grad as built: the frozen layer stayed frozen.
    for name, requires_grad in compiled["requires_grad"].items():
        assert requires_grad == (not name.startswith("frozen.")), name
    diffs: List[float] = [abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])]
    print(f"\n[{key}] DeepSpeed {compiled['deepspeed']}: max relative loss difference vs ZeRO-0 "
          f"eager {max(diffs):.2e}; losses {compiled['losses'][0]:.5f} -> {compiled['losses'][-1]:.5f}")
    return compiled, eager


# fp32: both sides run the same math in fp32 (TF32 off), differing only in kernel choice and
# fusion (inductor vs eager ATen); 1e-5 relative is the bound, with an absolute floor of
# 1e-6 for parameters that pass near zero (a relative bound is meaningless there).
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# bf16: the parameters are stored in bf16 (8 significant bits, one ulp = 2^-8 = 3.9e-3 relative).
# DeepCompile's fused kernels round intermediates at other points than eager ATen kernels, so
# one-ulp differences are expected per step, and a weight rounded differently once stays a few
# ulps apart over 10 AdamW steps (lr 1e-3 moves a weight by about one bf16 ulp per step).
# 2e-2 relative is ~5 ulps; the absolute floor 2e-3 is one ulp at 0.5.
BF16_RTOL, BF16_ATOL = 2e-2, 2e-3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_minimal_repro_trains_under_deepcompile_and_matches_eager(runs: Dict[str, Any],
                                                                  dtype: str) -> None:
    compiled, eager = _check_training(runs, f"frozen-linear-{dtype}")
    rtol, atol = (FP32_RTOL, FP32_ATOL) if dtype == "fp32" else (BF16_RTOL, BF16_ATOL)
    _assert_matches(compiled, eager, rtol, atol)


def test_frozen_layer_used_three_times_matches_eager(runs: Dict[str, Any]) -> None:
    compiled, eager = _check_training(runs, "reuse3-fp32")
    _assert_matches(compiled, eager, FP32_RTOL, FP32_ATOL)


@pytest.mark.parametrize("setting", ["cudagraphs", "partitions"])
def test_inductor_cuda_graphs_never_record_a_dc_op(runs: Dict[str, Any], setting: str) -> None:
    """With inductor's CUDA graphs on, training still matches eager: a recorded dc op would
    replay its device work without its host side (the registry's gathered state, the reducer's
    buckets), so the gradients or the gathers would go wrong. The dc ops are tagged
    cudagraph_unsafe: inductor skips a graph that calls one, or records only what lies between
    the calls (graph_partition)."""
    compiled = _trained(runs[f"frozen-linear-fp32-dc-{setting}"])
    assert compiled["inductor"]["triton.cudagraphs"] is True
    # Inductor took the CUDA-graph path: it skipped graphs (a dc op in them) or split them at
    # the dc ops (graph_partition, on by default in newer torch).
    counts = compiled["cudagraphs"]
    assert counts.get("cudagraph_skips", 0) + counts.get("cudagraph_partitions", 0) >= 1, counts
    _assert_matches(compiled, _trained(runs["frozen-linear-fp32-eager"]), FP32_RTOL, FP32_ATOL)
    print(f"\n[{setting}] inductor's counters {counts}")


def test_deepcompiles_passes_run_with_the_heap_frozen(runs: Dict[str, Any]) -> None:
    """The deepcompile-pass-gc patch took effect on the GPU: every run of DeepCompile's passes
    (a forward and a backward graph at the first compile, again at the re-plan) ran frozen,
    whatever the process had frozen before (``thawed`` counts those runs)."""
    stats = _trained(runs["frozen-linear-fp32-dc"])["pass_gc"]
    assert stats["frozen"] >= 2, stats
    print(f"\n[pass-gc] {stats}")


@pytest.mark.parametrize("key", ["frozen-linear-fp32", "reuse3-fp32"])
def test_two_gpus_train_under_deepcompile_like_zero0_eager(runs: Dict[str, Any], key: str) -> None:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    compiled, eager = _trained(runs[f"{key}-dc-ws2"]), _trained(runs[f"{key}-eager-ws2"])
    assert compiled["world_size"] == eager["world_size"] == 2
    assert compiled["install"]["verdict"] == "supported"
    (rank1,) = compiled["other_ranks"]
    (eager1,) = eager["other_ranks"]
    assert rank1["rank"] == eager1["rank"] == 1 and "error" not in rank1, rank1.get("error")
    assert "error" not in eager1, eager1.get("error")
    # Each rank its own batches: its own losses, the same params once gathered; each rank as
    # the same rank of ZeRO-0.
    assert rank1["losses"] != compiled["losses"]
    assert rank1["params"] == compiled["params"]
    _assert_matches(compiled, eager, FP32_RTOL, FP32_ATOL)
    _assert_matches(rank1, eager1, FP32_RTOL, FP32_ATOL)
    diffs = [abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])]
    print(f"\n[{key} ws2] DeepSpeed {compiled['deepspeed']}: max relative loss difference vs ZeRO-0 "
          f"eager on the same two GPUs {max(diffs):.2e}")


def test_param_unfrozen_after_compile_raises_our_error(runs: Dict[str, Any]) -> None:
    # Frozen at engine.compile(), made trainable before step 2: the step-2 backward must raise
    # (UnfrozenAfterCompile, naming the params), not train on without their gradients. Without
    # that guard, dynamo keeps the compiled graphs (no recompile on a requires_grad change) and
    # the native layer refused the first gradient only at step 5 (seen on 0.19.2 and 0.19.8).
    r = runs["frozen-linear-unfreeze-dc"]
    assert r.get("unfrozen_at_step") == 2, r.get("error", r["log_tail"])
    detail = f"losses {r['losses']}; error {r.get('error')}\n{r['log_tail']}"
    assert "error" in r, f"training went on after unfreezing: {detail}"
    assert len(r["losses"]) == 2, detail
    assert r["error_type"] == "UnfrozenAfterCompile", detail
    assert "frozen.weight (ds_id" in r["error"] and "had requires_grad=False at engine.compile()" in r["error"], detail


def test_report_compile_to_first_step_time() -> None:
    # Alone, with fresh inductor and extension caches: what a user's first run costs.
    r = _trained(run_alone("timing-ours", RUNS["frozen-linear-fp32-dc"], STEPS, fresh_caches=True))
    print(f"\n[ds_z3native] DeepSpeed {r['deepspeed']}: engine.compile() to the end of the first "
          f"step with ds_z3native's op (fresh caches): {r['compile_to_first_step_end_s']:.2f} s; "
          f"steady step {r['step_ms_after_warmup']:.2f} ms")
    assert r["compile_to_first_step_end_s"] > 0


@pytest.mark.slow
def test_deepspeed_own_op_without_install() -> None:
    # DeepSpeed's own path: its op JIT-built into a fresh extension cache, no install().
    # 0.19.0 - 0.19.5 fail the minimal reproduction with KeyError at engine.compile(); later ones train.
    args = ("--mode", "deepcompile", "--native", "deepspeed", "--model", "frozen-linear",
            "--dtype", "fp32")
    r = run_alone("timing-deepspeed", args, STEPS, fresh_caches=True)
    if _deepspeed_version() < Version("0.19.6"):
        assert r.get("error_type") == "KeyError", r.get("error", r["log_tail"])
        print(f"\n[deepspeed] DeepSpeed {r['deepspeed']} without ds_z3native: {r['error']}")
    else:
        _trained(r)
        print(f"\n[deepspeed] DeepSpeed {r['deepspeed']}: engine.compile() to the end of the first "
              f"step with DeepSpeed's JIT-built op (fresh caches): {r['compile_to_first_step_end_s']:.2f} s; "
              f"steady step {r['step_ms_after_warmup']:.2f} ms")
