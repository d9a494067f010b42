"""DeepCompile graphs whose every call inductor's C++ wrapper can make.

Inductor turns a graph into wrapper code that launches its kernels and calls the ops it does not
lower. Its default wrapper is Python; ``torch._inductor.config.cpp_wrapper = True`` makes it C++,
which costs less host time per launch. Two kinds of call in a DeepCompile graph stop the C++
wrapper, and both are rewritten here just before inductor compiles a graph:

* :data:`DEEPCOMPILE_TYPED_END_BACKWARD`: DeepSpeed's ``dc.end_backward(Any deps, ...)``. The C++
  wrapper cannot pass an ``Any`` argument. The call becomes ``ds_z3native::end_backward(Tensor[]
  deps, int graph_id, bool release_reduce_buckets)``, whose kernel is the same
  (:func:`type_end_backward`); DeepSpeed only ever passes the graph's ``reduce_grad`` outputs.
* :data:`DEEPCOMPILE_ATTENTION_RNG`: torch's random-state wrappers around attention. An op tagged
  ``nondeterministic_seeded`` inside a checkpointed region is recomputed in the backward, and
  AOTAutograd wraps it in a higher-order op that saves and restores the generator's state
  (``graphsafe_run_with_rng_state`` on CUDA, ``run_and_save_rng_state`` /
  ``run_with_rng_state`` elsewhere), so that the recompute draws what the forward drew. PyTorch's
  fused attention ops carry that tag for their dropout, and a model without attention dropout
  calls them with ``dropout_p=0``, where they draw nothing. The C++ wrapper cannot call these
  higher-order ops: a wrapped attention call whose ``dropout_p`` is 0 becomes the plain call
  (:func:`unwrap_attention_rng`). Any other wrapped op (a real dropout) keeps its wrapper. On CUDA
  the wrapper's generator state is a graph input that inductor requires to feed exactly one such
  call, so DeepSpeed's partitioner runs with AOTAutograd's ``graphsafe_rng_functionalization``
  off (the other form, whose state is a tensor the rewrite can replace), and the rewrite runs on
  the partitioner's forward and backward graphs together, before DeepSpeed profiles them.

Both rewrites run only while inductor compiles with its C++ wrapper (:func:`cpp_wrapper_on`); the
Python wrapper gets DeepSpeed's graphs as they are. They are functions of the graph alone (warm
starts get the cold run's graphs), and neither changes what a graph computes.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

from packaging.version import Version

from ..run_state import RUN_STATE
from . import Patch, Undo
from ._fx import is_call
from ._rebind import undo_all, when_module_imported, wrap_function
from .deepcompile_graph_ids import wrap_inductor_compiler
from .inductor_fallback import register_fallback_lowering

__all__ = ["DEEPCOMPILE_TYPED_END_BACKWARD", "DEEPCOMPILE_ATTENTION_RNG", "PATCHES",
           "ATTENTION_OPS", "cpp_wrapper_on", "type_end_backward", "unwrap_attention_rng",
           "inductor_calls_stats"]

log = logging.getLogger(__name__)

# torch's fused attention ops whose only use of the generator is their dropout (aten names).
ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

_stats = {"end_backward_typed": 0, "attention_unwrapped": 0, "rng_wrappers_kept": 0}


def inductor_calls_stats() -> Dict[str, int]:
    """This process's counts: ``end_backward`` calls retyped (``end_backward_typed``), attention
    calls taken out of their random-state wrapper (``attention_unwrapped``) and wrapped calls
    left as they were (``rng_wrappers_kept``: not an attention op, or dropout)."""
    return dict(_stats)


def typed_end_backward_op() -> Any:
    """``torch.ops.ds_z3native.end_backward.default`` (loads the native module)."""
    import torch

    from .. import _native

    _native.load()
    return torch.ops.ds_z3native.end_backward.default


def type_end_backward(gm: Any) -> int:
    """Rewrite ``gm`` in place: each ``dc.end_backward(deps, graph_id, release)`` becomes
    ``ds_z3native::end_backward`` over the tensors among ``deps`` (a None dependency orders
    nothing). Returns the number of calls rewritten."""
    import torch

    end_backward = torch.ops.dc.end_backward.default
    graph = gm.graph
    nodes = [n for n in graph.nodes if is_call(n, end_backward)]
    if not nodes:
        return 0
    op = typed_end_backward_op()
    register_fallback_lowering(op, never_reuse_inputs=True)
    # No output: FX's dead-code elimination must keep the call, as it keeps dc's.
    torch.fx.node._side_effectful_functions.add(op)
    for node in nodes:
        deps = node.args[0] if node.args else node.kwargs.get("deps")
        flat = deps if isinstance(deps, (list, tuple)) else [deps]
        tensors = [d for d in flat if isinstance(d, torch.fx.Node)]
        rest = [d for d in flat if d is not None and not isinstance(d, torch.fx.Node)]
        graph_id = node.args[1] if len(node.args) > 1 else node.kwargs["graph_id"]
        if rest:
            raise TypeError(f"end_backward of graph {graph_id}: dependencies other than graph "
                            f"values or None: {rest!r}")
        release = (node.args[2] if len(node.args) > 2
                   else node.kwargs.get("release_reduce_buckets", True))
        with graph.inserting_before(node):
            typed = graph.call_function(op, (tensors, graph_id, release))
        typed.meta.update(node.meta)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    _stats["end_backward_typed"] += len(nodes)
    return len(nodes)


def _attention_ops() -> Tuple[Any, ...]:
    import torch

    return tuple(getattr(torch.ops.aten, name).default for name in ATTENTION_OPS
                 if hasattr(torch.ops.aten, name))


def _dropout_is_zero(op: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether ``op(*args, **kwargs)`` passes a ``dropout_p`` of exactly 0 (a number, not a
    graph value)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in kwargs:
                value = kwargs["dropout_p"]
            elif i < len(args):
                value = args[i]
            else:
                value = arg.default_value
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    return False


def _rng_wrappers() -> Dict[Any, str]:
    """torch's random-state higher-order ops this torch has, by kind."""
    from torch._prims import rng_prims

    kinds = {}
    for name in ("graphsafe_run_with_rng_state", "run_and_save_rng_state", "run_with_rng_state"):
        op = getattr(rng_prims, name, None)
        if op is not None:
            kinds[op] = name
    return kinds


