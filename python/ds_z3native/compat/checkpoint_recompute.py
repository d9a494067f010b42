"""Eager ZeRO-3 with non-reentrant activation checkpointing of modules that hold frozen params.

The problem (DeepSpeed 0.19.0 – 0.19.2). ``torch.utils.checkpoint`` (non-reentrant, PyTorch's and
transformers' default) re-runs a checkpointed forward inside backward, and ZeRO-3's module hooks
fire again: the pre-forward hook gathers the params, the post-forward hook partitions them in place
(``param.data = torch.empty(0)``). The recompute stores a tensor that requires grad as a detached
alias, which keeps the gathered storage alive; a tensor that does not (a frozen param) is stored as
the param object itself, so it shrinks to shape ``[0]`` and checkpoint's metadata check fails:
``CheckpointError: Recomputed values ... saved {'shape': [N]} ... recomputed {'shape': [0]}``.

DeepSpeed 0.19.3 attributes each frozen param fetched during a recompute to the module whose
backward was running when the recompute started (the *trigger*) and releases it when that
module's backward ends, plus a sweep at the end of backward. When the trigger is a leaf that runs
first (the usual transformer block) the param is released early and gathered again by its own
module's pre-backward hook; when an op of the checkpointed block itself starts the recompute,
every frozen param of the block stays gathered until the whole block's backward is done.

**Holds** (:data:`RECOMPUTE_FROZEN`, DeepSpeed 0.19.0 – 0.19.2). During a non-reentrant recompute
(``ds_z3native.current_graph_task_id() != -1`` with a saved-tensor hook active) each frozen param
that a module fetches gets a hold: a token in ``param.ds_active_sub_modules``, so that the
recompute's forward release leaves it gathered. The hold ends at the first of

* the end of the backward of the module that used it (of the last such module to finish backward,
  for a param shared by several): its last use;
* the end of the trigger's backward, if none of those modules has begun its backward by then: each
  gathers the param again in its own pre-backward hook, so releasing it there costs no use and
  keeps residency at or below DeepSpeed 0.19.3+'s;
* the end of backward (below).

At the end of the recompute every frozen param it saved must be gathered (checkpoint checks
their shapes then), in this scheme and in DeepSpeed's, so the two have the same peak of gathered
params; the holds lower the residency after that point where the block's own op triggers the
recompute. That is not a lower peak, so on DeepSpeed >= 0.19.3 DeepSpeed's own attribution stays
(:func:`apply_recompute_fix` with ``holds=True`` replaces it, for measurements and tests).

**Hardening** (every 0.19.x; the whole of :data:`RECOMPUTE_HARDENING` on 0.19.3 – 0.19.8):

* a recompute that re-runs a module whose backward is under way (a module enclosing the op that
  started the recompute, when checkpoint's early stop is off) does not release what that backward
  gathered; DeepSpeed releases it, and the backward then fails in ``AccumulateGrad`` or in an op
  that reads the param (``The size of tensor a (0) must match ...``), trainable params included;
* at the end of ``engine.backward``, everything a backward left gathered is released: held
  params, modules whose backward began and never ended (a checkpointed block fed an input that
  needs no grad never runs its post-backward hook; a module called twice runs it once), and
  modules whose recomputed forward was cut short (checkpoint's early stop), which are also taken
  off ZeRO's forward module stack (``FWD_MODULE_STACK`` grows by a few entries per checkpointed
  block per step otherwise);
* when ``engine.backward`` raises (an exception inside a recompute, say), all of the above and
  every other gathered non-persistent param of the model (DeepSpeed's forward keeps some for a
  reuse in backward that never came), so that a retry starts clean;
* DeepSpeed's backward epilogue does the first of these however backward was entered:
  ``engine.backward(loss)``, ``loss.backward()`` and ``engine.scale(loss).backward()`` (the latter
  two run it from the graph task's final callback); the next forward's start (outside backward)
  does it again for a backward whose epilogue never ran.

Reentrant checkpointing needs no hold (its recompute builds an ordinary graph whose backward runs
the modules' hooks) and gets none.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from packaging.version import Version

from . import Patch, Undo
from ._rebind import replace_attributes

__all__ = ["RECOMPUTE_FROZEN", "RECOMPUTE_HARDENING", "PATCHES", "RECOMPUTE_HOLD",
           "apply_recompute_fix", "applied_mode", "release_leftovers", "in_nonreentrant_recompute"]

log = logging.getLogger(__name__)

_COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
_OFFLOAD_MODULE = "deepspeed.runtime.zero.parameter_offload"
_STAGE3_MODULE = "deepspeed.runtime.zero.stage3"
_ENGINE_MODULE = "deepspeed.runtime.engine"
# PartitionedParameterCoordinator.__release_param, as Python mangles it: partitions a param if it
# is gathered and no submodule lists it, and keeps the coordinator's gathered-numel count.
_RELEASE_PARAM = "_PartitionedParameterCoordinator__release_param"
# DeepSpeed >= 0.19.3: its recompute attribution (module-level function in _COORDINATOR_MODULE)
# and the per-module set it fills.
_UPSTREAM_ATTRIBUTION = "update_recompute_parameters"
_UPSTREAM_RECOMPUTE_SET = "ds_recompute_parameters"
_STATE_ATTR = "_dsz_recompute_state"


class _RecomputeHold:
    """The token a held param carries in ``ds_active_sub_modules`` (which otherwise holds module
    ds_ids): while it is there, DeepSpeed's release leaves the param gathered."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "recompute-hold"


