"""``torch.library.opcheck`` on every dc op of the op list (``ds_z3native/dc_ops.def``, from which
the extension registers each op and its Meta kernel), with real samples on a live one-rank gloo
runtime (params and a graph registered, gathers and gradients in flight); and on every op of
ds_z3native's own namespace (``ds_z3native::``) registered once the package and its patch
modules are imported: those defined in Python here, the native ones in the test file named in
:data:`NATIVE_OPS_ELSEWHERE`.

The ops are stateful (a gather marks a param gathered, a gradient is queued in a bucket), and
opcheck's sub-tests each run the op one or more times; so every sample is rebuilt on a fresh
runtime for every sub-test. Where a sub-test cannot apply to one of DeepSpeed's schemas the
sample says which and why, and the behaviour is asserted directly instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.utils._pytree as pytree

import ds_z3native
from ds_z3native.dc_ops import DC_OPS
from helpers.native_rt import OPCHECK_UTILS, compile_config, live_runtime, opcheck_on_fresh_runtimes

UTILS = OPCHECK_UTILS
GRAPH = 0
THRESHOLD = 10  # free_activation_threshold of the runtime the samples run on

# opcheck's schema test turns every argument into a keyword, which cannot express DeepSpeed's
# schemas "(Tensor a, int id, int id)" (two arguments named id). Those samples go through
# positional_schema_check instead, which checks the same things.
DUPLICATE_ARG_NAMES = {"test_schema": "DeepSpeed's schema names two arguments 'id' (checked "
                                      "positionally instead)"}
# wait_allgather/release_param are DeepSpeed's "Tensor(a) a -> Tensor(a)" ops and return their
# input itself, as DeepSpeed's kernels do. SchemaCheckMode allows returning an input object only
# for mutating ops, and AOT autograd cannot functionalize a custom op with an aliased output;
# DeepCompile inserts these ops into graphs that are already functionalized, so neither applies.
# The alias is asserted by the sample's check instead.
ALIASING = {"test_schema": "returns its input object (DeepSpeed's kernel does the same)",
            "test_aot_dispatch_dynamic": "custom aliasing ops cannot be functionalized"}


def placeholder() -> torch.Tensor:
    """What DeepCompile passes for a ZeRO-3 param: its released (empty) data."""
    return torch.empty(0)


@dataclass
class Sample:
    name: str
    # Builds the arguments on a prepared runtime (may run other ops first).
    args: Callable[[Any], Tuple[Any, ...]]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    skip: Dict[str, str] = field(default_factory=dict)  # sub-test -> why it cannot apply
    # Called after one plain call of the op: (module, args, output).
    check: Optional[Callable[[Any, Tuple[Any, ...], Any], None]] = None


SHAPES = {1: (3, 5), 2: (7,), 3: (2, 2)}
LAYOUTS = ("contiguous", "transposed", "offset")


def param_values() -> Dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {ds_id: torch.randn(torch.Size(shape).numel(), generator=g)
            for ds_id, shape in SHAPES.items()}


def prepare(m) -> None:
    """Registers three params (1 trainable, 2 frozen, 3 trainable persistent) and graph 0, and
    begins a backward (DeepSpeed's backward prologue calls start_backward before any backward
    graph runs; end_backward refuses to run before the first one)."""
    shards = param_values()
    m.register_z3_param(1, list(SHAPES[1]), shards[1], torch.zeros(15), False)
    m.register_z3_param(2, list(SHAPES[2]), shards[2], torch.Tensor(), False)
    m.register_z3_param(3, list(SHAPES[3]), shards[3], torch.zeros(4), True, torch.float32)
    m.register_graph_z3(GRAPH, [1, 2, 3])
    m.start_backward(True)


def gathered(ds_id: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.ops.dc.allgather_param(placeholder(), GRAPH, ds_id, dtype)


def activation(layout: str = "contiguous") -> torch.Tensor:
    """A saved activation: contiguous, a transposed view (dense, not contiguous) or a view at a
    storage offset (SDPA outputs and permuted clones are saved like the second)."""
    base = torch.arange(32.0)
    if layout == "transposed":
        return base[:16].reshape(4, 4).t()
    if layout == "offset":
        return base[5:21].reshape(4, 4)
    return base[:16].reshape(4, 4)


def offloaded(value_id: int, layout: str = "contiguous") -> torch.Tensor:
    """What DeepCompile's graph hands wait_offload: offload_tensor's output."""
    waited = torch.ops.dc.offload_tensor(activation(layout), GRAPH, value_id)
    return waited


def saved(value_id: int, layout: str = "contiguous") -> torch.Tensor:
    """What the forward saves for the backward: wait_offload's output."""
    return torch.ops.dc.wait_offload(offloaded(value_id, layout), GRAPH, value_id)


