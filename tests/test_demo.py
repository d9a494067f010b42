"""``ds-z3native demo``: the README's first command trains, ``--without-fix`` shows DeepSpeed's
failure where DeepSpeed has it, and the launcher refuses, times out and cleans up as it says.

The demo runs as a user runs it (a subprocess of the console script / ``python -m``), on the
DeepSpeed importable here; the ``deepspeed`` tests run on DeepSpeed 0.19.8 and again on 0.19.2.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEMO_TIMEOUT = 300


def _ds_version() -> Version:
    deepspeed = pytest.importorskip("deepspeed")
    return Version(Version(deepspeed.__version__.split("+")[0]).base_version)


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("DS_Z3NATIVE", None)
    # The console script lives beside the interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env


def _run(cmd: List[str], extra_env: Optional[Dict[str, str]] = None,
         timeout: float = DEMO_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(extra_env), capture_output=True, text=True,
                          timeout=timeout)


def _readme_demo_command() -> str:
    """The last step of the README's first command (what runs the demo)."""
    from test_cli_readme import readme_commands

    return readme_commands()[0].split("&&")[-1].strip()


def _losses(stdout: str) -> List[float]:
    match = re.search(r"^\s*loss by step\s+(.+)$", stdout, re.M)
    assert match, f"no 'loss by step' line in:\n{stdout}"
    return [float(v) for v in match.group(1).split()]


def _show(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-4000:]}"


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.release_matrix
def test_readme_demo_command_shows_the_gain(tmp_path: Path) -> None:
    """The README's demo command, as written (plus --json): DeepSpeed alone, then with
    ds_z3native, 2 gloo ranks, ZeRO-3, non-reentrant checkpointing; under DeepCompile where this
    DeepSpeed runs it on the CPU (0.19.4 on), else eager. Exit 0; with ds_z3native every loss is
    finite and the loss falls; DeepSpeed alone fails where this release needs the fix
    (DeepCompile, or eager before 0.19.3) and trains where it does not, and the gain line says
    which."""
    from ds_z3native.demo import DemoOptions, compare_options

    command = _readme_demo_command()
    assert command.startswith("ds-z3native demo") and "--compare" in command.split(), command
    path = tmp_path / "demo.json"
    r = _run(shlex.split(command) + ["--json", str(path)])
    assert r.returncode == 0, _show(r)
    data = json.loads(path.read_text())
    alone, fixed = data["alone"], data["with_ds_z3native"]
    deepcompile = compare_options(DemoOptions(device="cpu")).deepcompile
    assert deepcompile == (_ds_version() >= Version("0.19.4")), _ds_version()
    assert fixed["options"]["deepcompile"] == alone["options"]["deepcompile"] == deepcompile
    assert fixed["exit_code"] == 0 and fixed["error"] is None, _show(r)
    losses = fixed["losses"]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses), losses
    assert min(losses[-5:]) < losses[0] - 0.5, f"the LoRA adapters did not learn: {losses}"
    assert re.search(r"^\s*outcome\s+(FAILED.*?|OK)\s{2,}OK$", r.stdout, re.M), _show(r)
    assert re.search(r"^\s*steps\s+\d+ of 20\s+20 of 20$", r.stdout, re.M), _show(r)
    version = re.escape(fixed["deepspeed_version"])
    if deepcompile or _ds_version() < Version("0.19.3"):
        assert alone["exit_code"] == 1 and alone["error"] is not None, alone
        assert re.search(rf"^gain: with ds_z3native this run trains; DeepSpeed {version} alone "
                         r"fails \(\w+", r.stdout, re.M), _show(r)
        if not deepcompile:
            assert alone["error"]["type"] == "CheckpointError", alone["error"]
            assert re.search(r"^why: DeepSpeed 0\.19\.\d's ZeRO-3 frees frozen params",
                             r.stdout, re.M), _show(r)
    else:
        assert alone["exit_code"] == 0 and len(alone["losses"]) == 20, alone
        assert re.search(rf"^gain: both train: DeepSpeed {version} runs this without "
                         r"ds_z3native; steady step [0-9.]+ s alone", r.stdout, re.M), _show(r)
    # tqdm's bar on stderr, with the step's loss, step time and peak memory (MiB or GiB: a
    # DeepCompile rank on a newer torch passes 1 GiB).
    assert re.search(r"LoRA fine-tune: 100%.*20/20.*step 20 loss [0-9.]+ [0-9.]+s/step peak RSS "
                     r"[0-9.]+ [MG]iB", r.stderr), r.stderr[-2000:]
    first = 7 if deepcompile else 2  # after DeepCompile's re-plan at step 6
    assert re.search(rf"^\s*step time, median\s+.*\s[0-9.]+ s \(steps {first}-20\)$",
                     r.stdout, re.M), _show(r)
    # The fix line counts install()'s patches by group (the recompute fix among ZeRO-3's), as
    # many as the start-up line (on stderr, above the bar) says.
    total, groups = _fix_row_groups(r.stdout)
    assert re.search(rf"fix: ds_z3native\.install\(\), {total} patches \(set-up", r.stderr), \
        r.stderr[-2000:]
    assert sum(groups.values()) == total and groups.get("ZeRO-3", 0) >= 1, _show(r)


