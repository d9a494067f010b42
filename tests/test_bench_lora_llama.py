"""``bench/lora_llama.py`` and its registration (``bench/benchmarks/lora_llama.py``): records
merged into one result per setup, each ratio against a baseline of its own run (``upstream``, our
own loop, unsharded PyTorch), some variants re-run into the existing result, and the plans
``python -m bench lora_llama --dry-run`` prints (two GPUs under torchrun, ``--trace``, inductor
caches and profile stores, picked variants)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from ds_z3native.settings import PROFILE_STORE_ENV
from helpers.bench_cli import run_bench as _bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench import report  # noqa: E402


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


def test_the_grouped_reduce_alone_is_a_lora_pair_run_only_when_named() -> None:
    # dc-ckpt-single-reduce-each is dc-ckpt-single with set_group_reduce(False): the two in one
    # invocation measure the grouped reduce alone. A full run leaves it out.
    from bench.core.variants import CHECKPOINTING, DEEPCOMPILE, OPT_IN, OURS_DC

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


def test_the_variants_are_one_table_and_the_docs_table_is_written_from_it() -> None:
    """bench/core/variants.py's records are the one source: the lists the benchmark reads are
    derived from them, each ds_z3native variant's settings are Settings fields with valid
    values, each baseline a variant, and docs/benchmarks.md's table is the generated one."""
    import dataclasses

    from bench.core import variants as V
    from ds_z3native.settings import Settings

    names = [v.name for v in V.VARIANT_TABLE]
    assert len(names) == len(set(names)) == len(V.VARIANTS)
    for v in V.VARIANT_TABLE:
        assert v.checkpointing in ("none", "non-reentrant", "reentrant"), v
        assert v.op in (None, "ours", "deepspeed") and (v.op is None or v.deepcompile), v
        if v.settings:
            assert v.op == "ours", v
            dataclasses.replace(Settings(), **dict(v.settings))  # refuses a bad field or value
        for base in (v.trainer_of, v.varlen_of):
            assert base is None or base in V.VARIANT_BY_NAME, v
    assert V.SINGLE_CYCLE == tuple(v.name for v in V.VARIANT_TABLE
                                   if dict(v.settings).get("single_cycle"))
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert V.variant_table_markdown() in docs, (
        "docs/benchmarks.md's LoRA variant table differs from bench/core/variants.py's: paste "
        "`python -c \"from bench.core.variants import variant_table_markdown as t; print(t())\"`")


@pytest.mark.slow
def test_the_peer_variants_train_the_same_model_on_the_same_batches(tmp_path: Path) -> None:
    """plain PyTorch with torch.compile (``compiled``) and FSDP2 with per-layer compile and
    checkpointing (``fsdp2-ckpt-compile``, one gloo rank) against ``plain``, toy size on the CPU,
    fp32: the same losses step for step; each record says what torch.compile made of it."""
    import os
    import subprocess

    from ds_z3native._net import free_port

    losses = {}
    for variant in ("plain", "compiled", "fsdp2-ckpt-compile"):
        out = tmp_path / f"{variant}.json"
        env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env.pop("DS_Z3NATIVE", None)
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "lora_llama.py"), "--variant",
                            variant, "--size", "toy", "--steps", "3", "--warmup", "1", "--seq",
                            "32", "--micro-batch", "1", "--no-track-gathered", "--run", "peers",
                            "--output", str(out)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        record = json.loads(out.read_text())
        losses[variant] = record["losses"]
        setup = record["setup"]
        assert setup["zero"] is None and setup["deepspeed_config"] is None, setup
        if variant != "plain":
            assert set(record["dynamo"]) == {"unique_graphs", "graph_breaks"}, record["dynamo"]
    assert setup["framework"] == "fsdp2" and setup["compile"] == "layers"
    assert len(losses["plain"]) == 4
    for variant in ("compiled", "fsdp2-ckpt-compile"):
        assert losses[variant] == pytest.approx(losses["plain"], rel=1e-4), (variant, losses)
