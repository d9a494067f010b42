"""``ds_z3native.launch``: the one launcher of multi-rank runs (demo, self-test, benchmarks, the
tests' ``run_ranks``). Results come back in rank order with the launcher environment set; a rank
that raises, dies or hangs fails the run with an error naming it, and no rank is left running."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from ds_z3native import launch
from ds_z3native._net import free_port
from ds_z3native.launch import RanksFailed, run_ranks


def _report(rank: int, world_size: int, tag: str) -> Dict[str, Any]:
    launch.send({"rank": rank, "tag": tag})
    print(f"rank {rank} writes to its log")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "LAUNCH_TEST")
    return {"rank": rank, "world_size": world_size, "tag": tag,
            "env": {k: os.environ.get(k) for k in keys}}


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad value 42 on purpose")
    time.sleep(120)  # must be stopped by the launcher


def _rank0_dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)
    time.sleep(120)


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(120)


def _gloo_sum(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _ours(before: set) -> List[Any]:
    return [p for p in multiprocessing.active_children() if p not in before]


def test_results_env_messages_and_logs(tmp_path: Path) -> None:
    messages: List[Tuple[int, Any]] = []
    results = run_ranks(_report, 2, "x", env={"LAUNCH_TEST": "yes"}, timeout=120,
                        log_dir=str(tmp_path), on_message=lambda r, m: messages.append((r, m)))
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
    env0, env1 = results[0]["env"], results[1]["env"]
    assert env0["RANK"] == env0["LOCAL_RANK"] == "0" and env1["RANK"] == "1"
    assert env0["WORLD_SIZE"] == env0["LOCAL_WORLD_SIZE"] == "2"
    assert env0["MASTER_ADDR"] == "127.0.0.1" and env0["MASTER_PORT"] == env1["MASTER_PORT"]
    assert env0["LAUNCH_TEST"] == "yes"
    assert "LAUNCH_TEST" not in os.environ  # set in the ranks only
    assert sorted(messages, key=lambda m: m[0]) == [(0, {"rank": 0, "tag": "x"}),
                                                    (1, {"rank": 1, "tag": "x"})]
    assert "rank 1 writes to its log" in (tmp_path / "rank1.log").read_text()


def test_a_raising_rank_is_named_and_the_others_are_stopped() -> None:
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_rank1_raises, 2, timeout=120)
    assert time.monotonic() - start < 60  # rank 0 was stopped, not waited for
    first = info.value.first
    assert (first.rank, first.kind, first.type) == (1, "raised", "ValueError")
    assert "bad value 42 on purpose" in first.message and "_rank1_raises" in first.traceback
    assert str(info.value).startswith("rank 1: ValueError: bad value 42 on purpose")
    assert first.summary == "rank 1: ValueError: bad value 42 on purpose"
    assert _ours(before) == []


def test_a_dead_rank_is_named_with_its_exit_code() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(RanksFailed) as info:
        run_ranks(_rank0_dies, 2, timeout=120)
    first = info.value.first
    assert (first.rank, first.kind, first.exitcode) == (0, "died", 7)
    assert "rank 0 exited with code 7 without reporting an error" in str(info.value)
    assert _ours(before) == []


def test_a_hang_times_out_and_every_rank_is_stopped() -> None:
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"ranks \[0, 1\] did not finish within 3 s"):
        run_ranks(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 60
    assert _ours(before) == []
    with pytest.raises(RanksFailed, match=r"ranks \[0\] sent nothing for 2 s"):
        run_ranks(_hangs, 1, timeout=None, idle_timeout=2)
    assert _ours(before) == []


def test_a_process_group_on_request() -> None:
    assert run_ranks(_gloo_sum, 2, backend="gloo", timeout=120) == [3.0, 3.0]


def test_send_outside_a_rank_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not a rank started by ds_z3native.launch"):
        launch.send("hello")
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        launch.start_ranks(_hangs, 0)


def _unpicklable(rank: int, world_size: int) -> Any:
    return lambda: rank  # a lambda does not pickle


def test_a_result_that_does_not_pickle_fails_naming_the_rank() -> None:
    with pytest.raises(RanksFailed, match=r"rank 0: .*could not send the rank's result"):
        run_ranks(_unpicklable, 1, timeout=120)


def _taken_ports(count: int) -> Tuple[List[Any], List[int]]:
    """``count`` listening sockets on 127.0.0.1 and their ports."""
    import socket

    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        socks.append(s)
    return socks, [s.getsockname()[1] for s in socks]


def test_a_port_taken_before_the_ranks_bind_it_is_replaced(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # free_port() only says a port was free a moment ago: another process (a rank of another
    # run, a connection's ephemeral port) can take it first. The ranks start again on another.
    socks, ports = _taken_ports(1)
    chosen = iter(ports)
    monkeypatch.setattr(launch, "free_port", lambda: next(chosen, None) or free_port())
    try:
        with caplog.at_level("INFO", logger="ds_z3native.launch"):
            assert run_ranks(_gloo_sum, 2, backend="gloo", timeout=120) == [3.0, 3.0]
    finally:
        for s in socks:
            s.close()
    assert "starting the ranks again on another port (attempt 2 of 3)" in caplog.text


def test_a_port_taken_every_time_fails_after_the_last_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    socks, ports = _taken_ports(launch.PORT_ATTEMPTS)
    chosen = iter(ports)
    monkeypatch.setattr(launch, "free_port", lambda: next(chosen))
    try:
        with pytest.raises(RanksFailed) as failed:
            run_ranks(_gloo_sum, 2, backend="gloo", timeout=120)
    finally:
        for s in socks:
            s.close()
    assert failed.value.first.port_in_use and failed.value.first.phase == "init"
    assert len(list(chosen)) == 0  # one port per attempt, no more
    monkeypatch.undo()
    # A rank failing in its own code is never restarted, whatever its message says.
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_rank1_raises, 2, timeout=60)
    assert not any(e.port_in_use for e in failed.value.errors)


_KEPT: List[Any] = []


def _makes_a_semaphore(rank: int, world_size: int) -> int:
    # What tqdm does for its lock (torch.fx's interpreter builds a tqdm bar in every compile)
    # where the start method is spawn: a named semaphore, registered with the parent's resource
    # tracker.
    lock = multiprocessing.get_context("spawn").RLock()
    _KEPT.append(lock)  # alive until the rank ends, as tqdm's class attribute is
    with lock:
        return rank


def test_a_rank_leaves_no_semaphore_for_the_parents_tracker_to_report() -> None:
    """A rank ends with os._exit, which skips multiprocessing's exit finalizers: the named
    semaphores it made are removed first, so the resource tracker, which the parent shares, has
    nothing to report as leaked when the parent exits (a warning under every DeepCompile demo)."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); "
            "from test_launch import _makes_a_semaphore; "
            "from ds_z3native.launch import run_ranks; "
            "print(run_ranks(_makes_a_semaphore, 2))")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[0, 1]", r.stderr
    assert "leaked semaphore" not in r.stderr, r.stderr
