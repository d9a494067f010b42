"""DeepCompile's re-plan compiled at the first step when the profile store already holds it.

DeepSpeed's ZeRO-3 schedule compiles every graph twice: at step 0 with its gather and release
pass only, then at its re-plan (after the 5th step) from scratch (Dynamo, AOTAutograd, inductor)
with the prefetch and persistence passes, on profiles taken again. The first cycle is there to
be profiled and to bring the run to the re-plan. A run whose profile store
(``compat.deepcompile_profile_store``) holds that re-plan's profiles (a second run of the same
job, a restart, a resumed run) does not need it.

* :data:`DEEPCOMPILE_WARM_START` (every release; only with a profile store set, and on unless
  ``ds_z3native.set_warm_start(False)`` / ``DS_Z3NATIVE_WARM_START=0``):

  - After a re-plan, each rank writes a manifest to the store, named by the store key of the
    re-plan's first profile (its first graph's operator profile). It lists the params the re-plan
    kept gathered: those chosen before its graphs were compiled
    (``compat.deepcompile_persistent``), and those its last backward graph added.
  - When DeepSpeed launches its first cycle, every rank holds a manifest, and the schedule ends
    with a re-plan made of DeepSpeed's gather/release, prefetch and ``selective_gather`` passes,
    the re-plan's passes run at once. The cycle carries the re-plan's label, so its profiles
    replay the re-plan's, and no re-plan follows.
  - The cycle's first profile decides. If every rank's store holds a manifest for it, the
    manifest's params are kept gathered as the re-plan had them before compiling (the rest at the
    last backward graph, where ``selective_gather`` ran), and the graphs the cycle compiles are
    the re-plan's, so inductor's cache serves them.
  - Otherwise the cycle is the first cycle after all: the re-plan's passes do nothing in it, its
    profiles carry the first cycle's label, and the re-plan is scheduled again.

A warm start skips DeepSpeed's ``selective_gather`` run: the manifest holds what it chose in the
run that recorded it, on that run's memory profile (the same profiles the store replays).

* Single cycle (``ds_z3native.set_single_cycle(True)`` / ``DS_Z3NATIVE_SINGLE_CYCLE=1``, off by
  default; with or without a profile store): a first cycle that does not start warm runs the
  re-plan's passes at once, on the profiles it measures, and DeepSpeed's own ``selective_gather``
  at its last backward graph, with the optimizer's states yet to come held back from its memory
  budget (:func:`optimizer_state_bytes`); no re-plan follows; the graphs compiled before that
  choice are compiled again with the params it kept gathered grouped
  (:mod:`.deepcompile_regroup`). With a store, its profiles and manifest are the re-plan's, so
  a later run starts warm from them.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from packaging.version import Version

from .. import settings
from ..run_state import RUN_STATE
from . import Patch, Undo
from . import deepcompile_profile_store as store
from . import deepcompile_regroup as regroup
from ._rebind import undo_all, when_module_imported
from .deepcompile_persistent import (SELECTIVE_GATHER_MODULE, early_choice,
                                     group_persistent_gathers, last_backward_graph,
                                     persistent_ids)
from .deepcompile_schedule import wrap_launch_compile_passes

__all__ = ["DEEPCOMPILE_WARM_START", "PATCHES", "WARM_PASSES", "warm_start_stats",
           "reset_warm_start", "manifest_path", "optimizer_state_bytes"]

log = logging.getLogger(__name__)

BACKEND_MODULE = "deepspeed.compile.backend"
_KIND = "warm"
_FORMAT = 1
_SELECTIVE_GATHER = "selective_gather"
# The passes a warm start runs at step 0 (DeepSpeed's default re-plan): each needs only the
# cycle's own profiles, none the optimizer's state.
WARM_PASSES = frozenset({"add_z3_gather_release", "schedule_prefetch", _SELECTIVE_GATHER})


def manifest_path(directory: Path, key: str, rank: int) -> Path:
    """Where a rank's manifest of the re-plan whose first profile has store key ``key`` lies."""
    return directory / f"{_KIND}-{key[:32]}.rank{rank}.json"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _device() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _agree(value: Optional[int], group: Any = None, device: Any = None) -> bool:
    """Whether every rank of ``group`` has a ``value`` (not None) and all of them are equal."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group=group) <= 1:
        return value is not None
    import deepspeed.comm as ds_dist

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    v = 0 if value is None else int(value)
    with unset_fake_temporarily():  # a profile is looked up inside AOTAutograd's fake mode
        flags = torch.tensor([0 if value is None else 1, v, -v], dtype=torch.int64,
                             device=device if device is not None else _device())
        ds_dist.all_reduce(flags, op=ds_dist.ReduceOp.MIN, group=group)
        return int(flags[0]) == 1 and int(flags[1]) == -int(flags[2])


def _checksum(record: Dict[str, Any]) -> int:
    return zlib.crc32(json.dumps([record["early"], record["added"]]).encode())


def _load_manifest(path: Path) -> Optional[Dict[str, Any]]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("DeepCompile warm start: %s is unreadable (%s); not used", path, e)
        return None
    ok = (isinstance(record, dict) and record.get("format") == _FORMAT
          and record.get("kind") == _KIND
          and all(isinstance(record.get(k), list) and all(isinstance(i, int) for i in record[k])
                  for k in ("early", "added")))
    return record if ok else None


def _set_persistent(ds_ids: List[int]) -> None:
    from deepspeed.compile.util import get_deepcompile_handle

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    handle = get_deepcompile_handle()
    with unset_fake_temporarily():  # called inside AOTAutograd's compile: the gathers are real
        for ds_id in ds_ids:  # ascending on every rank: set_persistent may gather
            handle.set_persistent(ds_id)


class _WarmStart(store.ProfileObserver):
    """This process's warm start: its phase and the cycle DeepSpeed compiles now."""

    def __init__(self) -> None:
        self.stats = {"started": 0, "fell_back": 0, "manifests_written": 0,
                      "profiles_measured": 0, "single_cycles": 0}
        self.reset()

    def reset(self) -> None:
        # None: not tried; "declined": tried, no manifest on every rank; "tentative": the
        # re-plan's passes launched, the first profile not yet seen; "on": started from the
        # store; "off": fell back to the first cycle; "single": the re-plan's passes on the
        # cycle's own profiles, once.
        self.phase: Optional[str] = None
        self.single = False  # a cycle that does not start warm runs as "single"
        self.rest: List[Tuple[int, List[Any]]] = []
        self.manifest: Optional[Dict[str, Any]] = None
        self.first_key: Optional[str] = None  # the cycle's first operator profile
        self.final = False  # the cycle compiling now is the schedule's re-plan
        self.written = False

    # -- the cycle's profiles ---------------------------------------------------------------
    def before(self, kind: str, interp: Any, size: int) -> None:
        if self.phase != "tentative" or kind != "operator":
            return
        directory = store.profile_store()
        key = store.profile_key(kind, interp.graph, size)
        manifest = None
        if directory is not None and store.occurrences_of(key) == 0:
            manifest = _load_manifest(manifest_path(directory, key, _rank()))
        checksum = None if manifest is None else _checksum(manifest)
        group, device = getattr(interp, "process_group", None), getattr(interp, "device", None)
        if _agree(checksum, group, device):
            self.start(manifest)
        else:
            self.fall_back("the store holds no manifest of its first graph on every rank")

    def after(self, kind: str, key: str, replayed: bool) -> None:
        if self.first_key is None and kind == "operator":
            self.first_key = key
        if self.phase == "on" and self.final and not replayed:
            self.stats["profiles_measured"] += 1

    # -- phases -----------------------------------------------------------------------------
    def start(self, manifest: Dict[str, Any]) -> None:
        self.phase, self.manifest = "on", manifest
        self.stats["started"] += 1
        _set_persistent(sorted(manifest["early"]))
        log.info("DeepCompile warm start: the re-plan's graphs are compiled now, from the profile "
                 "store; %d params kept gathered as the re-plan had them", len(manifest["early"]))

    def run_single(self, why: str) -> None:
        self.phase, self.rest = "single", []
        self.stats["single_cycles"] += 1
        regroup.begin_single_cycle()
        log.info("DeepCompile single cycle (%s): the re-plan's passes run now, on this cycle's "
                 "profiles, and no re-plan follows", why)

    def fall_back(self, why: str) -> None:
        if self.single:
            self.run_single(why)
            return
        self.phase, self.final = "off", False
        self.stats["fell_back"] += 1
        schedule = getattr(sys.modules.get(BACKEND_MODULE), "remaining_schedule", None)
        if schedule is not None:
            schedule.extend(self.rest)
        log.info("DeepCompile warm start not taken (%s): this cycle compiles as the first, and "
                 "the re-plan comes at step %s", why, [s for s, _ in self.rest])
        self.rest = []

    def active(self) -> bool:
        """Whether the re-plan's passes act in this cycle (settles a tentative start that saw
        no profile: without one, the first cycle)."""
        if self.phase == "tentative":
            self.fall_back("no profile of the cycle was looked up in the store")
        return self.phase != "off"

    # -- the manifest -----------------------------------------------------------------------
    def write_manifest(self, backend: Any) -> None:
        self.written = True
        directory = store.profile_store()
        if directory is None or self.first_key is None:
            return
        try:
            final = persistent_ids(getattr(backend, "param_manager", {}))
        except (AttributeError, KeyError, RuntimeError) as e:
            log.info("DeepCompile warm start: no manifest written (%s)", e)
            return
        kept = set(final)
        if self.phase == "on" and self.manifest:
            early = sorted(self.manifest["early"])
        elif self.phase == "single":
            # Chosen at its last backward graph ("added" replays that), except those its
            # regroup reached in every graph compiled before: a warm start compiles those
            # graphs with them kept gathered from the start, as the regroup did.
            early = [i for i in (regroup.regrouped_ids() or []) if i in kept]
        else:
            early = [i for i in early_choice() if i in kept]
        record = {"format": _FORMAT, "kind": _KIND, "early": early,
                  "added": sorted(set(final) - set(early))}
        path = manifest_path(directory, self.first_key, _rank())
        if _load_manifest(path) == record:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError as e:
            log.warning("DeepCompile warm start: could not write %s (%s)", path, e)
            return
        self.stats["manifests_written"] += 1
        log.info("DeepCompile warm start: the re-plan's choices recorded in %s (%d + %d params "
                 "kept gathered)", path, len(early), len(record["added"]))


