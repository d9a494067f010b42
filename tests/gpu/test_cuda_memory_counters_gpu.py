"""The ``cuda-memory-counters`` patch on a real CUDA device: DeepSpeed's CUDA accelerator answers
``memory_allocated`` / ``max_memory_allocated`` with torch's own numbers through every allocator
state a profiler meets (allocations, frees, a peak reset), through the native read and through
torch's nested stats dict alike; a device it cannot read is refused by name; the undo puts
DeepSpeed's methods back.

Marked ``gpu`` (tests/conftest.py skips it without CUDA).
"""

from __future__ import annotations

from typing import Callable, List

import pytest
import torch

pytestmark = pytest.mark.gpu


def _states() -> List[Callable[[], None]]:
    """Steps that move the allocator's current and peak counters apart and together."""
    held: List[torch.Tensor] = []

    def alloc(n: int) -> Callable[[], None]:
        return lambda: held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))

    def free_first() -> None:
        held.pop(0)

    return [alloc(1 << 20), alloc(3 << 20), alloc(517), free_first,
            torch.cuda.reset_peak_memory_stats, alloc(1 << 21), free_first, held.clear,
            torch.cuda.reset_peak_memory_stats]


def test_the_accelerator_answers_torchs_numbers_through_both_reads() -> None:
    from deepspeed.accelerator import get_accelerator

    from ds_z3native import build_info, native
    from ds_z3native.compat import cuda_memory_counters as counters

    accelerator = get_accelerator()
    assert accelerator.device_name() == "cuda"
    torch.cuda.init()
    cls = type(accelerator)
    before = (cls.memory_allocated, cls.max_memory_allocated)
    undo = counters.patch_cuda_memory_counters()
    try:
        assert (cls.memory_allocated, cls.max_memory_allocated) != before
        if build_info()["flavour"] == "cuda":
            assert counters._native_reader() is native().cuda_allocated_bytes
        readers = {"patched": counters.allocated_bytes, "nested dict": counters._nested_dict_reader}
        if counters._native_reader() is not None:
            readers["native"] = counters._native_reader()
        checked = 0
        for step in _states():
            step()
            want = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
            assert (accelerator.memory_allocated(), accelerator.max_memory_allocated()) == want
            assert (accelerator.memory_allocated(0), accelerator.max_memory_allocated(0)) == want
            # a torch.device goes to DeepSpeed's own method (torch's answer)
            assert accelerator.memory_allocated(torch.device("cuda:0")) == want[0]
            for name, read in readers.items():
                assert tuple(read(0)) == want, name
            checked += 1
        assert checked == len(_states())
    finally:
        undo()
    assert (cls.memory_allocated, cls.max_memory_allocated) == before


def test_a_device_that_is_not_visible_is_refused_by_name() -> None:
    from ds_z3native import build_info, native

    if build_info()["flavour"] != "cuda":
        pytest.skip("a CPU build of ds_z3native has no native CUDA counters")
    bad = torch.cuda.device_count() + 7
    with pytest.raises(RuntimeError, match=rf"cuda_allocated_bytes: device {bad} is not a visible CUDA device"):
        native().cuda_allocated_bytes(bad)
    with pytest.raises(RuntimeError, match=r"cuda_allocated_bytes: device -1 "):
        native().cuda_allocated_bytes(-1)
