"""A single cycle's graphs compiled before its persistence choice, compiled again with it.

In a single cycle (``ds_z3native.set_single_cycle(True)``, :mod:`.deepcompile_warm_start`)
DeepSpeed's ``selective_gather`` chooses the params kept gathered at the last backward graph of
the first step, when every forward graph (and any backward graph compiled before that one) is
already compiled. Those graphs keep DeepSpeed's ``allgather_param`` / ``wait_allgather`` /
``release_param`` calls per use of a param kept gathered: each a no-op dispatcher call from
inductor's wrapper code, about a third of the calls :mod:`.deepcompile_persistent` removes from a
checkpointed step (its backward graph recomputes the forward), and the host time they cost is
paid in every step for the rest of the run.

* :data:`DEEPCOMPILE_SINGLE_CYCLE_REGROUP` (every release whose ``deepspeed.compile.inductor``
  has ``patch_compiler``): while a single cycle compiles, each graph handed to inductor before
  the choice is kept as it was handed over (a copy of the FX graph after DeepSpeed's passes,
  its example inputs, the compiler, the tracing context and the cache tag), and the compiled
  function AOTAutograd gets is a holder of the compiled code. Once the graph where
  ``selective_gather`` ran is compiled, each kept graph in which a param is now kept gathered is
  rewritten by :func:`.deepcompile_persistent.group_persistent_gathers` (one
  ``gather_persistent`` call; the waits and releases go) and compiled again by the same
  compiler in its own tracing context. Only its dc op calls differ, so inductor's code for the
  rest is the same; the new code goes into the holder when the compiled forward reports the
  same output strides as the first (AOTAutograd fitted the backward to those) and when every
  rank compiled it (the graphs' collectives must match across ranks). Otherwise the graph keeps
  its first compile, which is correct, with the calls it had.

  The price is one more inductor compile of each such graph (no Dynamo or AOTAutograd trace, no
  profiling); the re-plan of DeepSpeed's two-cycle schedule traces, profiles and compiles every
  graph again. With a profile store, the run's manifest records the regrouped params as chosen
  before compiling (``early``), so a warm start compiles these same graphs and inductor's cache
  serves them. Off with ``set_group_persistent(False)``, as the grouping it completes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from packaging.version import Version

from .. import settings
from ..run_state import RUN_STATE
from . import Patch, Undo
from .deepcompile_graph_ids import graph_id_of, wrap_patch_compiler
from .deepcompile_persistent import group_persistent_gathers, group_stats, persistent_ids

__all__ = ["DEEPCOMPILE_SINGLE_CYCLE_REGROUP", "PATCHES", "CompiledHolder", "regroup_stats",
           "begin_single_cycle", "choice_made", "regrouped_ids",
           "reset_regroup"]

log = logging.getLogger(__name__)

BACKEND_MODULE = "deepspeed.compile.backend"


class CompiledHolder:
    """What AOTAutograd calls in place of a graph's compiled code: the code inside can be
    replaced between two calls. Boxed (takes the argument list), as inductor's code is."""

    _boxed_call = True

    def __init__(self, compiled: Callable) -> None:
        self.compiled = compiled

    def __call__(self, args: List[Any]) -> Any:
        compiled = self.compiled
        if getattr(compiled, "_boxed_call", False):
            return compiled(args)
        return compiled(*args)


@dataclass
class _Kept:
    """A graph compiled before the choice, as it was handed to its compiler."""

    graph_id: int  # DeepSpeed's id (its process group is found by it)
    bwd: bool
    gm: Any  # a copy of the FX graph module, taken before the compiler changed it
    example_inputs: Any  # as the compiler got them: a tuple or a list (see _same_inputs)
    compiler: Callable
    tracing_context: Any
    cache_key_tag: Optional[str]
    output_strides: Optional[List[Any]]
    holder: CompiledHolder


@dataclass
class _Cycle:
    active: bool = False
    chosen: bool = False
    kept: List[_Kept] = field(default_factory=list)
    regrouped: List[int] = field(default_factory=list)  # ds_ids reached by gather_persistent
    complete: bool = False  # every kept graph that had such params was regrouped


_cycle = _Cycle()
_stats = {"kept": 0, "regrouped": 0, "declined": 0, "strides_checked": 0, "removed_calls": 0,
          "seconds": 0.0}


def regroup_stats() -> Dict[str, Any]:
    """This process's counts: graphs kept for a regroup (``kept``), compiled again with their
    persistent params grouped and swapped in (``regrouped``), left with their first compile
    (``declined``: a compile failed, strides differed, or a rank could not), graphs whose output
    strides were compared with their first compile's (``strides_checked``: the forward graphs),
    dc op nodes the regrouped graphs lost (``removed_calls``) and the seconds the compiles
    took."""
    return dict(_stats)


