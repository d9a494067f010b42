"""ds_z3native: DeepSpeed ZeRO-3 made correct and fast for models with frozen parameters.

``native()`` returns the compiled drop-in for ``deepspeed.ops.dc_op`` (loading it registers the
``torch.ops.dc`` operators); ``build_info()`` tells how it was built. ``install()`` makes
DeepSpeed's DeepCompile use it (and patches DeepSpeed's Python side for frozen params);
``uninstall()`` undoes that, ``installed()`` reports it. ``DS_Z3NATIVE=1`` runs ``install()`` at
``import deepspeed`` (see ``ds_z3native_autoload``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Dict

import torch

from ._native import DcNamespaceTaken, existing_dc_owner, load
from .installer import InstallError, InstallReport, UnsupportedDeepSpeed, install, installed, uninstall

__all__ = ["native", "build_info", "current_graph_task_id", "DcNamespaceTaken",
           "existing_dc_owner", "__version__", "install", "uninstall", "installed",
           "InstallReport", "InstallError", "UnsupportedDeepSpeed"]
__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def native() -> ModuleType:
    """The native module ``ds_z3native._C`` (loaded on first use, once per process)."""
    return load()


def build_info() -> Dict[str, Any]:
    """Flavour (``cpu``/``cuda``), the torch, CUDA and NCCL versions and arch list of the build,
    and whether the running torch matches the one it was built against."""
    info = dict(load().build_info())
    info["runtime_torch_version"] = torch.__version__
    info["torch_matches_build"] = info["torch_version"] == torch.__version__
    return info


def current_graph_task_id() -> int:
    """The autograd engine's current graph task id: -1 outside backward, >= 0 inside it."""
    return int(load().current_graph_task_id())
