"""``ds_z3native::gather_persistent`` and the DeepCompile pass that emits it
(``ds_z3native.compat.deepcompile_persistent.group_persistent_gathers``), on a live one-rank gloo
runtime; no DeepSpeed engine runs.

* the op through ``torch.library.opcheck`` (a fresh runtime for every sub-test: the op gathers);
* its values: the full params in their shapes, in the requested dtypes; a copy kept gathered is
  handed out again without an all-gather (same storage); after an optimizer step's invalidation a
  trainable param is re-gathered from its changed shard, a frozen one is not;
* its refusals (and its Meta kernel's), each naming the op, the id or graph and the bad value,
  before anything is gathered, the runtime usable afterwards;
* the pass on hand-built fx graphs of DeepSpeed's dc ops: the structure it leaves (one
  gather_persistent node, the persistent params' dc nodes gone, the others untouched, prefetch
  lists filtered), the cases it must leave alone, and the rewritten graph computing what the
  original computes on the same runtime.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ds_z3native.compat import deepcompile_persistent as dp
from helpers.native_rt import live_runtime, opcheck_on_fresh_runtimes

GRAPH = 3  # not 0: a kernel that ignores its graph_id argument would still find graph 0
# 1: trainable, kept gathered  2: frozen, kept gathered  3: trainable, gathered per use
# 4: trainable, kept gathered, not in GRAPH  5: frozen, registered persistent (never gathered)
SHAPES: Dict[int, Tuple[int, ...]] = {1: (3, 5), 2: (7,), 3: (2, 2), 4: (4,), 5: (2, 3)}
FROZEN = (2, 5)
GRAPH_IDS = [1, 2, 3, 5]
PH = torch.empty(0)  # what DeepCompile passes for a released ZeRO-3 param


def op() -> Any:
    return dp.gather_persistent_op()


def shards() -> Dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {ds_id: torch.randn(torch.Size(shape).numel(), generator=g)
            for ds_id, shape in SHAPES.items()}


def full(ds_id: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return shards()[ds_id].view(SHAPES[ds_id]).to(dtype)


def prepare(m: Any) -> Dict[int, torch.Tensor]:
    """Registers the params of SHAPES and GRAPH, keeps 1, 2 and 4 gathered; returns the shards
    the runtime reads (changing one in place changes the param)."""
    s = shards()
    for ds_id, shape in SHAPES.items():
        grad = torch.Tensor() if ds_id in FROZEN else torch.zeros(s[ds_id].numel())
        m.register_z3_param(ds_id, list(shape), s[ds_id], grad, ds_id == 5)
    m.register_graph_z3(GRAPH, GRAPH_IDS)
    for ds_id in (1, 2, 4):
        m.set_persistent(ds_id)
    return s


def optimizer_step(m: Any) -> None:
    """What a training step does to the runtime's copies: a backward that updates ends with
    end_backward, which invalidates the graph's trainable params (the optimizer changes their
    shards next)."""
    m.start_backward(True)
    torch.ops.dc.end_backward(None, GRAPH, False)


def stale() -> Tuple[Any, ...]:
    from ds_z3native import native

    optimizer_step(native())
    return (GRAPH, [PH, PH], [1, 2], [])


# ------------------------------------------------------------------------------------ opcheck

# name -> (args built on a prepared runtime, kwargs)
SAMPLES: Dict[str, Tuple[Callable[[], Tuple[Any, ...]], Dict[str, Any]]] = {
    "kept": (lambda: (GRAPH, [PH, PH], [1, 2], []), {}),
    "registered_persistent_not_yet_gathered": (lambda: (GRAPH, [PH, PH], [5, 1], []), {}),
    "dtypes": (lambda: (GRAPH, [PH, PH, PH], [2, 1, 5],
                        [torch.bfloat16, torch.float32, torch.float16]), {}),
    "dtypes_kw": (lambda: (GRAPH, [PH], [1]), {"dtypes": [torch.bfloat16]}),
    "dtypes_some_of_the_shards": (lambda: (GRAPH, [PH, PH], [1, 2], [None, torch.float16]), {}),
    "after_optimizer_step": (stale, {}),
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_opcheck(sample: str) -> None:
    build, kwargs = SAMPLES[sample]
    opcheck_on_fresh_runtimes(op(), lambda m: build(), prepare,
                              f"gather_persistent sample {sample!r}", kwargs)


def test_the_op_has_a_meta_kernel_and_a_kernel_for_every_device() -> None:
    op()
    name = "ds_z3native::gather_persistent"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert str(op()._schema) == ("ds_z3native::gather_persistent(int graph_id, Tensor[] params, "
                                 "int[] ids, ScalarType?[] dtypes) -> Tensor[]")


# ------------------------------------------------------------------------------------- values

def test_returns_the_full_params_in_their_shapes() -> None:
    with live_runtime() as m:
        prepare(m)
        m.reset_comm_stats()
        out = op()(GRAPH, [PH, PH, PH], [2, 1, 5], [])
        assert [t.shape for t in out] == [SHAPES[2], SHAPES[1], SHAPES[5]]
        assert all(t.dtype == torch.float32 for t in out)
        for t, ds_id in zip(out, (2, 1, 5)):
            assert torch.equal(t, full(ds_id))
        # 1 and 2 were gathered by set_persistent; 5 (registered persistent) is gathered now.
        assert m.comm_stats()["allgather_calls"] == 1
        assert m.param_state(5)["gathered"] and m.param_state(5)["valid"]


def test_returns_the_requested_dtypes() -> None:
    with live_runtime() as m:
        prepare(m)
        dtypes = [torch.bfloat16, torch.float16, torch.float64]
        out = op()(GRAPH, [PH, PH, PH], [1, 2, 5], dtypes)
        for t, ds_id, dtype in zip(out, (1, 2, 5), dtypes):
            assert t.dtype == dtype and t.shape == SHAPES[ds_id]
            assert torch.equal(t, full(ds_id, dtype))


def test_a_dtype_of_none_gives_that_params_shard_dtype() -> None:
    with live_runtime() as m:
        prepare(m)
        out = op()(GRAPH, [PH, PH], [1, 2], [None, torch.bfloat16])
        assert out[0].dtype == torch.float32 and torch.equal(out[0], full(1, torch.float32))
        assert out[1].dtype == torch.bfloat16 and torch.equal(out[1], full(2, torch.bfloat16))


def test_a_second_call_hands_out_the_kept_copies_without_gathering() -> None:
    with live_runtime() as m:
        prepare(m)
        first = op()(GRAPH, [PH, PH], [1, 2], [])
        m.reset_comm_stats()
        second = op()(GRAPH, [PH, PH], [1, 2], [])
        assert m.comm_stats()["allgather_calls"] == 0
        for a, b, ds_id in zip(first, second, (1, 2)):
            assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            assert b.data_ptr() == a.data_ptr() and b.shape == SHAPES[ds_id]
            assert torch.equal(b, full(ds_id))
        # What allgather_param returns for the param is the same copy.
        waited = torch.ops.dc.allgather_param(PH, GRAPH, 1)
        assert waited.data_ptr() == first[0].data_ptr()
        assert m.comm_stats()["allgather_calls"] == 0


def test_after_an_optimizer_step_a_trainable_param_is_regathered_a_frozen_one_is_not() -> None:
    # On one rank a kept param is its shard (test_native_gloo covers two ranks): after the
    # step both read what the optimizer wrote, and no copy is made.
    with live_runtime() as m:
        s = prepare(m)
        before = op()(GRAPH, [PH, PH], [1, 2], [])
        assert [t.data_ptr() for t in before] == [s[1].data_ptr(), s[2].data_ptr()]
        optimizer_step(m)
        assert not m.param_state(1)["valid"] and m.param_state(2)["valid"]
        s[1].mul_(-2).add_(1)  # the optimizer writes the trainable shard in place
        m.reset_comm_stats()
        out = op()(GRAPH, [PH, PH], [1, 2], [])
        assert m.comm_stats()["allgather_calls"] == 1  # the trainable one, counted, not copied
        assert torch.equal(out[0], (full(1) * -2 + 1))
        assert torch.equal(out[1], full(2))
        assert out[0].data_ptr() == s[1].data_ptr()
        assert m.param_state(1)["valid"] and m.param_state(1)["persistent"]
        # And kept again.
        m.reset_comm_stats()
        again = op()(GRAPH, [PH, PH], [1, 2], [])
        assert m.comm_stats()["allgather_calls"] == 0
        assert again[0].data_ptr() == out[0].data_ptr()
        assert torch.equal(again[0], full(1) * -2 + 1)


def test_after_an_optimizer_step_the_requested_dtype_is_gathered() -> None:
    with live_runtime() as m:
        s = prepare(m)
        optimizer_step(m)
        s[1].add_(0.5)
        out = op()(GRAPH, [PH, PH], [1, 2], [torch.bfloat16, torch.float32])
        assert out[0].dtype == torch.bfloat16
        assert torch.equal(out[0], (full(1) + 0.5).to(torch.bfloat16))
        assert torch.equal(out[1], full(2))


# ----------------------------------------------------------------------------------- refusals

# name -> (args, pattern the message must match)
REFUSALS: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "not_persistent": ((GRAPH, [PH, PH], [1, 3], []),
                       r"gather_persistent: ds_id 3 of graph 3 is not persistent"),
    "unknown_id": ((GRAPH, [PH, PH], [1, 99], []), r"gather_persistent: unknown ds_id 99"),
    "not_in_graph": ((GRAPH, [PH, PH], [1, 4], []),
                     r"gather_persistent: ds_id 4 is not a parameter of graph 3"),
    "duplicate": ((GRAPH, [PH, PH, PH], [1, 2, 1], []), r"gather_persistent: ds_id 1 listed twice"),
    "empty": ((GRAPH, [], [], []), r"gather_persistent: graph 3: no ds_ids"),
    "params_ids_length": ((GRAPH, [PH], [1, 2], []),
                          r"gather_persistent: graph 3: 1 params but 2 ids"),
    "dtypes_length": ((GRAPH, [PH, PH], [1, 2], [torch.bfloat16]),
                      r"gather_persistent: graph 3: 2 ids but 1 dtypes"),
    "unknown_graph": ((9, [PH], [1], []), r"gather_persistent: unknown graph_id 9"),
    "unsupported_dtype": ((GRAPH, [PH, PH], [2, 1], [torch.float32, torch.complex64]),
                          r"gather_persistent: ds_id 1 cannot be gathered in ComplexFloat"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal_names_the_op_and_value_and_gathers_nothing(case: str) -> None:
    args, pattern = REFUSALS[case]
    with live_runtime() as m:
        s = prepare(m)
        optimizer_step(m)  # param 1 needs a gather: a refusal must not have started it
        s[1].add_(1)
        m.reset_comm_stats()
        with pytest.raises(RuntimeError, match=pattern):
            op()(*args)
        assert m.comm_stats()["allgather_calls"] == 0
        assert not m.param_state(1)["valid"]
        assert not m.param_state(3)["gathered"]
        out = op()(GRAPH, [PH, PH], [1, 2], [])
        assert torch.equal(out[0], full(1) + 1) and torch.equal(out[1], full(2))
        assert m.comm_stats()["allgather_calls"] == 1


def test_a_param_whose_persistence_was_declined_is_refused() -> None:
    with live_runtime() as m:
        # A strided shard: even on one rank its kept copy is a copy, which the budget counts.
        strided = torch.zeros(30)[::2].copy_(shards()[1])
        m.register_z3_param(1, [3, 5], strided, torch.zeros(15), False)
        m.register_graph_z3(GRAPH, [1])
        m.set_persistence_budget(4)  # fewer bytes than the param's
        m.set_persistent(1)
        assert not m.param_state(1)["persistent"] and m.persistence_info()["declined"] == 1
        with pytest.raises(RuntimeError, match=r"gather_persistent: ds_id 1 of graph 3 is not "
                                               r"persistent"):
            op()(GRAPH, [PH], [1], [])
        assert not m.param_state(1)["gathered"]


def test_without_a_runtime_the_op_is_refused() -> None:
    from ds_z3native import native

    native().cleanup()
    with pytest.raises(RuntimeError, match=r"gather_persistent: the runtime is not initialized"):
        op()(GRAPH, [PH], [1], [])


def test_meta_kernel_returns_full_shapes_in_the_requested_dtypes() -> None:
    with live_runtime() as m:
        prepare(m)
        m.reset_comm_stats()
        with FakeTensorMode():
            ph = torch.empty(0)
            out = op()(GRAPH, [ph, ph, ph], [1, 2, 5],
                       [torch.bfloat16, torch.float16, torch.float32])
            plain = op()(GRAPH, [ph], [3], [])  # shapes only: persistence is the device kernel's
            some = op()(GRAPH, [ph, ph], [1, 2], [torch.float16, None])
        assert [(t.shape, t.dtype) for t in some] == [(SHAPES[1], torch.float16),
                                                      (SHAPES[2], torch.float32)]
        assert [(t.shape, t.dtype) for t in out] == [
            (SHAPES[1], torch.bfloat16), (SHAPES[2], torch.float16), (SHAPES[5], torch.float32)]
        assert plain[0].shape == SHAPES[3] and plain[0].dtype == torch.float32
        assert m.comm_stats()["allgather_calls"] == 0
        assert not m.param_state(5)["gathered"]


# name -> (args from a fake placeholder, pattern the message must match)
META_REFUSALS: Dict[str, Tuple[Callable[[torch.Tensor], Tuple[Any, ...]], str]] = {
    "unknown_id": (lambda ph: (GRAPH, [ph, ph], [1, 99], []),
                   r"gather_persistent \(meta\): unknown ds_id 99"),
    "empty": (lambda ph: (GRAPH, [], [], []), r"gather_persistent \(meta\): graph 3: no ds_ids"),
    "params_ids_length": (lambda ph: (GRAPH, [ph], [1, 2], []),
                          r"gather_persistent \(meta\): graph 3: 1 params but 2 ids"),
    "dtypes_length": (lambda ph: (GRAPH, [ph], [1], [torch.float16, torch.float32]),
                      r"gather_persistent \(meta\): graph 3: 1 ids but 2 dtypes"),
}


@pytest.mark.parametrize("case", sorted(META_REFUSALS))
def test_meta_kernel_refusals(case: str) -> None:
    build, pattern = META_REFUSALS[case]
    with live_runtime() as m:
        prepare(m)
        with FakeTensorMode():
            ph = torch.empty(0)
            with pytest.raises(RuntimeError, match=pattern):
                op()(*build(ph))
            out = op()(GRAPH, [ph], [1], [])  # still usable
        assert out[0].shape == SHAPES[1] and out[0].dtype == torch.float32


# -------------------------------------------------------------------------------------- pass

dc = torch.ops.dc
X_SHAPE = (2, 5)


class Builder:
    """A DeepCompile-like graph: placeholders p1, p2, p3 (the released params) and x."""

    def __init__(self) -> None:
        op()  # loads the native module, which registers the dc ops
        self.graph = torch.fx.Graph()
        self.p = {i: self.graph.placeholder(f"p{i}") for i in (1, 2, 3)}
        self.x = self.graph.placeholder("x")

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def gather(self, ds_id: int, dtype: Optional[torch.dtype] = None,
               source: Optional[torch.fx.Node] = None) -> torch.fx.Node:
        kwargs = {} if dtype is None else {"dtype": dtype}
        src = self.p[ds_id] if source is None else source
        ag = self.call(dc.allgather_param.default, src, GRAPH, ds_id, **kwargs)
        return self.call(dc.wait_allgather.default, ag, GRAPH, ds_id)

    def release(self, x: torch.fx.Node, ds_id: int, n_users: int) -> torch.fx.Node:
        return self.call(dc.release_param.default, x, GRAPH, ds_id, n_users)

    def prefetch(self, ids: Sequence[int], dtypes: Optional[List[torch.dtype]] = None) -> None:
        args: Tuple[Any, ...] = (GRAPH, [self.p[i] for i in ids], list(ids))
        if dtypes is not None:
            args += (dtypes,)
        self.call(dc.prefetch_params_fused.default, *args)

    def module(self, *outputs: torch.fx.Node) -> torch.fx.GraphModule:
        self.graph.output(tuple(outputs))
        self.graph.lint()
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def model_graph(dtype1: Optional[torch.dtype] = None, dtype2: Optional[torch.dtype] = None,
                return_w2: bool = False) -> torch.fx.GraphModule:
    """Param 2 gathered first, then 3 (not persistent), then 1 twice; prefetches of [2], [1, 3]
    and [1]."""
    b = Builder()
    aten = torch.ops.aten
    b.prefetch([2])
    w2 = b.gather(2, dtype2)
    s2 = b.call(aten.sum.default, w2)
    r2 = b.release(s2, 2, 1)
    b.prefetch([1, 3], [torch.float32, torch.float32])
    w3 = b.gather(3)
    w1 = b.gather(1, dtype1)
    t1 = b.call(aten._to_copy.default, b.call(aten.t.default, w1), dtype=torch.float32)
    y = b.call(aten.mm.default, b.x, t1)                                       # (2, 3)
    r1 = b.release(y, 1, 2)
    z = b.call(aten.mm.default, b.call(aten.slice.Tensor, r1, 1, 0, 2), w3)   # (2, 2)
    r3 = b.release(z, 3, 1)
    b.prefetch([1])
    w1b = b.gather(1, dtype1)
    s1 = b.call(aten.sum.default, w1b)  # in the gather's dtype
    u = b.call(aten.add.Tensor, r3, s1)
    r1b = b.release(u, 1, 2)
    outs = [r1b, b.call(aten.mul.Tensor, r2, 2), s1]
    if return_w2:
        outs.append(w2)
    return b.module(*outs)


def nodes(gm: torch.fx.GraphModule, target: Any) -> List[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def ids_of(gm: torch.fx.GraphModule, target: Any) -> List[int]:
    return [int(n.args[2]) for n in nodes(gm, target)]


def run_pass(gm: torch.fx.GraphModule, persistent: Sequence[int]) -> Any:
    """The pass as DeepSpeed's run_opt_passes runs it: lint and recompile a changed module."""
    out = dp.group_persistent_gathers(gm, GRAPH, [], {}, None, None, None, False,
                                      is_persistent=lambda ds_id: ds_id in persistent)
    if out is not None:
        out.graph.lint()
        out.recompile()
    return out