def reloaded(value_id: int, layout: str = "contiguous") -> torch.Tensor:
    """What DeepCompile's backward hands wait_reload: reload_tensor's output."""
    return torch.ops.dc.reload_tensor(saved(value_id, layout), GRAPH, value_id)


def queued_gradient() -> torch.Tensor:
    ds_z3native.native().start_backward(True)
    return torch.ops.dc.reduce_grad(torch.ones(3, 5), GRAPH, 1)


def _check_gathered(m, args, out) -> None:
    ds_id = args[2]
    dtype = args[3] if len(args) > 3 else torch.float32
    assert out.dtype == dtype and out.shape == SHAPES[ds_id]
    torch.testing.assert_close(out.reshape(-1), param_values()[ds_id].to(dtype))


def _check_alias(m, args, out) -> None:
    assert out is args[0]


def _check_released(m, args, out) -> None:
    assert out is args[0]
    assert out.untyped_storage().nbytes() == 0  # freed under every view the graph holds
    assert not m.param_state(1)["gathered"]


def _check_released_shard(m, args, out) -> None:
    # On one rank the gathered param in the shard's dtype is the shard: its release forgets it
    # and leaves the shard's values where they are.
    assert out is args[0]
    assert not m.param_state(1)["gathered"]
    torch.testing.assert_close(out.reshape(-1), param_values()[1], rtol=0, atol=0)


def _check_prefetched(m, args, out) -> None:
    for ds_id in args[2]:
        assert m.param_state(ds_id)["gathered"] and m.param_state(ds_id)["valid"]
    assert m.comm_stats()["allgather_calls"] == len(args[2])


def _check_reduced(m, args, out) -> None:
    assert out.numel() == 0
    torch.ops.dc.end_backward([out], GRAPH)
    # Only check the op ran: the values are the gloo tests' business.
    assert m.comm_stats()["reduce_scatter_calls"] == 1


def _check_freed(m, args, out) -> None:
    for t, n in zip(args[0], (11, 4)):
        assert t.numel() == (0 if n > THRESHOLD else n)


def _check_not_freed(m, args, out) -> None:
    assert [t.numel() for t in args[0]] == [5, THRESHOLD]


def _check_stand_in(m, args, out) -> None:
    # The activation's shape on its device, one element broadcast: the values stay with the
    # runtime, and no memory is shared with the input.
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert out.stride() == (0,) * out.dim() and not torch._C._overlaps(out, args[0])
    assert not out.any()


def _check_offload_round_trip(layout: str) -> Callable[[Any, Tuple[Any, ...], Any], None]:
    def check(m, args, out) -> None:
        _check_stand_in(m, args, out)
        value_id = args[2]
        back = torch.ops.dc.wait_offload(out, GRAPH, value_id)
        back = torch.ops.dc.reload_tensor(back, GRAPH, value_id)
        back = torch.ops.dc.wait_reload(back, GRAPH, value_id)
        assert torch.equal(back, activation(layout)) and back.is_contiguous()
    return check


def _check_reloaded(layout: str) -> Callable[[Any, Tuple[Any, ...], Any], None]:
    def check(m, args, out) -> None:
        assert torch.equal(out, activation(layout)) and out.is_contiguous()
        assert not torch._C._overlaps(out, args[0])
    return check


def _check_params_intact(m, args, out) -> None:
    torch.testing.assert_close(gathered(1).reshape(-1), param_values()[1])


def _check_end_backward(m, args, out) -> None:
    assert m.runtime_info()["pending_gradients"] == 0


