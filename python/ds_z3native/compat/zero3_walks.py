"""ZeRO-3's per-step walks of the whole model (the optimizer step's release of every param,
DeepCompile's eager fallback around every forward), over kept module and parameter lists.

``DeepSpeedZeroOptimizer_Stage3.step()`` first calls ``partition_all_parameters()``, which walks
the whole model three times: ``PartitionedParameterCoordinator.release_and_reset_all(module)``
walks ``named_parameters()`` once to wait for in-flight gathers, clear each param's active
submodules and release it, and once more to check every param came back partitioned;
``DeepSpeedZeRoOffload.partition_all_parameters()`` then checks again over a third walk. Each walk
goes through ``named_modules()`` of every module: on a 1 B LoRA model (16 layers, about 1,300
modules, 371 params) that is most of the optimizer step's host time, every step, where a
DeepCompile step is host-bound.

:data:`ZERO3_RELEASE_PARAM_LIST` does the same per parameter (the same waits, clears, releases and
checks, in one pass plus one check) over a list of the model's parameters kept between steps
(:data:`~ds_z3native.compat.module_lists.LISTS`, dropped when a module of the model registers a
parameter or a submodule) plus the root module's external parameters, read fresh each call as
DeepSpeed's walk reads them. A param that is not gathered and has no gather in flight costs two
attribute reads.

:data:`DEEPCOMPILE_FALLBACK_MODULE_LIST`: DeepSpeed's eager fallback for DeepCompile ZeRO-3
(``deepspeed.compile.z3_eager_fallback``, 0.19.4 and later) walks ``modules()`` as every compiled
forward starts and again as it ends (to switch each module's ``_parameters`` into and out of its
gather-on-access mode) and ``parameters()`` before it (to release params left gathered): three
more walks per forward, on the host path of every compiled step. The same per-module and
per-param work runs over the kept lists.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List

from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, wrap_method
from .module_lists import LISTS, param_list

__all__ = ["DEEPCOMPILE_FALLBACK_MODULE_LIST", "PATCHES", "ZERO3_RELEASE_PARAM_LIST",
           "listed_params"]

log = logging.getLogger(__name__)

# DeepSpeed's private members of PartitionedParameterCoordinator, as Python mangles them.
_INFLIGHT = "_PartitionedParameterCoordinator__inflight_param_registry"
_RELEASE = "_PartitionedParameterCoordinator__release_param"


def listed_params(module: Any) -> List[Any]:
    """The params DeepSpeed's ``iter_params(module, recurse=True)`` yields: every parameter of the
    tree (kept list), then the module's own external parameters (ZeRO-3's
    ``register_external_parameter``), read now."""
    params = LISTS.get(module, "params", param_list)
    external = getattr(module, "_external_params", None)
    if external:
        return params + list(external.values())
    return params


def _not_released(param: Any) -> RuntimeError:
    summary = param.ds_summary() if hasattr(param, "ds_summary") else repr(param)
    return RuntimeError(f"partition_all_parameters: {summary} expected to be released")


def _releasing_listed(release_and_reset_all: Callable) -> Callable:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    available, not_available = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE

    def release_and_reset_all_listed(self: Any, module: Any) -> None:
        inflight = getattr(self, _INFLIGHT, None)
        release = getattr(self, _RELEASE, None)
        if inflight is None or release is None:  # not the coordinator this was written for
            return release_and_reset_all(self, module)
        import torch

        with torch.no_grad():
            params = listed_params(module)
            for param in params:
                active = getattr(param, "ds_active_sub_modules", None)
                if active is None:
                    # Not a ZeRO-3 param: a module removed from the tree since the list was kept
                    # (removals register nothing), or one DeepSpeed never converted. The walk of
                    # the tree as it is now tells which, and does what DeepSpeed does.
                    return release_and_reset_all(self, module)
                if inflight:
                    handle = inflight.pop(param, None)
                    if handle is not None:
                        handle.wait()
                active.clear()
                if param.ds_status == available:
                    release(param)
            for param in params:
                if param.ds_status != not_available:
                    raise _not_released(param)
        return None

    return release_and_reset_all_listed


def _checking_listed(partition_all_parameters: Callable) -> Callable:
    def partition_all_parameters_listed(self: Any) -> None:
        module = getattr(self, "module", None)
        if module is None:
            return partition_all_parameters(self)
        # The release checks every param it went over came back partitioned (DeepSpeed's own
        # release, where it takes over, checks as well): a second pass would find nothing more.
        self.get_param_coordinator().release_and_reset_all(module)
        return None

    return partition_all_parameters_listed


def patch_release_walk() -> Undo:
    """Both walks of ``partition_all_parameters`` go over the kept parameter list."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator

    return undo_all([
        LISTS.track(),
        wrap_method(PartitionedParameterCoordinator, "release_and_reset_all", _releasing_listed),
        wrap_method(DeepSpeedZeRoOffload, "partition_all_parameters", _checking_listed)])


