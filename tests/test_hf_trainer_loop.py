"""The Trainer-loop patches (``ds_z3native.compat.hf_trainer_loop``) on a real ZeRO-3 engine (one
gloo rank, DeepSpeed on CPU): ``engine.train()`` with nothing to change walks no module, every
change still lands (a module left in eval, a module added since, a module with its own
``train``), ``engine.zero_grad()`` clears every grad (a param added since too), the ZeRO-3 FLOP
count sees partitioned params at full size, and ``uninstall()`` leaves no hook behind.
The HF Trainer's own ``total_flos`` at ZeRO-3 against ZeRO-0: tests/test_trainers.py."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from helpers.dist import run_ranks

pytestmark = pytest.mark.deepspeed


def _walks_on_a_zero3_engine(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.nn.modules import module as torch_module

    import ds_z3native
    from ds_z3native.compat.hf_trainer_loop import zero3_flops_param_count

    def hooks() -> tuple:
        return (len(torch_module._global_parameter_registration_hooks),
                len(torch_module._global_module_registration_hooks))

    out: Dict[str, Any] = {"hooks_before": hooks(), "train_before": DeepSpeedEngine.train}
    ds_z3native.install()
    out["hooks_installed"] = hooks()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Dropout(0.1), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    # transformers' count: every param but the embedding's weight, at full size.
    out["count_plain"] = sum(p.numel() for n, p in model.named_parameters() if n != "0.weight")
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={"train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    out["numel_partitioned"] = sum(p.numel() for p in engine.module.parameters())
    out["count_zero3"] = zero3_flops_param_count(engine.module)
    out["count_not_zero3"] = zero3_flops_param_count(torch.nn.Linear(2, 2))

    # Every module's train() call, by class name.
    calls: list = []
    plain_train = torch.nn.Module.train

    def counted(self: Any, mode: bool = True) -> Any:
        calls.append(type(self).__name__)
        return plain_train(self, mode)

    torch.nn.Module.train = counted  # type: ignore[method-assign]
    try:
        engine.train()
        engine.train()
        out["calls_unchanged"] = len(calls)
        engine.module[2].eval()
        calls.clear()
        engine.train()
        out["dropout_back_in_train"] = engine.module[2].training
        out["calls_after_eval_of_one"] = len(calls)
        engine.eval()
        out["all_eval"] = not any(m.training for m in engine.module.modules())
        engine.train()
        out["all_train"] = all(m.training for m in engine.module.modules())

        engine.module.add_module("added", torch.nn.Linear(2, 2).eval())
        engine.train()
        out["added_in_train"] = engine.module.added.training

        class OwnTrain(torch.nn.Module):
            seen: list = []

            def train(self, mode: bool = True) -> Any:
                OwnTrain.seen.append(mode)
                return super().train(mode)

        engine.module.add_module("own", OwnTrain())
        engine.train()
        engine.train()
        out["own_train_calls"] = list(OwnTrain.seen)
    finally:
        torch.nn.Module.train = plain_train  # type: ignore[method-assign]

    for p in engine.module.parameters():
        p.grad = torch.zeros_like(p)
    engine.zero_grad()
    out["grads_left"] = sum(p.grad is not None for p in engine.module.parameters())
    engine.module.add_module("later", torch.nn.Linear(2, 2))
    engine.module.later.weight.grad = torch.ones(2, 2)
    engine.zero_grad()
    out["later_grad_cleared"] = engine.module.later.weight.grad is None

    # transformers slices its layer list in every forward (a new ModuleList registering the
    # layers): neither that in eager code nor in code Dynamo compiles drops what is kept, and
    # a compiled forward does not recompile when a kept tree changes between calls.
    from ds_z3native.compat.hf_trainer_loop import LISTS

    class Slicing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))

        def forward(self, x: Any) -> Any:
            for layer in self.layers[:2]:
                x = layer(x)
            return x

    compiles: list = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        compiles.append(gm)
        return gm.forward

    slicing = Slicing()
    generation = LISTS.generation
    slicing(torch.ones(1, 2))
    out["generation_kept_eager"] = LISTS.generation == generation
    compiled = torch.compile(slicing, backend=counting)
    compiled(torch.ones(1, 2))
    out["generation_kept_compiled"] = LISTS.generation == generation
    engine.module.add_module("after_compile", torch.nn.Linear(2, 2))
    engine.train()
    out["generation_moved"] = LISTS.generation != generation
    compiled(torch.ones(1, 2))
    out["compiles"] = len(compiles)

    ds_z3native.uninstall()
    out["hooks_after"] = hooks()
    out["train_restored"] = DeepSpeedEngine.train is out.pop("train_before")
    return out


@pytest.fixture(scope="module")
def walks() -> Dict[str, Any]:
    return run_ranks(_walks_on_a_zero3_engine, 1, timeout=300)[0]


def test_train_with_nothing_to_change_calls_no_module_train(walks: Dict[str, Any]) -> None:
    assert walks["calls_unchanged"] == 0


def test_train_still_makes_every_change(walks: Dict[str, Any]) -> None:
    assert walks["dropout_back_in_train"] and walks["calls_after_eval_of_one"] >= 5
    assert walks["all_eval"] and walks["all_train"]
    assert walks["added_in_train"]  # a module registered since the last call


def test_a_module_with_its_own_train_gets_every_call(walks: Dict[str, Any]) -> None:
    assert walks["own_train_calls"] == [True, True]


def test_zero_grad_clears_every_grad_also_of_params_added_since(walks: Dict[str, Any]) -> None:
    assert walks["grads_left"] == 0
    assert walks["later_grad_cleared"]


def test_flops_count_sees_partitioned_params_at_full_size(walks: Dict[str, Any]) -> None:
    assert walks["numel_partitioned"] == 0  # what transformers' own count adds up under ZeRO-3
    assert walks["count_zero3"] == walks["count_plain"] == 8 * 8 + 8 + 8 * 4 + 4
    assert walks["count_not_zero3"] is None  # transformers' own count serves plain models


def test_registrations_outside_the_tree_and_compiled_code_keep_the_lists(
        walks: Dict[str, Any]) -> None:
    assert walks["generation_kept_eager"] and walks["generation_kept_compiled"]
    assert walks["generation_moved"]  # a module added to the engine's tree
    assert walks["compiles"] == 1  # no recompile on the hook's state (one per step otherwise)


def test_uninstall_removes_the_registration_hooks(walks: Dict[str, Any]) -> None:
    before, installed, after = walks["hooks_before"], walks["hooks_installed"], walks["hooks_after"]
    assert installed == (before[0] + 1, before[1] + 1)
    assert after == before
    assert walks["train_restored"]
