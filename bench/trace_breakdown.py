"""Where a training step's time goes, read from a ``torch.profiler`` Chrome trace.

:func:`breakdown` takes the trace of ``steps`` profiled steps (``bench/lora_llama.py --trace``)
and returns, per step:

* ``device_busy_ms`` / ``device_busy_share``: the union of the device's kernel, memcpy and memset
  intervals over all its streams (time the device is doing anything), and its share of the step's wall time (``None`` without device activity, e.g. on a
  CPU);
* ``launches``: kernel launches by kind (``nccl``, ``triton`` for inductor's generated kernels,
  ``gemm``, ``attention``, ``memcpy``, ``memset``, ``other``) and their ``total``; each launch is
  classified by the kernel it started (the runtime call and the kernel share a correlation id);
* ``host_ms``: host time in the DeepCompile ops (``dc_ops``: DeepSpeed's ``dc`` ops and
  ds_z3native's ``ds_z3native::gather_persistent`` and ``reduce_grads``), in inductor's compiled graphs
  (``compiled_graphs``: the ``## Call CompiledFxGraph`` spans), the part of the latter that is not
  ``dc`` ops (``graph_wrapper``: inductor's wrapper code and the kernels' launch calls), and in
  launch calls overall (``launch_calls``);
* ``dc_calls``: calls per DeepCompile op (by its name without the namespace);
* ``device_idle``: where the device waits, for traces whose steps are marked with
  :data:`PHASE_PREFIX` spans (``phase:step`` around each step, ``phase:forward``,
  ``phase:backward``, ``phase:optimizer_step`` inside it; ``bench/lora_llama.py`` marks them):
  the device's idle time within the steps (``ms``), split by the phase the host was in meanwhile
  (``by_phase``; ``other`` is step time outside the three, such as the batch's copy and the
  final read of the loss), and the part of it while the host was inside a compiled graph
  (``in_compiled_graphs``) or a DeepCompile op (``in_dc_ops``). The device idles while the host
  has not yet launched its next work, so a phase's share is the host time of that phase the
  step waits for. ``None`` without device activity or without ``phase:step`` spans.

Host intervals are merged per thread before they are summed, so nested events are not counted
twice; device intervals are merged per device.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

__all__ = ["LAUNCH_KINDS", "PHASES", "PHASE_PREFIX", "breakdown", "breakdown_file", "kernel_kind",
           "union_length"]

LAUNCH_KINDS = ("nccl", "triton", "gemm", "attention", "memcpy", "memset", "other")
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
COMPILED_GRAPH = "## Call CompiledFxGraph"
# The namespaces of the ops DeepCompile's graphs call: DeepSpeed's and ours (gather_persistent,
# reduce_grads).
DC_OP_PREFIXES = ("dc::", "ds_z3native::")

# Host spans (torch.profiler.record_function) marking a step and its phases.
PHASE_PREFIX = "phase:"
PHASES = ("forward", "backward", "optimizer_step")

Interval = Tuple[float, float]


def _merged(intervals: Iterable[Interval]) -> List[Interval]:
    """``intervals`` as sorted, disjoint intervals covering the same points."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def union_length(intervals: Iterable[Interval]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    return sum(end - start for start, end in _merged(intervals))


def _gaps(within: Sequence[Interval], busy: Sequence[Interval]) -> List[Interval]:
    """The parts of the union of ``within`` not covered by the union of ``busy``."""
    gaps: List[Interval] = []
    cover = _merged(busy)
    for ws, we in _merged(within):
        cursor = ws
        for bs, be in cover:
            if be <= cursor:
                continue
            if bs >= we:
                break
            if bs > cursor:
                gaps.append((cursor, bs))
            cursor = max(cursor, be)
            if cursor >= we:
                break
        if cursor < we:
            gaps.append((cursor, we))
    return gaps


def _overlap(intervals: Sequence[Interval], within: Sequence[Interval]) -> float:
    """Length of the union of ``intervals`` that lies inside the union of ``within``."""
    clipped = []
    for s, e in intervals:
        for ws, we in within:
            lo, hi = max(s, ws), min(e, we)
            if hi > lo:
                clipped.append((lo, hi))
    return union_length(clipped)


def kernel_kind(name: str, category: str = "kernel") -> str:
    """The launch kind of a device event (see :data:`LAUNCH_KINDS`)."""
    if category == "gpu_memcpy" or name.startswith("Memcpy"):
        return "memcpy"
    if category == "gpu_memset" or name.startswith("Memset"):
        return "memset"
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if low.startswith("triton"):
        return "triton"
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")):
        return "gemm"
    return "other"


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name.startswith(("cudaMemcpy", "cudaMemset", "cuMemcpy",
                                                       "cuMemset"))


def _span(event: Mapping[str, Any]) -> Interval:
    """An ``X`` event's ``(start, end)``."""
    ts = float(event["ts"])
    return ts, ts + float(event.get("dur", 0.0))


