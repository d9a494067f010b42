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
from . import settings
from ._version import __version__
from .settings import (GROUP_PERSISTENT_ENV, GROUP_REDUCE_ENV, PERSISTENCE_BUDGET_ENV,
                       PREFETCH_BUDGET_ENV, PROFILE_STORE_ENV, SINGLE_CYCLE_ENV, WARM_START_ENV,
                       Settings)
from .installer import (InstallError, InstallReport, UnsupportedDeepSpeed, UnverifiedPatchTarget,
                        install, installed, uninstall)

__all__ = ["native", "build_info", "current_graph_task_id", "DcNamespaceTaken",
           "existing_dc_owner", "__version__", "install", "uninstall", "installed",
           "InstallReport", "InstallError", "UnsupportedDeepSpeed", "UnverifiedPatchTarget",
           "set_persistence_budget",
           "PERSISTENCE_BUDGET_ENV", "set_prefetch_budget", "PREFETCH_BUDGET_ENV",
           "set_profile_store", "PROFILE_STORE_ENV", "set_group_persistent",
           "GROUP_PERSISTENT_ENV", "set_group_reduce", "GROUP_REDUCE_ENV", "set_warm_start",
           "WARM_START_ENV", "set_single_cycle",
           "SINGLE_CYCLE_ENV", "Settings",
           "current_settings"]

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


def current_settings() -> Settings:
    """This process's settings (persistence and prefetch budgets, profile store) as the setters
    below left them or,
    where no setter was called, as ``DS_Z3NATIVE_*`` gave them when first needed (see
    :mod:`ds_z3native.settings`)."""
    return settings.current()


def set_persistence_budget(mib: Optional[float]) -> None:
    """Cap the memory DeepCompile's selective gather may keep gathered, in MiB (``None``: no cap,
    DeepSpeed's behaviour). After profiling, DeepCompile marks params persistent
    (``set_persistent``) while it estimates free GPU memory, trading memory for fewer gathers;
    with a cap, ds_z3native keeps only what fits and the others are gathered and released at
    each use as before. DeepCompile registers every param non-persistent (its ``init_z3`` clears
    DeepSpeed's own persistence threshold), so with a cap of 0 nothing stays gathered between
    uses, small norm weights included. On one rank a gathered param is its shard itself: keeping
    it takes no memory and counts 0 bytes against the cap. Use the same cap on every rank: a
    param kept persistent is gathered at once, a collective that every rank must join.

    Applies to the live runtime, if any, and to every later ``init()`` in this process (the
    native module's default, ``_C.set_default_persistence_budget``). This process only: nothing
    is written to ``os.environ``, so child processes (spawned ranks, subprocesses) keep the
    default their own environment gives (``DS_Z3NATIVE_PERSISTENCE_BUDGET_MB``, read when they
    first need it): set the variable before starting them, or call this in each of them.
    ValueError naming this function and the value for anything but ``None`` or MiB in
    [0, 1e12)."""
    value = settings.check_budget_mib(mib, "set_persistence_budget")
    m = load()
    new = settings.update(persistence_budget_mib=value)  # the native default follows
    if m.is_initialized():
        m.set_persistence_budget(new.persistence_budget_bytes)


def set_prefetch_budget(mib: Optional[float]) -> None:
    """Cap DeepCompile's prefetch window, in MiB (``None``: no cap, DeepSpeed's behaviour).
    After profiling, DeepCompile's prefetch pass moves all-gathers ahead of their use while the
    gathered bytes in flight stay under 4e9 bytes and 90% of the device's memory, so on a large
    GPU most of a small model can be gathered at once. With a cap, at most ``mib`` MiB of
    prefetched params are in flight; 0 gathers each param just before its first use (least
    memory, least overlap). Together with ``set_persistence_budget(0)`` this brings DeepCompile's
    peak close to eager ZeRO-3's.

    Takes effect at DeepCompile's next planning (its 6th step, or a recompile) while ds_z3native
    is installed (patch ``deepcompile-prefetch-budget``). This process only: nothing is written
    to ``os.environ``, so child processes keep the default their own environment gives
    (``DS_Z3NATIVE_PREFETCH_BUDGET_MB``, read when they first need it): set the variable before
    starting them, or call this in each of them. Use the same cap on every rank: it shapes the
    compiled graph's collectives. ValueError naming this function and the value for anything
    but ``None`` or MiB in [0, 1e12)."""
    settings.update(prefetch_budget_mib=settings.check_budget_mib(mib, "set_prefetch_budget"))


def set_group_persistent(enabled: bool) -> None:
    """Whether DeepCompile's re-plan reaches the params it keeps gathered with one op call per
    graph (``True``, the default) or with DeepSpeed's three calls per use (``False``).

    DeepCompile keeps params gathered across steps when memory allows (its ``selective_gather``
    pass, at the end of the re-plan after its 5th step). With this on, that choice is made at the
    start of the re-plan from the first cycle's profiles, by DeepSpeed's own pass, and the
    re-planned graphs reach those params with one ``ds_z3native::gather_persistent`` call each
    instead of an ``allgather_param``, ``wait_allgather`` and ``release_param`` per use: host
    time a host-bound step no longer spends. The values computed are the same.

    Read at each re-plan while ds_z3native is installed (patch
    ``deepcompile-persistent-group``). This process only: nothing is written to ``os.environ``;
    child processes read ``DS_Z3NATIVE_GROUP_PERSISTENT`` (1/0), the default. Use the same setting
    on every rank. ValueError naming this function for anything but a bool."""
    settings.update(group_persistent=settings.check_switch(enabled, "set_group_persistent"))


