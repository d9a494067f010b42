"""ZeRO-3's gradient norm in one reduction over the gradient partition buffer, not one per param.

Every optimizer step, ``DeepSpeedZeroOptimizer_Stage3.step()`` takes the norm of each param
group's gradient partitions (``_get_norm_groups`` → ``get_grad_norm_direct``) one tensor at a
time: a dtype conversion and a norm kernel per param, then a stack, a power and a sum. On a LoRA
model that is two small launches per adapter matrix (448 on a 16-layer Llama with LoRA on every
linear layer), all on the host path of a step that DeepCompile has made host-bound.

The partitions it is handed are, as DeepSpeed lays them out for ZeRO-3 (eager and DeepCompile
alike), consecutive views of one gradient buffer, in the group's order. Where they are (one
storage, each contiguous, each starting where the one before ends, one dtype), the sum of their
squared norms is the squared norm of the span they cover; :data:`ZERO3_FLAT_GRAD_NORM` hands
DeepSpeed's own ``get_grad_norm_direct`` that span as the gradients (one, or pieces no larger
than the largest partition where the span is longer: DeepSpeed converts each to the norm dtype,
and that copy stays no larger than the loop's largest), each with the group's first param as the
param it belongs to. Everything else that function does (the norm dtype, the
all-reduce over the params' partition group, the model-parallel and expert-parallel reductions,
the -1 for an inf or NaN norm) stays DeepSpeed's, for the release that runs.

The span is used only where it gives the same sum as the per-param loop: norm type 2, every
param counted (model-parallel rank 0: a param that is not tensor-parallel counts on that rank
alone), and the params alike in what the loop reads of them (partition group, placement family,
expert group name). Anything else (partitions that are not one span: a frozen param's zeros, an
offloaded gradient; any other norm type; a tensor-parallel rank other than 0; mixed groups) goes
through DeepSpeed's loop unchanged. The two sums differ only in rounding order, in the norm dtype
(float64 where the device has it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional, Sequence

from packaging.version import Version

from ..run_state import RUN_STATE
from . import Patch
from ._rebind import wrap_method

__all__ = ["PATCHES", "ZERO3_FLAT_GRAD_NORM", "contiguous_span", "flat_norm_counts"]

log = logging.getLogger(__name__)

_COUNTS_LOCK = threading.Lock()
_COUNTS: Dict[str, int] = {"flat": 0, "per_param": 0}

# The span is handed over in pieces of at most max(MIN_PIECE, the largest partition's numel)
# elements (float64 copies of 32 MiB at least).
MIN_PIECE = 1 << 22

# What DeepSpeed's loop reads of each param, beyond its gradient (absent attributes read as None).
_PARAM_KEYS = ("ds_process_group", "ds_zero_placement_family", "ds_zero_partition_group_name")


def flat_norm_counts(reset: bool = False) -> Dict[str, int]:
    """How many gradient norms this process took over one span (``flat``) and through DeepSpeed's
    per-param loop (``per_param``) since the last reset; ``reset`` zeroes them after reading."""
    with _COUNTS_LOCK:
        out = dict(_COUNTS)
        if reset:
            for key in _COUNTS:
                _COUNTS[key] = 0
    return out


def _count(key: str) -> None:
    with _COUNTS_LOCK:
        _COUNTS[key] += 1


def contiguous_span(tensors: Sequence[Any]) -> Optional[Any]:
    """A 1-D tensor over exactly the elements of ``tensors`` where they lie back to back, in
    order, in one storage (each contiguous, one dtype and device); None where they do not.

    The span shares their storage (no copy). One tensor is its own span, flattened."""
    import torch

    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = next((t for t in tensors if t.numel()), tensors[0])
    storage = first.untyped_storage().data_ptr()
    dtype, device, itemsize = first.dtype, first.device, first.element_size()
    expected = first.data_ptr()
    total = 0
    for t in tensors:
        n = t.numel()
        if (t.dtype != dtype or t.device != device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage):
            return None
        if n and t.data_ptr() != expected:  # an empty view's data_ptr() is 0
            return None
        expected += n * itemsize
        total += n
    return first.as_strided((total,), (1,), first.storage_offset())


def _alike(params: Sequence[Any]) -> bool:
    """Whether every param reads the same as the first where DeepSpeed's loop looks."""
    first = [getattr(params[0], key, None) for key in _PARAM_KEYS]
    for p in params:
        for key, value in zip(_PARAM_KEYS, first):
            if getattr(p, key, None) != value:
                return False
    return True


def _flat_norm(get_grad_norm_direct: Callable) -> Callable:
    def get_grad_norm_direct_flat(self: Any, gradients: Any, params: Any, norm_type: Any = 2) -> Any:
        try:
            two = float(norm_type) == 2.0
        except (TypeError, ValueError):
            two = False
        if (two and isinstance(gradients, (list, tuple)) and isinstance(params, (list, tuple))
                and len(gradients) > 1 and len(gradients) == len(params)
                and getattr(self, "model_parallel_rank", 0) == 0 and _alike(params)):
            span = contiguous_span(gradients)
            if span is not None:
                _count("flat")
                # In pieces no larger than the largest partition (or MIN_PIECE elements): DeepSpeed
                # converts each gradient it is handed to the norm dtype, and the loop's largest
                # such copy is its largest partition's.
                piece = max(MIN_PIECE, max(g.numel() for g in gradients))
                pieces = list(span.split(piece)) if span.numel() > piece else [span]
                return get_grad_norm_direct(self, pieces, [params[0]] * len(pieces), norm_type)
        _count("per_param")
        return get_grad_norm_direct(self, gradients, params, norm_type)

    return get_grad_norm_direct_flat


def patch_grad_norm() -> Callable[[], None]:
    """``get_grad_norm_direct`` takes one norm over the span its gradients cover, where they are
    one span of one buffer."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return wrap_method(DeepSpeedZeroOptimizer_Stage3, "get_grad_norm_direct", _flat_norm)


ZERO3_FLAT_GRAD_NORM = Patch(
    name="zero3-flat-grad-norm",
    summary="ZeRO-3's optimizer step takes each param group's gradient norm in one reduction over "
            "the span of the gradient buffer its partitions cover, instead of a conversion and a "
            "norm kernel per param",
    apply=patch_grad_norm,
    wraps=("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct",
           "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._get_norm_groups",
           "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition"),
    first=Version("0.19.0"),
    last=None,
)

PATCHES = [ZERO3_FLAT_GRAD_NORM]


def _clear_counts() -> None:
    flat_norm_counts(reset=True)


RUN_STATE.register("flat_grad_norm", flat_norm_counts, _clear_counts)
