"""ds_z3native: DeepSpeed ZeRO-3 made correct and fast for models with frozen parameters.

``native()`` returns the compiled drop-in for ``deepspeed.ops.dc_op`` (loading it registers the
``torch.ops.dc`` operators); ``build_info()`` tells how it was built. ``install()`` makes
DeepSpeed's DeepCompile use it (and patches DeepSpeed's Python side for frozen params);
``uninstall()`` undoes that, ``installed()`` reports it. ``DS_Z3NATIVE=1`` runs ``install()`` at
``import deepspeed`` (see ``ds_z3native_autoload``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Dict, Optional

import torch

from ._native import DcNamespaceTaken, existing_dc_owner, load
from ._version import __version__
from .compat.deepcompile_prefetch import PREFETCH_BUDGET_ENV, parse_budget_mib
from .compat.deepcompile_profile_store import PROFILE_STORE_ENV
from .installer import (InstallError, InstallReport, UnsupportedDeepSpeed, UnverifiedPatchTarget,
                        install, installed, uninstall)

__all__ = ["native", "build_info", "current_graph_task_id", "DcNamespaceTaken",
           "existing_dc_owner", "__version__", "install", "uninstall", "installed",
           "InstallReport", "InstallError", "UnsupportedDeepSpeed", "UnverifiedPatchTarget",
           "set_persistence_budget",
           "PERSISTENCE_BUDGET_ENV", "set_prefetch_budget", "PREFETCH_BUDGET_ENV",
           "set_profile_store", "PROFILE_STORE_ENV"]

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


def current_graph_task_id() -> int:
    """The autograd engine's current graph task id: -1 outside backward, >= 0 inside it."""
    return int(load().current_graph_task_id())


PERSISTENCE_BUDGET_ENV = "DS_Z3NATIVE_PERSISTENCE_BUDGET_MB"


def set_persistence_budget(mib: Optional[float]) -> None:
    """Cap the memory DeepCompile's selective gather may keep gathered, in MiB (``None``: no cap,
    DeepSpeed's behaviour). After profiling, DeepCompile marks params persistent
    (``set_persistent``) while it estimates free GPU memory, trading memory for fewer gathers;
    with a cap, ds_z3native keeps only what fits and the others are gathered and released at
    each use as before. DeepCompile registers every param non-persistent (its ``init_z3`` clears
    DeepSpeed's own persistence threshold), so with a cap of 0 nothing stays gathered between
    uses, small norm weights included. Use the same cap on every rank: a param kept persistent is
    gathered at once, a collective that every rank must join.

    Applies to the live runtime, if any, and to every later ``init()`` in this process and its
    children (through ``DS_Z3NATIVE_PERSISTENCE_BUDGET_MB``, which can also be set directly)."""
    if mib is None:
        os.environ.pop(PERSISTENCE_BUDGET_ENV, None)
        nbytes = None
    else:
        mib = parse_budget_mib(mib, "set_persistence_budget")
        os.environ[PERSISTENCE_BUDGET_ENV] = repr(mib)
        nbytes = int(mib * 1024 * 1024)
    m = load()
    if m.is_initialized():
        m.set_persistence_budget(nbytes)


def set_prefetch_budget(mib: Optional[float]) -> None:
    """Cap DeepCompile's prefetch window, in MiB (``None``: no cap, DeepSpeed's behaviour).
    After profiling, DeepCompile's prefetch pass moves all-gathers ahead of their use while the
    gathered bytes in flight stay under 4e9 bytes and 90% of the device's memory, so on a large
    GPU most of a small model can be gathered at once. With a cap, at most ``mib`` MiB of
    prefetched params are in flight; 0 gathers each param just before its first use (least
    memory, least overlap). Together with ``set_persistence_budget(0)`` this brings DeepCompile's
    peak close to eager ZeRO-3's.

    Takes effect at DeepCompile's next planning (its 6th step, or a recompile) while ds_z3native
    is installed (patch ``deepcompile-prefetch-budget``), in this process and its children
    (through ``DS_Z3NATIVE_PREFETCH_BUDGET_MB``, which can also be set directly). Use the same
    cap on every rank: it shapes the compiled graph's collectives."""
    if mib is None:
        os.environ.pop(PREFETCH_BUDGET_ENV, None)
    else:
        os.environ[PREFETCH_BUDGET_ENV] = repr(parse_budget_mib(mib, "set_prefetch_budget"))


def set_profile_store(directory: Optional[str | os.PathLike]) -> None:
    """Keep DeepCompile's graph profiles in ``directory`` and replay them in later runs
    (``None``: profile afresh each time, DeepSpeed's behaviour).

    DeepCompile orders each graph's all-gathers by the times it measured profiling that graph;
    timings vary from run to run, so two runs of the same job compile graphs in different orders
    and inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) cannot serve the second. With a store, the
    first run's profile of each graph is written there and a later run uses it once every rank
    has it: the same schedule, the same graphs, and inductor's cached code. Profiling still runs.
    A stored profile describes the hardware it was measured on (the fingerprint names the device
    and group size); delete the directory to measure again.

    Applies while ds_z3native is installed (patch ``deepcompile-profile-store``), in this process
    and its children (through ``DS_Z3NATIVE_PROFILE_STORE``, which can also be set directly). Use
    the same setting on every rank."""
    if directory is None:
        os.environ.pop(PROFILE_STORE_ENV, None)
        return
    path = os.fspath(directory)
    if not str(path).strip():
        raise ValueError("set_profile_store: the directory is empty; pass None to turn the store off")
    os.environ[PROFILE_STORE_ENV] = str(path)
