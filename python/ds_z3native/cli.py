"""Command line of ds_z3native: ``ds-z3native <command>`` or ``python -m ds_z3native <command>``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional


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


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ds-z3native`` console script."""
    parser = argparse.ArgumentParser(prog="ds-z3native", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-info", help="print how the native extension was built (JSON)")
    p.set_defaults(func=_cmd_build_info)
    p = sub.add_parser("selftest", help="drive the dc op on gloo ranks: gather, reduce, refusals")
    p.add_argument("--ranks", type=int, default=2, help="number of gloo ranks (default 2)")
    p.set_defaults(func=_cmd_selftest)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))
