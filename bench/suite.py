"""The benchmark suite: a registry of named benchmarks, the shared JSON result format, the CLI.

``python -m bench <name|all|list> [--smoke] [--output-dir DIR] [--dry-run]``. Every benchmark has

* a GPU command builder (``Benchmark.commands``): the processes that produce its numbers on the
  GPU host (``--dry-run`` prints them); ``Benchmark.run`` runs them and collects one result;
* a ``--smoke`` mode (``Benchmark.smoke``): the same code at toy size on CPU (gloo), which CI runs
  to show that it runs (its timings mean nothing).

Result file (``<output-dir>/<name>.json``; ``--smoke`` defaults to ``bench/results/smoke/``, which
``bench.report`` does not read)::

    {"bench": name, "schema": 1, "mode": "full" | "smoke", "created": ISO-8601 UTC,
     "setup": {...}, "versions": {"torch", "deepspeed", "transformers", "peft", "ds_z3native",
     "cuda", "python", "device"}, "baseline": run key the ratios refer to (or null),
     "runs": {key: {"variant": str, "status": "ok" | "failed" | "not_available",
                    "reason": str (not ok), "step_ms": {"median", "min", "max", "n"},
                    "peak_gib": float | null, "peak_kind": str,
                    "ratio": {"step_ms": run / baseline, "peak_gib": ...} | null,
                    ... benchmark-specific fields}}}

Run keys are the variant (``ours``) or ``variant@deepspeed-version`` where a benchmark compares
DeepSpeed versions. ``bench/lora_llama.py merge``'s output (``{"bench", "runs"}``, records with
``step_ms`` and ``peak_gib``) is a subset of this format.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from packaging.version import Version

from ds_z3native._net import free_port

log = logging.getLogger("bench.suite")

__all__ = ["SCHEMA", "RESULTS_DIR", "SMOKE_DIR", "GIB", "Command", "BenchContext", "Benchmark",
           "register", "registry", "versions", "summarize", "peak_memory_gib", "pick_baseline",
           "add_ratios", "finish_result", "write_result", "run_command", "check_lora_variants",
           "main"]

SCHEMA = 1
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
SMOKE_DIR = RESULTS_DIR / "smoke"
GIB = 2**30
RATIO_METRICS = ("step_ms", "first_step_s", "peak_gib")
_PACKAGES = ("torch", "deepspeed", "transformers", "peft", "ds_z3native")


# --------------------------------------------------------------------------- result helpers

def versions(device: Optional[str] = None) -> Dict[str, Optional[str]]:
    """Installed versions of torch, DeepSpeed, transformers, PEFT, ds_z3native (from package
    metadata: nothing is imported), torch's CUDA version, Python, and ``device`` if given."""
    out: Dict[str, Optional[str]] = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
    except ImportError:
        out["cuda"] = None
    out["python"] = platform.python_version()
    out["device"] = device
    return out


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """``{"median", "min", "max", "n"}`` of ``values`` (at least one)."""
    if not values:
        raise ValueError("summarize: no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def peak_memory_gib(device: str = "cpu") -> "tuple[float, str]":
    """(peak, what it measures): ``torch.cuda.max_memory_allocated`` on CUDA, else the process's
    peak RSS."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / GIB, "torch.cuda.max_memory_allocated"
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "process peak RSS (ru_maxrss)")


def metric_value(record: Mapping[str, Any], metric: str) -> Optional[float]:
    """A record's central value of ``metric``: the number itself, or its ``median`` (``mean``
    where only a mean was recorded); None when absent or not a finite number."""
    value = record.get(metric)
    if isinstance(value, Mapping):
        value = value.get("median", value.get("mean"))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def run_variant(key: str, record: Mapping[str, Any]) -> str:
    """The variant of a run: its ``variant`` field, else the key before ``@``."""
    return str(record.get("variant") or key.split("@", 1)[0])


def run_deepspeed(key: str, record: Mapping[str, Any]) -> Optional[str]:
    """The DeepSpeed version of a run: from its key (``variant@version``) or its versions."""
    if "@" in key:
        return key.split("@", 1)[1]
    return (record.get("versions") or {}).get("deepspeed")


def _version_key(v: Optional[str]) -> tuple:
    parts = []
    for p in (v or "").split("."):
        parts.append(int(p) if p.isdigit() else -1)
    return tuple(parts)


def run_ok(record: Mapping[str, Any]) -> bool:
    """A run that produced numbers (no ``error``, status ok or absent)."""
    return not record.get("error") and record.get("status", "ok") == "ok"


def pick_baseline(runs: Mapping[str, Mapping[str, Any]], preferred: Sequence[str],
                  deepspeed: Optional[str] = None) -> Optional[str]:
    """The run key of the first variant in ``preferred`` that has a successful run (restricted
    to DeepSpeed ``deepspeed`` if given; the newest DeepSpeed wins a tie)."""
    for variant in preferred:
        keys = [k for k, r in runs.items() if run_variant(k, r) == variant and run_ok(r)
                and (deepspeed is None or run_deepspeed(k, r) == deepspeed)]
        if keys:
            return max(keys, key=lambda k: _version_key(run_deepspeed(k, runs[k])))
    return None


def add_ratios(result: Dict[str, Any], preferred: Sequence[str],
               per_deepspeed: bool = False) -> None:
    """Set ``result["baseline"]`` and each run's ``ratio`` (run / baseline of ``step_ms``,
    ``first_step_s``, ``peak_gib`` where both have it). ``per_deepspeed``: each DeepSpeed
    version's runs against the baseline of that version (``result["baseline"]`` is then a map).
    A record measured in another invocation than the baseline (another ``run`` label, e.g. a
    LoRA variant re-run into an existing result) gets no ratio."""
    runs: Dict[str, Dict[str, Any]] = result.get("runs", {})
    baselines: Dict[Optional[str], Optional[str]] = {}
    if per_deepspeed:
        for key, record in runs.items():
            ds = run_deepspeed(key, record)
            if ds not in baselines:
                baselines[ds] = pick_baseline(runs, preferred, ds)
        result["baseline"] = {str(ds): b for ds, b in baselines.items()}
    else:
        result["baseline"] = pick_baseline(runs, preferred)
    for key, record in runs.items():
        base_key = (baselines.get(run_deepspeed(key, record)) if per_deepspeed
                    else result["baseline"])
        other_run = base_key is not None and runs[base_key].get("run") != record.get("run")
        if base_key is None or not run_ok(record) or other_run:
            record["ratio"] = None
            continue
        base = runs[base_key]
        ratio: Dict[str, float] = {}
        for metric in RATIO_METRICS:
            mine, theirs = metric_value(record, metric), metric_value(base, metric)
            if mine is not None and theirs:
                ratio[metric] = mine / theirs
        record["ratio"] = ratio or None


def finish_result(bench: "Benchmark", result: Dict[str, Any], ctx: "BenchContext") -> Dict[str, Any]:
    """Fill the common fields (bench, schema, mode, created, versions, ratios) of ``result``
    (a benchmark may name its result ``<name>_<suffix>``, e.g. per world size)."""
    if not str(result.get("bench", "")).startswith(bench.name):
        result["bench"] = bench.name
    result["schema"] = SCHEMA
    result["mode"] = "smoke" if ctx.smoke else "full"
    result["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result.setdefault("setup", {})
    result.setdefault("versions", versions())
    result.setdefault("runs", {})
    for key, record in result["runs"].items():
        record.setdefault("variant", run_variant(key, record))
        record.setdefault("status", "ok" if run_ok(record) else "failed")
    add_ratios(result, bench.baseline, per_deepspeed=bench.ratio_per_deepspeed)
    return result


def write_result(result: Mapping[str, Any], path: Path) -> Path:
    """Write ``result`` as indented, key-sorted JSON (one trailing newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return path


# --------------------------------------------------------------------------- registry

@dataclasses.dataclass
class Command:
    """One process of a benchmark's GPU plan."""

    argv: List[str]
    label: str
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    output: Optional[Path] = None

    def shell(self) -> str:
        """The command as one shell line (environment first)."""
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


@dataclasses.dataclass
class BenchContext:
    """What a benchmark run is asked for."""

    output_dir: Path
    smoke: bool = False
    steps: Optional[int] = None
    repeats: Optional[int] = None
    ranks: Optional[int] = None
    extra_deepspeed: Dict[str, str] = dataclasses.field(default_factory=dict)
    timeout: float = 3600.0
    work_root: Optional[Path] = None  # logs and intermediate files; a new temp dir by default
    variants: Optional[List[str]] = None  # lora_llama: only these, merged into the existing result
    trace: Optional[Path] = None  # lora_llama: torch.profiler traces of two more steps, here
    # One label for all runs of this invocation: a result's ratios compare runs of one label.
    run_id: str = dataclasses.field(default_factory=lambda: datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))

    @property
    def work_dir(self) -> Path:
        """Where logs and per-process outputs go (created on first use)."""
        if self.work_root is None:
            self.work_root = Path(tempfile.mkdtemp(prefix="bench-"))
        return self.work_root


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A named benchmark: its GPU command builder, its full run and its CPU smoke run."""

    name: str
    description: str
    baseline: Sequence[str]  # variants in order of preference for the ratio baseline
    commands: Callable[[BenchContext], List[Command]]
    run: Callable[[BenchContext], Dict[str, Any]]
    smoke: Callable[[BenchContext], Dict[str, Any]]
    ratio_per_deepspeed: bool = False
    multi_gpu: bool = False  # a full run also runs at 2 GPUs where the host has them


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA: no GPUs
        return 0


def contexts_for(bench: Benchmark, ctx: BenchContext, gpus: Optional[int] = None) -> List[BenchContext]:
    """The runs of ``bench`` that ``ctx`` asks for: as given, plus (full runs of a ``multi_gpu``
    benchmark without ``--ranks``, on a host with ``gpus`` >= 2 GPUs) the same at 2 ranks."""
    if ctx.smoke or ctx.ranks is not None or not bench.multi_gpu:
        return [ctx]
    gpus = _cuda_device_count() if gpus is None else gpus
    # its own work folder: the 2-rank runs must not find the 1-rank runs' files
    return [ctx] + ([dataclasses.replace(ctx, ranks=2, work_root=None)] if gpus >= 2 else [])


_REGISTRY: Dict[str, Benchmark] = {}
_MODULES = ("bench.native_micro",)


def register(bench: Benchmark) -> Benchmark:
    """Add ``bench`` to the registry (a later registration of the same name replaces it)."""
    _REGISTRY[bench.name] = bench
    return bench


def registry() -> Dict[str, Benchmark]:
    """Every registered benchmark by name (modules holding benchmarks are imported first)."""
    for module in _MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)


def run_command(cmd: Command, log_dir: Path, timeout: float = 3600.0,
                progress_every: float = 60.0) -> int:
    """Run ``cmd`` (output to a log file under ``log_dir``), logging its start, a line every
    ``progress_every`` seconds while it runs, and its end; its exit code (124 on timeout).

    Past ``timeout`` the command and every process descended from it (a launcher's ranks too)
    get SIGABRT first, which makes each Python process print every thread's traceback into the
    log (``PYTHONFAULTHANDLER``), then SIGKILL; the log's tail is logged, so a hang says where it
    hung."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (re.sub(r"[^\w.@-]+", "_", cmd.label) + ".log")
    env = dict(os.environ)
    env.update(cmd.env)
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT at a timeout prints every thread's traceback
    log.info("%s: %s (log: %s)", cmd.label, cmd.shell(), log_path)
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while True:
            try:
                code = proc.wait(timeout=min(progress_every,
                                             max(1.0, timeout - (time.monotonic() - start))))
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed >= timeout:
                    _stop_process_tree(proc)
                    log.error("%s: stopped after %.0f s (timeout %.0f s); the log ends:\n%s",
                              cmd.label, elapsed, timeout, _tail(log_path))
                    return 124
                log.info("%s: still running (%.0f s)", cmd.label, elapsed)
    log.info("%s: exit %d after %.1f s", cmd.label, code, time.monotonic() - start)
    return code


def _stop_process_tree(proc: "subprocess.Popen[bytes]", grace: float = 10.0) -> None:
    """SIGABRT to ``proc`` and every process descended from it (tracebacks into the log; no
    core files), then SIGKILL to whatever is left. Descendants are found through /proc, not the
    process group: torchrun starts each rank in a session of its own."""
    tree = _process_tree(proc.pid)
    for pid in tree:
        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            os.kill(pid, signal.SIGABRT)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
        time.sleep(0.2)
    for pid in set(tree) | set(_process_tree(proc.pid)):
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:  # where /proc told nothing
        proc.kill()
    proc.wait()


def _process_tree(root: int) -> List[int]:
    """``root`` and its living descendants (Linux /proc; only ``root`` where there is none)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (Linux /proc; a zombie, dead but not yet reaped, does not)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return bool(fields) and fields[0] not in ("Z", "X")  # no fields: gone with its /proc entry


def _stat_fields(stat: Path) -> List[str]:
    """The fields of a /proc/<pid>/stat after the command name (state, ppid, ...); [] when the
    process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _tail(path: Path, lines: int = 60, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of the file at ``path`` (reading at most its last ``max_bytes``)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def run_commands(cmds: Sequence[Command], ctx: BenchContext) -> List[int]:
    """Run ``cmds`` one after another with ``[i/n]`` progress; their exit codes."""
    codes = []
    for i, cmd in enumerate(cmds, 1):
        log.info("[%d/%d] %s", i, len(cmds), cmd.label)
        codes.append(run_command(cmd, ctx.work_dir / "logs", ctx.timeout))
    return codes


def _read_json(path: Optional[Path]) -> Optional[Dict[str, Any]]:
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        log.error("%s: not JSON (%s)", path, e)
        return None


def _deepspeed_envs(ctx: BenchContext) -> List[tuple]:
    """(DeepSpeed version label, extra env) for the installed DeepSpeed and each
    ``--deepspeed-path VERSION=PATH`` (prepended to PYTHONPATH)."""
    installed = versions().get("deepspeed") or "installed"
    envs: List[tuple] = [(installed, {})]
    for version, path in sorted(ctx.extra_deepspeed.items()):
        pp = os.environ.get("PYTHONPATH")
        envs.append((version, {"PYTHONPATH": str(Path(path).resolve()) + (":" + pp if pp else "")}))
    return envs


# ------------------------------------------------------- time to the first DeepCompile step

_FIRST_STEP_VARIANTS = {"ours": ["--native", "ours"],
                        "deepspeed-jit": ["--native", "deepspeed", "--fresh-extension-cache"]}


def _first_step_commands(ctx: BenchContext) -> List[Command]:
    repeats = ctx.repeats or 3
    steps = ctx.steps or 10
    cmds = []
    for ds, env in _deepspeed_envs(ctx):
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
    grouped: Dict[str, List[Optional[Dict[str, Any]]]] = {}
    for cmd in cmds:
        key = cmd.label.split()[1]
        grouped.setdefault(key, []).append(_read_json(cmd.output))
    runs: Dict[str, Any] = {}
    versions_seen: Dict[str, Any] = {}
    for key, outs in grouped.items():
        variant, ds = key.split("@", 1)
        good = [o for o in outs if o and not o.get("error") and "compile_to_first_step_end_s" in o]
        record: Dict[str, Any] = {"variant": variant, "deepspeed": ds, "peak_gib": None,
                                  "peak_kind": "not measured"}
        if good:
            record["first_step_s"] = summarize([o["compile_to_first_step_end_s"] for o in good])
            record["step_ms"] = summarize([o["step_ms_after_warmup"] for o in good])
            record["runs_failed"] = len(outs) - len(good)
            versions_seen.setdefault("torch", good[0].get("torch"))
        else:
            failed = next((o for o in outs if o and o.get("error")), None)
            record["status"] = "failed"
            record["error"] = failed["error"] if failed else "no result written (see the log)"
        runs[key] = record
    return {"runs": runs}


def _first_step_run(ctx: BenchContext) -> Dict[str, Any]:
    cmds = _first_step_commands(ctx)
    run_commands(cmds, ctx)
    result = _first_step_collect(cmds)
    result["setup"] = {
        "runner": "bench/deepcompile_run.py --mode deepcompile", "model": "seed: a frozen "
        "Linear(64, 64) feeding a trainable Linear(64, 16), batch 8, fp32, AdamW lr 1e-3",
        "steps": ctx.steps or 10, "repeats": ctx.repeats or 3, "processes": "one per run, one GPU",
        "first_step_s": "engine.compile() to the end of step 1; fresh inductor cache every run, "
                        "fresh extension cache for deepspeed-jit",
        "step_ms": "mean of steps 7 and later, per run"}
    result["versions"] = versions(_cuda_device_name())
    return result


def _first_step_smoke(ctx: BenchContext) -> Dict[str, Any]:
    """On the CPU: with DeepSpeed >= 0.19.3 our op runs DeepCompile there (gloo; DeepSpeed's own
    op builds only with CUDA, so its variant is not available); older DeepSpeed profiles with
    CUDA events only, and the runner then trains its model eagerly (ZeRO-0) to show it works."""
    ds = versions().get("deepspeed")
    out = ctx.work_dir / "first_step_smoke.json"
    deepcompile = bool(ds) and Version(ds).release >= (0, 19, 3)
    args = ["--mode", "deepcompile", "--native", "ours"] if deepcompile else ["--mode", "eager"]
    cmd = Command([sys.executable, "bench/deepcompile_run.py", *args, "--steps", "2",
                   "--json", str(out)],
                  label="deepcompile_first_step smoke (CPU)",
                  env={"DS_ACCELERATOR": "cpu", "TORCHINDUCTOR_CACHE_DIR":
                       str(ctx.work_dir / "first_step_inductor")}, output=out)
    code = run_command(cmd, ctx.work_dir / "logs", ctx.timeout)
    res = _read_json(out) or {}
    ok = code == 0 and not res.get("error") and len(res.get("losses", [])) == 2
    runs: Dict[str, Any] = {}
    for v in _FIRST_STEP_VARIANTS:
        if v == "ours" and deepcompile:
            continue
        reason = ("DeepSpeed's own dc op builds only with CUDA" if v != "ours" else
                  "DeepCompile on the CPU needs DeepSpeed >= 0.19.3")
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
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a label only
        return None


register(Benchmark(
    name="deepcompile_first_step",
    description="time from engine.compile() to the end of the first DeepCompile step: "
                "ds_z3native's prebuilt op vs DeepSpeed's JIT build (fresh extension cache)",
    baseline=("deepspeed-jit",), commands=_first_step_commands, run=_first_step_run,
    smoke=_first_step_smoke, ratio_per_deepspeed=True))


# ------------------------------------------------------------------------- 1 B LoRA (Llama)

def _lora_script() -> "tuple[str, Sequence[str]]":
    """The LoRA runner (``bench/lora_llama.py``; ``bench/eager_lora.py`` in older checkouts)
    and its variants."""
    for module in ("lora_llama", "eager_lora"):
        if (BENCH_DIR / f"{module}.py").exists():
            mod = importlib.import_module(f"bench.{module}")
            return f"bench/{module}.py", tuple(getattr(mod, "VARIANTS", ()))
    raise FileNotFoundError("bench/lora_llama.py (or bench/eager_lora.py) is missing")


def check_lora_variants(variants: Sequence[str]) -> None:
    """Raise ValueError for a LoRA variant set that cannot run as asked (``dc-warm`` needs the
    ``dc`` run of the same invocation to fill its inductor cache; ``trainer-dc-ckpt`` is compared
    with the same invocation's ``dc-ckpt``)."""
    if "dc-warm" in variants and "dc" not in variants:
        raise ValueError("lora_llama variant dc-warm re-runs dc's graphs from the inductor cache "
                         "dc fills in the same invocation: pick dc as well")
    from bench.lora_llama import TRAINER

    for trainer, own in TRAINER.items():
        if trainer in variants and own not in variants:
            raise ValueError(f"lora_llama variant {trainer} is measured against our loop's {own} "
                             f"of the same invocation: pick {own} as well")


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
        env["DS_Z3NATIVE_PROFILE_STORE"] = str(ctx.work_dir / "profiles" / deepspeed)
    return env


def _lora_commands(ctx: BenchContext) -> List[Command]:
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
    check_lora_variants(variants)
    for ds, env in _deepspeed_envs(ctx):
        # Another DeepSpeed is there for ds_z3native's fix on it: only "ours" runs on it.
        for variant in (variants if not env else tuple(v for v in ("ours",) if v in variants)):
            out = ctx.work_dir / "lora" / f"{variant}-{ds}.json"
            port = ([f"--master_port={free_port()}"] if ranks > 1 else [])
            trace = ["--trace", str(ctx.trace / ds)] if ctx.trace is not None else []
            cmds.append(Command([*launcher, *port, script, "--variant", variant, *steps, *trace,
                                 "--run", ctx.run_id, "--output", str(out)],
                                label=f"lora_llama {variant}@{ds}",
                                env={**env, **_lora_inductor_cache(ctx, ds, variant)}, output=out))
    return cmds


def _lora_merge(cmds: Sequence[Command], ctx: BenchContext, script: str) -> Dict[str, Any]:
    inputs = [str(c.output) for c in cmds if c.output is not None and c.output.exists()]
    merged = ctx.work_dir / "lora" / "merged.json"
    if merged.exists():
        merged.unlink()
    from bench.lora_llama import bench_name  # the result's name per world size, as merge gives it

    existing = ctx.output_dir / f"{bench_name(ctx.ranks or 1)}.json"
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
    result = _read_json(merged) or {"runs": {}}
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
    script, _ = _lora_script()
    cmds = _lora_commands(ctx)
    run_commands(cmds, ctx)
    return _lora_merge(cmds, ctx, script)


def _lora_smoke(ctx: BenchContext) -> Dict[str, Any]:
    from bench.lora_llama import DEEPCOMPILE

    script, variants = _lora_script()
    picked = ["ours", "none"]
    ds = versions().get("deepspeed")
    # DeepCompile runs on the CPU from DeepSpeed 0.19.3 (its profiler falls back without CUDA).
    if ds and Version(ds).release >= (0, 19, 3):
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
                            env={"DS_ACCELERATOR": "cpu", **_lora_inductor_cache(ctx, str(ds), v)},
                            output=out))
    run_commands(cmds, ctx)
    return _lora_merge(cmds, ctx, script)


