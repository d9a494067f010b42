"""The CLI behind ``python -m bench <name|all|list> [--smoke] [--output-dir DIR] [--dry-run]``
(and ``ds-z3native bench``). Every benchmark has

* a GPU command builder (``Benchmark.commands``): the processes that produce its numbers on a
  CUDA machine (``--dry-run`` prints them); ``Benchmark.run`` runs them and collects one result;
* a ``--smoke`` mode (``Benchmark.smoke``): the same code at toy size on CPU (gloo), which CI runs
  to show that it runs (its timings mean nothing).

Each writes ``<output-dir>/<name>.json`` (format: ``bench.core.schema``); a full run into
``bench/results`` then regenerates the report (``bench.report``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from bench.benchmarks import registry
from bench.benchmarks.compile_scaling import ALL_KINDS as SCALING_KINDS
from bench.benchmarks.lora_llama import check_lora_variants
from bench.core.registry import BenchContext, Benchmark, contexts_for, finish_result
from bench.core.schema import RESULTS_DIR, SMOKE_DIR, metric_value, run_ok, write_result
from bench.core.variants import VARIANTS as LORA_VARIANTS

log = logging.getLogger("bench.core.cli")

__all__ = ["run_benchmark", "format_runs", "build_parser", "main"]


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
    """``--deepspeed-path VERSION=PATH`` values as ``{version: path}``."""
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
                   help="lora_llama: run only these variants; compile_scaling: only these "
                        "runs of each depth (ours-cold, ours-warm, deepspeed-cold); merged into "
                        "the existing result file (its other runs stay)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="lora_llama: profile two more steps of each variant after its timed ones "
                        "(torch.profiler; DIR/<deepspeed>/<variant>-rank<r>.json and -top.txt)")
    p.add_argument("--layers", default=None, metavar="N,M",
                   help="compile_scaling: the decoder layer counts to run (default 2,4,8,16; "
                        "2,4,8,16,32 adds the 32-layer run; --smoke: 2)")
    p.add_argument("--no-report", action="store_true",
                   help="do not regenerate the benchmark tables and plot afterwards (a full run "
                        "into bench/results does by default)")
    p.add_argument("--run", default=None, metavar="LABEL",
                   help="the run label of this invocation's runs (default: its start time); "
                        "give invocations the same label to have their runs compared, e.g. "
                        "compile_scaling's runs spread over several commands")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="logs and per-process files (inductor caches, profile stores) here "
                        "instead of a new temporary folder: a later invocation finds them (a "
                        "compile_scaling warm run after its cold run's invocation)")
    p.add_argument("-v", "--verbose", action="store_true", help="DEBUG logging")
    return p


def _remove_if_empty(root: Optional[Path]) -> None:
    """Remove ``root`` and the folders under it where none holds a file (a dry run's work folder,
    made while planning); a folder with anything in it stays as it is."""
    if root is None or not root.is_dir() or any(p.is_file() or p.is_symlink()
                                                for p in root.rglob("*")):
        return
    for folder in sorted((p for p in root.rglob("*")), key=lambda p: len(p.parts), reverse=True):
        folder.rmdir()
    root.rmdir()


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
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        known = SCALING_KINDS if names == ["compile_scaling"] else LORA_VARIANTS
        unknown_variants = [v for v in variants if v not in known]
        if names not in (["lora_llama"], ["compile_scaling"]) or not variants \
                or unknown_variants or args.smoke:
            print(f"--variants applies to a full lora_llama run (names from "
                  f"{', '.join(LORA_VARIANTS)}) or compile_scaling run (names from "
                  f"{', '.join(SCALING_KINDS)}); got {args.variants!r} for {args.name!r}",
                  file=sys.stderr)
            return 2
        if names == ["lora_llama"]:
            try:
                check_lora_variants(variants)
            except ValueError as e:
                print(f"--variants: {e}", file=sys.stderr)
                return 2
    layers = None
    if args.layers is not None:
        try:
            layers = [int(n) for n in args.layers.split(",") if n.strip()]
        except ValueError:
            layers = []
        if names != ["compile_scaling"] or not layers or min(layers) < 1:
            print(f"--layers applies to compile_scaling and takes layer counts of at least 1 "
                  f"(e.g. 2,4,8,16,32); got {args.layers!r} for {args.name!r}", file=sys.stderr)
            return 2
    ctx = BenchContext(output_dir=args.output_dir or (SMOKE_DIR if args.smoke else RESULTS_DIR),
                       smoke=args.smoke, steps=args.steps, repeats=args.repeats, ranks=args.ranks,
                       extra_deepspeed=_parse_extra(args.deepspeed_path), timeout=args.timeout,
                       variants=variants, trace=args.trace, layers=layers,
                       work_root=args.work_dir)
    if args.run is not None:
        if not args.run.strip():
            print("--run wants a non-empty label", file=sys.stderr)
            return 2
        ctx.run_id = args.run.strip()
    if args.dry_run:
        planned: List[BenchContext] = []
        try:
            for name in names:
                for run_ctx in contexts_for(benches[name], ctx):
                    planned.append(run_ctx)
                    try:
                        cmds = benches[name].commands(run_ctx)
                    except ValueError as e:  # a plan the arguments cannot make
                        print(str(e), file=sys.stderr)
                        return 2
                    print(f"# {name}" + (f" ({run_ctx.ranks} ranks)" if run_ctx.ranks else ""))
                    for cmd in cmds:
                        print(cmd.shell())
        finally:
            if args.work_dir is None:  # a plan leaves no empty temporary folder behind
                for run_ctx in planned:
                    _remove_if_empty(run_ctx.work_root)
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
