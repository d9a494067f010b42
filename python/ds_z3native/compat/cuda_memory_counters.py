"""DeepSpeed's CUDA accelerator reads the allocator's counters without building torch's stats dict.

DeepCompile's profiling passes read ``get_accelerator().memory_allocated()`` and
``max_memory_allocated()`` several times for every node of every graph they run (the operator
profile once per graph, the memory profile after each pass that changes it). torch answers each
read by building the device's whole statistics dict (about 150 entries), flattening it into
dotted keys in Python and sorting it. A cold compile of the 1 B LoRA model's 16-layer graphs on
one H200 made about 227,000 such reads; flattening and sorting were the largest single cost of
DeepCompile's passes after the scheduler's walk.

* :data:`CUDA_MEMORY_COUNTERS` (every release, applied only when DeepSpeed's accelerator is the
  CUDA one): both methods answer from one read of the caching allocator's counters, the native
  module's ``cuda_allocated_bytes`` where ds_z3native was built for CUDA, else torch's nested
  statistics dict, read without flattening. The numbers are torch's own (``allocated_bytes``,
  aggregate over both pools, current and peak; 0 before CUDA is initialised). A device given as
  anything but ``None`` or an index goes to torch as before.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Optional, Tuple

import torch
from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, wrap_method

__all__ = ["CUDA_MEMORY_COUNTERS", "PATCHES", "allocated_bytes", "patch_cuda_memory_counters"]

log = logging.getLogger(__name__)

AllocatedBytes = Tuple[int, int]
# The accelerator's methods, in the order of allocated_bytes()'s answer.
_METHODS = ("memory_allocated", "max_memory_allocated")


@functools.lru_cache(maxsize=None)
def _native_reader() -> Optional[Callable[[int], AllocatedBytes]]:
    """The native module's one-call read, or None for a build without CUDA (or no native module)."""
    try:
        from .. import _native
        return getattr(_native.load(), "cuda_allocated_bytes", None)
    except (ImportError, OSError) as exc:  # a broken build is reported by install(), not here
        log.debug("native module unavailable for CUDA memory counters: %s", exc)
        return None


def _nested_dict_reader(device: int) -> AllocatedBytes:
    aggregate = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
    return int(aggregate.get("current", 0)), int(aggregate.get("peak", 0))


def allocated_bytes(device: Optional[int] = None) -> AllocatedBytes:
    """``(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device))`` from one
    read of the caching allocator's counters.

    ``device`` is a CUDA device index, or None for the current device. Before CUDA is initialised
    both are 0, as torch answers.
    """
    if not torch.cuda.is_initialized():
        return 0, 0
    index = torch.cuda.current_device() if device is None else int(device)
    reader = _native_reader()
    if reader is not None:
        current, peak = reader(index)
        return int(current), int(peak)
    return _nested_dict_reader(index)


def _reading(which: int) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def read(self: Any, device_index: Any = None) -> int:
            if device_index is not None and not isinstance(device_index, int):
                return original(self, device_index)
            return allocated_bytes(device_index)[which]

        return read

    return make


def patch_cuda_memory_counters() -> Undo:
    """DeepSpeed's CUDA accelerator's ``memory_allocated`` and ``max_memory_allocated`` answer from
    :func:`allocated_bytes` (a no-op undo on any other accelerator)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda":
        return lambda: None
    cls = type(accelerator)
    owners = [next(c for c in cls.__mro__ if name in c.__dict__) for name in _METHODS]
    log.debug("DeepSpeed's CUDA accelerator: memory counters read in one call (native: %s)",
              _native_reader() is not None)
    return undo_all([wrap_method(owner, name, _reading(which))
                     for which, (owner, name) in enumerate(zip(owners, _METHODS))])


CUDA_MEMORY_COUNTERS = Patch(
    name="cuda-memory-counters",
    summary="on DeepSpeed's CUDA accelerator, memory_allocated() and max_memory_allocated() read "
            "the allocator's counters in one call instead of building and flattening torch's "
            "stats dict (DeepCompile's profilers read them several times per graph node)",
    apply=patch_cuda_memory_counters,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.memory_allocated",
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.max_memory_allocated",
    ),
)

PATCHES: List[Patch] = [CUDA_MEMORY_COUNTERS]