def set_group_reduce(enabled: bool) -> None:
    """Whether DeepCompile's backward graphs hand their gradients to ds_z3native's reduction in
    groups, one op call per group (``True``, the default), or one ``reduce_grad`` call per
    gradient as DeepSpeed compiles them (``False``).

    A LoRA step reduces the gradient of every adapter matrix (224 on a 16-layer Llama with
    adapters on all linear layers), each through its own dispatcher call from inductor's code;
    the reduction itself is bucketed either way. With this on, consecutive ``reduce_grad`` calls
    of a backward graph become one ``ds_z3native::reduce_grads`` call at the last of them (at
    most 64 gradients or 64 MiB of them per call, so the gradients held for it stay small). The
    values reduced are the same.

    Read when DeepCompile hands a graph to inductor while ds_z3native is installed (patch
    ``deepcompile-grouped-reduce``). This process only: nothing is written to ``os.environ``;
    child processes read ``DS_Z3NATIVE_GROUP_REDUCE`` (1/0), the default. Use the same setting on
    every rank. ValueError naming this function for anything but a bool."""
    settings.update(group_reduce=settings.check_switch(enabled, "set_group_reduce"))


def set_warm_start(enabled: bool) -> None:
    """Whether a DeepCompile run whose profile store holds this job's re-plan starts from it
    (``True``, the default) or compiles and re-plans as a first run does (``False``).

    DeepCompile compiles every graph twice: at its first step with its gather and release pass
    only, and at its re-plan (after the 5th step) from scratch with the prefetch and persistence
    passes, on profiles taken then. With a profile store (:func:`set_profile_store`) a run records
    what its re-plan chose; a later run of the same job (a restart, a resumed run) then compiles
    the re-plan's graphs at its first step, from the stored profiles and inductor's cache, and
    does not re-plan. If the store does not hold its first graph, the run compiles and re-plans
    as a first run does. No effect without a profile store.

    Read at DeepCompile's first step while ds_z3native is installed (patch
    ``deepcompile-warm-start``). This process only: child processes read
    ``DS_Z3NATIVE_WARM_START`` (1/0), the default. Use the same setting on every rank.
    ValueError naming this function for anything but a bool."""
    settings.update(warm_start=settings.check_switch(enabled, "set_warm_start"))


def set_single_cycle(enabled: bool) -> None:
    """Whether a DeepCompile run that does not start warm compiles its graphs once
    (``True``) or twice, as DeepSpeed does (``False``, the default).

    DeepSpeed compiles every graph at its first step with its gather and release pass only, and
    again at its re-plan (after the 5th step) with the prefetch and persistence passes: the
    second compile costs about as long as the first. With this on, the first step runs the
    re-plan's passes at once, on the profiles that step measures, and no re-plan follows: about
    half the time to a steady state on a cold run. The params DeepSpeed's ``selective_gather``
    keeps gathered are chosen at the only cycle's last backward graph; the graphs compiled before
    it are compiled once more by inductor alone, reaching them with one ``gather_persistent``
    call per graph instead of DeepSpeed's three op calls per use (:func:`set_group_persistent`;
    patch ``deepcompile-single-cycle-regroup``). The choice is made before the optimizer's first
    step, so the memory its states will take is held back from it (two fp32 values per trainable element, an Adam-like optimizer; a resumed run
    whose states are loaded already holds that memory back twice and keeps fewer params
    gathered). A job run once benefits; a job restarted often gains more from a profile store
    (:func:`set_warm_start`), which this fills as a re-plan would: a later run starts warm from
    it. Only for DeepSpeed's default schedule (gather/release, then prefetch and selective
    gather); another schedule runs as configured.

    Read at DeepCompile's first step while ds_z3native is installed (patch
    ``deepcompile-warm-start``). This process only: child processes read
    ``DS_Z3NATIVE_SINGLE_CYCLE`` (1/0, default 0). Use the same setting on every rank.
    ValueError naming this function for anything but a bool."""
    settings.update(single_cycle=settings.check_switch(enabled, "set_single_cycle"))


def set_profile_store(directory: Optional[str | os.PathLike]) -> None:
    """Keep DeepCompile's graph profiles in ``directory`` and replay them in later runs
    (``None``: profile afresh each time, DeepSpeed's behaviour).

    DeepCompile orders each graph's all-gathers by the times it measured profiling that graph;
    timings vary from run to run, so two runs of the same job compile graphs in different orders
    and inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) cannot serve the second. With a store, the
    first run's profile of each graph is written there and a later run uses it once every rank
    has it: the same schedule, the same graphs, and inductor's cached code; the graph is then not
    profiled again (DeepCompile's profilers run every node 15 times).
    A stored profile describes the hardware it was measured on (the fingerprint names the device
    and group size); delete the directory to measure again.

    Applies while ds_z3native is installed (patch ``deepcompile-profile-store``). This process
    only: nothing is written to ``os.environ``, so child processes keep the default their own
    environment gives (``DS_Z3NATIVE_PROFILE_STORE``, read when they first need it): set the
    variable before starting them, or call this in each of them. Use the same setting on every
    rank. ValueError naming this function for an empty path or something not a path."""
    settings.update(profile_store=settings.check_profile_store(directory, "set_profile_store"))
