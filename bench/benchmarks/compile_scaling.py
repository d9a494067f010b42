"""The ``compile_scaling`` benchmark: DeepCompile's time to a steady state against model depth.

For 2, 4, 8 and 16 decoder layers of the 1 B LoRA shape (``bench/lora_llama.py --size 1b
--layers N``; ``--layers 2,4,8,16,32`` adds 32), the ``dc-ckpt`` setup (DeepCompile,
non-reentrant checkpointing, LoRA r=16 on every linear layer) runs, one process of
``bench/lora_llama.py`` per run:

* ``ours-cold``: ``dc-ckpt`` with ds_z3native, a fresh inductor cache and profile store;
* ``ours-warm``: the same again, from the inductor cache and profile store ``ours-cold`` of the
  same depth filled (what compiling costs a second run of the same job);
* ``ours-single`` (only when ``--variants`` names it): ``dc-ckpt`` cold, its own fresh caches,
  with ``DS_Z3NATIVE_SINGLE_CYCLE=1``: each graph compiled once, at the first step, with the
  re-plan's passes, and no re-plan (``ds_z3native.set_single_cycle``);
* ``ours-single-warm`` (only when ``--variants`` names it): the same again, from the inductor
  cache and profile store ``ours-single`` of the same depth filled;
* ``deepspeed-cold``: ``dc-upstream``, DeepSpeed's own DeepCompile (its op, no ds_z3native) on
  the same model, LoRA and batch without checkpointing, a fresh inductor cache. With
  checkpointing DeepSpeed alone does not run this model (``dc-ckpt-upstream`` fails at its first
  forward on DeepSpeed 0.19.8: ``'weight' must be 2-D``), so its nearest setup that runs is the
  baseline; a graph without recomputation is smaller, so the ratios lean in DeepSpeed's favour.
  Its op is loaded (JIT-built the first time) before the clock starts, so no run's compile time
  holds the build (``deepcompile_first_step`` measures it). Where DeepSpeed has no op for the accelerator (its CPU accelerator), the first such run
  says so and the others are recorded as not available with the same reason, without running.
  DeepSpeed's own warm run is not in the plan: it would cost about another cold run per depth.

Each run records the seconds from ``engine.compile()`` to the end of step 1, the re-plan step
(DeepCompile's 6th: profiling and a full recompile), the seconds from ``engine.compile()`` to the
end of the last step (step 20), torch's compile-time counters per phase
(``torch._dynamo.utils.compile_times``: Dynamo's tracing, the backend, AOTAutograd, inductor) and
its compile event counters (``torch._dynamo.utils.counters``). The result's ``summary`` compares,
at the deepest depth of the run, our cold and warm wall time to the last step with DeepSpeed's
cold one, and how our cold compile to step 1 grows from 8 to 16 layers.

``--smoke``: the same code at toy size on the CPU (``DS_ACCELERATOR=cpu``), 7 steps (DeepCompile
needs 7 to pass its re-plan, so the last step is step 7), one depth (2 layers) unless
``--layers`` says otherwise: every cold compile of the toy costs about 100 s of CPU time
(inductor compiles its C++ kernels).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ds_z3native.settings import PROFILE_STORE_ENV, SINGLE_CYCLE_ENV
from bench.core.registry import BenchContext, Benchmark, register
from bench.core.runner import Command, run_command
from bench.core.schema import metric_value, read_json, run_ok, same_run_ratio, versions

log = logging.getLogger("bench.benchmarks.compile_scaling")

__all__ = ["BENCHMARK", "KINDS", "ALL_KINDS", "LAYERS", "SMOKE_LAYERS", "STEPS", "SMOKE_STEPS", "ScalingRun", "plan",
           "commands", "summarize_scaling", "keep_history"]

SCRIPT = "bench/lora_llama.py"
LAYERS = (2, 4, 8, 16)
SMOKE_LAYERS = (2,)
STEPS = 20
SMOKE_STEPS = 7  # DeepCompile re-plans at its 6th step; one step after it is the least
MIN_STEPS = 7
# The runs of each depth, in order (a warm run re-uses the cold run's caches).
KINDS = ("ours-cold", "ours-warm", "deepspeed-cold")
# Every kind ``--variants`` may name, in the order they run: the plan's and a single-cycle cold
# run (ds_z3native.set_single_cycle).
ALL_KINDS = ("ours-cold", "ours-warm", "ours-single", "ours-single-warm", "deepspeed-cold")
# The run whose caches a warm run re-uses (its cache -> that run's cache).
WARM_FROM = {"warm": "cold", "single-warm": "single"}
# The LoRA runner's variant per implementation: ours is the dc-ckpt setup; DeepSpeed alone fails
# on it (see the module's docstring), so its baseline is the same without checkpointing.
LORA_VARIANT = {"ours": "dc-ckpt", "deepspeed": "dc-upstream"}
# What each run measures, in the result's setup.
METRICS = {
    "compile_to_first_step_s": "seconds from engine.compile() to the end of step 1",
    "replan_step_s": "seconds of step 6, where DeepCompile profiles and recompiles (its re-plan)",
    "wall_to_last_step_s": "seconds from engine.compile() to the end of the last step",
    "step_ms": "steady step time over the steps after the re-plan (7 to the last)",
    "compile_seconds": "torch._dynamo.utils.compile_times per timed function, summed, seconds: "
                       "to the end of step 1 (first_step), in the re-plan step (replan), from "
                       "engine.compile() to the last step (to_last_step); they nest "
                       "(_compile.compile_inner holds the rest), so they do not add up",
    "compile_counters": "torch._dynamo.utils.counters at the end of the run (frames, captured "
                        "calls, unique graphs, inductor's and AOTAutograd's cache outcomes)",
    "deepcompile_pass_seconds": "DeepCompile's own timing of each compiled graph's passes "
                                "(deepspeed.compile.backend.opt_pass_times: its passes, their "
                                "profiling runs and the scheduler), per graph in the order "
                                "compiled",
}


@dataclasses.dataclass(frozen=True)
class ScalingRun:
    """One process of the plan: an implementation (``ours`` or ``deepspeed``), cold or warm,
    at a depth."""

    implementation: str
    cache: str
    layers: int

    @property
    def variant(self) -> str:
        """The run's variant: one of :data:`ALL_KINDS`."""
        return f"{self.implementation}-{self.cache}"

    @property
    def key(self) -> str:
        """The run's key in the result: ``<variant>-<layers>l``."""
        return f"{self.variant}-{self.layers}l"

    @property
    def label(self) -> str:
        """The process's label (its log file's name)."""
        return f"compile_scaling {self.key}"


