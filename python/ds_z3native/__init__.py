"""ds_z3native: DeepSpeed ZeRO-3 made correct and fast for models with frozen parameters.

``native()`` returns the compiled drop-in for ``deepspeed.ops.dc_op`` (loading it registers the
``torch.ops.dc`` operators); ``build_info()`` tells how it was built. ``install()`` makes
DeepSpeed's DeepCompile use it (and patches DeepSpeed's Python side for frozen params);
``uninstall()`` undoes that, ``installed()`` reports it. ``DS_Z3NATIVE=1`` runs ``install()`` at
``import deepspeed`` (see ``ds_z3native_autoload``). ``configure()`` sets ds_z3native's settings
(:class:`Settings`; also a ``"ds_z3native"`` section of the DeepSpeed config and the
``DS_Z3NATIVE_*`` variables), ``current_settings()`` returns them.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Dict, Optional

import torch

from ._native import DcNamespaceTaken, existing_dc_owner, load
from . import settings
from ._version import __version__
from .settings import (GROUP_PERSISTENT_ENV, GROUP_REDUCE_ENV, PERSISTENCE_BUDGET_ENV,
                       PREFETCH_BUDGET_ENV, PROFILE_STORE_ENV, SINGLE_CYCLE_ENV, WARM_START_ENV,
                       Settings)
from .installer import (InstallError, InstallReport, UnsupportedDeepSpeed, UnverifiedPatchTarget,
                        install, installed, uninstall)

__all__ = ["native", "build_info", "current_graph_task_id", "stats", "reset_stats",
           "DcNamespaceTaken",
           "existing_dc_owner", "__version__", "install", "uninstall", "installed",
           "InstallReport", "InstallError", "UnsupportedDeepSpeed", "UnverifiedPatchTarget",
           "set_persistence_budget",
           "PERSISTENCE_BUDGET_ENV", "set_prefetch_budget", "PREFETCH_BUDGET_ENV",
           "set_profile_store", "PROFILE_STORE_ENV", "set_group_persistent",
           "GROUP_PERSISTENT_ENV", "set_group_reduce", "GROUP_REDUCE_ENV", "set_warm_start",
           "WARM_START_ENV", "set_single_cycle",
           "SINGLE_CYCLE_ENV", "Settings",
           "current_settings", "configure"]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def native() -> ModuleType:
    """The native module ``ds_z3native._C`` (loaded on first use, once per process)."""
    return load()


def build_info() -> Dict[str, Any]:
    """Flavour (``cpu``/``cuda``), the torch, CUDA and NCCL versions and arch list of the build,
    where its CUDA runtime came from (``cuda_source``: ``toolkit`` or ``wheels``) or why it has
    none (``cpu_reason``, e.g. ``cpu-torch``, ``no-cuda-runtime``), and whether the running torch
    matches the one it was built against."""
    info = dict(load().build_info())
    info["runtime_torch_version"] = torch.__version__
    info["torch_matches_build"] = info["torch_version"] == torch.__version__
    return info


def stats() -> Dict[str, Any]:
    """What every patch did in this process, by part name (graphs rewritten, profiles stored and
    replayed, warm starts, gradient norms taken over one span...): see
    :mod:`ds_z3native.run_state`."""
    from . import run_state
    from .compat import registry

    registry.all_patches()  # imports every patch module: each registers its counters
    return run_state.stats()


def reset_stats() -> None:
    """Clear every patch's counters and the per-run state they belong to, as in a new process."""
    from . import run_state
    from .compat import registry

    registry.all_patches()
    run_state.reset()


def current_graph_task_id() -> int:
    """The autograd engine's current graph task id: -1 outside backward, >= 0 inside it."""
    return int(load().current_graph_task_id())


def current_settings() -> Settings:
    """This process's settings (:class:`Settings`), as the environment, :func:`configure` and a
    ``"ds_z3native"`` section of the DeepSpeed config left them (:mod:`ds_z3native.settings`)."""
    return settings.current()


def configure(**fields: Any) -> Settings:
    """Set the named fields of this process's :class:`Settings` (``help(ds_z3native.Settings)``
    says what each does, the values it takes and the variable that gives its default), e.g.
    ``configure(persistence_budget_mib=512, single_cycle=True)``; returns the new settings.

    Every value is checked before any is applied: ValueError naming the field and the value for
    a bad one, naming an unknown field and listing the settings; nothing changes then. The
    persistence budget also reaches the live native runtime, if one is initialized. This process
    only: nothing is written to ``os.environ``, so child processes (spawned ranks, subprocesses)
    read their own ``DS_Z3NATIVE_*`` variables; a ``"ds_z3native"`` section of the DeepSpeed
    config, with the same keys, reaches every rank and is applied when an engine is created
    with it, over what was set before."""
    return settings.apply("configure({}=...)", fields)


def set_persistence_budget(mib: Optional[float]) -> None:
    """``configure(persistence_budget_mib=mib)``; see that field of :class:`Settings`."""
    settings.apply("set_persistence_budget", {"persistence_budget_mib": mib})


def set_prefetch_budget(mib: Optional[float]) -> None:
    """``configure(prefetch_budget_mib=mib)``; see that field of :class:`Settings`."""
    settings.apply("set_prefetch_budget", {"prefetch_budget_mib": mib})


def set_profile_store(directory: Optional[str | os.PathLike]) -> None:
    """``configure(profile_store=directory)``; see that field of :class:`Settings`."""
    settings.apply("set_profile_store", {"profile_store": directory})


def set_group_persistent(enabled: bool) -> None:
    """``configure(group_persistent=enabled)``; see that field of :class:`Settings`."""
    settings.apply("set_group_persistent", {"group_persistent": enabled})


def set_group_reduce(enabled: bool) -> None:
    """``configure(group_reduce=enabled)``; see that field of :class:`Settings`."""
    settings.apply("set_group_reduce", {"group_reduce": enabled})


def set_warm_start(enabled: bool) -> None:
    """``configure(warm_start=enabled)``; see that field of :class:`Settings`."""
    settings.apply("set_warm_start", {"warm_start": enabled})


def set_single_cycle(enabled: bool) -> None:
    """``configure(single_cycle=enabled)``; see that field of :class:`Settings`."""
    settings.apply("set_single_cycle", {"single_cycle": enabled})