RECOMPUTE_HOLD = _RecomputeHold()

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def in_nonreentrant_recompute(graph_task_id: Callable[[], int]) -> bool:
    """Whether a forward running now may be a non-reentrant checkpoint recompute: inside backward
    (``graph_task_id() != -1``) with a saved-tensor hook active. A reentrant recompute (no hook)
    and any forward outside backward answer False. Without the torch API to look at the hooks,
    every forward inside backward answers True (holding is the safe side)."""
    if graph_task_id() == -1:
        return False
    return _top_hooks is None or _top_hooks(False) is not None


class _State:
    """One coordinator's bookkeeping of the backward in progress."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # Modules whose backward began (pre-backward fetch) and has not ended, in begin order.
        self.backward_active: Dict[int, torch.nn.Module] = {}
        # Modules whose recomputed forward began and has not ended, in begin order.
        self.recompute_open: Dict[int, torch.nn.Module] = {}
        # Held param -> ds_ids of the modules that fetched it in a recompute and whose backward
        # has not ended; the params each such module / each trigger module holds.
        self.owners: Dict[torch.nn.Parameter, Set[int]] = {}
        self.by_owner: Dict[int, List[torch.nn.Parameter]] = {}
        self.by_trigger: Dict[int, List[torch.nn.Parameter]] = {}

    def empty(self) -> bool:
        return not (self.backward_active or self.recompute_open or self.owners)

    def hold(self, param: torch.nn.Parameter, owner: int, trigger: Optional[int]) -> None:
        owners = self.owners.get(param)
        if owners is None:
            owners = self.owners[param] = set()
            param.ds_active_sub_modules.add(RECOMPUTE_HOLD)
        if owner not in owners:
            owners.add(owner)
            self.by_owner.setdefault(owner, []).append(param)
        if trigger is not None and trigger != owner:
            self.by_trigger.setdefault(trigger, []).append(param)

    def _drop(self, param: torch.nn.Parameter) -> None:
        del self.owners[param]
        param.ds_active_sub_modules.discard(RECOMPUTE_HOLD)

    def backward_ended(self, module_id: int) -> List[torch.nn.Parameter]:
        """Ends the holds that end with this module's backward; returns the params to release."""
        self.backward_active.pop(module_id, None)
        released = []
        for param in self.by_trigger.pop(module_id, ()):
            owners = self.owners.get(param)
            # A module already in backward will not gather the param again: keep it for that one.
            if owners is not None and not any(o in self.backward_active for o in owners):
                self._drop(param)
                released.append(param)
        for param in self.by_owner.pop(module_id, ()):
            owners = self.owners.get(param)
            if owners is None:
                continue
            owners.discard(module_id)
            if not owners:
                self._drop(param)
                released.append(param)
        return released

    def take_all(self) -> Tuple[List[torch.nn.Module], List[torch.nn.Module],
                                List[torch.nn.Parameter]]:
        """Empties the state; returns (cut-short recomputed modules, modules whose backward did
        not end, held params), the holds removed from the latter."""
        cut_short = list(self.recompute_open.values())
        unfinished = list(self.backward_active.values())
        held = list(self.owners)
        for param in held:
            param.ds_active_sub_modules.discard(RECOMPUTE_HOLD)
        self.recompute_open.clear()
        self.backward_active.clear()
        self.owners.clear()
        self.by_owner.clear()
        self.by_trigger.clear()
        return cut_short, unfinished, held