def _by_thread(events: Iterable[Mapping[str, Any]]) -> Dict[Any, List[Interval]]:
    out: Dict[Any, List[Interval]] = defaultdict(list)
    for e in events:
        out[(e.get("pid"), e.get("tid"))].append(_span(e))
    return out


def breakdown(trace: Mapping[str, Any], steps: int, step_ms: Sequence[float]) -> Dict[str, Any]:
    """Per-step breakdown of ``steps`` profiled steps whose wall times were ``step_ms`` (ms)."""
    if steps < 1:
        raise ValueError(f"breakdown: steps must be >= 1, got {steps}")
    if len(step_ms) != steps:
        raise ValueError(f"breakdown: {steps} steps but {len(step_ms)} step times")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    wall_ms = sum(step_ms) / steps

    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    # Busy: any stream of the device at work (the union across its streams, per device).
    by_device: Dict[Any, List[Interval]] = defaultdict(list)
    for e in device:
        by_device[e.get("pid")].append(_span(e))
    busy_us = sum(union_length(iv) for iv in by_device.values()) if device else None
    kinds_by_correlation = {}
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            kinds_by_correlation[corr] = kernel_kind(str(e.get("name", "")), e.get("cat", ""))

    launch_events = [e for e in events
                     if e.get("cat") in RUNTIME_CATEGORIES and _is_launch(str(e.get("name", "")))]
    launches: Counter = Counter()
    for e in launch_events:
        corr = (e.get("args") or {}).get("correlation")
        kind = kinds_by_correlation.get(corr)
        if kind is None:  # a runtime call whose device event the trace did not keep
            kind = "memcpy" if "Memcpy" in e["name"] else "memset" if "Memset" in e["name"] \
                else "other"
        launches[kind] += 1

    dc_events = [e for e in events if e.get("cat") == "cpu_op"
                 and str(e.get("name", "")).startswith(DC_OP_PREFIXES)]
    graphs = [e for e in events if str(e.get("name", "")).startswith(COMPILED_GRAPH)]
    dc_by_thread, graph_by_thread = _by_thread(dc_events), _by_thread(graphs)
    dc_us = sum(union_length(iv) for iv in dc_by_thread.values())
    graph_us = sum(union_length(iv) for iv in graph_by_thread.values())
    dc_in_graphs_us = sum(_overlap(dc_by_thread.get(t, []), iv)
                          for t, iv in graph_by_thread.items())
    launch_us = sum(union_length(iv) for iv in _by_thread(launch_events).values())

    def per_step_ms(us: float) -> float:
        return round(us / 1000.0 / steps, 3)

    idle = None
    marked: Dict[str, List[Interval]] = defaultdict(list)  # phase:<name> spans by name
    for e in events:
        name = str(e.get("name", ""))
        if name.startswith(PHASE_PREFIX):
            marked[name[len(PHASE_PREFIX):]].append(_span(e))
    if device and marked["step"]:
        gaps = _gaps(marked["step"], [iv for ivs in by_device.values() for iv in ivs])
        by_phase = {phase: _overlap(gaps, _merged(marked[phase])) for phase in PHASES}
        idle_us = union_length(gaps)
        by_phase["other"] = max(idle_us - sum(by_phase.values()), 0.0)
        idle = {"ms": per_step_ms(idle_us),
                "by_phase": {k: per_step_ms(v) for k, v in by_phase.items()},
                "in_compiled_graphs": per_step_ms(_overlap(gaps, _merged(
                    iv for ivs in graph_by_thread.values() for iv in ivs))),
                "in_dc_ops": per_step_ms(_overlap(gaps, _merged(
                    iv for ivs in dc_by_thread.values() for iv in ivs)))}

    return {
        "steps": steps,
        "wall_ms": round(wall_ms, 3),
        "device_busy_ms": None if busy_us is None else per_step_ms(busy_us),
        "device_busy_share": (None if busy_us is None or wall_ms <= 0
                              else round(busy_us / 1000.0 / steps / wall_ms, 4)),
        "launches": {**{k: round(launches[k] / steps, 1) for k in LAUNCH_KINDS},
                     "total": round(sum(launches.values()) / steps, 1)},
        "host_ms": {"dc_ops": per_step_ms(dc_us), "compiled_graphs": per_step_ms(graph_us),
                    "graph_wrapper": per_step_ms(max(graph_us - dc_in_graphs_us, 0.0)),
                    "launch_calls": per_step_ms(launch_us)},
        "dc_calls": {name.split("::", 1)[1]: round(n / steps, 1)
                     for name, n in sorted(Counter(e["name"] for e in dc_events).items())},
        "device_idle": idle,
    }


def breakdown_file(path: Path, steps: int, step_ms: Sequence[float]) -> Dict[str, Any]:
    """:func:`breakdown` of the Chrome trace at ``path``."""
    return breakdown(json.loads(Path(path).read_text()), steps, step_ms)
