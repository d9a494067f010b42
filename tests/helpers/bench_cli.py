"""The benchmark suite as its tests drive it (``tests/test_bench_*.py``): the environment of its
processes, ``python -m bench`` run in this process, and the versions every result records.

``bench/`` is a folder of the checkout, not an installed package: a test module puts the
checkout first on ``sys.path`` before it calls :func:`run_bench`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from typing import Dict

from helpers.env import without_autoload

__all__ = ["VERSION_KEYS", "bench_env", "run_bench"]

VERSION_KEYS = {"torch", "deepspeed", "transformers", "peft", "ds_z3native", "cuda"}


def bench_env() -> Dict[str, str]:
    """The environment of a benchmark process: DeepSpeed's CPU accelerator, no autoload."""
    return without_autoload(DS_ACCELERATOR="cpu")


def run_bench(*argv: str) -> subprocess.CompletedProcess:
    """``python -m bench *argv`` run in this process, in the environment of ``bench_env()``: its
    exit code, stdout and stderr. The entry points' own ``main`` (``tests/test_bench_cli.py``'s
    ``test_bench_help`` starts them as processes); a plan or a refusal needs no process of its
    own, nor the seconds a loaded CI machine takes to import torch and DeepSpeed again for each."""
    from unittest import mock

    from bench.core.cli import main

    out, err = io.StringIO(), io.StringIO()
    handlers, level = list(logging.root.handlers), logging.root.level  # main() calls basicConfig
    try:
        with mock.patch.dict(os.environ, bench_env(), clear=True), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's refusals
                code = e.code if isinstance(e.code, int) else 2
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    return subprocess.CompletedProcess(["python", "-m", "bench", *argv], code, out.getvalue(),
                                       err.getvalue())
