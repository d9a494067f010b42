"""``bench/lora_llama.py --take-turns DIR:N``: processes started together compile side by side,
then run their timed steps one at a time, so two variants are compared on one machine, one GPU
and one time span without their timed steps overlapping (here: two eager toy runs on the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest

from helpers.env import without_autoload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench.lora_llama import Turns, _parse  # noqa: E402


def _env() -> Dict[str, str]:
    return without_autoload(DS_ACCELERATOR="cpu")


def _pair(tmp_path: Path, take_turns: str, steps: int) -> Dict[str, Dict]:
    """Two eager toy runs (``none`` and ``ours``) started together with ``--take-turns
    <tmp_path>/turns:<take_turns>``; their records by variant."""
    procs = {}
    for variant in ("none", "ours"):
        procs[variant] = subprocess.Popen(
            [sys.executable, "bench/lora_llama.py", "--variant", variant, "--size", "toy",
             "--steps", str(steps), "--warmup", "1", "--seq", "32", "--micro-batch", "1",
             "--no-track-gathered", "--take-turns", f"{tmp_path / 'turns'}:{take_turns}",
             "--run", "pair", "--output", str(tmp_path / f"{variant}.json")],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {v: p.communicate(timeout=600)[0] for v, p in procs.items()}
    for v, p in procs.items():
        assert p.returncode == 0, logs[v][-3000:]
    return {v: json.loads((tmp_path / f"{v}.json").read_text()) for v in procs}


def test_two_runs_take_turns_for_their_timed_steps(tmp_path: Path) -> None:
    records = _pair(tmp_path, "2", steps=8)
    windows = sorted((r["turns"]["window"], v) for v, r in records.items())
    (first, first_v), (second, second_v) = windows
    assert all(w[0] < w[1] for w, _ in windows), windows
    assert first[1] <= second[0], f"timed windows overlap: {windows}"
    # The second waited for the first's turn (its lock), not merely for it to get ready: all of
    # the first's window but what the ready poll (every 0.2 s) may have let it see later.
    assert records[second_v]["turns"]["turn_wait_s"] >= (first[1] - first[0]) - 0.25, windows
    for r in records.values():
        assert r["turns"]["processes"] == 2 and r["step_ms"]["n"] == 8


def test_runs_interleave_their_timed_steps_a_turn_at_a_time(tmp_path: Path) -> None:
    """``DIR:N:K``: K timed steps per turn, the processes alternating in a fixed order, every
    turn's window apart from the others'."""
    records = _pair(tmp_path, "2:2", steps=5)
    spans = sorted((w[0], w[1], v) for v, r in records.items() for w in r["turns"]["windows"])
    for r in records.values():
        t = r["turns"]
        # 5 timed steps at 2 a turn: 3 turns, the last also holding the end of the run.
        assert t["steps_per_turn"] == 2 and len(t["windows"]) == 3 and r["step_ms"]["n"] == 5
        assert t["window"] == [t["windows"][0][0], t["windows"][-1][1]]
    assert all(a[2] != b[2] for a, b in zip(spans, spans[1:])), f"turns did not alternate: {spans}"
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"turns overlap: {spans}"


def test_a_partner_that_ends_between_its_turns_fails_the_other(tmp_path: Path) -> None:
    gone = _ended_pid()
    t = Turns(tmp_path, 2, timeout=600, per_turn=1)
    (tmp_path / f"started-{gone}").touch()
    (tmp_path / f"ready-{gone}").touch()
    (tmp_path / "ticket").write_text("0" if int(gone) < os.getpid() else "1")  # its turn
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"process {gone} ended between its turns"):
        t.take()
    assert time.perf_counter() - start < 30


def _ended_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_partner_that_never_gets_ready_fails_with_how_many_were(tmp_path: Path) -> None:
    t = Turns(tmp_path, 2, timeout=0.5)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"only 1 of 2 processes reached their timed steps"):
        t.take()
    assert time.perf_counter() - start < 30


def test_a_partner_that_ends_before_its_turn_fails_the_others_at_once(tmp_path: Path) -> None:
    t = Turns(tmp_path, 2, timeout=600)
    gone = _ended_pid()
    (tmp_path / f"started-{gone}").touch()  # started, then crashed while compiling
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"process {gone} ended before its timed steps"):
        t.take()
    assert time.perf_counter() - start < 30  # not the 600 s timeout


def test_a_partner_that_ran_its_turn_and_ended_still_counts_as_ready(tmp_path: Path) -> None:
    t = Turns(tmp_path, 2, timeout=5)
    done = _ended_pid()
    (tmp_path / f"started-{done}").touch()
    (tmp_path / f"ready-{done}").touch()  # it was ready, took its turn first and exited
    t.take()
    t.give_back()
    assert t.record["ready_wait_s"] < 5


def test_a_folder_with_marks_of_ended_processes_is_refused(tmp_path: Path) -> None:
    (tmp_path / f"ready-{_ended_pid()}").touch()
    with pytest.raises(RuntimeError, match=r"holds marks of processes that ended .*new folder"):
        Turns(tmp_path, 2)


def test_one_process_takes_its_turn_at_once_and_gives_it_back(tmp_path: Path) -> None:
    t = Turns(tmp_path, 1)
    t.take()
    other = Turns(tmp_path, 1, timeout=5)
    import fcntl

    with open(tmp_path / "turn.lock", "a") as probe:  # held: a second lock is refused
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    t.give_back()
    other.take()  # free again
    other.give_back()
    start, end = t.record["window"]
    assert start <= end


@pytest.mark.parametrize("bad", ["/tmp/x", "/tmp/x:0", ":2", "/tmp/x:two", "/tmp/x:2:0"])
def test_take_turns_wants_a_folder_and_a_count(bad: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parse(["--variant", "none", "--output", "x.json", "--take-turns", bad])
    assert "expected DIR:N with N >= 1 (or DIR:N:K" in capsys.readouterr().err


def test_take_turns_reads_steps_per_turn() -> None:
    args = _parse(["--variant", "none", "--output", "x.json", "--take-turns", "/tmp/a:b:3:4"])
    assert args.take_turns == (Path("/tmp/a:b"), 3, 4)
    assert _parse(["--variant", "none", "--output", "x.json",
                   "--take-turns", "/tmp/a:3"]).take_turns == (Path("/tmp/a"), 3, None)


def test_the_documented_pair_commands_parse() -> None:
    """docs/benchmarks.md's side-by-side commands (a GPU run) are valid lora_llama.py command lines
    (the run above is the same mechanism at toy size on the CPU)."""
    import re
    import shlex


    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "--take-turns" in b)
    lines = [c for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert lines[0].strip() == "turns=$(mktemp -d)"  # a new folder for each pair
    commands = [shlex.split(c.replace("&", "").replace("; wait", "")) for c in lines[1:]]
    runs = [c for c in commands if c[2:3] != ["merge"]]
    assert len(runs) == 2 and all(c[:2] == ["python", "bench/lora_llama.py"] for c in commands)
    for c in runs:
        args = _parse(c[2:])
        assert args.take_turns is not None and args.take_turns[1] == len(runs)
    assert {_parse(c[2:]).variant for c in runs} == {"trainer-dc-ckpt", "dc-ckpt"}
