"""Batches of varying length (``bench/lora_llama.py --lengths``, the ``-varlen`` variants): the
pair's plan, the lengths drawn per step from one seed, full or padded rows, the per-token ratio
to the fixed run of the same invocation with its table and README row, and a smoke run on the
CPU whose DeepCompile graphs stay bounded."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from helpers.bench_cli import bench_env as _env, run_bench as _bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench import report  # noqa: E402


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
