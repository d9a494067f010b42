"""Run a function on N ranks of one host, one fresh process (spawn) each.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` interpreters, gives each the launcher
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port) plus ``env``, optionally initializes ``torch.distributed``
(``backend``), calls ``fn(rank, world_size, *args)`` and returns the ranks' return values in rank
order. ``fn`` must be importable by name (a module-level function) and its return value must
pickle; it is sent by value, never through shared memory, so it outlives the rank.

When a rank raises, dies, or the ranks run past ``timeout`` (or send nothing for
``idle_timeout``), every rank still running is stopped (SIGTERM, then SIGKILL after a grace
period) and :class:`RanksFailed` is raised; its ``errors`` name each rank that failed, with its
exception type, message and traceback, or its exit code. ``log_dir`` sends each rank's stdout and
stderr (its file descriptors, so native code and DeepSpeed's logs too) to ``log_dir/rank<N>.log``.

A rank can report to the parent while it runs with :func:`send`; the parent gets each message
through ``on_message(rank, message)`` as it arrives (the demo's progress bar).

``start_ranks`` returns the running :class:`Ranks` for a caller that needs the processes
themselves; ``run_ranks`` is ``start_ranks`` + :meth:`Ranks.wait` + :meth:`Ranks.stop`.

A rank ends with ``os._exit`` once its result is sent and its process group destroyed, skipping
interpreter finalization: once ``torch._dynamo`` is imported (DeepSpeed imports it),
``destroy_process_group()`` no longer frees a gloo group, so its worker threads outlive the
interpreter, and a worker that needs the GIL during finalization ends the process with
``std::terminate`` (SIGABRT) after the rank had finished. Before it, the rank removes the named
semaphores it made (multiprocessing's exit finalizers would have): the resource tracker is the
parent's, and would report them leaked when the parent exits (tqdm makes one for its lock, and
torch.fx's interpreter builds a tqdm bar, disabled, in every DeepCompile compile).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ._net import free_port

__all__ = ["RankError", "RanksFailed", "Ranks", "start_ranks", "run_ranks", "send", "rank_env",
           "rank_log"]

log = logging.getLogger(__name__)

# The connection to the parent, in a rank started by start_ranks (None elsewhere).
_to_parent: Optional[Connection] = None


@dataclass(frozen=True)
class RankError:
    """Why a run failed: a rank raised (``raised``), ended without a result (``died``), or the
    ranks ran out of time (``timeout``, ``rank`` None)."""

    rank: Optional[int]
    kind: str
    type: str
    message: str
    traceback: str = ""
    exitcode: Optional[int] = None
    # Where a raising rank was: "init" (joining the process group, before ``fn``) or "run".
    phase: str = "run"

    @property
    def port_in_use(self) -> bool:
        """Whether the rank could not join the process group because its port was taken (a
        free port chosen by one process can be taken by another before the rank binds it)."""
        text = self.message.lower()
        return self.phase == "init" and ("address already in use" in text
                                         or "eaddrinuse" in text)

    @property
    def summary(self) -> str:
        """One line: which rank, the exception type and the first line of its message."""
        where = "the ranks" if self.rank is None else f"rank {self.rank}"
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{where}: {self.type}: {first}"

    def __str__(self) -> str:
        where = "the ranks" if self.rank is None else f"rank {self.rank}"
        text = f"{where}: {self.type}: {self.message}"
        return f"{text}\n{self.traceback.rstrip()}" if self.traceback else text


class RanksFailed(RuntimeError):
    """A rank raised or died, or the ranks ran out of time; ``errors`` (first reported first)
    says which rank and why, ``log_dir`` where the ranks' logs are (None: not redirected)."""

    def __init__(self, errors: Sequence[RankError], log_dir: Optional[str] = None) -> None:
        self.errors: Tuple[RankError, ...] = tuple(errors)
        self.log_dir = log_dir
        text = "\n".join(str(e) for e in self.errors)
        if log_dir is not None:
            text += f"\n(rank logs: {log_dir})"
        super().__init__(text)

    @property
    def first(self) -> RankError:
        """The error reported first (usually the cause; the others often follow from it)."""
        return self.errors[0]


# How many times run_ranks starts the ranks when their port was taken before they bound it.
PORT_ATTEMPTS = 3


