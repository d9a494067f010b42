"""``python -m bench compile_scaling`` (``bench/benchmarks/compile_scaling.py``): its plan (each
depth cold, warm and with DeepSpeed's op; single-cycle runs only when named; one run per
invocation as docs/benchmarks.md loops), its summary at the deepest depth, its table and README
row, the runs it replaces or merges from other invocations, and its smoke run on the CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ds_z3native.settings import PROFILE_STORE_ENV, SINGLE_CYCLE_ENV
from helpers.bench_cli import VERSION_KEYS, bench_env as _env, run_bench as _bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench import report  # noqa: E402


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
