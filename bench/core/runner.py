"""Running a benchmark's processes: ``Command`` and a supervisor that logs progress and stops a
hung process tree with every thread's traceback in its log. With ``echo`` the process's own
output also goes to this process's log as it comes, each line after the command's label.

A process past its timeout, and every process descended from it (a launcher's ranks too), gets
SIGABRT first, which makes each Python process print every thread's traceback into the log
(``PYTHONFAULTHANDLER``), then SIGKILL; the log's tail is logged, so a hang says where it hung.
Descendants are found through Linux /proc.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import resource
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence

from bench.core.schema import ROOT

log = logging.getLogger("bench.core.runner")

__all__ = ["Command", "run_command", "run_commands"]


@dataclasses.dataclass
class Command:
    """One process of a benchmark's GPU plan."""

    argv: List[str]
    label: str
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    output: Optional[Path] = None

    def shell(self) -> str:
        """The command as one shell line (environment first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def run_command(cmd: Command, log_dir: Path, timeout: float = 3600.0,
                progress_every: float = 60.0, echo: bool = False) -> int:
    """Run ``cmd`` (output to a log file under ``log_dir``), logging its start, a line every
    ``progress_every`` seconds while it runs, and its end; its exit code (124 on timeout).
    ``echo``: each line the process writes is also logged as it comes (``label | line``).

    Past ``timeout`` the command and every process descended from it (a launcher's ranks too)
    get SIGABRT first, which makes each Python process print every thread's traceback into the
    log (``PYTHONFAULTHANDLER``), then SIGKILL; the log's tail is logged, so a hang says where it
    hung."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (re.sub(r"[^\w.@-]+", "_", cmd.label) + ".log")
    env = dict(os.environ)
    env.update(cmd.env)
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT at a timeout prints every thread's traceback
    log.info("%s: %s (log: %s)", cmd.label, cmd.shell(), log_path)
    start = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd.argv, stdout=subprocess.PIPE if echo else out,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        pump = None
        if echo:
            assert proc.stdout is not None  # a pipe was asked for
            pump = threading.Thread(target=_pump, args=(proc.stdout, out, cmd.label),
                                    name=f"echo {cmd.label}", daemon=True)
            pump.start()
        while True:
            try:
                code = proc.wait(timeout=min(progress_every,
                                             max(1.0, timeout - (time.monotonic() - start))))
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed >= timeout:
                    _stop_process_tree(proc)
                    _join(pump)
                    log.error("%s: stopped after %.0f s (timeout %.0f s); the log ends:\n%s",
                              cmd.label, elapsed, timeout, _tail(log_path))
                    return 124
                log.info("%s: still running (%.0f s)", cmd.label, elapsed)
        _join(pump)
    log.info("%s: exit %d after %.1f s", cmd.label, code, time.monotonic() - start)
    return code


def _pump(stream: IO[bytes], out: IO[bytes], label: str) -> None:
    """Copy ``stream`` line by line into ``out`` (flushed: a stopped run's tail is read from it)
    and log each line after ``label``, until the stream ends."""
    for line in iter(stream.readline, b""):
        out.write(line)
        out.flush()
        log.info("%s | %s", label, line.decode(errors="replace").rstrip())
    stream.close()


def _join(pump: Optional[threading.Thread], grace: float = 10.0) -> None:
    """Wait up to ``grace`` seconds for the echo thread to copy what is left (a descendant that
    outlived the process may hold the pipe open: then it is left to end with it)."""
    if pump is not None:
        pump.join(grace)


def _stop_process_tree(proc: "subprocess.Popen[bytes]", grace: float = 10.0) -> None:
    """SIGABRT to ``proc`` and every process descended from it (tracebacks into the log; no
    core files), then SIGKILL to whatever is left. Descendants are found through /proc, not the
    process group: torchrun starts each rank in a session of its own."""
    tree = _process_tree(proc.pid)
    for pid in tree:
        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            os.kill(pid, signal.SIGABRT)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
        time.sleep(0.2)
    for pid in set(tree) | set(_process_tree(proc.pid)):
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:  # where /proc told nothing
        proc.kill()
    proc.wait()


def _process_tree(root: int) -> List[int]:
    """``root`` and its living descendants (Linux /proc; only ``root`` where there is none)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (Linux /proc; a zombie, dead but not yet reaped, does not)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return bool(fields) and fields[0] not in ("Z", "X")  # no fields: gone with its /proc entry


def _stat_fields(stat: Path) -> List[str]:
    """The fields of a /proc/<pid>/stat after the command name (state, ppid, ...); [] when the
    process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _tail(path: Path, lines: int = 60, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of the file at ``path`` (reading at most its last ``max_bytes``)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def run_commands(cmds: Sequence[Command], log_dir: Path, timeout: float = 3600.0,
                 echo: bool = False) -> List[int]:
    """Run ``cmds`` one after another (logs under ``log_dir``; ``echo``: see ``run_command``)
    with ``[i/n]`` progress; their exit codes."""
    codes = []
    for i, cmd in enumerate(cmds, 1):
        log.info("[%d/%d] %s", i, len(cmds), cmd.label)
        codes.append(run_command(cmd, log_dir, timeout, echo=echo))
    return codes
