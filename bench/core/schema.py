"""The benchmark result format and the helpers every benchmark and the report share.

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

import importlib.metadata
import json
import logging
import math
import platform
import resource
import statistics
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

log = logging.getLogger("bench.core.schema")

__all__ = ["SCHEMA", "BENCH_DIR", "ROOT", "RESULTS_DIR", "SMOKE_DIR", "GIB", "RATIO_METRICS",
           "versions", "summarize", "peak_memory_gib", "metric_value", "run_variant",
           "run_deepspeed", "run_ok", "pick_baseline", "add_ratios", "write_result", "read_json"]

SCHEMA = 1
BENCH_DIR = Path(__file__).resolve().parents[1]
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
SMOKE_DIR = RESULTS_DIR / "smoke"
GIB = 2**30
RATIO_METRICS = ("step_ms", "first_step_s", "peak_gib")
_PACKAGES = ("torch", "deepspeed", "transformers", "peft", "ds_z3native")


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


def peak_memory_gib(device: str = "cpu") -> Tuple[float, str]:
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


def _version_key(v: Optional[str]) -> Tuple[int, ...]:
    """A DeepSpeed version as a sortable tuple (a non-numeric part sorts first)."""
    parts = []
    for p in (v or "").split("."):
        parts.append(int(p) if p.isdigit() else -1)
    return tuple(parts)


def run_ok(record: Mapping[str, Any]) -> bool:
    """A run that produced numbers (no ``error``, status ok or absent)."""
    return not record.get("error") and record.get("status", "ok") == "ok"


def same_run_ratio(a: Optional[Mapping[str, Any]], b: Optional[Mapping[str, Any]],
                   metric: str) -> Optional[float]:
    """``a``'s ``metric`` over ``b``'s; None unless both runs are ok, have it and belong to one
    run label (runs of separate invocations are not compared)."""
    if a is None or b is None or not run_ok(a) or not run_ok(b) or a.get("run") != b.get("run"):
        return None
    x, y = metric_value(a, metric), metric_value(b, metric)
    return x / y if x is not None and y else None


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

def write_result(result: Mapping[str, Any], path: Path) -> Path:
    """Write ``result`` as indented, key-sorted JSON (one trailing newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return path



def read_json(path: Optional[Path]) -> Optional[Dict[str, Any]]:
    """The JSON object at ``path``; None when there is no path, no file, or no JSON in it."""
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        log.error("%s: not JSON (%s)", path, e)
        return None
