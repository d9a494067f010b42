"""Start ``bench/deepcompile_run.py`` training runs (one process each: dynamo caches, DeepSpeed's
hooks and the native runtime are process-wide) and collect their JSON results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from ds_z3native._net import free_port

__all__ = ["RUNNER", "LAUNCHER_KEYS", "child_env", "start", "collect", "run_alone", "run_together", "cpu_deepcompile_mark",
           "needs_cpu_deepcompile"]

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "bench" / "deepcompile_run.py"
TIMEOUT_S = 900
# A run still going this long prints every thread's stack into its log and exits: the failure
# shows where it hung (a CPU run takes about a minute on two cores).
WATCHDOG_S = 600


# Set by a launcher (or DS_Z3NATIVE by the caller's shell) for this process; a child run gets its
# own.
LAUNCHER_KEYS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", "DS_Z3NATIVE")


def child_env() -> Dict[str, str]:
    """This process's environment for a training run started from it: without the launcher's
    variables and DS_Z3NATIVE, output unbuffered."""
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    run_env["PYTHONUNBUFFERED"] = "1"
    return run_env


def start(args: Iterable[str], tmp: Path, name: str, steps: int, fresh_caches: bool = False,
          env: Optional[Mapping[str, str]] = None, nproc: int = 1) -> Tuple[subprocess.Popen, Path]:
    """Launch one run writing ``tmp/<name>.json`` (log: ``tmp/<name>.log``). ``nproc`` > 1:
    that many ranks under ``torch.distributed.run`` (one GPU each); rank r > 0 writes
    ``tmp/<name>.json.rank<r>``."""
    out = tmp / f"{name}.json"
    run_env = child_env()
    run_env.update(env or {})
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                     f"--master_port={free_port()}"]
    cmd = [*launcher, str(RUNNER), *args, "--steps", str(steps), "--json", str(out),
           "--watchdog-s", str(WATCHDOG_S)]
    if fresh_caches:
        run_env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / f"{name}-inductor")
        cmd.append("--fresh-extension-cache")
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=ROOT), out


def collect(proc: subprocess.Popen, out: Path, timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """Wait for a run; rank 0's result with ``log_tail`` (the last 3000 characters of its log)
    and ``other_ranks`` (the results of ranks 1, 2, ... of a multi-rank run, in rank order)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = out.with_suffix(".log").read_text()
    # A watchdog dump: keep its first stack (the main thread's, up to faulthandler's 100 frames)
    # whole.
    dump = text.find("Timeout (0:")
    if dump >= 0 and not out.exists():
        second = text.find("\nThread 0x", text.find("Thread 0x", dump) + 1)
        log = text[dump:second if second > 0 else dump + 20000]
    else:
        log = text[-3000:]
    assert out.exists(), f"runner died (rc {proc.returncode}):\n{log}"
    result = json.loads(out.read_text())
    result["log_tail"] = log
    others = sorted(out.parent.glob(out.name + ".rank*"), key=lambda p: int(p.name.rsplit("rank", 1)[1]))
    result["other_ranks"] = [json.loads(p.read_text()) for p in others]
    return result


def run_alone(name: str, args: Iterable[str], steps: int, fresh_caches: bool = False,
              env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """One run, waited for."""
    with tempfile.TemporaryDirectory() as tmp:
        return collect(*start(args, Path(tmp), name, steps, fresh_caches, env))


def run_together(runs: Mapping[str, Tuple[Iterable[str], int]],
                 env: Optional[Mapping[str, str]] = None,
                 nprocs: Optional[Mapping[str, int]] = None) -> Dict[str, Dict[str, Any]]:
    """Start every ``name -> (args, steps)`` at once (the compiles are CPU-bound and overlap),
    then collect them all. ``nprocs``: ranks per run name (default 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        started = {name: start(args, Path(tmp), name, steps, env=env,
                               nproc=(nprocs or {}).get(name, 1))
                   for name, (args, steps) in runs.items()}
        t0 = time.perf_counter()
        results = {name: collect(*p) for name, p in started.items()}
        print(f"\n[runs] {len(results)} runs together in {time.perf_counter() - t0:.0f} s")
        return results


def _deepspeed_version() -> Any:
    import deepspeed
    from packaging.version import Version

    return Version(deepspeed.__version__.split("+")[0])


def cpu_deepcompile_mark() -> Any:
    """A skip mark for where DeepCompile does not run on DeepSpeed's CPU accelerator: before
    0.19.3 its profiler needs CUDA; 0.19.3's own eager-fallback getter gathers a frozen param
    between Dynamo building a guard and checking it ("Guard failed on the same frame it was
    created ... rank mismatch"; 0.19.4 changed the getter). Those releases' DeepCompile runs are
    covered on a CUDA machine (tests/gpu). For a module's ``pytestmark``."""
    import pytest
    from packaging.version import Version

    return pytest.mark.skipif(
        _deepspeed_version() < Version("0.19.4"),
        reason="DeepCompile on the CPU runs from DeepSpeed 0.19.4 (before: CUDA-only profiler; "
               "0.19.3: its eager-fallback getter breaks Dynamo's guard); covered in tests/gpu")


def needs_cpu_deepcompile(test: Any) -> Any:
    """``test`` skipped where DeepCompile does not run on the CPU (``cpu_deepcompile_mark``)."""
    return cpu_deepcompile_mark()(test)
