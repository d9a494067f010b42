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

__all__ = ["RUNNER", "start", "collect", "run_alone", "run_together"]

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "bench" / "deepcompile_run.py"
TIMEOUT_S = 900
# A run still going this long prints every thread's stack into its log and exits: the failure
# shows where it hung (a CPU run takes about a minute on two cores).
WATCHDOG_S = 600


def start(args: Iterable[str], tmp: Path, name: str, steps: int, fresh_caches: bool = False,
          env: Optional[Mapping[str, str]] = None) -> Tuple[subprocess.Popen, Path]:
    """Launch one run writing ``tmp/<name>.json`` (log: ``tmp/<name>.log``)."""
    out = tmp / f"{name}.json"
    run_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "DS_Z3NATIVE")}
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env.update(env or {})
    cmd = [sys.executable, str(RUNNER), *args, "--steps", str(steps), "--json", str(out),
           "--watchdog-s", str(WATCHDOG_S)]
    if fresh_caches:
        run_env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / f"{name}-inductor")
        cmd.append("--fresh-extension-cache")
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=ROOT), out


def collect(proc: subprocess.Popen, out: Path, timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """Wait for a run; its result with ``log_tail`` (the last 3000 characters of its log)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = out.with_suffix(".log").read_text()
    # A watchdog dump: keep its first stack (the main thread's) whole.
    dump = text.find("Timeout (0:")
    log = text[dump:dump + 6000] if dump >= 0 and not out.exists() else text[-3000:]
    assert out.exists(), f"runner died (rc {proc.returncode}):\n{log}"
    result = json.loads(out.read_text())
    result["log_tail"] = log
    return result


def run_alone(name: str, args: Iterable[str], steps: int, fresh_caches: bool = False,
              env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """One run, waited for."""
    with tempfile.TemporaryDirectory() as tmp:
        return collect(*start(args, Path(tmp), name, steps, fresh_caches, env))


def run_together(runs: Mapping[str, Tuple[Iterable[str], int]],
                 env: Optional[Mapping[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """Start every ``name -> (args, steps)`` at once (the compiles are CPU-bound and overlap),
    then collect them all."""
    with tempfile.TemporaryDirectory() as tmp:
        started = {name: start(args, Path(tmp), name, steps, env=env)
                   for name, (args, steps) in runs.items()}
        t0 = time.perf_counter()
        results = {name: collect(*p) for name, p in started.items()}
        print(f"\n[runs] {len(results)} runs together in {time.perf_counter() - t0:.0f} s")
        return results