def _check_test_call(m, args, out) -> None:
    assert torch.equal(out, args[0]) and out.data_ptr() != args[0].data_ptr()


SAMPLES: Dict[str, List[Sample]] = {
    "allgather_param": [
        Sample("trainable", lambda m: (placeholder(), GRAPH, 1), check=_check_gathered),
        Sample("frozen_bf16", lambda m: (placeholder(), GRAPH, 2, torch.bfloat16),
               check=_check_gathered),
        Sample("persistent_kw_dtype", lambda m: (placeholder(), GRAPH, 3),
               kwargs={"dtype": torch.float16}),
    ],
    "prefetch_params_fused": [
        Sample("plain", lambda m: (GRAPH, [placeholder(), placeholder()], [1, 2]),
               check=_check_prefetched),
        Sample("dtypes", lambda m: (GRAPH, [placeholder()] * 3, [1, 2, 3],
                                    [torch.bfloat16, torch.float32, torch.float16]),
               check=_check_prefetched),
    ],
    "wait_allgather": [
        Sample("gathered", lambda m: (gathered(1), GRAPH, 1), skip=ALIASING, check=_check_alias),
    ],
    "release_param": [
        Sample("more_users", lambda m: (gathered(1), GRAPH, 1, 1000), skip=ALIASING,
               check=_check_alias),
        Sample("last_user", lambda m: (gathered(1, torch.float64), GRAPH, 1, 1),
               skip=ALIASING, check=_check_released),
        Sample("last_user_shard", lambda m: (gathered(1), GRAPH, 1, 1), skip=ALIASING,
               check=_check_released_shard),
    ],
    "reduce_grad": [
        Sample("fp32", lambda m: (torch.randn(3, 5), GRAPH, 1), check=_check_reduced),
        Sample("bf16_grad", lambda m: (torch.randn(3, 5, dtype=torch.bfloat16), GRAPH, 1),
               check=_check_reduced),
    ],
    "free_tensors": [
        Sample("below_threshold", lambda m: ([torch.randn(5), torch.randn(THRESHOLD)],),
               check=_check_not_freed),
        # Freeing in place is the op's purpose, but DeepSpeed's schema "Tensor[] a" declares no
        # mutation, which SchemaCheckMode reports.
        Sample("above_threshold", lambda m: ([torch.randn(11), torch.randn(4)],),
               skip={"test_schema": "frees its (non-mutable by schema) inputs in place"},
               check=_check_freed),
    ],
    "offload_tensor": [
        Sample(f"activation_{layout}", lambda m, layout=layout: (activation(layout), GRAPH, 7),
               skip=DUPLICATE_ARG_NAMES, check=_check_offload_round_trip(layout))
        for layout in LAYOUTS
    ],
    "wait_offload": [
        Sample(f"after_offload_{layout}", lambda m, layout=layout: (offloaded(7, layout), GRAPH, 7),
               skip=DUPLICATE_ARG_NAMES, check=_check_stand_in)
        for layout in LAYOUTS
    ],
    "reload_tensor": [
        Sample(f"saved_{layout}", lambda m, layout=layout: (saved(7, layout), GRAPH, 7),
               skip=DUPLICATE_ARG_NAMES, check=_check_stand_in)
        for layout in LAYOUTS
    ],
    "wait_reload": [
        Sample(f"after_reload_{layout}", lambda m, layout=layout: (reloaded(7, layout), GRAPH, 7),
               skip=DUPLICATE_ARG_NAMES, check=_check_reloaded(layout))
        for layout in LAYOUTS
    ],
    "offload_parameter": [
        Sample("param", lambda m: (placeholder(), GRAPH, 1), skip=DUPLICATE_ARG_NAMES,
               check=_check_params_intact),
    ],
    "reload_parameter": [
        Sample("param", lambda m: (placeholder(), GRAPH, 1), skip=DUPLICATE_ARG_NAMES,
               check=_check_params_intact),
    ],
    "end_backward": [
        Sample("deps_tensors", lambda m: ([torch.empty(0), torch.empty(0)], GRAPH, True),
               check=_check_end_backward),
        # `Any deps` is not looked at by the dispatcher, and the catch-all kernel that serves
        # all-None deps (TORCH_LIBRARY_IMPL(dc, Undefined), as DeepSpeed registers it) is stored
        # as CompositeImplicitAutograd, which FakeTensorMode prefers to the Meta kernel: under
        # fake tensors the device kernel runs, and with a gradient queued it flushes real
        # buckets, which fake mode rejects. DeepCompile never traces with gradients queued.
        Sample("deps_tensors_gradient_queued",
               lambda m: ([queued_gradient(), torch.empty(0)], GRAPH, True),
               skip={"test_faketensor": "fake mode runs the catch-all device kernel"},
               check=_check_end_backward),
        Sample("deps_none", lambda m: (None, GRAPH, False), check=_check_end_backward),
        Sample("two_args_none_deps", lambda m: ([None, None], GRAPH),
               check=_check_end_backward),
    ],
    "test_call": [
        Sample("tensor", lambda m: (torch.randn(3, 2),), check=_check_test_call),
    ],
}


