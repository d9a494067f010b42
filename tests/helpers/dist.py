"""Run a function on N real ranks (one process each) over a gloo process group.

``run_ranks(fn, world_size, *args)`` is :func:`ds_z3native.launch.run_ranks` with what the tests
want: the environment DeepSpeed expects on a CPU host (``DS_ACCELERATOR=cpu`` unless set),
``torch.distributed`` initialized with gloo (``init_pg``), and a failure as :class:`RankFailed`
(an AssertionError naming the rank, with its traceback). ``fn(rank, world_size, *args)`` must be
importable by name (a module-level function in a test module) and return something that
pickles; a hang fails after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List, Optional

from ds_z3native import launch
from ds_z3native._net import free_port

__all__ = ["run_ranks", "free_port", "run_python", "RankFailed"]


class RankFailed(AssertionError):
    """A rank raised, died or hung."""


def run_ranks(fn: Callable, world_size: int, *args: Any, env: Optional[Dict[str, str]] = None,
              timeout: float = 300.0, init_pg: bool = True) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results."""
    rank_env = dict(env or {})
    rank_env.setdefault("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    try:
        return launch.run_ranks(fn, world_size, *args, env=rank_env, timeout=timeout,
                                backend="gloo" if init_pg else None)
    except launch.RanksFailed as e:
        raise RankFailed(str(e)) from None


def run_python(code: str, timeout: float = 120.0, env: Optional[Dict[str, str]] = None
               ) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (for cases that may abort the process)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