def test_compare_refuses_without_fix() -> None:
    r = _run([sys.executable, "-m", "ds_z3native", "demo", "--compare", "--without-fix"],
             timeout=120)
    assert r.returncode == 2 and "leave out --without-fix" in r.stderr, _show(r)
    assert r.stdout == "", _show(r)


def test_compare_runs_deepcompile_where_it_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """--compare picks DeepCompile where it runs here (CPU ranks from DeepSpeed 0.19.4), else
    eager; an explicit --deepcompile stays."""
    from ds_z3native import demo

    opts = demo.DemoOptions(device="cpu")
    monkeypatch.setattr(demo, "_deepspeed_version", lambda: Version("0.19.4"))
    assert demo.compare_options(opts).deepcompile
    monkeypatch.setattr(demo, "_deepspeed_version", lambda: Version("0.19.3"))
    assert not demo.compare_options(opts).deepcompile
    forced = demo.DemoOptions(device="cpu", deepcompile=True)
    assert demo.compare_options(forced) is forced


def test_comparison_table_and_gain() -> None:
    """The side-by-side table: each run's outcome (where it failed), steps, losses, median step;
    the failing run's error with why; the gain line from both."""
    from ds_z3native.demo import EXIT_FAILED, Comparison, DemoResult, format_comparison

    options = {"model_size": "small", "steps": 3, "deepcompile": True}
    alone = DemoResult(EXIT_FAILED, options, deepspeed_version="0.19.8", world_size=2,
                       error={"rank": 0, "step": None, "stage": "engine.compile()",
                              "type": "RuntimeError",
                              "message": "Error building extension 'dc': [1/7] c++ -I...\n"
                                         "c++ -MMD ...\nz1.cpp:6: fatal error: cuda.h: No "
                                         "such file or directory\nmore",
                              "why": "because", "traceback": ""})
    fixed = DemoResult(0, options, deepspeed_version="0.19.8", world_size=2,
                       losses=[7.0, 6.0, 5.0], step_seconds=[9.0, 0.5, 0.3])
    text = format_comparison(Comparison(alone, fixed))
    assert re.search(r"^\s*outcome\s+FAILED in engine\.compile\(\): RuntimeError\s+OK$", text,
                     re.M), text
    assert re.search(r"^\s*loss first -> last\s+-\s+7\.0000 -> 5\.0000$", text, re.M), text
    assert re.search(r"^\s*step time, median\s+-\s+0\.400 s \(steps 2-3\)$", text, re.M), text
    assert "DeepSpeed alone: RuntimeError (rank 0 in engine.compile())" in text, text
    # A failed build: what failed and the compiler's first error, not its command lines.
    assert ("  Error building extension 'dc'\n  z1.cpp:6: fatal error: cuda.h: No such file or "
            "directory\nwhy: because") in text, text
    assert "c++" not in text and "more" not in text, text
    assert text.endswith("gain: with ds_z3native this run trains; DeepSpeed 0.19.8 alone fails "
                         "(RuntimeError in engine.compile())"), text
    both = format_comparison(Comparison(
        DemoResult(0, options, deepspeed_version="0.19.3", step_seconds=[9.0, 0.6, 0.6]),
        DemoResult(0, options, deepspeed_version="0.19.3", step_seconds=[9.0, 0.3, 0.3])))
    assert both.endswith("gain: both train: DeepSpeed 0.19.3 runs this without ds_z3native; "
                         "steady step 0.600 s alone, 0.300 s with ds_z3native (2.00x)"), both
    assert Comparison(alone, fixed).exit_code == 0


