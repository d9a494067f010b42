"""Graph ids that are the same in every run, so that compiled DeepCompile graphs can come from a cache.

DeepCompile names each graph it compiles by ``id(gm.graph)``, a memory address, and its passes
write that number into the graph as the ``graph_id`` argument of every ``torch.ops.dc`` call.
Inductor's FX-graph cache keys on the graph, constants included, so a second run with the same
cache directory misses on every graph (measured on the CPU: 4 of 4 misses) and recompiles
everything; only kernel-level caches help.

* :data:`DEEPCOMPILE_CANONICAL_GRAPH_IDS` (every release whose ``deepspeed.compile.inductor``
  has ``patch_compiler``, the wrapper DeepSpeed puts around inductor's forward and backward
  compilers): just before inductor sees a graph, the ``graph_id`` arguments of the dc ops are
  replaced by a canonical id, and the native runtime is told that the canonical id names
  DeepSpeed's graph (``alias_graph``); every dc op resolves it. Canonical ids are -1, -2, ... in
  the order DeepSpeed hands its graphs over since the runtime's last ``reset()`` (DeepSpeed
  resets at each re-plan), so the same program gets the same ids in every run and on every rank.
  They are negative, so they never equal an ``id()``. The rewrite is made in the graph object
  DeepSpeed's profile also points to, after its passes have read it (they read ds_ids and node
  names, never the graph id); DeepSpeed's own tables keep its ids. A graph holding no dc call of
  its graph (a pass schedule that gathers nothing) is left as it is. While inductor compiles
  it, ``torch.compiler.config.cache_key_tag`` also names the DeepSpeed and ds_z3native versions
  and a fingerprint of their bytes (our native library, DeepSpeed's inductor module): the cached
  code depends on DeepSpeed's lowering of the dc ops and on our op, which inductor's key does
  not cover, so an upgrade or a rebuild never reuses code compiled for another. Where inductor
  declines to cache such a graph at all (its FX-graph cache "bypass"), the reason inductor gives
  is logged at INFO under this module's logger and kept: :func:`cache_bypasses`.
* :data:`DEEPCOMPILE_CACHE_CHECKPOINT_RNG` (every release): under non-reentrant activation
  checkpointing on CUDA, AOTAutograd wraps each recomputed random kernel (SDPA, dropout) in the
  higher-order op ``graphsafe_run_with_rng_state``, and torch releases that do not declare that op
  cacheable (2.11 does not; later releases do) make inductor and AOTAutograd skip their caches for
  every such graph: a restarted checkpointed job recompiled them all. Where the running torch
  does not declare it, the op is named in torch's own
  ``torch._inductor.config.unsafe_marked_cacheable_functions`` with a value naming ds_z3native's
  and torch's versions (part of the cache key). The op's compiled code depends on nothing but the
  graph: the random state it replays is a runtime input. Where torch declares it, nothing changes.
* :data:`DEEPCOMPILE_GENERATOR_CACHE_KEY` (every release): those checkpointed graphs take the
  CUDA generator as an input, and AOTAutograd hands inductor a clone of it as the example input.
  torch releases that do not treat a generator as an opaque reference (2.11) pickle that clone,
  seed and offset included, into the FX-graph cache key, so a graph compiled after some random
  draws (at DeepCompile's re-plan, step 6) never matched the same graph compiled at step 0 (a
  warm start): measured on one H200 at 16 layers, the warm start's two checkpointed graphs
  missed the cache its cold run had filled at the re-plan, while a third run's hit the second's.
  With the patch, inductor's (and AOTAutograd's) cache pickler reduces a generator to its
  device; where torch has its own reducer for generators, that one stays.
* :data:`DEEPCOMPILE_SOURCELESS_SYMBOLS` (every release): DeepSpeed's compile turns tensors that
  Dynamo gave no source (a checkpointed region's saved CPU random state, 5,056 bytes) into fake
  tensors with symbolic sizes, and torch names such a symbol after the number of fake tensors
  still alive in the mode (``__meta_utils_unknown_tensor<N>``, then ``s<hash of that name>``):
  a re-plan's compile and a first compile of the same graph differ there (measured on the CPU:
  ``s70`` at the re-plan, ``s87`` at step 0), and inductor's key holds the name, so a graph
  compiled at a re-plan was compiled again at a warm start's step 0. With the patch such a
  tensor is named by its dtype and shape and how many like it the mode converted before, the
  same at every compile of the same program. Named tensors are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

from packaging.version import Version

from ..dc_ops import DC_OPS, OWN_OPS
from ..run_state import RUN_STATE
from . import Patch, Undo
from ._rebind import when_module_imported, wrap_function

__all__ = ["INDUCTOR_MODULE", "GRAPH_ID_ARG", "OWN_GRAPH_ID_ARG", "wrap_patch_compiler",
           "wrap_inductor_compiler",
           "checkpoint_rng_op",
           "mark_checkpoint_rng_cacheable",
           "canonical_graph_id", "graph_id_of", "uses_graph_id", "canonicalize_graph_ids", "cache_key_tag",
           "CacheBypassLog", "cache_bypasses", "patch_canonical_graph_ids",
           "DEEPCOMPILE_CANONICAL_GRAPH_IDS", "DEEPCOMPILE_CACHE_CHECKPOINT_RNG",
           "DEEPCOMPILE_GENERATOR_CACHE_KEY", "generator_cache_key", "patch_generator_cache_key",
           "DEEPCOMPILE_SOURCELESS_SYMBOLS", "sourceless_name", "patch_sourceless_symbols",
           "PATCHES"]

log = logging.getLogger(__name__)

INDUCTOR_MODULE = "deepspeed.compile.inductor"

# The position of the graph id among each native dc op's arguments, read from the schemas of the
# op list (ds_z3native.dc_ops.graph_id_position: the argument named graph_id, or the first of the
# offload ops' two "int id"). DeepSpeed also defines dc ops of its own
# (optimizer-state offload), whose ints are not graph ids: they are not listed.
GRAPH_ID_ARG: Dict[str, int] = {op.name: op.graph_id_arg for op in DC_OPS
                                if op.graph_id_arg is not None}
# The same for ds_z3native's own ops (library ``ds_z3native``, the list's DSZ_OP lines), which
# its graph rewrites emit.
OWN_GRAPH_ID_ARG: Dict[str, int] = {op.name: op.graph_id_arg for op in OWN_OPS
                                    if op.graph_id_arg is not None}
_GRAPH_ID_ARGS = {"dc": GRAPH_ID_ARG, "ds_z3native": OWN_GRAPH_ID_ARG}


def canonical_graph_id(native: Any, graph_id: int) -> int:
    """The canonical id of DeepSpeed's graph ``graph_id`` in the live runtime ``native``
    (``ds_z3native._C``): its alias if it has one, else a new alias, -(number of aliases + 1)."""
    aliases = native.graph_aliases()
    for alias, target in aliases.items():
        if target == graph_id:
            return alias
    alias = -(len(aliases) + 1)
    native.alias_graph(alias, graph_id)
    return alias


def _graph_id_args(graph: Any):
    """(node, position or "graph_id", value) of each graph id a native dc op (or one of
    ds_z3native's own ops) of ``graph`` takes."""
    import torch

    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or target.namespace not in _GRAPH_ID_ARGS:
            continue
        pos = _GRAPH_ID_ARGS[target.namespace].get(target._schema.name.split("::", 1)[-1])
        if pos is None:
            continue
        if len(node.args) > pos:
            yield node, pos, node.args[pos]
        elif "graph_id" in node.kwargs:
            yield node, "graph_id", node.kwargs["graph_id"]


def graph_id_of(graph: Any) -> Any:
    """The graph id the first native dc op (or op of ds_z3native's) of ``graph`` takes; None
    where it has none."""
    return next((value for _, _, value in _graph_id_args(graph)), None)


def uses_graph_id(graph: Any, graph_id: int) -> bool:
    """Whether a native dc op of ``graph`` takes ``graph_id`` as its graph id."""
    return any(value == graph_id for _, _, value in _graph_id_args(graph))


def canonicalize_graph_ids(graph: Any, graph_id: int, canonical: int) -> int:
    """Replace ``graph_id`` by ``canonical`` where a native dc op of ``graph`` (an FX graph) takes
    it as its graph id; the number of calls changed."""
    found = [(node, pos) for node, pos, value in _graph_id_args(graph) if value == graph_id]
    for node, pos in found:
        if isinstance(pos, int):
            args = list(node.args)
            args[pos] = canonical
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, pos: canonical}
    return len(found)


