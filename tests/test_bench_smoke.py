"""The benchmark suite on CPU: the native microbenchmark's smoke run writes a complete result,
the full tables of docs/benchmarks.md and the README's summary are regenerated from result JSON
and idempotently, and both entry points (``python -m bench``, ``ds-z3native bench``) answer
``--help``.

Timings are not asserted (CPU smoke numbers mean nothing); structure and counts are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from ds_z3native.settings import PROFILE_STORE_ENV, SINGLE_CYCLE_ENV
from helpers.env import without_autoload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench import report  # noqa: E402
from bench.native_micro import MicroConfig, make_params  # noqa: E402

VERSION_KEYS = {"torch", "deepspeed", "transformers", "peft", "ds_z3native", "cuda"}


def _env() -> Dict[str, str]:
    return without_autoload(DS_ACCELERATOR="cpu")


def _bench(*argv: str) -> subprocess.CompletedProcess:
    """``python -m bench *argv`` run in this process, in the environment of ``_env()``: its exit
    code, stdout and stderr. The entry points' own ``main`` (``test_bench_help`` starts them as
    processes); a plan or a refusal needs no process of its own, nor the seconds a loaded CI
    machine takes to import torch and DeepSpeed again for each."""
    from unittest import mock

    from bench.core.cli import main

    out, err = io.StringIO(), io.StringIO()
    handlers, level = list(logging.root.handlers), logging.root.level  # main() calls basicConfig
    try:
        with mock.patch.dict(os.environ, _env(), clear=True), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's refusals
                code = e.code if isinstance(e.code, int) else 2
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    return subprocess.CompletedProcess(["python", "-m", "bench", *argv], code, out.getvalue(),
                                       err.getvalue())


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run([sys.executable, "-m", "bench", "native_micro", "--smoke", "--output-dir",
                        str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "native_micro: done" in r.stderr  # progress goes through logging
    return json.loads((out / "native_micro.json").read_text())


def test_native_micro_smoke_writes_the_result_format(micro: Dict[str, Any]) -> None:
    assert micro["bench"] == "native_micro" and micro["mode"] == "smoke" and micro["schema"] == 1
    assert VERSION_KEYS <= set(micro["versions"])
    setup = micro["setup"]
    assert setup["params"] == 500 and setup["frozen"] == 450 and setup["trainable"] == 50
    assert setup["ranks"] == 2 and setup["graphs"] == 1
    ours = micro["runs"]["ours"]
    assert ours["status"] == "ok", ours.get("error")
    for key in ("step_ms", "forward_gather_ms", "backward_gather_reduce_ms"):
        stats = ours[key]
        assert stats["min"] <= stats["median"] <= stats["max"] and stats["n"] == setup["steps"]
    assert ours["peak_gib"] > 0 and ours["peak_kind"]
    # The op calls' own host cost, for a kept (persistent) param and a gathered one.
    assert set(ours["per_call_us"]) == {"kept", "gathered"}
    assert all(us > 0 for us in ours["per_call_us"].values())
    assert micro["baseline"] in micro["runs"]
    assert ours["ratio"]["step_ms"] > 0
    ds = micro["runs"]["deepspeed"]
    if ds["status"] != "ok":  # CPU: DeepSpeed's op needs CUDA; the reason is recorded
        assert ds["status"] == "not_available" and ds["reason"]
        assert ds["ratio"] is None


def test_native_micro_counts_collectives(micro: Dict[str, Any]) -> None:
    setup = micro["setup"]
    col = micro["runs"]["ours"]["collectives"]
    assert col["source"] == "comm_stats()" and col["timed_steps_identical"] is True
    first, later = col["first_step"], col["later_step"]
    count = setup["count"]
    # Every trainable param is reduced once per step: one reduce-scatter each.
    assert first["reduce_scatter_calls"] == later["reduce_scatter_calls"] == setup["trainable"]
    assert later["bucket_flushes"] >= 1
    # Persistent frozen params: gathered at the first step only.
    per_first, per_later = col["per_category"]["first_step"], col["per_category"]["later_step"]
    assert per_first["persistent_frozen"]["allgather_calls"] == count["persistent_frozen"]
    assert per_later["persistent_frozen"]["allgather_calls"] == 0
    pf = col["persistent_frozen_allgather_bytes"]
    assert pf["first_step"] > 0 and pf["later_step"] == 0
    # Non-persistent params: gathered in forward and again in backward, every step.
    for cat in ("frozen", "trainable"):
        assert per_later[cat]["allgather_calls"] == 2 * count[cat]
    assert first["allgather_calls"] - later["allgather_calls"] == count["persistent_frozen"]


def test_the_counted_first_step_is_never_timed() -> None:
    with pytest.raises(ValueError, match="warmup >= 1"):
        MicroConfig(warmup=0)


def test_the_nccl_log_count_runs_on_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU run counts DeepSpeed's collectives in a separate untimed run (NCCL's COLL log):
    that run must start from the benchmark's own config. On gloo NCCL logs nothing, so the
    count reports zero steps found, not a failed run (on a CUDA machine a ValueError from a
    config without warm-up stopped the whole benchmark after both timed runs)."""
    from bench.native_micro import _count_with_nccl_log

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # Few params on one rank: each gather is preceded by a 31 MB marker all-reduce.
    cfg = dataclasses.replace(MicroConfig.for_mode(smoke=True), n_params=20, ranks=1)
    counted = _count_with_nccl_log("ours", cfg, timeout=300)
    assert counted == {"source": "NCCL COLL log", "error": "found 0 step(s) in NCCL's log"}


def test_params_are_deterministic_and_mixed() -> None:
    cfg = MicroConfig.for_mode(smoke=True)
    a, b = make_params(cfg), make_params(cfg)
    assert a == b and len(a) == 500
    assert sum(p.frozen for p in a) == 450
    assert len({p.shape for p in a}) >= 5


def _fixture_results(d: Path) -> None:
    first = {"bench": "deepcompile_first_step", "mode": "full", "runs": {
        "ours@0.19.8": {"first_step_s": {"median": 5.0, "min": 4.5, "max": 5.5, "n": 3}},
        "deepspeed-jit@0.19.8": {"first_step_s": {"median": 50.0, "min": 49, "max": 51, "n": 3}},
        "ours@0.19.2": {"first_step_s": {"median": 5.4, "min": 5.4, "max": 5.4, "n": 1}},
        "deepspeed-jit@0.19.2": {"status": "failed", "error": "KeyError: 0",
                                 "error_where": "engine.compile()"}}}
    # bench/lora_llama.py merge output: no ratios, no status, one failed run, fields missing.
    lora = {"bench": "lora_llama", "runs": {
        "upstream@0.19.8": {"variant": "upstream", "step_ms": {"median": 200.0, "min": 190.0,
                                                               "max": 210.0},
                            "peak_gib": 20.0, "versions": {"deepspeed": "0.19.8"},
                            "setup": {"dtype": "bf16", "world_size": 1, "micro_batch": 4,
                                      "seq": 1024, "model": {"params": 960_000_000,
                                                             "lora_r": 16}}},
        "ours@0.19.2": {"variant": "ours", "step_ms": {"median": 180.0, "min": 175.0,
                                                       "max": 190.0},
                        "peak_gib": 18.0, "tokens_per_s": 22755.5, "tflops": 150.2,
                        "peak_share": 0.152, "versions": {"deepspeed": "0.19.2"}},
        "upstream@0.19.2": {"variant": "upstream", "error": "Traceback ...\nCheckpointError: x",
                            "versions": {"deepspeed": "0.19.2"}}}}
    (d / "deepcompile_first_step.json").write_text(json.dumps(first))
    (d / "lora_llama.json").write_text(json.dumps(lora))
    (d / "native_micro.json").write_text(json.dumps({"bench": "native_micro", "mode": "smoke",
                                                     "runs": {}}))
    (d / "notes.json").write_text(json.dumps({"something": "else"}))


def test_report_regenerates_the_tables_and_the_summary_idempotently(tmp_path: Path) -> None:
    _fixture_results(tmp_path)
    readme, tables = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    tables.parent.mkdir()
    head, tail = "# t\n\n## Results\n\nintro\n\n", "\n\nafter the summary\n"
    readme.write_text(f"{head}{report.SUMMARY_BEGIN}\nstale\n{report.SUMMARY_END}{tail}")
    t_head, t_tail = "# Benchmarks\n\nmethod\n\n", "\n\nafter the tables\n"
    tables.write_text(f"{t_head}{report.BEGIN}\nstale\n{report.END}{t_tail}")
    argv = ["--results-dir", str(tmp_path), "--readme", str(readme), "--tables", str(tables),
            "--no-plot"]
    assert report.main(argv + ["--check"]) == 1  # both blocks stale
    assert report.main(argv) == 0
    once, summary = tables.read_text(), readme.read_text()
    # Only what lies between the markers changes.
    assert once.startswith(t_head + report.BEGIN) and once.endswith(report.END + t_tail)
    assert summary.startswith(head + report.SUMMARY_BEGIN) and summary.endswith(
        report.SUMMARY_END + tail)
    assert "stale" not in once and "stale" not in summary
    # The full tables.
    assert "| 0.19.8 | 5.00 s (4.50–5.50) | 50.00 s (49.00–51.00) | 10.0x faster |" in once
    assert "| 0.19.2 | 5.40 s | fails: `KeyError: 0` at `engine.compile()` | works vs fails |" in once
    lines = once.splitlines()
    ours = next(ln for ln in lines if ln.startswith("| ours | eager ZeRO-3 + ds_z3native holds | - | 0.19.2 |"))
    # 180 ms against the 200 ms baseline: 1.11x faster
    assert "180.0 (175.0–190.0)" in ours and "1.11x vs" in ours and "22,756" in ours
    assert "15.2%" in ours
    assert any(ln.startswith("| upstream | eager ZeRO-3, DeepSpeed's own | - | 0.19.2 | fails: `CheckpointError: x`")
               for ln in lines)
    assert "Native reduce/gather" not in once  # smoke results are not tabled
    # The summary: the first-step rows, and a link to the tables relative to the README.
    rows = [ln for ln in summary.splitlines() if ln.startswith("| DeepCompile")]
    assert len(rows) == 2 and "| 5.00 s (4.50–5.50) | 50.00 s (49.00–51.00)" in rows[0]
    assert rows[0].endswith("| 10.0x faster | - |")  # the fixture names no date or device
    assert "works vs fails" in rows[1]
    assert "[docs/benchmarks.md](docs/benchmarks.md)" in summary
    # Idempotent, and --check agrees.
    assert report.main(argv) == 0
    assert tables.read_text() == once and readme.read_text() == summary
    assert report.main(argv + ["--check"]) == 0


def test_summary_takes_each_baselines_best_variant_of_the_same_run(tmp_path: Path) -> None:
    from bench.lora_llama import merge

    def record(variant: str, median: float, peak: float, run: str, ckpt: str) -> Path:
        path = tmp_path / f"{variant}-{run}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": peak, "run": run,
            "step_ms": {"median": median, "min": median, "max": median},
            "setup": {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4,
                      "device": "NVIDIA H200", "checkpointing": ckpt,
                      "model": {"params": 963_315_712, "lora_r": 16}}}))
        return path

    results = tmp_path / "results"
    out = results / "lora_llama.json"
    ck, no = "non-reentrant", "none"
    # An older run whose dc-ckpt was faster against its own baseline: replaced below, not shown.
    merge([record("upstream", 1000.0, 4.0, "2026-01-01T00:00:00+00:00", ck),
           record("dc-ckpt", 50.0, 4.0, "2026-01-01T00:00:00+00:00", ck)], out)
    merge([record("upstream", 900.0, 4.0, "2026-02-02T00:00:00+00:00", ck),
           record("ours", 800.0, 4.0, "2026-02-02T00:00:00+00:00", ck),
           record("dc-ckpt", 100.0, 4.4, "2026-02-02T00:00:00+00:00", ck),
           record("none", 600.0, 8.0, "2026-02-02T00:00:00+00:00", no),
           record("plain", 50.0, 10.0, "2026-02-02T00:00:00+00:00", no),  # not ds_z3native
           record("dc", 200.0, 6.0, "2026-02-02T00:00:00+00:00", no),
           # faster, but its run has no `none` of its own: no same-run ratio
           record("dc-upstream", 100.0, 6.0, "2026-03-03T00:00:00+00:00", no)], out)
    summary = report.render_summary(report.load_results(results))
    rows = [ln for ln in summary.splitlines() if ln.startswith("| LoRA")]
    assert len(rows) == 3, summary
    ckpt_row, plain_row, ceiling_row = rows
    assert "checkpointing: non-reentrant" in ckpt_row and "`dc-ckpt`" in ckpt_row
    assert "100.0 ms, 4.40 GiB" in ckpt_row and "`upstream`" in ckpt_row and "900.0 ms" in ckpt_row
    assert "| 9.00x faster, peak 1.10x | 2026-02-02, 1 x NVIDIA H200 |" in ckpt_row
    assert "checkpointing: none" in plain_row and "`dc`" in plain_row and "`plain`" not in plain_row
    assert "3.00x faster, peak 0.75x" in plain_row and "0.96 B Llama, 1 GPU," in plain_row
    # Against plain PyTorch of the same run: the ds_z3native run closest to it (dc-ckpt 2.00x,
    # dc 4.00x).
    assert "against unsharded PyTorch" in ceiling_row and "`dc-ckpt`" in ceiling_row
    assert "| 2.00x the step time, peak 0.44x |" in ceiling_row


