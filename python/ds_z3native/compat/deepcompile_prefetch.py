"""DeepCompile's prefetch window, capped on request (``ds_z3native.set_prefetch_budget``).

After profiling (its 6th step), DeepCompile's ``schedule_prefetch`` pass moves each parameter's
all-gather earlier in the graph, so that communication overlaps compute. It keeps moving
gathers ahead while the profiled peak plus the prefetched bytes stay under 90% of the device's
memory and the prefetched bytes stay under ``MAX_BUFFERED_SIZE`` (4e9 bytes in DeepSpeed
0.19.2-0.19.8). On a large GPU and a model of a few GB that is most of the model gathered at
once: on one H200 a 1 B LoRA run with checkpointing peaked 18% above eager ZeRO-3 even with no
param kept persistent. Where memory matters more than overlap, a budget bounds the window.

* :data:`DEEPCOMPILE_PREFETCH_BUDGET` (every release whose ``prefetch`` pass has
  ``MAX_BUFFERED_SIZE``): while ``schedule_prefetch`` runs, ``MAX_BUFFERED_SIZE`` is the smaller
  of DeepSpeed's value and the budget (``DS_Z3NATIVE_PREFETCH_BUDGET_MB``, set by
  ``ds_z3native.set_prefetch_budget``); without a budget the pass runs untouched. A budget of 0
  leaves each gather just before its first use. The value is restored after each call, so the
  module constant is never left changed.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Optional

from packaging.version import Version

from . import Patch, Undo
from ._rebind import when_module_imported, wrap_function

__all__ = ["PREFETCH_BUDGET_ENV", "PREFETCH_MODULE", "DEEPCOMPILE_PREFETCH_BUDGET", "PATCHES",
           "parse_budget_mib", "prefetch_budget_bytes", "patch_prefetch_budget"]

log = logging.getLogger(__name__)

PREFETCH_BUDGET_ENV = "DS_Z3NATIVE_PREFETCH_BUDGET_MB"
PREFETCH_MODULE = "deepspeed.compile.passes.prefetch"


def parse_budget_mib(value: Any, what: str) -> float:
    """``value`` as a budget in MiB: a finite number in [0, 1e12); ValueError naming ``what``
    (the function or variable it came from) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value >= 1e12:
        raise ValueError(f"{what}: expected MiB in [0, 1e12) or None, got {value!r}")
    return float(value)


def prefetch_budget_bytes() -> Optional[int]:
    """The prefetch budget in bytes from ``DS_Z3NATIVE_PREFETCH_BUDGET_MB``; None when unset or
    empty (DeepSpeed's window). A malformed value raises ValueError naming the variable."""
    raw = os.environ.get(PREFETCH_BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{PREFETCH_BUDGET_ENV}: expected MiB in [0, 1e12), got {raw!r}") from None
    return int(parse_budget_mib(value, PREFETCH_BUDGET_ENV) * 1024 * 1024)


def _within_budget(schedule_prefetch: Callable, module: Any) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = prefetch_budget_bytes()
        if budget is None:
            return schedule_prefetch(*args, **kwargs)
        original = module.MAX_BUFFERED_SIZE
        module.MAX_BUFFERED_SIZE = min(original, budget)
        log.info("DeepCompile prefetch window capped at %d bytes (DeepSpeed's: %d)",
                 module.MAX_BUFFERED_SIZE, original)
        try:
            return schedule_prefetch(*args, **kwargs)
        finally:
            module.MAX_BUFFERED_SIZE = original

    return wrapper


def patch_prefetch_budget() -> Undo:
    """Wrap ``schedule_prefetch`` (once DeepSpeed imports its prefetch pass) so that it honours
    the budget; the undo restores it."""

    def apply() -> Undo:
        import importlib

        module = importlib.import_module(PREFETCH_MODULE)
        if not hasattr(module, "MAX_BUFFERED_SIZE") or not hasattr(module, "schedule_prefetch"):
            log.warning("%s has no MAX_BUFFERED_SIZE/schedule_prefetch: a prefetch budget cannot "
                        "apply to this DeepSpeed", PREFETCH_MODULE)
            return lambda: None
        return wrap_function([module], "schedule_prefetch",
                             lambda original: _within_budget(original, module))

    return when_module_imported(PREFETCH_MODULE, apply)


DEEPCOMPILE_PREFETCH_BUDGET = Patch(
    name="deepcompile-prefetch-budget",
    summary="DeepCompile's prefetch pass keeps at most ds_z3native.set_prefetch_budget() MiB of "
            "all-gathers in flight (DeepSpeed: up to 4e9 bytes, or 90% of device memory)",
    apply=patch_prefetch_budget,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.passes.prefetch:schedule_prefetch",
        "deepspeed.compile.passes.prefetch:MAX_BUFFERED_SIZE",
    ),
)

PATCHES = [DEEPCOMPILE_PREFETCH_BUDGET]
