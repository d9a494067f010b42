"""DeepCompile ZeRO-3 with frozen params (requires_grad=False): fixes of ``init_z3``.

``deepspeed/compile/init_z3.py: init_z3(engine, ...)`` registers every module parameter with the
native op, passing the param's slot of the optimizer's gradient partition
(``optimizer.__param_id_to_grad_partition[ds_id]``). That map is built from the optimizer's
trainable param groups only.

* :data:`FROZEN_GRAD_BUFFER` (DeepSpeed 0.19.0 – 0.19.5): those releases look the slot up for every
  param, so the first frozen param raises ``KeyError: <ds_id>`` at ``engine.compile()``. 0.19.6
  passes an empty tensor for ``requires_grad=False`` params instead; this patch gives the older
  releases the same: while ``init_z3`` runs, the optimizer's map answers an empty tensor for the
  ds_ids of frozen params (the map itself is not changed, and is put back when init_z3 returns).
* :data:`DECLARE_FROZEN` (every release): after init_z3 has registered the params, each frozen one
  is declared frozen to the native layer with ``set_param_frozen(ds_id, True)``, so frozenness
  is a recorded fact and not only inferred from an empty buffer (unpatched, 0.19.0 – 0.19.5
  register a param frozen after ``deepspeed.initialize`` with its optimizer slot). Before
  init_z3 runs, a param that is not floating point is refused with :class:`NonFloatParam`,
  naming it and what to change: the native layer registers params as floating-point shards, and
  init_z3 would stop at the first such param with only its ds_id, the params before it
  registered. QLoRA's 4-bit weights are such params where bitsandbytes stores them packed in
  uint8 (``bnb_4bit_quant_storage``'s default); stored in the compute dtype they train.
* :data:`UNFROZEN_GUARD` (every release): a param frozen at ``engine.compile()`` and made
  trainable later has no gradient buffer, and DeepCompile's compiled graphs keep computing no
  gradient for it: dynamo does not recompile when a parameter's requires_grad changes, so the
  gradient is silently absent until the next recompile (DeepCompile's step-5 re-planning), where
  it reaches ``dc::reduce_grad`` and the native layer refuses it. Seen on one H200 with DeepSpeed
  0.19.2 and 0.19.8: unfrozen before step 2, three steps trained without it, then step 5 raised.
  This patch adds a DeepCompile pre-backward hook (DeepSpeed runs those at the start of
  ``engine.backward``; 0.19.0 - 0.19.1 call them with no argument, 0.19.2+ with the
  accumulation-boundary flag, and the hook takes either) that raises
  :class:`UnfrozenAfterCompile`, naming the params, at the first backward after the change. The
  native refusal stays as the second line.
"""

from __future__ import annotations

import collections
import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

from packaging.version import Version

from . import Patch, Undo
from ._rebind import when_module_imported, wrap_function

__all__ = ["FROZEN_GRAD_BUFFER", "DECLARE_FROZEN", "UNFROZEN_GUARD", "PATCHES", "init_z3_owners",
           "wrap_init_z3",
           "patch_frozen_grad_buffer", "patch_declare_frozen", "patch_unfrozen_guard",
           "UnfrozenAfterCompile", "NonFloatParam", "refuse_non_float_params"]

log = logging.getLogger(__name__)

# DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition, as Python mangles it.
_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


_INIT_Z3_MODULE = "deepspeed.compile.init_z3"


# Every patch here wraps init_z3 where it is defined; the modules holding a ``from`` import of it
# are rebound to the same wrapper, so its fingerprint covers them.
def init_z3_owners() -> List[ModuleType]:
    """Modules holding DeepSpeed's ``init_z3``: its own module and, in releases that import it at
    module level (0.19.0 - 0.19.7 do; 0.19.8 imports it inside ``engine.compile()``),
    ``deepspeed.runtime.engine``."""
    return [importlib.import_module(_INIT_Z3_MODULE),
            importlib.import_module("deepspeed.runtime.engine")]


def wrap_init_z3(make_wrapper: Callable[[Callable], Callable]) -> Undo:
    """Wraps ``init_z3`` in every module holding it (:func:`init_z3_owners`) with
    ``make_wrapper(init_z3)`` once its module is imported; the undo unwraps it."""
    # init_z3's module is heavy (it imports the compile passes and inductor) and 0.19.8 imports it
    # only at engine.compile(): patch it when it is imported, never import it early.
    return when_module_imported(_INIT_Z3_MODULE,
                                lambda: wrap_function(init_z3_owners(), "init_z3", make_wrapper))


