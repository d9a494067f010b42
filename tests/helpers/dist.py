"""Run a function on N real ranks (one process each) over a gloo process group.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh interpreters (spawn), sets the
launcher environment DeepSpeed expects (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
DS_ACCELERATOR=cpu), initializes ``torch.distributed`` with gloo, calls ``fn(rank, world_size,
*args)`` and returns the per-rank return values (which must pickle). A rank's exception is
re-raised in the parent with that rank's traceback; a hang fails after ``timeout`` seconds.
``fn`` must be importable by name (a module-level function in a test module).

A rank leaves with ``os._exit`` once its result is written and its process group destroyed,
skipping interpreter finalization: once ``torch._dynamo`` is imported (DeepSpeed imports it),
``destroy_process_group()`` no longer frees a gloo group (something in
``torch.distributed._tools`` keeps it), so its worker threads outlive the interpreter. A worker
still dropping the last collective's work then needs the GIL to free a tensor Python let go of,
and taking the GIL during finalization ends the thread inside a destructor: ``std::terminate``,
SIGABRT after the rank had finished (about one run in five of a two-rank DeepSpeed test here;
0 in 30 with a 0.5 s pause before exit, 0 in 30 without DeepSpeed).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.multiprocessing as mp

from ds_z3native._net import free_port

__all__ = ["run_ranks", "free_port", "run_python", "RankFailed"]


class RankFailed(AssertionError):
    """A rank raised, died or hung."""


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
               env: Dict[str, str], out_dir: str, init_pg: bool) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result: Dict[str, Any]
    try:
        if init_pg:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        result = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist

        if init_pg and dist.is_initialized() and result["ok"]:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written: see the module doc for why not finalize


def run_ranks(fn: Callable, world_size: int, *args: Any, env: Optional[Dict[str, str]] = None,
              timeout: float = 300.0, init_pg: bool = True) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank_main, nprocs=world_size, join=False, start_method="spawn",
                                 args=(world_size, free_port(), fn, args, dict(env or {}), out_dir,
                                       init_pg))
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise RankFailed(f"ranks did not finish within {timeout:.0f} s (hung)")
        except RankFailed:
            raise
        except mp.ProcessRaisedException as e:  # pragma: no cover - fn errors are pickled
            raise RankFailed(str(e)) from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"a rank died: {e}") from None
        except Exception as e:  # noqa: BLE001
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise RankFailed(f"ranks did not finish: {e}") from None
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RankFailed(f"rank {rank} left no result (hung or killed)")
            with open(path, "rb") as f:
                r = pickle.load(f)
            if not r["ok"]:
                raise RankFailed(f"rank {rank} failed:\n{r['error']}")
            results.append(r["value"])
        return results


def run_python(code: str, timeout: float = 120.0, env: Optional[Dict[str, str]] = None
               ) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (for cases that may abort the process)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