def test_pass_structure() -> None:
    gm = model_graph()
    before = dp.group_stats()
    out = run_pass(gm, {1, 2})
    assert out is gm
    groups = nodes(gm, op())
    assert len(groups) == 1
    group = groups[0]
    graph_id, params, ids, dtypes = group.args
    assert graph_id == GRAPH and ids == [2, 1] and dtypes == []  # first-gather order
    assert [p.name for p in params] == ["p2", "p1"]
    # Inserted before the first gather it replaces: after the [2] prefetch it erased.
    order = list(gm.graph.nodes)
    assert order.index(group) < min(order.index(n) for n in nodes(gm, torch.ops.aten.sum.default))
    items = [n for n in group.users]
    assert all(n.target is operator.getitem for n in items)
    assert sorted(n.args[1] for n in items) == [0, 1]  # param 1 gathered twice: one entry
    for target in (dc.allgather_param.default, dc.wait_allgather.default,
                   dc.release_param.default):
        assert ids_of(gm, target) == [3]  # the non-persistent param keeps its nodes
    prefetches = nodes(gm, dc.prefetch_params_fused.default)
    assert [(p.args[2], [x.name for x in p.args[1]]) for p in prefetches] == [([3], ["p3"])]
    assert prefetches[0].args[3] == [torch.float32]  # the dtypes list filtered alike
    # The persistent params' uses read the group's outputs.
    mm_weight = nodes(gm, torch.ops.aten.t.default)[0].args[0]
    assert mm_weight.target is operator.getitem and mm_weight.args == (group, 1)
    gm.graph.lint()
    after = dp.group_stats()
    assert after["graphs"] - before["graphs"] == 1
    assert after["params"] - before["params"] == 2
    # 3 gathers + 3 waits + 3 releases of params 1 (twice) and 2.
    assert after["removed_calls"] - before["removed_calls"] == 9