def cache_key_tag(base: str) -> str:
    """``base`` (torch.compiler.config.cache_key_tag) extended with what the compiled code of a
    DeepCompile graph depends on and inductor's cache key does not cover: DeepSpeed's lowering of
    the dc ops and our op. Named by versions, and by a fingerprint of the bytes (our native
    library, DeepSpeed's inductor module), so a rebuild or an edited checkout at the same
    version misses instead of running stale code."""
    import deepspeed

    from .._version import __version__

    tag = f"deepspeed-{deepspeed.__version__}+ds_z3native-{__version__}+{build_fingerprint()}"
    return f"{base}|{tag}" if base else tag


@functools.lru_cache(maxsize=None)
def build_fingerprint() -> str:
    """:func:`fingerprint` of the loaded ``ds_z3native._C`` library and DeepSpeed's
    ``deepspeed.compile.inductor`` source (computed once per process). Where a file cannot be
    read, ``"unknown-build"`` with a warning: the tag still names the versions."""
    import importlib

    from .. import _native

    modules = (_native.load(), importlib.import_module(INDUCTOR_MODULE))
    try:
        return fingerprint([Path(m.__file__) for m in modules])
    except (OSError, AttributeError, TypeError) as e:  # the latter two: a module without a file
        log.warning("DeepCompile cache tag without a build fingerprint (%s): a rebuild at the "
                    "same version could reuse cached code compiled for the old build", e)
        return "unknown-build"


