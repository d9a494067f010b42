"""DeepCompile's persistent params reached in one op call per graph, not three per use.

DeepCompile's ``selective_gather`` pass keeps parameters gathered across steps when memory
allows (``set_persistent``): on one H200 every parameter of a 1 B LoRA model. It decides at the
end of the re-plan (the last backward graph's compile at step 5), after the re-plan's other
graphs are compiled; so every graph keeps an ``allgather_param`` / ``wait_allgather`` /
``release_param`` call per param use, each a dispatcher call from inductor's wrapper code that
does nothing for a param kept gathered: 2,554 of them per step on that model, about 39 ms of host
time in a host-bound step.

* :data:`DEEPCOMPILE_PERSISTENT_GROUP` (every release whose re-plan runs ``selective_gather``):
  when DeepSpeed launches the re-plan (``launch_compile_passes``), before it clears the first
  cycle's profiles, DeepSpeed's own ``selective_gather`` runs once on them (the complete profiles
  of every graph, as the pass reads them for the last backward graph), so its choice is made
  before the re-plan compiles anything. The re-plan then ends each graph's passes with
  :func:`group_persistent_gathers`: the gathers of params kept gathered become one
  ``ds_z3native::gather_persistent`` call at the graph's first gather (which re-gathers, in one
  collective group, the trainable ones an optimizer step made stale), and their waits and
  releases go. Params it does not keep gathered are left as DeepSpeed scheduled them; its own
  ``selective_gather`` still runs at the end of the re-plan and may add more (those keep their
  calls). Off with ``DS_Z3NATIVE_GROUP_PERSISTENT=0`` or ``ds_z3native.set_group_persistent(False)``
  (read at each re-plan).

The choice is DeepSpeed's: its pass, its memory budget (profiled peaks and the device's free
memory, agreed over the ranks with an all-reduce), made one re-plan earlier on the first cycle's
profiles, whose graphs have no prefetch yet.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

from packaging.version import Version

from .. import settings
from ..run_state import RUN_STATE
from . import Patch, Undo
from ._fx import is_call
from ._rebind import when_module_imported
from .deepcompile_schedule import wrap_launch_compile_passes
from .inductor_fallback import register_fallback_lowering

__all__ = ["DEEPCOMPILE_PERSISTENT_GROUP", "PATCHES", "group_persistent_gathers",
           "gather_persistent_op", "choose_persistent_early", "last_backward_graph",
           "group_stats", "persistent_ids", "early_choice"]

log = logging.getLogger(__name__)

BACKEND_MODULE = "deepspeed.compile.backend"
SELECTIVE_GATHER_MODULE = "deepspeed.compile.passes.selective_gather"

# What this process's re-plans did: early choices made, graphs grouped, params and dc op calls.
_stats = {"early_choices": 0, "graphs": 0, "params": 0, "removed_calls": 0}
# The params kept gathered after this process's last early choice (ds_ids, ascending).
_early: List[int] = []


def group_stats() -> Dict[str, int]:
    """This process's counts: re-plans whose persistent params were chosen early
    (``early_choices``), graphs rewritten (``graphs``), params reached through
    ``gather_persistent`` summed over them (``params``) and dc op nodes removed
    (``removed_calls``)."""
    return dict(_stats)


def early_choice() -> List[int]:
    """The params (ds_ids, ascending) kept gathered right after this process's last early
    choice; empty before one."""
    return list(_early)


def persistent_ids(param_managers: Dict[int, Any]) -> List[int]:
    """The ds_ids of the params of ``param_managers`` (DeepCompile's ``DSGraphParamManager`` per
    graph) that the native runtime keeps gathered, ascending."""
    from .. import _native

    m = _native.load()
    ids = {int(ds_id) for pm in param_managers.values() for ds_id in pm.ds_ids.values()}
    return sorted(ds_id for ds_id in ids if m.param_state(ds_id)["persistent"])


def gather_persistent_op() -> Any:
    """``torch.ops.ds_z3native.gather_persistent.default`` (loads the native module)."""
    import torch

    from .. import _native

    _native.load()
    return torch.ops.ds_z3native.gather_persistent.default


def _gather_dtype(node: Any) -> Any:
    """The ``dtype`` argument of an ``allgather_param`` node (None: the shard's dtype)."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")


def group_persistent_gathers(gm: Any, graph_id: int, graph_order: Any, profiling_results: Any,
                             create_inputs_fn: Any, mem_budget: Any, param_manager: Any,
                             bwd: bool, is_persistent: Optional[Callable[[int], bool]] = None
                             ) -> Any:
    """A DeepCompile pass (DeepSpeed's pass signature): the ``allgather_param`` nodes of params
    kept gathered (``is_persistent``, default: the native runtime's flag) become the outputs of
    one ``gather_persistent`` node, and their ``wait_allgather`` and ``release_param`` nodes go
    (each returns its input). Returns the changed graph module, or None when nothing changed."""
    import torch

    dc = torch.ops.dc
    if is_persistent is None:
        from .. import _native

        m = _native.load()

        def is_persistent(ds_id: int) -> bool:
            return bool(m.param_state(ds_id)["persistent"])

    graph = gm.graph
    gathers: Dict[int, List[Any]] = {}
    for node in graph.nodes:
        if is_call(node, dc.allgather_param.default):
            gathers.setdefault(int(node.args[2]), []).append(node)
    chosen: List[Tuple[int, Any, Any]] = []  # ds_id, param input, dtype
    for ds_id, nodes in gathers.items():
        dtypes = {_gather_dtype(n) for n in nodes}
        sources = {n.args[0] for n in nodes}
        if len(dtypes) != 1 or len(sources) != 1 or not is_persistent(ds_id):
            continue
        # A param the graph returns as it is (its wait is a graph output) keeps DeepSpeed's
        # nodes: the output's name is recorded on them.
        if any(user.op == "output" for n in nodes for wait in n.users for user in wait.users):
            continue
        source = next(iter(sources))
        if not isinstance(source, torch.fx.Node) or source.op != "placeholder":
            continue
        chosen.append((ds_id, source, next(iter(dtypes))))
    if not chosen:
        return None
    register_fallback_lowering(gather_persistent_op(), never_reuse_inputs=False)
    chosen_ids = {ds_id for ds_id, _, _ in chosen}
    first = next(n for n in graph.nodes if is_call(n, dc.allgather_param.default)
                 and int(n.args[2]) in chosen_ids)
    ids = [ds_id for ds_id, _, _ in chosen]
    dtypes = [dtype for _, _, dtype in chosen]
    with graph.inserting_before(first):
        group = graph.call_function(
            gather_persistent_op(),
            (graph_id, [source for _, source, _ in chosen], ids,
             # One entry per id (None: the shard's dtype), or none at all.
             [] if all(d is None for d in dtypes) else dtypes))
        group.meta["val"] = [gathers[ds_id][0].meta.get("val") for ds_id in ids]
        full = {}
        for i, ds_id in enumerate(ids):
            item = graph.call_function(operator.getitem, (group, i))
            item.meta["val"] = gathers[ds_id][0].meta.get("val")
            full[ds_id] = item
    removed = 0
    for ds_id in ids:
        for gather in gathers[ds_id]:
            gather.replace_all_uses_with(full[ds_id])
            graph.erase_node(gather)
            removed += 1
    for node in list(graph.nodes):
        if (is_call(node, dc.wait_allgather.default) or is_call(node, dc.release_param.default)) \
                and int(node.args[2]) in chosen_ids:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
        elif is_call(node, dc.prefetch_params_fused.default) and set(node.args[2]) & chosen_ids:
            keep = [i for i, ds_id in enumerate(node.args[2]) if ds_id not in chosen_ids]
            if not keep:
                graph.erase_node(node)
            else:
                args = list(node.args)
                args[1] = [node.args[1][i] for i in keep]
                args[2] = [node.args[2][i] for i in keep]
                if len(args) > 3 and args[3] is not None:
                    args[3] = [node.args[3][i] for i in keep]
                node.args = tuple(args)
    _stats["graphs"] += 1
    _stats["params"] += len(ids)
    _stats["removed_calls"] += removed
    log.info("DeepCompile graph %d (%s): %d params kept gathered reached by one "
             "gather_persistent call (%d dc op calls removed)", graph_id,
             "backward" if bwd else "forward", len(ids), removed)
    return gm


# A pass this package adds: no cycle label of the profile store names it.
group_persistent_gathers.ds_z3native_label = None  # type: ignore[attr-defined]


def last_backward_graph(graph_order: List[Tuple[int, bool]]) -> Optional[int]:
    """The graph whose backward runs last (the first forward graph that needs a backward), where
    DeepSpeed's ``selective_gather`` acts; None without a backward graph."""
    return next((graph_id for graph_id, needs_bwd in graph_order if needs_bwd), None)


def choose_persistent_early(selective_gather: Callable, profiling_results: Dict[int, Any],
                            graph_order: List[Tuple[int, bool]], param_manager: Dict[int, Any]
                            ) -> bool:
    """Run DeepSpeed's ``selective_gather`` on a finished cycle's profiles, as it runs on the
    last backward graph; False (nothing run) when the cycle has no backward graph or no
    profiles."""
    last_backward = last_backward_graph(graph_order)
    if last_backward is None or last_backward not in profiling_results:
        return False
    selective_gather(None, last_backward, graph_order, profiling_results, None, None,
                     param_manager, True)
    _stats["early_choices"] += 1
    return True


def _launching_with_early_persistence(launch: Callable) -> Callable:
    def launch_compile_passes(global_steps: int, *args: Any, **kwargs: Any) -> Any:
        import sys

        backend = sys.modules[BACKEND_MODULE]
        sg_module = sys.modules.get(SELECTIVE_GATHER_MODULE)
        selective_gather = getattr(sg_module, "selective_gather", None)
        schedule = getattr(backend, "remaining_schedule", None)
        due = bool(schedule) and schedule[0][0] == global_steps
        replan = due and selective_gather is not None and any(
            getattr(p, "__name__", None) == "selective_gather" for p in schedule[0][1])
        enabled = replan and settings.current().group_persistent
        if enabled:
            profiles = dict(backend.profiling_results)
            try:
                order = backend.graph_order_with_frame_id.get_graph_order()
            except AssertionError:  # a graph whose backward was never decided
                order = []
            managers = dict(backend.param_manager)
        result = launch(global_steps, *args, **kwargs)
        if not enabled:
            return result
        if choose_persistent_early(selective_gather, profiles, order, managers):
            _early[:] = persistent_ids(managers)
            backend.next_passes = list(backend.next_passes) + [group_persistent_gathers]
        else:
            log.info("DeepCompile re-plan at step %d: no complete first cycle to choose "
                     "persistent params from; the re-plan runs as DeepSpeed's", global_steps)
        return result

    return launch_compile_passes


def patch_persistent_group() -> Undo:
    """Wrap ``launch_compile_passes`` (and the modules' own references to it)."""

    def apply() -> Undo:
        import importlib

        importlib.import_module(SELECTIVE_GATHER_MODULE)
        return wrap_launch_compile_passes(_launching_with_early_persistence)

    return when_module_imported(BACKEND_MODULE, apply)


DEEPCOMPILE_PERSISTENT_GROUP = Patch(
    name="deepcompile-persistent-group",
    summary="DeepCompile chooses the params it keeps gathered at the start of its re-plan and "
            "reaches them with one gather_persistent call per graph (DeepSpeed: three dc op "
            "calls per use, each a no-op for a param kept gathered)",
    apply=patch_persistent_group,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.backend:launch_compile_passes",
        "deepspeed.compile.backend:profiling_results",
        "deepspeed.compile.backend:param_manager",
        "deepspeed.compile.passes.selective_gather:selective_gather",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_PERSISTENT_GROUP]


def _clear_stats() -> None:
    for key in _stats:
        _stats[key] = 0


RUN_STATE.register("persistent_group", group_stats, _clear_stats)
