"""The benchmark registry: ``Benchmark`` (a name, a GPU command builder, a full run, a CPU smoke
run), ``BenchContext`` (what one run is asked for), ``register`` and the finishing of a result.

The benchmarks register themselves from ``bench/benchmarks/`` (``bench.benchmarks.registry()``
imports them all); this module knows none of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.core.runner import Command
from bench.core.schema import SCHEMA, add_ratios, run_ok, run_variant, versions

__all__ = ["BenchContext", "Benchmark", "register", "registered", "contexts_for",
           "finish_result", "deepspeed_envs"]


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
    layers: Optional[List[int]] = None  # compile_scaling: the depths (decoder layers) to run
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
    """How many CUDA devices torch sees (0 without torch or CUDA)."""
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


def register(bench: Benchmark) -> Benchmark:
    """Add ``bench`` to the registry (a later registration of the same name replaces it)."""
    _REGISTRY[bench.name] = bench
    return bench


def registered() -> Dict[str, Benchmark]:
    """Every benchmark registered so far, by name."""
    return dict(_REGISTRY)


def finish_result(bench: Benchmark, result: Dict[str, Any], ctx: BenchContext) -> Dict[str, Any]:
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


def deepspeed_envs(ctx: BenchContext) -> List[Tuple[str, Dict[str, str]]]:
    """(DeepSpeed version label, extra env) for the installed DeepSpeed and each
    ``--deepspeed-path VERSION=PATH`` (prepended to PYTHONPATH)."""
    installed = versions().get("deepspeed") or "installed"
    envs: List[Tuple[str, Dict[str, str]]] = [(installed, {})]
    for version, path in sorted(ctx.extra_deepspeed.items()):
        pp = os.environ.get("PYTHONPATH")
        envs.append((version, {"PYTHONPATH": str(Path(path).resolve()) + (":" + pp if pp else "")}))
    return envs
