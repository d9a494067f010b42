"""``bench/core/runner.py``'s ``run_command``: a hung command is stopped with its tracebacks and
its children, and a process's output is echoed as it comes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package


def test_a_hung_command_is_stopped_with_its_tracebacks_and_its_children(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A launcher-like parent whose child (a rank, in a session of its own as torchrun starts
    # them) never ends: past the timeout both are gone, and the log (echoed to the caller) holds
    # each one's traceback.
    from bench.core.runner import Command, _alive, run_command

    pid_file = tmp_path / "child.pid"
    child = "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(3600)" % str(pid_file)
    parent = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r], "
              "start_new_session=True); time.sleep(3600)" % child)
    env = {"PYTHONFAULTHANDLER": "0"}  # no setting switches the tracebacks off
    with caplog.at_level("INFO", logger="bench.core.runner"):
        code = run_command(Command([sys.executable, "-c", parent], label="hangs", env=env),
                           tmp_path, timeout=4.0, progress_every=1.0)
    assert code == 124
    child_pid = int(pid_file.read_text())
    assert not _alive(child_pid)  # killed (at most a zombie until its new parent reaps it)
    log_text = (tmp_path / "hangs.log").read_text()
    # Both processes printed their traceback (they share the log, so the lines may interleave).
    assert log_text.count("Aborted") == 2 and log_text.count("<module>") == 2, log_text
    assert "stopped after" in caplog.text and "Aborted" in caplog.text


def test_run_command_echoes_the_process_output_as_it_comes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from bench.core.runner import Command, run_command

    script = "import sys, time; print('step 1', flush=True); time.sleep(0.2); print('step 2')"
    with caplog.at_level("INFO", logger="bench.core.runner"):
        code = run_command(Command([sys.executable, "-c", script], label="echoed"), tmp_path,
                           timeout=60.0, echo=True)
    assert code == 0
    assert "echoed | step 1" in caplog.text and "echoed | step 2" in caplog.text
    assert (tmp_path / "echoed.log").read_text() == "step 1\nstep 2\n"  # the log file still
    caplog.clear()
    with caplog.at_level("INFO", logger="bench.core.runner"):
        run_command(Command([sys.executable, "-c", script], label="quiet"), tmp_path, timeout=60.0)
    assert "quiet | step" not in caplog.text and "step 2" in (tmp_path / "quiet.log").read_text()
