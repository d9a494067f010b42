"""Cheaper collections around DeepCompile's passes; no reductions over one rank in its profilers.

Two costs of a cold DeepCompile compile that do nothing for its result in common setups, found
in a cProfile of the 1 B LoRA model's 16-layer single-cycle compile on one H200:

* :data:`PASS_GC` (every release): ``run_opt_passes`` runs a full ``gc.collect()`` before its
  passes and after each one (so that tensors caught in reference cycles are freed before the
  next memory profile). A full collection walks every tracked object of the process (torch,
  transformers, Dynamo's and inductor's state, the graphs): about 0.76 s each there, 14 of them,
  10.7 s. With the patch the passes run with the objects alive at their start frozen
  (``gc.freeze()`` after one full collection): DeepSpeed's collections then walk only what was
  made since, which holds every tensor a pass or its profiling run creates, and the objects are
  unfrozen when the passes end (also on an error). An object alive at the passes' start that
  dies inside a reference cycle during them is freed by the first collection after them, not
  between two passes. Objects the process had frozen before (a library freezing its heap before
  it forks workers) are unfrozen with them: collectable again, as before that freeze
  (:func:`pass_gc_stats` counts such runs).
* :data:`ONE_RANK_PROFILE` (every release): DeepCompile's profilers (``ProfilingInterpreter``,
  ``MemoryProfilingInterpreter`` and their helpers) reduce a few values across ranks for every
  graph node they run (about 106,000 reductions in that compile, each a collective's launch and
  then a read of its result). Over a process group of one rank a reduction returns its input, and
  the patch skips the collective there (the reads stay, DeepSpeed's); a barrier there becomes a
  wait for the device, which is what a barrier on one rank does. A group of two or more ranks
  reduces as before.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from packaging.version import Version

from ..run_state import RUN_STATE
from . import Patch, Undo
from ._rebind import replace_attributes, when_module_imported, wrap_function

__all__ = ["PASS_GC", "ONE_RANK_PROFILE", "PATCHES", "OneRankComm", "PassGcStats",
           "pass_gc_stats", "patch_pass_gc", "patch_one_rank_profile"]

log = logging.getLogger(__name__)

BACKEND_MODULE = "deepspeed.compile.backend"
PROFILE_MODULE = "deepspeed.compile.profilers.graph_profile"


@dataclass
class PassGcStats:
    """What :data:`PASS_GC` did in this process: ``frozen`` runs of the passes with the objects
    alive at their start frozen; ``thawed`` of them found objects someone else had frozen, which
    are unfrozen with ours when the passes end."""

    frozen: int = 0
    thawed: int = 0
    running: bool = dataclasses.field(default=False, repr=False)  # passes running frozen now


_STATS = PassGcStats()


def pass_gc_stats() -> Dict[str, int]:
    """:class:`PassGcStats` of this process, as a dict."""
    return {"frozen": _STATS.frozen, "thawed": _STATS.thawed}


def _freezing_passes(run_opt_passes: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        if _STATS.running:  # inside passes already running frozen: they unfreeze at their end
            return run_opt_passes(*args, **kwargs)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        found = gc.get_freeze_count()
        if found:
            # Frozen by someone else (a library freezing before it forks workers, say): the
            # unfreeze below thaws them too. They become collectable again, as they were
            # before that freeze; nothing alive is freed by it.
            _STATS.thawed += 1
            log.debug("DeepCompile's passes: %d objects were already frozen; they are unfrozen "
                      "with the passes' own when the passes end", found)
        # Outside the compile's fake mode, as DeepSpeed's own collections: finalizers that run
        # see real tensors.
        with unset_fake_temporarily():
            gc.collect()
        gc.freeze()
        _STATS.frozen += 1
        _STATS.running = True
        try:
            return run_opt_passes(*args, **kwargs)
        finally:
            _STATS.running = False
            gc.unfreeze()

    return run


def patch_pass_gc() -> Undo:
    """``deepspeed.compile.backend.run_opt_passes`` runs with the objects alive at its start
    frozen, so its ``gc.collect()`` calls walk only what the passes made."""
    return when_module_imported(
        BACKEND_MODULE,
        lambda: wrap_function([importlib.import_module(BACKEND_MODULE)], "run_opt_passes",
                              _freezing_passes))


def _argument(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, name: str,
              default: Any = None) -> Any:
    """A collective's argument given by position (after the tensor) or by name."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class OneRankComm:
    """``deepspeed.comm`` as DeepCompile's profilers see it: ``all_reduce`` over a group of one
    rank returns at once (the tensor already holds the result) and ``barrier`` there waits for
    the device; anything else, and any group of more ranks or an asynchronous call, is
    ``deepspeed.comm``'s own."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle probing a half-built proxy: not deepspeed.comm's
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_comm"), name)

    def _one_rank(self, group: Any, async_op: Any) -> bool:
        if async_op or not self._comm.is_initialized():
            return False
        return self._comm.get_world_size(group=group) == 1

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """``deepspeed.comm.all_reduce(tensor, op, group, async_op, ...)``; a no-op on one rank."""
        if self._one_rank(_argument(args, kwargs, 1, "group"),
                          _argument(args, kwargs, 2, "async_op", False)):
            return None
        return self._comm.all_reduce(tensor, *args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        """``deepspeed.comm.barrier(group, async_op, ...)``; a device wait on one rank."""
        if self._one_rank(_argument(args, kwargs, 0, "group"),
                          _argument(args, kwargs, 1, "async_op", False)):
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()
            return None
        return self._comm.barrier(*args, **kwargs)


def patch_one_rank_profile() -> Undo:
    """DeepCompile's profiling module reaches ``deepspeed.comm`` through :class:`OneRankComm`."""

    def apply() -> Undo:
        module = importlib.import_module(PROFILE_MODULE)
        comm = getattr(module, "dist", None)
        if comm is None or isinstance(comm, OneRankComm):
            log.debug("%s.dist is %r; left as it is", PROFILE_MODULE, comm)
            return lambda: None
        return replace_attributes([(module, "dist", OneRankComm(comm))])

    return when_module_imported(PROFILE_MODULE, apply)


PASS_GC = Patch(
    name="deepcompile-pass-gc",
    summary="DeepCompile's passes run with the objects alive at their start frozen, so the full "
            "garbage collection before and after each pass walks only what the passes made",
    apply=patch_pass_gc,
    first=Version("0.19.0"),
    last=None,
    wraps=("deepspeed.compile.backend:run_opt_passes",),
)

ONE_RANK_PROFILE = Patch(
    name="deepcompile-one-rank-profile",
    summary="DeepCompile's profilers skip their per-node reductions and barriers over a process "
            "group of one rank (the values are already the result)",
    apply=patch_one_rank_profile,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.profilers.graph_profile:dist",
        "deepspeed.compile.profilers.graph_profile:ProfilingInterpreter.run_node",
        "deepspeed.compile.profilers.graph_profile:MemoryProfilingInterpreter.run_node",
    ),
)

PATCHES: List[Patch] = [PASS_GC, ONE_RANK_PROFILE]


def _clear_stats() -> None:
    _STATS.frozen = _STATS.thawed = 0


RUN_STATE.register("pass_gc", pass_gc_stats, _clear_stats)
