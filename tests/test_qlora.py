"""QLoRA on the CPU: what needs no bitsandbytes kernels.

* DeepCompile refuses a param that is not floating point at ``engine.compile()``, naming it and
  what to change, before registering anything. QLoRA's 4-bit bitsandbytes weights are such
  params where they are stored packed in uint8 (``bnb_4bit_quant_storage``'s default).
  DeepCompile's ZeRO-3 registers every param with the native layer as a floating-point shard,
  which refuses the first uint8 one by its ds_id alone, after registering the params before it.
  A frozen uint8 param carrying a ``quant_state`` stands for a packed 4-bit weight here
  (bitsandbytes' ``Params4bit`` keeps its quantization state there, whose ``dtype`` is the
  compute dtype).
* docs/usage.md's QLoRA section shows the commands tests/gpu/test_qlora_gpu.py runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict

import pytest
import torch

from helpers.dist import run_ranks
from helpers.example_runs import shown_command, shown_commands
from helpers.qlora_runs import SHOWN

WORLD = 2


class _Packed(torch.nn.Module):
    """A frozen uint8 weight shaped like a packed 4-bit one, with a ``quant_state``."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(15, 1, dtype=torch.uint8), requires_grad=False)
        self.weight.quant_state = SimpleNamespace(dtype=dtype)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), _Packed(), torch.nn.Linear(5, 3))


def test_refusal_names_the_params_and_the_quant_storage_to_set() -> None:
    from ds_z3native.compat.deepcompile_frozen import NonFloatParam, refuse_non_float_params

    model = _model()
    model.append(_Packed(torch.float16))
    with pytest.raises(NonFloatParam) as refused:
        refuse_non_float_params(SimpleNamespace(module=model))
    message = str(refused.value)
    assert "2 param(s) are not floating point" in message, message
    assert "1.weight (ds_id ?, Parameter of dtype torch.uint8)" in message, message
    assert "3.weight" in message, message
    # The first one's compute dtype, read from its quantization state.
    assert "bnb_4bit_quant_storage=torch.bfloat16" in message, message
    refuse_non_float_params(SimpleNamespace(module=_model()[::2]))  # all float: nothing raised


def _compile_scenario(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import deepspeed.ops
    import ds_z3native
    from ds_z3native.compat.deepcompile_frozen import NonFloatParam

    # gloo's collectives: DeepSpeed's shared-memory comm op would be JIT-built at initialize.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_z3native.install()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "compile": {"deepcompile": True}}
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    out: Dict[str, Any] = {"ds_ids": {n: p.ds_id for n, p in engine.module.named_parameters()}}
    try:
        # What engine.compile() calls for ZeRO-3 with "deepcompile": true; it runs init_z3.
        engine.get_deepcompile_backend("inductor", {}, None)
        out["error"] = None
    except NonFloatParam as e:
        out["error"], out["type"] = str(e), "NonFloatParam"
    except RuntimeError as e:
        out["error"], out["type"] = str(e), type(e).__name__
    # Whether the trainable param before the uint8 one was registered.
    try:
        ds_z3native.native().param_state(engine.module[0].weight.ds_id)
        out["first_registered"] = True
    except RuntimeError:
        out["first_registered"] = False
    ds_z3native.uninstall()
    return out


@pytest.mark.deepspeed
@pytest.mark.slow
def test_engine_compile_refuses_a_uint8_param_before_registering_any() -> None:
    for r in run_ranks(_compile_scenario, WORLD, timeout=600):
        assert r["type"] == "NonFloatParam", r
        ds_id = r["ds_ids"]["1.weight"]
        assert f"1.weight (ds_id {ds_id}, Parameter of dtype torch.uint8)" in r["error"], r
        assert "engine.compile() with DeepCompile" in r["error"], r
        assert "bnb_4bit_quant_storage=torch.bfloat16" in r["error"], r
        assert not r["first_registered"], r


def test_usage_doc_shows_the_qlora_commands_the_gpu_test_runs() -> None:
    assert shown_commands(qlora=True) == [shown_command(args) for args in SHOWN.values()]