def _wrapped_call(node: Any, kind: str) -> Tuple[Any, Tuple[Any, ...], Dict[str, Any]]:
    """The op, args and kwargs a random-state wrapper node runs."""
    if kind == "run_with_rng_state":  # (rng_state, op, *args, **kwargs)
        return node.args[1], tuple(node.args[2:]), dict(node.kwargs)
    kwargs = {k: v for k, v in node.kwargs.items() if k != "rng_state"}
    return node.args[0], tuple(node.args[1:]), kwargs


def unwrap_attention_rng(gm: Any) -> int:
    """Rewrite ``gm`` in place: each random-state wrapper around an op of :data:`ATTENTION_OPS`
    called with ``dropout_p`` 0 becomes the op's own call. ``run_and_save_rng_state``'s saved
    state (a forward output the backward's ``run_with_rng_state`` took) becomes an empty tensor.
    Returns the number of wrappers removed."""
    import torch

    wrappers = _rng_wrappers()
    attention = _attention_ops()
    graph = gm.graph
    removed = kept = 0
    for node in list(graph.nodes):
        kind = wrappers.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        op, args, kwargs = _wrapped_call(node, kind)
        if op not in attention or not _dropout_is_zero(op, args, kwargs):
            kept += 1
            continue
        if kind == "run_and_save_rng_state" and not all(
                user.target is operator.getitem for user in node.users):
            kept += 1
            continue
        with graph.inserting_before(node):
            call = graph.call_function(op, args, kwargs)
        val = node.meta.get("val")
        if kind == "run_and_save_rng_state":  # (state, outputs)
            if val is not None:
                call.meta["val"] = val[1]
            state: Optional[Any] = None
            for user in list(node.users):
                if user.args[1] == 0:
                    if state is None:
                        with graph.inserting_before(node):
                            state = graph.call_function(
                                torch.ops.aten.empty.memory_format, ([0],),
                                {"dtype": torch.uint8, "device": torch.device("cpu")})
                        if val is not None:
                            state.meta["val"] = val[0].new_empty((0,))
                    user.replace_all_uses_with(state)
                else:
                    user.replace_all_uses_with(call)
                graph.erase_node(user)
        else:
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
        graph.erase_node(node)
        removed += 1
    if removed:
        graph.lint()
        gm.recompile()
    _stats["attention_unwrapped"] += removed
    _stats["rng_wrappers_kept"] += kept
    return removed


def cpp_wrapper_on() -> bool:
    """Whether inductor compiles with its C++ wrapper now (``torch._inductor.config.cpp_wrapper``,
    set by the user or by ``torch.compile(options=...)`` around the compile)."""
    from torch._inductor import config

    return bool(getattr(config, "cpp_wrapper", False))


def _rewriting(rewrite: Callable[[Any], int], what: str) -> Callable[[Callable], Callable]:
    """The compiler transform that runs ``rewrite`` on each graph while the C++ wrapper is on."""

    def with_rewrite(compiler: Callable) -> Callable:
        def compile_rewritten(gm: Any, example_inputs: Any) -> Any:
            changed = rewrite(gm) if cpp_wrapper_on() else 0
            if changed:
                log.debug("DeepCompile graph: %d %s", changed, what)
            return compiler(gm, example_inputs)

        return compile_rewritten

    return with_rewrite