_state = _WarmStart()


def warm_start_stats() -> Dict[str, int]:
    """This process's counts: warm starts taken (``started``), tried and not taken
    (``fell_back``), manifests written, and profiles a warm start measured because the store
    lacked them (``profiles_measured``)."""
    return dict(_state.stats)


def reset_warm_start() -> None:
    """Forget this process's warm start and counts (as a new process)."""
    _state.__init__()  # type: ignore[misc]
    regroup.reset_regroup()


def _guarded(fn: Callable, label: Optional[str]) -> Callable:
    """``fn`` as a pass of a warm start: it acts unless the start fell back, and the cycle's
    label names it (as ``label``) under the same condition."""

    @functools.wraps(fn)
    def warm_pass(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if _state.active() else None

    setattr(warm_pass, store.LABEL_ATTR, lambda: label if _state.phase != "off" else None)
    return warm_pass


def optimizer_state_bytes(param_managers: Dict[int, Any], world_size: int) -> int:
    """What an Adam-like optimizer's states will take on one rank for the trainable params the
    graphs of ``param_managers`` use: two fp32 values per element of each one's partition."""
    seen, total = set(), 0
    for manager in param_managers.values():
        for name, ds_param in manager.params.items():
            param = ds_param.param
            ds_id = manager.ds_ids[name]
            if ds_id in seen or not param.requires_grad:
                continue
            seen.add(ds_id)
            numel = getattr(param, "ds_numel", None)  # a ZeRO-3 param's full size
            numel = int(param.numel() if numel is None else numel)
            total += 8 * -(-numel // max(1, world_size))
    return total


def _selective_gather_held_back(selective_gather: Callable, gm: Any, graph_id: int,
                                graph_order: Any, profiling_results: Any, *args: Any) -> Any:
    """DeepSpeed's ``selective_gather`` at the last backward graph of a single cycle, with the
    optimizer's states yet to come held on the device while it measures its headroom."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    param_manager = args[2] if len(args) > 2 else {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    reserve = optimizer_state_bytes(param_manager, world)
    held = None
    with unset_fake_temporarily():
        try:
            held = torch.empty(reserve, dtype=torch.uint8, device=_device()) if reserve else None
            fits = 1
        except RuntimeError:  # out of memory, whichever the device
            fits = None
    # Every rank runs DeepSpeed's pass (its collectives) or none does.
    group = getattr(profiling_results.get(graph_id), "process_group", None) \
        if isinstance(profiling_results, dict) else None
    if not _agree(fits, group):
        log.warning("DeepCompile single cycle: the optimizer's states (%d bytes) do not fit "
                    "beside this step's memory on every rank; no params kept gathered", reserve)
        del held
        return None
    log.info("DeepCompile single cycle: selective_gather with %d bytes held back for the "
             "optimizer's states", reserve)
    try:
        return selective_gather(gm, graph_id, graph_order, profiling_results, *args)
    finally:
        del held


def _persistence(selective_gather: Callable) -> Callable:
    """Stands for ``selective_gather`` in a cycle of the re-plan's passes at the first step: in a
    warm start, at the last backward graph, the params the manifest says it added are kept
    gathered; in a single cycle, DeepSpeed's pass runs (:func:`_selective_gather_held_back`)."""

    def stored_persistence(gm: Any, graph_id: int, graph_order: Any, *args: Any) -> Any:
        bwd = args[-1] if args else False
        if not bwd or graph_id != last_backward_graph(graph_order):
            return None
        if _state.phase == "single":  # DeepSpeed's pass as its module holds it now
            current = getattr(sys.modules.get(SELECTIVE_GATHER_MODULE), _SELECTIVE_GATHER,
                              selective_gather)
            try:
                return _selective_gather_held_back(current, gm, graph_id, graph_order, *args)
            finally:
                regroup.choice_made()
        if _state.manifest:
            _set_persistent(sorted(_state.manifest["added"]))
        return None

    return stored_persistence


def _pass_name(fn: Any) -> Optional[str]:
    return store.cycle_label([fn]) or None


def _warm_passes(first: List[Any], final: List[Any], with_group: bool) -> List[Any]:
    """The re-plan's passes ``final`` as a warm start runs them: those of the first cycle as
    they are, the others guarded, ``selective_gather`` replaced by the manifest's choice, and
    the persistent params' grouping last where it is on."""
    first_names = {_pass_name(p) for p in first}
    passes: List[Any] = []
    for fn in final:
        name = _pass_name(fn)
        if name == _SELECTIVE_GATHER:
            passes.append(_guarded(_persistence(fn), _SELECTIVE_GATHER))
        elif name in first_names:
            passes.append(fn)
        else:
            passes.append(_guarded(fn, name))
    if with_group:
        passes.append(_guarded(group_persistent_gathers, None))
    return passes


def _warm_startable(schedule: Any) -> bool:
    """A schedule whose last entry is a re-plan of DeepSpeed's default passes, after a first."""
    if len(schedule) < 2:
        return False
    names = {_pass_name(p) for p in schedule[-1][1]}
    return _SELECTIVE_GATHER in names and names <= WARM_PASSES and \
        {_pass_name(p) for p in schedule[0][1]} <= names


def _has_manifest() -> Optional[int]:
    directory = store.profile_store()
    if directory is None or not directory.is_dir():
        return None
    return 1 if any(directory.glob(f"{_KIND}-*.rank{_rank()}.json")) else None


def _launching_warm(launch: Callable) -> Callable:
    def launch_compile_passes(global_steps: int, *args: Any, **kwargs: Any) -> Any:
        backend = sys.modules[BACKEND_MODULE]
        schedule = getattr(backend, "remaining_schedule", None)
        due = bool(schedule) and schedule[0][0] == global_steps
        if _state.final and not _state.written:
            _state.write_manifest(backend)  # the re-plan's graphs are all compiled by now
        if not due:
            return launch(global_steps, *args, **kwargs)
        warm = single = False
        cold_why = ""  # why a single cycle does not start warm
        if _state.phase is None:
            current = settings.current()
            if _warm_startable(schedule):
                _state.phase, _state.single = "declined", current.single_cycle
                if store.profile_store() is None:
                    cold_why = "no profile store"
                elif not current.warm_start:
                    cold_why = "warm start off"
                else:
                    warm = _agree(_has_manifest())
                    cold_why = "the store holds no re-plan on every rank"
                single = not warm and current.single_cycle
            elif current.single_cycle:
                _state.phase = "declined"
                log.info("DeepCompile single cycle not taken: the pass schedule is not "
                         "DeepSpeed's default (gather/release, then prefetch and "
                         "selective_gather); it runs as configured")
        if warm or single:
            entries = list(schedule)
            passes = _warm_passes(entries[0][1], entries[-1][1],
                                  settings.current().group_persistent)
            schedule.clear()
            schedule.append((global_steps, passes))
            _state.phase, _state.rest = "tentative", entries[1:]
            if single:
                _state.run_single("no warm start: " + cold_why)
        entry_label = store.cycle_label(schedule[0][1])
        _state.first_key, _state.written = None, False
        _state.final = len(schedule) == 1 and _SELECTIVE_GATHER in entry_label.split(",")
        result = launch(global_steps, *args, **kwargs)
        if warm:
            log.info("DeepCompile warm start at step %d: the re-plan's passes run now if the "
                     "store holds its first graph", global_steps)
        return result

    return launch_compile_passes


def patch_warm_start() -> Undo:
    """Wrap ``launch_compile_passes`` and tell the profile store's profiles to the warm start."""

    def apply() -> Undo:
        previous = store.set_observer(_state)
        return undo_all([wrap_launch_compile_passes(_launching_warm),
                         lambda: store.set_observer(previous)])

    return when_module_imported(BACKEND_MODULE, apply)


DEEPCOMPILE_WARM_START = Patch(
    name="deepcompile-warm-start",
    summary="with a profile store holding this job's re-plan, DeepCompile compiles the re-plan's "
            "graphs at the first step and does not re-plan (DeepSpeed: every graph compiled "
            "twice, the second time after profiling it again)",
    apply=patch_warm_start,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.backend:launch_compile_passes",
        "deepspeed.compile.backend:remaining_schedule",
        "deepspeed.compile.backend:next_passes",
        "deepspeed.compile.backend:param_manager",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_WARM_START]


RUN_STATE.register("warm_start", warm_start_stats, reset_warm_start)
