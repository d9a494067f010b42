"""Benchmark tables and plot from the benchmark results: ``python -m bench.report``.

Reads every ``bench/results/*.json`` (suite results, and ``bench/lora_llama.py merge`` output;
smoke results are skipped unless ``--include-smoke``), then

* rewrites the full tables, one per benchmark with its footnote, between
  ``<!-- bench-table:begin -->`` and ``<!-- bench-table:end -->`` in docs/benchmarks.md;
* rewrites the summary table (per benchmark, ds_z3native's best variant against its baseline of
  the same run) between ``<!-- bench-summary:begin -->`` and ``<!-- bench-summary:end -->`` in
  README.md (nothing else in either file changes; running it twice changes nothing);
* draws ``bench/results/summary.png``: step time and peak memory per variant, one row per
  benchmark (needs matplotlib: ``pip install -e ".[bench]"``; without it the tables are still
  written and the message says so).

``--check`` writes nothing and exits 1 when either block is not what the results give.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from bench.core.variants import VARIANT_TABLE
from bench.core.schema import (RESULTS_DIR, ROOT, add_ratios, metric_value, run_deepspeed, run_ok,
                               run_variant, same_run_ratio)

log = logging.getLogger("bench.report")

__all__ = ["BEGIN", "END", "SUMMARY_BEGIN", "SUMMARY_END", "TABLES", "load_results",
           "render_block", "render_summary", "replace_block", "update_readme", "plot_summary",
           "main"]

# The full tables (docs/benchmarks.md) and the summary (README.md) each live between markers.
BEGIN = "<!-- bench-table:begin -->"
END = "<!-- bench-table:end -->"
SUMMARY_BEGIN = "<!-- bench-summary:begin -->"
SUMMARY_END = "<!-- bench-summary:end -->"
TABLES = ROOT / "docs" / "benchmarks.md"
ORDER = ("deepcompile_first_step", "native_micro", "lora_llama", "lora_llama_ws2",
         "lora_llama_varlen", "persistent_group", "compile_scaling")
# Ratio baselines of results written without one (e.g. lora_llama.py's merge output).
BASELINES: Dict[str, Tuple[Tuple[str, ...], bool]] = {
    "deepcompile_first_step": (("deepspeed-jit",), True),
    "native_micro": (("deepspeed", "ours"), False),
    "lora_llama": (("upstream", "none", "plain"), False),
    "lora_llama_varlen": (("dc-ckpt-single", "dc-ckpt"), False),
}


def _family(name: str) -> str:
    """The benchmark a result belongs to: ``lora_llama_ws2`` (the 2-GPU runs) and
    ``lora_llama_h100`` (runs on another kind of GPU) -> ``lora_llama``; ``lora_llama_varlen``
    (and ``lora_llama_varlen_h100``...) is a family of its own."""
    base, sep, ws = name.rpartition("_ws")
    if sep and ws.isdigit():
        name = base
    for family in sorted(BASELINES, key=len, reverse=True):  # the longest name that fits
        if name == family or name.startswith(family + "_"):
            return family
    return name


# --------------------------------------------------------------------------- loading

def load_results(results_dir: Path = RESULTS_DIR, include_smoke: bool = False
                 ) -> Dict[str, Dict[str, Any]]:
    """Every result JSON in ``results_dir`` (not recursive) by bench name, ratios filled in
    where missing. Files that are not results (no ``runs``) are skipped with a warning."""
    results: Dict[str, Dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            log.warning("%s: not JSON, skipped (%s)", path, e)
            continue
        if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
            log.warning("%s: no 'runs' object, skipped", path)
            continue
        if data.get("mode") == "smoke" and not include_smoke:
            log.info("%s: a smoke result, skipped", path)
            continue
        name = str(data.get("bench") or path.stem)
        data["bench"] = name
        data["_path"] = str(path)
        if any("ratio" not in r for r in data["runs"].values() if isinstance(r, dict)):
            preferred, per_ds = BASELINES.get(_family(name), ((), False))
            preferred = preferred or tuple(run_variant(k, r) for k, r in data["runs"].items())
            add_ratios(data, preferred, per_deepspeed=per_ds)
        results[name] = data
    return results


# --------------------------------------------------------------------------- formatting

def _num(value: Optional[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    return "-" if value is None else fmt.format(value) + unit


def _spread(stats: Any, fmt: str, unit: str = "") -> str:
    """``median unit`` (``(min–max)`` when there are several samples)."""
    if not isinstance(stats, Mapping):
        return _num(stats if isinstance(stats, (int, float)) else None, fmt, unit)
    mid = stats.get("median", stats.get("mean"))
    if mid is None:
        return "-"
    text = fmt.format(mid) + unit
    if stats.get("n", 2) > 1 and "min" in stats and "max" in stats:
        text += f" ({fmt.format(stats['min'])}–{fmt.format(stats['max'])})"
    return text


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _error(record: Mapping[str, Any]) -> str:
    text = str(record.get("error") or record.get("reason") or record.get("status") or "failed")
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "failed"
    if record.get("error_where"):
        return f"fails: `{last}` at `{record['error_where']}`"
    if record.get("status") == "not_available":
        return f"not available: {last}"
    return f"fails: `{last}`"


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def _ratio(record: Mapping[str, Any], metric: str = "step_ms") -> Optional[float]:
    return (record.get("ratio") or {}).get(metric)


def _first_step_rows(result: Mapping[str, Any]) -> List[List[str]]:
    """``[DeepSpeed, ours, DeepSpeed's JIT op, ratio]`` per DeepSpeed version, newest first."""
    runs = result["runs"]
    by_ds: Dict[str, Dict[str, Mapping[str, Any]]] = {}
    for key, r in runs.items():
        by_ds.setdefault(str(run_deepspeed(key, r)), {})[run_variant(key, r)] = r
    rows = []
    for ds in sorted(by_ds, key=lambda v: [int(p) if p.isdigit() else -1 for p in v.split(".")],
                     reverse=True):
        ours, theirs = by_ds[ds].get("ours"), by_ds[ds].get("deepspeed-jit")

        def cell(r: Optional[Mapping[str, Any]]) -> str:
            if r is None:
                return "-"
            return _spread(r.get("first_step_s"), "{:.2f}", " s") if run_ok(r) else _error(r)

        if ours and theirs and run_ok(ours) and run_ok(theirs):
            a, b = metric_value(ours, "first_step_s"), metric_value(theirs, "first_step_s")
            ratio = f"{b / a:.1f}x faster" if a and b and b >= a else (
                f"{a / b:.1f}x slower" if a and b else "-")
        elif ours and run_ok(ours) and theirs:
            ratio = "works vs fails"
        elif theirs and run_ok(theirs) and ours:
            ratio = "fails vs works"
        else:
            ratio = "-"
        rows.append([ds, cell(ours), cell(theirs), ratio])
    return rows


def _first_step(result: Mapping[str, Any]) -> List[str]:
    rows = _first_step_rows(result)
    title = ("**Time from `engine.compile()` to the end of the first DeepCompile step** (ZeRO-3, "
             "a frozen\nLinear feeding a trainable one, fp32, fresh extension cache):")
    return [title, ""] + _table(["DeepSpeed", "ds_z3native (prebuilt op, `install()`)",
                                 "DeepSpeed's own op (JIT build)", "ratio"], rows)


def _native_micro(result: Mapping[str, Any]) -> List[str]:
    s = result.get("setup", {})
    rows = []
    for key in sorted(result["runs"], key=lambda k: (k != "ours", k)):
        r = result["runs"][key]
        name = {"ours": "ds_z3native", "deepspeed": "DeepSpeed's op"}.get(key, key)
        if not run_ok(r):
            rows.append([name, _error(r)] + ["-"] * 7)
            continue
        col = r.get("collectives") or {}
        probe = r.get("per_call_us") or {}
        first, later = col.get("first_step") or {}, col.get("later_step") or {}
        pf = col.get("persistent_frozen_allgather_bytes") or {}
        gathers = _num(later.get("allgather_calls"), "{:d}")
        if first.get("allgather_calls") not in (None, later.get("allgather_calls")):
            gathers += f" ({first['allgather_calls']} at step 1)"
        rows.append([name, _spread(r.get("step_ms"), "{:.2f}"), _num(_ratio(r), "{:.2f}", "x"),
                     gathers, f"{_num(later.get('reduce_scatter_calls'), '{:d}')} / "
                     f"{_num(later.get('bucket_flushes'), '{:d}')}",
                     _bytes(later.get("allgather_bytes")),
                     f"{_bytes(pf.get('first_step'))} → {_bytes(pf.get('later_step'))}",
                     f"{_num(probe.get('kept'), '{:.1f}')} / {_num(probe.get('gathered'), '{:.1f}')}",
                     _num(r.get("peak_gib"), "{:.2f}", " GiB")])
    title = (f"**Native reduce/gather microbenchmark** ({s.get('params', '?')} params, "
             f"{s.get('frozen', '?')} frozen, {s.get('persistent', '?')} persistent, one graph, "
             f"{s.get('ranks', '?')} rank(s), {s.get('dtype', '?')}; a step: forward gathers, "
             f"backward gathers + `reduce_grad` + `end_backward`):")
    return [title, ""] + _table(
        ["op", "ms/step (min–max)", "ratio", "all-gathers / step", "reduce-scatters / flushes",
         "all-gather bytes / step", "persistent frozen all-gather bytes: step 1 → later",
         "µs per gather/wait/release: kept / gathered", "peak"], rows)


_LORA_ORDER = ("plain", "none", "upstream", "reentrant", "ours", "dc", "dc-warm", "dc-ckpt",
               "trainer-dc-ckpt", "dc-ckpt-lowmem", "dc-ckpt-lean", "dc-upstream",
               "dc-ckpt-upstream", "dc-ckpt-single", "dc-ckpt-single-reduce-each",
               "dc-ckpt-varlen", "dc-ckpt-single-varlen")
# Each LoRA variant's label in the tables (bench/core/variants.py's VARIANT_TABLE).
_LORA_WHAT = {v.name: v.label for v in VARIANT_TABLE if v.label}


def _lora_speedup(r: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> Optional[str]:
    """Step-time speedup against the same run's eager ZeRO-3 with the same checkpointing
    (``vs`` from lora_llama.py merge), with its peak-memory ratio; where that baseline is not
    the table's row (a later run replaced it), its step time is named. A Trainer-driven run adds
    its step time over that of our own loop's run of the same variant (``vs["own_loop"]``)."""
    vs = r.get("vs") or {}
    ckpt = (r.get("setup") or {}).get("checkpointing")
    base = "none" if ckpt == "none" else "upstream"
    parts = []
    ref = vs.get(base)
    if ref:
        peak = ref.get("peak_ratio")
        ms = ref.get("baseline_ms")
        parts.append(f"{ref['speedup']:.2f}x vs `{base}`"
                     + (f" of its run ({ms:.1f} ms)" if not _own_row(base, r, runs)
                        and isinstance(ms, (int, float)) else "")
                     + (f", peak {peak:.2f}x" if isinstance(peak, (int, float)) else "")
                     + _other_gpu(ref))
    plain = vs.get("plain") or {}
    if isinstance(plain.get("step_ratio"), (int, float)):
        ms = plain.get("baseline_ms")
        parts.append(f"step time {plain['step_ratio']:.2f}x `plain`'s"
                     + (f" of its run ({ms:.1f} ms)" if not _own_row("plain", r, runs)
                        and isinstance(ms, (int, float)) else "")
                     + _other_gpu(plain))
    own = vs.get("own_loop") or {}
    if isinstance(own.get("step_ratio"), (int, float)):
        ms = own.get("baseline_ms")
        parts.append(f"step time {own['step_ratio']:.3f}x `{own['variant']}`'s"
                     + (f" of its run ({ms:.1f} ms)" if not _own_row(own["variant"], r, runs)
                        and isinstance(ms, (int, float)) else "")
                     + _other_gpu(own))
    return "; ".join(parts) or None


def _other_gpu(ratio: Mapping[str, Any]) -> str:
    """A note for a ratio between runs whose timed steps ran on two GPUs (``devices``: 2)."""
    return " (measured on another GPU)" if ratio.get("devices") == 2 else ""


def _own_row(variant: str, r: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the table's row of ``variant`` is from the same run as ``r``."""
    return any(run_variant(k, x) == variant and x.get("run") == r.get("run")
               for k, x in runs.items())


def _lora_keys(runs: Mapping[str, Mapping[str, Any]]) -> List[str]:
    """The keys of LoRA runs in the table's row order: variant, then DeepSpeed version."""
    def order(key: str) -> Any:
        v = run_variant(key, runs[key])
        return (_LORA_ORDER.index(v) if v in _LORA_ORDER else len(_LORA_ORDER), v,
                run_deepspeed(key, runs[key]) or "")
    return sorted(runs, key=order)


def _zero_threshold(r: Mapping[str, Any]) -> str:
    """``, ZeRO-3 persistence threshold N`` where the run's DeepSpeed config sets
    ``stage3_param_persistence_threshold`` (else DeepSpeed's default: nothing to say)."""
    config = (r.get("setup") or {}).get("deepspeed_config") or {}
    threshold = (config.get("zero_optimization") or {}).get("stage3_param_persistence_threshold")
    if threshold is None:
        return ""
    shown = f"{threshold:,}" if isinstance(threshold, int) else str(threshold)  # e.g. "auto"
    return f", ZeRO-3 persistence threshold {shown}"


def _lora(result: Mapping[str, Any]) -> List[str]:
    runs = result["runs"]
    first = next((r for r in runs.values() if r.get("setup")), {})
    s = result.get("setup") or first.get("setup") or {}
    model = s.get("model") or {}
    rows = []

    # The file's baseline is a fallback only for rows that checkpoint as it does (a run without
    # checkpointing is not measured against one with it).
    baseline_ckpt = (runs.get(str(result.get("baseline")), {}).get("setup") or {}).get("checkpointing")
    for key in _lora_keys(runs):
        r = runs[key]
        variant = run_variant(key, r)
        setup = r.get("setup") or {}
        head = [variant, _LORA_WHAT.get(variant, "-"), setup.get("checkpointing", "-"),
                str(run_deepspeed(key, r) or "-")]
        if not run_ok(r):
            rows.append(head + [_error(r)] + ["-"] * 6)
            continue
        share = r.get("peak_share")
        speedup = _lora_speedup(r, runs)
        compile_cell = "-"
        if setup.get("deepcompile"):
            compile_cell = " / ".join(_num(r.get(k), "{:.0f}", " s") for k in (
                "compile_to_first_step_s", "replan_step_s", "wall_to_last_step_s"))
        ratio = _ratio(r)  # step time / the baseline's: its inverse is the speedup
        same_ckpt = baseline_ckpt == setup.get("checkpointing")
        fallback = (f"{1 / ratio:.2f}x vs `{result.get('baseline')}`"
                    if same_ckpt and isinstance(ratio, (int, float)) and ratio > 0 else "-")
        rows.append(head + [_spread(r.get("step_ms"), "{:.1f}"),
                            speedup if speedup is not None else fallback,
                            _num(r.get("tokens_per_s"), "{:,.0f}"),
                            _num(r.get("peak_gib"), "{:.2f}"), _num(r.get("tflops"), "{:.1f}"),
                            _num(None if share is None else 100 * share, "{:.1f}", "%"),
                            compile_cell])
    params = model.get("params")
    title = ("**LoRA fine-tune step** ("
             + (f"{params / 1e9:.2f} B params, " if isinstance(params, (int, float)) else "")
             + (f"LoRA r={model['lora_r']}, " if model.get("lora_r") else "")
             + (f"micro-batch {s['micro_batch']} x {s['seq']} tokens, " if s.get("micro_batch")
                and s.get("seq") else "")
             + f"{s.get('dtype', '?')}, {s.get('world_size', '?')} GPU(s)"
             + "".join(sorted({_zero_threshold(r) for r in runs.values()} - {""}))
             + f", {s.get('device', '?')}; speedup: the same run's eager ZeRO-3 step time with the "
               "same checkpointing over this one):")
    lines = [title, ""] + _table(["variant", "what", "checkpointing", "DeepSpeed",
                                  "ms/step (min–max)", "speedup", "tokens/s", "peak GiB",
                                  "TFLOP/s", "share of bf16 peak",
                                  "compile to end of step 1 / re-plan step / to last step"], rows)
    return lines + _lora_breakdown(runs, result.get("replaced") or [])


def _lora_breakdown(runs: Mapping[str, Mapping[str, Any]],
                    others: Sequence[Mapping[str, Any]] = ()) -> List[str]:
    """Where a step goes, for the runs profiled with ``--trace`` (bench.trace_breakdown): the
    table's runs first, then profiled runs the file keeps beside them (``replaced``: a profiled
    run of another invocation need not be the one the step-time table shows), each named by its
    run label."""
    traced = [(runs[key], run_variant(key, runs[key]), run_deepspeed(key, runs[key]))
              for key in _lora_keys(runs)]
    traced += [(r, run_variant("?", r), run_deepspeed("", r)) for r in others]
    rows = []
    for record, variant, deepspeed in traced:
        split = (record.get("trace") or {}).get("breakdown")
        if not run_ok(record) or not split:
            continue
        launches = split.get("launches") or {}
        # The kinds the run recorded (bench/trace_breakdown.py's), those it launched at all.
        kinds = ", ".join(f"{k} {n:.0f}" for k, n in launches.items() if k != "total" and n)
        host = split.get("host_ms") or {}
        share = split.get("device_busy_share")
        rows.append([variant, str(deepspeed or "-"), str(record.get("run") or "-"),
                     _num((record.get("step_ms") or {}).get("median"), "{:.1f}"),
                     _num(split.get("wall_ms"), "{:.1f}"),
                     _num(split.get("device_busy_ms"), "{:.1f}"),
                     _num(None if share is None else 100 * share, "{:.0f}", "%"),
                     _num(launches.get("total"), "{:,.0f}") + (f" ({kinds})" if kinds else ""),
                     _num(host.get("dc_ops"), "{:.1f}"), _num(host.get("graph_wrapper"), "{:.1f}"),
                     _num(sum((split.get("dc_calls") or {}).values()) or None, "{:,.0f}"),
                     _idle_cell(split.get("device_idle"))])
    if not rows:
        return []
    return ["", "**Where a step goes** (`--trace`: two more steps under torch.profiler after the "
            "timed ones; per step, profiler overhead included, next to the run's median step "
            "without the profiler; host times are the CPU's time inside the dc ops and inside "
            "inductor's compiled graphs other than dc ops):", ""] + \
        _table(["variant", "DeepSpeed", "run", "ms/step", "ms/step profiled", "device busy ms",
                "device busy", "launches (by kind)", "host ms in dc ops",
                "host ms in graph wrapper", "dc op calls",
                "device idle ms (host in forward / backward / optimizer step / other)"], rows)


def _idle_cell(idle: Optional[Mapping[str, Any]]) -> str:
    """The device's idle ms per step, by the phase the host was in (bench.trace_breakdown's
    ``device_idle``; traces from before the phases were marked have none)."""
    if not idle:
        return "-"
    phases = idle.get("by_phase") or {}
    return f"{idle['ms']:.1f} (" + " / ".join(
        f"{phases.get(k, 0.0):.1f}" for k in ("forward", "backward", "optimizer_step", "other")) + ")"


def _lengths_cell(r: Mapping[str, Any]) -> str:
    """A LoRA run's lengths: the draw of a varlen run, else its fixed tokens per row."""
    setup = r.get("setup") or {}
    lengths = setup.get("lengths")
    if not lengths:
        return f"{setup.get('seq', '?')} (fixed)"
    step = f", step {lengths['step']}" if lengths.get("step", 1) != 1 else ""
    return (f"uniform {lengths.get('min')}–{lengths.get('max')}{step} "
            f"(mean {_num(lengths.get('mean'), '{:g}')})")


def _compiles_cell(r: Mapping[str, Any]) -> str:
    """Dynamo's graphs over the run and the steps (1-based) that compiled one."""
    graphs = r.get("dynamo_graphs")
    if not isinstance(graphs, int):
        return "-"
    steps = [i + 1 for i in r.get("compile_steps") or []]
    return f"{graphs}" + (f" (step{'s' if len(steps) > 1 else ''} "
                          f"{', '.join(map(str, steps))})" if steps else "")


def _vs_fixed(r: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> str:
    """A varlen run's time per token over its fixed-length run's (``vs["fixed"]`` from
    lora_llama.py merge), naming that run's time where it is not the table's row."""
    ref = (r.get("vs") or {}).get("fixed") or {}
    ratio = ref.get("token_time_ratio")
    if not isinstance(ratio, (int, float)):
        return "-"
    base = ref.get("baseline_us_per_token")
    steady = ref.get("steady_ratio")
    return (f"{ratio:.3f}x `{ref['variant']}`'s"
            + (f" of its run ({base:.2f} µs)" if not _own_row(ref["variant"], r, runs)
               and isinstance(base, (int, float)) else "")
            + (f" ({steady:.3f}x without the timed steps that compiled)"
               if isinstance(steady, (int, float)) and abs(steady - ratio) > 5e-4 else "")
            + _other_gpu(ref))


def _lora_varlen(result: Mapping[str, Any]) -> List[str]:
    """DeepCompile on lengths drawn per step against its base variant at their mean, per token
    (``bench/lora_llama.py``'s varlen variants)."""
    runs = result["runs"]
    first = next((r for r in runs.values() if r.get("setup")), {})
    s = result.get("setup") or first.get("setup") or {}
    model = s.get("model") or {}
    rows = []
    for key in _lora_keys(runs):
        r = runs[key]
        variant = run_variant(key, r)
        setup = r.get("setup") or {}
        head = [variant, _lengths_cell(r), str(run_deepspeed(key, r) or "-")]
        if not run_ok(r):
            rows.append(head + [_error(r)] + ["-"] * 8)
            continue
        n = (r.get("step_ms") or {}).get("n")
        tokens = r.get("timed_tokens")
        steady = r.get("us_per_token_steady")
        us = r.get("us_per_token")
        compiles = r.get("deepcompile_compiles") or {}
        rows.append(head + [
            f"{len(r.get('step_s_all') or [])} ({_num(n, '{:d}')})",
            _num(tokens / n if isinstance(tokens, (int, float)) and n else None, "{:,.0f}"),
            _num(us, "{:.2f}") + (f" ({steady:.2f} steady)" if isinstance(steady, (int, float))
                                  and isinstance(us, (int, float)) and abs(steady - us) > 5e-3
                                  else ""),
            _vs_fixed(r, runs),
            _spread(r.get("step_ms"), "{:.1f}"),
            _compiles_cell(r),
            (f"{compiles['fwd']} / {compiles['bwd']}" if compiles else "-"),
            _num(r.get("peak_gib"), "{:.2f}"),
            " / ".join(_num(r.get(k), "{:.0f}", " s") for k in (
                "compile_to_first_step_s", "wall_to_last_step_s")) if setup.get("deepcompile")
            else "-"])
    params = model.get("params")
    rows_kind = {(r.get("setup") or {}).get("rows", "full") for r in runs.values()} - {None}
    title = ("**DeepCompile on batches of varying length** ("
             + (f"{params / 1e9:.2f} B params, " if isinstance(params, (int, float)) else "")
             + (f"LoRA r={model['lora_r']}, " if model.get("lora_r") else "")
             + f"micro-batch {s.get('micro_batch', '?')}, "
             + ("each row a collator-padded row of the step's length"
                if rows_kind == {"padded"} else "every row the step's length (no padding)")
             + f", {s.get('dtype', '?')}, {s.get('world_size', '?')} GPU(s), "
             + f"{s.get('device', '?')}; each varlen run against its base variant at the "
               "lengths' mean in the same run; µs per token: the timed steps' time over their "
               "tokens; steady: without the timed steps that compiled):")
    return [title, ""] + _table(
        ["variant", "tokens per row", "DeepSpeed", "steps (timed)", "tokens per timed step",
         "µs per token", "time per token vs fixed length", "ms/step (min–max)",
         "Dynamo graphs (steps that compiled)", "DeepCompile compiles (fwd / bwd)", "peak GiB",
         "compile to end of step 1 / to last step"], rows)


def _generic(result: Mapping[str, Any]) -> List[str]:
    rows = []
    for key, r in sorted(result["runs"].items()):
        if not run_ok(r):
            rows.append([key, _error(r), "-", "-"])
            continue
        rows.append([key, _spread(r.get("step_ms"), "{:.2f}"), _num(_ratio(r), "{:.2f}", "x"),
                     _num(metric_value(r, "peak_gib"), "{:.2f}", " GiB")])
    return [f"**{result['bench']}** (baseline `{result.get('baseline')}`):", ""] + _table(
        ["run", "ms/step (min–max)", "ratio", "peak"], rows)


# compile_scaling: torch's compile-time counters shown per phase (whichever this torch names).
_PHASES = (("Dynamo, all", "_compile.compile_inner"),
           ("backend", "OutputGraph.call_user_compiler"),
           ("AOTAutograd", "create_aot_dispatcher_function"),
           ("inductor", "compile_fx_inner"))


def _scaling_run(result: Mapping[str, Any], variant: str, layers: int) -> Optional[Mapping[str, Any]]:
    """The ``compile_scaling`` run of ``variant`` (``ours-cold``...) at ``layers``."""
    return result["runs"].get(f"{variant}-{layers}l")


def _scaling_cell(r: Optional[Mapping[str, Any]]) -> str:
    """A run's seconds to the end of step 1 / of its re-plan step / to the last step."""
    if r is None:
        return "-"
    if not run_ok(r):
        return _error(r)
    return " / ".join(_num(metric_value(r, k), "{:.0f}") for k in (
        "compile_to_first_step_s", "replan_step_s", "wall_to_last_step_s")) + " s"


def _scaling_ratio(a: Optional[Mapping[str, Any]], b: Optional[Mapping[str, Any]]) -> str:
    """``a``'s wall time to the last step over ``b``'s, where both are of one run label."""
    ratio = same_run_ratio(a, b, "wall_to_last_step_s")
    return "-" if ratio is None else f"{ratio:.2f}x"


def _params(n: Any) -> str:
    """A parameter count in B (M below 0.1 B)."""
    if not isinstance(n, (int, float)):
        return "-"
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _scaling_checkpointing(result: Mapping[str, Any]) -> Tuple[str, str]:
    """A ``compile_scaling`` result's checkpointing (ours, DeepSpeed's): one name for both in
    older results, one each where DeepSpeed's baseline runs without it."""
    ckpt = (result.get("setup") or {}).get("checkpointing", "?")
    if isinstance(ckpt, Mapping):
        return str(ckpt.get("ours", "?")), str(ckpt.get("deepspeed", "?"))
    return str(ckpt), str(ckpt)


def _ckpt_words(mode: str) -> str:
    return "without checkpointing" if mode == "none" else f"{mode} checkpointing"


def _compile_scaling(result: Mapping[str, Any]) -> List[str]:
    runs = result["runs"]
    s = result.get("setup") or {}
    model = s.get("model") or {}
    last = s.get("last_step", "?")
    depths = sorted({int(r["layers"]) for r in runs.values()
                     if isinstance(r.get("layers"), int)})
    # The single-cycle columns only where the result holds such a run.
    single = any(r.get("variant") == "ours-single" for r in runs.values())
    single_warm = any(r.get("variant") == "ours-single-warm" for r in runs.values())
    rows = []
    for n in depths:
        cold, warm, one, one_warm, theirs = (
            _scaling_run(result, v, n) for v in
            ("ours-cold", "ours-warm", "ours-single", "ours-single-warm", "deepspeed-cold"))
        params = next((((r.get("setup") or {}).get("model") or {}).get("params")
                       for r in (cold, warm, one, one_warm, theirs) if r and r.get("setup")),
                      None)
        phases = ((cold or {}).get("compile_seconds") or {}).get("to_last_step") or {}
        # A row whose runs come from more than one invocation names each cell's run label
        # (ratios are only taken within one).
        labels = {r.get("run") for r in (cold, warm, one, one_warm, theirs)
                  if r and r.get("run")}

        def cell(r: Optional[Mapping[str, Any]]) -> str:
            text = _scaling_cell(r)
            return f"{text} ({r['run']})" if r and r.get("run") and len(labels) > 1 else text

        rows.append([str(n), _params(params), cell(cold), cell(warm),
                     *([cell(one)] if single else []),
                     *([cell(one_warm)] if single_warm else []), cell(theirs),
                     _scaling_ratio(cold, theirs), _scaling_ratio(warm, theirs),
                     *([_scaling_ratio(one, theirs)] if single else []),
                     *([_scaling_ratio(one_warm, theirs)] if single_warm else []),
                     " / ".join(_num(phases.get(key), "{:.0f}") for _, key in _PHASES)
                     if cold and run_ok(cold) else "-"])
    ckpt_ours, ckpt_theirs = _scaling_checkpointing(result)
    shape = ", ".join(f"{label} {model[key]}" for label, key in (
        ("hidden", "hidden_size"), ("MLP", "intermediate_size"), ("heads", "num_attention_heads"),
        ("vocab", "vocab_size")) if key in model)
    title = ("**DeepCompile's time to a steady state against depth** (the "
             + ("1 B LoRA shape" if s.get("size") == "1b" else f"`{s.get('size', '?')}` shape")
             + (f", {shape}" if shape else "") + ", at each depth; `dc-ckpt`: DeepCompile, "
             f"{ckpt_ours} checkpointing, LoRA r={model.get('lora_r', '?')}, "
             f"micro-batch {s.get('micro_batch', '?')} x {s.get('seq', '?')} tokens, "
             f"{s.get('dtype', '?')}, one {s.get('device', '?')}; a cell: seconds from "
             f"`engine.compile()` to the end of step 1 / the re-plan step (step 6) alone / from "
             f"`engine.compile()` to the end of step {last}):")
    return [title, ""] + _table(
        ["layers", "params", "ds_z3native, cold", "ds_z3native, warm (cache and profile store "
         "of the cold run)",
         *(["ds_z3native, single cycle, cold"] if single else []),
         *(["ds_z3native, single cycle, warm (cache and profile store of the single-cycle run)"]
           if single_warm else []),
         "DeepSpeed alone, cold" + (f" ({_ckpt_words(ckpt_theirs)})" if ckpt_theirs != ckpt_ours
                                    else ""),
         f"ours cold / DeepSpeed's, to step {last}",
         f"ours warm / DeepSpeed's cold, to step {last}",
         *([f"ours single cycle / DeepSpeed's cold, to step {last}"] if single else []),
         *([f"ours single cycle warm / DeepSpeed's cold, to step {last}"] if single_warm
           else []),
         "ours cold, torch compile_times to step " + str(last) + ": "
         + " / ".join(label for label, _ in _PHASES) + " (s)"], rows)


def _group_rows(result: Mapping[str, Any]) -> List[Tuple[str, Mapping[str, Any]]]:
    """persistent_group's runs, ungrouped first: (variant, record)."""
    runs = result["runs"]
    keys = sorted(runs, key=lambda k: (run_variant(k, runs[k]) != "dc-ckpt-ungrouped", k))
    return [(run_variant(k, runs[k]), runs[k]) for k in keys]


def _persistent_group(result: Mapping[str, Any]) -> List[str]:
    """Params kept gathered reached by one call per graph (``dc-ckpt``) against DeepSpeed's three
    calls per use (``dc-ckpt-ungrouped``), the same run."""
    rows = []
    s = result.get("setup") or {}
    for variant, r in _group_rows(result):
        if not run_ok(r):
            rows.append([variant, _error(r)] + ["-"] * 7)
            continue
        vs = (r.get("vs") or {}).get("ungrouped") or {}
        host = r.get("host_ms") or {}
        split = (r.get("trace") or {}).get("breakdown") or {}
        calls = split.get("dc_calls") or {}
        rows.append([
            variant, "one call per graph" if (r.get("setup") or {}).get("group_persistent")
            else "DeepSpeed's: three per use",
            _spread(r.get("step_ms"), "{:.1f}"),
            _num(vs.get("step_ratio"), "{:.2f}", "x"),
            " / ".join(_num(host.get(k), "{:.1f}") for k in ("forward", "backward", "step")),
            _num(sum(calls.values()) or None, "{:,.0f}"),
            _num(r.get("peak_gib"), "{:.2f}"), str(r.get("run") or "-")])
    params = (s.get("model") or {}).get("params")
    title = ("**Params kept gathered, one call per graph** (DeepCompile + ds_z3native, "
             + (f"{params / 1e9:.2f} B params ({s.get('layers')} layers of the 1 B shape), "
                if isinstance(params, (int, float)) else "")
             + f"checkpointing: {s.get('checkpointing', '?')}, {s.get('world_size', '?')} GPU, "
             + f"{s.get('device', '?')}; ratio: step time over the same run's ungrouped one):")
    header = ["variant", "kept-gathered params reached by", "ms/step (min–max)", "ratio",
              "host ms per step: forward / backward / step", "dc op calls per step (profiled)",
              "peak GiB", "run"]
    return [title, ""] + _table(header, rows)


def _summary_persistent_group(result: Mapping[str, Any]) -> List[List[str]]:
    rows = dict(_group_rows(result))
    grouped, weak = rows.get("dc-ckpt"), rows.get("dc-ckpt-ungrouped")
    if not (grouped and weak and run_ok(grouped) and run_ok(weak)):
        return []
    s = grouped.get("setup") or {}
    host = ((grouped.get("vs") or {}).get("ungrouped") or {}).get("host_ms_ratio") or {}
    params = (s.get("model") or {}).get("params")
    return [[f"DeepCompile step, params kept gathered, {params / 1e9:.2f} B Llama "
             f"({s.get('layers')} layers), 1 GPU, checkpointing: {s.get('checkpointing')}",
             f"`dc-ckpt`, one gather_persistent call per graph: "
             f"{_num(metric_value(grouped, 'step_ms'), '{:.1f}')} ms",
             f"`dc-ckpt-ungrouped`, DeepSpeed's three dc op calls per use: "
             f"{_num(metric_value(weak, 'step_ms'), '{:.1f}')} ms",
             f"{_num(grouped.get('ratio'), '{:.2f}')}x the step time"
             + (f" (the unchanged optimizer step: {host['step']:.2f}x, the host's share)"
                if isinstance(host.get("step"), (int, float)) else ""),
             _measured(result, grouped, gpus=1)]]


_FORMATTERS: Dict[str, Callable[[Mapping[str, Any]], List[str]]] = {
    "deepcompile_first_step": _first_step, "native_micro": _native_micro,
    "lora_llama": _lora, "lora_llama_varlen": _lora_varlen, "persistent_group": _persistent_group,
    "compile_scaling": _compile_scaling}


def render_block(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The markdown between the markers (without them): one titled table per benchmark."""
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    sections = []
    for n in names:
        lines = _FORMATTERS.get(_family(n), _generic)(results[n])
        if results[n].get("note"):  # how and where the numbers were taken
            lines += ["", f"_{results[n]['note']}_"]
        sections.append("\n".join(lines))
    if not sections:
        return "No benchmark results yet: run `python -m bench all` on a GPU machine."
    return "\n\n".join(sections)


# --------------------------------------------------------------------------- summary

_DATE = re.compile(r"\d{4}-\d\d-\d\d")


def _measured(result: Mapping[str, Any], record: Optional[Mapping[str, Any]] = None,
              gpus: Any = None) -> str:
    """When and on what a summary row was measured: the run's date (its run label, else the
    result file's), the GPU model and how many."""
    date = _DATE.match(str((record or {}).get("run") or ""))
    date = date or _DATE.match(str(result.get("created") or ""))
    device = ((record or {}).get("setup") or {}).get("device") or (
        result.get("setup") or {}).get("device") or (result.get("versions") or {}).get("device")
    parts = [date.group(0)] if date else []
    if device:
        parts.append(f"{gpus} x {device}" if gpus else str(device))
    return ", ".join(parts) or "-"


def _summary_first_step(result: Mapping[str, Any]) -> List[List[str]]:
    return [[f"DeepCompile, `engine.compile()` to the end of step 1, DeepSpeed {ds}",
             ours, theirs + " (DeepSpeed's own op, JIT build)" if theirs != "-" else "-", ratio,
             _measured(result, gpus=1)]
            for ds, ours, theirs, ratio in _first_step_rows(result)]


def _summary_native_micro(result: Mapping[str, Any]) -> List[List[str]]:
    runs, base = result["runs"], result.get("baseline")
    ours, theirs = runs.get("ours"), runs.get(str(base))
    if not ours or not theirs or not run_ok(ours) or not run_ok(theirs):
        return []
    s = result.get("setup") or {}
    ratio = _ratio(ours)
    return [[f"Native reduce/gather microbenchmark ({s.get('params', '?')} params, "
             f"{s.get('frozen', '?')} frozen)",
             f"{_num(metric_value(ours, 'step_ms'), '{:.2f}')} ms/step",
             f"{_num(metric_value(theirs, 'step_ms'), '{:.2f}')} ms/step (DeepSpeed's op)",
             f"{1 / ratio:.2f}x faster ({ratio:.2f}x the step time)"
             if isinstance(ratio, (int, float)) and ratio > 0 else "-",
             _measured(result, gpus=s.get("ranks"))]]


def _summary_lora(result: Mapping[str, Any]) -> List[List[str]]:
    """Per baseline (``none``: no checkpointing, ``upstream``: checkpointing), the ds_z3native
    variant with the highest speedup over that baseline's row of the same run."""
    runs = result["runs"]
    first = next((r for r in runs.values() if r.get("setup")), {})
    s = result.get("setup") or first.get("setup") or {}
    params = (s.get("model") or {}).get("params")
    size = f"{params / 1e9:.2f} B Llama, " if isinstance(params, (int, float)) else ""
    best: Dict[str, Tuple[float, str]] = {}
    for key in _lora_keys(runs):
        r = runs[key]
        variant = run_variant(key, r)
        if not run_ok(r) or "ds_z3native" not in _LORA_WHAT.get(variant, ""):
            continue
        ckpt = (r.get("setup") or {}).get("checkpointing")
        base = "none" if ckpt == "none" else "upstream"
        ref = (r.get("vs") or {}).get(base) or {}
        speedup = ref.get("speedup")
        if isinstance(speedup, (int, float)) and _own_row(base, r, runs) and (
                base not in best or speedup > best[base][0]):
            best[base] = (speedup, key)
    rows = []
    for base in ("upstream", "none"):
        if base not in best:
            continue
        speedup, key = best[base]
        r = runs[key]
        variant = run_variant(key, r)
        ref_key = next(k for k, x in runs.items()
                       if run_variant(k, x) == base and x.get("run") == r.get("run"))
        ref = runs[ref_key]
        peak = ((r.get("vs") or {}).get(base) or {}).get("peak_ratio")
        ckpt = (r.get("setup") or {}).get("checkpointing", "-")
        ws = (r.get("setup") or {}).get("world_size") or s.get("world_size")
        rows.append([
            f"LoRA fine-tune step, {size}{ws} GPU{'' if ws == 1 else 's'}, checkpointing: {ckpt}"
            + _zero_threshold(r),
            f"`{variant}` ({_LORA_WHAT[variant]}): {_num(metric_value(r, 'step_ms'), '{:.1f}')} ms,"
            f" {_num(r.get('peak_gib'), '{:.2f}')} GiB",
            f"`{base}` ({_LORA_WHAT.get(base, '-')}): "
            f"{_num(metric_value(ref, 'step_ms'), '{:.1f}')} ms, "
            f"{_num(ref.get('peak_gib'), '{:.2f}')} GiB",
            f"{speedup:.2f}x faster" + (f", peak {peak:.2f}x" if isinstance(peak, (int, float))
                                        else ""),
            _measured(result, r, gpus=ws)])
    rows += _summary_plain(result, size)
    rows += _summary_trainer(result, size)
    return rows


def _summary_plain(result: Mapping[str, Any], size: str) -> List[List[str]]:
    """The ds_z3native run with the lowest step time over plain PyTorch's (no ZeRO, no
    checkpointing) of the same run (``vs["plain"]``), among the table's runs and those the file
    keeps beside them (``replaced``: a profiled run); no row without such a ratio."""
    records = [(run_variant(key, r), r) for key, r in result["runs"].items()]
    records += [(str(r.get("variant")), r) for r in result.get("replaced") or []]
    best: Optional[Tuple[float, str, Mapping[str, Any]]] = None
    for variant, r in records:
        ratio = ((r.get("vs") or {}).get("plain") or {}).get("step_ratio")
        if (run_ok(r) and "ds_z3native" in _LORA_WHAT.get(variant, "")
                and isinstance(ratio, (int, float)) and (best is None or ratio < best[0])):
            best = (ratio, variant, r)
    if best is None:
        return []
    ratio, variant, r = best
    plain = r["vs"]["plain"]
    peak = plain.get("peak_ratio")
    ws = (r.get("setup") or {}).get("world_size") or 1
    ckpt = (r.get("setup") or {}).get("checkpointing", "-")
    return [[f"LoRA fine-tune step against unsharded PyTorch, {size}{ws} GPU"
             f"{'' if ws == 1 else 's'}, checkpointing: {ckpt}{_zero_threshold(r)}",
             f"`{variant}` ({_LORA_WHAT[variant]}): {_num(metric_value(r, 'step_ms'), '{:.1f}')} ms,"
             f" {_num(r.get('peak_gib'), '{:.2f}')} GiB",
             "`plain` (PyTorch, no ZeRO, no checkpointing): "
             f"{_num(plain.get('baseline_ms'), '{:.1f}')} ms",
             f"{ratio:.2f}x the step time" + (f", peak {peak:.2f}x" if isinstance(peak, (int, float))
                                             else "") + _other_gpu(plain),
             _measured(result, r, gpus=ws)]]


def _summary_trainer(result: Mapping[str, Any], size: str) -> List[List[str]]:
    """A row per HF Trainer variant measured against our own loop's run of the same variant in
    the same run (``vs["own_loop"]``)."""
    rows = []
    for key in _lora_keys(result["runs"]):
        r = result["runs"][key]
        own = (r.get("vs") or {}).get("own_loop") or {}
        ratio = own.get("step_ratio")
        if not run_ok(r) or not isinstance(ratio, (int, float)):
            continue
        variant = run_variant(key, r)
        ws = (r.get("setup") or {}).get("world_size") or 1
        ckpt = (r.get("setup") or {}).get("checkpointing", "-")
        rows.append([
            f"LoRA fine-tune step through HF Trainer, {size}{ws} GPU{'' if ws == 1 else 's'}, "
            f"checkpointing: {ckpt}{_zero_threshold(r)}",
            f"`{variant}` ({_LORA_WHAT.get(variant, '-')}): "
            f"{_num(metric_value(r, 'step_ms'), '{:.1f}')} ms",
            f"`{own.get('variant', '?')}` (our own loop): "
            f"{_num(own.get('baseline_ms'), '{:.1f}')} ms",
            f"{ratio:.2f}x the step time" + _other_gpu(own),
            _measured(result, r, gpus=ws)])
    return rows


def _summary_lora_varlen(result: Mapping[str, Any]) -> List[List[str]]:
    """A row per varlen run with its fixed-length run of the same invocation as the table's row:
    time per token on lengths drawn per step against the base variant's at their mean."""
    rows = []
    runs = result["runs"]
    for key in _lora_keys(runs):
        r = runs[key]
        ref = (r.get("vs") or {}).get("fixed") or {}
        ratio = ref.get("token_time_ratio")
        if (not run_ok(r) or not isinstance(ratio, (int, float))
                or not _own_row(ref.get("variant", ""), r, runs)):
            continue
        variant = run_variant(key, r)
        setup = r.get("setup") or {}
        lengths = setup.get("lengths") or {}
        params = (setup.get("model") or {}).get("params")
        ws = setup.get("world_size") or 1
        steps = len(r.get("step_s_all") or [])
        rows.append([
            f"DeepCompile LoRA step on lengths uniform in {lengths.get('min')}–"
            f"{lengths.get('max')} (dynamic shapes), "
            + (f"{params / 1e9:.2f} B Llama, " if isinstance(params, (int, float)) else "")
            + f"{ws} GPU{'' if ws == 1 else 's'}, checkpointing: {setup.get('checkpointing', '-')}",
            f"`{variant}`: {_num(r.get('us_per_token'), '{:.2f}')} µs per token, "
            f"{_num(r.get('dynamo_graphs'), '{:d}')} Dynamo graphs in {steps} steps",
            f"`{ref['variant']}` at {setup.get('seq', '?')} tokens per row: "
            f"{_num(ref.get('baseline_us_per_token'), '{:.2f}')} µs per token",
            f"{ratio:.2f}x the time per token" + _other_gpu(ref),
            _measured(result, r, gpus=ws)])
    return rows


def _summary_compile_scaling(result: Mapping[str, Any]) -> List[List[str]]:
    """At the run's deepest depth: our cold, warm and single-cycle wall time to the last step
    against DeepSpeed's op's cold one, each where the summary has it (runs of one label). Where
    no run of ours shares DeepSpeed's label, the times of ours of one label (the label of the
    last of cold, warm, single cycle that finished) with no ratio, the labels named; no row
    without DeepSpeed's run or any of ours."""
    summary = result.get("summary") or {}
    n = summary.get("layers")
    theirs = _scaling_run(result, "deepspeed-cold", n) if isinstance(n, int) else None
    wall = "wall_to_last_step_s"
    ours = []  # (what, run, ratio)
    others = []  # runs of ours that finished, of another label than DeepSpeed's
    for variant, what, key in (("ours-cold", "cold", "cold_vs_deepspeed"),
                               ("ours-warm", "warm", "warm_vs_deepspeed"),
                               ("ours-single", "single cycle (cold)", "single_vs_deepspeed"),
                               ("ours-single-warm", "single cycle (warm)",
                                "single_warm_vs_deepspeed")):
        r = _scaling_run(result, variant, n) if isinstance(n, int) else None
        ratio = summary.get(key)
        if r is not None and isinstance(ratio, (int, float)):
            ours.append((what, r, ratio))
        elif r is not None and run_ok(r):
            others.append((what, r))
    if theirs is None or not run_ok(theirs) or not (ours or others):
        return []
    ckpt_ours, ckpt_theirs = _scaling_checkpointing(result)
    last = (result.get("setup") or {}).get("last_step", "?")
    measured = _measured(result, theirs, gpus=1)
    if ours:
        shown = ", ".join(f"{_num(metric_value(r, wall), '{:.0f}')} s {what}" for what, r, _ in ours)
        verdict = (", ".join(f"{ratio:.2f}x {what.split(' (')[0]}" for what, _, ratio in ours)
                   + " (wall time)")
    else:
        label = others[-1][1].get("run")
        shown = ", ".join(f"{_num(metric_value(r, wall), '{:.0f}')} s {what}"
                          for what, r in others if r.get("run") == label) + f", run {label}"
        verdict = f"no ratio: not one run (DeepSpeed's: run {theirs.get('run')})"
        # Two runs, maybe two machines: each named.
        measured = (f"ours: {_measured(result, others[-1][1], gpus=1)}; DeepSpeed's: "
                    f"{measured}")
    return [[f"DeepCompile, `engine.compile()` to the end of step {last}, {n} layers of the "
             f"1 B LoRA shape, checkpointing",
             shown,
             f"{_num(metric_value(theirs, wall), '{:.0f}')} s (DeepSpeed's own op, cold"
             + (f", {_ckpt_words(ckpt_theirs)})" if ckpt_theirs != ckpt_ours else ")"),
             verdict,
             measured]]


_SUMMARIES: Dict[str, Callable[[Mapping[str, Any]], List[List[str]]]] = {
    "deepcompile_first_step": _summary_first_step, "native_micro": _summary_native_micro,
    "lora_llama": _summary_lora, "lora_llama_varlen": _summary_lora_varlen,
    "persistent_group": _summary_persistent_group, "compile_scaling": _summary_compile_scaling}


def _one_row_per_claim(rows: List[List[str]]) -> List[List[str]]:
    """Rows that make the same claim (the same benchmark column: one job measured on several
    machines or days) reduced to the latest measurement (the measured column opens with its
    date), in the place of the first; the others stay in docs/benchmarks.md's tables."""
    latest: Dict[str, List[str]] = {}
    for row in rows:
        kept = latest.get(row[0])
        if kept is None or row[4][:10] > kept[4][:10]:
            latest[row[0]] = row
    seen: set = set()
    out = []
    for row in rows:
        if row[0] not in seen:
            seen.add(row[0])
            out.append(latest[row[0]])
    return out


def render_summary(results: Mapping[str, Mapping[str, Any]], tables: str = "docs/benchmarks.md"
                   ) -> str:
    """The README's summary (without the markers): a few headline rows, each ds_z3native's best
    variant of a benchmark against its baseline measured in the same run; ``tables`` is the link
    to the full tables."""
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    rows = _one_row_per_claim(
        [row for n in names for row in _SUMMARIES.get(_family(n), lambda r: [])(results[n])])
    if not rows:
        return "No benchmark results yet: run `python -m bench all` on a GPU machine."
    link = f"[{tables}]({tables})"
    return "\n".join(_table(["benchmark", "ds_z3native", "baseline (same run)", "result",
                              "measured"], rows)
                      + ["", f"Every table, its setup and how it was measured: {link}."])


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the content between the markers replaced by ``block`` (one blank line on
    each side); ValueError when the markers are missing or out of order."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < 0 or stop < start:
        raise ValueError(f"the file needs the markers {begin} ... {end} (in this order)")
    return text[:start + len(begin)] + "\n\n" + block.strip("\n") + "\n\n" + text[stop:]


def update_readme(readme: Path, block: str, begin: str = BEGIN, end: str = END) -> bool:
    """Rewrite the block between ``begin`` and ``end`` in ``readme`` (README.md or
    docs/benchmarks.md); True when the file changed."""
    old = readme.read_text()
    new = replace_block(old, block, begin, end)
    if new != old:
        readme.write_text(new)
    return new != old


# --------------------------------------------------------------------------- plot

def _plot_rows(results: Mapping[str, Mapping[str, Any]]
               ) -> List[Tuple[str, str, List[Tuple[str, float]], List[Tuple[str, float]]]]:
    rows = []
    for name in [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER):
        runs = results[name]["runs"]
        metric, label = (("first_step_s", "s to end of first step")
                         if name == "deepcompile_first_step" else
                         ("us_per_token", "µs / token") if _family(name) == "lora_llama_varlen"
                         else ("step_ms", "ms / step"))
        # LoRA bars in the table's row order (eager first, then DeepCompile); others by name.
        keys = (_lora_keys(runs) if _FORMATTERS.get(_family(name)) in (_lora, _lora_varlen)
                else sorted(runs))
        times = [(k, v) for k in keys if run_ok(runs[k])
                 for v in [metric_value(runs[k], metric)] if v is not None]
        peaks = [(k, v) for k in keys if run_ok(runs[k])
                 for v in [metric_value(runs[k], "peak_gib")] if v is not None]
        if times or peaks:
            rows.append((name, label, times, peaks))
    return rows


def plot_summary(results: Mapping[str, Mapping[str, Any]], path: Path) -> Optional[Path]:
    """Bar charts of step time and peak memory per variant, one row per benchmark, to ``path``;
    None (and a logged message) when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written (pip install matplotlib, or "
                    "pip install --no-build-isolation -e \".[bench]\")")
        return None
    rows = _plot_rows(results)
    if not rows:
        log.warning("no successful runs to plot")
        return None
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.2 * len(rows)), squeeze=False)
    for (name, label, times, peaks), (ax_t, ax_m) in zip(rows, axes):
        for ax, data, ylabel in ((ax_t, times, label), (ax_m, peaks, "peak GiB")):
            if data:
                ax.bar(range(len(data)), [v for _, v in data], color="#4c72b0")
                ax.set_xticks(range(len(data)))
                ax.set_xticklabels([k for k, _ in data], rotation=20, ha="right", fontsize=8)
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_xticks([])
            ax.set_ylabel(ylabel)
            ax.set_title(f"{name}: {ylabel}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- CLI

def main(argv: Optional[List[str]] = None) -> int:
    """``python -m bench.report``: exit 0, or 1 when ``--check`` finds a block stale."""
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--readme", type=Path, default=ROOT / "README.md",
                   help="the file whose summary block is rewritten (default README.md)")
    p.add_argument("--tables", type=Path, default=TABLES,
                   help="the file whose full-table block is rewritten (default docs/benchmarks.md)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG to write (default <results-dir>/summary.png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--include-smoke", action="store_true", help="also read smoke results")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a block is stale")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    results = load_results(args.results_dir, args.include_smoke)
    link = Path(os.path.relpath(args.tables.resolve(), args.readme.resolve().parent)).as_posix()
    blocks = [(args.tables, render_block(results), BEGIN, END, "tables"),
              (args.readme, render_summary(results, link), SUMMARY_BEGIN, SUMMARY_END, "summary")]
    if args.check:
        stale = False
        for path, block, begin, end, what in blocks:
            text = path.read_text()
            here = replace_block(text, block, begin, end) != text
            stale = stale or here
            print(f"{path}: {what} "
                  + ("stale, run python -m bench.report" if here else "up to date"))
        return 1 if stale else 0
    for path, block, begin, end, what in blocks:
        changed = update_readme(path, block, begin, end)
        print(f"{path}: {what} block {'updated' if changed else 'unchanged'} "
              f"({len(results)} result file(s))")
    if not args.no_plot:
        out = plot_summary(results, args.plot or args.results_dir / "summary.png")
        print(f"plot: {out}" if out else "plot: not written (see the message above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
