"""What the ops that hand out a gathered param return: memory aligned to 16 bytes and a storage of
its own, whatever the param's size and dtype, as inductor's generated code and torch's custom-op
contract assume of an op's outputs.

ZeRO-3 keeps a rank's partitions as views into one flat buffer, so on one rank (where the
gathered param is the shard's memory) a param of 13 bf16 elements starts 26 bytes after the one
before it. Inductor asserts the alignment of every fallback op's output
(``assert_alignment(buf, 16, 'torch.ops.dc.allgather_param.default')``), and AOT autograd checks,
at a compiled function's first call, that no output of a custom op shares a storage with an input
or another output (a warning today, an error with ``CI`` set and in later torch releases).
"""

from __future__ import annotations

from typing import Iterator, List

import pytest
import torch

from helpers.native_rt import live_runtime

SIZES = [10, 13, 33, 5, 1000]  # odd sizes: each shard of the flat buffer starts off 16 bytes
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GRAPH = 0


def placeholder() -> torch.Tensor:
    """A ZeRO-3 param as DeepCompile passes it: released, shape [0]."""
    return torch.empty(0)


@pytest.fixture(params=DTYPES, ids=str)
def flat_params(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """A one-rank runtime whose params are registered as ZeRO-3 registers them: shards that are
    consecutive views into one flat buffer (params 0..4, sizes SIZES, dtype of the param)."""
    dtype = request.param
    flat = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(0)).to(dtype)
    with live_runtime() as m:
        offset = 0
        shards: List[torch.Tensor] = []
        for ds_id, n in enumerate(SIZES):
            shard = flat.narrow(0, offset, n)
            m.register_z3_param(ds_id, [n], shard, torch.zeros(n), False)
            shards.append(shard)
            offset += n
        m.register_graph_z3(GRAPH, list(range(len(SIZES))))
        yield m, flat, shards


def test_the_layout_puts_shards_off_alignment(flat_params: tuple) -> None:
    """The layout above is the one that breaks inductor: without copies, these would be handed
    out unaligned (this is what the other tests stand on)."""
    _, _, shards = flat_params
    assert any(s.data_ptr() % 16 for s in shards)


def test_allgather_param_returns_aligned_memory_with_the_params_values(flat_params: tuple) -> None:
    m, _, shards = flat_params
    for ds_id, shard in enumerate(shards):
        out = torch.ops.dc.allgather_param(placeholder(), GRAPH, ds_id, None)
        assert out.data_ptr() % 16 == 0, (ds_id, out.dtype, out.data_ptr() % 16)
        assert torch.equal(out, shard)
        torch.ops.dc.release_param(out, GRAPH, ds_id, 1)
    # An aligned shard on one rank is still handed out without a copy (the first one is).
    assert torch.ops.dc.allgather_param(placeholder(), GRAPH, 0, None).data_ptr() == shards[0].data_ptr()


def test_no_output_of_allgather_param_shares_a_storage_with_the_flat_buffer(flat_params: tuple) -> None:
    _, flat, _ = flat_params
    outs = [torch.ops.dc.allgather_param(placeholder(), GRAPH, i, None) for i in range(len(SIZES))]
    storages = {o.untyped_storage()._cdata for o in outs}
    assert len(storages) == len(outs)
    assert flat.untyped_storage()._cdata not in storages


def test_gather_persistent_outputs_are_aligned_and_own_their_storage(flat_params: tuple) -> None:
    m, _, shards = flat_params
    ids = list(range(len(SIZES)))
    for ds_id in ids:
        m.set_persistent(ds_id)
    outs = torch.ops.ds_z3native.gather_persistent(GRAPH, [placeholder()] * len(ids), ids, [])
    assert [o.data_ptr() % 16 for o in outs] == [0] * len(ids)
    assert len({o.untyped_storage()._cdata for o in outs}) == len(ids)
    for out, shard in zip(outs, shards):
        assert torch.equal(out, shard)


def test_an_output_is_copied_where_it_would_overlap_an_input(flat_params: tuple) -> None:
    """A param input whose data still lies in the flat buffer (ZeRO-3's eager state at world size
    1) must not come back as the op's output: the op returns a copy instead."""
    m, flat, shards = flat_params
    m.set_persistent(0)
    aliasing_input = flat.narrow(0, 0, SIZES[0])  # the param's data over its own shard
    (out,) = torch.ops.ds_z3native.gather_persistent(GRAPH, [aliasing_input], [0], [])
    assert out.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert torch.equal(out, shards[0])
    single = torch.ops.dc.allgather_param(flat, GRAPH, 0, None)
    assert single.data_ptr() != shards[0].data_ptr() and torch.equal(single, shards[0])


@pytest.fixture
def aliasing_is_an_error() -> Iterator[None]:
    """torch's custom-op aliasing check raising, as it does with ``CI`` set (and will always)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(check_custom_op_aliasing=True, error_on_custom_op_aliasing=True):
        yield


def test_inductor_runs_a_graph_of_gathers_of_odd_sized_params(flat_params: tuple,
                                                               aliasing_is_an_error: None) -> None:
    """Inductor's generated code asserts each gathered param's alignment, and AOT autograd checks
    the ops' outputs for aliases at the first call: both pass, and the result is eager's."""
    m, _, shards = flat_params
    for ds_id in (3, 4):
        m.set_persistent(ds_id)

    def gathered_sum(p: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for ds_id in (0, 1, 2):  # (wait and release are inserted after AOT autograd's tracing)
            w = torch.ops.dc.allgather_param(p, GRAPH, ds_id, None)
            total = total + (w.float() * 2).sum()
        kept = torch.ops.ds_z3native.gather_persistent(GRAPH, [p, p], [3, 4], [])
        return total + sum((k.float() * 3).sum() for k in kept)

    torch._dynamo.reset()
    compiled = torch.compile(gathered_sum, backend="inductor", fullgraph=True)
    # The graph is the same text for every dtype (the params' dtypes come from the runtime, not
    # from the graph's inputs): inductor's caches would hand the first dtype's code to the next.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = compiled(placeholder())
    want = sum((s.float() * 2).sum() for s in shards[:3]) + sum((s.float() * 3).sum() for s in shards[3:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