def test_report_keeps_the_committed_tables_and_summary() -> None:
    results = report.load_results(ROOT / "bench" / "results")
    block = report.render_block({"deepcompile_first_step": results["deepcompile_first_step"]})
    text = report.TABLES.read_text()
    start = text.index(report.BEGIN) + len(report.BEGIN)
    assert block in text[start:text.index(report.END)]
    assert "| 0.19.8 | 5.29 s | 49.99 s | 9.4x faster |" in block
    # The committed README and docs/benchmarks.md are what the committed results give.
    assert report.main(["--check", "--no-plot"]) == 0
    readme = (ROOT / "README.md").read_text()
    summary = readme[readme.index(report.SUMMARY_BEGIN):readme.index(report.SUMMARY_END)]
    assert "9.4x faster" in summary and "(docs/benchmarks.md)" in summary
    assert "| 1.27x faster (0.79x the step time) |" in summary  # native_micro: 16.40 vs 20.80 ms


def test_report_without_markers_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bench-table:begin"):
        report.replace_block("no markers here\n", "x")
    with pytest.raises(ValueError, match="bench-summary:begin"):
        report.replace_block(f"{report.BEGIN}\n{report.END}\n", "x", report.SUMMARY_BEGIN,
                             report.SUMMARY_END)


def test_plot_or_a_clear_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fixture_results(tmp_path)
    out = report.plot_summary(report.load_results(tmp_path), tmp_path / "summary.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert out is None and "matplotlib is not installed" in caplog.text
    else:
        assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_orders_lora_bars_as_the_table_rows() -> None:
    ok = {"status": "ok", "step_ms": {"median": 1.0}, "peak_gib": 1.0}
    keys = ["dc@0.19.8", "upstream@0.19.8", "ours@0.19.2", "plain@0.19.8", "ours@0.19.8"]
    results = {"lora_llama": {"runs": {k: dict(ok) for k in keys}},
               "native_micro": {"runs": {"ours": dict(ok), "deepspeed": dict(ok)}}}
    rows = {name: [k for k, _ in times] for name, _, times, _ in report._plot_rows(results)}
    assert rows["lora_llama"] == ["plain@0.19.8", "upstream@0.19.8", "ours@0.19.2",
                                  "ours@0.19.8", "dc@0.19.8"]
    assert rows["native_micro"] == ["deepspeed", "ours"]  # not a LoRA table: by name


@pytest.mark.parametrize("cmd", [[sys.executable, "-m", "bench"],
                                 [sys.executable, "-m", "ds_z3native", "bench"]])
def test_bench_help(cmd: list, tmp_path: Path) -> None:
    # ds-z3native from another directory: it finds the checkout it was installed from.
    r = subprocess.run(cmd + ["--help"], cwd=ROOT if cmd[2] == "bench" else tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--smoke" in r.stdout and "--output-dir" in r.stdout
    r = subprocess.run(cmd + ["list"], cwd=ROOT if cmd[2] == "bench" else tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("native_micro", "deepcompile_first_step", "lora_llama", "compile_scaling"):
        assert name in r.stdout


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora_llama", "deepcompile_first_step"])
def test_gpu_benchmarks_smoke_on_cpu(tmp_path: Path, name: str) -> None:
    # Each GPU benchmark runs its own code at toy size on the CPU (timings mean nothing here).
    # A per-process limit below the test's own: a hung process is stopped with its tracebacks
    # in the output below, instead of the test timing out blind.
    r = subprocess.run([sys.executable, "-m", "bench", name, "--smoke", "--timeout", "600",
                        "--output-dir", str(tmp_path)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["bench"] == name and result["mode"] == "smoke"
    ok = {k: v for k, v in result["runs"].items() if v.get("status") == "ok"}
    failed = {k: v for k, v in result["runs"].items() if v.get("status") == "failed"}
    assert ok and not failed, result["runs"]
    import deepspeed
    from packaging.version import Version

    cpu_deepcompile = Version(deepspeed.__version__.split("+")[0]) >= Version("0.19.3")
    if name == "lora_llama":
        assert {k.split("@")[0] for k in ok} >= {"ours", "none"}
        for run in ok.values():
            assert run["step_ms"]["median"] > 0 and run["tokens_per_s"] > 0
            # Sampled over the timed steps; on the CPU there is no GPU to sample, and it says so.
            assert run["gpu_conditions"]["available"] is False
            assert run["gpu_conditions"]["why"] == "not on a GPU"
        if cpu_deepcompile:
            dc = next(v for k, v in ok.items() if k.startswith("dc-ckpt@"))
            assert dc["graph_breaks"] == 0 and len(dc["losses"]) == 7
            # Reduce buckets sized to the LoRA gradients (fp32, at most both of a double-buffered
            # pair), not DeepSpeed's reduce_bucket_size (5e8 elements: 2 GB per fp32 bucket).
            trainable = dc["setup"]["model"]["trainable"]
            assert 0 < dc["reduce_bucket_bytes"] <= 2 * 4 * trainable
            # Where compiling went, per window: the re-plan recompiles (Dynamo, AOTAutograd)
            # although torch._dynamo.reset() cleared torch's counters at its start.
            for run in (dc, next(v for k, v in ok.items() if k.startswith("trainer-dc-ckpt@"))):
                for window in ("first_step", "replan"):
                    phases = run["compile_seconds"][window]
                    assert phases.get("_compile.compile_inner", 0) > 0, (window, phases)
                    assert phases.get("bytecode_tracing", 0) > 0, (window, phases)
            # The same variant through HF Trainer: DeepCompile's graphs without a break, the
            # re-plan at the 6th step, a loss logged at every step, its step time against ours.
            trainer = next(v for k, v in ok.items() if k.startswith("trainer-dc-ckpt@"))
            assert trainer["setup"]["loop"] == "transformers.Trainer"
            assert dc["setup"]["loop"] == "own"
            assert trainer["setup"]["deepspeed_config"] == dc["setup"]["deepspeed_config"]
            assert trainer["graph_breaks"] == 0 and len(trainer["losses"]) == 7
            assert len(trainer["step_s_all"]) == 7 and trainer["step_ms"]["n"] == 1
            # Where each step's host time went, measured the same way in both loops: the wrappers
            # sit on the engine each loop drives (the one accelerate built, for the trainer).
            for run in (dc, trainer):
                host = run["host_ms"]
                assert min(host["forward"], host["backward"], host["step"]) > 0, host
                assert host["other"] < run["step_ms"]["max"], host
                assert len(host["gc_collections_by_generation"]) == 3, host
            own = trainer["vs"]["own_loop"]
            assert own["variant"] == "dc-ckpt" and own["step_ratio"] == pytest.approx(
                trainer["step_ms"]["median"] / dc["step_ms"]["median"])
    else:
        if cpu_deepcompile:
            assert any(k.startswith("ours@") and v["first_step_s"]["median"] > 0
                       for k, v in ok.items())
        assert all(v["status"] == "not_available" for k, v in result["runs"].items()
                   if k.startswith("deepspeed-jit@"))


def test_lora_merge_keeps_one_setup_per_file(tmp_path: Path) -> None:
    from bench.lora_llama import merge

    def record(variant: str, world_size: int, median: float) -> Path:
        path = tmp_path / f"{variant}-ws{world_size}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 4.0,
            "step_ms": {"median": median, "min": median, "max": median},
            "setup": {"size": "1b", "world_size": world_size, "seq": 1024, "micro_batch": 4,
                      "device": "NVIDIA H200"}}))
        return path

    out = tmp_path / "lora.json"
    merged = merge([record("upstream", 1, 1200.0), record("dc-ckpt", 1, 150.0)], out)
    assert merged["runs"]["dc-ckpt@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(8.0)
    with pytest.raises(ValueError, match=r"dc-ckpt@0\.19\.8 has setup .*'world_size': 2.*"
                                         r"one file compares one setup"):
        merge([record("dc-ckpt", 2, 160.0)], out)
    assert json.loads(out.read_text())["runs"]["dc-ckpt@0.19.8"]["step_ms"]["median"] == 150.0
    # The same setup re-run replaces its run; the replaced run, with the ratios it had, moves to
    # "replaced" (numbers the docs cite stay in the committed JSON).
    merged = merge([record("dc-ckpt", 1, 120.0)], out)
    assert merged["runs"]["dc-ckpt@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(10.0)
    (old,) = merged["replaced"]
    assert old["step_ms"]["median"] == 150.0 and old["vs"]["upstream"]["speedup"] == pytest.approx(8.0)
    merged = merge([record("dc-ckpt", 1, 120.0)], out)  # the same record again: nothing replaced
    assert len(merged["replaced"]) == 1


def _lora_record(folder: Path, variant: str, median: float, run: Optional[str],
                 name: str = "") -> Path:
    """A 1 B, one-GPU LoRA record of ``variant`` with step time ``median`` in run ``run``,
    written to ``folder/<name or variant>-<run>.json``."""
    path = folder / f"{name or variant}-{run}.json"
    path.write_text(json.dumps({
        "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 5.0, "run": run,
        "step_ms": {"median": median, "min": median, "max": median},
        "setup": {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4,
                  "device": "NVIDIA H200", "checkpointing": "non-reentrant"}}))
    return path


def test_trainer_run_is_measured_against_our_loop_of_the_same_run(tmp_path: Path) -> None:
    from bench import report
    from bench.lora_llama import merge
    from bench.benchmarks.lora_llama import check_lora_variants

    def record(variant: str, median: float, run: str) -> Path:
        return _lora_record(tmp_path, variant, median, run)

    out = tmp_path / "lora_llama.json"
    merged = merge([record("dc-ckpt", 140.0, "b"), record("trainer-dc-ckpt", 154.0, "b")], out)
    own = merged["runs"]["trainer-dc-ckpt@0.19.8"]["vs"]["own_loop"]
    assert own == {"variant": "dc-ckpt", "step_ratio": pytest.approx(1.1), "baseline_ms": 140.0,
                   "run": "b", "devices": None}
    # Another invocation's dc-ckpt replaces the row: the trainer keeps the ratio of its own run,
    # and the table names that run's step time.
    merged = merge([record("upstream", 900.0, "a"), record("dc-ckpt", 100.0, "a")], out)
    assert merged["runs"]["trainer-dc-ckpt@0.19.8"]["vs"]["own_loop"]["baseline_ms"] == 140.0
    assert merged["runs"]["dc-ckpt@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(9.0)
    rows = {ln.split("|")[1].strip(): ln for ln in report._lora(merged) if ln.startswith("| ")}
    assert "step time 1.100x `dc-ckpt`'s of its run (140.0 ms)" in rows["trainer-dc-ckpt"]
    assert "9.00x vs `upstream`" in rows["dc-ckpt"]
    # The README's summary has a row for the Trainer against our loop of its own run.
    (row,) = [r for r in report._summary_lora(merged) if "HF Trainer" in r[0]]
    assert row[1:4] == ["`trainer-dc-ckpt` (HF Trainer + DeepCompile + ds_z3native (`dc-ckpt` "
                        "through `TrainingArguments`)): 154.0 ms",
                        "`dc-ckpt` (our own loop): 140.0 ms", "1.10x the step time"]
    # A trainer run with no run of ours beside it gets no ratio (nothing to compare with).
    merged = merge([record("trainer-dc-ckpt", 150.0, "c")], out)
    assert "own_loop" not in (merged["runs"]["trainer-dc-ckpt@0.19.8"].get("vs") or {})
    assert not [r for r in report._summary_lora(merged) if "HF Trainer" in r[0]]
    with pytest.raises(ValueError, match="pick dc-ckpt as well"):
        check_lora_variants(["trainer-dc-ckpt"])
    check_lora_variants(["trainer-dc-ckpt", "dc-ckpt"])


def test_a_ratio_between_runs_on_two_gpus_says_so(tmp_path: Path) -> None:
    """One invocation's processes can land on two machines (or two GPUs of one): the merge
    counts the GPUs the two runs' timed steps ran on, and the table says when they differ."""
    from bench import report
    from bench.lora_llama import merge

    def record(variant: str, median: float, gpu: str) -> Path:
        path = tmp_path / f"{variant}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 5.0, "run": "r",
            "step_ms": {"median": median, "min": median, "max": median},
            "gpu_conditions": {"available": True, "device": gpu},
            "setup": {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4,
                      "device": "NVIDIA H200", "checkpointing": "non-reentrant"}}))
        return path

    out = tmp_path / "lora_llama.json"
    merged = merge([record("upstream", 900.0, "GPU-a"), record("dc-ckpt", 100.0, "GPU-a"),
                    record("trainer-dc-ckpt", 110.0, "GPU-b")], out)
    runs = merged["runs"]
    assert runs["dc-ckpt@0.19.8"]["vs"]["upstream"]["devices"] == 1
    assert runs["trainer-dc-ckpt@0.19.8"]["vs"]["own_loop"]["devices"] == 2
    rows = {ln.split("|")[1].strip(): ln for ln in report._lora(merged) if ln.startswith("| ")}
    assert "measured on another GPU" in rows["trainer-dc-ckpt"]
    assert "another GPU" not in rows["dc-ckpt"]
    (row,) = [r for r in report._summary_lora(merged) if "HF Trainer" in r[0]]
    assert row[3] == "1.10x the step time (measured on another GPU)"


def test_two_gpu_lora_runs_get_their_own_result_and_table(tmp_path: Path) -> None:
    from bench.lora_llama import merge

    def record(variant: str, median: float, peak: float) -> Path:
        path = tmp_path / f"{variant}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": peak,
            "step_ms": {"median": median, "min": median, "max": median},
            "setup": {"size": "1b", "world_size": 2, "seq": 1024, "micro_batch": 4,
                      "device": "NVIDIA H200", "checkpointing": "non-reentrant",
                      "deepcompile": variant.startswith("dc")}}))
        return path

    results = tmp_path / "results"
    merged = merge([record("upstream", 900.0, 3.0), record("dc-ckpt", 150.0, 3.3)],
                   results / "lora_llama_ws2.json")
    assert merged["bench"] == "lora_llama_ws2"
    block = report.render_block(report.load_results(results))
    # The LoRA table (its own title and speedup column), not the generic one.
    assert "**LoRA fine-tune step**" in block and "2 GPU(s)" in block
    row = next(ln for ln in block.splitlines() if ln.startswith("| dc-ckpt |"))
    assert "6.00x vs `upstream`, peak 1.10x" in row


