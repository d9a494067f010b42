"""DeepCompile's gradient reductions in one op call per group of gradients, not one per gradient.

DeepCompile's ZeRO passes put a ``dc.reduce_grad`` call after each gradient the backward graph
computes; inductor's wrapper code then makes one dispatcher call per trainable param per step.
The reduction behind it is bucketed (the gradient is copied into a bucket on a copy stream, and
the bucket is reduce-scattered when full or at ``end_backward``), so each call's host cost is
the call itself: a LoRA step on a 16-layer Llama made 224 of them (with its three other dc op
calls, 24.5 ms of host time in a 165 ms profiled step on an H200; the step is host-bound).

* :data:`DEEPCOMPILE_GROUPED_REDUCE` (every release whose ``deepspeed.compile.inductor`` has
  ``patch_compiler``): just before inductor compiles a DeepCompile graph, consecutive
  ``reduce_grad`` calls (in graph order) become one ``ds_z3native::reduce_grads`` call placed
  at the last of them (:func:`group_reduce_grads`): at most :data:`MAX_GRADS` gradients and
  :data:`MAX_BYTES` of them per call, since each is held until the call. The native op checks
  every id and gradient of the group before queuing any, then queues them as ``reduce_grad``
  does, with one lock and one wait of the copy stream for the compute stream. Inductor never
  plans another buffer into a gradient's storage (the copy stream reads it after the call
  returns), as DeepSpeed's lowering of ``reduce_grad`` does. Off with
  ``ds_z3native.set_group_reduce(False)`` (``DS_Z3NATIVE_GROUP_REDUCE=0``).

The grouping is a function of the graph alone, so a warm start's graphs are grouped as the cold
run's were and inductor's cache serves them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

from packaging.version import Version

from .. import settings
from ..run_state import RUN_STATE
from . import Patch, Undo
from ._fx import is_call
from .deepcompile_graph_ids import wrap_inductor_compiler
from .inductor_fallback import register_fallback_lowering

__all__ = ["DEEPCOMPILE_GROUPED_REDUCE", "PATCHES", "MAX_GRADS", "MAX_BYTES",
           "group_reduce_grads", "reduce_grads_op", "reduce_group_stats"]

log = logging.getLogger(__name__)

MAX_GRADS = 64  # gradients per reduce_grads call
MAX_BYTES = 64 << 20  # gradient bytes per call: each is held from its own reduce_grad's place

_stats = {"graphs": 0, "groups": 0, "grads": 0, "removed_calls": 0}


def reduce_group_stats() -> Dict[str, int]:
    """This process's counts: graphs rewritten (``graphs``), ``reduce_grads`` calls made
    (``groups``), gradients they take (``grads``) and op calls removed per step of those graphs
    (``removed_calls``: grads - groups)."""
    return dict(_stats)


def reduce_grads_op() -> Any:
    """``torch.ops.ds_z3native.reduce_grads.default`` (loads the native module)."""
    import torch

    from .. import _native

    _native.load()
    return torch.ops.ds_z3native.reduce_grads.default


def _grad_bytes(node: Any) -> Optional[int]:
    """The bytes of the gradient a ``reduce_grad`` node takes, from its traced value; None when
    unknown (symbolic or untraced)."""
    val = getattr(node.args[0], "meta", {}).get("val")
    try:
        return int(val.numel()) * int(val.element_size())
    except (AttributeError, TypeError, RuntimeError):
        return None


def _groups(nodes: List[Any], groupable: Callable[[Any], bool], max_grads: int,
            max_bytes: int) -> List[List[Any]]:
    """``nodes`` (``reduce_grad`` nodes in graph order) cut into runs of consecutive
    ``groupable`` ones of one graph id, each of at most ``max_grads`` nodes and ``max_bytes``
    gradient bytes (a gradient of unknown or larger size stands alone); a node that is not
    groupable ends the run before it."""
    groups: List[List[Any]] = []
    current: List[Any] = []
    held = 0
    for node in nodes:
        if not groupable(node):
            if current:
                groups.append(current)
            current, held = [], 0
            continue
        size = _grad_bytes(node)
        fits = (size is not None and len(current) < max_grads and held + size <= max_bytes
                and (not current or current[0].args[1] == node.args[1]))
        if current and not fits:
            groups.append(current)
            current, held = [], 0
        current.append(node)
        held += size if size is not None else max_bytes
    if current:
        groups.append(current)
    return groups


def _only_ended(node: Any, end_backward: Any) -> bool:
    """Whether ``node``'s value is used only by ``end_backward`` (its dependency list) or the
    graph's output: nothing between it and the group's call reads it."""
    return all(user.op == "output" or is_call(user, end_backward) for user in node.users)


def group_reduce_grads(gm: Any, max_grads: int = MAX_GRADS, max_bytes: int = MAX_BYTES) -> int:
    """Rewrite ``gm`` in place: consecutive ``dc.reduce_grad`` nodes become one
    ``ds_z3native::reduce_grads`` node at the place of the last of them, whose value stands for
    each of theirs (``end_backward``'s dependencies name it once). Returns the number of
    ``reduce_grad`` nodes removed (0: the graph is unchanged)."""
    import torch

    dc = torch.ops.dc
    graph = gm.graph
    reduce_grad, end_backward = dc.reduce_grad.default, dc.end_backward.default
    nodes = [n for n in graph.nodes if is_call(n, reduce_grad)]
    if len(nodes) < 2:
        return 0

    def groupable(n: Any) -> bool:
        return (len(n.args) >= 3 and isinstance(n.args[0], torch.fx.Node)
                and _only_ended(n, end_backward))

    op = None
    removed = groups = 0
    for members in _groups(nodes, groupable, max_grads, max_bytes):
        if len(members) < 2:
            continue
        if op is None:
            op = reduce_grads_op()
            register_fallback_lowering(op, never_reuse_inputs=True)
        last = members[-1]
        with graph.inserting_after(last):
            group = graph.call_function(
                op, (last.args[1], [n.args[0] for n in members], [int(n.args[2]) for n in members]))
        if "val" in last.meta:
            group.meta["val"] = last.meta["val"]
        for node in members:
            node.replace_all_uses_with(group)
            graph.erase_node(node)
        removed += len(members) - 1
        groups += 1
    if not groups:
        return 0
    # end_backward's dependency list names each group once.
    for node in graph.nodes:
        if is_call(node, end_backward) and isinstance(node.args[0], (list, tuple)):
            deps: List[Any] = []
            for dep in node.args[0]:
                if not (isinstance(dep, torch.fx.Node) and dep in deps):
                    deps.append(dep)
            node.args = (deps, *node.args[1:])
    graph.lint()
    gm.recompile()
    _stats["graphs"] += 1
    _stats["groups"] += groups
    _stats["grads"] += removed + groups
    _stats["removed_calls"] += removed
    log.info("DeepCompile graph %s: %d reduce_grad calls grouped into %d reduce_grads calls",
             nodes[0].args[1], removed + groups, groups)
    return removed


def _grouping(compiler: Callable) -> Callable:
    def compile_with_grouped_reduce(gm: Any, example_inputs: Any) -> Any:
        if settings.current().group_reduce:
            group_reduce_grads(gm)
        return compiler(gm, example_inputs)

    return compile_with_grouped_reduce


def patch_grouped_reduce() -> Undo:
    """Wrap DeepSpeed's ``patch_compiler`` so that inductor compiles each DeepCompile graph with
    its reductions grouped; the undo restores it."""
    return wrap_inductor_compiler(_grouping, "DeepCompile graphs keep one reduce_grad call per "
                                  "gradient")


DEEPCOMPILE_GROUPED_REDUCE = Patch(
    name="deepcompile-grouped-reduce",
    summary="DeepCompile's backward graphs hand their gradients to the reduction in groups, one "
            "ds_z3native::reduce_grads call per up to 64 gradients, instead of one reduce_grad "
            "call each",
    apply=patch_grouped_reduce,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.inductor:patch_compiler",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_GROUPED_REDUCE]


def _clear_stats() -> None:
    for key in _stats:
        _stats[key] = 0


RUN_STATE.register("reduce_group", reduce_group_stats, _clear_stats)
