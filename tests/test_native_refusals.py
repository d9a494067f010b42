"""Inputs the native runtime used to accept silently, leaving wrong data or a poisoned runtime
behind. Each is now an error naming the op, the id and the value, raised before any state
changes; afterwards valid calls give exact results.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from helpers.native_rt import live_runtime

PH = torch.empty(0)  # what DeepCompile passes for a released ZeRO-3 param


def _dc() -> Any:
    return torch.ops.dc


def _raises(match: str, fn: Callable[[], Any], exc: Any = RuntimeError) -> str:
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("shape", [[274177, 67280421310721], [2**32, 2**32], [2**62, 4, 0]])
def test_element_count_overflow_is_refused(shape) -> None:
    with live_runtime() as m:
        _raises(r"register_z3_param: ds_id 2: the element count of ds_shape .* overflows int64",
                lambda: m.register_z3_param(2, shape, torch.ones(1), None, False))
        _raises(r"register_param: ds_id 3: the element count of ds_shape .* overflows int64",
                lambda: m.register_param(3, shape, torch.ones(1), None, 0))
        for ds_id in (2, 3):
            _raises(rf"unknown ds_id {ds_id}", lambda: m.param_state(ds_id))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn, torch.bool])
def test_gather_in_an_unsupported_dtype_leaves_the_param_released(dtype) -> None:
    with live_runtime() as m:
        shard = torch.arange(6.0) + 0.25
        m.register_z3_param(1, [2, 3], shard, torch.zeros(6), False)
        m.register_z3_param(2, [6], shard * 2, torch.zeros(6), False)
        m.register_graph_z3(0, [1, 2])
        _raises(r"prefetch_params_fused: ds_id 1 cannot be gathered in",
                lambda: _dc().prefetch_params_fused(0, [PH, PH], [2, 1], [torch.float32, dtype]))
        _raises(r"allgather_param: ds_id 1 cannot be gathered in",
                lambda: _dc().allgather_param(PH, 0, 1, dtype=dtype))
        assert not m.param_state(1)["gathered"] and not m.param_state(2)["gathered"]
        assert m.comm_stats()["allgather_calls"] == 0
        assert torch.equal(_dc().allgather_param(PH, 0, 1), shard.view(2, 3))


def test_a_copy_gathered_in_one_dtype_is_not_returned_for_another() -> None:
    with live_runtime() as m:
        shard = torch.tensor([1.0 + 2**-10, 2.5, -3.75, 1e-3])  # not exact in bf16 or int
        m.register_z3_param(1, [4], shard, torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        _dc().prefetch_params_fused(0, [PH], [1], [torch.bfloat16])
        got = _dc().allgather_param(PH, 0, 1, dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, shard)
        assert torch.equal(_dc().allgather_param(PH, 0, 1, dtype=torch.bfloat16),
                           shard.to(torch.bfloat16))
        m.invalidate_gathered_param(1)
        _dc().prefetch_params_fused(0, [PH], [1], [torch.int32])
        assert torch.equal(_dc().allgather_param(PH, 0, 1), shard)
        # A copy in the shard's own dtype converts exactly: no second gather.
        m.register_z3_param(2, [4], shard, torch.zeros(4), True)
        m.register_graph_z3(1, [2])
        m.set_persistent(2)
        m.reset_comm_stats()
        assert torch.equal(_dc().allgather_param(PH, 1, 2, dtype=torch.bfloat16),
                           shard.to(torch.bfloat16))
        assert m.comm_stats()["allgather_calls"] == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_gradient_is_refused_and_the_others_land(dtype) -> None:
    with live_runtime() as m:
        buf1, buf2 = torch.zeros(4), torch.zeros(3)
        m.register_z3_param(1, [4], torch.ones(4), buf1, False)
        m.register_z3_param(2, [3], torch.ones(3), buf2, False)
        m.register_graph_z3(0, [1, 2])
        m.start_backward(True)
        g1, g2 = torch.randn(4), torch.randn(3)
        _dc().reduce_grad(g1, 0, 1)
        _raises(r"reduce_grad: gradient of ds_id 2 would be reduced in Float8",
                lambda: _dc().reduce_grad(torch.ones(3).to(dtype), 0, 2))
        _dc().reduce_grad(g2, 0, 2)
        _dc().end_backward([None], 0)
        assert torch.equal(buf1, g1) and torch.equal(buf2, g2)
        _raises(r"register_z3_param: expected_grad_dtype of ds_id 5 must be .* got Float8",
                lambda: m.register_z3_param(5, [4], torch.ones(4), torch.zeros(4), False, dtype))


def test_changes_that_would_drop_a_queued_gradient_are_refused() -> None:
    with live_runtime() as m:
        buf = torch.zeros(6)
        m.register_z3_param(1, [6], torch.ones(6), buf, False)
        m.register_graph_z3(0, [1])
        m.start_backward(True)
        g = torch.randn(6)
        _dc().reduce_grad(g, 0, 1)
        _raises(r"register_z3_param: ds_id 1 has a gradient queued .* 9 elements",
                lambda: m.register_z3_param(1, [9], torch.ones(9), torch.zeros(9), False))
        _raises(r"register_z3_param: ds_id 1 has a gradient queued .*frozen",
                lambda: m.register_z3_param(1, [6], torch.ones(6), None, False))
        _raises(r"set_param_frozen: ds_id 1 has a gradient queued .*frozen",
                lambda: m.set_param_frozen(1, True))
        _raises(r"update_param_grad_buffer: ds_id 1 has a gradient queued .*grad buffer of 0",
                lambda: m.update_param_grad_buffer(1, torch.empty(0), 0))
        assert not m.is_param_frozen(1) and m.param_state(1)["numel"] == 6
        _dc().end_backward([None], 0)
        assert torch.equal(buf, g)
        m.set_param_frozen(1, True)  # after the flush, nothing is queued
        assert m.is_param_frozen(1)


def test_release_and_wait_without_a_gather_are_refused() -> None:
    with live_runtime() as m:
        shard = torch.arange(4.0)
        m.register_z3_param(1, [4], shard, torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        _raises(r"release_param: ds_id 1 of graph 0 \(n_users 2\) is not gathered",
                lambda: _dc().release_param(shard, 0, 1, 2))
        _raises(r"wait_allgather: ds_id 1 of graph 0 is not gathered",
                lambda: _dc().wait_allgather(shard, 0, 1))
        # The refused release started no use count: a real gather with two users lives until
        # its second release.
        t = _dc().wait_allgather(_dc().allgather_param(PH, 0, 1), 0, 1)
        _dc().release_param(t, 0, 1, 2)
        assert m.param_state(1)["gathered"] and torch.equal(t, shard)
        _dc().release_param(t, 0, 1, 2)
        assert not m.param_state(1)["gathered"]


def test_meta_tensors_get_the_same_checks() -> None:
    meta = torch.empty(4, device="meta")
    with live_runtime() as m:
        m.register_z3_param(1, [4], torch.ones(4), torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        for op, fn in {"wait_allgather": lambda: _dc().wait_allgather(meta, 0, 777),
                       "release_param": lambda: _dc().release_param(meta, 0, 777, 1),
                       "reduce_grad": lambda: _dc().reduce_grad(meta, 0, 777),
                       "offload_parameter": lambda: _dc().offload_parameter(meta, 0, 777),
                       "reload_parameter": lambda: _dc().reload_parameter(meta, 0, 777)}.items():
            _raises(rf"{op} \(meta\): unknown ds_id 777", fn)
        _raises(r"reduce_grad \(meta\): gradient of ds_id 1 .* is a meta tensor",
                lambda: _dc().reduce_grad(meta, 0, 1))
        _raises(r"register_z3_param: grad buffer of ds_id 2 .*has no data",
                lambda: m.register_z3_param(2, [4], torch.ones(4), meta, False))
        _raises(r"register_z3_param: ds_tensor of ds_id 3 .*has no data",
                lambda: m.register_z3_param(3, [4], meta, torch.zeros(4), False))


@pytest.mark.parametrize("value", [None, 1.0, 0])
def test_bool_flags_take_only_bools(value) -> None:
    with live_runtime() as m:
        m.register_z3_param(1, [4], torch.ones(4), torch.zeros(4), False)
        for name, fn in {"start_backward": lambda: m.start_backward(value),
                         "enable_profiling": lambda: m.enable_profiling(value),
                         "set_param_frozen": lambda: m.set_param_frozen(1, value),
                         "register_z3_param": lambda: m.register_z3_param(
                             4, [4], torch.ones(4), torch.zeros(4), value)}.items():
            msg = _raises(rf"{name}\(\): incompatible function arguments", fn, TypeError)
            assert "Invoked with: " in msg and repr(value) in msg
        assert not m.is_profiling() and not m.is_param_frozen(1)
        _raises(r"unknown ds_id 4", lambda: m.param_state(4))


def test_zero1_wrong_size_gradient_refused_in_a_non_update_micro_step() -> None:
    with live_runtime() as m:
        buf = torch.zeros(4)
        m.register_param(1, [4], torch.ones(4), buf, 0)
        m.register_graph_z1(0, [1])
        m.start_backward(False)
        _raises(r"reduce_grad: gradient of ds_id 1 has 3 elements, the param has 4",
                lambda: _dc().reduce_grad(torch.ones(3), 0, 1))
        g1 = torch.tensor([1.0, 2.0, 3.0, 4.0])
        _dc().reduce_grad(g1, 0, 1)
        _dc().end_backward([None], 0)
        m.start_backward(True)
        g2 = torch.tensor([0.5, 0.5, 0.5, 0.5])
        _dc().reduce_grad(g2, 0, 1)
        _dc().end_backward([None], 0)
        assert torch.equal(buf, g1 + g2)



def test_end_backward_before_any_start_backward_is_refused_unless_profiling() -> None:
    # DeepSpeed calls start_backward from the engine's backward prologue before any backward
    # graph runs; only DeepCompile's profiler runs a backward graph's end_backward before the
    # first start_backward (a backward graph compiled ahead of time is profiled during the first
    # forward), with profiling on and so nothing queued.
    with live_runtime() as m:
        buf = torch.zeros(4)
        m.register_z3_param(1, [4], torch.ones(4), buf, False)
        m.register_graph_z3(0, [1])
        m.enable_profiling(True)
        _dc().end_backward([torch.empty(0)], 0, True)
        m.enable_profiling(False)
        g = torch.randn(4)
        _dc().reduce_grad(g, 0, 1)
        for profiling in (False, True):
            m.enable_profiling(profiling)
            _raises(rf"^ds_z3native end_backward: graph_id 0: no backward has begun on this "
                    rf"runtime \(start_backward was not called since init; profiling "
                    rf"{'on' if profiling else 'off'}, 1 gradients queued\)",
                    lambda: _dc().end_backward([None], 0))
            # Refused before any state changed: the gradient is still queued, nothing landed.
            assert m.runtime_info()["pending_gradients"] == 1 and not buf.any()
        m.enable_profiling(False)
        _raises(r"end_backward: .*graph_id 5", lambda: _dc().end_backward([None], 5))
        m.start_backward(True)
        _dc().end_backward([None], 0)
        assert torch.equal(buf, g) and m.runtime_info()["pending_gradients"] == 0
        # reset() drops the graphs, not the backward that has begun.
        m.reset()
        m.register_graph_z3(1, [1])
        _dc().end_backward([None], 1)
    with live_runtime() as m:  # a new init starts without a backward again
        m.register_z3_param(1, [4], torch.ones(4), torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        _raises(r"end_backward: graph_id 0: no backward has begun .*profiling off, 0 gradients",
                lambda: _dc().end_backward(None, 0, False))


def test_end_backward_with_meta_deps_outside_a_trace_is_refused() -> None:
    meta = torch.empty(0, device="meta")
    with live_runtime() as m:
        buf = torch.zeros(4)
        m.register_z3_param(1, [4], torch.ones(4), buf, False)
        m.register_graph_z3(0, [1])
        m.start_backward(True)
        g = torch.randn(4)
        _dc().reduce_grad(g, 0, 1)
        for deps, where in (([torch.empty(0), meta], r"deps\[1\]"), (meta, "deps"),
                            ([None, (torch.empty(0), torch.empty(2, 3, device="meta"))],
                             r"deps\[1\]\[1\]")):
            shape = r"\[2, 3\]" if "\\]\\[1" in where else r"\[0\]"
            _raises(rf"^ds_z3native end_backward: graph_id 0: {where} is a meta tensor "
                    rf"\(shape {shape}\) outside a fake-tensor trace",
                    lambda: _dc().end_backward(deps, 0))
            assert m.runtime_info()["pending_gradients"] == 1 and not buf.any()
        _dc().end_backward([torch.empty(0)], 0)
        assert torch.equal(buf, g)


def test_end_backward_inside_a_fake_tensor_trace_leaves_the_runtime_alone() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with live_runtime() as m:
        buf = torch.zeros(4)
        m.register_z3_param(1, [4], torch.ones(4), buf, False)
        m.register_graph_z3(0, [1])
        m.start_backward(True)
        g = torch.randn(4)
        _dc().reduce_grad(g, 0, 1)
        mode = FakeTensorMode()
        for real in (torch.empty(0), torch.empty(0, device="meta")):
            fake = mode.from_tensor(real)
            with mode:
                _dc().end_backward([fake, None], 0)
            assert m.runtime_info()["pending_gradients"] == 1 and not buf.any()
        _dc().end_backward([None], 0)
        assert torch.equal(buf, g)


_NONE_TENSOR_CALLS = {
    "allgather_param": lambda: _dc().allgather_param(None, 0, 1),
    "wait_allgather": lambda: _dc().wait_allgather(None, 0, 1),
    "release_param": lambda: _dc().release_param(None, 0, 1, 2),
    "reduce_grad": lambda: _dc().reduce_grad(None, 0, 1),
    "offload_tensor": lambda: _dc().offload_tensor(None, 0, 7),
    "reload_tensor": lambda: _dc().reload_tensor(None, 0, 7),
    "wait_offload": lambda: _dc().wait_offload(None, 0, 7),
    "wait_reload": lambda: _dc().wait_reload(None, 0, 7),
    "offload_parameter": lambda: _dc().offload_parameter(None, 0, 1),
    "reload_parameter": lambda: _dc().reload_parameter(None, 0, 1),
    "test_call": lambda: _dc().test_call(None),
}


@pytest.mark.parametrize("op", sorted(_NONE_TENSOR_CALLS))
def test_a_none_tensor_argument_is_named(op) -> None:
    with live_runtime() as m:
        m.register_z3_param(1, [4], torch.ones(4), torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        _raises(rf"^ds_z3native {op}: argument 'a' is None \(an undefined tensor\), where a "
                "tensor is required$", _NONE_TENSOR_CALLS[op])
        assert not m.param_state(1)["gathered"] and m.comm_stats()["allgather_calls"] == 0
        assert torch.equal(_dc().allgather_param(PH, 0, 1), torch.ones(4))
        # Other missing kernels keep torch's NotImplementedError type, naming op and key.
        if op == "test_call":
            with pytest.raises(NotImplementedError, match=r"^ds_z3native test_call: no kernel "
                               r"for dispatch key \w+"):
                _dc().test_call(torch.ones(2, dtype=torch.float32).to_sparse())


def test_tensor_list_arguments_without_tensors() -> None:
    with live_runtime() as m:
        m.register_z3_param(1, [4], torch.ones(4), torch.zeros(4), False)
        m.register_graph_z3(0, [1])
        # None inside or for a Tensor[]: torch's own argument parsing names op and argument.
        _raises(r"prefetch_params_fused\(\) Expected a value of type 'List\[Tensor\]' for "
                r"argument 'params'", lambda: _dc().prefetch_params_fused(0, [None], [1]))
        _raises(r"free_tensors\(\) Expected a value of type 'List\[Tensor\]' for argument 'a'",
                lambda: _dc().free_tensors([None]))
        _raises(r"free_tensors\(\) Expected a value of type 'List\[Tensor\]' for argument 'a'",
                lambda: _dc().free_tensors(None))
        # Empty lists leave the dispatcher no tensor to choose a kernel by (DeepSpeed's op
        # refuses them too; DeepCompile never emits one).
        _raises(r"^ds_z3native prefetch_params_fused: argument 'params' is an empty list",
                lambda: _dc().prefetch_params_fused(0, [], []))
        _raises(r"^ds_z3native free_tensors: argument 'a' is an empty list",
                lambda: _dc().free_tensors([]))
        assert m.comm_stats()["allgather_calls"] == 0
