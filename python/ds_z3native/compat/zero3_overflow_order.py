"""ZeRO-3's fp16 overflow check reads the gradient partitions after the reductions that wrote them.

Under DeepCompile the gradients are reduced by the native op's reduce-scatter stream, and
``dc::end_backward`` orders the compute stream after the last reduction without blocking the host
(DeepSpeed's own executor waits on the host; not waiting lets the host launch the optimizer step
while the last bucket is still being reduced, about 4% of a 1 B LoRA step on an H100). Every
reader on the compute stream, and every host read (which synchronizes that stream), comes after
the reductions.

One reader is on another stream: ``DeepSpeedZeroOptimizer_Stage3.has_overflow`` runs
``isinf``/``isnan`` over the flat gradient partitions on ``reduce_and_partition_stream``, which
waits for nothing DeepCompile did. Unordered, an fp16 run with dynamic loss scaling can read a
bucket before its reduction lands: an inf in the last bucket missed and applied, or a stale value
read as an overflow and a step skipped, depending on timing.

:data:`ZERO3_OVERFLOW_AFTER_REDUCTIONS` makes ``reduce_and_partition_stream`` wait for the current
stream before ``has_overflow`` reads: the current stream is ordered after the reductions, so the
check is too. Eager ZeRO-3 reduces on that stream itself, and the current stream has finished the
backward by the optimizer step: the wait adds no order it did not have. Where the accelerator
runs in order (the CPU), DeepSpeed keeps no such stream and nothing changes.
"""

from __future__ import annotations

from typing import Any, Callable

from packaging.version import Version

from . import Patch
from ._rebind import wrap_method

__all__ = ["PATCHES", "ZERO3_OVERFLOW_AFTER_REDUCTIONS"]


def _after_current_stream(has_overflow: Callable) -> Callable:
    def has_overflow_after_the_reductions(self: Any, partition_gradients: bool = True) -> Any:
        stream = getattr(self, "reduce_and_partition_stream", None)
        if partition_gradients and stream is not None:
            from deepspeed.accelerator import get_accelerator

            stream.wait_stream(get_accelerator().current_stream())
        return has_overflow(self, partition_gradients)

    return has_overflow_after_the_reductions


def patch_overflow_order() -> Callable[[], None]:
    """``has_overflow`` reads the gradient partitions in order after the current stream."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return wrap_method(DeepSpeedZeroOptimizer_Stage3, "has_overflow", _after_current_stream)


ZERO3_OVERFLOW_AFTER_REDUCTIONS = Patch(
    name="zero3-overflow-after-reductions",
    summary="ZeRO-3's fp16 overflow check runs on DeepSpeed's reduce_and_partition_stream, which "
            "waits for nothing DeepCompile's reductions did; it now waits for the current stream "
            "(ordered after the reductions) before it reads the gradient partitions",
    apply=patch_overflow_order,
    wraps=("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.has_overflow",),
    first=Version("0.19.0"),
    last=None,
)

PATCHES = [ZERO3_OVERFLOW_AFTER_REDUCTIONS]
