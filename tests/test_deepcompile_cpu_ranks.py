"""DeepCompile on several ranks whose batches have different lengths at a step
(``deepcompile-ranks-compile-together``), as TRL's packing gives each rank its own length.

DeepCompile's compile runs collectives (its profiler reduces at every graph node), so a rank
meeting a new length compiled alone while the other ran its compiled graph: the collectives
mismatched and both ranks hung (seen with ``examples/sft_lora.py --trainer trl --packing`` on 2
CPU ranks). With the patch every rank compiles where any rank's guards fail, and they agree on
the dynamic dimensions, so they trace the same graph. A hang fails these tests at their timeout.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from helpers.dc_runner import needs_cpu_deepcompile
from helpers.dist import run_ranks
from helpers.rank_lengths_run import train

# Step 2: rank 0 sees its first length again (its graph fits), rank 1 a new one (it must
# compile); step 6 is DeepCompile's re-plan (compiled again from nothing, no vote); the
# evaluation forward compiles a no-grad graph, each rank at its own length.
LENGTHS = "12,12,9,20,14,14,23;17,9,9,11,26,14,15"
EVAL_LENGTHS = "10;21"
STEPS = 7


class _Projection(torch.nn.Module):
    # A module of this file: Dynamo does not start tracing in torch.nn's own modules.
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


def _per_node_reducing_ranks(rank: int, world_size: int, lengths: List[List[int]]
                             ) -> Dict[str, Any]:
    """A compiled module whose backend reduces once per graph node, as DeepCompile's profiler
    does, and a collective after each call; each rank calls it at its own lengths, with the vote
    and the agreement on."""
    import torch.distributed as dist

    from ds_z3native.compat.deepcompile_rank_sync import RankCompileSync

    nodes: List[int] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        for _ in gm.graph.nodes:
            dist.all_reduce(torch.ones(1))
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    model = _Projection()
    model.compile(backend=backend)
    sync = RankCompileSync(dist.new_group(backend="gloo"), world_size)
    sync.install()
    sync.watch(model)
    try:
        for n in lengths[rank]:
            model(torch.ones(2, n, 8)).sum()
            dist.all_reduce(torch.ones(4))  # as DeepCompile's graph gathers params when it runs
    finally:
        sync.uninstall()
    return {"nodes": nodes, "stats": sync.stats()}


@pytest.mark.slow
def test_ranks_compile_together_and_trace_the_same_graph() -> None:
    # Rank 0 meets a new length at step 3, rank 1 at step 2; after the first compile, every
    # compile happens on both ranks together, with the sequence dimension dynamic on both
    # (rank 0's own sizes had not changed when rank 1's forced the compile).
    lengths = [[5, 5, 7, 9, 5, 11], [6, 8, 8, 10, 12, 7]]
    r0, r1 = run_ranks(_per_node_reducing_ranks, 2, lengths, timeout=240)
    assert r0["nodes"] == r1["nodes"] and len(r0["nodes"]) == 2, (r0, r1)
    assert r0["stats"]["recompiles"] == r1["stats"]["recompiles"] == 1
    assert r0["stats"]["forced"] == 1 and r1["stats"]["forced"] == 0
    assert r0["stats"]["marked"] == {"[0][0]": [1]}
    assert r0["stats"]["votes"] == r1["stats"]["votes"] == len(lengths[0]) - 1


@needs_cpu_deepcompile
@pytest.mark.slow
@pytest.mark.deepspeed
def test_lengths_differing_between_ranks_train_like_zero0() -> None:
    """The tiny LoRA Llama under DeepCompile on 2 ranks, each with batches of its own lengths:
    every step and evaluation loss of each rank as at ZeRO-0 with the same batches."""
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    ours = run_ranks(train, 2, "deepcompile", LENGTHS, EVAL_LENGTHS, env=env, timeout=1200,
                     init_pg=False)
    ref = run_ranks(train, 2, "zero0", LENGTHS, EVAL_LENGTHS, env=env, timeout=600,
                    init_pg=False)
    for rank in range(2):
        a, b = ours[rank], ref[rank]
        assert len(a["losses"]) == len(b["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(a["losses"] + a["eval_losses"]),
                                   torch.tensor(b["losses"] + b["eval_losses"]),
                                   rtol=2e-5, atol=2e-6, msg=f"rank {rank}")
    # The case that hung: one rank's guards passed while the other's failed, and it compiled too.
    assert sum(r["rank_sync"]["forced"] for r in ours) >= 1
    assert ours[0]["rank_sync"]["recompiles"] == ours[1]["rank_sync"]["recompiles"] >= 2
    # First length, the symbolic one, the re-plan's, evaluation: not one graph per length.
    assert ours[0]["dynamo_graphs"] == ours[1]["dynamo_graphs"] <= 5


def test_a_torch_without_the_guard_hook_fails_compile_on_several_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_z3native.compat.deepcompile_rank_sync import guard_complete_hook_setter

    assert callable(guard_complete_hook_setter(2))  # this torch has it
    monkeypatch.delattr(torch.compiler, "set_enable_guard_collectives")
    with pytest.raises(RuntimeError, match=r"engine.compile\(\): DeepCompile on 4 ranks needs "
                                           r"Dynamo's guard-complete hook.*"
                                           + torch.__version__.replace("+", r"\+")):
        guard_complete_hook_setter(4)