def _state(coordinator: Any) -> _State:
    state = coordinator.__dict__.get(_STATE_ATTR)
    if state is None:
        state = coordinator.__dict__.setdefault(_STATE_ATTR, _State())
    return state


class _DeepSpeed:
    """The DeepSpeed objects the patch touches, resolved (and checked) at apply time."""

    def __init__(self) -> None:
        self.coordinator_module = importlib.import_module(_COORDINATOR_MODULE)
        self.offload_module = importlib.import_module(_OFFLOAD_MODULE)
        self.coordinator_cls = self.coordinator_module.PartitionedParameterCoordinator
        self.stage3_cls = importlib.import_module(_STAGE3_MODULE).DeepSpeedZeroOptimizer_Stage3
        self.engine_cls = importlib.import_module(_ENGINE_MODULE).DeepSpeedEngine
        self.iter_params = self.coordinator_module.iter_params
        self.z3_leaf_module = importlib.import_module("deepspeed.utils").z3_leaf_module
        self.available = importlib.import_module(
            "deepspeed.runtime.zero.partition_parameters").ZeroParamStatus.AVAILABLE
        missing = [f"PartitionedParameterCoordinator.{name}"
                   for name in ("fetch_sub_module", "release_sub_module", "reset_step",
                                _RELEASE_PARAM) if not hasattr(self.coordinator_cls, name)]
        if not hasattr(self.stage3_cls, "backward_epilogue"):
            missing.append("DeepSpeedZeroOptimizer_Stage3.backward_epilogue")
        if not hasattr(self.engine_cls, "backward"):
            missing.append("DeepSpeedEngine.backward")
        if not isinstance(getattr(self.offload_module, "FWD_MODULE_STACK", None), list):
            missing.append("parameter_offload.FWD_MODULE_STACK")
        if missing:
            raise RuntimeError("ds_z3native checkpoint_recompute: this DeepSpeed lacks "
                               f"{', '.join(missing)}; the patch targets DeepSpeed 0.19.x")
        self.has_upstream_attribution = hasattr(self.coordinator_module, _UPSTREAM_ATTRIBUTION)

    def params_of(self, module: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
        return self.iter_params(module, recurse=self.z3_leaf_module(module))


def _release(coordinator: Any, params: Iterable[torch.nn.Parameter]) -> None:
    release = getattr(coordinator, _RELEASE_PARAM)
    seen: Set[int] = set()
    for param in params:
        if id(param) in seen or param.ds_persist or param.is_external_param:
            continue
        seen.add(id(param))
        release(param)  # partitions it only if it is gathered and no module lists it


def _drop_from_stack(stack: List[torch.nn.Module], modules: List[torch.nn.Module]) -> None:
    """Removes the entries that forwards cut short left on ZeRO's forward module stack."""
    for module in reversed(modules):
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is module:
                del stack[i]
                break


def _release_leftovers(ds: _DeepSpeed, coordinator: Any, why: str) -> None:
    state = coordinator.__dict__.get(_STATE_ATTR)
    if state is None:
        return
    with state.lock:
        if state.empty():
            return
        cut_short, unfinished, held = state.take_all()
    params: List[torch.nn.Parameter] = list(held)
    for module in cut_short + unfinished:
        for param in ds.params_of(module):
            param.ds_active_sub_modules.discard(module.ds_id)
            params.append(param)
        # DeepSpeed >= 0.19.3 attributed recomputed frozen params to this module.
        attributed = getattr(module, _UPSTREAM_RECOMPUTE_SET, None)
        if attributed:
            for param in attributed:
                param.ds_active_sub_modules.discard(module.ds_id)
                params.append(param)
            attributed.clear()
    _drop_from_stack(ds.offload_module.FWD_MODULE_STACK, cut_short)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: releasing %d held params, %d modules whose backward did not end, %d "
                  "recomputed modules cut short", why, len(held), len(unfinished), len(cut_short))
    _release(coordinator, params)


def _release_all(ds: _DeepSpeed, coordinator: Any, module: torch.nn.Module) -> None:
    """After a backward that raised: release every gathered non-persistent param of ``module``,
    including those DeepSpeed's forward kept for a reuse the aborted backward never reached."""
    _release_leftovers(ds, coordinator, "backward raised")
    clean_inflight = getattr(coordinator, "_clean_inflight_param_registry", None)
    if clean_inflight is not None:
        clean_inflight()
    gathered = [p for p in module.parameters()
                if p.ds_status == ds.available and not p.ds_persist]
    for param in gathered:
        param.ds_active_sub_modules.clear()
    _release(coordinator, gathered)


