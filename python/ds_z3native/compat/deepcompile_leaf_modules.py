"""DeepCompile ZeRO-3 with ZeRO-3 leaf modules (mixture-of-experts blocks): their eager hooks go.

ZeRO-3 treats a *leaf module* (``deepspeed.utils.set_z3_leaf_modules``; DeepSpeed's default list
names transformers' ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` and
``Qwen3MoeSparseMoeBlock``) as one unit: its params are gathered together, and its gradients are
reduced by a full backward hook on the module (``register_full_backward_hook``, one per leaf
module, kept in the stage-3 optimizer's ``_leaf_module_hooks``) instead of one hook per param.

* :data:`LEAF_MODULE_HOOKS` (every release): DeepCompile's ``init_z3`` removes ZeRO-3's module
  hooks and its per-param gradient hooks (DeepCompile's graphs gather params and reduce every
  gradient themselves) but leaves the leaf modules' backward hooks in place. Dynamo cannot trace a
  module with a full backward hook ("Module-level backwards hooks require compiled autograd"):
  the graph breaks at each leaf module inside PEFT's and transformers' context managers, Dynamo
  runs those frames eagerly, and the trainable params read there reach DeepCompile outside its
  graphs (ds_z3native's eager-fallback refusal, ``EagerTrainableParam``, at the first step of a
  Qwen3-MoE or Mixtral LoRA run with checkpointing). Were the hook to run, it would reduce the
  leaf module's gradients a second time through ZeRO-3's eager path. With the patch ``init_z3``
  also removes those hooks, as it does the others; eager ZeRO-3 (no ``engine.compile()``) keeps
  them. :func:`leaf_module_hooks_removed` counts what was removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from packaging.version import Version

from ..run_state import RUN_STATE
from . import Patch, Undo
from .deepcompile_frozen import wrap_init_z3

__all__ = ["LEAF_MODULE_HOOKS", "PATCHES", "LeafHookStats", "leaf_module_hooks_removed",
           "patch_leaf_module_hooks"]

log = logging.getLogger(__name__)


@dataclass
class LeafHookStats:
    """What :data:`LEAF_MODULE_HOOKS` did in this process: ``engines`` compiled with leaf-module
    hooks in place, ``hooks`` removed from them."""

    engines: int = 0
    hooks: int = 0


_STATS = LeafHookStats()


def leaf_module_hooks_removed() -> Dict[str, int]:
    """``{"engines", "hooks"}``: ZeRO-3 leaf-module backward hooks removed at ``engine.compile()``
    in this process, and from how many engines."""
    return {"engines": _STATS.engines, "hooks": _STATS.hooks}


def _leaf_module_names(engine: Any, optimizer: Any) -> List[str]:
    leaves = getattr(optimizer, "leaf_parameters", None) or {}
    names = {id(m): n for n, m in engine.module.named_modules()}
    return [names.get(id(m), type(m).__name__) for m in leaves]


def _removing_leaf_module_hooks(init_z3: Callable) -> Callable:
    def init_z3_without_leaf_module_hooks(engine: Any, *args: Any, **kwargs: Any) -> Any:
        result = init_z3(engine, *args, **kwargs)
        optimizer = getattr(engine, "optimizer", None)
        handles = getattr(optimizer, "_leaf_module_hooks", None)
        if isinstance(handles, list) and handles:
            names = _leaf_module_names(engine, optimizer)
            for handle in handles:
                handle.remove()
            _STATS.engines += 1
            _STATS.hooks += len(handles)
            log.info("DeepCompile ZeRO-3: removed the gradient-reduction backward hooks of %d "
                     "ZeRO-3 leaf module(s) (%s): DeepCompile's graphs reduce their gradients, "
                     "and Dynamo cannot trace a module with a backward hook", len(handles),
                     ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
            handles.clear()
        return result

    return init_z3_without_leaf_module_hooks


def patch_leaf_module_hooks() -> Undo:
    """After init_z3, the stage-3 optimizer's leaf-module backward hooks are removed."""
    return wrap_init_z3(_removing_leaf_module_hooks)


LEAF_MODULE_HOOKS = Patch(
    name="deepcompile-z3-leaf-module-hooks",
    summary="engine.compile() with DeepCompile removes ZeRO-3's backward hooks on leaf modules "
            "(mixture-of-experts blocks), as it does its other hooks (a graph break at each one, "
            "then EagerTrainableParam)",
    apply=patch_leaf_module_hooks,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.init_z3:init_z3",
        # What the hooks do, where they are kept, and the leaf modules named in the log.
        "deepspeed.runtime.zero.stage3:"
        "DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._leaf_module_hooks",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.leaf_parameters",
    ),
)

PATCHES: List[Patch] = [LEAF_MODULE_HOOKS]


def _clear_stats() -> None:
    _STATS.engines = _STATS.hooks = 0


RUN_STATE.register("leaf_module_hooks", leaf_module_hooks_removed, _clear_stats)
