"""Command line: ``ds-z3native`` / ``python -m ds_z3native``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ds-z3native`` console script."""
    parser = argparse.ArgumentParser(prog="ds-z3native", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build-info", help="print how the native extension was built (JSON)")
    args = parser.parse_args(argv)
    if args.command == "build-info":
        from . import build_info

        json.dump(build_info(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
