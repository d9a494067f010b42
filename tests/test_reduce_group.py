"""``ds_z3native::reduce_grads`` and the DeepCompile rewrite that emits it
(``ds_z3native.compat.deepcompile_reduce_group``), on a live one-rank gloo runtime; no DeepSpeed
engine runs (``tests/test_deepcompile_cpu_warm_start.py`` trains through it on two ranks).

* the op through ``torch.library.opcheck`` (a fresh runtime for every sub-test: the op queues);
* its values: what one ``reduce_grad`` call per gradient leaves in the grad buffers, also where a
  bucket fills in the middle of a group, for a gradient of another dtype, and for one param's two
  gradients in one group;
* its refusals (and its Meta kernel's), each naming the op, the id and the bad value, with
  nothing of the group queued, the runtime usable afterwards;
* the rewrite on hand-built fx graphs of DeepSpeed's dc ops: the groups it makes (runs of
  consecutive calls, cut by count, bytes and graph id), the calls it leaves alone, and the
  rewritten graph leaving the same grad buffers as the original on the same runtime;
* the compiler wrapper it installs, and ``set_group_reduce(False)``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import ds_z3native
from ds_z3native import settings
from ds_z3native.compat import deepcompile_reduce_group as rg
from helpers.native_rt import live_runtime, opcheck_on_fresh_runtimes

GRAPH = 3  # not 0: a kernel that ignores its graph_id argument would still find graph 0
# 1, 2, 4: trainable  3: frozen  5: trainable, its gradient reduced in bf16
SHAPES: Dict[int, Tuple[int, ...]] = {1: (3, 5), 2: (7,), 3: (2, 2), 4: (4, 4), 5: (6,)}
FROZEN = (3,)
BF16 = (5,)


def op() -> Any:
    return rg.reduce_grads_op()


def prepare(m: Any) -> Dict[int, torch.Tensor]:
    """Registers the params of SHAPES in GRAPH; returns their grad buffers (frozen: none)."""
    g = torch.Generator().manual_seed(3)
    buffers = {}
    for ds_id, shape in SHAPES.items():
        numel = torch.Size(shape).numel()
        shard = torch.randn(numel, generator=g)
        grad = torch.Tensor() if ds_id in FROZEN else torch.zeros(numel)
        dtype = torch.bfloat16 if ds_id in BF16 else torch.float32
        m.register_z3_param(ds_id, list(shape), shard, grad, False, dtype)
        buffers[ds_id] = grad
    m.register_graph_z3(GRAPH, list(SHAPES))
    m.start_backward(True)
    return buffers


def grads(seed: int = 0) -> Dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {ds_id: torch.randn(shape, generator=g) for ds_id, shape in SHAPES.items()}


def end(m: Any) -> None:
    torch.ops.dc.end_backward([None], GRAPH, False)


def reduced(calls: Callable[[Dict[int, torch.Tensor]], None], bucket: int = 1 << 16
            ) -> Dict[int, torch.Tensor]:
    """The grad buffers after ``calls(grads())`` and end_backward on a fresh runtime."""
    with live_runtime(bucket_size=bucket) as m:
        buffers = prepare(m)
        calls(grads())
        end(m)
        return {k: v.clone() for k, v in buffers.items() if k not in FROZEN}


def one_by_one(ids: List[int]) -> Callable[[Dict[int, torch.Tensor]], None]:
    def calls(g: Dict[int, torch.Tensor]) -> None:
        for ds_id in ids:
            torch.ops.dc.reduce_grad(g[ds_id], GRAPH, ds_id)
    return calls


def grouped(ids: List[int]) -> Callable[[Dict[int, torch.Tensor]], None]:
    def calls(g: Dict[int, torch.Tensor]) -> None:
        out = op()(GRAPH, [g[ds_id] for ds_id in ids], ids)
        assert out.numel() == 0
    return calls


# ------------------------------------------------------------------------------------ opcheck

SAMPLES: Dict[str, Callable[[], Tuple[Any, ...]]] = {
    "two": lambda: (GRAPH, [torch.randn(3, 5), torch.randn(7)], [1, 2]),
    "bf16_reduced": lambda: (GRAPH, [torch.randn(6), torch.randn(4, 4)], [5, 4]),
    "one": lambda: (GRAPH, [torch.randn(7)], [2]),
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_opcheck(sample: str) -> None:
    opcheck_on_fresh_runtimes(op(), lambda m: SAMPLES[sample](), prepare,
                              f"reduce_grads sample {sample!r}")


def test_the_op_has_a_meta_kernel_and_a_kernel_for_every_device() -> None:
    op()
    name = "ds_z3native::reduce_grads"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert str(op()._schema) == ("ds_z3native::reduce_grads(int graph_id, Tensor[] grads, "
                                 "int[] ids) -> Tensor")


# ------------------------------------------------------------------------------------- values

@pytest.mark.parametrize("bucket", [1 << 16, 20], ids=["one_bucket", "flushes_mid_group"])
def test_leaves_what_one_reduce_grad_per_gradient_leaves(bucket: int) -> None:
    ids = [4, 1, 5, 2]
    expected = reduced(one_by_one(ids), bucket)
    got = reduced(grouped(ids), bucket)
    assert set(got) == set(expected)
    for ds_id in expected:
        assert torch.equal(got[ds_id], expected[ds_id]), ds_id
    g = grads()
    assert torch.equal(got[1], g[1].reshape(-1))  # one rank: the reduced gradient is the gradient
    assert torch.equal(got[5], g[5].to(torch.bfloat16).float())  # reduced in bf16


def test_two_gradients_of_one_param_in_a_group_are_added() -> None:
    def twice(g: Dict[int, torch.Tensor]) -> None:
        op()(GRAPH, [g[1], g[2], g[1]], [1, 2, 1])

    got = reduced(twice)
    g = grads()
    assert torch.allclose(got[1], 2 * g[1].reshape(-1)) and torch.equal(got[2], g[2])
    assert torch.equal(got[1], reduced(one_by_one([1, 2, 1]))[1])


def test_the_copy_reads_the_gradient_after_the_call_returns_its_value() -> None:
    # The copy into the bucket is queued on the copy stream; the gradient's value at the call
    # is what is reduced (on the CPU the copy runs at once).
    with live_runtime() as m:
        buffers = prepare(m)
        g = torch.randn(7)
        expected = g.clone()
        op()(GRAPH, [g, torch.randn(3, 5)], [2, 1])
        g.zero_()
        end(m)
        assert torch.equal(buffers[2], expected)


# ----------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("args,match", [
    ((GRAPH, [torch.randn(3, 5), torch.randn(2, 2)], [1, 3]), r"reduce_grads.*ds_id 3 is frozen"),
    ((GRAPH, [torch.randn(3, 5), torch.randn(2)], [1, 99]), r"reduce_grads.*99"),
    ((GRAPH, [torch.randn(3, 5), torch.randn(5)], [1, 2]),
     r"reduce_grads.*gradient of ds_id 2 has 5 elements, the param has 7"),
    ((GRAPH, [torch.randn(3, 5)], [1, 2]), r"reduce_grads.*graph 3: 1 gradients but 2 ids"),
    ((GRAPH, [], []), r"reduce_grads.*graph 3: no ds_ids"),
    ((GRAPH, [torch.randn(3, 5), torch.ones(7, dtype=torch.int64)], [1, 2]),
     r"reduce_grads.*ds_id 2 must be floating point"),
    ((12345, [torch.randn(3, 5)], [1]), r"reduce_grads.*12345"),
], ids=["frozen", "unknown_id", "wrong_numel", "lengths", "empty", "integer", "unknown_graph"])
def test_refused_naming_the_op_and_the_value_with_nothing_queued(args: Tuple[Any, ...],
                                                                 match: str) -> None:
    with live_runtime() as m:
        buffers = prepare(m)
        with pytest.raises(RuntimeError, match=match):
            op()(*args)
        # Nothing of the group was queued (param 1 came first in most groups), and the
        # runtime still reduces.
        end(m)
        assert torch.count_nonzero(buffers[1]) == 0
        m.start_backward(True)
        g = torch.randn(7)
        op()(GRAPH, [g], [2])
        end(m)
        assert torch.equal(buffers[2], g)


def test_the_meta_kernel_refuses_unknown_ids_and_meta_gradients() -> None:
    with live_runtime() as m:
        prepare(m)
        with pytest.raises(RuntimeError, match=r"reduce_grads \(meta\).*99"):
            op()(GRAPH, [torch.empty(2, device="meta")], [99])
        with pytest.raises(RuntimeError, match=r"reduce_grads \(meta\).*gradient of ds_id 1 "
                                               r"\(shape \[3, 5\]\) is a meta tensor"):
            op()(GRAPH, [torch.empty(3, 5, device="meta")], [1])
        with pytest.raises(RuntimeError, match=r"reduce_grads \(meta\).*1 gradients but 2 ids"):
            op()(GRAPH, [torch.empty(3, 5, device="meta")], [1, 2])


# ----------------------------------------------------------------------------------- rewrite

def backward_graph(ids: List[int], extra_user: Tuple[int, ...] = (),
                   graph_ids: Optional[Dict[int, int]] = None) -> torch.fx.GraphModule:
    """A graph shaped like DeepCompile's backward: each gradient computed (x * 2), its
    reduce_grad, then end_backward over every reduce_grad's value; ``extra_user``: ids whose
    reduce_grad value something else reads too."""
    dc = torch.ops.dc
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"g{i}_{ds_id}") for i, ds_id in enumerate(ids)]
    reduces = []
    outs = []
    for i, ds_id in enumerate(ids):
        grad = graph.call_function(torch.ops.aten.mul.Tensor, (inputs[i], 2))
        grad.meta["val"] = torch.empty(SHAPES[ds_id])
        r = graph.call_function(dc.reduce_grad.default,
                                (grad, (graph_ids or {}).get(ds_id, GRAPH), ds_id))
        r.meta["val"] = torch.empty(0)
        reduces.append(r)
        if ds_id in extra_user:
            outs.append(graph.call_function(torch.ops.aten.clone.default, (r,)))
    graph.call_function(dc.end_backward.default, (reduces, GRAPH, False))
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_consecutive_calls_become_one_call_at_the_last_and_end_backward_names_it_once() -> None:
    gm = backward_graph([1, 2, 4, 5])
    assert rg.group_reduce_grads(gm) == 3
    nodes = list(gm.graph.nodes)
    (group,) = [n for n in nodes if n.target == op()]
    assert group.args[0] == GRAPH and group.args[2] == [1, 2, 4, 5]
    assert not any(n.target == torch.ops.dc.reduce_grad.default for n in nodes)
    # at the place of the last: after every gradient it takes
    grads_ = [n for n in nodes if n.target == torch.ops.aten.mul.Tensor]
    assert all(nodes.index(g) < nodes.index(group) for g in grads_)
    (end_node,) = [n for n in nodes if n.target == torch.ops.dc.end_backward.default]
    assert end_node.args[0] == [group]


def test_groups_are_cut_by_count_bytes_and_graph_id() -> None:
    gm = backward_graph([1, 2, 4, 5, 1])
    assert rg.group_reduce_grads(gm, max_grads=2) == 2  # [1, 2] [4, 5] [1]
    groups = [n.args[2] for n in gm.graph.nodes if n.target == op()]
    assert groups == [[1, 2], [4, 5]]
    assert [n.args[2] for n in gm.graph.nodes
            if n.target == torch.ops.dc.reduce_grad.default] == [1]
    # bytes: 1 is 60 bytes, 2 is 28, 4 is 64: 60 + 28 fit in 100, 64 more do not
    gm = backward_graph([1, 2, 4])
    rg.group_reduce_grads(gm, max_bytes=100)
    assert [n.args[2] for n in gm.graph.nodes if n.target == op()] == [[1, 2]]
    gm = backward_graph([1, 2, 4, 5], graph_ids={4: 8, 5: 8})
    rg.group_reduce_grads(gm)
    assert [(n.args[0], n.args[2]) for n in gm.graph.nodes if n.target == op()] == \
        [(GRAPH, [1, 2]), (8, [4, 5])]


def test_calls_read_elsewhere_or_alone_are_left_as_they_are() -> None:
    gm = backward_graph([1, 2, 4], extra_user=(2,))
    assert rg.group_reduce_grads(gm) == 0  # 1 and 4 are not consecutive without 2
    assert len([n for n in gm.graph.nodes if n.target == torch.ops.dc.reduce_grad.default]) == 3
    gm = backward_graph([1])
    assert rg.group_reduce_grads(gm) == 0


def test_the_rewritten_graph_leaves_the_grad_buffers_of_the_original() -> None:
    ids = [4, 1, 5, 2]
    inputs = [grads(1)[ds_id] for ds_id in ids]

    def run(gm: torch.fx.GraphModule) -> Dict[int, torch.Tensor]:
        with live_runtime(bucket_size=20) as m:
            buffers = prepare(m)
            gm(*inputs)
            return {k: v.clone() for k, v in buffers.items() if k not in FROZEN}

    original = run(backward_graph(ids))
    gm = backward_graph(ids)
    assert rg.group_reduce_grads(gm) == 3
    regrouped = run(gm)
    for ds_id in ids:
        assert torch.equal(regrouped[ds_id], original[ds_id]), ds_id
        assert torch.count_nonzero(original[ds_id]) > 0


def test_the_compiler_wrapper_groups_unless_set_off() -> None:
    seen: List[List[str]] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> str:
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return "compiled"

    before = settings.current()
    try:
        assert rg._grouping(compiler)(backward_graph([1, 2]), []) == "compiled"
        assert "ds_z3native.reduce_grads.default" in seen[-1]
        ds_z3native.set_group_reduce(False)
        rg._grouping(compiler)(backward_graph([1, 2]), [])
        assert "ds_z3native.reduce_grads.default" not in seen[-1]
        assert seen[-1].count("dc.reduce_grad.default") == 2
    finally:
        settings.use(before)
    with pytest.raises(ValueError, match="set_group_reduce"):
        ds_z3native.set_group_reduce("yes")  # type: ignore[arg-type]
