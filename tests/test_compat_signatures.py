"""Each patch's version range against the installed DeepSpeed's signatures and call forms.

A patch wraps DeepSpeed functions and passes their arguments on by position or reads them by
name; a release that renames, reorders or drops one would break the patch only when the wrapped
code runs (often only under CUDA DeepCompile). :data:`USES` lists, for every patch, the DeepSpeed
callables it wraps or calls and the leading parameters it relies on; the tests check them in the
installed release for every patch that targets it, so running them on each release (CI's release
matrix) checks each patch's ``first``/``last`` against the signatures of every release it covers.
The pre-backward hook is checked through DeepSpeed's own caller, which is where 0.19.0 - 0.19.1
differ (they call hooks with no argument).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from packaging.version import Version

from ds_z3native.compat import deepspeed_version
from ds_z3native.compat.registry import all_patches

pytestmark = [pytest.mark.deepspeed, pytest.mark.release_matrix]

_ENGINE = "deepspeed.runtime.engine"
_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
_INIT_Z3 = ("deepspeed.compile.init_z3", "init_z3", ("engine",))
_RECOMPUTE = [
    (_COORDINATOR, "PartitionedParameterCoordinator.fetch_sub_module",
     ("self", "current_submodule", "forward")),
    (_COORDINATOR, "PartitionedParameterCoordinator.release_sub_module",
     ("self", "submodule", "forward")),
    (_COORDINATOR, "PartitionedParameterCoordinator.reset_step", ("self",)),
    (_COORDINATOR, "PartitionedParameterCoordinator.__release_param", ("self", "param")),
    (_COORDINATOR, "iter_params", ("module", "recurse")),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.backward_epilogue", ("self",)),
    (_ENGINE, "DeepSpeedEngine.backward", ("self",)),
]

# patch name -> (module, attribute path, leading parameter names the patch relies on; None: an
# attribute that must exist and is not called).
USES: Dict[str, List[Tuple[str, str, Optional[Tuple[str, ...]]]]] = {
    "deepcompile-z3-frozen-grad-buffer": [_INIT_Z3],
    "deepcompile-z3-declare-frozen": [_INIT_Z3,
                                      ("deepspeed.compile.util", "get_deepcompile_handle", ())],
    "deepcompile-z3-unfrozen-guard": [_INIT_Z3,
                                      ("deepspeed.compile.util", "add_pre_backward_hook", ("hook",)),
                                      ("deepspeed.compile.util", "pre_backward_hooks", None)],
    "deepcompile-z3-leaf-module-hooks": [
        _INIT_Z3,
        ("deepspeed.runtime.zero.stage3",
         "DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks", ("self",))],
    "deepcompile-z3-eager-generate": [
        # transformers' generate() is what it wraps; of DeepSpeed only the engines compiled
        # with the eager gather (deepcompile-z3-eager-gather), found through their modules.
        (_ENGINE, "DeepSpeedEngine.compile", ("self",))],
    "deepcompile-hf-checkpoint-graph-breaks": [
        (_ENGINE, "DeepSpeedEngine.compile", ("self",)),
        (_ENGINE, "DeepSpeedEngine.is_deepcompile_enabled", ("self",))],
    "deepcompile-z3-eager-gather": [
        (_ENGINE, "DeepSpeedEngine.compile", ("self",)),
        (_ENGINE, "DeepSpeedEngine.forward", ("self",)),
        # The wrapper reads retain_graph as the second argument after self.
        (_ENGINE, "DeepSpeedEngine.backward", ("self", "loss", "retain_graph")),
        (_ENGINE, "DeepSpeedEngine.is_deepcompile_active", ("self",)),
        (_ENGINE, "DeepSpeedEngine.zero_optimization_partition_weights", ("self",)),
        ("deepspeed.runtime.zero.parameter_offload", "ZeROOrderedDict.__init__",
         ("self", "parent_module"))],
    "deepcompile-prefetch-budget": [
        ("deepspeed.compile.passes.prefetch", "schedule_prefetch", ()),
        ("deepspeed.compile.passes.prefetch", "MAX_BUFFERED_SIZE", None)],
    "deepcompile-canonical-graph-ids": [
        ("deepspeed.compile.inductor", "patch_compiler",
         ("original_compiler", "dc_compiler", "z3_partition", "graph_id"))],
    # The wrapper reads bwd by keyword or as the sixth argument (DeepSpeed passes it by keyword).
    "deepcompile-single-cycle-regroup": [
        ("deepspeed.compile.inductor", "patch_compiler",
         ("original_compiler", "dc_compiler", "z3_partition", "graph_id", "graph_param_manager",
          "bwd")),
        ("deepspeed.compile.backend", "profiling_results", None),
        ("deepspeed.compile.backend", "param_manager", None)],
    # The wrapper passes every argument on, the compiler first.
    "deepcompile-grouped-reduce": [
        ("deepspeed.compile.inductor", "patch_compiler", ("original_compiler",))],
    "deepcompile-typed-end-backward": [
        ("deepspeed.compile.inductor", "patch_compiler", ("original_compiler",))],
    # The partitioner wrapper passes every argument on, to the factory and to its partitioner;
    # the backend and the inductor module call the factory by the name they imported.
    "deepcompile-attention-rng": [
        ("deepspeed.compile.inductor", "patch_compiler", ("original_compiler",)),
        ("deepspeed.compile.partitioner", "get_wrapped_partitioner", None),
        ("deepspeed.compile.backend", "get_wrapped_partitioner", None),
        ("deepspeed.compile.inductor", "get_wrapped_partitioner", None)],
    "deepcompile-cache-checkpoint-rng": [],  # a torch config table: see tests/test_compat_graph_ids.py
    # torch's: the wrapper passes every argument on and edits the pickler's dispatch_table after.
    "deepcompile-generator-cache-key": [
        ("torch._inductor.codecache", "FxGraphCachePickler.__init__", ("self",))],
    # torch's: the source is passed by keyword, as DeepSpeed's and AOTAutograd's callers do.
    "deepcompile-sourceless-symbols": [
        ("torch._subclasses.fake_tensor", "FakeTensorMode.from_tensor", ("self", "tensor"))],
    "deepcompile-profile-store": [
        ("deepspeed.compile.profilers.graph_profile", "ProfilingInterpreter.run", ("self",)),
        ("deepspeed.compile.profilers.graph_profile", "MemoryProfilingInterpreter.run", ("self",)),
        ("deepspeed.compile.profilers.comm_profile", "run_all_gather", ("device", "dtype"))],
    "gloo-collectives-outside-python-dispatch": [
        ("deepspeed.comm.torch", "TorchBackend.all_gather_into_tensor", ("self",)),
        ("deepspeed.comm.torch", "TorchBackend.reduce_scatter_tensor", ("self",))],
    "deepcompile-kwargs-dependencies": [
        ("deepspeed.compile.list_schedule", "filter_args", ("node",)),
        ("deepspeed.compile.list_schedule", "get_node_requirements", ("target_node", "scheduled"))],
    "deepcompile-resume-schedule": [
        ("deepspeed.compile.backend", "launch_compile_passes", ("global_steps",)),
        ("deepspeed.compile.backend", "remaining_schedule", None),
        ("deepspeed.compile.backend", "init_schedule", ("schedule",))],
    "deepcompile-symbolic-input-guards": [
        ("deepspeed.compile.patch_fake_tensor", "patch_fake_tensor", ()),
        ("deepspeed.compile.patch_fake_tensor", "_get_guard_sizes_strides", ("t",)),
        ("deepspeed.compile.init_z3", "patch_fake_tensor", None)],  # imported there
    "deepcompile-keep-automatic-dynamic": [
        ("deepspeed.compile.backend", "launch_compile_passes", ("global_steps",))],
    # Reads is_deepcompile_active() and module after the original returns.
    "deepcompile-ranks-compile-together": [
        (_ENGINE, "DeepSpeedEngine.compile", ("self",)),
        (_ENGINE, "DeepSpeedEngine.is_deepcompile_active", ("self",))],
    "deepcompile-persistent-group": [
        ("deepspeed.compile.backend", "launch_compile_passes", ("global_steps",)),
        ("deepspeed.compile.backend", "remaining_schedule", None),
        ("deepspeed.compile.backend", "next_passes", None),
        ("deepspeed.compile.backend", "profiling_results", None),
        ("deepspeed.compile.backend", "param_manager", None),
        ("deepspeed.compile.backend", "graph_order_with_frame_id", None),
        # Called by position, as run_opt_passes calls a pass.
        ("deepspeed.compile.passes.selective_gather", "selective_gather",
         ("gm", "graph_id", "graph_order", "profiling_results", "create_inputs_fn", "mem_budget",
          "param_manager", "bwd"))],
    "deepcompile-warm-start": [
        ("deepspeed.compile.backend", "launch_compile_passes", ("global_steps",)),
        ("deepspeed.compile.backend", "remaining_schedule", None),
        ("deepspeed.compile.backend", "next_passes", None),
        ("deepspeed.compile.backend", "param_manager", None),
        ("deepspeed.compile.util", "get_deepcompile_handle", ()),
        # The passes of DeepSpeed's default re-plan, found by these names in its schedule.
        ("deepspeed.compile.passes.zero3_compile", "add_z3_gather_release", ("gm", "graph_id")),
        ("deepspeed.compile.passes.prefetch", "schedule_prefetch", ("gm", "graph_id")),
        ("deepspeed.compile.passes.selective_gather", "selective_gather",
         ("gm", "graph_id", "graph_order", "profiling_results", "create_inputs_fn", "mem_budget",
          "param_manager", "bwd"))],
    "deepcompile-aot-partial-constructions": [
        ("deepspeed.compile.inductor", "patch_create_aot_dispatcher_function",
         ("graph_id", "z3_partition", "make_fw_graph", "make_bw_graph"))],
    "zero3-coalesced-gather-waits-on-every-handle": [
        ("deepspeed.runtime.zero.partition_parameters", "Init._allgather_params_coalesced",
         ("self",)),
        ("deepspeed.comm.comm", "all_gather_into_tensor", ()),
        ("deepspeed.comm.comm", "all_gather", ())],
    "deepcompile-cpu-device": [
        ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator.current_device", ("self",))],
    "cuda-memory-counters": [
        ("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator.memory_allocated",
         ("self", "device_index")),
        ("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator.max_memory_allocated",
         ("self", "device_index"))],
    "deepcompile-pass-gc": [
        ("deepspeed.compile.backend", "run_opt_passes",
         ("opt_passes", "gm", "graph_id", "graph_order", "profiling_results", "create_inputs_fn",
          "mem_budget", "param_manager", "bwd"))],
    "deepcompile-one-rank-profile": [
        ("deepspeed.compile.profilers.graph_profile", "ProfilingInterpreter.run_node",
         ("self", "n")),
        ("deepspeed.compile.profilers.graph_profile", "MemoryProfilingInterpreter.run_node",
         ("self", "n")),
        # OneRankComm reads the group and async_op of these by position or name.
        ("deepspeed.comm.comm", "all_reduce", ("tensor", "op", "group", "async_op")),
        ("deepspeed.comm.comm", "barrier", ("group", "async_op")),
        ("deepspeed.comm.comm", "get_world_size", ("group",))],
    "hf-trainer-zero3-flos": [],  # transformers' Trainer only: see tests/test_hf_trainer_loop.py
    # transformers' and torch's only: see tests/test_compat_hf_moe_grouped_mm.py
    "hf-grouped-mm-fallback-backward": [],
    "engine-train-unchanged-mode": [
        (_ENGINE, "DeepSpeedEngine.train", ("self", "mode"))],
    "engine-zero-grad-param-list": [(_ENGINE, "DeepSpeedEngine.zero_grad", ("self",))],
    "zero3-release-param-list": [
        ("deepspeed.runtime.zero.partitioned_param_coordinator",
         "PartitionedParameterCoordinator.release_and_reset_all", ("self", "module")),
        ("deepspeed.runtime.zero.partitioned_param_coordinator",
         "PartitionedParameterCoordinator.__release_param", ("self", "param", "free_data")),
        ("deepspeed.runtime.zero.parameter_offload",
         "DeepSpeedZeRoOffload.partition_all_parameters", ("self",)),
        ("deepspeed.runtime.zero.parameter_offload",
         "DeepSpeedZeRoOffload.get_param_coordinator", ("self",))],
    "deepcompile-z3-fallback-module-list": [
        ("deepspeed.compile.z3_eager_fallback",
         "DeepCompileZ3EagerFallback._enable_forward_fallback", ("self",)),
        ("deepspeed.compile.z3_eager_fallback",
         "DeepCompileZ3EagerFallback._disable_forward_fallback", ("self",)),
        ("deepspeed.compile.z3_eager_fallback",
         "DeepCompileZ3EagerFallback.release_available_params_for_next_forward", ("self",)),
        ("deepspeed.compile.z3_eager_fallback",
         "DeepCompileZ3EagerFallback._release_unclaimed_tracked_params", ("self",)),
        ("deepspeed.runtime.zero.parameter_offload", "ensure_zero_ordered_dict", ("module",))],
    "zero3-flat-grad-norm": [
        ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct",
         ("self", "gradients", "params", "norm_type"))],
    "inductor-attention-aux-outputs": [
        ("torch._inductor.ir", "ExternKernel.codegen_alignment_asserts", ("self", "wrapper")),
        ("torch._inductor.ir", "ExternKernel.codegen_size_asserts", ("self", "wrapper"))],
    "zero3-overflow-after-reductions": [
        ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.has_overflow",
         ("self", "partition_gradients"))],
    # The wrapper binds __init__'s arguments to its signature and reads config_class (the
    # parsed config's _param_dict: tests/test_settings_config.py) and config by name.
    "engine-config-section": [
        (_ENGINE, "DeepSpeedEngine.__init__",
         ("self", "args", "model", "optimizer", "model_parameters", "training_data",
          "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config", "config_class"))],
    "checkpoint-recompute-frozen": _RECOMPUTE,
    "checkpoint-recompute-hardening": _RECOMPUTE,
}

VERSION = deepspeed_version()


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        if part.startswith("__") and not part.endswith("__"):  # private: as Python mangles it
            part = f"_{type(obj).__name__ if not isinstance(obj, type) else obj.__name__}{part}"
        obj = getattr(obj, part)
    return obj


def _parameters(module: str, path: str) -> List[str]:
    """The parameter names of the function ``path`` as written in ``module``'s source. Read from
    the source: DeepSpeed decorates some (nvtx ranges) with wrappers that hide the signature."""
    tree = ast.parse(Path(importlib.import_module(module).__file__).read_text())
    scope: List[ast.stmt] = tree.body
    for part in path.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef)) and n.name == part]
        assert found, f"{module}: no {path} in the source"
        node = found[-1]
        scope = node.body
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), path
    a = node.args
    return [x.arg for x in a.posonlyargs + a.args]


def test_every_patch_says_what_it_uses() -> None:
    assert set(USES) == {p.name for p in all_patches()}


@pytest.mark.parametrize("patch", [p for p in all_patches() if p.targets(VERSION)],
                         ids=lambda p: p.name)
def test_what_each_patch_uses_has_the_parameters_it_relies_on(patch: Any) -> None:
    wrong = []
    for module, path, leading in USES[patch.name]:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError) as e:
            wrong.append(f"{module}.{path}: missing ({e})")
            continue
        if leading is None:
            continue
        names = _parameters(module, path)[:len(leading)]
        if tuple(names) != leading:
            wrong.append(f"{module}.{path}: parameters start {names}, the patch relies on "
                         f"{list(leading)}")
    assert not wrong, f"DeepSpeed {VERSION} vs {patch.name}: " + "; ".join(wrong)


def test_recompute_patch_ranges_split_where_deepspeeds_own_attribution_begins() -> None:
    # checkpoint-recompute-frozen replaces nothing upstream (0.19.0 - 0.19.2); the hardening
    # runs beside DeepSpeed's update_recompute_parameters (0.19.3+).
    from ds_z3native.compat.checkpoint_recompute import RECOMPUTE_FROZEN, RECOMPUTE_HARDENING

    upstream = hasattr(importlib.import_module(_COORDINATOR), "update_recompute_parameters")
    assert RECOMPUTE_HARDENING.targets(VERSION) is upstream
    assert RECOMPUTE_FROZEN.targets(VERSION) is (not upstream)


def test_frozen_grad_buffer_patch_targets_the_releases_that_look_frozen_params_up() -> None:
    # Up to 0.19.5 init_z3 reads the optimizer's grad partition of every param; 0.19.6+ only
    # of params that require grad. Read from the installed source.
    from ds_z3native.compat.deepcompile_frozen import FROZEN_GRAD_BUFFER

    source = inspect.getsource(importlib.import_module("deepspeed.compile.init_z3").init_z3)
    assert "__param_id_to_grad_partition[p.ds_id]" in source
    checks_requires_grad = "p.requires_grad" in source
    assert FROZEN_GRAD_BUFFER.targets(VERSION) is (not checks_requires_grad)


def test_unfrozen_guard_runs_in_deepspeeds_backward_prologue() -> None:
    # DeepSpeed's own caller of pre-backward hooks: 0.19.0 - 0.19.1 call them with no argument,
    # 0.19.2+ with the accumulation-boundary flag. The guard raises before the prologue goes on
    # to the native start_backward.
    from deepspeed.compile import util
    from ds_z3native.compat.deepcompile_frozen import UnfrozenAfterCompile, _UnfrozenGuard

    weight = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    weight.ds_id = 41
    guard = _UnfrozenGuard([("layer.weight", weight)])
    util.add_pre_backward_hook(guard)
    try:
        weight.requires_grad_(True)
        for boundary in (True, False):
            with pytest.raises(UnfrozenAfterCompile, match=r"layer\.weight \(ds_id 41\)"):
                util.deepcompile_backward_prologue(boundary)
    finally:
        util.pre_backward_hooks.remove(guard)


def test_pre_backward_hook_call_form_matches_the_release() -> None:
    # What the guard must accept, read from the installed caller's source.
    from deepspeed.compile import util

    source = inspect.getsource(util.deepcompile_backward_prologue)
    with_flag = "hook(is_gradient_accumulation_boundary)" in source
    assert with_flag or "hook()" in source, source
    assert with_flag is (VERSION >= Version("0.19.2"))