@pytest.mark.deepspeed
@pytest.mark.slow
def test_without_fix_shows_what_deepspeed_does() -> None:
    """Without install(): DeepSpeed 0.19.0 - 0.19.2 fail with the CheckpointError users see
    (a frozen param recomputed as shape [0]) and the demo says why and exits non-zero; from
    0.19.3 DeepSpeed's own fix makes the run succeed, and the demo says so."""
    r = _run([sys.executable, "-m", "ds_z3native", "demo", "--without-fix", "--device", "cpu",
              "--model-size", "tiny", "--steps", "3", "--no-progress"])
    assert r.returncode in (0, 1), _show(r)
    assert re.search(r"^\s*fix\s+none \(--without-fix\)$", r.stdout, re.M), _show(r)
    if _ds_version() >= Version("0.19.3"):
        assert r.returncode == 0, _show(r)
        assert all(math.isfinite(v) for v in _losses(r.stdout))
        assert "carries its own fix" in r.stdout, _show(r)
    else:
        assert r.returncode == 1, _show(r)
        assert re.search(r"^error \(rank \d at step 1\): CheckpointError$", r.stdout, re.M), \
            _show(r)
        assert re.search(r"recomputed metadata: \{'shape': torch\.Size\(\[0\]\)", r.stdout), \
            _show(r)
        assert re.search(r"^why: DeepSpeed 0\.19\.\d's ZeRO-3 frees frozen params", r.stdout,
                         re.M), _show(r)