def patch_typed_end_backward() -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that each DeepCompile graph inductor compiles with
    its C++ wrapper reaches it with ``ds_z3native::end_backward``; the undo restores it."""
    return wrap_inductor_compiler(_rewriting(type_end_backward, "end_backward calls retyped"),
                                  "DeepCompile graphs keep end_backward(Any), which inductor's "
                                  "C++ wrapper cannot call")


BACKEND_MODULE = "deepspeed.compile.backend"
PARTITIONER_MODULE = "deepspeed.compile.partitioner"
# The modules that call the partitioner factory by the name they imported: the backend (its
# "eager" backend) and the inductor module (``wrap_partition_fn``, the inductor backend's path).
PARTITIONER_CALLERS = (BACKEND_MODULE, "deepspeed.compile.inductor")


def _partitioning_without_graphsafe_rng(get_wrapped_partitioner: Callable) -> Callable:
    """DeepSpeed's ``get_wrapped_partitioner``, whose partitioner runs with AOTAutograd's
    ``graphsafe_rng_functionalization`` off while inductor's C++ wrapper is on, and whose forward
    and backward graphs then have their dropout-free attention unwrapped
    (:func:`unwrap_attention_rng`) before DeepSpeed's passes see them. DeepSpeed profiles the
    backward graph with the tensors the compiled forward saved: a forward unwrapped at its
    compile saves an empty state, which the backward's ``run_with_rng_state`` cannot restore on
    CUDA ("RNG state is wrong size"), and the profile stopped there."""

    def get_partitioner(*args: Any, **kwargs: Any) -> Callable:
        partition = get_wrapped_partitioner(*args, **kwargs)

        def partition_for_the_wrapper(*a: Any, **k: Any) -> Any:
            if not cpp_wrapper_on():
                return partition(*a, **k)
            from torch._functorch import config as functorch_config

            with functorch_config.patch(graphsafe_rng_functionalization=False):
                graphs = partition(*a, **k)
            for gm in graphs:
                unwrap_attention_rng(gm)
            return graphs

        return partition_for_the_wrapper

    return get_partitioner


def patch_attention_rng() -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that each DeepCompile graph inductor compiles with
    its C++ wrapper reaches it with its dropout-free attention calls unwrapped, and its
    ``get_wrapped_partitioner`` (in its module and in each module that imported it by name) so
    that such a graph's recomputed seeded ops get the ``run_and_save_rng_state`` form on every
    device (the undo restores both).

    On CUDA, AOTAutograd's default form is ``graphsafe_run_with_rng_state``, which takes the
    generator's state as a graph input, and inductor requires such an input to feed exactly one
    of those calls: an unwrapped call would leave it feeding none (an AssertionError in inductor's
    ``placeholder``). The other form passes the state as a tensor the rewrite can replace."""

    def apply_partitioner() -> Undo:
        import importlib

        owners = [importlib.import_module(name) for name in (PARTITIONER_MODULE,
                                                             *PARTITIONER_CALLERS)]
        if not hasattr(owners[0], "get_wrapped_partitioner"):
            log.warning("%s has no get_wrapped_partitioner: inductor's C++ wrapper cannot compile "
                        "checkpointed attention on CUDA", PARTITIONER_MODULE)
            return lambda: None
        return wrap_function(owners, "get_wrapped_partitioner",
                             _partitioning_without_graphsafe_rng)

    return undo_all([
        wrap_inductor_compiler(_rewriting(unwrap_attention_rng, "attention calls unwrapped"),
                               "checkpointed attention keeps its random-state wrapper"),
        when_module_imported(BACKEND_MODULE, apply_partitioner),
    ])


DEEPCOMPILE_TYPED_END_BACKWARD = Patch(
    name="deepcompile-typed-end-backward",
    summary="with inductor's C++ wrapper, DeepCompile graphs end their backward through "
            "ds_z3native::end_backward(Tensor[] deps), which it can call, instead of "
            "dc.end_backward(Any deps)",
    apply=patch_typed_end_backward,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.inductor:patch_compiler",
    ),
)

DEEPCOMPILE_ATTENTION_RNG = Patch(
    name="deepcompile-attention-rng",
    summary="with inductor's C++ wrapper, checkpointed attention calls without dropout reach "
            "it as plain calls, not inside the random-state wrapper AOTAutograd puts around "
            "recomputed seeded ops (which it cannot call)",
    apply=patch_attention_rng,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.inductor:patch_compiler",
        "deepspeed.compile.partitioner:get_wrapped_partitioner",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_TYPED_END_BACKWARD, DEEPCOMPILE_ATTENTION_RNG]


def _clear_stats() -> None:
    for key in _stats:
        _stats[key] = 0


RUN_STATE.register("inductor_calls", inductor_calls_stats, _clear_stats)
