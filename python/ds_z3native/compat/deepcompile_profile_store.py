"""DeepCompile's profile kept between runs, so that a second run schedules the same graphs.

DeepCompile profiles each graph it compiles (``ProfilingInterpreter``: every node's device and
wall time and memory; ``MemoryProfilingInterpreter`` at a re-plan: the memory after each node)
and its scheduler orders the all-gathers by those figures: ``fast_free_schedule`` ranks
candidate gathers by the summed ``device_time`` of the nodes they need. Timings differ from run
to run by noise, so on a GPU two runs of the same job give graphs whose nodes come in another
order, and inductor's FX-graph cache, keyed on the graph, misses every one of them (measured on
an H200, torch 2.11: two identical runs, 4 of 4 graphs missed, the graphs differing only in the
order of gathers and of the prefetch list; the graph ids were already canonical). On the CPU the
profile's device times are 0 and a second run hits.

* :data:`DEEPCOMPILE_PROFILE_STORE` (every release this package supports): with a store directory
  set (:func:`ds_z3native.set_profile_store`, default ``DS_Z3NATIVE_PROFILE_STORE``:
  :mod:`ds_z3native.settings`, asked at each profile), each complete
  profile of a graph is written there under a fingerprint of the graph (node names, ops,
  targets, argument structure and tensor shapes; DeepSpeed and torch versions, device name,
  process-group size, and the compile cycle: the names of the passes DeepSpeed scheduled for it,
  :func:`cycle_label`), the how-manieth profile of that graph and cycle it is, and this process's
  global rank. Symbolic sizes enter the fingerprint with their symbols renamed in the order the
  graph uses them (torch numbers them differently at a first compile and at a re-plan). A later
  profile of a graph with the same fingerprint is replaced by the stored one when every rank of the
  profiler's process group has it (else every rank measures and writes its file anew): the
  scheduler then sees the figures of the first run and orders the graph the same way. The
  all-gather timings DeepCompile's prefetch pass fuses gathers by
  (``comm_profile.run_all_gather``, measured once per process) are kept and replayed the same
  way, the benchmark then skipped on every rank. A graph whose stored profile every rank holds
  is not profiled at all: its ranks agree on that before the profiler's first collective, and
  the profiler's run (each node run 15 times, one or two collectives per node) is skipped, since
  DeepSpeed uses only what a profile leaves in the graph's nodes, not the outputs of that run.
  Without a store directory nothing changes. A stored profile is what the first run measured on
  this hardware; delete the directory to measure again. The warm start
  (``compat.deepcompile_warm_start``) hears of each profile through :func:`set_observer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from packaging.version import Version

from .. import settings
from ..run_state import RUN_STATE
from . import Patch, Undo
from ._rebind import undo_all, when_module_imported, wrap_function, wrap_method

__all__ = ["PROFILE_MODULE", "COMM_PROFILE_MODULE", "NODE_KEYS", "LABEL_ATTR", "ProfileObserver",
           "set_observer", "cycle_label", "profile_key", "occurrences_of",
           "profile_store", "graph_fingerprint", "store_stats", "reset_store_stats",
           "patch_profile_store", "DEEPCOMPILE_PROFILE_STORE", "PATCHES"]

log = logging.getLogger(__name__)

PROFILE_MODULE = "deepspeed.compile.profilers.graph_profile"
COMM_PROFILE_MODULE = "deepspeed.compile.profilers.comm_profile"
# What DeepSpeed's profilers write into each node's meta (the last two since 0.19.8).
NODE_KEYS = ("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size", "profile_mem_start",
             "profile_mem_peak")
_FORMAT = 2
BACKEND_MODULE = "deepspeed.compile.backend"
# A pass's attribute naming the pass it stands for in a cycle's label (a str), or None for a pass
# this package adds that no label names; a callable gives either, asked at each profile.
LABEL_ATTR = "ds_z3native_label"

_stats_lock = threading.Lock()
_stats: Dict[str, int] = {"recorded": 0, "replayed": 0}
# How many profiles of each graph this process has taken: DeepCompile profiles a graph again at
# its re-plan, and that profile is stored apart from the first one (the n-th profile of a graph
# replays the n-th of the run that recorded it, never an earlier one of the same run).
_occurrences: Dict[str, int] = {}


def profile_store() -> Optional[Path]:
    """The store directory in effect (:func:`ds_z3native.settings.current`), or None."""
    return settings.current().profile_store


def store_stats() -> Dict[str, int]:
    """How many profiles this process wrote to the store and replayed from it."""
    with _stats_lock:
        return dict(_stats)


def reset_store_stats() -> None:
    """Zero :func:`store_stats` and forget which graphs were profiled (as a new process)."""
    with _stats_lock:
        for key in _stats:
            _stats[key] = 0
        _occurrences.clear()


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


class ProfileObserver:
    """What is told of each profile the store sees (one observer per process:
    :func:`set_observer`): :meth:`before` ahead of the key's computation (it may change the
    cycle's label), :meth:`after` once the profile is replayed or taken."""

    def before(self, kind: str, interp: Any, size: int) -> None:  # pragma: no cover - interface
        """A ``kind`` profile of ``interp.graph`` in a profiler group of ``size`` ranks is next."""

    def after(self, kind: str, key: str, replayed: bool) -> None:  # pragma: no cover - interface
        """The profile under ``key`` was replayed from the store, or measured."""


