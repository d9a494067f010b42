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


# A real ZeRO-3 engine (one gloo rank, DeepSpeed on CPU): what the eager-fallback gather does
# with DeepSpeed's own partitioned params, under Dynamo's frame hook and against others'
# partition calls.

def _eager_gather_on_a_zero3_engine(rank: int, world_size: int) -> dict:
    import sys

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from ds_z3native.compat.deepcompile_eager import EagerFallbackGather

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={"train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    frozen, other = engine.module[0], engine.module[1]
    with deepspeed.zero.GatheredParameters([frozen.weight]):
        full = frozen.weight.detach().clone()
    out: dict = {"status_before": str(frozen.weight.ds_status)}
    gather = EagerFallbackGather(engine)
    other_w = other.weight  # read before the window opens: not gathered, not held
    original_partition = frozen.weight.__dict__["partition"]  # DeepSpeed's
    gather.active = True  # inside the engine's forward, as engine.forward's wrapper marks it

    # 1. Eager code run under Dynamo's frame hook (a frame Dynamo gave up on: a graph break
    # inside a context manager) reads the frozen weight. Any frame of the read that Dynamo
    # compiles hands the param to the backend as a graph input: DeepCompile's backend profiles
    # such a graph and partitions the param afterwards.
    compiled_frames: list = []

    def recording_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        frame = sys._getframe()
        while frame is not None:
            code = frame.f_locals.get("code") if frame.f_code.co_name == "_compile" else None
            if code is not None:
                compiled_frames.append(f"{code.co_filename}:{code.co_name}")
                break
            frame = frame.f_back
        return gm.forward

    class Ctx:
        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return False

    def eager_read(x: torch.Tensor) -> torch.Tensor:
        with Ctx():
            torch._dynamo.graph_break()
            return x @ frozen.weight.t()

    torch._dynamo.reset()
    x = torch.randn(2, 8)
    with torch.no_grad():
        y = torch.compile(eager_read, backend=recording_backend)(x)
    out["compiled_frames"] = compiled_frames
    out["eager_result_error"] = float((y - x @ full.t()).abs().max())
    out["held_after_read"] = gather.held()

    # 2. Someone else partitions the held param, the way DeepCompile's graph profiler does
    # after profiling a graph that uses it; a list naming another param partitions that one.
    w = frozen.weight
    other_w.all_gather()
    w.partition(param_list=[w], has_been_updated=False)
    w.partition(param_list=[w, other_w], has_been_updated=False)
    out["held_status"] = str(w.ds_status)
    out["held_shape"] = list(w.shape)
    out["other_status"] = str(other_w.ds_status)
    out["deferred"] = gather.deferred_partitions
    gather.active = False
    gather.release()
    out["released_status"] = str(w.ds_status)
    out["partition_restored"] = w.__dict__["partition"] is original_partition
    w.partition(param_list=[w])  # nothing held: partitions as DeepSpeed's own (already partitioned)
    out["deferred_after_release"] = gather.deferred_partitions
    out["available"] = str(ZeroParamStatus.AVAILABLE)
    out["not_available"] = str(ZeroParamStatus.NOT_AVAILABLE)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def zero3_gather() -> dict:
    from helpers.dist import run_ranks

    return run_ranks(_eager_gather_on_a_zero3_engine, 1)[0]


def test_eager_read_under_dynamos_frame_hook_is_never_compiled(zero3_gather: dict) -> None:
    r = zero3_gather
    assert r["status_before"] == r["not_available"]
    # Without _never_compiled: Dynamo compiles the gather's frames (torch 2.13: DeepSpeed's
    # getter returning the gathered param, a graph whose input is the param; torch 2.11 on the
    # On an H200: EagerFallbackGather.gather around all_gather, the param partitioned by
    # DeepCompile's profiler before the embedding read it).
    assert r["compiled_frames"] == []
    assert r["eager_result_error"] == 0.0
    assert r["held_after_read"] == [0]


def test_a_held_param_stays_gathered_when_others_partition_it(zero3_gather: dict) -> None:
    r = zero3_gather
    assert (r["held_status"], r["held_shape"]) == (r["available"], [8, 8])
    assert r["deferred"] == 2
    assert r["other_status"] == r["not_available"]  # the other param of the list was partitioned
    assert r["released_status"] == r["not_available"]
    assert r["partition_restored"]
    assert r["deferred_after_release"] == 2
