"""Run ``examples/sft_lora.py`` the way the commands of docs/usage.md do (``torchrun`` or
``accelerate launch``, ``DS_Z3NATIVE`` in the environment) and read what it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ds_z3native._net import free_port

from helpers.dc_runner import child_env

__all__ = ["ROOT", "EXAMPLE", "DS_Z3", "DS_Z3_DEEPCOMPILE", "ACCELERATE_CONFIG", "run_example",
           "zero0_config", "adapter_tensors", "losses_by_step", "assert_same_training", "load_example",
           "shown_command", "shown_commands"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft_lora.py"
DS_Z3 = ROOT / "examples" / "ds_z3.json"
DS_Z3_DEEPCOMPILE = ROOT / "examples" / "ds_z3_deepcompile.json"
ACCELERATE_CONFIG = ROOT / "examples" / "accelerate_zero3.yaml"
TIMEOUT_S = 1200


def run_example(out: Path, name: str, args: Sequence[str], ds_z3native: Optional[str] = "1",
                nproc: int = 2, launcher: str = "torchrun", expect_ok: bool = True,
                env: Optional[Mapping[str, str]] = None, device: str = "cpu") -> Dict[str, Any]:
    """One run of the example into ``out/name`` (its log ``out/name.log``); the JSON it wrote,
    with ``log`` (the log's last 4000 characters) and ``rc``. ``expect_ok``: a failed run fails
    the test with its log. ``device="cpu"``: DeepSpeed's CPU accelerator, gloo (CUDA hidden);
    ``"cuda"``: one GPU per rank."""
    run_env = child_env()
    if device == "cpu":
        run_env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    run_env.update(TORCHINDUCTOR_CACHE_DIR=str(out / "inductor-cache"), **(env or {}))
    if ds_z3native is not None:
        run_env["DS_Z3NATIVE"] = ds_z3native
    port = str(free_port())
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_CONFIG), "--num_processes", str(nproc), "--main_process_port", port]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}"]
    results = out / f"{name}.json"
    cmd += [str(EXAMPLE), *args, "--output-dir", str(out / name), "--results", str(results)]
    log_path = out / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=ROOT,
                              timeout=TIMEOUT_S)
    log_tail = log_path.read_text()[-4000:]
    if expect_ok:
        assert proc.returncode == 0 and results.exists(), \
            f"{name}: rc {proc.returncode}\n{' '.join(cmd)}\n{log_tail}"
    result: Dict[str, Any] = json.loads(results.read_text()) if results.exists() else {}
    result.update(rc=proc.returncode, log=log_tail)
    return result


def shown_command(args: Sequence[str], launcher: str = "torchrun", nproc: int = 2) -> str:
    """The command line a user types for a run of the example with ``args`` (paths relative to
    the repository), as docs/usage.md shows it."""
    if launcher == "accelerate":
        start = f"accelerate launch --config_file {ACCELERATE_CONFIG.relative_to(ROOT)}"
    else:
        start = f"torchrun --nproc_per_node {nproc}"
    shown = [str(Path(a).relative_to(ROOT)) if a.startswith(str(ROOT)) else a for a in args]
    return " ".join(["DS_Z3NATIVE=1", start, str(EXAMPLE.relative_to(ROOT)), *shown])


USAGE_DOC = ROOT / "docs" / "usage.md"


def shown_commands() -> List[str]:
    """The example commands docs/usage.md shows (its lines that run examples/sft_lora.py)."""
    text = USAGE_DOC.read_text()
    return [line.strip() for line in text.splitlines()
            if line.startswith("DS_Z3NATIVE=1 ") and str(EXAMPLE.relative_to(ROOT)) in line]


def load_example() -> Any:
    """examples/sft_lora.py as a module (its model, data and argument parsing)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sft_lora_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def zero0_config(out: Path) -> Path:
    """examples/ds_z3.json at ZeRO stage 0 (the unsharded reference), written under ``out``."""
    config = json.loads(DS_Z3.read_text())
    config["zero_optimization"] = {"stage": 0}
    path = out / "ds_z0.json"
    path.write_text(json.dumps(config))
    return path


def adapter_tensors(result: Dict[str, Any]) -> Dict[str, Any]:
    """The LoRA tensors a run saved (``trainer.save_model``), by name."""
    from safetensors.torch import load_file

    return load_file(str(Path(result["adapter"]) / "adapter_model.safetensors"))


def losses_by_step(result: Dict[str, Any], key: str = "train_loss") -> Dict[int, float]:
    """What a run logged under ``key`` (``train_loss`` or ``eval_loss``), by global step."""
    return {int(step): loss for step, loss in result[key]}


def assert_same_training(ours: Dict[str, Any], ref: Dict[str, Any], steps: List[int],
                         rtol: float = 1e-4, atol: float = 1e-5,
                         adam: Optional[Tuple[float, int]] = None) -> None:
    """Logged losses at ``steps``, the evaluation losses at those steps and the saved adapter
    equal within ``rtol``/``atol``. ``adam=(lr, steps)``: the adapters are compared as Adam
    moves them instead (where kernels round differently, as on the GPU): Adam steps each weight by
    about ``lr`` whatever its gradient's size, so a weight whose gradient is near zero can move
    the other way in one run; each differs by at most ``2 * lr * steps``, and the LoRA B weights
    (zero at the start: their value is what training did) differ on average by under 5% of their
    mean size. The Trainer's FLOP count (``total_flos``) is the same: ZeRO-3's partitioned params
    count at their full size."""
    assert ours["total_flos"] == ref["total_flos"] > 0, (ours["total_flos"], ref["total_flos"])
    a, b = losses_by_step(ours), losses_by_step(ref)
    assert set(steps) <= set(a) and set(steps) <= set(b), (sorted(a), sorted(b))
    torch.testing.assert_close(torch.tensor([a[s] for s in steps]),
                               torch.tensor([b[s] for s in steps]), rtol=rtol, atol=atol)
    ea, eb = losses_by_step(ours, "eval_loss"), losses_by_step(ref, "eval_loss")
    evals = [s for s in eb if s in steps]
    assert evals and sorted(ea) == evals, (sorted(ea), sorted(eb))
    torch.testing.assert_close(torch.tensor([ea[s] for s in evals]),
                               torch.tensor([eb[s] for s in evals]), rtol=rtol, atol=atol)
    got, want = adapter_tensors(ours), adapter_tensors(ref)
    assert got.keys() == want.keys() and len(got) > 0
    if adam is None:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol)
    else:
        lr, n = adam
        worst = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
        assert worst <= 2 * lr * n, f"largest adapter difference {worst:.3g} > 2 * {lr} * {n}"
        b = [k for k in want if "lora_B" in k]
        diff = sum(float((got[k].float() - want[k].float()).abs().sum()) for k in b)
        size = sum(float(want[k].float().abs().sum()) for k in b)
        assert diff <= 0.05 * size, f"LoRA B mean difference {diff / size:.3g} of their size"
    # The adapter moved away from its initial value (lora_B starts at zero): it was trained.
    assert any(float(t.abs().max()) > 0 for n, t in got.items() if "lora_B" in n)
