"""Loads ds_z3native._C exactly once, refusing when another library already owns torch.ops.dc.

Two libraries that both define the ``dc`` operator namespace abort the process (a C++ static
initializer throws), so the check runs *before* the shared object is loaded.

After loading, every dc op with tensor arguments gets an error callback for the dispatch keys it
has no kernel for. The one that matters is the Undefined key: the dispatcher lands there when no
argument carries a tensor (Python passes None for a ``Tensor`` argument as an undefined tensor,
or a ``Tensor[]`` is empty), and torch's own message names the op but not the argument. A kernel
cannot serve that key alone: torch.library stores a kernel registered for it as a catch-all
(CompositeImplicitAutograd), which FakeTensorMode and AOT tracing would run in place of the Meta
kernels, and the dispatcher asserts that no kernel is stored under the Undefined key itself.
end_backward keeps DeepSpeed's catch-all (its ``Any deps`` may all be None).

The settings (:mod:`ds_z3native.settings`) are resolved before the shared object is loaded (a
malformed ``DS_Z3NATIVE_*`` variable is refused then, with nothing loaded), and the module gets
their persistence budget, the default of every later ``init()``, now and after each change.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from types import ModuleType
from typing import Callable, Optional

import torch

from . import settings

__all__ = ["load", "DcNamespaceTaken", "existing_dc_owner"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_module: Optional[ModuleType] = None


class DcNamespaceTaken(RuntimeError):
    """Another library registered the ``dc`` operators before ds_z3native could."""


def existing_dc_owner() -> Optional[str]:
    """Where the current ``dc::allgather_param`` registration comes from, or None if there is none."""
    if not torch._C._jit_get_schemas_for_operator("dc::allgather_param"):
        return None
    dump = torch._C._dispatch_dump("dc::allgather_param")
    match = re.search(r"registered at (\S+)", dump)
    return match.group(1) if match else "an unknown library"


def load() -> ModuleType:
    """Import and return ``ds_z3native._C`` (registering the ``dc`` ops), once per process."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        owner = existing_dc_owner()
        if owner is not None:
            raise DcNamespaceTaken(
                "torch.ops.dc is already registered by another library "
                f"(schema defined at {owner}); loading ds_z3native._C now would abort the process. "
                "This usually means DeepSpeed's own DeepCompile op (deepspeed.ops.dc_op, JIT-built or "
                "prebuilt) was loaded first: call ds_z3native.install() before engine.compile() / "
                "before anything calls get_deepcompile_handle(), or set DS_Z3NATIVE=1 so it happens "
                "at `import deepspeed`.")
        settings.current()  # a malformed variable is refused before anything is loaded
        module = importlib.import_module("ds_z3native._C")
        settings.subscribe(lambda s: module.set_default_persistence_budget(
            s.persistence_budget_bytes))
        _module = module
        _name_missing_tensor_arguments(_module.build_info()["flavour"])
        log.debug("loaded ds_z3native._C (%s build)", _module.build_info()["flavour"])
        return _module


def _missing_kernel_error(op: str, no_tensor: str, flavour: str) -> Callable[[str], None]:
    def report(key: str) -> None:
        if key == "Undefined":
            raise RuntimeError(f"ds_z3native {op}: {no_tensor}")
        devices = "CPU and CUDA" if flavour == "cuda" else "CPU (this build has no CUDA)"
        raise NotImplementedError(
            f"ds_z3native {op}: no kernel for dispatch key {key}: the dc ops run on {devices} "
            "tensors, and trace with meta or fake tensors")
    return report


def _name_missing_tensor_arguments(flavour: str) -> None:
    """Installs the error callbacks described in the module docstring (torch's hook for a missing
    kernel; it gets the dispatch key, not the arguments, which is enough: for these schemas the
    Undefined key means every Tensor argument is None or every Tensor[] is empty)."""
    set_callback = getattr(torch._C, "_dispatch_set_report_error_callback", None)
    if set_callback is None:  # an older torch: its own message stays
        return
    from .dc_ops import DC_OPS  # the op list csrc/ops/schema.cpp defines the ops from

    for name in (op.name for op in DC_OPS):
        schema = torch._C._jit_get_schemas_for_operator(f"dc::{name}")[0]
        tensors = [a.name for a in schema.arguments if isinstance(a.type, torch._C.TensorType)]
        lists = [a.name for a in schema.arguments if isinstance(a.type, torch._C.ListType)
                 and isinstance(a.type.getElementType(), torch._C.TensorType)]
        if tensors:
            no_tensor = (f"argument '{tensors[0]}' is None (an undefined tensor), where a tensor "
                         "is required")  # the ids are not known here: torch passes only the key
        elif lists:
            no_tensor = (f"argument '{lists[0]}' is an empty list: with no tensor among the "
                         "arguments the dispatcher has no kernel to choose")
        else:
            continue
        handle = torch._C._dispatch_find_schema_or_throw(f"dc::{name}", "")
        set_callback(handle, _missing_kernel_error(name, no_tensor, flavour))
