"""DeepCompile in a real training loop: evaluation forwards and resumed runs.

Two faults of DeepSpeed's DeepCompile (0.19.0 - 0.19.8) that an HF Trainer / TRL / accelerate
run meets, each fixed by a patch:

* :data:`DEEPCOMPILE_KWARGS_DEPENDENCIES`: DeepCompile's ZeRO-3 list scheduler reads a node's
  inputs from its positional arguments only (``list_schedule.filter_args`` and
  ``list_schedule.get_node_requirements``; its last-use analysis, ``util.get_last_uses``, does
  read keyword arguments). The no-grad graph of an HF Llama passes the attention mask to SDPA
  as ``attn_mask=where``: the scheduler placed the SDPA node before the ``where`` that computes
  its mask and failed with ``KeyError: 'where'`` (``make_graph_from_schedule``) at the first
  evaluation of every Trainer run with ``eval_strategy`` set. With the patch keyword inputs are
  dependencies like positional ones; for graphs without them the schedule is the same. The
  patched walk also keeps the set of scheduled nodes from one call to the next (:class:`_Scheduled`)
  where DeepSpeed's builds it from the whole list on each call: the same schedule, in a ninth of
  the time on a 16-layer decoder's forward graph and half on its backward.
* :data:`DEEPCOMPILE_RESUME_SCHEDULE`: DeepSpeed launches its compile passes when the engine's
  ``global_steps`` equals a scheduled step (0, then 5 for the profile-driven re-plan).
  ``load_checkpoint`` sets ``global_steps`` to the checkpoint's step, so a resumed run never
  launched the first entry and its first forward failed in ``run_opt_passes`` (``TypeError:
  'NoneType' object is not iterable``). With the patch, when the step count is found past the
  next scheduled step (a checkpoint was loaded), the rest of the schedule moves by the
  difference: a resumed run compiles at its first step and re-plans as many steps later as a
  fresh run does.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Set, Tuple

from packaging.version import Version

from . import Patch, Undo
from ._rebind import rebind_when_imported, undo_all, when_module_imported, wrap_function

__all__ = ["DEEPCOMPILE_KWARGS_DEPENDENCIES", "DEEPCOMPILE_RESUME_SCHEDULE", "PATCHES",
           "shift_schedule", "wrap_launch_compile_passes"]

log = logging.getLogger(__name__)

SCHEDULE_MODULE = "deepspeed.compile.list_schedule"
BACKEND_MODULE = "deepspeed.compile.backend"
# Modules that hold their own reference to launch_compile_passes.
LAUNCH_OWNERS = (BACKEND_MODULE, "deepspeed.compile.init_z3", "deepspeed.compile.init_z1",
                 "deepspeed.compile.init_z1_and_2", "deepspeed.compile.init_z2")


def _flat_nodes(value: Any) -> List[Any]:
    from torch.fx.node import map_arg

    found: List[Any] = []
    map_arg(value, found.append)
    return found


def _with_kwarg_inputs(filter_args: Callable) -> Callable:
    def filter_args_and_kwargs(node: Any) -> List[Any]:
        found = list(filter_args(node))
        for extra in _flat_nodes(node.kwargs):
            if extra not in found:
                found.append(extra)
        return found

    return filter_args_and_kwargs


class _Scheduled:
    """The nodes of a scheduler's ``scheduled`` list as a set, kept across calls.

    DeepSpeed's ``fast_free_schedule`` asks for a node's requirements a few hundred thousand times
    on a 16-layer decoder's graph, each time with its growing list of scheduled nodes or with that
    list plus a short path (``scheduled + schedule_until_ag``). Building a set of the whole list on
    each call made the scheduler quadratic in the graph's size (minutes of a compile at 16 layers).
    Here the set of the list seen last grows by what was appended to it since; a list that starts
    with that list's nodes (checked element by element, in C) adds only its tail; any other list
    starts a new set. The list the set follows must only grow by appending while it is followed,
    which is how the scheduler builds its schedule. One lives on each graph being scheduled
    (:func:`_scheduled_of`), and goes with it.
    """

    def __init__(self) -> None:
        self._list: Optional[List[Any]] = None
        self._set: Set[Any] = set()
        self._length = 0

    def split(self, scheduled: List[Any]) -> Tuple[Set[Any], List[Any]]:
        """``(base, tail)``: ``scheduled``'s nodes are those of ``base`` and of ``tail``."""
        n = self._length
        followed = self._list
        if (followed is not None and len(scheduled) >= n
                and (n == 0 or scheduled[n - 1] is followed[n - 1])):
            if scheduled is followed:
                self._set.update(scheduled[n:])
                self._length = len(scheduled)
                return self._set, []
            if scheduled[:n] == followed[:n]:
                return self._set, scheduled[n:]
        self._list = scheduled
        self._set = set(scheduled)
        self._length = len(scheduled)
        return self._set, []


_SCHEDULED_ATTR = "_ds_z3native_scheduled"


