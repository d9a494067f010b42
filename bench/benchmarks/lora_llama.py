"""The ``lora_llama`` benchmark: a 1 B Llama with PEFT LoRA, one process of
``bench/lora_llama.py`` per variant and DeepSpeed, merged into one result by the script's
``merge`` (``lora_llama_ws<N>`` at N ranks). ``--variants`` re-runs some variants into the
existing result; ``--trace`` profiles two more steps of each. ``--variants`` naming a varlen
variant (``dc-ckpt-single-varlen``, with its base ``dc-ckpt-single``) makes a varlen invocation:
the varlen runs draw their lengths (``VARLEN_DC_STEPS`` steps), the others run at the lengths'
mean (DeepCompile ones ``FIXED_DC_STEPS`` steps), into ``lora_llama_varlen``."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any, Dict, List, Sequence, Tuple

from packaging.version import Version

from ds_z3native._net import free_port
from ds_z3native.settings import PROFILE_STORE_ENV
from bench.core.registry import BenchContext, Benchmark, deepspeed_envs, register
from bench.core.runner import Command, run_command, run_commands
from bench.core.schema import read_json, versions
from bench.core.variants import DEEPCOMPILE, OPT_IN, TRAINER, VARIANTS, VARLEN
from bench.lora_llama import (DEFAULT_LENGTHS, FIXED_DC_STEPS, VARLEN_DC_STEPS, bench_name,
                              fixed_length, is_varlen_invocation, parse_lengths)

__all__ = ["SCRIPT", "BENCHMARK", "check_lora_variants"]

SCRIPT = "bench/lora_llama.py"


def _lora_script() -> Tuple[str, Sequence[str]]:
    """The LoRA runner's path (relative to the checkout) and its variants."""
    return SCRIPT, VARIANTS


def check_lora_variants(variants: Sequence[str]) -> None:
    """Raise ValueError for a LoRA variant set that cannot run as asked (``dc-warm`` needs the
    ``dc`` run of the same invocation to fill its inductor cache; ``trainer-dc-ckpt`` is compared
    with the same invocation's ``dc-ckpt``)."""
    if "dc-warm" in variants and "dc" not in variants:
        raise ValueError("lora_llama variant dc-warm re-runs dc's graphs from the inductor cache "
                         "dc fills in the same invocation: pick dc as well")
    for trainer, own in TRAINER.items():
        if trainer in variants and own not in variants:
            raise ValueError(f"lora_llama variant {trainer} is measured against our loop's {own} "
                             f"of the same invocation: pick {own} as well")
    for varlen, fixed in VARLEN.items():
        if varlen in variants and fixed not in variants:
            raise ValueError(f"lora_llama variant {varlen} is measured against {fixed} at its "
                             f"lengths' mean in the same invocation: pick {fixed} as well")


def _length_args(variant: str, varlen: bool) -> List[str]:
    """A variant's length and step arguments in a varlen invocation (none otherwise): the
    varlen runs draw ``DEFAULT_LENGTHS``, the others run at its mean."""
    if not varlen:
        return []
    if variant in VARLEN:
        return ["--lengths", DEFAULT_LENGTHS, "--dc-steps", str(VARLEN_DC_STEPS)]
    return (["--seq", str(fixed_length(parse_lengths(DEFAULT_LENGTHS)))]
            + (["--dc-steps", str(FIXED_DC_STEPS)] if variant in DEEPCOMPILE else []))


def _lora_inductor_cache(ctx: BenchContext, deepspeed: str, variant: str = "") -> Dict[str, str]:
    """The environment giving this invocation's LoRA run of ``variant`` on ``deepspeed`` its own
    inductor cache, fresh per invocation and per variant, so every variant compiles cold but
    dc-warm, which shares dc's and finds what dc put there (a DeepCompile variant with DeepSpeed's
    op builds graphs with the same ``torch.ops.dc`` calls, which could hit dc's entries). dc and
    dc-warm also share a DeepCompile profile store (dc records, dc-warm replays: the same
    schedule, so the cached graphs match)."""
    shared = variant in ("dc", "dc-warm")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(ctx.work_dir / "inductor" / deepspeed
                                          / ("dc" if shared else variant or "default"))}
    if shared:
        env[PROFILE_STORE_ENV] = str(ctx.work_dir / "profiles" / deepspeed)
    return env


def _lora_commands(ctx: BenchContext) -> List[Command]:
    """The GPU plan: one process per variant and DeepSpeed (under torch.distributed.run at more
    than one rank; only ``ours`` on a ``--deepspeed-path`` DeepSpeed)."""
    script, variants = _lora_script()
    cmds = []
    steps = ["--steps", str(ctx.steps)] if ctx.steps else []
    ranks = ctx.ranks or 1
    launcher = [sys.executable]
    if ranks > 1:  # one process per GPU; plain PyTorch (no ZeRO) is a one-GPU ceiling only
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
        variants = tuple(v for v in variants if v != "plain")
    if ctx.variants:
        variants = tuple(v for v in variants if v in ctx.variants)
    else:  # a full run: the opt-in variants run only when named
        variants = tuple(v for v in variants if v not in OPT_IN)
    check_lora_variants(variants)
    varlen = is_varlen_invocation(variants)
    for ds, env in deepspeed_envs(ctx):
        # Another DeepSpeed is there for ds_z3native's fix on it: only "ours" runs on it.
        for variant in (variants if not env else tuple(v for v in ("ours",) if v in variants)):
            out = ctx.work_dir / "lora" / f"{variant}-{ds}.json"
            port = ([f"--master_port={free_port()}"] if ranks > 1 else [])
            trace = ["--trace", str(ctx.trace / ds)] if ctx.trace is not None else []
            cmds.append(Command([*launcher, *port, script, "--variant", variant, *steps, *trace,
                                 *_length_args(variant, varlen), "--run", ctx.run_id,
                                 "--output", str(out)],
                                label=f"lora_llama {variant}@{ds}",
                                env={**env, **_lora_inductor_cache(ctx, ds, variant)}, output=out))
    return cmds


