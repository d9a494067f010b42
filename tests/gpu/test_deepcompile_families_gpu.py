"""DeepCompile ZeRO-3 + PEFT LoRA + non-reentrant checkpointing on decoder families other than
Llama, on CUDA, against eager ZeRO-3: GPT-2 (Conv1D layers, a model class that names no loss
type), Qwen3-MoE and Mixtral (mixture-of-experts blocks: ZeRO-3 leaf modules, router trained in
full), with an evaluation and a ``generate()`` between steps. The CPU side of the same runs is
``tests/test_deepcompile_cpu_families.py::test_other_decoder_families_train_like_eager_zero3``; here the
graphs are inductor's CUDA kernels and the collectives NCCL.

    python -m pytest -m gpu tests/gpu/test_deepcompile_families_gpu.py -q -s
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from helpers.dc_runner import run_together

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

# 8 steps: past DeepCompile's step-6 re-plan, with evaluations and generations before and after it.
STEPS = 8
FAMILIES = ("gpt2", "qwen3_moe", "mixtral")
COMMON = ("--model", "llama", "--size", "tiny", "--dtype", "fp32", "--native", "ours",
          "--checkpointing", "non-reentrant", "--eval-every", "3", "--generate-every", "3")
# fp32 with TF32 off on both sides: the same math, differing in inductor's fusion only.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict[str, Any]]:
    plan = {}
    for family in FAMILIES:
        plan[f"{family}-dc"] = ((*COMMON, "--family", family, "--mode", "deepcompile"), STEPS)
        plan[f"{family}-eager"] = ((*COMMON, "--family", family, "--mode", "eager",
                                    "--eager-stage", "3"), STEPS)
    return run_together(plan)


def _trained(r: Dict[str, Any]) -> Dict[str, Any]:
    assert "error" not in r, f"{r['error']}\n{r.get('traceback', '')}\n{r['log_tail']}"
    assert len(r["losses"]) == STEPS
    return r


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_family_trains_evaluates_and_generates_like_eager_zero3(
        runs: Dict[str, Dict[str, Any]], family: str) -> None:
    import torch

    dc, eager = _trained(runs[f"{family}-dc"]), _trained(runs[f"{family}-eager"])
    torch.testing.assert_close(torch.tensor(dc["losses"]), torch.tensor(eager["losses"]),
                               rtol=RTOL, atol=ATOL)
    assert dc["params"].keys() == eager["params"].keys() and dc["params"]
    for name, values in eager["params"].items():
        torch.testing.assert_close(torch.tensor(dc["params"][name]), torch.tensor(values),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert len(dc["eval_losses"]) == len(eager["eval_losses"]) == STEPS // 3
    torch.testing.assert_close(torch.tensor(dc["eval_losses"]), torch.tensor(eager["eval_losses"]),
                               rtol=RTOL, atol=ATOL)
    assert len(dc["generated"]) == STEPS // 3 and dc["generated"] == eager["generated"]
    assert dc["eager_gather"]["generations"] == STEPS // 3
    assert dc["eager_gather"]["held_after_training"] == []
    assert dc["graph_breaks"] == 0, dc["graph_break_reasons"]
    trained_in_full = sorted(n for n, rg in dc["requires_grad"].items() if rg and "lora_" not in n)
    if family == "gpt2":
        assert trained_in_full == []
    else:
        assert trained_in_full and all(n.endswith(".gate.weight") for n in trained_in_full), \
            trained_in_full
        assert dc["leaf_module_hooks"]["hooks"] > 0, dc["leaf_module_hooks"]
    print(f"\n[{family}] losses {dc['losses'][0]:.4f} -> {dc['losses'][-1]:.4f}; compile to the end "
          f"of step 1 {dc['compile_to_first_step_end_s']:.1f} s; generated {dc['generated']}")