def regrouped_ids() -> Optional[List[int]]:
    """The params (ds_ids, ascending) the last single cycle's regroup reached with
    ``gather_persistent`` in every graph compiled before its choice; None when some such graph
    kept its first compile (or no regroup ran)."""
    return sorted(_cycle.regrouped) if _cycle.complete else None


def begin_single_cycle() -> None:
    """A single cycle starts compiling: keep its graphs until its choice."""
    _cycle.__init__()  # type: ignore[misc]
    _cycle.active = settings.current().group_persistent


def choice_made() -> None:
    """The cycle's ``selective_gather`` has chosen: the graph compiling now, and every later
    one, is grouped by the cycle's own passes; those kept are regrouped once it is compiled."""
    if _cycle.active:
        _cycle.chosen = True


def reset_regroup() -> None:
    """Forget this process's cycle and counts (as a new process)."""
    _cycle.__init__()  # type: ignore[misc]
    for key in _stats:
        _stats[key] = 0.0 if key == "seconds" else 0


def _copy_module(gm: Any) -> Any:
    """A copy of ``gm`` that inductor's FX-graph cache keys as it keys ``gm`` itself: the same
    graph (its nodes copied, their meta dicts shallow-copied) and the same attributes in the
    same order (the key pickles the module's ``__dict__``, whose order a lazily compiled module
    and a new one would otherwise not share)."""
    import torch

    graph = copy.deepcopy(gm.graph)
    kept = torch.fx.GraphModule(gm, graph)
    kept.meta = dict(getattr(gm, "meta", {}))
    attrs = kept.__dict__
    ordered = {k: attrs[k] for k in gm.__dict__ if k in attrs}
    ordered.update((k, v) for k, v in attrs.items() if k not in ordered)
    attrs.clear()
    attrs.update(ordered)
    return kept


def _current_tag() -> Optional[str]:
    import torch

    return getattr(torch.compiler.config, "cache_key_tag", None)


def _same_inputs(example_inputs: Any) -> Any:
    """A shallow copy of ``example_inputs`` in the same kind of sequence. Inductor's FX-graph
    cache key hashes a tuple of inputs as one item and a list input by input, so a list where
    the first compile had a tuple (DeepSpeed hands a tuple to the compiler when it replaces the
    ZeRO-3 params' fake inputs: on CUDA) keys the graph differently from the warm start that
    compiles it first: that start would miss the cache."""
    if isinstance(example_inputs, tuple):
        return tuple(example_inputs)
    return list(example_inputs)


def _recording(compiler: Callable, graph_id: int, bwd: bool) -> Callable:
    def compile_kept(gm: Any, example_inputs: Any) -> Any:
        import torch

        if not _cycle.active:
            return compiler(gm, example_inputs)
        if _cycle.chosen:
            compiled = compiler(gm, example_inputs)
            if _cycle.kept:
                _regroup_kept()
            return compiled
        context = torch._guards.TracingContext.try_get()
        kept = _copy_module(gm)
        inputs = _same_inputs(example_inputs)
        compiled = compiler(gm, example_inputs)
        strides = getattr(context, "output_strides", None) if context is not None else None
        holder = CompiledHolder(compiled)
        _cycle.kept.append(_Kept(graph_id, bwd, kept, inputs, compiler, context, _current_tag(),
                                 None if strides is None else list(strides), holder))
        _stats["kept"] += 1
        return holder

    return compile_kept


def _with_recording(patch_compiler: Callable) -> Callable:
    def wrapper(original_compiler: Callable, dc_compiler: Callable, z3_partition: bool,
                graph_id: int, *args: Any, **kwargs: Any) -> Any:
        bwd = bool(kwargs.get("bwd", args[1] if len(args) > 1 else False))
        return patch_compiler(_recording(original_compiler, graph_id, bwd), dc_compiler,
                              z3_partition, graph_id, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _as_first_compiled(kept: _Kept) -> Any:
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._guards.tracing(kept.tracing_context))
        config = torch.compiler.config
        if kept.cache_key_tag is not None and hasattr(config, "cache_key_tag"):
            stack.enter_context(config.patch(cache_key_tag=kept.cache_key_tag))
        yield stack.enter_context(torch._guards.TracingContext.report_output_strides())


