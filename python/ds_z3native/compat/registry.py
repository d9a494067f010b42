"""Every patch of DeepSpeed's Python side that ``install()`` knows, in the order it applies them.

* ``deepcompile_frozen``: DeepCompile ZeRO-3 ``init_z3`` with frozen params.
* ``hf_graph_breaks``: ``engine.compile()`` removes the graph breaks of transformers'
  gradient checkpointing that non-reentrant checkpointing does not need.
* ``hf_moe_grouped_mm``: transformers' grouped-matmul fallback op (mixture-of-experts experts under
  torch.compile) gets a backward op AOTAutograd does not trace into, where transformers' own is a
  Python loop it cannot trace.
* ``deepcompile_eager``: after ``engine.compile()``, code outside the compiled graphs sees gathered
  params (or a clear error for trainable ones).
* ``deepcompile_prefetch``: DeepCompile's prefetch pass honours ``set_prefetch_budget``.
* ``deepcompile_graph_ids``: DeepCompile's graphs reach inductor with run-independent graph ids
  (warm FX-graph cache hits across runs).
* ``deepcompile_regroup``: a single cycle's graphs compiled before its persistence choice are
  compiled again with the params it kept gathered grouped (wraps the same function as the
  graph-id patch, around it, so it sees canonical ids).
* ``deepcompile_profile_store``: DeepCompile's graph profiles kept between runs.
* ``deepcompile_warm_start``: with a store holding the job's re-plan, DeepCompile compiles the
  re-plan's graphs at the first step (installed before the two below: they wrap the same
  function around it, the resume shift first).
* ``deepcompile_aot``: DeepSpeed 0.19.0's AotAutograd constructor patch tolerates AotAutograd
  objects built without its compilers.
* ``deepcompile_schedule``: DeepCompile's scheduler sees keyword inputs (evaluation graphs),
  and its compile passes start at a resumed step.
* ``deepcompile_persistent``: DeepCompile's re-plan chooses the params it keeps gathered first and
  reaches them with one op call per graph.
* ``deepcompile_dynamic_shapes``: inputs that are not ZeRO-3 params keep Dynamo's symbolic size
  guards (one graph for every sequence length); the re-plan keeps Dynamo's automatic-dynamic record.
* ``deepcompile_rank_sync``: DeepCompile on several ranks recompiles on every rank where any
  rank's guards fail, and the ranks agree on the dynamic input dimensions.
* ``cpu_accelerator``: DeepCompile on DeepSpeed's CPU accelerator gets a device it can parse.
* ``cuda_memory_counters``: DeepSpeed's CUDA accelerator reads the allocator's counters in one
  call (DeepCompile's profilers read them several times per graph node).
* ``deepcompile_profiling``: DeepCompile's passes collect garbage among what they made only, and
  its profilers skip their per-node reductions over a group of one rank.
* ``gloo_collectives``: DeepSpeed's collectives on CPU tensors under torch.compile's Python
  dispatcher run without it (a gloo deadlock otherwise).
* ``hf_trainer_loop``: HF Trainer's per-step walks of the module tree (``model.train()``,
  ``model.zero_grad()``, its FLOP count) cost a list walk, and its FLOP count sees ZeRO-3's params.
* ``zero3_walks``: ZeRO-3's optimizer step releases and checks every param over a kept
  parameter list instead of three walks of the module tree.
* ``zero3_grad_norm``: ZeRO-3's optimizer step takes a param group's gradient norm over the span
  of the gradient buffer its partitions cover, in one reduction instead of one per param.
* ``config_section``: a DeepSpeed engine applies the ``"ds_z3native"`` section of its config
  (ds_z3native's settings) before DeepSpeed builds it.
* ``checkpoint_recompute`` (optional module ``ds_z3native.compat.checkpoint_recompute``, its
  ``PATCHES``): eager ZeRO-3 with activation checkpointing of frozen params. Imported lazily; its
  absence is tolerated, an error while importing it is not.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Dict, List, Tuple

from packaging.version import Version

from . import Patch

__all__ = ["PATCH_MODULES", "OPTIONAL_MODULES", "all_patches", "patch_modules", "patches_for"]

log = logging.getLogger(__name__)

# The modules of this package whose ``PATCHES`` install() applies, in this order. A new patch
# module is one more name here (the test suite fails on a module with PATCHES not listed).
PATCH_MODULES = (
    "ds_z3native.compat.deepcompile_frozen",
    "ds_z3native.compat.deepcompile_leaf_modules",
    "ds_z3native.compat.hf_graph_breaks",
    "ds_z3native.compat.hf_moe_grouped_mm",
    "ds_z3native.compat.deepcompile_eager",
    "ds_z3native.compat.deepcompile_prefetch",
    "ds_z3native.compat.deepcompile_graph_ids",
    "ds_z3native.compat.deepcompile_regroup",
    "ds_z3native.compat.deepcompile_reduce_group",
    "ds_z3native.compat.deepcompile_inductor_calls",
    "ds_z3native.compat.inductor_attention_outputs",
    "ds_z3native.compat.deepcompile_profile_store",
    "ds_z3native.compat.deepcompile_warm_start",
    "ds_z3native.compat.deepcompile_schedule",
    "ds_z3native.compat.deepcompile_persistent",
    "ds_z3native.compat.deepcompile_dynamic_shapes",
    "ds_z3native.compat.deepcompile_rank_sync",
    "ds_z3native.compat.deepcompile_aot",
    "ds_z3native.compat.cpu_accelerator",
    "ds_z3native.compat.cuda_memory_counters",
    "ds_z3native.compat.deepcompile_profiling",
    "ds_z3native.compat.gloo_collectives",
    "ds_z3native.compat.hf_trainer_loop",
    "ds_z3native.compat.zero3_walks",
    "ds_z3native.compat.zero3_grad_norm",
    "ds_z3native.compat.zero3_overflow_order",
    "ds_z3native.compat.config_section",
)
OPTIONAL_MODULES = ("ds_z3native.compat.checkpoint_recompute",)


def _module_patches(module_name: str) -> List[Patch]:
    patches = list(importlib.import_module(module_name).PATCHES)
    bad = [p for p in patches if not isinstance(p, Patch)]
    if bad:
        raise TypeError(f"{module_name}.PATCHES holds non-Patch entries: {bad!r}")
    return patches


def _optional_patches(module_name: str) -> List[Patch]:
    if importlib.util.find_spec(module_name) is None:
        log.debug("%s is not installed; its patches are skipped", module_name)
        return []
    return _module_patches(module_name)


def _walk() -> List[Tuple[str, Patch]]:
    """(module name, patch) of every known patch, in application order."""
    found: List[Tuple[str, Patch]] = []
    for name in PATCH_MODULES:
        found += [(name, p) for p in _module_patches(name)]
    for name in OPTIONAL_MODULES:
        found += [(name, p) for p in _optional_patches(name)]
    return found


def all_patches() -> List[Patch]:
    """Every known patch, whatever DeepSpeed version it targets."""
    patches = [p for _, p in _walk()]
    names = [p.name for p in patches]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"two patches share a name: {duplicates}")
    return patches


def patch_modules() -> Dict[str, str]:
    """Each known patch's name -> the full name of the module that declares it."""
    return {p.name: module for module, p in _walk()}


def patches_for(version: Version) -> List[Patch]:
    """The patches that target DeepSpeed ``version``, in application order."""
    return [p for p in all_patches() if p.targets(version)]
