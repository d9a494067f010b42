"""A real client on CPU: a small randomly initialised ``LlamaForCausalLM`` with PEFT LoRA on every
linear layer and transformers' non-reentrant gradient checkpointing, trained for 3 steps under
eager ZeRO-3 on 2 gloo ranks. Its decoder layers are checkpointed with frozen norms and frozen
base weights, and the first layer's input (the frozen embedding's output) needs no grad.

Without ds_z3native, DeepSpeed < 0.19.3 fails with CheckpointError; with ``install()`` both
DeepSpeed versions train it exactly like plain PyTorch (no ZeRO, no checkpointing).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
from packaging.version import Version

from helpers.dist import run_ranks
from helpers.zero import assert_unpatched_outcome, train_and_collect

pytestmark = pytest.mark.deepspeed

deepspeed = pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("peft")

DS_VERSION = Version(deepspeed.__version__.split("+")[0])
UPSTREAM_FIX = DS_VERSION >= Version("0.19.3")

STEPS = 3
ROWS, SEQ, VOCAB = 2, 16, 128
LR = 1e-3
ADAM = {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0}


def _peft_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(11)
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                      init_lora_weights="gaussian")  # B != 0: every LoRA factor learns at once
    model = get_peft_model(model, lora)
    model.train()
    return model


def _batches(world_size: int) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(world_size)]
            for _ in range(STEPS)]


def _reference(model: torch.nn.Module, rank: int, world_size: int) -> Dict[str, Any]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, **ADAM)
    losses = []
    for step_batches in _batches(world_size):
        opt.zero_grad()
        for r, ids in enumerate(step_batches):
            loss = model(input_ids=ids, labels=ids).loss
            (loss / world_size).backward()
            if r == rank:
                losses.append(loss.item())
        opt.step()
    return {"losses": losses, "params": {n: p.detach().clone()
                                         for n, p in model.named_parameters() if p.requires_grad}}


def _gathered_after_backward(model: torch.nn.Module) -> List[str]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [name for name, p in model.named_parameters()
            if p.ds_active_sub_modules or (not p.ds_persist and p.ds_status
                                           != ZeroParamStatus.NOT_AVAILABLE)]


def _train(rank: int, world_size: int) -> Dict[str, Any]:
    model = _peft_llama()
    reference = _reference(copy.deepcopy(model), rank, world_size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, **ADAM, "torch_adam": True}},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    out: Dict[str, Any] = {"losses": [], "left_gathered": [], "frozen": 0}
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out["frozen"] = sum(1 for p in model.parameters()
                        if not p.requires_grad and p.ds_status == ZeroParamStatus.NOT_AVAILABLE)

    def train() -> None:
        for step_batches in _batches(world_size):
            ids = step_batches[rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            out["left_gathered"] += _gathered_after_backward(model)
            engine.step()
            out["losses"].append(loss.item())

    return train_and_collect(engine, model, reference, out, train)


def train_llama(rank: int, world_size: int) -> Dict[str, Any]:
    """DeepSpeed alone, then with ``ds_z3native.install()``; one engine each."""
    import deepspeed.ops

    import ds_z3native

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo; no JIT build
    results = {"unpatched": _train(rank, world_size)}
    results["patches"] = list(ds_z3native.install().patches)
    results["installed"] = _train(rank, world_size)
    ds_z3native.uninstall()
    return results


@pytest.mark.slow
def test_peft_llama_nonreentrant_checkpointing_two_ranks() -> None:
    results = run_ranks(train_llama, 2, timeout=300.0)
    for rank, per_rank in enumerate(results):
        unpatched, got = per_rank["unpatched"], per_rank["installed"]
        assert_unpatched_outcome(unpatched, UPSTREAM_FIX)
        assert "error" not in got, got["error"]
        assert got["frozen"] > 0  # frozen params are partitioned: the case the fix is about
        assert got["left_gathered"] == [], got["left_gathered"]
        ref = got["reference"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} losses: {m}")
        assert got["params"].keys() == ref["params"].keys() and len(got["params"]) > 0
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
