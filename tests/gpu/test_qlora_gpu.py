"""QLoRA under DeepSpeed ZeRO-3 with HF Trainer on CUDA, through ``examples/sft_lora.py --qlora``
as docs/usage.md launches it (``DS_Z3NATIVE=1 torchrun``, one rank per GPU).

The example's tiny Llama, built from a config (nothing downloaded), saved and loaded 4-bit
through transformers' ``BitsAndBytesConfig`` (nf4, double quantization, ``bnb_4bit_quant_storage``
= the compute dtype, bf16), PEFT LoRA on every linear layer, non-reentrant gradient
checkpointing: eager ZeRO-3 and DeepCompile (``--torch-compile`` with the DeepCompile config),
each against the same script and data at ZeRO stage 0 without ds_z3native: the logged losses
step by step, and each LoRA tensor of the saved adapter within a fraction of how far the
reference moved it from the initial adapter (which every run saves before its first step; the
reference must have moved each tensor by more than half an Adam step, rms). With the packed
weights stored in uint8 (bitsandbytes' default) DeepCompile refuses at ``engine.compile()``,
naming ``bnb_4bit_quant_storage``.

The commands are those of docs/usage.md's QLoRA section (``tests/test_qlora.py`` checks that
on the CPU). Needs bitsandbytes (skipped without it):

    python -m pytest -m gpu tests/gpu/test_qlora_gpu.py -q
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from helpers.example_runs import (adapter_tensors, initial_adapter_tensors, losses_by_step,
                                  run_example, zero0_config)
from helpers.param_bounds import assert_trained_alike
from helpers.qlora_runs import COMMON, DC, QLORA, SHOWN, STEPS

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed, pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="needs bitsandbytes (pip install bitsandbytes)")]

# bf16, as the other bf16 GPU tests bound it: 8 significant bits, and DeepCompile's fused kernels
# round at other points than eager's. Losses within 2e-2 relative; each LoRA tensor within 0.35
# of the reference's move from the initial adapter (Adam moves a weight whose gradient is near
# zero by about lr either way; a tensor that did not train is off by 1).
LOSS_RTOL = 2e-2
PARAMS_REL = 0.35


def _run(out: Path, name: str, args: List[str], **kwargs: Any) -> Dict[str, Any]:
    return run_example(out, name, args, device="cuda", nproc=torch.cuda.device_count(), **kwargs)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qlora-runs-gpu")


@pytest.fixture(scope="module")
def reference(out: Path) -> Dict[str, Any]:
    """The same QLoRA run at ZeRO stage 0, DeepSpeed alone."""
    return _run(out, "qlora-z0", ["--deepspeed", str(zero0_config(out)), *COMMON],
                ds_z3native=None)


def assert_same_qlora_training(ours: Dict[str, Any], ref: Dict[str, Any]) -> Dict[str, float]:
    """Losses by step within LOSS_RTOL, the same initial adapter, and each trained LoRA tensor
    within PARAMS_REL of the reference's move (``assert_trained_alike``); returns those ratios."""
    assert ours["qlora"] and ref["qlora"] and ours["bf16"] and ref["bf16"]
    assert ours["ds_z3native_installed"] is True and ref["ds_z3native_installed"] is False
    a, b = losses_by_step(ours), losses_by_step(ref)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (sorted(a), sorted(b))
    torch.testing.assert_close(torch.tensor([a[s] for s in b]), torch.tensor([b[s] for s in b]),
                               rtol=LOSS_RTOL, atol=0)
    initial = initial_adapter_tensors(ref)
    ours_initial = initial_adapter_tensors(ours)
    assert ours_initial.keys() == initial.keys()
    for name in initial:  # the same seed and base: the same adapter before training
        assert torch.equal(ours_initial[name], initial[name]), f"{name}: initial adapters differ"
    got, want = adapter_tensors(ours), adapter_tensors(ref)
    # LoRA on every linear layer of each of the 2 blocks (q, k, v, o, gate, up, down), A and B.
    assert sum("lora_A" in k for k in want) == sum("lora_B" in k for k in want) == 2 * 7
    return assert_trained_alike(got, want, initial, rel=PARAMS_REL, min_rms_move=ref["lr"] / 2,
                                what="saved adapter")


@pytest.mark.parametrize("name", ["qlora-z3", "qlora-dc"], ids=["eager-zero3", "deepcompile"])
def test_qlora_matches_zero0(out: Path, reference: Dict[str, Any], name: str) -> None:
    ours = _run(out, name, SHOWN[name])
    ratios = assert_same_qlora_training(ours, reference)
    print(f"{name}: largest ||ours - ref|| / ||ref - initial|| {max(ratios.values()):.3g}")
    if name == "qlora-dc":  # trained past DeepCompile's re-plan
        assert "Launching compile passes: global_steps=5" in (out / f"{name}.log").read_text()


def test_deepcompile_refuses_uint8_quant_storage(out: Path) -> None:
    weak = _run(out, "qlora-dc-uint8", [*DC, *QLORA, "--quant-storage", "uint8",
                                         "--max-steps", "1"], expect_ok=False)
    log = (out / "qlora-dc-uint8.log").read_text()
    assert weak["rc"] != 0, weak["log"]
    assert "NonFloatParam: ds_z3native: engine.compile() with DeepCompile" in log, weak["log"]
    assert "bnb_4bit_quant_storage=torch.bfloat16" in log, weak["log"]