def _frozen_ds_ids(engine: Any) -> List[int]:
    return [p.ds_id for p in engine.module.parameters() if not p.requires_grad]


class _GradPartitionsWithFrozen(collections.UserDict):
    """The optimizer's ds_id -> grad partition map (shared, not copied), answering an empty
    tensor for frozen params, as DeepSpeed >= 0.19.6 registers them."""

    def __init__(self, table: Dict[int, Any], frozen: Collection[int]) -> None:
        super().__init__()
        self.data = table  # reads and writes reach the optimizer's own dict
        self._frozen = frozenset(frozen)

    def __getitem__(self, ds_id: int) -> Any:
        if ds_id in self._frozen:
            import torch

            return torch.Tensor()
        return self.data[ds_id]


def _with_frozen_grad_buffers(init_z3: Callable) -> Callable:
    def init_z3_with_frozen_grad_buffers(engine: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(engine, "optimizer", None)
        table = getattr(optimizer, _GRAD_PARTITIONS, None)
        if not isinstance(table, dict):  # no ZeRO-3 optimizer: init_z3 passes empty buffers itself
            return init_z3(engine, *args, **kwargs)
        frozen = _frozen_ds_ids(engine)
        setattr(optimizer, _GRAD_PARTITIONS, _GradPartitionsWithFrozen(table, frozen))
        try:
            return init_z3(engine, *args, **kwargs)
        finally:
            setattr(optimizer, _GRAD_PARTITIONS, table)

    return init_z3_with_frozen_grad_buffers


def patch_frozen_grad_buffer() -> Undo:
    """init_z3 registers frozen params with an empty grad buffer instead of raising KeyError."""
    return wrap_init_z3(_with_frozen_grad_buffers)


class NonFloatParam(RuntimeError):
    """engine.compile() with DeepCompile met a param that is not floating point (a 4-bit QLoRA
    weight stored as uint8); nothing was registered."""


def _compute_dtype(param: Any, module: Any) -> str:
    """The dtype to store ``param`` in: a bitsandbytes 4-bit weight's own (its quant state's
    dtype, what it dequantizes to), else the model's first floating-point param's."""
    dtype = getattr(getattr(param, "quant_state", None), "dtype", None)
    if dtype is None or not getattr(dtype, "is_floating_point", False):
        dtype = next((p.dtype for p in module.parameters() if p.dtype.is_floating_point), None)
    return str(dtype) if dtype is not None else "torch.bfloat16"


def refuse_non_float_params(engine: Any) -> None:
    """Raises :class:`NonFloatParam` naming the params of ``engine.module`` that are not floating
    point (DeepCompile registers each ZeRO-3 param as a floating-point shard), with what to
    change; nothing when every param is floating point."""
    bad = [(name, p) for name, p in engine.module.named_parameters()
           if not p.dtype.is_floating_point]
    if not bad:
        return
    first = bad[0][1]
    shown = ", ".join(f"{n} (ds_id {getattr(p, 'ds_id', '?')}, {type(p).__name__} of dtype "
                      f"{p.dtype})" for n, p in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    dtype = _compute_dtype(first, engine.module)
    raise NonFloatParam(
        f"ds_z3native: engine.compile() with DeepCompile: {len(bad)} param(s) are not floating "
        f"point: {shown}{more}. DeepCompile's ZeRO-3 registers every param as a floating-point "
        f"shard; nothing was registered. For 4-bit bitsandbytes weights (QLoRA), which are "
        f"stored packed in uint8 by default, load the model with "
        f"BitsAndBytesConfig(..., bnb_4bit_quant_storage={dtype}) (the compute dtype): the "
        f"packed weights are then {dtype} params. Otherwise make such tensors buffers, or "
        f"train without DeepCompile.")


def _declaring_frozen(init_z3: Callable) -> Callable:
    def init_z3_declaring_frozen(engine: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_non_float_params(engine)
        result = init_z3(engine, *args, **kwargs)
        from deepspeed.compile import util

        handle = util.get_deepcompile_handle()
        if not hasattr(handle, "set_param_frozen"):
            # Only reachable if someone swapped the handle after install(); DeepSpeed's own op
            # has no frozen flag to set.
            log.warning("the DeepCompile handle is %r, not ds_z3native's: frozen params are not "
                        "declared", handle)
            return result
        frozen = _frozen_ds_ids(engine)
        for ds_id in frozen:
            handle.set_param_frozen(ds_id, True)
        log.debug("declared %d frozen params to the native layer", len(frozen))
        return result

    return init_z3_declaring_frozen


def patch_declare_frozen() -> Undo:
    """After init_z3, each requires_grad=False param is declared frozen with set_param_frozen."""
    return wrap_init_z3(_declaring_frozen)


class UnfrozenAfterCompile(RuntimeError):
    """A param frozen at engine.compile() requires grad now; its gradients would be lost."""


class _UnfrozenGuard:
    """DeepCompile pre-backward hook: refuses to run a backward once a param that was frozen at
    registration requires grad."""

    def __init__(self, frozen: List[Tuple[str, Any]]) -> None:
        self._frozen = frozen  # (name, param) of the params registered frozen

    def __call__(self, _is_gradient_accumulation_boundary: Optional[bool] = None) -> None:
        # DeepSpeed 0.19.0 - 0.19.1 call pre-backward hooks with no argument, 0.19.2+ with the
        # accumulation-boundary flag (deepcompile_backward_prologue): accept both.
        unfrozen = [f"{name} (ds_id {p.ds_id})" for name, p in self._frozen if p.requires_grad]
        if unfrozen:
            raise UnfrozenAfterCompile(
                "ds_z3native: " + ", ".join(unfrozen) + " had requires_grad=False at "
                "engine.compile() and require grad now. DeepCompile registered them frozen (no "
                "gradient buffer) and its compiled graphs compute no gradient for them, so this "
                "backward would drop their gradients. Set requires_grad before engine.compile() "
                "(or build a new engine).")


def patch_unfrozen_guard() -> Undo:
    """After init_z3, a pre-backward hook refuses params unfrozen since registration."""
    hooks: List[_UnfrozenGuard] = []

    def guarding_unfrozen(init_z3: Callable) -> Callable:
        def init_z3_guarding_unfrozen(engine: Any, *args: Any, **kwargs: Any) -> Any:
            result = init_z3(engine, *args, **kwargs)
            frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
            if frozen:
                from deepspeed.compile import util

                hook = _UnfrozenGuard(frozen)
                util.add_pre_backward_hook(hook)
                hooks.append(hook)
            return result

        return init_z3_guarding_unfrozen

    unwrap = wrap_init_z3(guarding_unfrozen)

    def undo() -> None:
        unwrap()
        if hooks:
            from deepspeed.compile import util

            util.pre_backward_hooks[:] = [h for h in util.pre_backward_hooks if h not in hooks]
            hooks.clear()

    return undo


FROZEN_GRAD_BUFFER = Patch(
    name="deepcompile-z3-frozen-grad-buffer",
    summary="init_z3 registers requires_grad=False params with an empty grad buffer "
            "(DeepSpeed < 0.19.6 raises KeyError at engine.compile())",
    apply=patch_frozen_grad_buffer,
    first=Version("0.19.0"),
    last=Version("0.19.5"),
    wraps=(
        "deepspeed.compile.init_z3:init_z3",
        # The optimizer's private map, swapped while init_z3 runs (set in the class's __init__).
        "deepspeed.runtime.zero.stage3:"
        "DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition",
    ),
)

DECLARE_FROZEN = Patch(
    name="deepcompile-z3-declare-frozen",
    summary="after init_z3, every requires_grad=False param is declared frozen to the native "
            "layer (set_param_frozen), not only inferred from an empty buffer; before it, a "
            "param that is not floating point (QLoRA's 4-bit weights stored as uint8) is "
            "refused with NonFloatParam, naming bnb_4bit_quant_storage",
    apply=patch_declare_frozen,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.init_z3:init_z3",
        "deepspeed.compile.util:get_deepcompile_handle",
    ),
)

UNFROZEN_GUARD = Patch(
    name="deepcompile-z3-unfrozen-guard",
    summary="a param frozen at engine.compile() and unfrozen later fails the next backward with "
            "a clear error instead of training without its gradient",
    apply=patch_unfrozen_guard,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.init_z3:init_z3",
        "deepspeed.compile.util:add_pre_backward_hook",
        "deepspeed.compile.util:pre_backward_hooks",  # the undo takes the hook out of it
        "deepspeed.compile.util:deepcompile_backward_prologue",  # calls the hook (its arguments)
    ),
)

# Applied in this order (each wraps the previous, so the later ones run after a successful
# registration); undone in reverse.
PATCHES: List[Patch] = [FROZEN_GRAD_BUFFER, DECLARE_FROZEN, UNFROZEN_GUARD]