def test_deepcompile_on_cpu_runs_where_deepspeed_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed runs DeepCompile on its CPU accelerator from 0.19.4: there ``--deepcompile``
    resolves to CPU ranks; on an older release it is refused with what to install."""
    from ds_z3native import demo

    opts = demo.DemoOptions(deepcompile=True, device="cpu")
    monkeypatch.setattr(demo, "_deepspeed_version", lambda: Version("0.19.4"))
    assert demo._resolve(opts) == (False, 2)
    monkeypatch.setattr(demo, "_deepspeed_version", lambda: Version("0.19.3"))
    with pytest.raises(demo.DemoRefused, match=r"needs DeepSpeed >= 0\.19\.4 \(DeepSpeed 0\.19\.3"):
        demo._resolve(opts)


def test_deepcompile_on_cpu_is_refused_on_old_deepspeed() -> None:
    """On the installed DeepSpeed, if it predates DeepCompile on the CPU: refused before any rank
    starts, exit 2."""
    if _ds_version() >= Version("0.19.4"):
        from ds_z3native import demo

        # The CPU path runs here; its refusal is the other test's. This DeepSpeed's version is
        # read as the demo reads it.
        assert demo._deepspeed_version() == Version(_ds_version().base_version)
        return
    start = time.monotonic()
    r = _run([sys.executable, "-m", "ds_z3native", "demo", "--deepcompile", "--device", "cpu"],
             timeout=120)
    assert r.returncode == 2, _show(r)
    assert "--deepcompile on the CPU needs DeepSpeed >= 0.19.4" in r.stderr, _show(r)
    assert "starting" not in r.stderr and r.stdout == "", _show(r)
    assert time.monotonic() - start < 120


def test_unknown_model_size_is_refused() -> None:
    r = _run([sys.executable, "-m", "ds_z3native", "demo", "--model-size", "huge"], timeout=120)
    assert r.returncode == 2 and "invalid choice: 'huge'" in r.stderr, _show(r)


def test_no_progress_stops_the_ranks() -> None:
    """A run that stops reporting (here: --timeout shorter than the ranks' set-up) fails with a
    clear message and leaves no rank process behind."""
    from ds_z3native.demo import EXIT_FAILED, DemoOptions, format_summary, run_demo

    before = set(multiprocessing.active_children())
    result = run_demo(DemoOptions(steps=2, ranks=2, model_size="tiny", device="cpu",
                                  timeout=1.0, progress=False))
    assert result.exit_code == EXIT_FAILED
    assert result.error is not None and result.error["type"] == "Timeout", result.error
    assert "no progress from the ranks for 1 s" in format_summary(result)
    left = [p for p in multiprocessing.active_children() if p not in before]
    assert left == [], f"rank processes still running: {left}"


def test_a_dead_rank_fails_the_run_and_stops_the_others() -> None:
    """A rank killed from outside (SIGKILL: no error of its own to report) fails the run with
    exit code 1 and a message naming that rank; the other rank is stopped."""
    import signal
    import threading

    from ds_z3native.demo import EXIT_FAILED, DemoOptions, format_summary, run_demo

    before = set(multiprocessing.active_children())
    results = []
    runner = threading.Thread(target=lambda: results.append(run_demo(DemoOptions(
        steps=50, ranks=2, model_size="tiny", device="cpu", progress=False))))
    runner.start()
    deadline = time.monotonic() + 60
    ranks: list = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = sorted((p for p in multiprocessing.active_children()
                        if p not in before and p.name.startswith("ds-z3native-demo-rank")),
                       key=lambda p: p.name)
        time.sleep(0.2)
    assert len(ranks) == 2, ranks
    time.sleep(2)  # let them get going
    os.kill(ranks[1].pid, signal.SIGKILL)
    runner.join(120)
    assert not runner.is_alive()
    result = results[0]
    assert result.exit_code == EXIT_FAILED
    assert result.error is not None and result.error["type"] == "RankDied", result.error
    assert result.error["rank"] == 1
    assert "rank 1 exited with code -9" in format_summary(result)
    assert not ranks[0].is_alive() and ranks[0].exitcode is not None


def _result(step_seconds: List[float], replan_steps: List[int], deepcompile: bool):
    from ds_z3native.demo import EXIT_OK, DemoResult

    return DemoResult(EXIT_OK, {"model_size": "1b", "steps": len(step_seconds),
                                "deepcompile": deepcompile},
                      step_seconds=step_seconds, replan_steps=replan_steps)


def _step_time_row(summary: str) -> str:
    match = re.search(r"^\s*step time\s+(.+)$", summary, re.M)
    assert match, summary
    return match.group(1)


def test_step_time_is_the_median_after_deepcompiles_replan() -> None:
    """DeepCompile compiles at step 1 and again at its scheduled re-plan (step 6 on DeepSpeed
    0.19): the summary reports the median of the steps after the re-plan and names both slow
    steps, not a mean that includes the re-plan."""
    from ds_z3native.demo import format_summary

    times = [186.9, 0.05, 0.04, 0.05, 0.04, 217.3] + [0.031, 0.029, 0.030, 0.9] + [0.030] * 10
    row = _step_time_row(format_summary(_result(times, [0, 5], deepcompile=True)))
    assert row.startswith("0.030 s median of steps 7-20 "), row
    assert "186.90 s first" in row and "217.30 s at DeepCompile's re-plan, step 6" in row, row


def test_step_time_without_deepcompile_is_the_median_after_the_first() -> None:
    from ds_z3native.demo import format_summary

    row = _step_time_row(format_summary(_result([2.5, 1.0, 1.2, 5.0, 1.1], [], False)))
    assert row == "1.150 s median of steps 2-5 (2.50 s first)", row
    row = _step_time_row(format_summary(_result([2.5], [], False)))
    assert row == "no steps after the first to measure (2.50 s first)", row


def test_a_run_that_ends_before_the_replan_says_so() -> None:
    from ds_z3native.demo import format_summary

    row = _step_time_row(format_summary(_result([186.9, 0.05, 0.04], [0, 5], deepcompile=True)))
    assert row == "0.045 s median of steps 2-3 (186.90 s first)", row
    row = _step_time_row(format_summary(_result([186.9] + [0.05] * 4 + [217.3], [0, 5], True)))
    assert row.startswith("no steps after the re-plan to measure"), row


@pytest.mark.deepspeed
def test_the_replan_steps_are_read_from_deepspeeds_pass_schedule() -> None:
    """What the rank reports after engine.compile(): the steps of DeepSpeed's own pass schedule,
    as its init_schedule() stores them."""
    from deepspeed.compile import backend

    from ds_z3native.demo import _deepcompile_replan_steps

    saved = backend.remaining_schedule
    try:
        backend.init_schedule([(0, []), (5, [])])
        assert _deepcompile_replan_steps() == [0, 5]
        backend.remaining_schedule = None  # engine.compile() never ran
        assert _deepcompile_replan_steps() == []
    finally:
        backend.remaining_schedule = saved


def test_a_rank_error_keeps_the_step_and_why_the_rank_sent() -> None:
    """A rank that fails sends its step and why before raising; the launcher's error (type,
    message, traceback) and that context make the summary's error; a timeout is the run's."""
    from ds_z3native.demo import _error_of
    from ds_z3native.launch import RankError

    error = RankError(1, "raised", "CheckpointError", "recomputed shape [0]", "Traceback ...")
    assert _error_of(error, {1: {"kind": "failing", "step": 2, "why": "because"}}, 600) == {
        "rank": 1, "step": 2, "stage": None, "type": "CheckpointError",
        "message": "recomputed shape [0]", "why": "because", "traceback": "Traceback ..."}
    # Before the first step: where (set-up or engine.compile()) instead of the step.
    compiling = _error_of(error, {1: {"kind": "failing", "step": None,
                                      "stage": "engine.compile()", "why": ""}}, 600)
    assert (compiling["step"], compiling["stage"]) == (None, "engine.compile()")
    died = RankError(0, "died", "RankDied", "rank 0 exited with code -9 without reporting an "
                     "error", exitcode=-9)
    assert _error_of(died, {}, 600)["step"] is None
    timeout = RankError(None, "timeout", "Timeout", "ranks [0, 1] sent nothing for 600 s")
    assert _error_of(timeout, {}, 600)["message"] == "no progress from the ranks for 600 s"


def _fix_row_groups(summary: str) -> Tuple[int, Dict[str, int]]:
    """(patches, {group: patches}) of a summary's fix row."""
    match = re.search(r"^\s*fix:?\s+ds_z3native\.install\(\), (\d+) patch(?:es)?: (.+); names in "
                      r"--json$", summary, re.M)
    assert match, summary
    groups = dict((g, int(n)) for g, n in re.findall(r"([^,(]+?) \((\d+)\)(?:, |$)",
                                                      match.group(2)))
    return int(match.group(1)), groups


