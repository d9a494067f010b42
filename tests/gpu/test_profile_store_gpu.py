"""A second DeepCompile run of the same job, with ds_z3native's profile store, is compiled from
inductor's cache.

Without the store a second run on the GPU missed inductor's FX-graph cache on every graph:
DeepSpeed orders each graph's all-gathers by the device times it profiles and fuses prefetches
by a timed all-gather benchmark, noisy from run to run, so the graphs inductor receives come in
another order each run. With the store the second run replays the first run's profiles and
timings, schedules the same graphs and finds them all in the cache; it trains the same.

    python -m pytest -m gpu tests/gpu/test_profile_store_gpu.py -q -s
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest

from ds_z3native.settings import PROFILE_STORE_ENV
from helpers.dc_runner import run_alone

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

ARGS = ("--model", "llama", "--native", "ours", "--size", "small", "--dtype", "bf16", "--mode",
        "deepcompile")
STEPS = 8  # past DeepCompile's step-6 re-plan, whose graphs are profiled and cached too


def _ok(r: Dict[str, Any]) -> Dict[str, Any]:
    assert "error" not in r, f"{r['error']}\n{r.get('traceback', '')}\n{r['log_tail']}"
    assert len(r["losses"]) == STEPS
    return r


def test_a_second_run_replays_the_profiles_and_is_served_by_inductors_cache(tmp_path: Path) -> None:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           PROFILE_STORE_ENV: str(tmp_path / "profiles")}
    cold = _ok(run_alone("cold", ARGS, STEPS, env=env))
    warm = _ok(run_alone("warm", ARGS, STEPS, env=env))
    print(f"\n[profile store] cold {cold['profile_store']} {cold['compile_caches']}, compile to the end "
          f"of step 1 {cold['compile_to_first_step_end_s']:.1f} s, re-plan {cold['step_s'][5]:.1f} s; "
          f"warm {warm['profile_store']} {warm['compile_caches']}, "
          f"{warm['compile_to_first_step_end_s']:.1f} s, {warm['step_s'][5]:.1f} s")
    assert cold["profile_store"]["replayed"] == 0 and cold["profile_store"]["recorded"] > 0
    assert warm["profile_store"] == {"recorded": 0, "replayed": cold["profile_store"]["recorded"]}
    compiled = sum(cold["compile_caches"].values())
    assert compiled > 0 and cold["compile_cache_bypasses"] == []
    assert warm["compile_caches"] == {"fxgraph_cache_hit": compiled}
    assert warm["losses"] == cold["losses"]
    assert warm["params"] == cold["params"]
