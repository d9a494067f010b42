"""DeepCompile ZeRO-3 on the CPU with other decoder families than Llama: GPT-2 and Qwen3-MoE on the
installed transformers, Qwen3-MoE on transformers 5.17 (its grouped-matmul fallback). Runs as in
``tests/test_deepcompile_cpu.py``; on a GPU: ``tests/gpu/test_deepcompile_families_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.dc_cpu import CPU_ENV, assert_same_training, ok, run
from helpers.dc_runner import cpu_deepcompile_mark, run_together
from helpers.old_transformers import old_transformers_env

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed, cpu_deepcompile_mark()]


@pytest.mark.release_matrix
@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe"])
def test_other_decoder_families_train_like_eager_zero3(family: str) -> None:
    # LoRA with non-reentrant checkpointing and evaluations between steps on two more decoder
    # families: GPT-2 (Conv1D layers; GPT2LMHeadModel names no loss type, whose warning broke
    # every compiled forward) and Qwen3-MoE (a mixture-of-experts block, a ZeRO-3 leaf module by
    # DeepSpeed's default, with its router trained in full: ZeRO-3's backward hook on it broke
    # the graph at every layer, and the trainable params then ran eagerly).
    # 7 steps, past DeepCompile's re-plan at step 6 (the training and evaluation graphs compiled
    # again with the profiles' schedule), an evaluation and a generation (engine.module.generate,
    # outside the engine's forward) after steps 2, 4 and 6: eager decoding between them.
    common = ("--model", "llama", "--family", family, "--size", "tiny",
              "--checkpointing", "non-reentrant", "--eval-every", "2", "--generate-every", "2")
    ours = ok(run(*common, steps=7), steps=7)
    ref = ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed",
                 steps=7), steps=7)
    assert_same_training(ours, ref, rtol=1e-4, atol=1e-5, steps=7)
    assert len(ours["eval_losses"]) == 3
    assert len(ours["generated"]) == 3 and ours["generated"] == ref["generated"]
    assert ours["eager_gather"]["generations"] == 3
    assert ours["eager_gather"]["held_after_training"] == []
    torch.testing.assert_close(torch.tensor(ours["eval_losses"]), torch.tensor(ref["eval_losses"]),
                               rtol=1e-4, atol=1e-5)
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]
    trained_in_full = [n for n, rg in ours["requires_grad"].items() if rg and "lora_" not in n]
    if family == "gpt2":
        assert ours["graph_break_fixes"]["default_loss"] == ["base_model.model: ForCausalLM"]
        assert trained_in_full == []
    else:
        assert trained_in_full == [f"base_model.model.model.layers.{i}.mlp.gate.weight"
                                   for i in range(2)]
        assert ours["leaf_module_hooks"] == {"engines": 1, "hooks": 2}
        # Without the patch the leaf modules keep ZeRO-3's backward hooks.
        weak = run(*common, "--skip-patch", "deepcompile-z3-leaf-module-hooks", steps=1)
        assert weak.get("error_type") == "EagerTrainableParam", weak.get("error", weak.keys())


def test_mixture_of_experts_on_transformers_5_17_trains_like_eager_zero3(tmp_path: Path) -> None:
    # transformers 5.17 runs Qwen3-MoE's experts under torch.compile with fp32 weights through
    # its grouped-matmul fallback op, whose backward (a Python loop over offs.tolist())
    # AOTAutograd could not trace: the first DeepCompile step failed with BackendCompilerFailed.
    # With hf-grouped-mm-fallback-backward that backward is ds_z3native's op (4 calls a step: two
    # layers, two grouped matmuls each) and the run trains like eager ZeRO-3 (which compiles
    # nothing) on the same transformers. One pair of runs (each DeepCompile run takes about a
    # minute on two cores); the failure without the patch is shown by
    # tests/test_compat_hf_moe_grouped_mm.py. A fresh inductor cache: AOTAutograd's cache key does
    # not cover a custom op's autograd formula.
    env = old_transformers_env({**CPU_ENV,
                                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    common = ("--model", "llama", "--family", "qwen3_moe", "--size", "tiny",
              "--checkpointing", "non-reentrant", "--eval-every", "2")
    runs = run_together({"ours": ((*common, "--count-ops"), 4),
                         "eager": ((*common, "--mode", "eager", "--eager-stage", "3",
                                    "--native", "deepspeed"), 4)}, env=env)
    ours, ref = ok(runs["ours"], steps=4), ok(runs["eager"], steps=4)
    assert "hf-grouped-mm-fallback-backward" in ours["install"]["patches"]
    assert not [u for u in ours["install"]["unverified"] if "hf-grouped-mm" in u], ours["install"]
    assert ours["op_calls_last_step"].get("ds_z3native::grouped_mm_fallback_backward") == 4, \
        ours["op_calls_last_step"]
    assert_same_training(ours, ref, rtol=1e-4, atol=1e-5, steps=4)
    torch.testing.assert_close(torch.tensor(ours["eval_losses"]), torch.tensor(ref["eval_losses"]),
                               rtol=1e-4, atol=1e-5)
    assert len(ours["eval_losses"]) == 2
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]