def _coordinator_of(engine: Any) -> Any:
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload.get_param_coordinator() if offload is not None else None


_lock = threading.Lock()
_applied: Optional[Tuple[_DeepSpeed, bool]] = None


def applied_mode() -> Optional[str]:
    """``"holds"`` or ``"hardening"`` while :func:`apply_recompute_fix` is in effect, else None."""
    applied = _applied
    return None if applied is None else ("holds" if applied[1] else "hardening")


def release_leftovers(engine: Any) -> None:
    """Releases what a backward of ``engine`` left gathered. ``engine.backward`` does it itself
    while the fix is applied, and so does the next forward; call this after ``loss.backward()``
    when the memory must come back before then. A no-op when the fix is not applied."""
    applied = _applied
    coordinator = _coordinator_of(engine)
    if applied is not None and coordinator is not None:
        _release_leftovers(applied[0], coordinator, "release_leftovers()")


def apply_recompute_fix(holds: bool = True) -> Undo:
    """Applies the fix to the imported DeepSpeed (see the module docstring) and returns its undo.

    ``holds=True``: recompute holds, replacing DeepSpeed's own attribution where it has one
    (>= 0.19.3). ``holds=False``: the hardening only, DeepSpeed's attribution left in place.
    Loads ``ds_z3native``'s native module (for ``current_graph_task_id``) now, so that a clash
    with another ``dc`` library surfaces here and not in the middle of a backward. Undo between
    steps, not during a backward.
    """
    global _applied
    from .._native import load

    graph_task_id: Callable[[], int] = load().current_graph_task_id
    ds = _DeepSpeed()
    with _lock:
        if _applied is not None:
            raise RuntimeError("ds_z3native checkpoint_recompute is already applied "
                               f"({applied_mode()}); undo it first")
        undo = _patch(ds, holds, graph_task_id)
        _applied = (ds, holds)

    def undo_and_forget() -> None:
        global _applied
        with _lock:
            undo()
            _applied = None

    return undo_and_forget