def _lora_merge(cmds: Sequence[Command], ctx: BenchContext, script: str) -> Dict[str, Any]:
    """The runs of ``cmds`` merged by ``script merge`` (into the existing result with
    ``--variants``; a full run moves the existing runs to its history); a process that wrote
    nothing is a failed run."""
    inputs = [str(c.output) for c in cmds if c.output is not None and c.output.exists()]
    merged = ctx.work_dir / "lora" / "merged.json"
    if merged.exists():
        merged.unlink()
    name = bench_name(ctx.ranks or 1, is_varlen_invocation(ctx.variants or ()))
    existing = ctx.output_dir / f"{name}.json"
    if existing.exists() and (ctx.variants or not ctx.smoke):
        previous = json.loads(existing.read_text())
        if ctx.variants:
            # Some variants re-run: the file's other runs stay, its footnote says what changed.
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
            previous["note"] = (str(previous.get("note", "")).rstrip() + f" Re-run {stamp}: "
                                + ", ".join(ctx.variants) + ".").strip()
            seed = previous
        else:
            # A full run: a fresh table, no footnote yet; the file's runs, with what they had
            # replaced and their footnote, move to its history (no measured number is lost).
            seed = {"bench": previous.get("bench"), "runs": {},
                    "replaced": [*previous.get("replaced", []), *previous.get("runs", {}).values()],
                    "replaced_notes": [*previous.get("replaced_notes", []),
                                       *([previous["note"]] if previous.get("note") else [])]}
        merged.parent.mkdir(parents=True, exist_ok=True)
        merged.write_text(json.dumps(seed))
    if inputs:
        code = run_command(Command([sys.executable, script, "merge", *inputs, "--output",
                                    str(merged)], label="lora_llama merge"),
                           ctx.work_dir / "logs", ctx.timeout)
        if code != 0:  # e.g. runs of another setup than the file's: nothing is merged
            raise RuntimeError(f"lora_llama merge failed (exit {code}); see "
                               f"{ctx.work_dir / 'logs' / 'lora_llama_merge.log'}")
    result = read_json(merged) or {"runs": {}}
    for cmd in cmds:  # a run that wrote nothing is a failed run too
        if cmd.output is None or not cmd.output.exists():
            key = cmd.label.split()[1]
            result["runs"].setdefault(key, {"variant": key.split("@")[0], "status": "failed",
                                            "error": "no result written (see the log)"})
    first = next((r for r in result["runs"].values() if r.get("setup")), None)
    if first is not None:
        result.setdefault("setup", first["setup"])
        result.setdefault("versions", first.get("versions"))
    return result


def _lora_run(ctx: BenchContext) -> Dict[str, Any]:
    """The full run: every process of the plan, then the merge."""
    script, _ = _lora_script()
    cmds = _lora_commands(ctx)
    run_commands(cmds, ctx.work_dir / "logs", ctx.timeout)
    return _lora_merge(cmds, ctx, script)


def _lora_smoke(ctx: BenchContext) -> Dict[str, Any]:
    """Toy size on the CPU: ``ours`` and ``none`` (and the DeepCompile variants where DeepSpeed
    runs them on the CPU), then the merge. A Trainer variant compiles into the inductor cache of
    the own-loop variant it repeats, which ran before it: inductor's C++ kernels, most of a toy's
    cold compile on the CPU, are built once (smoke timings mean nothing; Dynamo and AOTAutograd
    still trace every graph of both)."""
    script, variants = _lora_script()
    picked = ["ours", "none"]
    ds = versions().get("deepspeed")
    # DeepCompile runs on the CPU from DeepSpeed 0.19.4 (its profiler falls back without CUDA).
    if ds and Version(ds).release >= (0, 19, 4):
        picked += ["dc-ckpt", "trainer-dc-ckpt"]
    cmds = []
    for v in picked:
        if v not in variants:
            continue
        out = ctx.work_dir / "lora" / f"{v}.json"
        steps = (["--dc-steps", "7"] if v in DEEPCOMPILE else ["--steps", "2", "--warmup", "1"])
        cmds.append(Command([sys.executable, script, "--variant", v, "--size", "toy", *steps,
                             "--seq", "32", "--micro-batch", "1", "--no-track-gathered",
                             "--run", ctx.run_id, "--output", str(out)],
                            label=f"lora_llama {v}@{ds}",
                            env={"DS_ACCELERATOR": "cpu",
                                 **_lora_inductor_cache(ctx, str(ds), TRAINER.get(v, v))},
                            output=out))
    run_commands(cmds, ctx.work_dir / "logs", ctx.timeout)
    return _lora_merge(cmds, ctx, script)


BENCHMARK = register(Benchmark(
    name="lora_llama",
    description="1 B Llama + PEFT LoRA: ms/step, tokens/s, peak GiB, TFLOP/s per variant "
                "(checkpointing modes, ours vs upstream DeepSpeed, DeepCompile)",
    baseline=("upstream", "none", "plain"), commands=_lora_commands, run=_lora_run,
    smoke=_lora_smoke, multi_gpu=True))

