"""The ``native_micro`` benchmark: native reduce/gather, ds_z3native's dc op against DeepSpeed's
own, in ranks of their own (the measuring code is ``bench/native_micro.py``)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List

from bench.core.registry import BenchContext, Benchmark, register
from bench.core.runner import Command
from bench.native_micro import MicroConfig, measure

__all__ = ["BENCHMARK"]


def run(ctx: BenchContext) -> Dict[str, Any]:
    """The full benchmark (CUDA: NCCL; CPU: gloo at full size)."""
    return measure(MicroConfig.for_mode(False, ctx.ranks, ctx.steps), ctx.timeout)


def smoke(ctx: BenchContext) -> Dict[str, Any]:
    """Toy size on CPU over gloo (2 ranks unless ``ctx.ranks``)."""
    return measure(MicroConfig.for_mode(True, ctx.ranks, ctx.steps), min(ctx.timeout, 600.0))


def commands(ctx: BenchContext) -> List[Command]:
    """The GPU plan: one process that runs both implementations (each in ranks of its own)."""
    out = ctx.output_dir / "native_micro.json"
    argv = [sys.executable, "-m", "bench", "native_micro", "--output-dir", str(ctx.output_dir)]
    if ctx.ranks:
        argv += ["--ranks", str(ctx.ranks)]
    if ctx.steps:
        argv += ["--steps", str(ctx.steps)]
    return [Command(argv, label="native_micro", output=out)]


BENCHMARK = register(Benchmark(
    name="native_micro",
    description="native reduce/gather: 500 params, 90% frozen, one graph; ours vs DeepSpeed's "
                "dc op: ms/step, collectives, persistent-frozen all-gather bytes",
    baseline=("deepspeed", "ours"), commands=commands, run=run, smoke=smoke))