def _patch(ds: _DeepSpeed, holds: bool, graph_task_id: Callable[[], int]) -> Undo:
    coordinator_cls = ds.coordinator_cls
    available = ds.available
    fetch_sub_module = coordinator_cls.fetch_sub_module
    release_sub_module = coordinator_cls.release_sub_module
    reset_step = coordinator_cls.reset_step
    backward_epilogue = ds.stage3_cls.backward_epilogue
    engine_backward = ds.engine_cls.backward

    @functools.wraps(fetch_sub_module)
    def fetch_sub_module_tracked(self: Any, current_submodule: torch.nn.Module,
                                 forward: bool) -> None:
        fetch_sub_module(self, current_submodule, forward)
        state = _state(self)
        module_id = current_submodule.ds_id
        if not forward:
            with state.lock:
                state.backward_active.pop(module_id, None)  # the latest begin goes last
                state.backward_active[module_id] = current_submodule
            return
        if not in_nonreentrant_recompute(graph_task_id):
            return
        with state.lock:
            state.recompute_open[module_id] = current_submodule
            if not holds:
                return
            trigger = next(reversed(state.backward_active), None)
            for param in ds.params_of(current_submodule):
                # Persistent params too: until DeepSpeed's trace is complete it releases them.
                if param.requires_grad or param.is_external_param or param.ds_status != available:
                    continue
                state.hold(param, module_id, trigger)

    @functools.wraps(release_sub_module)
    def release_sub_module_tracked(self: Any, submodule: torch.nn.Module,
                                   forward: bool = False) -> None:
        state = self.__dict__.get(_STATE_ATTR)
        if state is None:
            release_sub_module(self, submodule, forward)
            return
        if forward:
            with state.lock:
                recomputed = state.recompute_open.pop(submodule.ds_id, None) is not None
                in_backward = submodule.ds_id in state.backward_active
            # What the module's pre-backward gathered is for its backward, still under way:
            # its post-backward releases it.
            if not (recomputed and in_backward):
                release_sub_module(self, submodule, forward)
            return
        release_sub_module(self, submodule, forward)
        with state.lock:
            released = state.backward_ended(submodule.ds_id)
        if released:
            _release(self, released)

    @functools.wraps(reset_step)
    def reset_step_releasing_leftovers(self: Any) -> None:
        if graph_task_id() == -1:  # a forward's start, not a recompute of the root module
            _release_leftovers(ds, self, "forward start")
        reset_step(self)

    @functools.wraps(backward_epilogue)
    def backward_epilogue_releasing_leftovers(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = backward_epilogue(self, *args, **kwargs)
        # engine.backward runs the epilogue after autograd returns; loss.backward() and
        # engine.scale(loss).backward() run it from the graph task's final callback, once
        # DeepSpeed has seen every gradient of the backward (with reentrant checkpointing, of
        # the nested backwards too): in every case no module's backward is left to use what the
        # holds kept, so it is released here (as DeepSpeed 0.19.8's epilogue releases its own
        # leftovers), not only at the next forward's start.
        _release_leftovers(ds, self.parameter_offload.get_param_coordinator(), "end of backward")
        return result

    @functools.wraps(engine_backward)
    def backward_releasing_on_error(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return engine_backward(self, *args, **kwargs)
        except BaseException:
            coordinator = _coordinator_of(self)
            if coordinator is not None:
                _release_all(ds, coordinator, self.module)
            raise

    def no_upstream_attribution(*_args: Any, **_kwargs: Any) -> None:
        """Turned off by ds_z3native: its recompute holds replace this attribution."""

    not_traced = torch.compiler.disable  # like DeepSpeed's own coordinator methods
    edits: List[Tuple[Any, str, Any]] = [
        (coordinator_cls, "fetch_sub_module", not_traced(fetch_sub_module_tracked)),
        (coordinator_cls, "release_sub_module", not_traced(release_sub_module_tracked)),
        (coordinator_cls, "reset_step", not_traced(reset_step_releasing_leftovers)),
        (ds.stage3_cls, "backward_epilogue", backward_epilogue_releasing_leftovers),
        (ds.engine_cls, "backward", backward_releasing_on_error),
    ]
    if holds and ds.has_upstream_attribution:
        edits.append((ds.coordinator_module, _UPSTREAM_ATTRIBUTION, no_upstream_attribution))

    undo = replace_attributes(edits)
    log.debug("checkpoint_recompute applied (holds=%s, %d edits)", holds, len(edits))
    return undo


# What both patches wrap or read: the coordinator's fetch/release/reset and its private release,
# stage 3's backward epilogue, the engine's backward, and ZeRO's forward module stack.
_TARGETS = (
    f"{_COORDINATOR_MODULE}:PartitionedParameterCoordinator.fetch_sub_module",
    f"{_COORDINATOR_MODULE}:PartitionedParameterCoordinator.release_sub_module",
    f"{_COORDINATOR_MODULE}:PartitionedParameterCoordinator.reset_step",
    f"{_COORDINATOR_MODULE}:PartitionedParameterCoordinator.__release_param",
    f"{_STAGE3_MODULE}:DeepSpeedZeroOptimizer_Stage3.backward_epilogue",
    f"{_ENGINE_MODULE}:DeepSpeedEngine.backward",
    f"{_OFFLOAD_MODULE}:FWD_MODULE_STACK",
)

RECOMPUTE_FROZEN = Patch(
    name="checkpoint-recompute-frozen",
    summary=("eager ZeRO-3 + non-reentrant activation checkpointing: frozen params fetched in a "
             "recompute stay gathered until their last use in backward; whatever a backward "
             "leaves gathered is released"),
    apply=functools.partial(apply_recompute_fix, holds=True),
    first=Version("0.19.0"),
    last=Version("0.19.2"),
    # DeepSpeed's own attribution, turned off while holds replace it (absent before 0.19.3).
    wraps=_TARGETS + (f"{_COORDINATOR_MODULE}:{_UPSTREAM_ATTRIBUTION}",),
)

RECOMPUTE_HARDENING = Patch(
    name="checkpoint-recompute-hardening",
    summary=("eager ZeRO-3 + non-reentrant activation checkpointing, beside DeepSpeed's own "
             "recompute fix: a recompute keeps what a running backward gathered; whatever a "
             "backward leaves gathered (or an exception in it) is released"),
    apply=functools.partial(apply_recompute_fix, holds=False),
    first=Version("0.19.3"),
    last=Version("0.19.8"),
    wraps=_TARGETS,
)

PATCHES: List[Patch] = [RECOMPUTE_FROZEN, RECOMPUTE_HARDENING]
