"""The eager minimal reproduction on one GPU over NCCL: a frozen LayerNorm feeding a trainable Linear,
two blocks under non-reentrant torch.utils.checkpoint, D=1024, ZeRO-3, 3 steps (fp32); and the
recompute holds released however backward is entered, in fp16 (a GPU-only mode of DeepSpeed).

DeepSpeed alone fails before 0.19.3 (CheckpointError: a frozen [1024] norm weight recomputed as
[0]); with ``ds_z3native.install()`` every version trains like plain PyTorch, and no
non-persistent param stays gathered after a backward.

On a CUDA machine, for each DeepSpeed version:
    python -m pytest -m gpu tests/gpu/test_eager_recompute_gpu.py -q
    PYTHONPATH=.cache/ds-0.19.2 python -m pytest -m gpu tests/gpu/test_eager_recompute_gpu.py -q
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from packaging.version import Version

from helpers.dist import run_ranks
from helpers.param_bounds import assert_trained_alike
from helpers.zero import assert_unpatched_outcome, train_and_collect
from test_eager_recompute import (NORM_LINEAR, SCALE_BACKWARD_BF16, SCALE_BACKWARD_FP16,
                                  TORCH_BACKWARD_GAS2, _assert_group, _batches, _engine,
                                  _zero_state_violations, run_group)

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

deepspeed = pytest.importorskip("deepspeed")
UPSTREAM_FIX = Version(deepspeed.__version__.split("+")[0]) >= Version("0.19.3")


def _train(device: torch.device, rank: int, world_size: int) -> Dict[str, Any]:
    from deepspeed.runtime.zero import parameter_offload

    model, engine, reference = _engine(NORM_LINEAR, rank, world_size)
    stack_len = len(parameter_offload.FWD_MODULE_STACK)
    out: Dict[str, Any] = {"losses": [], "violations": []}

    def train() -> None:
        for step_batches in _batches(NORM_LINEAR, world_size):
            loss = engine(step_batches[0][rank].to(device))
            engine.backward(loss)
            out["violations"] += _zero_state_violations(model, stack_len)
            engine.step()
            out["losses"].append(loss.item())

    return train_and_collect(engine, model, reference, out, train)


def norm_linear_on_device(rank: int, world_size: int, device_type: str, backend: str) -> Dict[str, Any]:
    """DeepSpeed alone, then with ds_z3native.install(), on ``device_type`` over ``backend``."""
    import torch.distributed as dist

    import ds_z3native

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:  # the same code path on CPU (a check of this test without a GPU)
        from test_eager_recompute import _no_shm_comm

        _no_shm_comm()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    results = {"unpatched": _train(device, rank, world_size)}
    results["patches"] = list(ds_z3native.install().patches)
    results["installed"] = _train(device, rank, world_size)
    ds_z3native.uninstall()
    return results


def check(results: Dict[str, Any], rtol: float, atol: float) -> None:
    """DeepSpeed alone as ``assert_unpatched_outcome`` expects; with install(): no error, ZeRO's
    state clean, the losses and trainable params of plain PyTorch within ``rtol``/``atol``, each
    trainable tensor moved from its initial value by more than half an Adam step (rms)."""
    unpatched, got = results["unpatched"], results["installed"]
    assert_unpatched_outcome(unpatched, UPSTREAM_FIX)
    assert "error" not in got, got["error"]
    assert got["violations"] == [], got["violations"]
    ref = got["reference"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=rtol, atol=atol)
    assert got["params"].keys() == ref["params"].keys()
    for name, value in got["params"].items():
        torch.testing.assert_close(value, ref["params"][name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    assert_trained_alike(got["params"], ref["params"], ref["initial"], rel=1e-2,
                         min_rms_move=NORM_LINEAR.lr / 2, what="norm-linear")


def test_minimal_reproduction_one_gpu_nccl_fails_alone_trains_like_pytorch_installed() -> None:
    results = run_ranks(norm_linear_on_device, 1, "cuda", "nccl",
                        env={"DS_ACCELERATOR": "cuda"}, init_pg=False, timeout=600.0)[0]
    # cuBLAS and the CPU reference sum in different orders
    check(results, rtol=1e-4, atol=1e-5)


def test_minimal_reproduction_two_gpus_nccl_fails_alone_trains_like_pytorch_installed() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for results in run_ranks(norm_linear_on_device, 2, "cuda", "nccl",
                             env={"DS_ACCELERATOR": "cuda"}, init_pg=False, timeout=600.0):
        check(results, rtol=1e-4, atol=1e-5)


def recompute_cases_on_gpu(rank: int, world_size: int, cases: Any) -> Dict[str, Any]:
    """``test_eager_recompute.run_group`` with install() on this rank's GPU over NCCL."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return run_group(rank, world_size, "install", cases)


def test_backward_entered_any_way_releases_holds_and_half_types_train_like_pytorch() -> None:
    # engine.scale(loss).backward() in DeepSpeed's fp16 mode (its loss scaler multiplies the
    # loss; CPU DeepSpeed refuses fp16), beside bf16 and loss.backward() with accumulation: no
    # param stays gathered or listed as in use after the backward, and training matches plain
    # PyTorch within the half type's rounding.
    cases = [SCALE_BACKWARD_FP16, SCALE_BACKWARD_BF16, TORCH_BACKWARD_GAS2]
    results = run_ranks(recompute_cases_on_gpu, 1, cases, env={"DS_ACCELERATOR": "cuda"},
                        init_pg=False, timeout=600.0)
    _assert_group(results, cases)