def fingerprint(paths: Iterable[Path]) -> str:
    """16 hex digits of SHA-256 over the bytes of ``paths``, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


CODECACHE_LOGGER = "torch._inductor.codecache"
BYPASS_MESSAGE = "Bypassing FX Graph Cache because "


class _BypassMessages(logging.Filter):
    """On inductor's cache logger: keeps the reason of each bypass message, and lets through
    only the records that logger would have emitted anyway (at or above ``floor``), so that
    lowering its level to read INFO adds nothing to the user's output."""

    def __init__(self, floor: int) -> None:
        super().__init__()
        self.floor = floor
        self.reasons: List[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(BYPASS_MESSAGE):
            self.reasons.append(message[len(BYPASS_MESSAGE):].strip("'"))
        return record.levelno >= self.floor


def _bypass_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_bypass"])


class CacheBypassLog:
    """The DeepCompile graphs inductor compiled without its FX-graph cache, and why: inductor
    names the reason only in an INFO message of ``torch._inductor.codecache``, which
    :meth:`watching` listens to while one graph compiles."""

    def __init__(self) -> None:
        self._entries: List[Tuple[int, str]] = []

    def entries(self) -> List[Tuple[int, str]]:
        """(canonical graph id, inductor's reason) per bypassed compile, in compile order."""
        return list(self._entries)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    @contextlib.contextmanager
    def watching(self, graph_id: int) -> Iterator[None]:
        """Record the cache bypasses of the compile run inside this block as ``graph_id``'s."""
        logger = logging.getLogger(CODECACHE_LOGGER)
        level = logger.level
        messages = _BypassMessages(floor=logger.getEffectiveLevel())
        logger.addFilter(messages)
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
        before = _bypass_count()
        try:
            yield
        finally:
            logger.removeFilter(messages)
            logger.setLevel(level)
            bypassed = _bypass_count() - before
            reasons = messages.reasons or ["inductor logged no reason"] * bypassed
            for reason in reasons:
                self._entries.append((graph_id, reason))
                log.info("inductor compiled DeepCompile graph %d without its FX-graph cache "
                         "(no reuse in a later run): %s", graph_id, reason)


_BYPASSES = CacheBypassLog()


def cache_bypasses() -> List[Tuple[int, str]]:
    """(canonical graph id, reason) for each DeepCompile graph of this process that inductor
    compiled without its FX-graph cache; empty when every graph could be cached."""
    return _BYPASSES.entries()


def _canonical_compiler(compiler: Callable, graph_id: int) -> Callable:
    def compile_with_canonical_ids(gm: Any, example_inputs: Any) -> Any:
        import torch

        from .. import _native

        native = _native.load()
        # A graph without dc calls of this graph (a pass schedule that gathers nothing) was never
        # registered with the runtime: it goes to inductor as it is.
        if not native.is_initialized() or not uses_graph_id(gm.graph, graph_id):
            return compiler(gm, example_inputs)
        try:
            canonical = canonical_graph_id(native, graph_id)
        except RuntimeError as e:  # only the cache is lost: the graph runs under DeepSpeed's id
            log.warning("DeepCompile graph %d keeps its id (no inductor cache hit across runs): %s",
                        graph_id, e)
            return compiler(gm, example_inputs)
        canonicalize_graph_ids(gm.graph, graph_id, canonical)
        gm.recompile()
        log.debug("DeepCompile graph %d compiled as graph %d", graph_id, canonical)
        config = torch.compiler.config
        with _BYPASSES.watching(canonical):
            if not hasattr(config, "cache_key_tag"):  # torch without the tag: ids only
                return compiler(gm, example_inputs)
            with config.patch(cache_key_tag=cache_key_tag(config.cache_key_tag)):
                return compiler(gm, example_inputs)

    return compile_with_canonical_ids


def _with_canonical_ids(patch_compiler: Callable) -> Callable:
    def wrapper(original_compiler: Callable, dc_compiler: Callable, z3_partition: bool,
                graph_id: int, *args: Any, **kwargs: Any) -> Any:
        return patch_compiler(_canonical_compiler(original_compiler, graph_id), dc_compiler,
                              z3_partition, graph_id, *args, **kwargs)

    return wrapper


def wrap_patch_compiler(make_wrapper: Callable[[Callable], Callable], without: str) -> Undo:
    """Wrap DeepSpeed's ``patch_compiler``, the wrapper it puts around inductor's forward and
    backward compilers, once DeepSpeed imports its inductor module; where that module has none,
    log ``without`` (what is lost) and change nothing. The undo restores it."""

    def apply() -> Undo:
        import importlib

        module = importlib.import_module(INDUCTOR_MODULE)
        if not hasattr(module, "patch_compiler"):
            log.warning("%s has no patch_compiler: %s", INDUCTOR_MODULE, without)
            return lambda: None
        return wrap_function([module], "patch_compiler", make_wrapper)

    return when_module_imported(INDUCTOR_MODULE, apply)


def wrap_inductor_compiler(transform: Callable[[Callable], Callable], without: str) -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that the compiler it is handed (inductor's forward or
    backward compiler, its first argument) becomes ``transform(compiler)``, every other argument
    passed on; ``without`` as for :func:`wrap_patch_compiler`. The undo restores it."""

    def make_wrapper(patch_compiler: Callable) -> Callable:
        def wrapper(original_compiler: Callable, *args: Any, **kwargs: Any) -> Any:
            return patch_compiler(transform(original_compiler), *args, **kwargs)

        return wrapper

    return wrap_patch_compiler(make_wrapper, without)


def patch_canonical_graph_ids() -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that inductor compiles each DeepCompile graph with
    canonical graph ids; the undo restores it."""
    return wrap_patch_compiler(_with_canonical_ids, "DeepCompile graphs keep DeepSpeed's "
                               "run-specific ids (no inductor cache hits across runs)")


DEEPCOMPILE_CANONICAL_GRAPH_IDS = Patch(
    name="deepcompile-canonical-graph-ids",
    summary="DeepCompile graphs reach inductor with run-independent graph ids (DeepSpeed: "
            "id(gm.graph)), so inductor's FX-graph cache can hit in a later run",
    apply=patch_canonical_graph_ids,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.inductor:patch_compiler",
    ),
)

