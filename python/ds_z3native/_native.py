"""Loads ds_z3native._C exactly once, refusing when another library already owns torch.ops.dc.

Two libraries that both define the ``dc`` operator namespace abort the process (a C++ static
initializer throws), so the check runs *before* the shared object is loaded.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from types import ModuleType
from typing import Optional

import torch

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
        _module = importlib.import_module("ds_z3native._C")
        log.debug("loaded ds_z3native._C (%s build)", _module.build_info()["flavour"])
        return _module
