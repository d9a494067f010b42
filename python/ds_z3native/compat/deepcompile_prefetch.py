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
  of DeepSpeed's value and the budget (``ds_z3native.set_prefetch_budget``, default
  ``DS_Z3NATIVE_PREFETCH_BUDGET_MB``: :mod:`ds_z3native.settings`) less the graph's largest
  gather, read at each call: the pass adds a gather while its window is within that value, so
  the window ends within the budget. Without a budget the pass runs untouched. A budget of 0 leaves each gather just before its first use.
  The value is restored after each call, so the module constant is never left changed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

from packaging.version import Version

from .. import settings
from . import Patch, Undo
from ._rebind import when_module_imported, wrap_function

__all__ = ["PREFETCH_MODULE", "DEEPCOMPILE_PREFETCH_BUDGET", "PATCHES", "prefetch_budget_bytes",
           "patch_prefetch_budget"]

log = logging.getLogger(__name__)

PREFETCH_MODULE = "deepspeed.compile.passes.prefetch"


def prefetch_budget_bytes() -> Optional[int]:
    """The prefetch budget in effect, in bytes (:func:`ds_z3native.settings.current`); None:
    DeepSpeed's window."""
    return settings.current().prefetch_budget_bytes


def _largest_gather(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
    """The largest all-gather (bytes, as profiled) of the graph ``schedule_prefetch`` is asked to
    plan; 0 where its arguments do not say (the pass then skips itself too)."""
    import inspect

    import torch
    from deepspeed.compile.passes import prefetch

    try:
        bound = inspect.signature(prefetch.schedule_prefetch).bind(*args, **kwargs)
        gm, graph_id = bound.arguments["gm"], bound.arguments["graph_id"]
        profile = bound.arguments["profiling_results"][graph_id]
        sizes = dict(profile.bwd_tensor_sizes if bound.arguments["bwd"] else profile.fwd_tensor_sizes)
    except (TypeError, KeyError, AttributeError) as e:
        log.debug("schedule_prefetch's graph and profile not readable: %s", e)
        return 0
    return int(max((sizes.get(n.name, 0) for n in gm.graph.nodes
                    if n.target == torch.ops.dc.allgather_param.default), default=0))


def _within_budget(schedule_prefetch: Callable, module: Any,
                   budget_bytes: Callable[[], Optional[int]]) -> Callable:
    """``schedule_prefetch`` run so that it keeps at most ``budget_bytes()`` (asked at each call:
    a setter may change it after install) of all-gathers in flight. The pass adds a gather to its
    window while the window is within ``module.MAX_BUFFERED_SIZE`` before it, so the window can
    end one gather over that value: it is set to the budget less the graph's largest gather."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = budget_bytes()
        if budget is None:
            return schedule_prefetch(*args, **kwargs)
        original = module.MAX_BUFFERED_SIZE
        module.MAX_BUFFERED_SIZE = min(original, max(0, budget - _largest_gather(args, kwargs)))
        log.info("DeepCompile prefetch window capped at %d bytes (budget %d, DeepSpeed's: %d)",
                 module.MAX_BUFFERED_SIZE, budget, original)
        try:
            return schedule_prefetch(*args, **kwargs)
        finally:
            module.MAX_BUFFERED_SIZE = original

    return wrapper


def patch_prefetch_budget(budget_bytes: Callable[[], Optional[int]] = prefetch_budget_bytes
                          ) -> Undo:
    """Wrap ``schedule_prefetch`` (once DeepSpeed imports its prefetch pass) so that it honours
    ``budget_bytes()`` (default: this process's settings); the undo restores it."""

    def apply() -> Undo:
        import importlib

        module = importlib.import_module(PREFETCH_MODULE)
        if not hasattr(module, "MAX_BUFFERED_SIZE") or not hasattr(module, "schedule_prefetch"):
            log.warning("%s has no MAX_BUFFERED_SIZE/schedule_prefetch: a prefetch budget cannot "
                        "apply to this DeepSpeed", PREFETCH_MODULE)
            return lambda: None
        return wrap_function([module], "schedule_prefetch",
                             lambda original: _within_budget(original, module, budget_bytes))

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
