"""The LoRA benchmark's variants as data: one :class:`Variant` record each (how it trains, what it
sets, its baseline), in :data:`VARIANT_TABLE`; ``bench/lora_llama.py`` runs them, ``merge``
measures each against its baseline, ``report.py`` labels their rows and docs/benchmarks.md's
variant table is :func:`variant_table_markdown`. Standard library only (the report imports it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

__all__ = ["Variant", "VARIANT_TABLE", "VARIANT_BY_NAME", "VARIANTS", "VARLEN", "CHECKPOINTING",
           "DEEPCOMPILE", "UPSTREAM_DC", "OPT_IN", "OURS_DC", "TRAINER", "SINGLE_CYCLE",
           "variant_table_markdown"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One LoRA variant: how it trains and against what it is measured.

    ``framework``: DeepSpeed ZeRO-3, plain PyTorch (no sharding) or PyTorch FSDP2
    (``fully_shard`` per decoder layer and the root), the peers; ``compile``: ``torch.compile``
    applied to the whole model or to each decoder layer (``module.compile()``, before sharding).
    ``op``: whose dc op DeepCompile runs and whether ds_z3native is installed: ``"ours"``
    (``ds_z3native.install()``, then ``configure(**settings)``), ``"deepspeed"`` (DeepSpeed's own
    JIT-built op, no ds_z3native) or ``None`` (no DeepCompile; eager variants other than ``ours``
    run DeepSpeed alone). ``trainer_of`` / ``varlen_of``: the variant of our own loop / at a fixed
    length it repeats, its baseline in the merge. ``opt_in``: left out of a full run (run when
    named, or by another benchmark)."""

    name: str
    about: str  # docs/benchmarks.md's variant table
    checkpointing: str  # "none", "non-reentrant" or "reentrant"
    deepcompile: bool = False
    op: Optional[str] = None
    settings: Tuple[Tuple[str, Any], ...] = ()  # ds_z3native.configure() fields
    framework: str = "deepspeed"  # "deepspeed", "torch" (one process, no sharding) or "fsdp2"
    compile: Optional[str] = None  # torch.compile of "model" or of each decoder layer ("layers")
    opt_in: bool = False
    trainer_of: Optional[str] = None
    varlen_of: Optional[str] = None
    label: str = ""  # the report's rows: what runs, in a few words ("" : none, shown "-")

    def setting(self, name: str, default: Any = None) -> Any:
        """The value this variant gives the ds_z3native setting ``name``, or ``default``."""
        return dict(self.settings).get(name, default)