def _compile_regrouped(kept: _Kept) -> Optional[Callable]:
    """``kept``'s graph with its persistent params grouped, compiled as it first was. Raises
    :class:`_Declined` where the new code cannot stand in for the first; None when nothing in the
    graph is kept gathered."""
    gm = _copy_module(kept.gm)
    graph_id = graph_id_of(gm.graph)  # canonical where the graph-id patch renamed it
    if graph_id is None:
        return None
    before = group_stats()["removed_calls"]
    if group_persistent_gathers(gm, graph_id, None, None, None, None, None, kept.bwd) is None:
        return None
    gm.recompile()
    removed = group_stats()["removed_calls"] - before
    with _as_first_compiled(kept) as strides:
        compiled = kept.compiler(gm, _same_inputs(kept.example_inputs))
        strides = None if strides is None else list(strides)
    if kept.output_strides is not None:
        _stats["strides_checked"] += 1
        if strides != kept.output_strides:
            raise _Declined(f"its output strides {strides} differ from its first compile's "
                            f"{kept.output_strides}")
    _stats["removed_calls"] += removed
    return compiled


class _Declined(RuntimeError):
    """A regrouped graph that cannot replace its first compile."""


def _agreed(ok: List[bool], group: Any) -> List[bool]:
    """``ok`` with an entry True only where it is True on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    if not ok or not dist.is_initialized() or dist.get_world_size(group=group) <= 1:
        return ok
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flags = torch.tensor([1 if v else 0 for v in ok], dtype=torch.int32,
                             device=get_accelerator().current_device_name())
        ds_dist.all_reduce(flags, op=ds_dist.ReduceOp.MIN, group=group)
        return [bool(v) for v in flags.tolist()]


def _process_group(graph_id: int) -> Any:
    results = getattr(sys.modules.get(BACKEND_MODULE), "profiling_results", {})
    return getattr(results.get(graph_id), "process_group", None)


def _regroup_kept() -> None:
    """Compile again, grouped, every kept graph that uses a param now kept gathered, and put
    the new code in place where every rank has it."""
    kept, _cycle.kept = _cycle.kept, []
    start = time.perf_counter()
    # Per kept graph: its new code, None where it has no param kept gathered, False where it
    # could not be compiled again.
    codes: List[Any] = []
    for entry in kept:
        try:
            codes.append(_compile_regrouped(entry))
        except Exception as e:  # the first compile stays: correct, with DeepSpeed's calls
            log.warning("DeepCompile single cycle: graph %d (%s) compiled before the persistence "
                        "choice keeps its first compile (%s: %s)", entry.graph_id,
                        "backward" if entry.bwd else "forward", type(e).__name__, e)
            codes.append(False)
    # Every rank swaps a graph or none does: the grouped and ungrouped calls launch different
    # collectives for a trainable param an optimizer step made stale.
    ok = _agreed([code is not False for code in codes], _process_group(kept[0].graph_id))
    declined = swapped = 0
    for entry, code, agreed in zip(kept, codes, ok):
        if code is None:
            continue
        if code is False or not agreed:
            declined += 1
            continue
        entry.holder.compiled = code
        swapped += 1
    _stats["regrouped"] += swapped
    _stats["declined"] += declined
    seconds = time.perf_counter() - start
    _stats["seconds"] += seconds
    backend = sys.modules.get(BACKEND_MODULE)
    try:
        chosen = persistent_ids(dict(getattr(backend, "param_manager", {})))
    except (AttributeError, KeyError, RuntimeError):
        chosen = []
    _cycle.regrouped, _cycle.complete = chosen, declined == 0
    log.info("DeepCompile single cycle: %d of %d graph(s) compiled before the persistence choice "
             "compiled again, %d params kept gathered reached by one gather_persistent call "
             "(%d kept their first compile; %.1f s)", swapped, len(kept), len(chosen), declined,
             seconds)


def patch_single_cycle_regroup() -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that a single cycle's graphs compiled before its
    choice can be compiled again after it; the undo restores it."""
    return wrap_patch_compiler(_with_recording, "a single cycle's graphs compiled before its "
                               "persistence choice keep DeepSpeed's calls")


DEEPCOMPILE_SINGLE_CYCLE_REGROUP = Patch(
    name="deepcompile-single-cycle-regroup",
    summary="a single cycle's graphs compiled before its persistence choice are compiled again "
            "(inductor only) with the params it kept gathered reached by one gather_persistent "
            "call, instead of three dc op calls per use for the rest of the run",
    apply=patch_single_cycle_regroup,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.inductor:patch_compiler",
        "deepspeed.compile.backend:profiling_results",
        "deepspeed.compile.backend:param_manager",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_SINGLE_CYCLE_REGROUP]


RUN_STATE.register("single_cycle_regroup", regroup_stats, reset_regroup)
