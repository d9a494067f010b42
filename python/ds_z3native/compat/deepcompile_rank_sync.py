"""DeepCompile on several ranks whose inputs differ in size at a step (per-rank packing, padding
to each rank's own longest row).

DeepCompile's compile of a graph runs collectives: its profiler reduces over the ranks at every
graph node, its passes reduce their budgets. So every rank must compile at the same call, and
compile the same graph. Dynamo decides both per rank: a rank whose batch has a new length fails
its guards and compiles (entering DeepCompile's profiling) while another, whose length it has
seen, runs its compiled graph (gathering params): the collectives mismatch and both ranks hang.
And a rank compiles a dimension symbolic only where its own sizes changed, so two ranks that do
compile together can still trace different graphs (one static, one dynamic), whose profiles
reduce over different numbers of nodes.

:data:`DEEPCOMPILE_RANKS_COMPILE_TOGETHER` (every release): after ``engine.compile()`` with
DeepCompile on more than one rank,

* every call of a compiled frame that has compiled code takes a vote over a gloo group of all
  ranks (Dynamo's guard-complete hook, the one ``torch.compiler.set_enable_guard_collectives``
  uses): where any rank's guards failed, every rank compiles. One all_reduce of three integers
  per call; torch's own hook pickles its vote through ``all_gather_object`` (two collectives);
* the ranks agree on which input dimensions are dynamic: each rank records, per input of the
  compiled module (its path in the arguments), the dimensions whose size it has seen change,
  and marks them ``maybe_mark_dynamic`` at every call; when a vote forces a compile, the ranks
  reduce their sizes and records, and a dimension that changed on any rank or differs between
  ranks is marked on all of them. The first compile (no vote: no compiled code yet) is static
  on every rank, as Dynamo's first compile is on one rank.

Dynamo calls the hook for every compiled frame in the process (a frame compiled outside
DeepCompile votes too): as with torch's guard collectives, compiled code must run on every rank
alike (an SPMD program).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from packaging.version import Version

from ..run_state import RUN_STATE
from . import Patch, Undo
from ._rebind import wrap_method

__all__ = ["DEEPCOMPILE_RANKS_COMPILE_TOGETHER", "PATCHES", "RankCompileSync", "rank_sync",
           "rank_sync_stats"]

log = logging.getLogger(__name__)

ENGINE_MODULE = "deepspeed.runtime.engine"


@dataclass
class _Seen:
    """One input's first shape and the dimensions whose size has changed since (or that the
    ranks agreed to treat as changed)."""

    first: Tuple[int, ...]
    varied: Set[int] = field(default_factory=set)


def _tensor_leaves(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
    import torch
    from torch.utils._pytree import keystr, tree_flatten_with_path

    leaves, _ = tree_flatten_with_path((args, kwargs))
    return [(keystr(path), v) for path, v in leaves if isinstance(v, torch.Tensor)]


class RankCompileSync:
    """The vote and the dynamic-dimension agreement of one process, over ``group`` (gloo, every
    rank). ``watch(module)`` makes a compiled module record and mark its inputs; ``install()``
    puts the vote in Dynamo's guard-complete hook."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self._local = threading.local()  # the inputs of the compiled call under way
        self._previous_hook: Any = None
        self._installed = False
        self._watched: List[Tuple[Any, Any]] = []  # (weakref to module, its compiled call)
        self.reset()

    def reset(self) -> None:
        """Zero the counters."""
        self.votes = 0           # votes taken (compiled-frame calls with compiled code)
        self.vote_s = 0.0        # seconds spent in them
        self.recompiles = 0      # votes where some rank's guards failed: every rank compiled
        self.forced = 0          # ... of which this rank's own guards had passed
        self.marked: Dict[str, List[int]] = {}  # input path -> dimensions agreed dynamic

    def stats(self) -> Dict[str, Any]:
        return {"votes": self.votes, "vote_s": self.vote_s, "recompiles": self.recompiles,
                "forced": self.forced, "marked": {k: sorted(v) for k, v in self.marked.items()},
                "world_size": self.world_size}

    # -- the compiled module's inputs -----------------------------------------------------------

    def watch(self, module: Any) -> None:
        """``module`` (compiled by ``module.compile()``) records and marks its inputs at each
        call. A module already watched is left as it is."""
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is None:
            raise RuntimeError(
                "engine.compile(): DeepCompile on several ranks watches the compiled module's "
                f"inputs, but {type(module).__name__} has no compiled call after compile() "
                "(torch's Module.compile sets _compiled_call_impl)")
        if getattr(compiled, "_ds_z3native_rank_sync", False):
            return
        record: Dict[str, _Seen] = {}

        def compiled_call_in_step(*args: Any, **kwargs: Any) -> Any:
            leaves = self._record_and_mark(record, args, kwargs)
            outer = getattr(self._local, "inputs", None)
            self._local.inputs = (record, leaves)
            try:
                return compiled(*args, **kwargs)
            finally:
                self._local.inputs = outer

        compiled_call_in_step._ds_z3native_rank_sync = True  # type: ignore[attr-defined]
        module._compiled_call_impl = compiled_call_in_step
        self._watched.append((weakref.ref(module), compiled))

    def unwatch(self) -> None:
        for ref, compiled in self._watched:
            module = ref()
            if module is not None and getattr(module._compiled_call_impl,
                                              "_ds_z3native_rank_sync", False):
                module._compiled_call_impl = compiled
        self._watched.clear()

    @staticmethod
    def _record_and_mark(record: Dict[str, _Seen], args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
        from torch._dynamo import maybe_mark_dynamic

        leaves = _tensor_leaves(args, kwargs)
        for path, t in leaves:
            shape = tuple(t.shape)
            seen = record.get(path)
            if seen is None:
                record[path] = _Seen(shape)
                continue
            if len(shape) != len(seen.first):
                continue  # another rank count: Dynamo guards on it as on any change of rank
            seen.varied.update(d for d, (a, b) in enumerate(zip(shape, seen.first)) if a != b)
            for d in seen.varied:
                maybe_mark_dynamic(t, d)
        return leaves

    # -- the vote -------------------------------------------------------------------------------

    def install(self) -> None:
        """Put :meth:`vote` in Dynamo's guard-complete hook (the one it replaces comes back at
        :meth:`uninstall`)."""
        if self._installed:
            return
        set_hook = guard_complete_hook_setter(self.world_size)
        self._previous_hook = set_hook(self.vote)
        if self._previous_hook is not None:
            log.warning("DeepCompile on %d ranks: Dynamo's guard-complete hook %r is replaced by "
                        "ds_z3native's vote (which also keeps the ranks' recompiles together)",
                        self.world_size, self._previous_hook)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            guard_complete_hook_setter(self.world_size)(self._previous_hook)
            self._installed = False
            self._previous_hook = None

    def vote(self, hit: bool) -> bool:
        """Dynamo's guard-complete hook: ``hit`` is whether this rank's guards passed; the
        answer is whether every rank's did (False: every rank compiles). An exception raised
        here ends the process (Dynamo calls the hook from C++ without a handler): only a misuse
        that would otherwise hang raises."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        record, leaves = getattr(self._local, "inputs", None) or ({}, [])
        layout = _layout_code(leaves)
        ballot = torch.tensor([0 if hit else 1, layout, -layout], dtype=torch.int64)
        dist.all_reduce(ballot, op=dist.ReduceOp.MAX, group=self.group)
        missed, high, negated_low = ballot.tolist()
        self.votes += 1
        if high != -negated_low:
            raise RuntimeError(
                f"DeepCompile guard vote on {self.world_size} ranks: the ranks call the compiled "
                f"module with different inputs (this rank's: "
                f"{[(p, tuple(t.shape)) for p, t in leaves]}, layout code {layout}; codes "
                f"{-negated_low}..{high} among the ranks); every rank must pass the same "
                "arguments, with the same number of dimensions each")
        if missed:
            self.recompiles += 1
            self.forced += int(hit)
            self._agree(record, leaves)
        self.vote_s += time.perf_counter() - t0
        return not missed

    def _agree(self, record: Dict[str, _Seen], leaves: List[Tuple[str, Any]]) -> None:
        """Every rank marks the dimensions that changed on any rank or differ between ranks."""
        import torch
        import torch.distributed as dist
        from torch._dynamo import maybe_mark_dynamic

        if not leaves:
            return
        sizes = [s for _, t in leaves for s in t.shape]
        flags = [int(d in record[p].varied) for p, t in leaves for d in range(t.dim())]
        both = torch.tensor(sizes + [-s for s in sizes] + flags, dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        n = len(sizes)
        values = both.tolist()
        high, negated_low, any_flag = values[:n], values[n:2 * n], values[2 * n:]
        i = 0
        for path, t in leaves:
            for d in range(t.dim()):
                if high[i] != -negated_low[i] or any_flag[i]:
                    if d not in record[path].varied:
                        record[path].varied.add(d)
                        self.marked.setdefault(path, []).append(d)
                    maybe_mark_dynamic(t, d)
                i += 1


def _layout_code(leaves: List[Tuple[str, Any]]) -> int:
    """The same on every rank whose compiled call has the same inputs (paths and dimension
    counts): a CRC, not Python's per-process salted hash."""
    return zlib.crc32(repr([(p, t.dim()) for p, t in leaves]).encode())


def guard_complete_hook_setter(world_size: int) -> Callable[[Any], Any]:
    """Dynamo's ``set_guard_complete_hook``; a torch without it raises, saying why it is
    needed."""
    import torch

    try:
        from torch._C._dynamo.eval_frame import set_guard_complete_hook
    except ImportError:
        set_guard_complete_hook = None
    if set_guard_complete_hook is None or not hasattr(torch.compiler,
                                                      "set_enable_guard_collectives"):
        raise RuntimeError(
            f"engine.compile(): DeepCompile on {world_size} ranks needs Dynamo's guard-complete "
            f"hook (torch.compiler.set_enable_guard_collectives), which torch {torch.__version__} "
            "lacks: without it a rank whose batch has a new length compiles alone and the ranks "
            "hang. Use a torch that has it, or pad every batch to one length on every rank")
    return set_guard_complete_hook


_SYNC: Optional[RankCompileSync] = None
_SYNC_LOCK = threading.Lock()


def rank_sync() -> Optional[RankCompileSync]:
    """This process's :class:`RankCompileSync` (None before a DeepCompile ``engine.compile()``
    on several ranks)."""
    return _SYNC


def rank_sync_stats() -> Dict[str, Any]:
    """Its counters (``{}`` where there is none)."""
    return _SYNC.stats() if _SYNC is not None else {}


def _start_sync(world_size: int) -> RankCompileSync:
    global _SYNC
    import torch.distributed as dist

    with _SYNC_LOCK:
        if _SYNC is None:
            guard_complete_hook_setter(world_size)  # before a collective: fail on every rank
            # Every rank calls engine.compile(): the group's creation is collective.
            _SYNC = RankCompileSync(dist.new_group(backend="gloo"), world_size)
        _SYNC.install()
        return _SYNC


def _compiling_ranks_together(compile_fn: Callable) -> Callable:
    def compile_ranks_together(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        out = compile_fn(self, *args, **kwargs)
        if self.is_deepcompile_active() and dist.is_initialized() and dist.get_world_size() > 1:
            _start_sync(dist.get_world_size()).watch(self.module)
        return out

    return compile_ranks_together


def patch_ranks_compile_together() -> Undo:
    """``DeepSpeedEngine.compile`` with DeepCompile on several ranks starts the vote and the
    dynamic-dimension agreement. The undo puts ``compile`` back, takes the vote out of Dynamo's
    hook and restores the watched modules' compiled calls."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    unwrap = wrap_method(DeepSpeedEngine, "compile", _compiling_ranks_together)

    def undo() -> None:
        global _SYNC
        unwrap()
        with _SYNC_LOCK:
            if _SYNC is not None:
                _SYNC.uninstall()
                _SYNC.unwatch()
                _SYNC = None

    return undo


DEEPCOMPILE_RANKS_COMPILE_TOGETHER = Patch(
    name="deepcompile-ranks-compile-together",
    summary="DeepCompile on several ranks: every rank compiles where any rank's guards fail "
            "(a vote per compiled-frame call), and the ranks agree on the dynamic input "
            "dimensions (a rank meeting a new length compiled alone and the ranks hung)",
    apply=patch_ranks_compile_together,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        f"{ENGINE_MODULE}:DeepSpeedEngine.compile",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_RANKS_COMPILE_TOGETHER]


def _clear_stats() -> None:
    if _SYNC is not None:
        _SYNC.reset()


RUN_STATE.register("rank_sync", rank_sync_stats, _clear_stats)
