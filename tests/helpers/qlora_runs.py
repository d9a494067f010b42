"""The QLoRA runs of ``examples/sft_lora.py`` that docs/usage.md shows and
tests/gpu/test_qlora_gpu.py runs (each as arguments of a torchrun launch)."""

from __future__ import annotations

from typing import Dict, List

from helpers.example_runs import DS_Z3, DS_Z3_DEEPCOMPILE

__all__ = ["STEPS", "QLORA", "COMMON", "DC", "SHOWN"]

STEPS = 8
QLORA = ["--qlora", "--bf16"]
COMMON = [*QLORA, "--max-steps", str(STEPS), "--grad-accum", "2", "--max-grad-norm", "0.5"]
DC = ["--deepspeed", str(DS_Z3_DEEPCOMPILE), "--torch-compile"]
SHOWN: Dict[str, List[str]] = {
    "qlora-z3": ["--deepspeed", str(DS_Z3), *COMMON],
    "qlora-dc": [*DC, *COMMON],
}
