"""Shared pieces of the DeepCompile-on-the-CPU tests (``tests/test_deepcompile_cpu*.py``): one
training run of ``bench/deepcompile_run.py`` on DeepSpeed's CPU accelerator, its result checked,
and two runs compared."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from helpers.dc_runner import run_alone

__all__ = ["CPU_ENV", "STEPS", "run", "run_once", "ok", "assert_same_training",
           "assert_same_on_every_rank"]

# 7 steps: past DeepCompile's step-6 re-planning.
STEPS = 7
CPU_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
_runs: Dict[Tuple[Any, ...], Dict[str, Any]] = {}


def run(*args: str, steps: int = STEPS) -> Dict[str, Any]:
    """One training run of the runner on the CPU; its JSON result."""
    return run_alone("cpu-run", args, steps, env=CPU_ENV)


def run_once(*args: str, steps: int = STEPS) -> Dict[str, Any]:
    """``run(*args, steps=steps)``, once per test process: tests comparing with the same
    reference run share it (its result is only read)."""
    key = (*args, steps)
    if key not in _runs:
        _runs[key] = run(*args, steps=steps)
    return _runs[key]


def ok(result: Dict[str, Any], steps: int = STEPS) -> Dict[str, Any]:
    """``result`` after checking that its run trained ``steps`` steps without an error (the
    failure message carries the run's error, traceback and log tail)."""
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}\n{result['log_tail']}"
    assert len(result["losses"]) == len(result["step_s"]) == steps
    return result


def assert_same_training(ours: Dict[str, Any], ref: Dict[str, Any], rtol: float,
                         atol: float, steps: int = STEPS) -> Tuple[float, float]:
    """Losses and params after training equal (fp32); returns the largest differences."""
    assert len(ours["losses"]) == len(ref["losses"]) == steps
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]),
                               rtol=rtol, atol=atol)
    assert ours["params"].keys() == ref["params"].keys()
    worst = 0.0
    for name, values in ref["params"].items():
        a, b = torch.tensor(ours["params"][name]), torch.tensor(values)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
        worst = max(worst, float((a - b).abs().max()))
    loss_diff = float((torch.tensor(ours["losses"]) - torch.tensor(ref["losses"])).abs().max())
    return loss_diff, worst


def assert_same_on_every_rank(ours: Dict[str, Any], ref: Dict[str, Any], rtol: float,
                              atol: float, steps: int = STEPS) -> Tuple[float, float]:
    """A multi-rank run trained as its reference of the same ranks: each rank's losses (each
    trained on batches of its own) and params after training equal the same rank's of
    ``ref`` (fp32); the ranks' losses differ (else a reduction that skipped its collective
    would pass) and their params agree. Returns the largest differences over the ranks."""
    ranks, ref_ranks = [ours, *ours["other_ranks"]], [ref, *ref["other_ranks"]]
    assert len(ranks) == len(ref_ranks) > 1, (len(ranks), len(ref_ranks))
    assert [r["rank"] for r in ranks] == [r["rank"] for r in ref_ranks] == list(range(len(ranks)))
    worst = (0.0, 0.0)
    for rank, (mine, theirs) in enumerate(zip(ranks, ref_ranks)):
        assert "error" not in mine, f"rank {rank}: {mine['error']}"
        diffs = assert_same_training(mine, theirs, rtol=rtol, atol=atol, steps=steps)
        worst = (max(worst[0], diffs[0]), max(worst[1], diffs[1]))
    assert len({tuple(r["losses"]) for r in ranks}) == len(ranks), "ranks trained on the same data"
    for r in ranks[1:]:
        assert r["params"] == ours["params"], f"rank {r['rank']}'s params differ from rank 0's"
    return worst