ZERO3_RELEASE_PARAM_LIST = Patch(
    name="zero3-release-param-list",
    summary="ZeRO-3's optimizer step releases and checks every param over a kept parameter list "
            "instead of three named_parameters() walks of the whole model per step",
    apply=patch_release_walk,
    wraps=("deepspeed.runtime.zero.partitioned_param_coordinator:"
           "PartitionedParameterCoordinator.release_and_reset_all",
           "deepspeed.runtime.zero.partitioned_param_coordinator:"
           "PartitionedParameterCoordinator.__release_param",
           "deepspeed.runtime.zero.partitioned_param_coordinator:"
           "PartitionedParameterCoordinator.__inflight_param_registry",
           "deepspeed.runtime.zero.partitioned_param_coordinator:iter_params",
           "deepspeed.runtime.zero.partitioned_param_coordinator:get_all_parameters",
           "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload.partition_all_parameters"),
    first=Version("0.19.0"),
    last=None,
)


# ---- DeepCompile's eager fallback ----------------------------------------------------------------

def _switching_listed(on: bool) -> Callable[[Callable], Callable]:
    """``_enable_forward_fallback`` (``on``) / ``_disable_forward_fallback`` over the kept module
    list: every module's ``_parameters`` made DeepSpeed's ZeRO dict and put into its forward mode;
    out of it again for those that are one."""

    def make(switch: Callable) -> Callable:
        from deepspeed.runtime.zero.parameter_offload import (ZeROOrderedDict,
                                                              ensure_zero_ordered_dict)

        def switch_forward_fallback_listed(self: Any) -> None:
            root = getattr(getattr(self, "engine", None), "module", None)
            if root is None:
                return switch(self)
            for module in LISTS.modules(root):
                params = module._parameters
                if on:
                    if not isinstance(params, ZeROOrderedDict):  # else ensure() does nothing
                        ensure_zero_ordered_dict(module)
                        params = module._parameters
                    params._in_forward = True
                elif isinstance(params, ZeROOrderedDict):
                    params._in_forward = False
            return None

        return switch_forward_fallback_listed

    return make


def _releasing_before_forward_listed(release: Callable) -> Callable:
    from deepspeed.runtime.zero.partition_parameters import (
        DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, ZeroParamStatus)

    available = ZeroParamStatus.AVAILABLE

    def release_available_params_for_next_forward_listed(self: Any) -> None:
        engine = getattr(self, "engine", None)
        if engine is None or not hasattr(self, "_outstanding_forward_graph_ids"):
            return release(self)
        import torch

        with torch.no_grad():
            released = self._release_unclaimed_tracked_params()
            if not self._outstanding_forward_graph_ids:
                for param in LISTS.get(engine.module, "params", param_list):
                    if (getattr(param, "ds_status", None) == available
                            and not getattr(param, "ds_persist", False)
                            and not getattr(param, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)):
                        param.partition()
                        released.append(param.ds_id)
            self._last_pre_forward_released_param_ids = released
        return None

    return release_available_params_for_next_forward_listed


_FALLBACK_METHODS = ("_enable_forward_fallback", "_disable_forward_fallback",
                     "release_available_params_for_next_forward",
                     "_release_unclaimed_tracked_params")


def patch_fallback_walks() -> Undo:
    """The eager fallback's three walks per forward go over the kept lists (nothing to do where
    the running DeepSpeed has no such fallback, or one without a release before each forward:
    0.19.3's)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed.compile.z3_eager_fallback") is None:
        return lambda: None
    from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback as Fallback

    if not all(name in vars(Fallback) for name in _FALLBACK_METHODS):
        return lambda: None
    return undo_all([
        LISTS.track(),
        wrap_method(Fallback, "_enable_forward_fallback", _switching_listed(True)),
        wrap_method(Fallback, "_disable_forward_fallback", _switching_listed(False)),
        wrap_method(Fallback, "release_available_params_for_next_forward",
                    _releasing_before_forward_listed)])


_FALLBACK = "deepspeed.compile.z3_eager_fallback:DeepCompileZ3EagerFallback."

DEEPCOMPILE_FALLBACK_MODULE_LIST = Patch(
    name="deepcompile-z3-fallback-module-list",
    summary="DeepSpeed's eager fallback for DeepCompile ZeRO-3 switches every module's params "
            "into and out of forward mode, and releases params left gathered, over kept module "
            "and parameter lists instead of three walks of the whole model per forward",
    apply=patch_fallback_walks,
    wraps=(_FALLBACK + "_enable_forward_fallback",
           _FALLBACK + "_disable_forward_fallback",
           _FALLBACK + "release_available_params_for_next_forward",
           _FALLBACK + "_release_unclaimed_tracked_params",
           "deepspeed.runtime.zero.parameter_offload:ensure_zero_ordered_dict"),
    first=Version("0.19.4"),
    last=None,
)

PATCHES: List[Patch] = [ZERO3_RELEASE_PARAM_LIST, DEEPCOMPILE_FALLBACK_MODULE_LIST]