def checkpoint_rng_op() -> Any:
    """torch's ``graphsafe_run_with_rng_state`` higher-order op, or None where this torch has
    none (or one without ``cacheable()``)."""
    try:
        from torch._prims import rng_prims
    except ImportError:
        return None
    op = getattr(rng_prims, "graphsafe_run_with_rng_state", None)
    return op if callable(getattr(op, "cacheable", None)) else None


def _cacheable_name(op: Any) -> str:
    # The name torch looks up in unsafe_marked_cacheable_functions (HigherOrderOperator.cacheable).
    return f"{op.__module__}.{op.__name__}"


def mark_checkpoint_rng_cacheable() -> Undo:
    """Name ``graphsafe_run_with_rng_state`` in ``unsafe_marked_cacheable_functions`` where this
    torch does not declare it cacheable; the undo restores the previous table. A no-op where
    torch declares it (or has no such op)."""
    import torch

    from .._version import __version__

    op = checkpoint_rng_op()
    if op is None:
        log.debug("this torch has no graphsafe_run_with_rng_state: nothing to mark cacheable")
        return lambda: None
    if op.cacheable():
        log.debug("torch %s declares %s cacheable", torch.__version__, _cacheable_name(op))
        return lambda: None
    config = torch._inductor.config
    name = _cacheable_name(op)
    value = f"ds_z3native-{__version__}+torch-{torch.__version__}"
    had = name in config.unsafe_marked_cacheable_functions
    previous = config.unsafe_marked_cacheable_functions.get(name)
    # a new table, not an edit of torch's default one
    config.unsafe_marked_cacheable_functions = {**config.unsafe_marked_cacheable_functions,
                                                name: value}
    log.debug("marked %s cacheable for inductor's and AOTAutograd's caches", name)

    def undo() -> None:
        # only our entry: what others added to the table meanwhile stays
        table = dict(config.unsafe_marked_cacheable_functions)
        if table.get(name) != value:
            return
        if had:
            table[name] = previous
        else:
            del table[name]
        config.unsafe_marked_cacheable_functions = table

    return undo