register(Benchmark(
    name="lora_llama",
    description="1 B Llama + PEFT LoRA: ms/step, tokens/s, peak GiB, TFLOP/s per variant "
                "(checkpointing modes, ours vs upstream DeepSpeed, DeepCompile)",
    baseline=("upstream", "none", "plain"), commands=_lora_commands, run=_lora_run,
    smoke=_lora_smoke, multi_gpu=True))


# ----------------------------------------------------------------------------------- CLI

def run_benchmark(bench: Benchmark, ctx: BenchContext) -> Path:
    """Run ``bench`` (smoke or full as ``ctx`` says) and write its result JSON; the path."""
    log.info("%s: %s run starting", bench.name, "smoke" if ctx.smoke else "full")
    start = time.monotonic()
    result = (bench.smoke if ctx.smoke else bench.run)(ctx)
    finish_result(bench, result, ctx)
    path = write_result(result, ctx.output_dir / f"{result['bench']}.json")
    log.info("%s: done in %.1f s, wrote %s", bench.name, time.monotonic() - start, path)
    return path


def format_runs(result: Mapping[str, Any]) -> str:
    """A plain-text table of a result's runs (for the terminal)."""
    lines = [f"{result.get('bench')} ({result.get('mode')}), baseline {result.get('baseline')}"]
    for key, r in sorted(result.get("runs", {}).items()):
        step = r.get("step_ms") or {}
        ratio = (r.get("ratio") or {}).get("step_ms")
        if not run_ok(r):
            why = str(r.get("reason") or r.get("error") or "").strip().splitlines() or [""]
            lines.append(f"  {key:<28} {r.get('status', 'failed')}: {why[-1]}")
            continue
        med = metric_value(r, "step_ms")
        peak = metric_value(r, "peak_gib")
        lines.append(f"  {key:<28} "
                     + (f"{med:10.3f} ms [{step.get('min', med):.3f}-{step.get('max', med):.3f}]"
                        if med is not None else f"{'-':>10}")
                     + (f"  x{ratio:.2f}" if ratio is not None else "")
                     + (f"  peak {peak:.3f} GiB" if peak is not None else ""))
    return "\n".join(lines)