OPS = [op.name for op in DC_OPS]


def test_every_listed_op_has_a_meta_kernel_and_samples() -> None:
    ds_z3native.native()
    missing = [name for name in OPS
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{name}", "Meta")]
    assert not missing, f"no Meta kernel for {missing}"
    assert sorted(SAMPLES) == sorted(OPS), (
        f"no samples for {sorted(set(OPS) - set(SAMPLES))}, "
        f"samples of unlisted ops {sorted(set(SAMPLES) - set(OPS))}")


def positional_schema_check(op: Any, args: Tuple[Any, ...], what: str) -> None:
    """What opcheck's test_schema checks, with the arguments passed by position (DeepSpeed's
    schemas that name two arguments ``id`` cannot be bound by keyword): no argument the schema does
    not mark mutable changes (values, strides, storage), and no output overlaps an argument or
    another output where the schema declares no alias."""
    schema = op._schema
    assert not any(a.alias_info is not None for a in schema.arguments), what
    assert not any(r.alias_info is not None for r in schema.returns), what
    inputs = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    before = [(a.clone(), a.stride(), a.untyped_storage()._cdata) for a in inputs]
    out = op(*args)
    outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    for i, (a, (values, stride, storage)) in enumerate(zip(inputs, before)):
        assert torch.equal(a, values), f"{what}: input {i} was changed"
        assert (a.stride(), a.untyped_storage()._cdata) == (stride, storage), (
            f"{what}: input {i}'s strides or storage were changed")
    for i, o in enumerate(outputs):
        for j, a in enumerate(inputs):
            assert not torch._C._overlaps(o, a), f"{what}: output {i} overlaps input {j}"
        for k, other in enumerate(outputs[:i]):
            assert not torch._C._overlaps(o, other), f"{what}: output {i} overlaps output {k}"


@pytest.mark.parametrize("op_name", OPS)
def test_opcheck(op_name: str) -> None:
    assert op_name in SAMPLES, f"no opcheck sample for dc::{op_name}"
    op = getattr(torch.ops.dc, op_name).default
    config = compile_config(free_activation_threshold=THRESHOLD)
    for sample in SAMPLES[op_name]:
        assert set(sample.skip) <= set(UTILS) and len(sample.skip) < len(UTILS)
        what = f"dc::{op_name} sample {sample.name!r}"
        opcheck_on_fresh_runtimes(op, sample.args, prepare, what, sample.kwargs, config,
                                  sample.skip)
        if sample.skip is DUPLICATE_ARG_NAMES:
            with live_runtime(config) as m:
                prepare(m)
                positional_schema_check(op, sample.args(m), what)
        if sample.check is not None:
            with live_runtime(config) as m:
                prepare(m)
                args = sample.args(m)
                m.reset_comm_stats()
                out = op(*args, **sample.kwargs)
                sample.check(m, args, out)


# ---- ds_z3native's own namespace ----------------------------------------------------------------

# Native ops of the ds_z3native namespace, opchecked beside their runtime's state.
NATIVE_OPS_ELSEWHERE = {"gather_persistent": "tests/test_persistent_group.py",
                        "reduce_grads": "tests/test_reduce_group.py",
                        "end_backward": "tests/test_inductor_calls.py"}


def _grouped_mm_sample(ends: Tuple[int, ...], input_grad: bool, weight_grad: bool,
                       offs_dtype: torch.dtype = torch.int32,
                       transposed: bool = False) -> Tuple[Any, ...]:
    """Arguments of ds_z3native::grouped_mm_fallback_backward as its autograd formula passes
    them: the weight only where grad_input is asked for, the input only for grad_weight."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, 5, generator=g)
    if transposed:  # transformers passes a (experts, out, in) weight transposed
        weight = torch.randn(3, 5, 4, generator=g).transpose(-2, -1)
    x, grad = torch.randn(7, 4, generator=g), torch.randn(7, 5, generator=g)
    return (x if weight_grad else None, weight if input_grad else None,
            torch.tensor(ends, dtype=offs_dtype), grad, input_grad, weight_grad)


# op name -> [(sample name, arguments)]
PYTHON_OP_SAMPLES: Dict[str, List[Tuple[str, Callable[[], Tuple[Any, ...]]]]] = {
    "grouped_mm_fallback_backward": [
        # expert 1 has no rows, row 6 is past the last offset
        ("both_grads_empty_expert", lambda: _grouped_mm_sample((2, 2, 6), True, True)),
        ("input_grad_only_frozen_weight", lambda: _grouped_mm_sample((2, 2, 6), True, False,
                                                                     torch.int64)),
        ("weight_grad_only", lambda: _grouped_mm_sample((2, 2, 6), False, True)),
        ("leading_empty_experts_transposed_weight",
         lambda: _grouped_mm_sample((0, 0, 7), True, True, transposed=True)),
    ],
}


def _namespace_ops() -> List[str]:
    from ds_z3native.compat.registry import all_patches

    ds_z3native.native()
    all_patches()  # imports every patch module, which define ds_z3native's Python ops
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("ds_z3native::"))


def test_every_ds_z3native_op_has_opcheck_samples() -> None:
    ops = _namespace_ops()
    assert ops == sorted(set(PYTHON_OP_SAMPLES) | set(NATIVE_OPS_ELSEWHERE)), (
        f"ds_z3native ops {ops}: no samples for "
        f"{sorted(set(ops) - set(PYTHON_OP_SAMPLES) - set(NATIVE_OPS_ELSEWHERE))}")
    for name in PYTHON_OP_SAMPLES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ds_z3native::{name}", "Meta"), name


@pytest.mark.parametrize("op_name,sample", [(op, i) for op, samples in PYTHON_OP_SAMPLES.items()
                                            for i in range(len(samples))])
def test_opcheck_python_op(op_name: str, sample: int) -> None:
    _namespace_ops()
    op = getattr(torch.ops.ds_z3native, op_name).default
    name, build = PYTHON_OP_SAMPLES[op_name][sample]
    for util in UTILS:
        try:
            torch.library.opcheck(op, build(), test_utils=util)
        except Exception as e:
            raise AssertionError(f"ds_z3native::{op_name} sample {name!r}, {util}: {e}") from e


def _optional_lists(schema: Any) -> List[str]:
    return [f"{a.name}: {a.type}" for a in schema.arguments
            if isinstance(a.type, torch.OptionalType)
            and isinstance(a.type.getElementType(), torch.ListType)]


def test_no_ds_z3native_op_takes_an_optional_list() -> None:
    """Compiled graphs call these ops; with ``cpp_wrapper=True`` torch 2.11's inductor passes
    their arguments through Python and refuses an optional list ('arg type List[ScalarType] is
    not yet supported by custom_op_wrapper'), so an op takes a plain list, empty for none."""
    bad = {name: _optional_lists(getattr(torch.ops.ds_z3native, name).default._schema)
           for name in _namespace_ops()}
    assert not {name: args for name, args in bad.items() if args}, bad
    # The check itself sees such an argument where one is (DeepSpeed's schema for the op its
    # fused prefetch pass emits without dtypes).
    assert [a.split(":")[0] for a in
            _optional_lists(torch.ops.dc.prefetch_params_fused.default._schema)] == ["dtypes"]