def _layers(ctx: BenchContext) -> Tuple[int, ...]:
    """The depths of this run, shallowest first (ValueError for a depth below 1)."""
    layers = tuple(sorted(set(ctx.layers))) if ctx.layers else (
        SMOKE_LAYERS if ctx.smoke else LAYERS)
    bad = [n for n in layers if n < 1]
    if bad:
        raise ValueError(f"compile_scaling: a depth must be at least 1 layer, got {bad[0]}")
    return layers


def _steps(ctx: BenchContext) -> int:
    """Steps per run (ValueError below DeepCompile's 7)."""
    steps = ctx.steps or (SMOKE_STEPS if ctx.smoke else STEPS)
    if steps < MIN_STEPS:
        raise ValueError(f"compile_scaling: --steps must be at least {MIN_STEPS} (DeepCompile "
                         f"re-plans at its 6th step), got {steps}")
    return steps


def plan(ctx: BenchContext) -> List[ScalingRun]:
    """The runs, per depth shallowest first: ours cold, ours warm (after the cold run whose cache
    it re-uses), DeepSpeed's op cold; with ``--variants``, only those of :data:`ALL_KINDS`."""
    kinds = [k for k in ALL_KINDS if k in ctx.variants] if ctx.variants else list(KINDS)
    return [ScalingRun(*kind.split("-", 1), n) for n in _layers(ctx) for kind in kinds]


def _inductor_dir(ctx: BenchContext, implementation: str, layers: int, cache: str = "cold"
                  ) -> Path:
    """The inductor cache of an implementation at a depth (a warm run shares its cold run's; a
    single-cycle run has its own, which its warm run shares)."""
    single = "-single" if cache.startswith("single") else ""
    return ctx.work_dir / "compile_scaling" / "inductor" / f"{implementation}{single}-{layers}l"


