"""A seeded random campaign of op sequences (tests/helpers/native_campaign.py): no crash, every
refusal a clear error, and exact results after the errors. One rank in a fresh interpreter (a
crash is a failed test naming its seed, not a dead pytest), and two gloo ranks.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from helpers.dist import run_python, run_ranks

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SUBPROCESS_ENV = {"PYTHONPATH": os.pathsep.join(
    filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))}
SEEDS_ONE_RANK = range(0, 1200)
SEEDS_TWO_RANKS = range(50_000, 50_400)


def _assert_campaign(stats: Dict[str, Any], cases: int) -> None:
    assert stats["cases"] == cases
    assert not stats["unclear"], "\n".join(stats["unclear"][:20])
    assert not stats["mismatch"], "\n".join(stats["mismatch"][:20])
    # The campaign exercises both sides of every op family it draws.
    assert stats["checked"] >= 0.7 * cases
    for op in ("register_z3_param", "allgather_param", "prefetch_params_fused", "release_param",
               "reduce_grad", "end_backward", "set_param_frozen", "wait_allgather"):
        assert stats["ok"].get(op, 0) > 0 and stats["refused"].get(op, 0) > 0, op


def test_random_op_sequences_one_rank() -> None:
    proc = run_python(f'''
import json
from helpers.native_rt import local_group
from helpers.native_campaign import run_campaign
stats = run_campaign(local_group(), range({SEEDS_ONE_RANK.start}, {SEEDS_ONE_RANK.stop}),
                     on_case=lambda seed: print("CASE", seed, flush=True))
print(json.dumps(stats), flush=True)
''', timeout=300, env=SUBPROCESS_ENV)
    lines = proc.stdout.splitlines()
    started = [line for line in lines if line.startswith("CASE ")]
    assert proc.returncode == 0, (f"exit code {proc.returncode} in {started[-1:]} (reproduce with "
                                  f"run_campaign(local_group(), [seed]))\n{proc.stderr[-3000:]}")
    _assert_campaign(json.loads(lines[-1]), len(SEEDS_ONE_RANK))


def _campaign_rank(rank: int, world_size: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from helpers.native_campaign import run_campaign

    return run_campaign(dist.new_group(backend="gloo"), SEEDS_TWO_RANKS, rank, world_size)


def test_random_op_sequences_two_ranks() -> None:
    r0, r1 = run_ranks(_campaign_rank, 2, timeout=300)
    for stats in (r0, r1):
        _assert_campaign(stats, len(SEEDS_TWO_RANKS))
    assert r0["ok"] == r1["ok"] and r0["refused"] == r1["refused"]  # the same calls, both ranks