# Every LoRA variant, in the order a full run runs them (docs/benchmarks.md's table is written
# from ``about``).
VARIANT_TABLE: Tuple[Variant, ...] = (
    Variant("plain",
            about="plain PyTorch, no ZeRO",
            checkpointing="none",
            framework="torch",
            label="plain PyTorch, no ZeRO"),
    Variant("compiled",
            about="plain PyTorch with `torch.compile(model)`, no ZeRO, no checkpointing",
            checkpointing="none",
            framework="torch",
            compile="model",
            label="plain PyTorch + torch.compile"),
    Variant("fsdp2-ckpt-compile",
            about="PyTorch FSDP2 (`fully_shard` per decoder layer and the root), non-reentrant "
                  "checkpointing, each decoder layer `.compile()`d (accelerate's regional "
                  "compilation)",
            checkpointing="non-reentrant",
            framework="fsdp2",
            compile="layers",
            label="FSDP2 + per-layer torch.compile"),
    Variant("none",
            about="eager ZeRO-3, no checkpointing",
            checkpointing="none",
            label="eager ZeRO-3"),
    Variant("upstream",
            about="eager ZeRO-3, non-reentrant checkpointing, DeepSpeed alone",
            checkpointing="non-reentrant",
            label="eager ZeRO-3, DeepSpeed's own"),
    Variant("ours",
            about="eager ZeRO-3 + non-reentrant checkpointing with ds_z3native's recompute fix",
            checkpointing="non-reentrant",
            label="eager ZeRO-3 + ds_z3native holds"),
    Variant("reentrant",
            about="eager ZeRO-3, reentrant checkpointing",
            checkpointing="reentrant",
            label="eager ZeRO-3"),
    Variant("dc",
            about="DeepCompile + ds_z3native, no checkpointing",
            checkpointing="none",
            deepcompile=True,
            op="ours",
            label="DeepCompile + ds_z3native"),
    Variant("dc-warm",
            about="`dc` again from `dc`'s inductor cache and profile store",
            checkpointing="none",
            deepcompile=True,
            op="ours",
            label="DeepCompile + ds_z3native, inductor cache and profile store warm from `dc`"),
    Variant("dc-ckpt",
            about="DeepCompile + ds_z3native, non-reentrant checkpointing",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            label="DeepCompile + ds_z3native"),
    Variant("dc-ckpt-lowmem",
            about="`dc-ckpt` with a persistence budget of 0",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('persistence_budget_mib', 0),),
            label="DeepCompile + ds_z3native, persistence budget 0"),
    Variant("dc-ckpt-lean",
            about="`dc-ckpt` with persistence and prefetch budgets of 0",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('persistence_budget_mib', 0), ('prefetch_budget_mib', 0)),
            label="DeepCompile + ds_z3native, persistence and prefetch budgets 0"),
    Variant("dc-upstream",
            about="DeepCompile with DeepSpeed's own JIT-built op, no checkpointing",
            checkpointing="none",
            deepcompile=True,
            op="deepspeed",
            label="DeepCompile, DeepSpeed's JIT op"),
    Variant("trainer-dc-ckpt",
            about="`dc-ckpt` through HF Trainer (`TrainingArguments`)",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            trainer_of="dc-ckpt",
            label="HF Trainer + DeepCompile + ds_z3native (`dc-ckpt` through `TrainingArguments`)"),
    Variant("dc-ckpt-upstream",
            about="`dc-ckpt`'s setup with DeepSpeed's own op, no ds_z3native (DeepSpeed 0.19.8 "
                  "alone fails on it)",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="deepspeed",
            opt_in=True,
            label="DeepCompile, DeepSpeed's JIT op"),
    Variant("dc-ckpt-ungrouped",
            about="`dc-ckpt` with `group_persistent=False`: the params kept gathered reached by "
                  "DeepSpeed's three op calls per use",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('group_persistent', False),),
            opt_in=True),
    Variant("dc-ckpt-single",
            about="`dc-ckpt` with `single_cycle=True`: one profiling cycle, no re-plan at step 6",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('single_cycle', True),),
            opt_in=True,
            label="DeepCompile + ds_z3native, `set_single_cycle(True)`"),
    Variant("dc-ckpt-single-reduce-each",
            about="`dc-ckpt-single` with `group_reduce=False`: a `reduce_grad` call per gradient, "
                  "as DeepSpeed's graphs make (against `dc-ckpt-single`: the grouped reduce alone)",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('single_cycle', True), ('group_reduce', False)),
            opt_in=True,
            label="DeepCompile + ds_z3native, single cycle, a reduce_grad call per gradient "
                  "(`set_group_reduce(False)`)"),
    Variant("dc-ckpt-varlen",
            about="`dc-ckpt` on a length drawn per step (`--lengths`), against `dc-ckpt` at their "
                  "mean in the same invocation",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            opt_in=True,
            varlen_of="dc-ckpt",
            label="`dc-ckpt` on lengths drawn per step"),
    Variant("dc-ckpt-single-varlen",
            about="`dc-ckpt-single` on a length drawn per step (`--lengths`), against "
                  "`dc-ckpt-single` at their mean in the same invocation",
            checkpointing="non-reentrant",
            deepcompile=True,
            op="ours",
            settings=(('single_cycle', True),),
            opt_in=True,
            varlen_of="dc-ckpt-single",
            label="`dc-ckpt-single` on lengths drawn per step"),
)
VARIANT_BY_NAME: Dict[str, Variant] = {v.name: v for v in VARIANT_TABLE}

# The table's columns, as the rest of the benchmark reads them.
VARIANTS = tuple(v.name for v in VARIANT_TABLE)
# Variants on batches of varying length (``--lengths``), each with the variant it repeats at a
# fixed length: merge gives it the ratio of its time per token to that one's.
VARLEN = {v.name: v.varlen_of for v in VARIANT_TABLE if v.varlen_of}
CHECKPOINTING = {v.name: v.checkpointing for v in VARIANT_TABLE}
DEEPCOMPILE = tuple(v.name for v in VARIANT_TABLE if v.deepcompile)
# DeepCompile with DeepSpeed's own op (no ds_z3native).
UPSTREAM_DC = tuple(v.name for v in VARIANT_TABLE if v.op == "deepspeed")
# Variants a full lora_llama run leaves out: they run when named (``--variants``) or by another
# benchmark (``compile_scaling``).
OPT_IN = tuple(v.name for v in VARIANT_TABLE if v.opt_in)
OURS_DC = tuple(v.name for v in VARIANT_TABLE if v.op == "ours")
# Variants HF Trainer drives (it enables checkpointing itself, from its arguments), each with the
# variant of our own loop it repeats: merge gives it the ratio of its step time to that one's.
TRAINER = {v.name: v.trainer_of for v in VARIANT_TABLE if v.trainer_of}
# Variants with ds_z3native's single_cycle setting on.
SINGLE_CYCLE = tuple(v.name for v in VARIANT_TABLE if v.setting("single_cycle", False))


def variant_table_markdown() -> str:
    """docs/benchmarks.md's table of the LoRA variants, from :data:`VARIANT_TABLE`."""
    rows = ["| variant | what runs | run by a full run |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.about} | {'when named' if v.opt_in else 'yes'} |"
             for v in VARIANT_TABLE]
    return "\n".join(rows)
