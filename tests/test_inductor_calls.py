"""``ds_z3native.compat.deepcompile_inductor_calls``: the rewrites that let inductor's C++ wrapper
compile a DeepCompile graph, and the op one of them emits.

* ``ds_z3native::end_backward(Tensor[] deps, ...)``: registered with a Meta kernel and one for
  every device, checked by ``torch.library.opcheck`` on a live one-rank gloo runtime; it leaves the
  grad buffers ``dc.end_backward`` leaves; refusals name the op, the graph and the bad value;
* the rewrite of ``dc.end_backward`` on hand-built graphs shaped like DeepCompile's backward, run
  on a live runtime against the original;
* the rewrite of random-state wrappers around attention: the wrappers removed (and the graph's
  values unchanged) where attention's ``dropout_p`` is 0, kept for dropout and for other ops;
* the compiler wrapper both install, which rewrites only while inductor's C++ wrapper is on.

``tests/test_deepcompile_cpu.py`` compiles a checkpointed LoRA Llama with inductor's C++ wrapper
through both, and shows it failing without either.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch._prims import rng_prims

from ds_z3native.compat import deepcompile_inductor_calls as ic
from ds_z3native.compat import deepcompile_reduce_group as rg
from helpers.native_rt import live_runtime, opcheck_on_fresh_runtimes
from test_reduce_group import FROZEN, GRAPH, backward_graph, grads, prepare

ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def op() -> Any:
    return ic.typed_end_backward_op()


def calls(gm: torch.fx.GraphModule) -> List[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ------------------------------------------------------------------- ds_z3native::end_backward

SAMPLES: Dict[str, Callable[[], Tuple[Any, ...]]] = {
    "two": lambda: ([torch.empty(0), torch.empty(0)], GRAPH, False),
    "release": lambda: ([torch.empty(0)], GRAPH, True),
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_opcheck(sample: str) -> None:
    opcheck_on_fresh_runtimes(op(), lambda m: SAMPLES[sample](), prepare,
                              f"end_backward sample {sample!r}")


def test_the_op_has_a_meta_kernel_a_kernel_for_every_device_and_one_without_tensors() -> None:
    op()
    name = "ds_z3native::end_backward"
    # Undefined (no tensor to dispatch on: an empty list) registers the catch-all kernel.
    for key in ("Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), key
    assert str(op()._schema) == ("ds_z3native::end_backward(Tensor[] deps, int graph_id, "
                                 "bool release_reduce_buckets=True) -> ()")
    assert torch.Tag.cudagraph_unsafe in op().tags


@pytest.mark.parametrize("deps", [[], [None]], ids=["no_deps", "none"])
@pytest.mark.parametrize("bucket", [1 << 16, 20], ids=["one_bucket", "flushed_before"])
def test_leaves_the_grad_buffers_dc_end_backward_leaves(deps: List[Any], bucket: int) -> None:
    def run(end: Callable[[List[torch.Tensor]], None]) -> Dict[int, torch.Tensor]:
        with live_runtime(bucket_size=bucket) as m:
            buffers = prepare(m)
            g = grads(2)
            outs = [torch.ops.dc.reduce_grad(g[i], GRAPH, i) for i in (1, 2, 4)]
            end(outs)
            return {k: v.clone() for k, v in buffers.items() if k not in FROZEN}

    expected = run(lambda outs: torch.ops.dc.end_backward([*outs, *deps], GRAPH, False))
    got = run(lambda outs: op()(outs, GRAPH, False))
    assert set(got) == set(expected)
    for ds_id in expected:
        assert torch.equal(got[ds_id], expected[ds_id]), ds_id
    assert torch.equal(got[1], grads(2)[1].reshape(-1))  # reached the buffer: flushed
    with live_runtime(bucket_size=bucket) as m:  # and with no dependency at all
        buffers = prepare(m)
        torch.ops.dc.reduce_grad(grads(2)[1], GRAPH, 1)
        op()([], GRAPH, False)
        assert torch.equal(buffers[1], grads(2)[1].reshape(-1))


def test_refusals_name_the_op_the_graph_and_the_value() -> None:
    with live_runtime() as m:
        prepare(m)
        with pytest.raises(RuntimeError, match=r"end_backward \(meta\).*graph_id 3: deps\[1\] "
                                               r"is a meta tensor \(shape \[4\]\)"):
            op()([torch.empty(0), torch.empty(4, device="meta")], GRAPH, False)
    with pytest.raises(RuntimeError, match=r"ds_z3native end_backward: the runtime is not "
                                           r"initialized"):
        op()([torch.empty(0)], GRAPH, False)


# -------------------------------------------------------------------- the end_backward rewrite

def test_end_backward_becomes_the_typed_call_over_its_tensor_dependencies() -> None:
    gm = backward_graph([1, 2, 4])
    (end,) = [n for n in gm.graph.nodes if n.target == torch.ops.dc.end_backward.default]
    reduces = list(end.args[0])
    end.args = ([reduces[0], None, *reduces[1:]], *end.args[1:])  # DeepSpeed may pass None
    assert ic.type_end_backward(gm) == 1
    assert torch.ops.dc.end_backward.default not in calls(gm)
    (typed,) = [n for n in gm.graph.nodes if n.target == op()]
    assert typed.args == (reduces, GRAPH, False)
    assert ic.type_end_backward(gm) == 0  # nothing left to rewrite
    # A dependency that is neither a graph value nor None has no typed form: refused by name.
    bad = backward_graph([1])
    (end,) = [n for n in bad.graph.nodes if n.target == torch.ops.dc.end_backward.default]
    end.args = ([*end.args[0], 7], *end.args[1:])
    with pytest.raises(TypeError, match=r"end_backward of graph 3: dependencies other than "
                                        r"graph values or None: \[7\]"):
        ic.type_end_backward(bad)


@pytest.mark.parametrize("grouped", [False, True], ids=["per_gradient", "grouped"])
def test_the_rewritten_graph_leaves_the_grad_buffers_of_the_original(grouped: bool) -> None:
    ids = [4, 1, 5, 2]
    inputs = [grads(1)[ds_id] for ds_id in ids]

    def run(gm: torch.fx.GraphModule) -> Dict[int, torch.Tensor]:
        with live_runtime(bucket_size=20) as m:
            buffers = prepare(m)
            gm(*inputs)
            return {k: v.clone() for k, v in buffers.items() if k not in FROZEN}

    original = run(backward_graph(ids))
    gm = backward_graph(ids)
    if grouped:
        assert rg.group_reduce_grads(gm) == 3
    assert ic.type_end_backward(gm) == 1
    rewritten = run(gm)
    for ds_id in ids:
        assert torch.count_nonzero(original[ds_id]) > 0
        assert torch.equal(rewritten[ds_id], original[ds_id]), ds_id


# --------------------------------------------------------- attention's random-state wrappers

def attention_graph(dropout_p: float, wrapped: Any = ATTENTION) -> torch.fx.GraphModule:
    """The forward of a checkpointed attention as AOTAutograd leaves it on the CPU: the call
    inside ``run_and_save_rng_state``, the saved state and the output among the graph's
    outputs."""
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    args = (q, k, v, dropout_p, True) if wrapped is ATTENTION else (q, dropout_p, True)
    w = graph.call_function(rng_prims.run_and_save_rng_state, (wrapped, *args))
    state = graph.call_function(operator.getitem, (w, 0))
    result = graph.call_function(operator.getitem, (w, 1))
    out = graph.call_function(operator.getitem, (result, 0))
    graph.output((state, out))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def recompute_graph(dropout_p: float) -> torch.fx.GraphModule:
    """The backward's recompute of it: ``run_with_rng_state(state, op, ...)``."""
    graph = torch.fx.Graph()
    state, q, k, v = (graph.placeholder(name) for name in ("state", "q", "k", "v"))
    w = graph.call_function(rng_prims.run_with_rng_state, (state, ATTENTION, q, k, v, dropout_p, True))
    graph.output((graph.call_function(operator.getitem, (w, 0)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def qkv() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 4, generator=g) for _ in range(3)]


def test_dropout_free_attention_leaves_its_wrappers_and_computes_the_same() -> None:
    gm = attention_graph(0.0)
    expected = gm(*qkv())[1]
    before = ic.inductor_calls_stats()["attention_unwrapped"]
    assert ic.unwrap_attention_rng(gm) == 1
    assert calls(gm).count(ATTENTION) == 1 and rng_prims.run_and_save_rng_state not in calls(gm)
    state, out = gm(*qkv())
    assert state.numel() == 0  # the saved state nothing reads any more
    assert torch.equal(out, expected)
    assert ic.inductor_calls_stats()["attention_unwrapped"] == before + 1

    rec = recompute_graph(0.0)
    expected = rec(torch.get_rng_state(), *qkv())[0]
    assert ic.unwrap_attention_rng(rec) == 1
    assert calls(rec) == [ATTENTION, operator.getitem]
    assert torch.equal(rec(torch.empty(0, dtype=torch.uint8), *qkv())[0], expected)


def test_dropout_and_other_seeded_ops_keep_their_wrappers() -> None:
    kept = ic.inductor_calls_stats()["rng_wrappers_kept"]
    for gm in (attention_graph(0.1), recompute_graph(0.5),
               attention_graph(0.0, wrapped=torch.ops.aten.native_dropout.default)):
        before = [str(t) for t in calls(gm)]
        assert ic.unwrap_attention_rng(gm) == 0
        assert [str(t) for t in calls(gm)] == before
    assert ic.inductor_calls_stats()["rng_wrappers_kept"] == kept + 3
    # dropout_p given by keyword, or as a graph value (unknown at compile time)
    graph = torch.fx.Graph()
    q, k, v, p = (graph.placeholder(name) for name in ("q", "k", "v", "p"))
    for kwargs in ({"dropout_p": 0.2}, {}):
        args = (q, k, v) if kwargs else (q, k, v, p)
        graph.call_function(rng_prims.run_and_save_rng_state, (ATTENTION, *args), kwargs)
    graph.output(())
    assert ic.unwrap_attention_rng(torch.fx.GraphModule(torch.nn.Module(), graph)) == 0


def test_the_cuda_wrapper_is_unwrapped_too() -> None:
    # graphsafe_run_with_rng_state (CUDA) returns the op's outputs; its rng_state keyword is the
    # generator's state, a graph input. Built by hand: the op itself runs on CUDA only.
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    graph = torch.fx.Graph()
    q, k, v, st = (graph.placeholder(name) for name in ("q", "k", "v", "rng"))
    w = graph.call_function(rng_prims.graphsafe_run_with_rng_state, (flash, q, k, v, 0.0, True),
                            {"rng_state": st, "scale": 0.5})
    graph.output((graph.call_function(operator.getitem, (w, 0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert ic.unwrap_attention_rng(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.target == flash]
    assert call.args == (q, k, v, 0.0, True) and call.kwargs == {"scale": 0.5}
    assert rng_prims.graphsafe_run_with_rng_state not in calls(gm)


# ------------------------------------------------------------------------ the compiler wrapper

def test_the_compiler_wrappers_rewrite_only_for_the_cpp_wrapper() -> None:
    from torch._inductor import config

    seen: List[List[Any]] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> str:
        seen.append(calls(gm))
        return "compiled"

    typed = ic._rewriting(ic.type_end_backward, "retyped")(compiler)
    unwrapped = ic._rewriting(ic.unwrap_attention_rng, "unwrapped")(compiler)
    with config.patch(cpp_wrapper=False):
        assert not ic.cpp_wrapper_on()
        typed(backward_graph([1, 2]), [])
        assert torch.ops.dc.end_backward.default in seen[-1] and op() not in seen[-1]
        unwrapped(attention_graph(0.0), [])
        assert rng_prims.run_and_save_rng_state in seen[-1]
    with config.patch(cpp_wrapper=True):
        assert ic.cpp_wrapper_on()
        assert typed(backward_graph([1, 2]), []) == "compiled"
        assert op() in seen[-1] and torch.ops.dc.end_backward.default not in seen[-1]
        assert unwrapped(attention_graph(0.0), []) == "compiled"
        assert ATTENTION in seen[-1] and rng_prims.run_and_save_rng_state not in seen[-1]


def test_partitioning_for_the_cpp_wrapper_takes_the_state_as_a_tensor() -> None:
    # On CUDA AOTAutograd's default wraps recomputed seeded ops in graphsafe_run_with_rng_state,
    # whose generator input inductor requires to feed one such call: unwrapping would leave it
    # feeding none. With the C++ wrapper on, DeepSpeed's partitioner runs with that form off.
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    seen: List[Tuple[Any, ...]] = []

    def get_wrapped_partitioner(*args: Any, **kwargs: Any) -> Callable:  # DeepSpeed's factory
        def partition(joint: Any, inputs: Any, *, num_fwd_outputs: int) -> Tuple[Any, ...]:
            seen.append((args, joint, inputs, num_fwd_outputs,
                         functorch_config.graphsafe_rng_functionalization))
            return attention_graph(0.0), recompute_graph(0.0)

        return partition

    factory = ic._partitioning_without_graphsafe_rng(get_wrapped_partitioner)
    before = functorch_config.graphsafe_rng_functionalization
    graphs = {}
    for on in (False, True):
        with config.patch(cpp_wrapper=on):
            partition = factory(True, [(0, 1, torch.Size([2]))], "min_cut", 7, set())
            graphs[on] = partition("joint", ["x"], num_fwd_outputs=3)
    assert seen[0][:4] == ((True, [(0, 1, torch.Size([2]))], "min_cut", 7, set()), "joint", ["x"], 3)
    assert seen[0][4] is before and seen[1][4] is False
    assert functorch_config.graphsafe_rng_functionalization is before
    # The Python wrapper's graphs are DeepSpeed's; the C++ wrapper's have their attention calls
    # unwrapped in both graphs at once (below: why).
    assert rng_prims.run_and_save_rng_state in calls(graphs[False][0])
    assert rng_prims.run_with_rng_state in calls(graphs[False][1])
    for gm in graphs[True]:
        assert ATTENTION in calls(gm)
        assert not {rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state} & set(calls(gm))


def test_the_backward_runs_with_what_the_partitioned_forward_saved() -> None:
    # DeepSpeed profiles a backward graph with the tensors the compiled forward saved, before
    # inductor compiles that backward. A forward unwrapped alone (at its own compile) saves an
    # empty state, which the backward's run_with_rng_state cannot restore: the profile stopped
    # there ("RNG state is wrong size" on CUDA). Unwrapped together, they run.
    from torch._inductor import config

    def partition_and_run(partitioned: Callable) -> torch.Tensor:
        fw, bw = partitioned(lambda *a, **k: (attention_graph(0.0), recompute_graph(0.0)))(
            "joint", [], num_fwd_outputs=1)
        state, _ = fw(*qkv())
        return bw(state, *qkv())[0]

    expected = recompute_graph(0.0)(torch.get_rng_state(), *qkv())[0]

    def forward_alone(partition_fn: Callable) -> Callable:
        def partition(*a: Any, **k: Any) -> Tuple[Any, Any]:
            fw, bw = partition_fn(*a, **k)
            ic.unwrap_attention_rng(fw)
            return fw, bw

        return partition

    with pytest.raises(RuntimeError, match="RNG state"):
        partition_and_run(forward_alone)
    factory = ic._partitioning_without_graphsafe_rng(lambda partition_fn: partition_fn)
    with config.patch(cpp_wrapper=True):
        assert torch.equal(partition_and_run(factory), expected)


def _through_the_backend(partition_fn: Callable) -> Callable:
    import deepspeed.compile.backend as backend

    return backend.get_wrapped_partitioner(False, [], partition_fn, 901, set())


def _through_the_inductor_module(partition_fn: Callable) -> Callable:
    # DeepSpeed's inductor backend hands AOTAutograd this wrapper, which calls the factory by the
    # name the inductor module imported.
    import deepspeed.compile.inductor as inductor

    return inductor.wrap_partition_fn(False, partition_fn, [], [], 902, set())


@pytest.mark.deepspeed
@pytest.mark.parametrize("caller", [_through_the_backend, _through_the_inductor_module],
                         ids=["eager-backend", "inductor-backend"])
def test_deepspeeds_own_partitioner_calls_run_without_graphsafe_rng_for_the_cpp_wrapper(
        caller: Callable) -> None:
    # The patch must reach every module that calls DeepSpeed's partitioner factory, not only the
    # module that defines it: DeepSpeed's inductor backend partitions through
    # deepspeed.compile.inductor, which imported the factory by name.
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    seen: List[bool] = []
    graphs = (torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()),
              torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    for gm in graphs:
        gm.graph.output(())

    def partition_fn(joint: Any, inputs: Any, *, num_fwd_outputs: int) -> Tuple[Any, Any]:
        seen.append(functorch_config.graphsafe_rng_functionalization)
        return graphs

    before = functorch_config.graphsafe_rng_functionalization
    undo = ic.DEEPCOMPILE_ATTENTION_RNG.apply()
    try:
        for on in (False, True):
            with config.patch(cpp_wrapper=on):
                assert caller(partition_fn)("joint", [], num_fwd_outputs=1) == graphs
    finally:
        undo()
    assert seen == [before, False]
    # The undo hands DeepSpeed's call sites their own factory back.
    with config.patch(cpp_wrapper=True):
        caller(partition_fn)("joint", [], num_fwd_outputs=1)
    assert seen[-1] is before


@pytest.mark.deepspeed
def test_every_deepcompile_module_holding_the_partitioner_factory_gets_the_wrapper() -> None:
    # A module that imported the factory by name keeps the original unless it is rebound: the
    # patch must reach each one this DeepSpeed has, not a list that a later release outgrows.
    import importlib
    import pkgutil

    import deepspeed.compile as dc_package
    import deepspeed.compile.partitioner as partitioner

    original = partitioner.get_wrapped_partitioner
    holders = []
    for info in pkgutil.walk_packages(dc_package.__path__, "deepspeed.compile."):
        module = importlib.import_module(info.name)
        if getattr(module, "get_wrapped_partitioner", None) is original:
            holders.append(module)
    assert len(holders) >= 3, [m.__name__ for m in holders]
    undo = ic.DEEPCOMPILE_ATTENTION_RNG.apply()
    try:
        missed = [m.__name__ for m in holders if m.get_wrapped_partitioner is original]
        assert missed == [], f"modules still calling DeepSpeed's own factory: {missed}"
    finally:
        undo()
    assert all(m.get_wrapped_partitioner is original for m in holders)
