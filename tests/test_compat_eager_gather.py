"""The eager-gather parameter dicts of ``ds_z3native.compat.deepcompile_eager`` on a plain module
(no DeepCompile run: the training behaviour is tests/test_deepcompile_cpu.py)."""

from __future__ import annotations

import copy
import io
import types

import pytest
import torch

pytestmark = pytest.mark.deepspeed


def _engine_with_zero_like_params() -> types.SimpleNamespace:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
        p.ds_status = ZeroParamStatus.AVAILABLE
    return types.SimpleNamespace(module=model)


def test_modules_with_zero_params_get_the_dict_and_get_it_back() -> None:
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    from ds_z3native.compat.deepcompile_eager import EagerFallbackGather, _eager_params_class

    engine = _engine_with_zero_like_params()
    before = {n: type(m._parameters) for n, m in engine.module.named_modules()}
    gather = EagerFallbackGather(engine)
    cls = _eager_params_class()
    assert isinstance(engine.module[0]._parameters, cls)
    assert isinstance(engine.module[0]._parameters, ZeROOrderedDict)  # DeepSpeed keeps it
    assert not isinstance(engine.module[1]._parameters, cls)  # ReLU has no params
    # Reading outside the engine's forward/backward changes nothing.
    w = engine.module[0].weight
    assert w.ds_id == 0 and gather.held() == [] and gather.gathered_total == 0
    gather.remove()
    assert {n: type(m._parameters) for n, m in engine.module.named_modules()} == before
    assert engine.module[0].weight is w


def test_a_compiled_module_can_still_be_copied_and_saved() -> None:
    from ds_z3native.compat.deepcompile_eager import EagerFallbackGather, _eager_params_class

    engine = _engine_with_zero_like_params()
    EagerFallbackGather(engine)
    clone = copy.deepcopy(engine.module)
    assert not isinstance(clone[0]._parameters, _eager_params_class())
    torch.testing.assert_close(clone[0].weight, engine.module[0].weight)
    buf = io.BytesIO()
    torch.save(engine.module, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded[2].bias, engine.module[2].bias)