def test_pass_passes_the_gathers_dtypes() -> None:
    gm = model_graph(dtype1=torch.bfloat16, dtype2=torch.float32)
    assert run_pass(gm, {1, 2}) is gm
    (group,) = nodes(gm, op())
    assert group.args[2] == [2, 1] and group.args[3] == [torch.float32, torch.bfloat16]


def test_pass_returns_none_when_no_param_is_persistent() -> None:
    gm = model_graph()
    code = gm.graph.python_code("self").src
    before = dp.group_stats()
    assert run_pass(gm, set()) is None
    assert gm.graph.python_code("self").src == code
    assert dp.group_stats()["graphs"] == before["graphs"]


def test_pass_leaves_a_param_returned_by_the_graph() -> None:
    gm = model_graph(return_w2=True)
    assert run_pass(gm, {1, 2}) is gm
    (group,) = nodes(gm, op())
    assert group.args[2] == [1]
    for target in (dc.allgather_param.default, dc.wait_allgather.default):
        assert sorted(ids_of(gm, target)) == [2, 3]
    assert sorted(ids_of(gm, dc.release_param.default)) == [2, 3]
    assert [p.args[2] for p in nodes(gm, dc.prefetch_params_fused.default)] == [[2], [3]]
    assert run_pass(model_graph(return_w2=True), {2}) is None