def _parse_extra(values: Iterable[str]) -> Dict[str, str]:
    out = {}
    for v in values:
        version, sep, path = v.partition("=")
        if not sep or not version or not path:
            raise argparse.ArgumentTypeError(f"--deepspeed-path wants VERSION=PATH, got {v!r}")
        out[version] = path
    return out


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    """The suite's argument parser."""
    p = argparse.ArgumentParser(
        prog=prog, description="Run ds_z3native's benchmarks; each writes <output-dir>/<name>.json "
        "(then `python -m bench.report` regenerates the tables of docs/benchmarks.md, the README's summary and the plot).")
    p.add_argument("name", help="a benchmark name, 'all', or 'list' (names and descriptions)")
    p.add_argument("--smoke", action="store_true",
                   help="toy size on CPU (gloo); what CI runs (default output: bench/results/smoke)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where the JSON goes (default bench/results, or bench/results/smoke with "
                        "--smoke)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the GPU plan's commands instead of running them")
    p.add_argument("--steps", type=int, default=None, help="timed steps (benchmark's default)")
    p.add_argument("--repeats", type=int, default=None, help="repeated runs where a benchmark "
                                                               "repeats whole processes")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks, one GPU each (native_micro; lora_llama: runs under "
                        "torch.distributed.run and writes lora_llama_ws<N>.json)")
    p.add_argument("--deepspeed-path", action="append", default=[], metavar="VERSION=PATH",
                   help="another DeepSpeed to run 'ours' on, prepended to PYTHONPATH (e.g. "
                        "0.19.2=/tmp/ds192); repeatable")
    p.add_argument("--timeout", type=float, default=3600.0, help="per process, seconds")
    p.add_argument("--variants", default=None, metavar="A,B",
                   help="lora_llama: run only these variants and merge them into the existing "
                        "result file (its other runs stay)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="lora_llama: profile two more steps of each variant after its timed ones "
                        "(torch.profiler; DIR/<deepspeed>/<variant>-rank<r>.json and -top.txt)")
    p.add_argument("--no-report", action="store_true",
                   help="do not regenerate the benchmark tables and plot afterwards (a full run "
                        "into bench/results does by default)")
    p.add_argument("-v", "--verbose", action="store_true", help="DEBUG logging")
    return p


