"""The ``deepcompile_first_step`` benchmark: time from ``engine.compile()`` to the end of the
first DeepCompile step, ds_z3native's prebuilt op against DeepSpeed's JIT build (fresh extension
cache). Each run is one process of ``bench/deepcompile_run.py``."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

from packaging.version import Version

from bench.core.registry import BenchContext, Benchmark, deepspeed_envs, register
from bench.core.runner import Command, run_command, run_commands
from bench.core.schema import read_json, summarize, versions

__all__ = ["BENCHMARK"]

_FIRST_STEP_VARIANTS = {"ours": ["--native", "ours"],
                        "deepspeed-jit": ["--native", "deepspeed", "--fresh-extension-cache"]}


def _first_step_commands(ctx: BenchContext) -> List[Command]:
    """The GPU plan: each variant, ``repeats`` fresh processes per DeepSpeed."""
    repeats = ctx.repeats or 3
    steps = ctx.steps or 10
    cmds = []
    for ds, env in deepspeed_envs(ctx):
        for variant, extra in _FIRST_STEP_VARIANTS.items():
            for r in range(repeats):
                out = ctx.work_dir / "first_step" / f"{variant}@{ds}.{r}.json"
                cache = ctx.work_dir / "first_step" / f"inductor-{variant}-{ds}-{r}"
                cmds.append(Command(
                    [sys.executable, "bench/deepcompile_run.py", "--mode", "deepcompile",
                     "--steps", str(steps), *extra, "--json", str(out)],
                    label=f"deepcompile_first_step {variant}@{ds} run {r + 1}/{repeats}",
                    env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, output=out))
    return cmds


def _first_step_collect(cmds: Sequence[Command]) -> Dict[str, Any]:
    """The runs of the processes of ``cmds``, one record per variant and DeepSpeed."""
    grouped: Dict[str, List[Optional[Dict[str, Any]]]] = {}
    for cmd in cmds:
        key = cmd.label.split()[1]
        grouped.setdefault(key, []).append(read_json(cmd.output))
    runs: Dict[str, Any] = {}
    for key, outs in grouped.items():
        variant, ds = key.split("@", 1)
        good = [o for o in outs if o and not o.get("error") and "compile_to_first_step_end_s" in o]
        record: Dict[str, Any] = {"variant": variant, "deepspeed": ds, "peak_gib": None,
                                  "peak_kind": "not measured"}
        if good:
            record["first_step_s"] = summarize([o["compile_to_first_step_end_s"] for o in good])
            record["step_ms"] = summarize([o["step_ms_after_warmup"] for o in good])
            record["runs_failed"] = len(outs) - len(good)
        else:
            failed = next((o for o in outs if o and o.get("error")), None)
            record["status"] = "failed"
            record["error"] = failed["error"] if failed else "no result written (see the log)"
        runs[key] = record
    return {"runs": runs}


def _first_step_run(ctx: BenchContext) -> Dict[str, Any]:
    """The full run: every process of the plan, then their records."""
    cmds = _first_step_commands(ctx)
    run_commands(cmds, ctx.work_dir / "logs", ctx.timeout)
    result = _first_step_collect(cmds)
    result["setup"] = {
        "runner": "bench/deepcompile_run.py --mode deepcompile", "model": "frozen-linear: a frozen "
        "Linear(64, 64) feeding a trainable Linear(64, 16), batch 8, fp32, AdamW lr 1e-3",
        "steps": ctx.steps or 10, "repeats": ctx.repeats or 3, "processes": "one per run, one GPU",
        "first_step_s": "engine.compile() to the end of step 1; fresh inductor cache every run, "
                        "fresh extension cache for deepspeed-jit",
        "step_ms": "mean of steps 7 and later, per run"}
    result["versions"] = versions(_cuda_device_name())
    return result


def _first_step_smoke(ctx: BenchContext) -> Dict[str, Any]:
    """On the CPU: with DeepSpeed >= 0.19.4 our op runs DeepCompile there (gloo; DeepSpeed's own
    op builds only with CUDA, so its variant is not available); older DeepSpeed profiles with
    CUDA events only, and the runner then trains its model eagerly (ZeRO-0) to show it works."""
    ds = versions().get("deepspeed")
    out = ctx.work_dir / "first_step_smoke.json"
    deepcompile = bool(ds) and Version(ds).release >= (0, 19, 4)
    args = ["--mode", "deepcompile", "--native", "ours"] if deepcompile else ["--mode", "eager"]
    cmd = Command([sys.executable, "bench/deepcompile_run.py", *args, "--steps", "2",
                   "--json", str(out)],
                  label="deepcompile_first_step smoke (CPU)",
                  env={"DS_ACCELERATOR": "cpu", "TORCHINDUCTOR_CACHE_DIR":
                       str(ctx.work_dir / "first_step_inductor")}, output=out)
    code = run_command(cmd, ctx.work_dir / "logs", ctx.timeout)
    res = read_json(out) or {}
    ok = code == 0 and not res.get("error") and len(res.get("losses", [])) == 2
    runs: Dict[str, Any] = {}
    for v in _FIRST_STEP_VARIANTS:
        if v == "ours" and deepcompile:
            continue
        reason = ("DeepSpeed's own dc op builds only with CUDA" if v != "ours" else
                  "DeepCompile on the CPU needs DeepSpeed >= 0.19.4")
        runs[f"{v}@{ds}"] = {"variant": v, "status": "not_available", "reason": reason}
    key = f"ours@{ds}" if deepcompile else f"eager-runner@{ds}"
    runs[key] = {"variant": key.split("@")[0], "status": "ok" if ok else "failed",
                 "losses": res.get("losses"),
                 "error": None if ok else (res.get("error") or f"exit code {code}")}
    if ok and deepcompile:
        runs[key]["first_step_s"] = summarize([res["compile_to_first_step_end_s"]])
    return {"runs": runs, "setup": {"runner": "bench/deepcompile_run.py " + " ".join(args) +
                                              " --steps 2", "device": "cpu"}}


def _cuda_device_name() -> Optional[str]:
    """The CUDA device's name, "cpu" without CUDA, None where torch cannot say (a label only)."""
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a label only
        return None


BENCHMARK = register(Benchmark(
    name="deepcompile_first_step",
    description="time from engine.compile() to the end of the first DeepCompile step: "
                "ds_z3native's prebuilt op vs DeepSpeed's JIT build (fresh extension cache)",
    baseline=("deepspeed-jit",), commands=_first_step_commands, run=_first_step_run,
    smoke=_first_step_smoke, ratio_per_deepspeed=True))