def _two_dtypes() -> torch.fx.GraphModule:
    b = Builder()
    w1 = b.gather(1, torch.float32)
    w1b = b.gather(1, torch.bfloat16)
    return b.module(b.call(torch.ops.aten.sum.default, w1),
                    b.call(torch.ops.aten.sum.default, w1b))


def _not_a_placeholder() -> torch.fx.GraphModule:
    b = Builder()
    view = b.call(torch.ops.aten.view.default, b.p[1], [-1])
    w1 = b.gather(1, source=view)
    return b.module(b.call(torch.ops.aten.sum.default, w1))


def _two_sources() -> torch.fx.GraphModule:
    b = Builder()
    w1 = b.gather(1)
    w1b = b.gather(1, source=b.p[2])
    return b.module(b.call(torch.ops.aten.sum.default, w1),
                    b.call(torch.ops.aten.sum.default, w1b))


@pytest.mark.parametrize("build", [_two_dtypes, _not_a_placeholder, _two_sources])
def test_pass_leaves_params_it_cannot_group(build: Callable[[], torch.fx.GraphModule]) -> None:
    gm = build()
    code = gm.graph.python_code("self").src
    assert run_pass(gm, {1, 2, 3}) is None
    assert gm.graph.python_code("self").src == code


def test_pass_reads_the_runtime_flag_by_default() -> None:
    with live_runtime() as m:
        prepare(m)
        gm = model_graph()
        assert dp.group_persistent_gathers(gm, GRAPH, [], {}, None, None, None, True) is gm
        (group,) = nodes(gm, op())
        assert group.args[2] == [2, 1]