def rank_env(rank: int, world_size: int, port: int) -> Dict[str, str]:
    """The environment torchrun gives a rank of a one-host run (what ``init_process_group``'s
    ``env://`` and DeepSpeed read)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def rank_log(log_dir: str, rank: int) -> str:
    """The log file of ``rank`` under ``log_dir``."""
    return os.path.join(log_dir, f"rank{rank}.log")


def send(message: Any) -> None:
    """In a rank started by :func:`start_ranks`: send ``message`` (picklable) to the parent's
    ``on_message``. Elsewhere: RuntimeError."""
    if _to_parent is None:
        raise RuntimeError("ds_z3native.launch.send: this process is not a rank started by "
                           "ds_z3native.launch")
    _send(_to_parent, ("message", message))


def _send(conn: Connection, item: Tuple[str, Any]) -> None:
    # Plain pickle: tensors go by value (torch's multiprocessing reducers would share them
    # through this process's memory, which ends with the rank).
    conn.send_bytes(pickle.dumps(item))


@dataclass(frozen=True)
class _Target:
    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    world_size: int
    port: int
    env: Mapping[str, str]
    backend: Optional[str]
    log_dir: Optional[str]


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _rank_main(target: _Target, rank: int, conn: Connection) -> None:
    global _to_parent
    if target.log_dir is not None:
        _redirect_output(rank_log(target.log_dir, rank))
    os.environ.update(target.env)
    os.environ.update(rank_env(rank, target.world_size, target.port))
    _to_parent = conn
    ok = False
    item: Tuple[str, Any]
    phase = "init"
    try:
        if target.backend is not None:
            import torch.distributed as dist

            dist.init_process_group(target.backend, rank=rank, world_size=target.world_size)
        phase = "run"
        value = target.fn(rank, target.world_size, *target.args)
        item = ("result", value)
        ok = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        text = traceback.format_exc()
        sys.stderr.write(text)
        item = ("error", {"type": type(e).__name__, "message": str(e), "traceback": text,
                          "phase": phase})
    try:
        _send(conn, item)
    except Exception as e:  # noqa: BLE001 - e.g. a result that does not pickle
        ok = False
        try:
            _send(conn, ("error", {"type": type(e).__name__,
                                   "message": f"could not send the rank's {item[0]}: {e}",
                                   "traceback": traceback.format_exc()}))
        except Exception:  # noqa: BLE001 - the parent is gone: nobody to report to
            pass
    if ok and target.backend is not None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown only: the result is sent
            pass
    _remove_semaphores()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # see the module doc for why not finalize


def _remove_semaphores() -> None:
    """Run multiprocessing's exit finalizers of this process's named semaphores only (unlink, and
    unregister from the resource tracker): what interpreter exit does, which ``os._exit`` skips."""
    try:
        from multiprocessing import synchronize, util

        registry = getattr(util, "_finalizer_registry", {})
        for finalizer in list(registry.values()):
            if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
                finalizer()
    except Exception as e:  # noqa: BLE001 - teardown only: at worst the tracker warns
        log.debug("removing this rank's semaphores: %s", e)


class Ranks:
    """Ranks started by :func:`start_ranks`: their processes, and the parent's side of the run."""

    def __init__(self, processes: List[Any], conns: List[Connection],
                 log_dir: Optional[str]) -> None:
        self.processes = processes
        self.log_dir = log_dir
        self._conns: List[Optional[Connection]] = list(conns)
        self._results: Dict[int, Any] = {}
        self._errors: List[RankError] = []

    @property
    def world_size(self) -> int:
        """How many ranks were started."""
        return len(self.processes)

    def _receive(self, rank: int, on_message: Optional[Callable[[int, Any], None]]) -> bool:
        """Reads one item from ``rank``; False when its connection is closed."""
        conn = self._conns[rank]
        if conn is None:
            return False
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            conn.close()
            self._conns[rank] = None
            return False
        try:
            kind, payload = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
            self._errors.append(RankError(rank, "raised", type(e).__name__,
                                          f"could not unpickle what rank {rank} sent: {e}"))
            return True
        if kind == "message":
            if on_message is not None:
                on_message(rank, payload)
        elif kind == "result":
            self._results[rank] = payload
        else:
            self._errors.append(RankError(rank, "raised", payload["type"], payload["message"],
                                          payload["traceback"],
                                          phase=payload.get("phase", "run")))
        return True

    def _drain(self, rank: int, on_message: Optional[Callable[[int, Any], None]]) -> None:
        conn = self._conns[rank]
        while conn is not None and conn.poll() and self._receive(rank, on_message):
            conn = self._conns[rank]

    def _finished(self, rank: int) -> bool:
        return rank in self._results or any(e.rank == rank for e in self._errors)

    def wait(self, timeout: Optional[float] = None, idle_timeout: Optional[float] = None,
             on_message: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
        """Wait for every rank's result; the results in rank order. ``timeout``: seconds for the
        whole run; ``idle_timeout``: seconds without any message or result from the ranks.
        RanksFailed at the first rank that raises or dies, or when time runs out (the ranks
        are then still running: :meth:`stop` them, as :func:`run_ranks` does)."""
        start = last_news = time.monotonic()
        while True:
            pending = [r for r in range(self.world_size) if not self._finished(r)]
            if self._errors or not pending:
                break
            now = time.monotonic()
            left = {"timeout": None if timeout is None else start + timeout - now,
                    "idle": None if idle_timeout is None else last_news + idle_timeout - now}
            expired = [k for k, v in left.items() if v is not None and v <= 0]
            if expired:
                what = (f"did not finish within {timeout:.0f} s" if "timeout" in expired else
                        f"sent nothing for {idle_timeout:.0f} s")
                self._errors.append(RankError(None, "timeout", "Timeout",
                                              f"ranks {pending} {what}"))
                break
            limit = min([1.0] + [v for v in left.values() if v is not None])
            by_handle: Dict[Any, Tuple[str, int]] = {}
            for r in pending:
                conn = self._conns[r]
                if conn is not None:
                    by_handle[conn] = ("conn", r)
                by_handle[self.processes[r].sentinel] = ("exit", r)
            ready = wait_any(list(by_handle), timeout=limit)
            # Messages first: a rank that sent its result and exited shows both at once.
            for handle in sorted(ready, key=lambda h: by_handle[h][0] != "conn"):
                what, r = by_handle[handle]
                if what == "conn":
                    if self._receive(r, on_message):
                        last_news = time.monotonic()
                    continue
                self._drain(r, on_message)
                if not self._finished(r):
                    p = self.processes[r]
                    p.join(1.0)
                    self._errors.append(RankError(
                        r, "died", "RankDied",
                        f"rank {r} exited with code {p.exitcode} without reporting an error",
                        exitcode=p.exitcode))
        if self._errors:
            raise RanksFailed(self._errors, self.log_dir)
        return [self._results[r] for r in range(self.world_size)]

    def stop(self, grace: float = 5.0, finish: float = 0.0) -> None:
        """End every rank still running: wait up to ``finish`` seconds for ranks to exit on their
        own, then SIGTERM, then SIGKILL after ``grace`` seconds; closes the connections."""
        deadline = time.monotonic() + finish
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for i, conn in enumerate(self._conns):
            if conn is not None:
                conn.close()
                self._conns[i] = None

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                env: Optional[Mapping[str, str]] = None, backend: Optional[str] = None,
                log_dir: Optional[str] = None, name: str = "ds-z3native-rank") -> Ranks:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)`` (see the module
    doc); the processes are named ``<name><rank>``. ``env`` is set in each rank before ``fn``
    runs (after ``fn``'s module is imported: what is read at import must be in this process's
    environment)."""
    if world_size < 1:
        raise ValueError(f"start_ranks: world_size must be at least 1, got {world_size}")
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    target = _Target(fn, tuple(args), world_size, free_port(), dict(env or {}), backend, log_dir)
    processes, conns = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(target, rank, writer), name=f"{name}{rank}",
                            daemon=False)
            processes.append(p)
            conns.append(reader)
            p.start()
            writer.close()  # the rank holds the only writer: its exit closes the pipe
    except BaseException:
        Ranks(processes, conns, log_dir).stop(grace=1.0)
        raise
    log.debug("started %d rank(s) of %s on port %d", world_size, getattr(fn, "__qualname__", fn),
              target.port)
    return Ranks(processes, conns, log_dir)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              env: Optional[Mapping[str, str]] = None, backend: Optional[str] = None,
              timeout: Optional[float] = 300.0, idle_timeout: Optional[float] = None,
              log_dir: Optional[str] = None, name: str = "ds-z3native-rank",
              on_message: Optional[Callable[[int, Any], None]] = None,
              finish: float = 30.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; their results in rank order.
    RanksFailed (every rank stopped) when one raises or dies or time runs out. After the last
    result the ranks get ``finish`` seconds to exit before they are stopped. Where a rank could
    not join the process group because another process took its port first, the ranks start
    again on another port (at most ``PORT_ATTEMPTS`` times): no rank had run ``fn``."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        ranks = start_ranks(fn, world_size, *args, env=env, backend=backend, log_dir=log_dir,
                            name=name)
        ok = False
        try:
            results = ranks.wait(timeout=timeout, idle_timeout=idle_timeout,
                                 on_message=on_message)
            ok = True
            return results
        except RanksFailed as e:
            if attempt == PORT_ATTEMPTS or not any(err.port_in_use for err in e.errors):
                raise
            log.info("run_ranks: %s; starting the ranks again on another port (attempt %d of "
                     "%d)", e.first.summary, attempt + 1, PORT_ATTEMPTS)
        finally:
            ranks.stop(finish=finish if ok else 0.0)
    raise AssertionError("unreachable")  # the last attempt returned or raised