def _scheduled_of(node: Any) -> _Scheduled:
    graph = node.graph
    found = getattr(graph, _SCHEDULED_ATTR, None)
    if found is None:
        found = _Scheduled()
        setattr(graph, _SCHEDULED_ATTR, found)
    return found


def _requirements_with_kwargs(get_node_requirements: Callable) -> Callable:
    def node_requirements(target_node: Any, scheduled: List[Any]) -> List[Any]:
        # Every not yet scheduled node that target_node depends on, itself included, producers
        # before consumers: a depth-first post-order over positional then keyword inputs (the
        # order DeepSpeed's own walk gives over positional inputs alone; fx's all_input_nodes
        # lists them so, each once). Iterative: a decoder's graph is thousands of nodes deep.
        done, tail = _scheduled_of(target_node).split(scheduled)
        # Nodes of the tail count as visited: skipped by the walk, never returned.
        visited = set(tail)
        ordered: List[Any] = []
        if target_node in done or target_node in visited:
            return ordered
        visited.add(target_node)
        path = [target_node]
        pending = [iter(target_node.all_input_nodes)]  # per node of the path: inputs left
        while pending:
            for child in pending[-1]:
                if child not in done and child not in visited:
                    visited.add(child)
                    path.append(child)
                    pending.append(iter(child.all_input_nodes))
                    break
            else:
                pending.pop()
                ordered.append(path.pop())
        return ordered

    return node_requirements


def patch_kwargs_dependencies() -> Undo:
    """DeepCompile's list scheduler counts keyword-argument inputs."""

    def schedule() -> Undo:
        import importlib

        module = importlib.import_module(SCHEDULE_MODULE)
        return undo_all([wrap_function([module], "filter_args", _with_kwarg_inputs),
                         wrap_function([module], "get_node_requirements",
                                       _requirements_with_kwargs)])

    return when_module_imported(SCHEDULE_MODULE, schedule)


def shift_schedule(schedule: Any, global_steps: int) -> int:
    """Moves every entry of ``schedule`` (a deque of ``(step, passes)``) so that its first entry
    is at ``global_steps``, when that entry's step is already behind it; returns the shift."""
    if not schedule or schedule[0][0] >= global_steps:
        return 0
    offset = global_steps - schedule[0][0]
    moved = [(step + offset, passes) for step, passes in schedule]
    schedule.clear()
    schedule.extend(moved)
    return offset


def _launching_after_resume(launch: Callable) -> Callable:
    def launch_compile_passes(global_steps: int, *args: Any, **kwargs: Any) -> Any:
        import sys

        backend = sys.modules[BACKEND_MODULE]
        schedule = getattr(backend, "remaining_schedule", None)
        if schedule is not None:
            first = schedule[0][0] if schedule else None
            offset = shift_schedule(schedule, global_steps)
            if offset:
                log.info("DeepCompile: the engine is at step %d, past its compile schedule's "
                         "step %d (a checkpoint was loaded): the schedule moves by %d steps, "
                         "to %s", global_steps, first, offset, [s for s, _ in schedule])
        return launch(global_steps, *args, **kwargs)

    return launch_compile_passes


def wrap_launch_compile_passes(make_wrapper: Callable[[Callable], Callable]) -> Undo:
    """Wrap DeepSpeed's ``launch_compile_passes`` (imported now) in its backend module and in
    every module holding its own reference (:data:`LAUNCH_OWNERS`, now or when imported); the
    undo restores them all. Patches that wrap it each call this, in their install order."""
    import importlib

    backend = importlib.import_module(BACKEND_MODULE)
    original = backend.launch_compile_passes
    undos = [wrap_function([backend], "launch_compile_passes", make_wrapper)]
    wrapper = backend.launch_compile_passes
    for name in LAUNCH_OWNERS[1:]:
        undos.append(rebind_when_imported(name, original, wrapper))
    return undo_all(undos)


def patch_resume_schedule() -> Undo:
    """DeepSpeed's compile-pass schedule moves forward when the engine's step count is past it."""
    return when_module_imported(
        BACKEND_MODULE, lambda: wrap_launch_compile_passes(_launching_after_resume))


DEEPCOMPILE_KWARGS_DEPENDENCIES = Patch(
    name="deepcompile-kwargs-dependencies",
    summary="DeepCompile's ZeRO-3 scheduler counts tensors passed by keyword as dependencies "
            "(an HF model's evaluation graph failed with KeyError 'where')",
    apply=patch_kwargs_dependencies,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.list_schedule:filter_args",
        "deepspeed.compile.list_schedule:get_node_requirements",
    ),
)

DEEPCOMPILE_RESUME_SCHEDULE = Patch(
    name="deepcompile-resume-schedule",
    summary="after load_checkpoint, DeepCompile's compile passes start at the resumed step "
            "(the first forward failed: next_passes None)",
    apply=patch_resume_schedule,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.backend:launch_compile_passes",
        "deepspeed.compile.backend:remaining_schedule",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_KWARGS_DEPENDENCIES, DEEPCOMPILE_RESUME_SCHEDULE]