def _command(run: ScalingRun, ctx: BenchContext, steps: int) -> Command:
    """The ``bench/lora_llama.py`` process of ``run``: its own inductor cache per implementation
    and depth (a warm run shares its cold run's), and for ours a profile store per depth (the
    cold run records, the warm run replays; a single-cycle run has its own of both)."""
    work = ctx.work_dir / "compile_scaling"
    size = (["--size", "toy", "--seq", "32", "--micro-batch", "1"] if ctx.smoke
            else ["--size", "1b"])
    extra = ["--build-op-first"] if run.implementation == "deepspeed" else []
    out = work / "runs" / f"{run.key}.json"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(_inductor_dir(ctx, run.implementation, run.layers,
                                                        run.cache))}
    if run.implementation == "ours":
        single = run.cache.startswith("single")
        env[PROFILE_STORE_ENV] = str(work / "profiles" /
                                     f"{run.layers}l{'-single' if single else ''}")
        env[SINGLE_CYCLE_ENV] = "1" if single else "0"
    else:  # DeepSpeed alone, whatever the shell's DS_Z3NATIVE says
        env["DS_Z3NATIVE"] = "0"
    if ctx.smoke:
        env["DS_ACCELERATOR"] = "cpu"
    return Command([sys.executable, SCRIPT, "--variant", LORA_VARIANT[run.implementation], *size,
                    "--layers", str(run.layers), "--dc-steps", str(steps), *extra,
                    "--run", ctx.run_id, "--output", str(out)],
                   label=run.label, env=env, output=out)


def commands(ctx: BenchContext) -> List[Command]:
    """The plan's processes, in order (``--dry-run`` prints them)."""
    steps = _steps(ctx)
    return [_command(run, ctx, steps) for run in plan(ctx)]


def _entry(run: ScalingRun, record: Optional[Mapping[str, Any]], code: Optional[int],
           ctx: BenchContext) -> Dict[str, Any]:
    """A run's record in the result: the runner's record (without what names the runner's own
    variant) with the run's variant, implementation, cache and depth, and its status."""
    entry: Dict[str, Any] = {k: v for k, v in (record or {}).items()
                             if k not in ("bench", "variant", "status", "vs")}
    entry.update(variant=run.variant, implementation=run.implementation, cache=run.cache,
                 layers=run.layers, lora_variant=LORA_VARIANT[run.implementation])
    if record is None:
        entry.update(status="failed", error=f"no result written (exit {code}; its log is in "
                                            f"{ctx.work_dir / 'logs'})")
    elif record.get("status") == "not_available":
        entry["status"] = "not_available"
    elif record.get("error") or metric_value(record, "wall_to_last_step_s") is None:
        entry["status"] = "failed"
        entry.setdefault("error", f"no time to the last step (exit {code})")
    else:
        entry["status"] = "ok"
    return entry


def _execute(ctx: BenchContext) -> Dict[str, Any]:
    """Runs the plan's processes one after another, each one's output logged as it comes; a
    warm run whose cold run failed and DeepSpeed's runs once one found its op not available are
    recorded without running. Returns the result (runs, setup, versions, summary)."""
    steps = _steps(ctx)
    runs = plan(ctx)
    out: Dict[str, Dict[str, Any]] = {}
    unavailable: Optional[str] = None
    for i, run in enumerate(runs, 1):
        source = WARM_FROM.get(run.cache)
        cold = out.get(ScalingRun(run.implementation, source, run.layers).key) if source else None
        if run.implementation == "deepspeed" and unavailable:
            entry = _entry(run, {"status": "not_available", "reason": unavailable}, None, ctx)
            log.info("[%d/%d] %s: not run, not available: %s", i, len(runs), run.label,
                     unavailable)
        elif source and (not run_ok(cold) if cold is not None else
                         not _inductor_dir(ctx, run.implementation, run.layers,
                                           source).is_dir()):
            entry = _entry(run, {"status": "not_available", "reason": "not run: the cold run "
                                 "whose inductor cache and profile store it re-uses did not "
                                 "finish (or, run alone, left no cache in --work-dir)"}, None, ctx)
            log.info("[%d/%d] %s: not run (its cold run did not finish)", i, len(runs), run.label)
        else:
            log.info("[%d/%d] %s", i, len(runs), run.label)
            cmd = _command(run, ctx, steps)
            code = run_command(cmd, ctx.work_dir / "logs", ctx.timeout, echo=True)
            entry = _entry(run, read_json(cmd.output), code, ctx)
            if run.implementation == "deepspeed" and entry["status"] == "not_available":
                unavailable = str(entry.get("reason"))
        out[run.key] = entry
        log.info("%s: %s", run.key, _brief(entry))
    previous = None if ctx.smoke else read_json(ctx.output_dir / "compile_scaling.json")
    if ctx.variants and previous and previous.get("mode") != "smoke":
        return merge_runs(previous, out, ctx, steps)
    result = _result(out, ctx, steps)
    if previous:
        keep_history(result, previous)
    return result


