"""The ``cuda-memory-counters`` patch where DeepSpeed's accelerator is not CUDA (this CI): it
changes nothing, and the counters it reads answer as torch does before CUDA is initialised.
Its numbers on a real device are checked by tests/gpu/test_cuda_memory_counters_gpu.py."""

from __future__ import annotations

import torch

from ds_z3native.compat import cuda_memory_counters as counters
from ds_z3native.compat.registry import all_patches


def test_the_patch_is_registered_for_every_supported_release() -> None:
    (patch,) = [p for p in all_patches() if p.name == "cuda-memory-counters"]
    assert patch.wraps == (
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.memory_allocated",
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.max_memory_allocated")
    assert str(patch.first) == "0.19.0" and patch.last is None


def test_on_another_accelerator_the_patch_changes_nothing() -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    assert get_accelerator().device_name() != "cuda"
    before = dict(vars(CUDA_Accelerator))
    cls = type(get_accelerator())
    before_own = dict(vars(cls))
    undo = counters.patch_cuda_memory_counters()
    assert dict(vars(CUDA_Accelerator)) == before and dict(vars(cls)) == before_own
    undo()
    assert dict(vars(CUDA_Accelerator)) == before


def test_before_cuda_is_initialised_the_counters_are_torchs_zeros() -> None:
    assert not torch.cuda.is_initialized()
    want = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    assert counters.allocated_bytes() == want == (0, 0)
    assert counters.allocated_bytes(0) == want