def test_runs_on_another_kind_of_gpu_get_their_own_result_and_lora_table(tmp_path: Path) -> None:
    from bench.lora_llama import merge

    def record(variant: str, median: float, device: str) -> Path:
        path = tmp_path / f"{variant}-{device[-4:]}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 5.0,
            "run": "r", "step_ms": {"median": median, "min": median, "max": median},
            "setup": {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4,
                      "device": device, "checkpointing": "non-reentrant",
                      "deepcompile": variant.startswith("dc")}}))
        return path

    results = tmp_path / "results"
    merge([record("plain", 100.0, "NVIDIA H200"), record("dc-ckpt", 100.0, "NVIDIA H200")],
          results / "lora_llama.json")
    other = merge([record("plain", 150.0, "NVIDIA H100 80GB HBM3"),
                   record("dc-ckpt", 120.0, "NVIDIA H100 80GB HBM3")],
                  results / "lora_llama_h100.json")
    assert other["bench"] == "lora_llama_h100"
    loaded = report.load_results(results)
    assert set(loaded) == {"lora_llama", "lora_llama_h100"}  # neither hides the other
    block = report.render_block(loaded)
    assert block.count("**LoRA fine-tune step**") == 2 and "NVIDIA H100 80GB HBM3" in block
    rows = [ln for ln in block.splitlines() if ln.startswith("| dc-ckpt |")]
    assert any("0.80x `plain`'s" in r for r in rows) and any("1.00x `plain`'s" in r for r in rows)



def test_a_set_persistence_threshold_is_named_in_the_lora_table_and_summary(tmp_path: Path
                                                                            ) -> None:
    # The same job at another stage3_param_persistence_threshold is a result of its own; its
    # table heading and README row say which threshold, where DeepSpeed's default says nothing.
    from bench.lora_llama import merge

    def record(variant: str, median: float, threshold: Optional[int]) -> Path:
        zero: Dict[str, Any] = {"stage": 3}
        if threshold is not None:
            zero["stage3_param_persistence_threshold"] = threshold
        path = tmp_path / f"{variant}-{threshold}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 5.0,
            "run": "r", "step_ms": {"median": median, "min": median, "max": median},
            "setup": {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4,
                      "device": "NVIDIA H100 80GB HBM3", "checkpointing": "non-reentrant",
                      "deepcompile": variant.startswith("dc"),
                      "deepspeed_config": None if variant == "plain" else {
                          "zero_optimization": zero}}}))
        return path

    results = tmp_path / "results"
    merge([record("plain", 100.0, None), record("dc-ckpt-single", 80.0, None)],
          results / "lora_llama_h100.json")
    merge([record("plain", 100.0, None), record("dc-ckpt-single", 70.0, 20480)],
          results / "lora_llama_h100_persist20k.json")
    loaded = report.load_results(results)
    titles = [ln for ln in report.render_block(loaded).splitlines()
              if ln.startswith("**LoRA fine-tune step**")]
    assert len(titles) == 2
    assert sum("ZeRO-3 persistence threshold 20,480" in t for t in titles) == 1
    assert all(", , " not in t for t in titles)
    rows = [ln for ln in report.render_summary(loaded).splitlines()
            if "against unsharded PyTorch" in ln]
    assert len(rows) == 2
    (named,) = [r for r in rows if "persistence threshold 20,480" in r]
    assert "70.0 ms" in named and "0.70x the step time" in named
    # A threshold left to HF Trainer's "auto" in a recorded config is named as it stands.
    assert report._zero_threshold({"setup": {"deepspeed_config": {"zero_optimization": {
        "stage3_param_persistence_threshold": "auto"}}}}) == ", ZeRO-3 persistence threshold auto"

def test_suite_runs_lora_on_two_gpus_under_torchrun() -> None:
    r = _bench("lora_llama", "--dry-run", "--ranks", "2")
    assert r.returncode == 0, r.stderr
    cmds = [ln for ln in r.stdout.splitlines() if "lora_llama.py" in ln]
    assert cmds and all("-m torch.distributed.run --nproc_per_node=2 --master_port=" in c
                        for c in cmds)
    variants = {c.split("--variant ")[1].split()[0] for c in cmds}
    assert "plain" not in variants and {"none", "upstream", "dc", "dc-ckpt"} <= variants


def test_suite_passes_trace_to_each_lora_run_per_deepspeed(tmp_path: Path) -> None:
    r = _bench("lora_llama", "--dry-run", "--variants", "dc,dc-upstream", "--trace", str(tmp_path),
               "--deepspeed-path", "0.19.2=/nonexistent")
    assert r.returncode == 0, r.stderr
    cmds = [ln for ln in r.stdout.splitlines() if "lora_llama.py" in ln]
    assert len(cmds) == 2, r.stdout  # "ours" alone runs on the other DeepSpeed: none picked here
    import deepspeed

    ds = deepspeed.__version__.split("+")[0]
    for cmd in cmds:
        assert f"--trace {tmp_path / ds} " in cmd, cmd
    # One run label for the whole invocation: the result compares these runs with each other.
    labels = {c.split("--run ")[1].split()[0] for c in cmds}
    assert len(labels) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:]+\+00:00", labels.pop())


def test_a_full_lora_run_adds_two_gpus_where_the_host_has_them(tmp_path: Path) -> None:
    from bench.benchmarks import registry
    from bench.core.registry import BenchContext, contexts_for

    benches = registry()
    full = BenchContext(output_dir=tmp_path)
    assert [c.ranks for c in contexts_for(benches["lora_llama"], full, gpus=2)] == [None, 2]
    assert [c.ranks for c in contexts_for(benches["lora_llama"], full, gpus=1)] == [None]
    # Asked for explicitly, in smoke mode, or a one-GPU benchmark: as asked.
    assert [c.ranks for c in contexts_for(benches["lora_llama"], BenchContext(tmp_path, ranks=4), 2)] == [4]
    assert [c.ranks for c in contexts_for(benches["lora_llama"], BenchContext(tmp_path, smoke=True), 2)] == [None]
    assert [c.ranks for c in contexts_for(benches["native_micro"], full, gpus=2)] == [None]