def main(argv: Optional[List[str]] = None, prog: str = "python -m bench") -> int:
    """The suite's CLI; exit code 0 when every run benchmark wrote its JSON."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    benches = registry()
    if args.name == "list":
        for name, b in sorted(benches.items()):
            print(f"{name:<24} {b.description}")
        return 0
    names = sorted(benches) if args.name == "all" else [args.name]
    unknown = [n for n in names if n not in benches]
    if unknown:
        print(f"unknown benchmark {unknown[0]!r}; known: {', '.join(sorted(benches))}",
              file=sys.stderr)
        return 2
    variants = None
    if args.variants is not None:
        _, known = _lora_script()
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown_variants = [v for v in variants if v not in known]
        if names != ["lora_llama"] or not variants or unknown_variants or args.smoke:
            print(f"--variants applies to a full lora_llama run and takes names from "
                  f"{', '.join(known)}; got {args.variants!r} for {args.name!r}", file=sys.stderr)
            return 2
        try:
            check_lora_variants(variants)
        except ValueError as e:
            print(f"--variants: {e}", file=sys.stderr)
            return 2
    ctx = BenchContext(output_dir=args.output_dir or (SMOKE_DIR if args.smoke else RESULTS_DIR),
                       smoke=args.smoke, steps=args.steps, repeats=args.repeats, ranks=args.ranks,
                       extra_deepspeed=_parse_extra(args.deepspeed_path), timeout=args.timeout,
                       variants=variants, trace=args.trace)
    if args.dry_run:
        for name in names:
            for run_ctx in contexts_for(benches[name], ctx):
                print(f"# {name}" + (f" ({run_ctx.ranks} ranks)" if run_ctx.ranks else ""))
                for cmd in benches[name].commands(run_ctx):
                    print(cmd.shell())
        return 0
    code = 0
    for name in names:
        for run_ctx in contexts_for(benches[name], ctx):
            try:
                path = run_benchmark(benches[name], run_ctx)
            except Exception:  # noqa: BLE001 - one failing benchmark does not stop the others
                log.exception("%s failed", name)
                code = 1
                continue
            print(format_runs(json.loads(path.read_text())))
    if not ctx.smoke and not args.no_report and ctx.output_dir.resolve() == RESULTS_DIR.resolve():
        from bench import report

        log.info("regenerating the benchmark tables and plot from %s", RESULTS_DIR)
        code = report.main([]) or code
    return code
