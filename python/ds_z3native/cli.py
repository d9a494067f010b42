"""Command line of ds_z3native: ``ds-z3native <command>`` or ``python -m ds_z3native <command>``
(:data:`DESCRIPTION` is what ``--help`` shows)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

# Plain text: argparse prints it as written.
DESCRIPTION = ("Commands: demo (a LoRA fine-tune under ZeRO-3 with activation checkpointing), "
               "doctor (is this environment covered), selftest (the dc op on gloo ranks), "
               "build-info, bench (the benchmark suite of a source checkout: python -m bench).")


def _cmd_build_info(args: argparse.Namespace) -> int:
    from . import build_info

    json.dump(build_info(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from .selftest import run_selftest

    print(f"ds_z3native self-test: {args.ranks} gloo ranks through torch.ops.dc")
    checks = run_selftest(world_size=args.ranks)
    for c in checks:
        mark = "PASS" if c.ok else "FAIL"
        print(f"  [{mark}] {c.name}" + (f"  ({c.detail})" if c.detail and not c.ok else ""))
    failed = [c for c in checks if not c.ok]
    print("self-test passed" if not failed else f"self-test FAILED: {len(failed)} check(s)")
    return 0 if not failed else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import (DemoOptions, DemoRefused, format_comparison, format_summary,
                       run_comparison, run_demo)

    opts = DemoOptions(steps=args.steps, ranks=args.ranks, model_size=args.model_size,
                       deepcompile=args.deepcompile, without_fix=args.without_fix,
                       device=args.device, lr=args.lr, seed=args.seed, timeout=args.timeout,
                       log_dir=args.log_dir, progress=not args.no_progress)
    try:
        result = run_comparison(opts) if args.compare else run_demo(opts)
    except DemoRefused as e:
        print(f"ds-z3native demo: {e}", file=sys.stderr)
        return 2
    print(format_comparison(result) if args.compare else format_summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return result.exit_code


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import format_check, format_report, run_doctor

    def show(check: object) -> None:
        print(format_check(check, tables=args.tables), flush=True)  # type: ignore[arg-type]

    if not args.json:
        print("ds-z3native doctor", flush=True)
    report = run_doctor(selftest=not args.no_selftest, ranks=args.ranks,
                        on_check=None if args.json else show)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def _bench_root() -> Optional[Path]:
    """The source checkout holding ``bench/`` (not installed with the package): the one this
    package was installed from in editable mode, else the current directory; None if neither."""
    here = Path(__file__).resolve().parents[2]  # <checkout>/python/ds_z3native/cli.py
    for root in (here, Path(os.getcwd())):
        if (root / "bench" / "core" / "cli.py").is_file():
            return root
    return None


def _cmd_bench(argv: List[str]) -> int:
    root = _bench_root()
    if root is None:
        print("ds-z3native bench: the benchmark suite lives in the source checkout (bench/ is not "
              "installed with the package) and none was found next to this installation or in "
              "the current directory; run it from a checkout: `cd ds_z3native && python -m bench "
              "--help`", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from bench.core.cli import main as bench_main
    except ImportError as e:
        print(f"ds-z3native bench: cannot import bench.core.cli from {root}: {e}", file=sys.stderr)
        return 2
    return int(bench_main(argv, prog="ds-z3native bench"))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ds-z3native`` console script."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    verbose = [a for a in args_in[:2] if a in ("-v", "--verbose")]
    if args_in[len(verbose):len(verbose) + 1] == ["bench"]:  # the suite parses its own options
        return _cmd_bench(args_in[len(verbose) + 1:] + verbose)
    parser = argparse.ArgumentParser(prog="ds-z3native", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-info", help="print how the native extension was built (JSON)")
    p.set_defaults(func=_cmd_build_info)
    p = sub.add_parser("selftest", help="drive the dc op on gloo ranks: gather, reduce, refusals")
    p.add_argument("--ranks", type=int, default=2, help="number of gloo ranks (default 2)")
    p.set_defaults(func=_cmd_selftest)

    from .models import DEFAULT_SIZE, MODEL_SIZES

    sizes = " ".join(f"{s.name} ({s.layers} layers x {s.hidden}): {s.note}."
                     for s in MODEL_SIZES.values())
    p = sub.add_parser(
        "demo", help="LoRA fine-tune of a small Llama under ZeRO-3 + activation checkpointing",
        description="Train a small Llama (random weights, no download) with PEFT LoRA under "
                    "DeepSpeed ZeRO-3 and non-reentrant gradient checkpointing, with "
                    "ds_z3native.install() applied. Starts its own ranks: 2 gloo ranks on CPU, "
                    "or one per GPU. Exit code 0 when it trains, 1 when a rank fails, 2 when it "
                    "cannot start here.")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--ranks", type=int, default=None,
                   help="number of ranks (default: one per GPU with CUDA, else 2)")
    p.add_argument("--model-size", choices=list(MODEL_SIZES), default=DEFAULT_SIZE,
                   help=f"model preset (default {DEFAULT_SIZE}). {sizes}")
    p.add_argument("--deepcompile", action="store_true",
                   help="DeepSpeed DeepCompile (engine.compile()): GPUs, or CPU ranks from DeepSpeed 0.19.4")
    p.add_argument("--without-fix", action="store_true",
                   help="do not call ds_z3native.install(): show what DeepSpeed alone does")
    p.add_argument("--compare", action="store_true",
                   help="run DeepSpeed alone, then with ds_z3native, and show both side by "
                        "side: under DeepCompile where it runs here (GPUs, or CPU ranks from "
                        "DeepSpeed 0.19.4), else eager")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to train (default: CUDA if available)")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default 5e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up after this many seconds without progress (default 600)")
    p.add_argument("--log-dir", default=None,
                   help="where the ranks write their logs (default: a new temporary directory)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("doctor", help="check this environment: versions, build, install(), "
                                      "DS_Z3NATIVE activation, self-test",
                       description="One verdict (PASS/WARN/FAIL) per check, with what to do for "
                                   "each WARN and FAIL. Exit code 1 if any check fails.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-selftest", action="store_true", help="skip the gloo self-test")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the self-test (default 2)")
    p.add_argument("--tables", action="store_true",
                   help="print each check's table (the patch fingerprints, one row per patch "
                        "target) under a PASS too, not only under a WARN or FAIL")
    p.set_defaults(func=_cmd_doctor)
    sub.add_parser("bench", help="run the benchmark suite of a source checkout "
                                 "(ds-z3native bench --help; same as python -m bench)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))