def test_some_lora_variants_rerun_into_the_existing_result(tmp_path: Path) -> None:
    from bench.lora_llama import merge
    from bench.benchmarks.lora_llama import _lora_merge, _lora_script
    from bench.core.registry import BenchContext
    from bench.core.runner import Command
    from bench.core.schema import add_ratios

    script, _ = _lora_script()
    setup = {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4, "device": "NVIDIA H200"}

    def record(variant: str, median: float, run: str) -> Path:
        path = tmp_path / f"{variant}-{run}.json"
        path.write_text(json.dumps({
            "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 4.0, "run": run,
            "step_ms": {"median": median, "min": median, "max": median}, "setup": setup}))
        return path

    results = tmp_path / "results"
    existing = results / "lora_llama.json"
    merge([record("upstream", 1200.0, "day-one"), record("dc", 300.0, "day-one")], existing)
    data = json.loads(existing.read_text())
    existing.write_text(json.dumps({**data, "note": "Measured on day one."}))

    def rerun(run: str, variants: List[str], medians: List[float]) -> Dict[str, Any]:
        ctx = BenchContext(output_dir=results, work_root=tmp_path / run, variants=variants,
                           run_id=run)
        cmds = [Command(["true"], label=f"lora_llama {v}@0.19.8", output=record(v, m, run))
                for v, m in zip(variants, medians)]
        result = _lora_merge(cmds, ctx, script)
        add_ratios(result, ("upstream", "none", "plain"))
        existing.write_text(json.dumps(result))
        return result

    # The baseline re-run with a new variant: they compare with each other; the day-one run
    # keeps its ratio to the day-one baseline, which the file no longer holds.
    result = rerun("day-two", ["upstream", "dc-ckpt"], [1000.0, 150.0])
    runs = result["runs"]
    assert sorted(runs) == ["dc-ckpt@0.19.8", "dc@0.19.8", "upstream@0.19.8"]
    assert runs["dc-ckpt@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(1000.0 / 150.0)
    assert runs["dc-ckpt@0.19.8"]["ratio"]["step_ms"] == pytest.approx(0.15)
    assert runs["dc@0.19.8"]["vs"]["upstream"] == pytest.approx(
        {"speedup": 4.0, "peak_ratio": 1.0, "baseline_ms": 1200.0, "run": "day-one",
         "devices": None})
    assert runs["dc@0.19.8"]["ratio"] is None  # not against another run's baseline
    assert result["note"].startswith("Measured on day one. Re-run ") and result["note"].endswith(
        "upstream, dc-ckpt.")
    # A variant re-run alone has no baseline of its own run: no ratio rather than a cross-run one.
    result = rerun("day-three", ["dc-ckpt"], [120.0])
    runs = result["runs"]
    assert "vs" not in runs["dc-ckpt@0.19.8"] and runs["dc-ckpt@0.19.8"]["ratio"] is None
    assert runs["dc@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(4.0)
    assert [(r["variant"], r["run"]) for r in result["replaced"]] == [
        ("upstream", "day-one"), ("dc-ckpt", "day-two")]  # what day two and day three replaced
    # A full run (no --variants) starts a fresh table; every earlier run and footnote is kept.
    ctx = BenchContext(output_dir=results, work_root=tmp_path / "day-four", run_id="day-four")
    result = _lora_merge([Command(["true"], label="lora_llama upstream@0.19.8",
                                  output=record("upstream", 900.0, "day-four"))], ctx, script)
    assert list(result["runs"]) == ["upstream@0.19.8"] and "note" not in result
    assert sorted((r["variant"], r["run"]) for r in result["replaced"]) == [
        ("dc", "day-one"), ("dc-ckpt", "day-three"), ("dc-ckpt", "day-two"),
        ("upstream", "day-one"), ("upstream", "day-two")]
    assert result["replaced_notes"] == [json.loads(existing.read_text())["note"]]
    block = report.render_block(report.load_results(results))
    rows = {ln.split("|")[1].strip(): ln for ln in block.splitlines() if ln.startswith("| dc")}
    assert "4.00x vs `upstream` of its run (1200.0 ms)" in rows["dc"]
    assert "x vs" not in rows["dc-ckpt"]
    # A run of another setup is not merged silently.
    other = tmp_path / "dc-ckpt-ws2.json"
    other.write_text(json.dumps({**json.loads(record("dc-ckpt", 160.0, "x").read_text()),
                                 "setup": {**setup, "world_size": 2}}))
    ctx = BenchContext(output_dir=results, work_root=tmp_path / "work", variants=["dc-ckpt"])
    with pytest.raises(RuntimeError, match="lora_llama merge failed"):
        _lora_merge([Command(["true"], label="lora_llama dc-ckpt@0.19.8", output=other)], ctx, script)


def test_dc_warm_compiles_from_the_cache_dc_filled_in_the_same_invocation() -> None:
    def plan() -> Dict[str, str]:
        r = _bench("lora_llama", "--dry-run", "--variants", "none,dc-warm,dc,dc-upstream")
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stdout.splitlines() if "--variant " in ln]
        return {ln.split("--variant ")[1].split()[0]: (
            ln.split("TORCHINDUCTOR_CACHE_DIR=")[1].split()[0],
            ln.split(f"{PROFILE_STORE_ENV}=")[1].split()[0] if f"{PROFILE_STORE_ENV}=" in ln else None)
            for ln in lines}

    first, second = plan(), plan()
    # dc-warm after the dc that fills its cache
    assert list(first) == ["none", "dc", "dc-warm", "dc-upstream"]
    # dc-warm shares dc's inductor cache; every other variant compiles into its own (DeepSpeed's
    # op calls the same torch.ops.dc ops: sharing dc's cache could have served its graphs).
    assert first["dc"][0] == first["dc-warm"][0]
    assert len({first["dc"][0], first["none"][0], first["dc-upstream"][0]}) == 3
    # dc records DeepCompile's profiles and dc-warm replays them (the same schedule, so the
    # cached graphs match); no other variant reads or writes them.
    assert first["dc"][1] == first["dc-warm"][1] is not None
    assert first["none"][1] is None and first["dc-upstream"][1] is None
    assert first["dc"] != second["dc"]  # every invocation starts cold
    r = _bench("lora_llama", "--dry-run", "--variants", "dc-warm")
    assert r.returncode == 2 and "pick dc as well" in r.stderr, r.stderr


def test_suite_variants_pick_lora_runs_and_refuse_unknown_names() -> None:
    r = _bench("lora_llama", "--dry-run", "--variants", "upstream,dc-ckpt-lean")
    assert r.returncode == 0, r.stderr
    picked = [ln.split("--variant ")[1].split()[0] for ln in r.stdout.splitlines() if "--variant " in ln]
    assert picked == ["upstream", "dc-ckpt-lean"]
    for argv in (["lora_llama", "--variants", "upstream,nope"], ["native_micro", "--variants", "ours"]):
        r = _bench(*argv, "--dry-run")
        assert r.returncode == 2 and "--variants applies to a full lora_llama run" in r.stderr, r.stderr


def test_native_micro_reads_nccls_coll_log_format() -> None:
    # Lines in the format NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL writes (host:pid:tid [rank] NCCL
    # INFO <Op>: opCount <hex> ... count <n> datatype <ncclDataType_t> ... [nranks=<n>] stream ...),
    # with the marker all-reduces native_micro issues between categories and at each step's end.
    from bench.native_micro import CATEGORIES, MARKER_BASE, parse_nccl_coll_log

    def line(op: str, op_count: int, count: int, dtype: int) -> str:
        return (f"node0:4242:4242 [0] NCCL INFO {op}: opCount {op_count:x} sendbuff "
                f"0x7f5dd32b2100 recvbuff 0x7f5dd32b4100 count {count} datatype {dtype} op 0 root 0 "
                f"comm 0x55bef0201370 [nranks=2] stream 0x55bef0208bd0")

    def marker(code: int) -> str:
        return line("AllReduce", 0, MARKER_BASE + code, 7)

    end_of_step = len(CATEGORIES) + 2
    log = "\n".join([
        "node0:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
        "node0:4242:4242 [0] NCCL INFO comm 0x55bef0201370 rank 0 nranks 2 - Init COMPLETE",
        marker(CATEGORIES.index("frozen")),
        line("AllGather", 1, 1024, 9), line("AllGather", 2, 512, 9),     # bf16: 2 bytes
        marker(CATEGORIES.index("persistent_frozen")),
        line("AllGather", 3, 256, 7),                                      # fp32: 4 bytes
        marker(CATEGORIES.index("trainable")),
        line("AllGather", 4, 100, 7), line("ReduceScatter", 5, 100, 7),
        line("AllReduce", 6, 8, 7),
        marker(end_of_step),
        marker(CATEGORIES.index("trainable")),
        line("AllGather", 7, 100, 7), line("ReduceScatter", 8, 100, 7),
        marker(end_of_step),
    ])
    first, later = parse_nccl_coll_log(log)
    assert first["allgather_calls"] == 4
    assert first["allgather_bytes"] == 2 * (1024 * 2 + 512 * 2 + 256 * 4 + 100 * 4)  # received
    assert first["reduce_scatter_calls"] == 1 and first["reduce_scatter_bytes"] == 2 * 400
    assert first["allreduce_calls"] == 1 and first["allreduce_bytes"] == 32  # markers not counted
    assert first["per_category"]["frozen"] == {"allgather_calls": 2, "allgather_bytes": 6144}
    assert first["per_category"]["persistent_frozen"]["allgather_bytes"] == 2048
    assert later["allgather_calls"] == 1 and "persistent_frozen" not in later["per_category"]


def test_lora_trace_profiles_two_more_steps(tmp_path: Path) -> None:
    # --trace: two more steps after the timed ones under torch.profiler, a Chrome trace and the
    # op table per rank; the record's steps stay the run's own (1 warm-up + 2 timed).
    trace_dir, out = tmp_path / "trace", tmp_path / "ours.json"
    r = subprocess.run([sys.executable, "bench/lora_llama.py", "--size", "toy", "--variant", "ours",
                        "--warmup", "1", "--steps", "2", "--no-track-gathered",
                        "--trace", str(trace_dir), "--output", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "error" not in record, record.get("error")
    assert len(record["losses"]) == 3 and record["step_ms"]["n"] == 2
    assert record["trace"]["steps"] == 2 and record["trace"]["ops"] > 0
    events = json.loads((trace_dir / "ours-rank0.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names), sorted(names)[:40]
    top = (trace_dir / "ours-rank0-top.txt").read_text()
    assert "Self CPU" in top and "aten::" in top
    # The per-step breakdown: no device on a CPU, no dc op in an eager run, the profiled steps'
    # own wall time.
    split = record["trace"]["breakdown"]
    assert split["steps"] == 2 and split["wall_ms"] > 0
    assert split["device_busy_share"] is None and split["launches"]["total"] == 0
    assert split["dc_calls"] == {} and split["host_ms"]["dc_ops"] == 0
    # Each profiled step and its three phases are marked for the device-idle split (None here:
    # no device).
    marks = [e["name"] for e in events if e.get("name", "").startswith("phase:")]
    assert sorted(set(marks)) == ["phase:backward", "phase:forward", "phase:optimizer_step",
                                  "phase:step"], marks
    assert all(marks.count(m) == 2 for m in set(marks)), marks
    assert split["device_idle"] is None


def test_lora_table_never_compares_across_checkpointing() -> None:
    # The file's baseline (eager with checkpointing) is no fallback for a row without it: a
    # DeepCompile run without checkpointing whose own-run `none` is gone shows no speedup.
    setup = {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4, "device": "H200"}

    def row(variant: str, ckpt: str, median: float, ratio: float) -> Dict[str, Any]:
        return {"variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 4.0,
                "step_ms": {"median": median, "min": median, "max": median},
                "setup": {**setup, "checkpointing": ckpt}, "ratio": {"step_ms": ratio}}

    result = {"bench": "lora_llama", "baseline": "upstream@0.19.8", "runs": {
        "upstream@0.19.8": row("upstream", "non-reentrant", 1000.0, 1.0),
        "dc-ckpt@0.19.8": row("dc-ckpt", "non-reentrant", 125.0, 0.125),
        "dc-upstream@0.19.8": row("dc-upstream", "none", 100.0, 0.1)}}
    rows = {ln.split("|")[1].strip(): ln.split("|")[6].strip()
            for ln in report._lora(result) if ln.startswith("| ")}
    assert rows["dc-ckpt"] == "8.00x vs `upstream@0.19.8`"
    assert rows["dc-upstream"] == "-"


FAKE_SMI = '''
# A stand-in for nvidia-smi: one GPU, "GPU-fake"; FAKE_SMI_LEGACY=1 plays a driver before 535.
import os, sys, time
args = sys.argv[1:]
target = args[args.index("-i") + 1]
if target != "GPU-fake":
    sys.exit("No devices were found")
if "--query-compute-apps=pid,used_memory" in args:
    print("4242, 1024")
    sys.exit(0)
fields = next(a for a in args if a.startswith("--query-gpu=")).split("=", 1)[1].split(",")
if os.environ.get("FAKE_SMI_LEGACY") and "clocks_event_reasons.active" in fields:
    sys.exit("Field \\"clocks_event_reasons.active\\" is not a valid field to query.")
rows = ["1980, 2619, 350.5, 45, 97, 0x0000000000000000",
        "1500, 2619, 700.0, 80, 100, 0x0000000000000004",
        "1980, 2619, [N/A], 46, 98, 0x0000000000000000",
        "1980, 2619, 351.0, 46, 98, 0x"]  # a line cut off mid-mask
loop = "-lms" in args
i = 0
while True:
    print(", ".join(rows[i % len(rows)].split(", ")[:len(fields)]), flush=True)
    i += 1
    if not loop:
        break
    time.sleep(0.02)
'''


def _fake_smi(tmp_path: Path) -> Path:
    """An executable ``nvidia-smi`` running FAKE_SMI with this interpreter."""
    script = tmp_path / "fake_smi.py"
    script.write_text(FAKE_SMI)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    smi.chmod(0o755)
    return smi


@pytest.mark.parametrize("legacy", [False, True])
def test_gpu_conditions_are_sampled_by_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  legacy: bool) -> None:
    import time

    from bench.conditions import GpuConditions

    smi = _fake_smi(tmp_path)
    if legacy:
        monkeypatch.setenv("FAKE_SMI_LEGACY", "1")
    sampler = GpuConditions(0, interval_ms=20, smi=str(smi), target="GPU-fake")
    sampler.prepare()  # the blocking queries, before anything would be timed
    sampler.start()
    time.sleep(3.0)  # the stand-in prints every 20 ms once its interpreter is up
    s = sampler.stop()
    assert s["available"] and s["samples"] >= 3 and s["device"] == "GPU-fake", s
    assert s["sm_clock_mhz"]["min"] == 1500 and s["sm_clock_mhz"]["max"] == 1980
    assert s["power_w"]["max"] == 700.0  # "[N/A]" samples skipped
    assert s["temperature_c"]["max"] == 80
    # Only the throttled samples' mask, counted (not 0x0, not a cut-off mask); the same under
    # the field's pre-535 name.
    (mask, count), = s["clock_event_reasons"].items()
    assert mask == "0x0000000000000004" and 1 <= count < s["samples"]
    neighbour = [{"pid": 4242, "used_mib": 1024.0, "this_process": False}]
    assert s["gpu_processes"] == {"at_start": neighbour, "at_stop": neighbour}
    assert len(s["load_avg_1m"]) == 2


def test_gpu_conditions_say_why_there_are_none(tmp_path: Path) -> None:
    from bench.conditions import GpuConditions

    smi = _fake_smi(tmp_path)
    for sampler, why in ((GpuConditions(None), "not on a GPU"),
                         (GpuConditions(0, smi=str(smi), target="GPU-fake"), "not started"),
                         (GpuConditions(0, smi=str(tmp_path / "absent")), "not found"),
                         (GpuConditions(0, smi=str(smi), target="GPU-other"), "No devices were found")):
        if why != "not started":
            sampler.start()
        s = sampler.stop()
        assert s["available"] is False and why in s["why"], s


# --------------------------------------------------------------------------- compile_scaling

SUMMARY_KEYS = {"layers", "metric", "cold_vs_deepspeed", "warm_vs_deepspeed",
                "single_vs_deepspeed", "single_warm_vs_deepspeed", "growth_8_to_16", "single_growth_8_to_16", "compile_growth"}


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return _bench("compile_scaling", "--dry-run", *argv)


def _plan_runs(stdout: str) -> List[Dict[str, Any]]:
    """Each planned process: its variant, depth, steps, size, flags and environment."""
    runs = []
    for line in stdout.splitlines():
        if line.startswith("#"):
            continue
        words = line.split()
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z][A-Z0-9_]*=", w))
        args = words[len(env):]
        assert args[1] == "bench/lora_llama.py", line

        def arg(name: str) -> str:
            return args[args.index(name) + 1]

        runs.append({"variant": arg("--variant"), "layers": int(arg("--layers")),
                     "steps": int(arg("--dc-steps")), "size": arg("--size"),
                     "output": Path(arg("--output")).name, "build_op_first": "--build-op-first" in args,
                     "env": env})
    return runs


def test_compile_scaling_gpu_plan_runs_each_depth_cold_warm_and_deepspeeds_op() -> None:
    r = _plan()
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "# compile_scaling"
    runs = _plan_runs(r.stdout)
    # Per depth, shallowest first: ours cold, ours warm (after the cold run it re-uses), then
    # DeepSpeed's op cold; 20 steps of the 1 B shape on the GPU (no CPU accelerator).
    assert [(x["layers"], x["output"]) for x in runs] == [
        (n, f"{v}-{n}l.json") for n in (2, 4, 8, 16)
        for v in ("ours-cold", "ours-warm", "deepspeed-cold")]
    for x in runs:
        assert x["size"] == "1b" and x["steps"] == 20 and "DS_ACCELERATOR" not in x["env"]
        ours = x["output"].startswith("ours")
        # DeepSpeed alone fails on dc-ckpt's setup: its baseline runs without checkpointing.
        assert x["variant"] == ("dc-ckpt" if ours else "dc-upstream")
        assert x["build_op_first"] is not ours  # DeepSpeed's JIT build stays out of its times
        assert (PROFILE_STORE_ENV in x["env"]) is ours
        assert x["env"].get("DS_Z3NATIVE") == (None if ours else "0")  # no zero-code install
    by_key = {x["output"][:-len(".json")]: x["env"] for x in runs}
    caches = [env["TORCHINDUCTOR_CACHE_DIR"] for env in by_key.values()]
    for n in (2, 4, 8, 16):
        cold, warm, theirs = (by_key[f"{v}-{n}l"] for v in ("ours-cold", "ours-warm", "deepspeed-cold"))
        # The warm run re-uses its cold run's inductor cache and profile store; nothing else
        # shares a cache (DeepSpeed's op calls the same torch.ops.dc ops: it could hit ours).
        assert warm == cold
        assert caches.count(cold["TORCHINDUCTOR_CACHE_DIR"]) == 2
        assert caches.count(theirs["TORCHINDUCTOR_CACHE_DIR"]) == 1
    assert len({env.get(PROFILE_STORE_ENV) for env in by_key.values()} - {None}) == 4
    # Every invocation starts cold.
    again = _plan_runs(_plan().stdout)
    assert again[0]["env"]["TORCHINDUCTOR_CACHE_DIR"] != runs[0]["env"]["TORCHINDUCTOR_CACHE_DIR"]
    # --layers adds the 32-layer depth; it belongs to compile_scaling, and too few steps for
    # DeepCompile's re-plan is refused before anything runs.
    deep = _plan_runs(_plan("--layers", "2,4,8,16,32").stdout)
    assert sorted({x["layers"] for x in deep}) == [2, 4, 8, 16, 32] and len(deep) == 15
    r = _plan("--steps", "6")
    assert r.returncode == 2 and "at least 7" in r.stderr, r.stderr
    r = _bench("lora_llama", "--dry-run", "--layers", "4")
    assert r.returncode == 2 and "--layers applies to compile_scaling" in r.stderr, r.stderr


def test_compile_scalings_deepspeed_variant_is_left_out_of_a_full_lora_run() -> None:
    def variants(*argv: str) -> List[str]:
        r = _bench("lora_llama", "--dry-run", *argv)
        assert r.returncode == 0, r.stderr
        return [ln.split("--variant ")[1].split()[0] for ln in r.stdout.splitlines()
                if "--variant " in ln]

    assert "dc-ckpt-upstream" not in variants() and "dc-ckpt" in variants()
    assert variants("--variants", "dc-ckpt,dc-ckpt-upstream") == ["dc-ckpt", "dc-ckpt-upstream"]


def _scaling_run(status: str = "ok", first: float = 0.0, wall: float = 0.0) -> Dict[str, Any]:
    if status != "ok":
        return {"status": status, "reason": "why"}
    return {"status": "ok", "compile_to_first_step_s": first, "replan_step_s": first / 4,
            "wall_to_last_step_s": wall}


def test_compile_scaling_summary_is_taken_at_the_deepest_depth() -> None:
    from bench.benchmarks.compile_scaling import summarize_scaling

    runs = {"ours-cold-8l": _scaling_run(first=100.0, wall=200.0),
            "ours-cold-16l": _scaling_run(first=150.0, wall=300.0),
            "ours-warm-16l": _scaling_run(first=60.0, wall=240.0),
            "ours-single-16l": _scaling_run(first=170.0, wall=180.0),
            "ours-single-8l": _scaling_run(first=85.0, wall=90.0),
            "deepspeed-cold-16l": _scaling_run(first=180.0, wall=400.0),
            "deepspeed-cold-8l": _scaling_run(first=120.0, wall=250.0)}
    summary = summarize_scaling(runs, [2, 4, 8, 16])
    assert set(summary) == SUMMARY_KEYS and summary["layers"] == 16
    assert summary["metric"] == "wall_to_last_step_s"
    assert summary["cold_vs_deepspeed"] == pytest.approx(300.0 / 400.0)
    assert summary["warm_vs_deepspeed"] == pytest.approx(240.0 / 400.0)
    assert summary["single_vs_deepspeed"] == pytest.approx(180.0 / 400.0)
    assert summary["growth_8_to_16"] == pytest.approx(150.0 / 100.0)  # compile to step 1
    assert summary["single_growth_8_to_16"] == pytest.approx(170.0 / 85.0)
    assert summary["compile_growth"] == {"from_layers": 8, "to_layers": 16,
                                         "ratio": pytest.approx(1.5)}
    # The deepest depth of the run is 32: its runs failed or are missing, so its comparisons are
    # null (never the 16-layer ones instead); the growth from 8 to 16 stays.
    runs["ours-cold-32l"] = _scaling_run("failed")
    summary = summarize_scaling(runs, [2, 4, 8, 16, 32])
    assert summary["layers"] == 32
    assert summary["cold_vs_deepspeed"] is None and summary["warm_vs_deepspeed"] is None
    assert summary["growth_8_to_16"] == pytest.approx(1.5)
    assert summary["compile_growth"]["to_layers"] == 16  # the deepest pair our cold run has
    # DeepSpeed's op not available: no comparison; a failed 8-layer run: no growth.
    runs = {"ours-cold-8l": _scaling_run("failed"), "ours-cold-16l": _scaling_run(first=1.0, wall=2.0),
            "ours-warm-16l": _scaling_run(first=1.0, wall=2.0),
            "deepspeed-cold-16l": _scaling_run("not_available")}
    summary = summarize_scaling(runs, [8, 16])
    assert {k: summary[k] for k in ("cold_vs_deepspeed", "warm_vs_deepspeed", "growth_8_to_16",
                                    "compile_growth")} == dict.fromkeys(
        ("cold_vs_deepspeed", "warm_vs_deepspeed", "growth_8_to_16", "compile_growth"))


def test_report_tables_compile_scaling_and_sums_it_up(tmp_path: Path) -> None:
    from bench.benchmarks.compile_scaling import summarize_scaling

    model = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "vocab_size": 32000, "lora_r": 16}

    def run(variant: str, layers: int, first: float, wall: float) -> Dict[str, Any]:
        return {**_scaling_run(first=first, wall=wall), "variant": variant, "layers": layers,
                "ratio": None, "run": "2026-02-02T00:00:00+00:00",
                "setup": {"device": "NVIDIA H200", "model": {**model, "params": layers * 60e6}},
                "compile_seconds": {"to_last_step": {"_compile.compile_inner": first,
                                                     "compile_fx_inner": first / 2}}}

    runs = {"ours-cold-8l": run("ours-cold", 8, 100.0, 200.0),
            "ours-warm-8l": run("ours-warm", 8, 50.0, 150.0),
            "deepspeed-cold-8l": {"status": "failed", "variant": "deepspeed-cold", "layers": 8,
                                  "error": "Traceback ...\nKeyError: 3", "ratio": None},
            "ours-cold-16l": run("ours-cold", 16, 160.0, 300.0),
            "ours-warm-16l": run("ours-warm", 16, 80.0, 240.0),
            "deepspeed-cold-16l": run("deepspeed-cold", 16, 200.0, 400.0)}
    single = {"ours-single-16l": run("ours-single", 16, 170.0, 180.0)}
    result = {"bench": "compile_scaling", "mode": "full", "runs": runs,
              "summary": summarize_scaling(runs, [8, 16]),
              "setup": {"size": "1b", "last_step": 20, "checkpointing": "non-reentrant",
                        "micro_batch": 4, "seq": 1024, "dtype": "bf16", "device": "NVIDIA H200",
                        "model": model}}
    (tmp_path / "compile_scaling.json").write_text(json.dumps(result))
    results = report.load_results(tmp_path)
    block = report.render_block(results)
    assert "**DeepCompile's time to a steady state against depth** (the 1 B LoRA shape" in block
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in block.splitlines() if re.match(r"^\| \d+ \|", ln)}
    assert list(rows) == ["8", "16"]
    assert rows["16"] == ["0.96 B", "160 / 40 / 300 s", "80 / 20 / 240 s", "200 / 50 / 400 s",
                          "0.75x", "0.60x", "160 / - / - / 80"]
    assert rows["8"][3] == "fails: `KeyError: 3`" and rows["8"][4:6] == ["-", "-"]
    summary = report.render_summary(results)
    (row,) = [ln for ln in summary.splitlines() if ln.startswith("| DeepCompile")]
    assert row == ("| DeepCompile, `engine.compile()` to the end of step 20, 16 layers of the 1 B "
                   "LoRA shape, checkpointing | 300 s cold, 240 s warm | 400 s (DeepSpeed's own "
                   "op, cold) | 0.75x cold, 0.60x warm (wall time) | 2026-02-02, 1 x NVIDIA H200 |")
    # A single-cycle run gets its own columns and its part of the summary row; none without.
    assert "single cycle" not in block
    with_single = {**result, "runs": {**runs, **single},
                   "summary": summarize_scaling({**runs, **single}, [8, 16])}
    (tmp_path / "compile_scaling.json").write_text(json.dumps(with_single))
    block = report.render_block(report.load_results(tmp_path))
    assert "| ds_z3native, single cycle, cold |" in block
    (row16,) = [ln for ln in block.splitlines() if ln.startswith("| 16 |")]
    assert [c.strip() for c in row16.split("|")[2:-1]] == [
        "0.96 B", "160 / 40 / 300 s", "80 / 20 / 240 s", "170 / 42 / 180 s", "200 / 50 / 400 s",
        "0.75x", "0.60x", "0.45x", "160 / - / - / 80"]
    assert "300 s cold, 240 s warm, 180 s single cycle (cold) |" in \
        report.render_summary(report.load_results(tmp_path))
    assert "0.75x cold, 0.60x warm, 0.45x single cycle (wall time) |" in \
        report.render_summary(report.load_results(tmp_path))
    # Runs of another invocation (run label) are shown with their label and compared with
    # nothing; the summary row keeps the ratios it has.
    later = {k: {**r, "run": "later"} for k, r in {**runs, **single}.items()
             if k in ("ours-single-16l", "deepspeed-cold-16l")}
    mixed = {**runs, **single, **later}
    (tmp_path / "compile_scaling.json").write_text(json.dumps(
        {**result, "runs": mixed, "summary": summarize_scaling(mixed, [8, 16])}))
    results = report.load_results(tmp_path)
    (row16,) = [ln for ln in report.render_block(results).splitlines() if ln.startswith("| 16 |")]
    assert [c.strip() for c in row16.split("|")[2:-1]] == [
        "0.96 B", "160 / 40 / 300 s (2026-02-02T00:00:00+00:00)",
        "80 / 20 / 240 s (2026-02-02T00:00:00+00:00)", "170 / 42 / 180 s (later)",
        "200 / 50 / 400 s (later)", "-", "-", "0.45x", "160 / - / - / 80"]
    (row,) = [ln for ln in report.render_summary(results).splitlines()
              if ln.startswith("| DeepCompile")]
    assert "| 180 s single cycle (cold) | 400 s (DeepSpeed's own op, cold) | " \
        "0.45x single cycle (wall time) |" in row
    # No run of ours shares DeepSpeed's label: the row shows those of ours of one label (the
    # single cycle's, the last listed) and no ratio.
    apart = {**mixed, "ours-single-16l": {**mixed["ours-single-16l"], "run": "latest"}}
    (tmp_path / "compile_scaling.json").write_text(json.dumps(
        {**result, "runs": apart, "summary": summarize_scaling(apart, [8, 16])}))
    (row,) = [ln for ln in report.render_summary(report.load_results(tmp_path)).splitlines()
              if ln.startswith("| DeepCompile")]
    assert "| 180 s single cycle (cold), run latest | 400 s (DeepSpeed's own op, cold) | " \
        "no ratio: not one run (DeepSpeed's: run later) |" in row, row
    # Two runs, maybe on two machines: the row says when and on what each was measured.
    assert row.rstrip(" |").split(" | ")[-1].startswith("ours: ") and "; DeepSpeed's: " in row, row
    # DeepSpeed's baseline run without checkpointing (DeepSpeed alone fails with it): the
    # table's column and the summary row say so.
    result["setup"]["checkpointing"] = {"ours": "non-reentrant", "deepspeed": "none"}
    (tmp_path / "compile_scaling.json").write_text(json.dumps(result))
    results = report.load_results(tmp_path)
    assert ("| DeepSpeed alone, cold (without checkpointing) |" in report.render_block(results)
            and "`dc-ckpt`: DeepCompile, non-reentrant checkpointing," in report.render_block(results))
    assert ("| 400 s (DeepSpeed's own op, cold, without checkpointing) |"
            in report.render_summary(results))
    # Without DeepSpeed's cold run at the deepest depth there is nothing to sum up.
    result["runs"]["deepspeed-cold-16l"] = {"status": "not_available", "reason": "no CUDA",
                                            "ratio": None}
    result["summary"] = summarize_scaling(result["runs"], [8, 16])
    (tmp_path / "compile_scaling.json").write_text(json.dumps(result))
    assert "| DeepCompile" not in report.render_summary(report.load_results(tmp_path))


def test_compile_scaling_keeps_the_runs_it_replaces() -> None:
    from bench.benchmarks.compile_scaling import keep_history

    first = {"mode": "full", "note": "Measured on day one.",
             "runs": {"ours-cold-16l": {"variant": "ours-cold", "run": "day-one"}}}
    second: Dict[str, Any] = {"runs": {"ours-cold-16l": {"variant": "ours-cold", "run": "day-two"}}}
    keep_history(second, first)
    assert second["replaced"] == [{"variant": "ours-cold", "run": "day-one", "key": "ours-cold-16l"}]
    assert second["replaced_notes"] == ["Measured on day one."]
    third: Dict[str, Any] = {"runs": {}}
    keep_history(third, {**second, "mode": "full"})
    assert [r["run"] for r in third["replaced"]] == ["day-one", "day-two"]
    assert third["replaced_notes"] == ["Measured on day one."]
    for previous in (None, {**first, "mode": "smoke"}):  # nothing before it, or a smoke result
        fresh: Dict[str, Any] = {"runs": {}}
        keep_history(fresh, previous)
        assert "replaced" not in fresh


def test_compile_scaling_runs_spread_over_invocations_merge_into_one_result(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where each command may run only a few minutes, each run of a depth is its own
    # invocation (--variants, one --run label, one --work-dir): the runs merge into one result
    # whose summary compares them; a warm run finds its cold run's cache in the work dir.
    import bench.benchmarks.compile_scaling as cs
    from bench.core.registry import BenchContext

    walls = {"ours-cold": 300.0, "ours-warm": 200.0, "deepspeed-cold": 400.0}
    ran: List[str] = []

    def fake_run(cmd: Any, logs: Path, timeout: float, echo: bool = False) -> int:
        key = cmd.output.stem
        ran.append(key)
        Path(cmd.env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
        wall = walls[key.rsplit("-", 1)[0]]
        cmd.output.parent.mkdir(parents=True, exist_ok=True)
        cmd.output.write_text(json.dumps({
            "bench": "lora_llama", "variant": "dc-ckpt", "run": cmd.argv[cmd.argv.index("--run") + 1],
            "compile_to_first_step_s": wall / 2, "replan_step_s": wall / 4,
            "wall_to_last_step_s": wall, "setup": {"device": "NVIDIA H200", "model": {}}}))
        return 0

    monkeypatch.setattr(cs, "run_command", fake_run)
    results, work = tmp_path / "results", tmp_path / "work"
    results.mkdir()

    def invoke(kind: str, label: str = "one") -> Dict[str, Any]:
        ctx = BenchContext(output_dir=results, variants=[kind], layers=[16], work_root=work,
                           run_id=label)
        result = cs._execute(ctx)
        result.update(bench="compile_scaling", mode="full")
        (results / "compile_scaling.json").write_text(json.dumps(result))
        return result

    invoke("ours-cold")
    invoke("ours-warm")
    result = invoke("deepspeed-cold")
    assert ran == ["ours-cold-16l", "ours-warm-16l", "deepspeed-cold-16l"]
    assert sorted(result["runs"]) == ["deepspeed-cold-16l", "ours-cold-16l", "ours-warm-16l"]
    assert result["summary"]["cold_vs_deepspeed"] == pytest.approx(0.75)
    assert result["summary"]["warm_vs_deepspeed"] == pytest.approx(0.5)
    assert "replaced" not in result or result["replaced"] == []
    # Running one again replaces it (the old one goes to the history); under another label it is
    # not compared with the others.
    result = invoke("deepspeed-cold", label="two")
    assert [r["key"] for r in result["replaced"]] == ["deepspeed-cold-16l"]
    assert result["summary"]["cold_vs_deepspeed"] is None
    # A warm run without its cold run's cache in the work dir does not run.
    ran.clear()
    ctx = BenchContext(output_dir=tmp_path / "elsewhere", variants=["ours-warm"], layers=[8],
                       work_root=tmp_path / "empty", run_id="three")
    alone = cs._execute(ctx)
    assert ran == [] and alone["runs"]["ours-warm-8l"]["status"] == "not_available"
    # Another setup in the existing file is refused, not mixed in.
    data = json.loads((results / "compile_scaling.json").read_text())
    data["setup"]["steps"] = 30
    (results / "compile_scaling.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="30 steps"):
        invoke("ours-cold")


def test_cli_takes_compile_scaling_runs_and_a_run_label() -> None:
    r = _plan("--variants", "ours-cold", "--layers", "16", "--run", "label-x", "--work-dir", "/tmp/w")
    assert r.returncode == 0, r.stderr
    (run,) = _plan_runs(r.stdout)
    assert run["output"] == "ours-cold-16l.json" and run["env"]["TORCHINDUCTOR_CACHE_DIR"] == \
        "/tmp/w/compile_scaling/inductor/ours-16l"
    assert "--run label-x" in r.stdout
    r = _plan("--variants", "dc-ckpt")
    assert r.returncode == 2 and \
        "ours-cold, ours-warm, ours-single, ours-single-warm, deepspeed-cold" in r.stderr, \
        r.stderr


def test_the_documented_run_by_run_loop_plans_one_run_per_invocation() -> None:
    # docs/benchmarks.md's loop, each invocation dry-run: one process each, of the named run.
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "for run in" in b)
    head, command = [ln.strip() for ln in block.splitlines() if ln.strip()][:2]
    kinds = head[len("for run in "):head.index(";")].split()
    assert kinds == ["ours-cold", "ours-warm", "ours-single", "deepspeed-cold"]
    words = command.split()
    assert words[:4] == ["python", "-m", "bench", "compile_scaling"], command
    for kind in kinds:
        r = _plan(*[kind if w == "$run" else w for w in words[4:]])
        assert r.returncode == 0, r.stderr
        (run,) = _plan_runs(r.stdout)
        assert run["output"] == f"{kind}-16l.json"


def test_a_single_cycle_run_is_planned_only_when_named_with_caches_of_its_own() -> None:
    assert "ours-single" not in _plan("--layers", "16").stdout
    r = _plan("--variants", "ours-single,ours-cold", "--layers", "16", "--work-dir", "/tmp/w")
    assert r.returncode == 0, r.stderr
    cold, single = _plan_runs(r.stdout)  # in the plan's order, whatever the order named
    assert (cold["output"], single["output"]) == ("ours-cold-16l.json", "ours-single-16l.json")
    assert single["variant"] == cold["variant"] == "dc-ckpt"
    assert (cold["env"][SINGLE_CYCLE_ENV], single["env"][SINGLE_CYCLE_ENV]) == ("0", "1")
    # Cold too: neither its inductor cache nor its profile store is the cold run's.
    for name in ("TORCHINDUCTOR_CACHE_DIR", PROFILE_STORE_ENV):
        assert single["env"][name] != cold["env"][name]
    assert single["env"]["TORCHINDUCTOR_CACHE_DIR"] == \
        "/tmp/w/compile_scaling/inductor/ours-single-16l"


def test_a_single_cycle_warm_run_reuses_the_single_cycle_runs_caches() -> None:
    r = _plan("--variants", "ours-single-warm,ours-single,ours-warm", "--layers", "16",
              "--work-dir", "/tmp/w")
    assert r.returncode == 0, r.stderr
    warm, single, single_warm = _plan_runs(r.stdout)  # the plan's order
    assert single_warm["output"] == "ours-single-warm-16l.json"
    for name in ("TORCHINDUCTOR_CACHE_DIR", PROFILE_STORE_ENV, SINGLE_CYCLE_ENV):
        assert single_warm["env"][name] == single["env"][name]
        assert name == SINGLE_CYCLE_ENV or single_warm["env"][name] != warm["env"][name]


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


@pytest.mark.slow
def test_compile_scaling_smoke_on_cpu(tmp_path: Path) -> None:
    # The same code at toy size on the CPU: ours cold, then warm from the cold run's inductor
    # cache and profile store, then DeepSpeed's op cold (not available on the CPU: recorded so,
    # with DeepSpeed's reason). Timings are not asserted.
    r = subprocess.run([sys.executable, "-m", "bench", "compile_scaling", "--smoke", "--timeout",
                        "600", "--output-dir", str(tmp_path)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Each process's own progress is visible as it runs, after its label.
    assert "compile_scaling ours-cold-2l | " in r.stderr
    assert re.search(r"compile_scaling ours-warm-2l \| .*dc-ckpt step 7/7", r.stderr)
    assert "compile_scaling: done" in r.stderr
    result = json.loads((tmp_path / "compile_scaling.json").read_text())
    assert result["bench"] == "compile_scaling" and result["mode"] == "smoke"
    assert result["schema"] == 1 and VERSION_KEYS <= set(result["versions"])
    setup = result["setup"]
    assert setup["size"] == "toy" and setup["layers"] == [2] and setup["device"] == "cpu"
    assert setup["steps"] == setup["last_step"] == 7
    assert "step 7, not 20" in setup["last_step_note"]
    assert set(setup["metrics"]) >= {"compile_to_first_step_s", "replan_step_s",
                                     "wall_to_last_step_s", "compile_seconds", "compile_counters",
                                     "deepcompile_pass_seconds"}
    runs = result["runs"]
    assert set(runs) == {"ours-cold-2l", "ours-warm-2l", "deepspeed-cold-2l"}
    assert result["baseline"] is None and all(r["ratio"] is None for r in runs.values())
    cold, warm, theirs = runs["ours-cold-2l"], runs["ours-warm-2l"], runs["deepspeed-cold-2l"]
    for run, cache in ((cold, "cold"), (warm, "warm")):
        assert run["status"] == "ok", run.get("error")
        assert (run["variant"], run["implementation"], run["cache"], run["layers"]) == (
            f"ours-{cache}", "ours", cache, 2)
        assert run["lora_variant"] == "dc-ckpt" and run["setup"]["model"]["num_hidden_layers"] == 2
        assert run["setup"]["layers"] == 2 and run["setup"]["checkpointing"] == "non-reentrant"
        assert len(run["step_s_all"]) == 7 and run["graph_breaks"] == 0
        assert 0 < run["compile_to_first_step_s"] < run["wall_to_last_step_s"]
        assert run["replan_step_s"] == run["step_s_all"][5] > 0
        # torch's per-phase compile times: to step 1, in the re-plan, and to the last step (both
        # compiles: the re-plan's reset of torch's counters does not lose the first). The warm
        # run starts from the cold run's re-plan (its manifest in the profile store): it compiles
        # at step 0 only.
        phases = run["compile_seconds"]
        inner = "_compile.compile_inner"
        for window in ("first_step", "replan", "to_last_step") if run is cold else \
                ("first_step", "to_last_step"):
            assert phases[window].get(inner, 0) > 0, (window, phases[window])
        assert phases["to_last_step"][inner] == pytest.approx(
            phases["first_step"][inner] + phases["replan"].get(inner, 0), abs=0.5)
        assert run["compile_counters"]["stats"]["unique_graphs"] > 0
        # DeepCompile's pass time per graph compiled: a forward and a backward graph per compile
        # (the cold run compiles at step 0 and at the re-plan, the warm run at step 0 only).
        passes = run["deepcompile_pass_seconds"]
        assert [p["direction"] for p in passes] == ["fwd", "bwd"] * (2 if run is cold else 1)
        assert all(p["s"] > 0 for p in passes)
    assert cold["warm_start"]["manifests_written"] == 1 and cold["warm_start"]["started"] == 0
    assert warm["warm_start"]["started"] == 1 and warm["warm_start"]["fell_back"] == 0
    assert warm["compile_seconds"]["replan"].get("_compile.compile_inner", 0) == 0
    # The warm run compiled from the cold run's inductor cache (a fresh cache would miss).
    assert cold["compile_counters"]["inductor"].get("fxgraph_cache_miss", 0) > 0
    assert warm["compile_counters"]["inductor"].get("fxgraph_cache_hit", 0) > 0
    assert warm["compile_counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    summary = result["summary"]
    assert set(summary) == SUMMARY_KEYS and summary["layers"] == 2
    assert summary["growth_8_to_16"] is None and summary["compile_growth"] is None  # one depth
    if theirs["status"] == "ok":
        assert summary["cold_vs_deepspeed"] == pytest.approx(
            cold["wall_to_last_step_s"] / theirs["wall_to_last_step_s"])
        assert summary["warm_vs_deepspeed"] == pytest.approx(
            warm["wall_to_last_step_s"] / theirs["wall_to_last_step_s"])
    else:  # DeepSpeed's op on the CPU: DeepSpeed says it has none; nothing to compare with
        assert theirs["status"] == "not_available", theirs
        assert "DeepSpeed has no DeepCompile op for its cpu accelerator" in theirs["reason"]
        assert theirs["implementation"] == "deepspeed" and theirs["lora_variant"] == "dc-upstream"
        assert summary["cold_vs_deepspeed"] is None and summary["warm_vs_deepspeed"] is None


def test_records_kept_beside_the_table_get_ratios_without_taking_its_rows(tmp_path: Path) -> None:
    """merge --beside: the own-loop half of a Trainer pair (or a profiled run) is kept in
    ``replaced`` next to the table's row of its variant, which keeps its own baseline; ratios
    find their same-run baseline there; unlabelled records in ``replaced`` (from several
    invocations) never serve as one."""
    from bench.lora_llama import main, merge

    def record(variant: str, median: float, run: Optional[str], name: str = "") -> Path:
        return _lora_record(tmp_path, variant, median, run, name)

    out = tmp_path / "lora_llama.json"
    merge([record("upstream", 900.0, "a"), record("dc-ckpt", 100.0, "a")], out)
    pair = [record("trainer-dc-ckpt", 154.0, "p"), record("dc-ckpt", 140.0, "p")]
    assert main(["merge", str(pair[0]), "--beside", str(pair[1]), "--output", str(out)]) == 0
    merged = json.loads(out.read_text())
    runs = merged["runs"]
    assert runs["dc-ckpt@0.19.8"]["run"] == "a"  # the table's row stays, with its baseline
    assert runs["dc-ckpt@0.19.8"]["vs"]["upstream"]["speedup"] == pytest.approx(9.0)
    assert runs["trainer-dc-ckpt@0.19.8"]["vs"]["own_loop"]["step_ratio"] == pytest.approx(1.1)
    (kept,) = merged["replaced"]
    assert kept["run"] == "p" and kept["step_ms"]["median"] == 140.0
    assert "upstream" not in (kept.get("vs") or {})  # its invocation ran no upstream
    # The same record again adds nothing; an unlabelled record beside is no baseline for others.
    merged = merge([], out, beside=[pair[1], record("upstream", 500.0, None, "old")])
    assert len(merged["replaced"]) == 2
    merged = merge([record("dc", 120.0, None)], out)
    assert "upstream" not in (merged["runs"]["dc@0.19.8"].get("vs") or {})


def test_a_run_is_measured_against_unsharded_pytorch_of_its_own_run(tmp_path: Path) -> None:
    """``plain`` (no ZeRO, no checkpointing) is the ceiling: every run of its invocation gets its
    step time over plain's, a profiled run kept beside the table too; the README's summary shows
    the ds_z3native run closest to it, and nothing where no run has plain beside it."""
    from bench import report
    from bench.lora_llama import merge

    def record(variant: str, median: float, run: str) -> Path:
        return _lora_record(tmp_path, variant, median, run)

    out = tmp_path / "lora_llama.json"
    merged = merge([record("upstream", 900.0, "a"), record("dc-ckpt", 100.0, "a")], out)
    assert not [r for r in report._summary_lora(merged) if "unsharded" in r[0]]
    merged = merge([record("plain", 120.0, "b")], out, beside=[record("dc-ckpt", 108.0, "b")])
    runs = merged["runs"]
    assert "plain" not in runs["plain@0.19.8"].get("vs", {})
    assert "plain" not in runs["dc-ckpt@0.19.8"].get("vs", {})  # run "a" has no plain
    (kept,) = [r for r in merged["replaced"] if r["run"] == "b"]
    assert kept["vs"]["plain"] == {"step_ratio": pytest.approx(0.9), "peak_ratio": 1.0,
                                   "baseline_ms": 120.0, "run": "b", "devices": None}
    (row,) = [r for r in report._summary_lora(merged) if "unsharded" in r[0]]
    assert row[1].startswith("`dc-ckpt` (DeepCompile + ds_z3native): 108.0 ms")
    assert row[2].startswith("`plain`") and "120.0 ms" in row[2]
    assert row[3] == "0.90x the step time, peak 1.00x"
    # Another invocation's plain takes the table's row: the ratio of run "b" stays.
    merged = merge([record("plain", 90.0, "c")], out)
    (kept,) = [r for r in merged["replaced"] if r["run"] == "b" and r["variant"] == "dc-ckpt"]
    assert kept["vs"]["plain"]["baseline_ms"] == 120.0
    rows = {ln.split("|")[1].strip(): ln for ln in report._lora(merged) if ln.startswith("| ")}
    assert "`plain`" not in rows["dc-ckpt"]


def test_persistent_group_table_and_summary_compare_with_the_same_runs_ungrouped_step(
        tmp_path: Path) -> None:
    from bench import report

    def record(variant: str, median: float, step_host: float, grouped: bool,
               calls: Dict[str, float]) -> Dict[str, Any]:
        return {"variant": variant, "run": "2026-02-03-x", "versions": {"deepspeed": "0.19.8"},
                "step_ms": {"median": median, "min": median - 1, "max": median + 1},
                "peak_gib": 3.0, "host_ms": {"forward": 20.0, "backward": 25.0,
                                             "step": step_host},
                "trace": {"breakdown": {"dc_calls": calls}},
                "setup": {"device": "NVIDIA H200", "layers": 8, "world_size": 1,
                          "checkpointing": "non-reentrant", "group_persistent": grouped,
                          "model": {"params": 5.5e8}}}

    weak = record("dc-ckpt-ungrouped", 80.0, 20.0, False,
                  {"allgather_param": 373, "wait_allgather": 373, "release_param": 536})
    ours = record("dc-ckpt", 60.0, 16.0, True, {"reduce_grad": 112})
    ours["ratio"], weak["ratio"] = 0.75, 1.0
    ours["vs"] = {"ungrouped": {"step_ratio": 0.75, "host_ms_ratio": {"step": 0.8}}}
    result = {"bench": "persistent_group", "created": "2026-02-03T00:00:00+00:00",
              "setup": ours["setup"],
              "runs": {"dc-ckpt@0.19.8": ours, "dc-ckpt-ungrouped@0.19.8": weak}}
    (tmp_path / "persistent_group.json").write_text(json.dumps(result))
    results = report.load_results(tmp_path)
    block = report.render_block(results)
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in block.splitlines()
            if ln.startswith("| dc-ckpt")]
    assert [r[0] for r in rows] == ["dc-ckpt-ungrouped", "dc-ckpt"]  # the baseline first
    assert rows[1][1:4] == ["one call per graph", "60.0 (59.0–61.0)", "0.75x"]
    assert rows[0][1] == "DeepSpeed's: three per use" and rows[0][5] == "1,282"
    (row,) = [ln for ln in report.render_summary(results).splitlines()
              if ln.startswith("| DeepCompile step, params kept gathered")]
    assert ("60.0 ms | `dc-ckpt-ungrouped`, DeepSpeed's three dc op calls per use: 80.0 ms | "
            "0.75x the step time (the unchanged optimizer step: 0.80x, the host's share) | "
            "2026-02-03, 1 x NVIDIA H200 |") in row
    # Without the ungrouped run of the same file there is nothing to compare with.
    del result["runs"]["dc-ckpt-ungrouped@0.19.8"]
    (tmp_path / "persistent_group.json").write_text(json.dumps(result))
    assert "params kept gathered" not in report.render_summary(report.load_results(tmp_path))


def test_a_dry_run_leaves_no_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    # A plan names folders under a new temporary work folder; printing it leaves none behind
    # (a real run's folder, with its logs, stays). --work-dir given: the caller's, left as it is.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for argv in (["compile_scaling", "--layers", "2,4"], ["lora_llama", "--variants", "dc,dc-warm"],
                 ["all"]):
        r = _bench(*argv, "--dry-run")
        assert r.returncode == 0, r.stderr
        assert "bench-" in r.stdout or "python" in r.stdout  # a plan was printed
        assert list((tmp_path / "tmp").iterdir()) == [], argv
    mine = tmp_path / "mine"
    r = _bench("compile_scaling", "--layers", "2", "--dry-run", "--work-dir", str(mine))
    assert r.returncode == 0 and str(mine) in r.stdout, r.stdout


def test_remove_if_empty_keeps_a_folder_with_a_file(tmp_path: Path) -> None:
    from bench.core.cli import _remove_if_empty

    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "d").mkdir()
    _remove_if_empty(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "e" / "f").mkdir(parents=True)
    (tmp_path / "e" / "f" / "log.txt").write_text("kept")
    _remove_if_empty(tmp_path / "e")
    assert (tmp_path / "e" / "f" / "log.txt").read_text() == "kept"
    _remove_if_empty(None)
    _remove_if_empty(tmp_path / "missing")


def test_the_grouped_reduce_alone_is_a_lora_pair_run_only_when_named() -> None:
    # dc-ckpt-single-reduce-each is dc-ckpt-single with set_group_reduce(False): the two in one
    # invocation measure the grouped reduce alone. A full run leaves it out.
    sys.path.insert(0, str(ROOT / "bench"))
    from lora_llama import CHECKPOINTING, DEEPCOMPILE, OPT_IN, OURS_DC

    name = "dc-ckpt-single-reduce-each"
    assert name in OPT_IN and name in OURS_DC and name in DEEPCOMPILE
    assert CHECKPOINTING[name] == CHECKPOINTING["dc-ckpt-single"] == "non-reentrant"
    assert name in report._LORA_WHAT and name in report._LORA_ORDER
    r = _bench("lora_llama", "--dry-run", "--variants", f"dc-ckpt-single,{name}")
    assert r.returncode == 0, r.stderr
    picked = [ln.split("--variant ")[1].split()[0] for ln in r.stdout.splitlines()
              if "--variant " in ln]
    assert picked == ["dc-ckpt-single", name]
    full = _bench("lora_llama", "--dry-run")
    assert full.returncode == 0 and f"--variant {name} " not in full.stdout + " "


def _varlen_record(folder: Path, variant: str, us_per_token: float, run: str,
                   steady: Optional[float] = None) -> Path:
    """A 1 B, one-GPU DeepCompile LoRA record of ``variant`` in run ``run``: a varlen one (lengths
    uniform in 128-2048) or a fixed one at their mean, at ``us_per_token``."""
    varlen = variant.endswith("-varlen")
    n, tokens = (94, 94 * 4 * 1088) if varlen else (34, 34 * 4 * 1088)
    path = folder / f"{variant}-{run}.json"
    path.write_text(json.dumps({
        "variant": variant, "versions": {"deepspeed": "0.19.8"}, "peak_gib": 3.4, "run": run,
        "step_ms": {"median": 85.0, "min": 10.0, "max": 160.0, "n": n},
        "step_s_all": [0.085] * (n + 6), "timed_tokens": tokens,
        "us_per_token": us_per_token,
        "us_per_token_steady": us_per_token if steady is None else steady,
        "dynamo_graphs": 2 if varlen else 1, "compile_steps": [0, 1] if varlen else [0],
        "deepcompile_compiles": {"fwd": 2, "bwd": 2} if varlen else {"fwd": 1, "bwd": 1},
        "compile_to_first_step_s": 80.0, "wall_to_last_step_s": 200.0,
        "setup": {"size": "1b", "world_size": 1, "seq": 1088, "micro_batch": 4,
                  "device": "NVIDIA H100 80GB HBM3", "checkpointing": "non-reentrant",
                  "deepcompile": True, "rows": "full", "model": {"params": 0.96e9, "lora_r": 16},
                  "lengths": {"spec": "uniform:128:2048", "min": 128, "max": 2048, "step": 1,
                              "mean": 1088.0, "seed": 0} if varlen else None}}))
    return path


def test_a_varlen_pair_runs_at_the_lengths_mean_only_when_named() -> None:
    # The varlen variant draws its lengths for 100 steps; its base variant runs at their mean
    # (1088 for 128-2048) for 40, in the same invocation. A full run leaves the pair out, and a
    # varlen variant without its base is refused (no ratio to give).
    r = _bench("lora_llama", "--dry-run", "--variants", "dc-ckpt-single,dc-ckpt-single-varlen")
    assert r.returncode == 0, r.stderr
    cmds = {ln.split("--variant ")[1].split()[0]: ln for ln in r.stdout.splitlines()
            if "--variant " in ln}
    assert list(cmds) == ["dc-ckpt-single", "dc-ckpt-single-varlen"]
    assert "--seq 1088 --dc-steps 40 " in cmds["dc-ckpt-single"]
    assert "--lengths uniform:128:2048 --dc-steps 100 " in cmds["dc-ckpt-single-varlen"]
    assert "--seq" not in cmds["dc-ckpt-single-varlen"]
    # Outside a varlen invocation the base variant runs as before.
    plain = _bench("lora_llama", "--dry-run", "--variants", "dc-ckpt-single")
    assert plain.returncode == 0 and "--seq" not in plain.stdout and "--dc-steps" not in plain.stdout
    full = _bench("lora_llama", "--dry-run")
    assert full.returncode == 0 and "-varlen" not in full.stdout
    alone = _bench("lora_llama", "--dry-run", "--variants", "dc-ckpt-varlen")
    assert alone.returncode == 2 and "pick dc-ckpt as well" in alone.stderr


def test_lengths_are_drawn_per_step_from_one_seed_and_rows_are_full_or_padded() -> None:
    import argparse

    import torch

    from bench.lora_llama import _Batches, _parse, parse_lengths

    args = _parse(["--variant", "dc-ckpt-single-varlen", "--size", "toy", "--output", "x"])
    assert args.seq == 1088 and args.lengths.text == "uniform:128:2048"
    a, b = _Batches(args, 0, 2), _Batches(args, 1, 2)
    batches = [(a.next("cpu"), b.next("cpu")) for _ in range(200)]
    # One length per step, the same on every rank (differing ranks would compile apart), drawn
    # over the whole range; every row that long, its tokens real: no mask, labels are the ids.
    assert a.lengths == b.lengths and len(set(a.lengths)) > 100
    assert 128 <= min(a.lengths) < 300 and 1900 < max(a.lengths) <= 2048
    assert abs(sum(a.lengths) / 200 - 1088) < 100
    for (x, y), n in zip(batches, a.lengths):
        assert x["input_ids"].shape == y["input_ids"].shape == (4, n)
        assert x["labels"] is x["input_ids"] and "attention_mask" not in x
        assert not torch.equal(x["input_ids"], y["input_ids"])  # each rank its own tokens
    assert a.tokens == [4 * n * 2 for n in a.lengths] == a.real_tokens
    # The same seed gives the same lengths again.
    again = _Batches(args, 0, 1)
    assert [again.next("cpu")["input_ids"].shape[1] for _ in range(200)] == a.lengths
    # A fixed run: --seq every step, the ids drawn as before (the loop's rank-seeded generator).
    fixed = _Batches(_parse(["--variant", "dc-ckpt-single", "--size", "toy", "--seq", "16",
                             "--output", "x"]), 3, 1)
    first = fixed.next("cpu")
    assert torch.equal(first["input_ids"], torch.randint(
        0, 512, (4, 16), generator=torch.Generator().manual_seed(1003)))
    # Padded rows: the first row the step's length, the others right-padded as a collator pads.
    padded = _Batches(_parse(["--variant", "dc-ckpt-single-varlen", "--size", "toy",
                              "--pad-rows", "--output", "x"]), 0, 1)
    for _ in range(20):
        batch = padded.next("cpu")
        mask, ids, labels = batch["attention_mask"], batch["input_ids"], batch["labels"]
        n = ids.shape[1]
        assert bool(mask[0].all())
        real = mask.sum(dim=1)
        assert all(n // 2 <= int(k) <= n for k in real)
        assert bool((labels[mask == 0] == -100).all()) and bool((ids[mask == 0] == 0).all())
        assert bool((labels[mask == 1] == ids[mask == 1]).all())
    assert padded.lengths == a.lengths[:20]  # padding draws from its own seed
    assert padded.tokens == [4 * n for n in padded.lengths]
    assert all(r <= t for r, t in zip(padded.real_tokens, padded.tokens))
    assert padded.real_tokens != padded.tokens
    # What the parser refuses, naming the value.
    for bad in ("uniform:1:8", "uniform:9:8", "normal:8:9", "uniform:8", "uniform:8:16:0"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            parse_lengths(bad)
    for argv in (["--variant", "dc-ckpt-single-varlen", "--seq", "512"],
                 ["--variant", "dc-ckpt-single", "--lengths", "uniform:8:16"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            _parse([*argv, "--output", "x"])


def test_a_varlen_run_is_measured_per_token_against_its_fixed_run(tmp_path: Path) -> None:
    from bench.lora_llama import merge

    results = tmp_path / "results"
    out = results / "lora_llama_varlen.json"
    merged = merge([_varlen_record(tmp_path, "dc-ckpt-single", 20.0, "a"),
                    _varlen_record(tmp_path, "dc-ckpt-single-varlen", 21.0, "a", steady=20.5),
                    _varlen_record(tmp_path, "upstream", 150.0, "a")], out)
    assert merged["bench"] == "lora_llama_varlen"
    runs = merged["runs"]
    fixed = runs["dc-ckpt-single-varlen@0.19.8"]["vs"]
    # Per token against the base variant of its run, and against nothing else.
    assert set(fixed) == {"fixed"}
    assert fixed["fixed"]["variant"] == "dc-ckpt-single"
    assert fixed["fixed"]["token_time_ratio"] == pytest.approx(1.05)
    assert fixed["fixed"]["steady_ratio"] == pytest.approx(1.025)
    assert fixed["fixed"]["baseline_us_per_token"] == 20.0 and fixed["fixed"]["run"] == "a"
    assert "fixed" not in (runs["dc-ckpt-single@0.19.8"].get("vs") or {})
    # A varlen run of another invocation keeps no ratio to this one's base.
    other = merge([_varlen_record(tmp_path, "dc-ckpt-single-varlen", 30.0, "b")], out)
    assert "fixed" not in (other["runs"]["dc-ckpt-single-varlen@0.19.8"].get("vs") or {})
    merge([_varlen_record(tmp_path, "dc-ckpt-single-varlen", 21.0, "a", steady=20.5)], out)

    # Its own table and README row, beside the lora_llama tables, not in them.
    loaded = report.load_results(results)
    assert report._family("lora_llama_varlen") == "lora_llama_varlen"
    assert report._family("lora_llama_varlen_ws2") == "lora_llama_varlen"
    assert report._family("lora_llama_h100") == "lora_llama"
    block = report.render_block(loaded)
    assert "**DeepCompile on batches of varying length**" in block
    assert "**LoRA fine-tune step**" not in block
    rows = {ln.split("|")[1].strip(): ln for ln in block.splitlines() if ln.startswith("| dc-")}
    assert "uniform 128–2048 (mean 1088)" in rows["dc-ckpt-single-varlen"]
    assert ("1.050x `dc-ckpt-single`'s (1.025x without the timed steps that compiled)"
            in rows["dc-ckpt-single-varlen"])
    assert "2 (steps 1, 2)" in rows["dc-ckpt-single-varlen"]
    assert "21.00 (20.50 steady)" in rows["dc-ckpt-single-varlen"]
    assert "1088 (fixed)" in rows["dc-ckpt-single"]
    summary = report.render_summary(loaded)
    (row,) = [ln for ln in summary.splitlines() if "lengths uniform in 128–2048" in ln]
    assert "`dc-ckpt-single-varlen`: 21.00 µs per token, 2 Dynamo graphs in 100 steps" in row
    assert "`dc-ckpt-single` at 1088 tokens per row: 20.00 µs per token" in row
    assert "1.05x the time per token" in row and "1 x NVIDIA H100 80GB HBM3" in row


@pytest.mark.slow
def test_varlen_variant_smoke_on_cpu(tmp_path: Path) -> None:
    # The varlen variant at toy size on the CPU (timings mean nothing here): every step's
    # length drawn, its tokens and loss recorded, and DeepCompile's graphs bounded: the first
    # length, then one symbolic graph for every later length (single cycle: no re-plan).
    out = tmp_path / "varlen.json"
    r = subprocess.run([sys.executable, "bench/lora_llama.py", "--variant",
                        "dc-ckpt-single-varlen", "--size", "toy", "--dc-steps", "8",
                        "--lengths", "uniform:8:40:4", "--micro-batch", "2",
                        "--no-track-gathered", "--output", str(out)], cwd=ROOT,
                       env={**_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["setup"]["lengths"]["spec"] == "uniform:8:40:4" and rec["setup"]["seq"] == 24
    lengths = rec["step_lengths"]
    assert len(lengths) == 8 and len(set(lengths)) >= 4
    assert all(n in range(8, 41, 4) for n in lengths)
    assert rec["step_tokens"] == [2 * n for n in lengths]
    assert len(rec["losses"]) == 8 and rec["graph_breaks"] == 0
    assert rec["timed_tokens"] == sum(rec["step_tokens"][6:])
    assert rec["us_per_token"] == pytest.approx(
        sum(rec["step_s_all"][6:]) * 1e6 / rec["timed_tokens"])
    graphs = rec["dynamo_graphs_by_step"]
    assert len(graphs) == 8 and graphs[-1] == rec["dynamo_graphs"] == 2, graphs
    # Compiled at the first step and at the first other length, nowhere else.
    assert rec["compile_steps"] == [0, next(i for i, n in enumerate(lengths) if n != lengths[0])]
    assert rec["deepcompile_compiles"]["fwd"] >= rec["dynamo_graphs"]


def test_the_readme_summary_keeps_one_row_per_claim_the_latest() -> None:
    from bench.report import _one_row_per_claim

    rows = [["step A", "1", "b", "r", "2026-12-01, 1 x H200"],
            ["compile", "2", "b", "r", "2026-12-02, 1 x H200"],
            ["step A", "3", "b", "r", "2026-12-06, 1 x H100"],
            ["step A", "4", "b", "r", "2026-12-03, 1 x H100"]]
    assert _one_row_per_claim(rows) == [rows[2], rows[1]]