def test_the_fix_row_counts_the_patches_by_what_they_fix() -> None:
    """The summary's fix row: install()'s patches counted per group of the module that holds them
    (every deepcompile_* module is DeepCompile's), the largest group first; the names stay in the
    result's fix (what --json writes)."""
    import importlib

    from ds_z3native.compat.registry import PATCH_MODULES, patches_for
    from ds_z3native.demo import format_summary

    names = [p.name for p in patches_for(Version("0.19.8"))]
    result = _result([1.0, 0.5], [], False)
    result.fix = "ds_z3native.install(): " + ", ".join(names)
    summary = format_summary(result)
    total, groups = _fix_row_groups(summary)
    assert total == len(names) and sum(groups.values()) == total, summary
    in_deepcompile_modules = [p.name for m in PATCH_MODULES if m.split(".")[-1].startswith(
        "deepcompile_") for p in importlib.import_module(m).PATCHES if p.name in names]
    assert groups["DeepCompile"] == len(in_deepcompile_modules), groups
    assert groups["HF Trainer"] == 3 and "other" not in groups, groups
    assert list(groups.values()) == sorted(groups.values(), reverse=True), groups
    assert max(len(line) for line in summary.splitlines()) < 200, summary
    assert all(name in result.to_json()["fix"] for name in names)
    # Not install()'s patches: shown as they are.
    for fix in ("none (--without-fix)", "ds_z3native.install(): no patches"):
        result.fix = fix
        assert re.search(rf"^\s*fix\s+{re.escape(fix)}$", format_summary(result), re.M)
    # A name no patch module holds is counted, as "other".
    result.fix = "ds_z3native.install(): deepcompile-z3-declare-frozen, not-a-patch"
    assert _fix_row_groups(format_summary(result)) == (2, {"DeepCompile": 1, "other": 1})


def test_every_patch_module_has_a_fix_group() -> None:
    """A new patch module gets a group of the summary's fix row (not its bare module name)."""
    from ds_z3native.compat.registry import OPTIONAL_MODULES, PATCH_MODULES
    from ds_z3native.demo import _FIX_GROUPS, _fix_group

    groups = set(_FIX_GROUPS.values()) | {"DeepCompile"}
    for module in PATCH_MODULES + OPTIONAL_MODULES:
        assert _fix_group(module.rsplit(".", 1)[-1]) in groups, module


def test_the_start_up_line_counts_the_patches_the_summary_names() -> None:
    from ds_z3native.demo import _fix_shown

    fix = "ds_z3native.install(): deepcompile-z3-declare-frozen, checkpoint-recompute-hardening"
    assert _fix_shown(fix, 2) == "ds_z3native.install(), 2 patches"
    assert _fix_shown("ds_z3native.install(): zero3-walks", 1) == "ds_z3native.install(), 1 patch"
    for unchanged in ("none (--without-fix)", "ds_z3native.install(): no patches"):
        assert _fix_shown(unchanged, 0) == unchanged