DEEPCOMPILE_CACHE_CHECKPOINT_RNG = Patch(
    name="deepcompile-cache-checkpoint-rng",
    summary="inductor's and AOTAutograd's caches keep checkpointed graphs whose recomputed random "
            "kernels torch wraps in graphsafe_run_with_rng_state (torch releases that do not "
            "declare that op cacheable)",
    apply=mark_checkpoint_rng_cacheable,
    first=Version("0.19.0"),
    last=None,
    # one entry is added to this table (and removed by the undo); torch reads it in
    # HigherOrderOperator.cacheable() and AOTAutograd's cache check
    wraps=("torch._inductor.config:unsafe_marked_cacheable_functions",),
)

def generator_cache_key(device: str) -> str:
    """What a ``torch.Generator`` stands for in inductor's cache keys (see
    :func:`patch_generator_cache_key`): its device, never its state. Only hashed, never called
    back: the callable a pickled generator names."""
    return f"torch.Generator({device})"


def _reduce_generator(generator: Any) -> Tuple[Callable[[str], str], Tuple[str]]:
    return generator_cache_key, (str(generator.device),)


def _keying_generators_by_device(init: Callable) -> Callable:
    def init_keying_generators(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        import torch

        table = getattr(self, "dispatch_table", None)
        if isinstance(table, dict):  # torch's own reducer for generators, where it has one, wins
            table.setdefault(torch.Generator, _reduce_generator)

    return init_keying_generators


def patch_generator_cache_key() -> Undo:
    """Key a ``torch.Generator`` in inductor's (and AOTAutograd's) cache keys by its device.

    With checkpointing on CUDA, AOTAutograd hands the compiled graphs a clone of the CUDA
    generator as an example input (graph-safe RNG functionalization: the graph takes the
    generator at run time), and torch releases that do not treat generators as opaque references
    pickle that clone, seed and offset included, into the cache key: a graph compiled after some
    random draws (DeepCompile's re-plan) then never matches the same graph compiled at step 0 (a
    warm start). The compiled code reads the generator's state when it runs, so the state at
    compile time is no part of what was compiled."""
    from torch._inductor.codecache import FxGraphCachePickler

    from ._rebind import wrap_method

    return wrap_method(FxGraphCachePickler, "__init__", _keying_generators_by_device)


DEEPCOMPILE_GENERATOR_CACHE_KEY = Patch(
    name="deepcompile-generator-cache-key",
    summary="inductor's cache keys name a random generator the compiled graph takes (a "
            "checkpointed graph's on CUDA) by its device, not its state at compile time, so a "
            "warm start's graphs match those its re-plan compiled after some random draws",
    apply=patch_generator_cache_key,
    first=Version("0.19.0"),
    last=None,
    wraps=("torch._inductor.codecache:FxGraphCachePickler.__init__",),
)

# Per fake mode: how many tensors without a source of each dtype and shape it was given.
_sourceless: "weakref.WeakKeyDictionary[Any, Dict[str, int]]" = weakref.WeakKeyDictionary()


def sourceless_name(mode: Any, tensor: Any) -> str:
    """The name a tensor given to ``mode`` without a source gets: its dtype and shape and how
    many such tensors the mode was given before."""
    shape = "x".join(map(str, tensor.shape)) or "scalar"
    kind = f"{str(tensor.dtype).replace('torch.', '')}_{shape}"
    counts = _sourceless.setdefault(mode, {})
    n = counts.get(kind, 0)
    counts[kind] = n + 1
    return f"__ds_z3native_sourceless_{kind}_{n}"


def _naming_sourceless(from_tensor: Callable) -> Callable:
    @functools.wraps(from_tensor)
    def from_tensor_named(self: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("source") is None and not args and getattr(self, "shape_env", None) \
                is not None and not kwargs.get("static_shapes", self.static_shapes):
            from torch._dynamo.source import ConstantSource

            kwargs["source"] = ConstantSource(sourceless_name(self, tensor))
        return from_tensor(self, tensor, *args, **kwargs)

    return from_tensor_named


def patch_sourceless_symbols() -> Undo:
    """Name the source-less tensors a fake mode converts with symbolic shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ._rebind import wrap_method

    return wrap_method(FakeTensorMode, "from_tensor", _naming_sourceless)


DEEPCOMPILE_SOURCELESS_SYMBOLS = Patch(
    name="deepcompile-sourceless-symbols",
    summary="a tensor DeepCompile's compile converts without a source gets a symbol named the "
            "same at every compile of the same program (torch: after the count of fake tensors "
            "alive), so inductor's cache serves a warm start the graphs of a re-plan",
    apply=patch_sourceless_symbols,
    first=Version("0.19.0"),
    last=None,
    wraps=("torch._subclasses.fake_tensor:FakeTensorMode.from_tensor",),
)

PATCHES = [DEEPCOMPILE_CANONICAL_GRAPH_IDS, DEEPCOMPILE_CACHE_CHECKPOINT_RNG,
           DEEPCOMPILE_GENERATOR_CACHE_KEY, DEEPCOMPILE_SOURCELESS_SYMBOLS]


def _clear_bypasses() -> None:
    _BYPASSES.clear()


RUN_STATE.register("compile_cache_bypasses", lambda: [list(b) for b in cache_bypasses()],
                 _clear_bypasses)