def merge_runs(previous: Mapping[str, Any], new: Dict[str, Dict[str, Any]], ctx: BenchContext,
               steps: int) -> Dict[str, Any]:
    """Some runs (``--variants``) merged into the existing result: its runs of other keys stay,
    those re-run move to ``replaced``; the summary covers every depth the result then holds (its
    ratios compare runs of one run label only). ValueError when the existing result was measured
    with another size or number of steps."""
    old_setup = previous.get("setup") or {}
    size = "toy" if ctx.smoke else "1b"
    if old_setup.get("size") not in (None, size) or old_setup.get("steps") not in (None, steps):
        raise ValueError(f"compile_scaling: the existing result ran size {old_setup.get('size')} "
                         f"for {old_setup.get('steps')} steps, this run size {size} for {steps}; "
                         "run every depth again without --variants (it keeps the old runs in "
                         "its history)")
    runs = {k: dict(r) for k, r in (previous.get("runs") or {}).items() if k not in new}
    runs.update(new)
    depths = sorted({int(r["layers"]) for r in runs.values() if r.get("layers") is not None})
    merged_ctx = dataclasses.replace(ctx, layers=depths or list(_layers(ctx)))
    result = _result(runs, merged_ctx, steps)
    result["replaced"] = [*previous.get("replaced", []),
                          *[{**r, "key": k} for k, r in (previous.get("runs") or {}).items()
                            if k in new]]
    if previous.get("replaced_notes"):
        result["replaced_notes"] = list(previous["replaced_notes"])
    if previous.get("note"):
        result["note"] = previous["note"]
    return result


def keep_history(result: Dict[str, Any], previous: Optional[Mapping[str, Any]]) -> None:
    """A run written over an earlier result keeps that result's runs (with what they had
    replaced) in its ``replaced`` list and its footnote in ``replaced_notes``: no measured number
    is lost. A smoke result is no history."""
    if not previous or previous.get("mode") == "smoke":
        return
    earlier = [{**r, "key": k} for k, r in (previous.get("runs") or {}).items()]
    result["replaced"] = [*previous.get("replaced", []), *earlier]
    result["replaced_notes"] = [*previous.get("replaced_notes", []),
                                *([previous["note"]] if previous.get("note") else [])]


def _brief(entry: Mapping[str, Any]) -> str:
    """A run in one line for the log."""
    if not run_ok(entry):
        why = str(entry.get("reason") or entry.get("error") or "").strip().splitlines() or [""]
        return f"{entry.get('status')}: {why[-1]}"
    return ", ".join(f"{k} {metric_value(entry, k):.1f} s" for k in
                     ("compile_to_first_step_s", "replan_step_s", "wall_to_last_step_s")
                     if metric_value(entry, k) is not None)


def summarize_scaling(runs: Mapping[str, Mapping[str, Any]],
                      layers: Sequence[int]) -> Dict[str, Any]:
    """The result's ``summary``, at the deepest of ``layers``: ``cold_vs_deepspeed``,
    ``warm_vs_deepspeed``, ``single_vs_deepspeed`` and ``single_warm_vs_deepspeed`` (our cold /
    warm / single-cycle cold / single-cycle warm wall time to the last step over DeepSpeed's
    cold),
    ``growth_8_to_16`` (our cold compile to the end of step 1 at 16 layers over 8),
    ``single_growth_8_to_16`` (the same for the single-cycle cold run), and ``compile_growth``, the same between the two deepest depths where our cold run has both;
    None for each figure whose runs are missing or did not finish."""
    deepest = max(layers) if layers else None

    def run(variant: str, n: Optional[int]) -> Optional[Mapping[str, Any]]:
        return runs.get(f"{variant}-{n}l") if n is not None else None

    measured = [n for n in sorted(layers) if run_ok(run("ours-cold", n) or {})]
    growth = None
    if len(measured) >= 2:
        a, b = measured[-2], measured[-1]
        ratio = same_run_ratio(run("ours-cold", b), run("ours-cold", a), "compile_to_first_step_s")
        if ratio is not None:
            growth = {"from_layers": a, "to_layers": b, "ratio": ratio}
    return {
        "layers": deepest,
        "metric": "wall_to_last_step_s",
        "cold_vs_deepspeed": same_run_ratio(run("ours-cold", deepest),
                                            run("deepspeed-cold", deepest), "wall_to_last_step_s"),
        "warm_vs_deepspeed": same_run_ratio(run("ours-warm", deepest),
                                            run("deepspeed-cold", deepest), "wall_to_last_step_s"),
        "single_vs_deepspeed": same_run_ratio(run("ours-single", deepest),
                                              run("deepspeed-cold", deepest),
                                              "wall_to_last_step_s"),
        "growth_8_to_16": same_run_ratio(run("ours-cold", 16), run("ours-cold", 8),
                                         "compile_to_first_step_s"),
        "single_warm_vs_deepspeed": same_run_ratio(run("ours-single-warm", deepest),
                                                   run("deepspeed-cold", deepest),
                                                   "wall_to_last_step_s"),
        "single_growth_8_to_16": same_run_ratio(run("ours-single", 16), run("ours-single", 8),
                                                "compile_to_first_step_s"),
        "compile_growth": growth,
    }


