"""``bench/report.py``: docs/benchmarks.md's tables and the README's summary regenerated from
result JSON, idempotently and only between their markers (the committed ones are what the
committed results give); the summary plot; the LoRA, persistent_group and README summary rows
rendered from hand-made results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench import report  # noqa: E402


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


def test_the_readme_summary_keeps_one_row_per_claim_the_latest() -> None:
    from bench.report import _one_row_per_claim

    rows = [["step A", "1", "b", "r", "2026-12-01, 1 x H200"],
            ["compile", "2", "b", "r", "2026-12-02, 1 x H200"],
            ["step A", "3", "b", "r", "2026-12-06, 1 x H100"],
            ["step A", "4", "b", "r", "2026-12-03, 1 x H100"]]
    assert _one_row_per_claim(rows) == [rows[2], rows[1]]