def _inputs() -> Tuple[torch.Tensor, ...]:
    x = torch.linspace(-1, 1, X_SHAPE[0] * X_SHAPE[1]).view(X_SHAPE)
    return (PH, PH, PH, x)


@pytest.mark.parametrize("dtype1, dtype2", [
    (None, None),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    # Gathers without a dtype beside gathers with one (DeepSpeed before 0.19.8 passes none):
    # each param must still come back in its own gathers' dtype.
    (torch.bfloat16, None),
])
def test_rewritten_graph_computes_what_the_original_computes(
        dtype1: Optional[torch.dtype], dtype2: Optional[torch.dtype]) -> None:
    with live_runtime() as m:
        s = prepare(m)
        original = model_graph(dtype1, dtype2)
        rewritten = model_graph(dtype1, dtype2)
        assert run_pass(rewritten, {1, 2}) is rewritten
        assert "ds_z3native.gather_persistent" in rewritten.code  # what runs is the rewrite
        expected = original(*_inputs())
        m.reset_comm_stats()
        got = before = rewritten(*_inputs())
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        # Only param 3 (not persistent) was gathered, and released again.
        assert m.comm_stats()["allgather_calls"] == 1
        assert not m.param_state(3)["gathered"]
        # After an optimizer step both graphs see the new values of param 1.
        optimizer_step(m)
        s[1].mul_(3)
        got = rewritten(*_inputs())
        expected = original(*_inputs())
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert not torch.equal(got[0], before[0])  # param 1 was re-gathered