_observer: Optional[ProfileObserver] = None


def set_observer(observer: Optional[ProfileObserver]) -> Optional[ProfileObserver]:
    """Make ``observer`` the one told of each profile; returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def _pass_label(fn: Any) -> Optional[str]:
    label = getattr(fn, LABEL_ATTR, getattr(fn, "__name__", type(fn).__name__))
    return label() if callable(label) else label


def cycle_label(passes: Optional[Iterable[Any]] = None) -> str:
    """The label of a compile cycle: the names of ``passes`` (default: the passes DeepSpeed runs
    now, ``backend.next_passes``) joined by commas, each as :data:`LABEL_ATTR` gives it."""
    if passes is None:
        import sys

        passes = getattr(sys.modules.get(BACKEND_MODULE), "next_passes", None) or []
    return ",".join(label for label in map(_pass_label, passes) if label is not None)


def profile_key(kind: str, graph: torch.fx.Graph, size: int) -> str:
    """The store key of a ``kind`` profile of ``graph`` taken now by a profiler group of ``size``
    ranks (without the occurrence)."""
    return graph_fingerprint(kind, graph, [*_context(size), f"cycle {cycle_label()}"])


def occurrences_of(key: str) -> int:
    """How many profiles under ``key`` this process has taken or replayed."""
    with _stats_lock:
        return _occurrences.get(key, 0)


def _occurrence(key: str) -> int:
    with _stats_lock:
        n = _occurrences.get(key, 0)
        _occurrences[key] = n + 1
        return n


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "name", None)
    if callable(name):
        return str(name())
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__


def _arg_shape(value: Any) -> Any:
    """An argument as the fingerprint sees it: a node by its name, a container item by item,
    anything else by its type only (DeepSpeed's graph id is an int that differs per run)."""
    if isinstance(value, torch.fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_arg_shape(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _arg_shape(v) for k, v in value.items()}
    return type(value).__name__


_SYMBOL = re.compile(r"\b[A-Za-z_]+\d+\b")


def _value_shape(node: torch.fx.Node, symbols: Optional[Dict[str, str]] = None) -> str:
    """A node's value shape and dtype. A symbolic size is written with its symbols renamed in
    the order the graph first uses them (``symbols`` holds the renaming so far): the shape
    environment numbers symbols by how many it has made in the process, which differs between
    a first trace and a re-trace of the same program."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape = getattr(val, "shape", None)
    if shape is None:
        return ""
    names = symbols if symbols is not None else {}

    def canonical(dim: Any) -> Any:
        if isinstance(dim, int):
            return int(dim)
        return _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"sym{len(names)}"), str(dim))

    return f"{tuple(canonical(s) for s in shape)} {getattr(val, 'dtype', '')}"


def _digest(kind: str, context: List[str], lines: Iterable[str]) -> str:
    """The store key of a ``kind`` of profile taken in ``context``, described by ``lines``."""
    return hashlib.sha256("\n".join([f"format {_FORMAT}", kind, *context, *lines]).encode()).hexdigest()


def graph_fingerprint(kind: str, graph: torch.fx.Graph, context: List[str]) -> str:
    """A digest of ``graph`` that two runs of the same program share: each node's name, op,
    target, argument structure and value shape, plus ``kind`` and ``context`` lines."""
    symbols: Dict[str, str] = {}
    return _digest(kind, context, (json.dumps([n.op, n.name, _target_name(n.target), _arg_shape(n.args),
                                               _arg_shape(n.kwargs), _value_shape(n, symbols)])
                                   for n in graph.nodes))


def _group_info(interp: Any) -> tuple:
    """(this process's global rank, the size of the profiler's process group); (0, 1) without
    torch.distributed. Files are named by the global rank: with several data-parallel groups
    sharing a store, two groups' rank 0 would otherwise read and write the same file."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size(group=getattr(interp, "process_group", None))


def _context(size: int) -> List[str]:
    import deepspeed

    device = ""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device())
    return [f"deepspeed {deepspeed.__version__}", f"torch {torch.__version__}", f"device {device}",
            f"group size {size}"]


def _all_ranks_agree(mine: bool, size: int, device: Any, group: Any = None) -> bool:
    """Whether ``mine`` holds on every rank of ``group`` (a MIN all-reduce there)."""
    if size <= 1:
        return mine
    import deepspeed.comm as ds_dist

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Profilers run inside AOTAutograd's compile, under its fake mode: the flag must be real.
    with unset_fake_temporarily():
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
        ds_dist.all_reduce(flag, op=ds_dist.ReduceOp.MIN, group=group)
        return int(flag.item()) == 1


def _load(path: Path, kind: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("DeepCompile profile store: %s is unreadable (%s); profiling afresh", path, e)
        return None
    if record.get("format") != _FORMAT or record.get("kind") != kind:
        return None
    return record


def _save(path: Path, record: Dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("DeepCompile profile store: could not write %s (%s)", path, e)


def _with_store(kind: str, complete: Callable[[Any, Any], bool], capture: Callable[[Any], Dict[str, Any]],
                replay: Callable[[Any, Dict[str, Any]], None],
                store_dir: Callable[[], Optional[Path]] = profile_store) -> Callable[[Callable], Callable]:
    """A wrapper of a profiler's ``run``: with ``store_dir()`` set, a graph whose profile every
    rank of the profiler's group holds is not run at all (the stored figures go into its nodes'
    meta); otherwise the profiler runs and its complete profile is recorded (``store_dir()``
    None: the profiler's own run, nothing kept).

    DeepSpeed's callers use what a profiler leaves in the graph's node meta (and a memory
    profiler's ``mem_record`` and ``profile_complete``), never what ``run`` returns: the graph's
    outputs, computed to be dropped. A skipped run returns None."""

    def make(run: Callable) -> Callable:
        def run_with_profile_store(self: Any, *args: Any) -> Any:
            store = store_dir()
            if store is None:
                return run(self, *args)
            rank, size = _group_info(self)
            if _observer is not None:
                _observer.before(kind, self, size)
            key = profile_key(kind, self.graph, size)
            path = store / f"{kind}-{key[:32]}-{_occurrence(key)}.rank{rank}.json"
            stored = _load(path, kind)
            usable = stored is not None and _fits(self, stored)
            # Every rank skips, or none does: the profilers' collectives (one or two per node)
            # must be reached by all ranks of the group or by none.
            if _all_ranks_agree(usable, size, getattr(self, "device", "cpu"),
                                getattr(self, "process_group", None)):
                replay(self, stored)
                _count("replayed")
                if _observer is not None:
                    _observer.after(kind, key, True)
                log.info("DeepCompile profile store: %s profile of a %d-node graph replayed from "
                         "%s, the graph not run", kind, len(self.graph.nodes), path)
                return None
            out = run(self, *args)
            if complete(self, out):
                # Written anew where a file was there but not used: every rank's store then
                # holds the profile of this one run.
                _save(path, {"format": _FORMAT, "kind": kind, **capture(self)})
                _count("recorded")
                log.info("DeepCompile profile store: %s profile of a %d-node graph recorded in %s",
                         kind, len(self.graph.nodes), path)
            if _observer is not None:
                _observer.after(kind, key, False)
            return out

        return run_with_profile_store

    return make


def _operator_profile_complete(interp: Any, out: Any) -> bool:
    import importlib

    module = importlib.import_module(PROFILE_MODULE)
    incomplete = getattr(module, "is_profile_incomplete", None)
    if incomplete is not None:
        return not incomplete(interp.graph)
    return out is not None  # DeepSpeed before 0.19.8: a failed profile returns nothing


def _memory_profile_complete(interp: Any, out: Any) -> bool:
    return bool(getattr(interp, "profile_complete", True))


def _capture_nodes(interp: Any) -> Dict[str, Any]:
    return {"nodes": {n.name: {k: n.meta[k] for k in NODE_KEYS if k in n.meta} for n in interp.graph.nodes}}


def _fits(interp: Any, stored: Dict[str, Any]) -> bool:
    """Whether a stored profile covers exactly the nodes of the graph being profiled."""
    nodes = stored.get("nodes")
    return isinstance(nodes, dict) and set(nodes) == {n.name for n in interp.graph.nodes}


def _replay_nodes(interp: Any, stored: Dict[str, Any]) -> None:
    for n in interp.graph.nodes:
        n.meta.update(stored["nodes"][n.name])


def _capture_memory(interp: Any) -> Dict[str, Any]:
    record = _capture_nodes(interp)
    record["mem_record"] = [list(r) for r in interp.mem_record]
    return record


def _replay_memory(interp: Any, stored: Dict[str, Any]) -> None:
    _replay_nodes(interp, stored)
    interp.mem_record = [tuple(r) for r in stored.get("mem_record", [])]
    interp.profile_complete = True  # only complete profiles are stored


def _with_comm_store(run_all_gather: Callable,
                     store_dir: Callable[[], Optional[Path]] = profile_store) -> Callable:
    """A wrapper of DeepSpeed's all-gather benchmark (``comm_profile.run_all_gather``, what its
    prefetch pass predicts gather times from, once per process) that records its timings in
    ``store_dir()``, or replays stored ones on every rank, skipping the benchmark."""

    def run_all_gather_with_store(device: Any, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        store = store_dir()
        if store is None:
            return run_all_gather(device, dtype, *args, **kwargs)
        import torch.distributed as dist

        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        key = _digest("comm", _context(size), [str(dtype), repr(args), repr(sorted(kwargs.items()))])
        path = store / f"comm-{key[:32]}.rank{rank}.json"
        stored = _load(path, "comm")
        usable = stored is not None and isinstance(stored.get("results"), list)
        if _all_ranks_agree(usable, size, device):
            _count("replayed")
            log.info("DeepCompile profile store: all-gather timings replayed from %s", path)
            return [tuple(r) for r in stored["results"]]
        results = run_all_gather(device, dtype, *args, **kwargs)
        _save(path, {"format": _FORMAT, "kind": "comm", "results": [list(r) for r in results]})
        _count("recorded")
        log.info("DeepCompile profile store: all-gather timings recorded in %s", path)
        return results

    return run_all_gather_with_store


def patch_profile_store(store_dir: Callable[[], Optional[Path]] = profile_store) -> Undo:
    """Wrap ``run`` of DeepSpeed's two profilers and its all-gather benchmark (once DeepSpeed
    imports them) with the store ``store_dir()`` names at each call (default: this process's
    settings)."""

    def apply() -> Undo:
        import importlib

        module = importlib.import_module(PROFILE_MODULE)
        undos = [wrap_method(module.ProfilingInterpreter, "run",
                             _with_store("operator", _operator_profile_complete, _capture_nodes,
                                         _replay_nodes, store_dir))]
        if hasattr(module, "MemoryProfilingInterpreter"):
            undos.append(wrap_method(module.MemoryProfilingInterpreter, "run",
                                     _with_store("memory", _memory_profile_complete,
                                                 _capture_memory, _replay_memory, store_dir)))
        return undo_all(undos)

    def apply_comm() -> Undo:
        import importlib

        module = importlib.import_module(COMM_PROFILE_MODULE)
        if not hasattr(module, "run_all_gather"):
            return lambda: None
        return wrap_function([module], "run_all_gather",
                             lambda original: _with_comm_store(original, store_dir))

    return undo_all([when_module_imported(PROFILE_MODULE, apply),
                     when_module_imported(COMM_PROFILE_MODULE, apply_comm)])


DEEPCOMPILE_PROFILE_STORE = Patch(
    name="deepcompile-profile-store",
    summary="with a store directory set, DeepCompile's graph profiles are kept between runs and "
            "replayed, so a second run schedules the same graphs (and inductor's cache can serve "
            "them); nothing changes without one",
    apply=patch_profile_store,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.profilers.graph_profile:ProfilingInterpreter.run",
        "deepspeed.compile.profilers.graph_profile:MemoryProfilingInterpreter.run",
        "deepspeed.compile.profilers.comm_profile:run_all_gather",
    ),
)

PATCHES = [DEEPCOMPILE_PROFILE_STORE]


RUN_STATE.register("profile_store", store_stats, reset_store_stats)