def _result(runs: Dict[str, Dict[str, Any]], ctx: BenchContext, steps: int) -> Dict[str, Any]:
    """The result of a run of the plan: its runs, setup, versions and summary."""
    layers = _layers(ctx)
    first = next((r for r in runs.values() if r.get("setup")), {})
    setup = first.get("setup") or {}
    model = {k: v for k, v in (setup.get("model") or {}).items()
             if k not in ("num_hidden_layers", "params", "trainable")}
    last_step = (f"the last step is step {steps}" if steps == STEPS else
                 f"the last step is step {steps}, not {STEPS}: at {'smoke' if ctx.smoke else 'this'} "
                 f"size the runs take {steps} steps (DeepCompile needs {MIN_STEPS} to pass its "
                 f"step-6 re-plan), so wall_to_last_step_s is to step {steps}")
    device = setup.get("device") or ("cpu" if ctx.smoke else None)
    return {
        "runs": runs,
        "summary": summarize_scaling(runs, layers),
        "versions": {**versions(device), **{k: v for k, v in (first.get("versions") or {}).items()
                                            if v is not None}},
        "setup": {
            "runner": (f"{SCRIPT} --variant {LORA_VARIANT['ours']} | {LORA_VARIANT['deepspeed']} "
                       f"--layers N --dc-steps {steps}"),
            "size": "toy" if ctx.smoke else "1b", "layers": list(layers), "steps": steps,
            "last_step": steps, "last_step_note": last_step,
            "model": model, "dtype": setup.get("dtype"), "micro_batch": setup.get("micro_batch"),
            "seq": setup.get("seq"), "world_size": setup.get("world_size"), "device": device,
            "checkpointing": {"ours": "non-reentrant", "deepspeed": "none"}, "deepcompile": True,
            "implementations": {
                "ours": "dc-ckpt: ds_z3native.install(), its prebuilt op",
                "deepspeed": "dc-upstream: DeepSpeed's own DeepCompile without checkpointing (with "
                             "it, DeepSpeed alone fails on this model), its op (JIT build, loaded "
                             "before the clock starts), no ds_z3native"},
            "cold": "a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR) per implementation and "
                    "depth, and for ours a fresh DeepCompile profile store",
            "warm": "ours only: a second process re-using the inductor cache and profile store "
                    "of the cold run of the same depth",
            "single": "ours only, where --variants names ours-single: cold (its own fresh "
                      "caches), DS_Z3NATIVE_SINGLE_CYCLE=1: each graph compiled once, no re-plan",
            "single_warm": "ours only, where --variants names ours-single-warm: a second "
                           "process re-using the inductor cache and profile store of the "
                           "single-cycle run of the same depth",
            "deepspeed_warm": "not run: it would cost about another cold run per depth",
            "processes": "one per run, one after another, one GPU" if not ctx.smoke
                         else "one per run, one after another, on the CPU (gloo)",
            "metrics": METRICS,
        },
    }


BENCHMARK = register(Benchmark(
    name="compile_scaling",
    description="DeepCompile's time to a steady state against depth (2-16 layers of the 1 B "
                "LoRA shape, checkpointing): ours cold and warm vs DeepSpeed's op cold",
    baseline=(), commands=commands, run=_execute, smoke=_execute))
