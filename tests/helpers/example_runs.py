"""Run ``examples/sft_lora.py`` the way the commands of docs/usage.md do (``torchrun`` or
``accelerate launch``, ``DS_Z3NATIVE`` in the environment) and read what it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ds_z3native._net import free_port

from helpers.dc_runner import child_env
from helpers.param_bounds import assert_trained_alike

__all__ = ["ROOT", "EXAMPLE", "DS_Z3", "DS_Z3_DEEPCOMPILE", "ACCELERATE_CONFIG", "run_example",
           "run_examples", "zero0_config", "adapter_tensors", "initial_adapter_tensors",
           "losses_by_step", "assert_same_training", "load_example", "shown_command",
           "shown_commands"]

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
    the test with its log. ``ds_z3native``: the run's ``DS_Z3NATIVE`` (None: unset, DeepSpeed
    alone). ``device="cpu"``: DeepSpeed's CPU accelerator, gloo (CUDA hidden); ``"cuda"``: one
    GPU per rank."""
    started = _start(out, name, args, ds_z3native, nproc, launcher, env, device, set())
    return _finish(out, name, *started, expect_ok=expect_ok)


def run_examples(out: Path, runs: Mapping[str, Tuple[Sequence[str], Optional[str]]],
                 nproc: int = 2, launcher: str = "torchrun",
                 env: Optional[Mapping[str, str]] = None,
                 device: str = "cpu") -> Dict[str, Dict[str, Any]]:
    """``name -> (args, ds_z3native)`` runs of the example started together (each as
    ``run_example`` starts it, on its own port; their compiles are CPU-bound and overlap), each
    expected to succeed; their results by name."""
    ports: Set[str] = set()
    started = {name: _start(out, name, args, ds_z3native, nproc, launcher, env, device, ports)
               for name, (args, ds_z3native) in runs.items()}
    return {name: _finish(out, name, *s, expect_ok=True) for name, s in started.items()}


def _start(out: Path, name: str, args: Sequence[str], ds_z3native: Optional[str], nproc: int,
           launcher: str, env: Optional[Mapping[str, str]], device: str,
           ports: Set[str]) -> Tuple[subprocess.Popen, List[str], Any]:
    run_env = child_env()
    if device == "cpu":
        run_env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    run_env.update(TORCHINDUCTOR_CACHE_DIR=str(out / "inductor-cache"), **(env or {}))
    if ds_z3native is not None:
        run_env["DS_Z3NATIVE"] = ds_z3native
    port = str(free_port())
    while port in ports:  # runs started together: each its own rendezvous port
        port = str(free_port())
    ports.add(port)
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_CONFIG), "--num_processes", str(nproc), "--main_process_port", port]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}"]
    cmd += [str(EXAMPLE), *args, "--output-dir", str(out / name), "--results",
            str(out / f"{name}.json")]
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=ROOT)
    return proc, cmd, log


def _finish(out: Path, name: str, proc: subprocess.Popen, cmd: List[str], log: Any,
            expect_ok: bool) -> Dict[str, Any]:
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    results = out / f"{name}.json"
    log_tail = (out / f"{name}.log").read_text()[-4000:]
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


def shown_commands(qlora: bool = False) -> List[str]:
    """The example commands docs/usage.md shows (its lines that run examples/sft_lora.py): those
    without ``--qlora``, or with ``qlora`` those with it (tests/gpu/test_qlora_gpu.py runs them)."""
    text = USAGE_DOC.read_text()
    return [line.strip() for line in text.splitlines()
            if line.startswith("DS_Z3NATIVE=1 ") and str(EXAMPLE.relative_to(ROOT)) in line
            and ("--qlora" in line.split()) == qlora]


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


def adapter_tensors(result: Dict[str, Any], key: str = "adapter") -> Dict[str, Any]:
    """The LoRA tensors a run saved (``trainer.save_model``), by name; ``key="initial_adapter"``:
    the adapter as initialised, before the first step."""
    from safetensors.torch import load_file

    return load_file(str(Path(result[key]) / "adapter_model.safetensors"))


def initial_adapter_tensors(result: Dict[str, Any]) -> Dict[str, Any]:
    """The LoRA tensors of a run before its first step, by name (as ``adapter_tensors``)."""
    return adapter_tensors(result, "initial_adapter")


def losses_by_step(result: Dict[str, Any], key: str = "train_loss") -> Dict[int, float]:
    """What a run logged under ``key`` (``train_loss`` or ``eval_loss``), by global step."""
    return {int(step): loss for step, loss in result[key]}


# Element-wise equal adapters are also within this share of the reference's move, per tensor.
ELEMENTWISE_REL = 1e-2


def assert_same_training(ours: Dict[str, Any], ref: Dict[str, Any], steps: List[int],
                         rtol: float = 1e-4, atol: float = 1e-5,
                         params_rel: Optional[float] = None) -> Dict[str, float]:
    """``ours`` trained as ``ref`` did; ``ref`` ran without ds_z3native (DeepSpeed alone, so that
    a fault of our patches cannot cancel out), both in the same dtype from the same initial
    adapter. Logged losses at ``steps`` and the evaluation losses at those steps equal within
    ``rtol``/``atol``; the Trainer's FLOP count (``total_flos``) the same (ZeRO-3's partitioned
    params count at their full size). The saved adapters, per LoRA tensor (``assert_trained_alike``):
    the reference moved from the initial value by more than half an Adam step (``lr / 2``, rms),
    and ``||ours - ref|| <= params_rel * ||ref - initial||`` -- a tensor that did not train
    in ``ours`` is off by the whole move and fails. ``params_rel=None``: the tensors are also
    equal element-wise within ``rtol``/``atol`` (the same sums, as fp32 on the CPU), with
    ``params_rel`` = ELEMENTWISE_REL. Where kernels round differently (the GPU, bf16), give
    ``params_rel``: Adam steps each weight by about ``lr`` whatever its gradient's size, so a weight
    whose gradient is near zero can move the other way in one run, and only the tensor's
    distance, relative to its move, is bounded. Returns ``name -> ||ours - ref|| / ||ref - initial||``."""
    assert ref.get("ds_z3native_installed") is False, \
        f"the reference run had ds_z3native installed: {ref.get('ds_z3native_installed')!r}"
    assert ours["bf16"] == ref["bf16"], (ours["bf16"], ref["bf16"])
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
    initial = initial_adapter_tensors(ref)
    assert got.keys() == want.keys() == initial.keys() and len(got) > 0
    ours_initial = initial_adapter_tensors(ours)
    for name in initial:  # the same seed: the same adapter before training
        assert torch.equal(ours_initial[name], initial[name]), f"{name}: initial adapters differ"
    if params_rel is None:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name}: {m}")
    return assert_trained_alike(got, want, initial, rel=params_rel or ELEMENTWISE_REL,
                                min_rms_move=ref["lr"] / 2, what="saved adapter")
