"""The GPU benchmarks (``lora_llama``, ``deepcompile_first_step``) through ``python -m bench NAME
--smoke``: each runs its own code at toy size on the CPU and writes a result with no failed run.
Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench_cli import bench_env as _env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package


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
