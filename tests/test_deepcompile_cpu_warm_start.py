"""DeepCompile ZeRO-3 on the CPU: what a run leaves for the next one and what it keeps gathered.
Inductor's FX-graph cache hit across runs (canonical graph ids), the profile store's manifests and
the warm start from them, a single compile cycle (``set_single_cycle``) and its regrouped forward,
and the params kept gathered reached by one call per graph with their gradients reduced by one
call, within a persistence budget (on two gloo ranks). Each rank of a two-rank run trains on
batches of its own, and the run is measured against DeepSpeed alone training the same ranks
eagerly (ZeRO-3 for the Llama, ZeRO-0 for the small model; one reference run each, shared).
Runs as in ``tests/test_deepcompile_cpu.py``; on a GPU: ``tests/gpu/test_profile_store_gpu.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from ds_z3native.settings import PERSISTENCE_BUDGET_ENV, PROFILE_STORE_ENV, WARM_START_ENV
from helpers.dc_cpu import CPU_ENV, STEPS, assert_same_on_every_rank, assert_same_training, ok
from helpers.dc_runner import cpu_deepcompile_mark, run_alone, run_together

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed, cpu_deepcompile_mark()]


# Two ranks of a LoRA Llama with non-reentrant checkpointing, the last step's op calls counted.
_LLAMA_KEPT = ["--model", "llama", "--size", "tiny", "--checkpointing", "non-reentrant",
               "--count-ops"]
# What the two-rank runs are measured against: the same ranks and batches (each rank its own)
# trained by DeepSpeed alone, eagerly (no ds_z3native, nothing compiled).
_UNPATCHED = ["--mode", "eager", "--native", "deepspeed"]


def _two_ranks(name: str, argv: List[str], env: Dict[str, str], steps: int = STEPS
               ) -> Dict[str, Any]:
    return ok(run_together({name: (argv, steps)}, env=env, nprocs={name: 2})[name], steps=steps)


@pytest.fixture(scope="module")
def llama_reference() -> Dict[str, Any]:
    """``_LLAMA_KEPT``'s model on two ranks under DeepSpeed's eager ZeRO-3 alone (about a
    sixth of a DeepCompile run's CPU time): the anchor of every two-rank Llama run here."""
    return _two_ranks("llama-reference", ["--model", "llama", "--size", "tiny", "--checkpointing",
                                          "non-reentrant", *_UNPATCHED, "--eager-stage", "3"],
                      CPU_ENV)


@pytest.fixture(scope="module")
def llama_kept_gathered(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[str, Any]]:
    """``_LLAMA_KEPT`` with every param kept gathered (``--persist-all``) and grouped, on two
    ranks, with a fresh profile store and inductor cache (``_cached_env``): that folder as the
    run left it, and the run's result. The grouping test compares it with an ungrouped run; the
    warm-start test starts a second run from a copy of its store (``_copy_caches``)."""
    root = tmp_path_factory.mktemp("llama-kept-gathered")
    _, env = _cached_env(root)
    runs = run_together({"cold": ([*_LLAMA_KEPT, "--persist-all"], STEPS)}, env=env,
                        nprocs={"cold": 2})
    return root, ok(runs["cold"])


# The persistence budget of the budget test's run: under half of the one-layer Llama's 1.3 MiB of
# params, so that DeepCompile's choice of every param (--persist-all) is partly declined.
_BUDGET_MIB = 0.5


@pytest.fixture(scope="module")
def llama_within_budget() -> Dict[str, Any]:
    """``_LLAMA_KEPT``'s model with one decoder layer on two ranks, every param chosen to be
    kept gathered, under a persistence budget of ``_BUDGET_MIB``. A single compile cycle
    (``--single-cycle``: the choice at the first step's last backward graph) and two steps: a
    quarter less CPU time than a two-cycle run to its re-plan."""
    argv = ["--model", "llama", "--size", "tiny", "--layers", "1", "--checkpointing",
            "non-reentrant", "--persist-all", "--single-cycle"]
    return _two_ranks("budget", argv, {**CPU_ENV, PERSISTENCE_BUDGET_ENV: str(_BUDGET_MIB)},
                      steps=2)


def test_params_kept_gathered_and_gradients_are_reached_by_one_call_per_group_and_train_the_same(
        llama_kept_gathered: Tuple[Path, Dict[str, Any]], llama_reference: Dict[str, Any]) -> None:
    # Two ranks (gloo), a LoRA Llama with non-reentrant checkpointing, every param kept gathered
    # from the re-plan on (--persist-all stands in for DeepCompile's memory policy, which keeps
    # nothing on a CPU). Grouped: each re-planned graph reaches them with one gather_persistent
    # call, the trainable LoRA params re-gathered in it after every optimizer step, and the
    # backward graph hands its gradients to the reduction in one reduce_grads call. Ungrouped:
    # DeepSpeed's three dc op calls per use and one reduce_grad call per gradient. The last
    # step's op calls are counted. The grouped run is the fixture's (its empty profile store
    # changes nothing before the re-plan writes a manifest; the single-cycle test's two-cycle
    # run groups without a store). Each rank trains on batches of its own, and both runs train
    # as DeepSpeed's eager ZeRO-3 does on the same ranks.
    argv = [*_LLAMA_KEPT, "--persist-all", "--no-group-persistent", "--no-group-reduce"]
    ungrouped = _two_ranks("ungrouped", argv, CPU_ENV)
    grouped = llama_kept_gathered[1]
    assert_same_training(grouped, ungrouped, rtol=1e-5, atol=1e-6)
    loss_diff, param_diff = assert_same_on_every_rank(grouped, llama_reference, rtol=1e-4,
                                                      atol=1e-5)
    assert_same_on_every_rank(ungrouped, llama_reference, rtol=1e-4, atol=1e-5)
    print(f"\n[persistent group] against eager ZeRO-3 on two ranks: max |loss diff| "
          f"{loss_diff:.2e}, max |LoRA param diff| {param_diff:.2e}")
    stats = grouped["persistent_group"]
    assert stats["early_choices"] == 1 and stats["graphs"] >= 2  # forward and backward
    calls, weak = grouped["op_calls_last_step"], ungrouped["op_calls_last_step"]
    print(f"\n[persistent group] {stats}; last step's op calls: grouped {calls}, "
          f"ungrouped {weak}")
    assert calls["ds_z3native::gather_persistent"] == stats["graphs"]
    for op in ("dc::allgather_param", "dc::wait_allgather", "dc::release_param"):
        assert op not in calls
        assert weak[op] >= stats["params"] // 2
    assert "ds_z3native::gather_persistent" not in weak
    assert ungrouped["persistent_group"]["early_choices"] == 0
    reduce = grouped["reduce_group"]
    assert "dc::reduce_grad" not in calls and weak["dc::reduce_grad"] > 1
    assert calls["ds_z3native::reduce_grads"] == 1 and "ds_z3native::reduce_grads" not in weak
    assert reduce["grads"] >= weak["dc::reduce_grad"]  # over every backward compile of the run
    assert ungrouped["reduce_group"]["graphs"] == 0
    # The optimizer steps took each gradient norm over the buffer DeepCompile's backward fills:
    # one span per step (one param group), never DeepSpeed's per-param loop.
    assert grouped["flat_grad_norm"] == {"flat": STEPS, "per_param": 0}


def test_params_kept_gathered_stay_within_the_persistence_budget(
        llama_kept_gathered: Tuple[Path, Dict[str, Any]],
        llama_within_budget: Dict[str, Any]) -> None:
    # The bytes a run holds gathered after training (each param's full padded copy; two ranks,
    # so each copy is memory of its own) against set_persistence_budget: DeepCompile chose every
    # param; within the budget only those that fit stay gathered (the others are gathered at
    # each use), the runtime's own record says the same, and without a budget all of them do.
    budget = int(_BUDGET_MIB * 2**20)
    for rank, r in enumerate([llama_within_budget, *llama_within_budget["other_ranks"]]):
        held, info = r["gathered_at_end"], r["gathered_at_end"]["persistence"]
        print(f"\n[persistence budget] rank {rank}: {held['params']} params, {held['bytes']} "
              f"bytes held gathered; {info}")
        assert info["budget_bytes"] == budget
        assert 0 < held["bytes"] <= budget
        assert held["bytes"] == info["selected_bytes"] and held["params"] == info["selected"]
        assert info["declined"] > 0
        # The params that fit are reached by gather_persistent, the others per use.
        assert r["persistent_group"]["params"] > 0 and r["persistent_group"]["graphs"] >= 2
    unbounded = llama_kept_gathered[1]["gathered_at_end"]
    assert unbounded["persistence"]["budget_bytes"] is None
    assert unbounded["persistence"]["declined"] == 0
    assert unbounded["bytes"] == unbounded["persistence"]["selected_bytes"] > 2 * budget


def _cached_env(tmp_path: Path) -> Tuple[Path, Dict[str, str]]:
    """A profile store and the environment of CPU runs sharing it and an inductor cache."""
    store = tmp_path / "profiles"
    return store, {**CPU_ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                   PROFILE_STORE_ENV: str(store)}


def _manifests(store: Path) -> List[str]:
    return sorted(p.name.split("-")[0] + " " + p.name.split(".")[-2] for p in store.iterdir())


@pytest.fixture(scope="module")
def frozen_linear_cold(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[str, Any]]:
    """A first run of the frozen-linear model with a fresh profile store and inductor cache
    (``_cached_env``): that folder as the run left it, and the run's result. Each test that
    goes on from there copies the folder (``_copy_caches``): a cold compile costs a minute on a
    loaded CI machine, and its result is only read."""
    root = tmp_path_factory.mktemp("frozen-linear-cold")
    _, env = _cached_env(root)
    return root, ok(run_alone("cold", ["--model", "frozen-linear"], STEPS, env=env))


def _copy_caches(cold: Tuple[Path, Dict[str, Any]], tmp_path: Path
                 ) -> Tuple[Path, Dict[str, str], Dict[str, Any]]:
    """A module fixture's first run (its ``_cached_env`` folder, its result): the store and
    inductor cache it left, copied into ``tmp_path``; the store, the environment of runs
    sharing both, and the first run's result."""
    root, result = cold
    for name in ("profiles", "inductor"):
        shutil.copytree(root / name, tmp_path / name, symlinks=True)
    store, env = _cached_env(tmp_path)
    return store, env, result


def test_a_second_run_is_compiled_from_the_fx_graph_cache_and_starts_warm(
        tmp_path: Path, frozen_linear_cold: Tuple[Path, Dict[str, Any]]) -> None:
    # DeepSpeed bakes id(gm.graph), a memory address, into every dc call of a graph, so
    # inductor's FX-graph cache missed on every graph, every run. With canonical graph ids the
    # step-6 re-plan, whose graphs the CPU leaves unchanged (DeepCompile's profile-driven passes
    # skip without CUDA timings), is served from the cache within the first run, and a second run
    # with the same cache directory compiles nothing; all train the same.
    # A profile store keeps only complete profiles; the CPU's have no CUDA timings (DeepSpeed
    # marks them incomplete), so no profile is recorded or replayed here (the GPU side:
    # tests/gpu/test_profile_store_gpu.py). The store still gets the re-plan's manifest, and a
    # warm start compiles the re-plan's two graphs at step 0 and no first cycle.
    store, env, cold = _copy_caches(frozen_linear_cold, tmp_path)  # the first run, cold
    listed = _manifests(store)
    again = ok(run_alone("again", ["--model", "frozen-linear"], STEPS,
                         env={**env, WARM_START_ENV: "0"}))
    warm = ok(run_alone("warm", ["--model", "frozen-linear"], STEPS, env=env))
    print(f"\n[fx-graph cache] cold {cold['compile_caches']}, without warm start "
          f"{again['compile_caches']}, warm {warm['compile_caches']}; compile to the end of "
          f"step 1: "
          f"cold {cold['compile_to_first_step_end_s']:.1f} s, warm "
          f"{warm['compile_to_first_step_end_s']:.1f} s; step 6: cold {cold['step_s'][5]:.1f} s, "
          f"warm {warm['step_s'][5]:.1f} s; warm start {warm['warm_start']}")
    assert cold["compile_caches"] == {"fxgraph_cache_miss": 2, "fxgraph_cache_hit": 2}  # fw, bw
    assert again["compile_caches"] == {"fxgraph_cache_hit": 4}
    assert warm["compile_caches"] == {"fxgraph_cache_hit": 2}  # the re-plan's graphs only
    for r in (cold, again, warm):
        assert r["compile_cache_bypasses"] == []
        assert r["profile_store"] == {"recorded": 0, "replayed": 0}
    assert listed == ["warm rank0"]  # the manifest alone, written after the re-plan
    assert cold["warm_start"] == {"started": 0, "fell_back": 0, "manifests_written": 1,
                                  "profiles_measured": 0, "single_cycles": 0}
    assert again["warm_start"] == {"started": 0, "fell_back": 0, "manifests_written": 0,
                                   "profiles_measured": 0, "single_cycles": 0}
    assert warm["warm_start"]["started"] == 1 and warm["warm_start"]["fell_back"] == 0
    assert _manifests(store) == listed
    for r in (again, warm):
        assert r["losses"] == cold["losses"]
        assert r["params"] == cold["params"]


def test_a_store_without_the_jobs_first_graph_compiles_and_re_plans_as_a_first_run(
        tmp_path: Path, frozen_linear_cold: Tuple[Path, Dict[str, Any]]) -> None:
    # The store holds another job's re-plan: the warm start is tried (a manifest is there) and
    # dropped at the first profile, whose graph has none; the run compiles its first cycle and
    # re-plans at step 6 as without a store, and its own manifest then lets the next run start
    # warm. The other job: the frozen-linear model's first run.
    store, env, _ = _copy_caches(frozen_linear_cold, tmp_path)
    first = ok(run_alone("first", ["--model", "reuse3"], STEPS, env=env))
    second = ok(run_alone("second", ["--model", "reuse3"], STEPS, env=env))
    print(f"\n[warm start] first {first['warm_start']} {first['compile_caches']}, second "
          f"{second['warm_start']} {second['compile_caches']}")
    assert first["warm_start"] == {"started": 0, "fell_back": 1, "manifests_written": 1,
                                   "profiles_measured": 0, "single_cycles": 0}
    assert first["compile_caches"] == {"fxgraph_cache_miss": 2, "fxgraph_cache_hit": 2}
    assert second["warm_start"]["started"] == 1
    assert second["compile_caches"] == {"fxgraph_cache_hit": 2}
    assert _manifests(store) == ["warm rank0", "warm rank0"]
    assert second["losses"] == first["losses"]
    assert second["params"] == first["params"]


def test_a_single_cycle_compiles_each_graph_once_and_a_later_run_starts_warm_from_it(
        tmp_path: Path) -> None:
    # Two ranks (gloo). set_single_cycle(True): the first step compiles the re-plan's passes,
    # DeepSpeed's selective_gather runs at its last backward graph (--persist-all: it keeps
    # every param gathered; the ranks agree that the optimizer's states fit first) and no
    # re-plan follows: one compile per graph where DeepSpeed's schedule takes two, and one more
    # inductor compile of the forward graph, compiled before the choice, with the params kept
    # gathered grouped (deepcompile-single-cycle-regroup): its steps make the dc op calls of the
    # two-cycle run's. It trains as the two-cycle run, and its manifests (every param chosen
    # before the regrouped forward) let the next run start warm, from inductor's cache, with
    # those graphs, training the same.
    # All train as DeepSpeed's ZeRO-0 does, eagerly on the same two ranks, each rank its own
    # batches.
    store, env = _cached_env(tmp_path)
    args = ["--model", "frozen-linear", "--persist-all", "--count-ops"]
    single = _two_ranks("single", args + ["--single-cycle"], env)
    manifests = {p.name: json.loads(p.read_text()) for p in store.iterdir()}
    warm = _two_ranks("warm", args, env)
    twice = _two_ranks("twice", args, CPU_ENV)
    reference = _two_ranks("reference", ["--model", "frozen-linear", *_UNPATCHED], CPU_ENV)
    for run in (single, twice, warm):
        assert_same_on_every_rank(run, reference, rtol=1e-5, atol=1e-6)
    print(f"\n[single cycle] {single['warm_start']} {single['compile_caches']}; two cycles "
          f"{twice['compile_caches']}; warm {warm['warm_start']} {warm['compile_caches']}; "
          f"manifest {manifests}")
    assert single["warm_start"] == {"started": 0, "fell_back": 0, "manifests_written": 1,
                                    "profiles_measured": 0, "single_cycles": 1}
    # fw, bw once each, and the forward again with its persistent params grouped
    assert single["compile_caches"] == {"fxgraph_cache_miss": 3}
    assert single["single_cycle_regroup"]["regrouped"] == 1
    assert single["single_cycle_regroup"]["declined"] == 0
    assert single["single_cycle_regroup"]["strides_checked"] == 1
    assert sum(twice["compile_caches"].values()) == 4  # DeepSpeed's schedule: twice each
    assert twice["warm_start"]["single_cycles"] == 0
    # Without the regroup the forward keeps an allgather/wait/release per param per step.
    assert single["op_calls_last_step"] == twice["op_calls_last_step"]
    assert not any(op.startswith(("dc::allgather", "dc::wait", "dc::release"))
                   for op in single["op_calls_last_step"]), single["op_calls_last_step"]
    assert sorted(name.split(".")[-2] for name in manifests) == ["rank0", "rank1"]
    for manifest in manifests.values():
        assert len(manifest["early"]) >= 2 and manifest["added"] == []  # frozen and trained
    assert_same_training(single, twice, rtol=1e-5, atol=1e-6)
    assert warm["warm_start"]["started"] == 1 and warm["warm_start"]["single_cycles"] == 0
    assert warm["compile_caches"] == {"fxgraph_cache_hit": 2}
    assert warm["op_calls_last_step"] == single["op_calls_last_step"]
    assert warm["losses"] == single["losses"]
    assert warm["params"] == single["params"]


def test_a_warm_start_keeps_the_re_plans_params_gathered_in_one_call_per_graph(
        tmp_path: Path, llama_kept_gathered: Tuple[Path, Dict[str, Any]],
        llama_reference: Dict[str, Any]) -> None:
    # Two ranks (gloo), a LoRA Llama with non-reentrant checkpointing. The first run (the
    # fixture's) keeps every param gathered (--persist-all stands in for DeepCompile's memory
    # policy, which keeps nothing on a CPU) and groups them at its re-plan; the second run is told
    # nothing of that and gets it from the store's manifest: from step 0 its graphs reach the
    # params with one gather_persistent call each, and it trains as the first, and as
    # DeepSpeed's eager ZeRO-3 on the same ranks.
    store, env, cold = _copy_caches(llama_kept_gathered, tmp_path)
    warm = _two_ranks("warm", _LLAMA_KEPT, env)
    print(f"\n[warm start] cold {cold['persistent_group']} {cold['compile_caches']}; warm "
          f"{warm['warm_start']} {warm['persistent_group']} {warm['compile_caches']}; last step's "
          f"op calls: warm {warm['op_calls_last_step']}")
    assert _manifests(store) == ["warm rank0", "warm rank1"]
    assert warm["warm_start"]["started"] == 1
    assert warm["persistent_group"]["early_choices"] == 0  # nothing chosen: the store said it
    assert warm["persistent_group"]["graphs"] == cold["persistent_group"]["graphs"]
    assert warm["persistent_group"]["params"] == cold["persistent_group"]["params"] > 0
    calls = warm["op_calls_last_step"]
    assert calls == cold["op_calls_last_step"]
    assert calls["ds_z3native::gather_persistent"] == warm["persistent_group"]["graphs"]
    assert "dc::allgather_param" not in calls
    # The re-plan's two graphs, no first cycle, both served by inductor's cache: the backward
    # takes the CPU's random state, whose symbol torch named after the number of fake tensors
    # alive (patch deepcompile-sourceless-symbols; without it the backward missed).
    assert sum(warm["compile_caches"].values()) * 2 == sum(cold["compile_caches"].values())
    assert warm["compile_caches"] == {"fxgraph_cache_hit": sum(warm["compile_caches"].values())}
    assert_same_training(warm, cold, rtol=1e-5, atol=1e-6)
    assert_same_on_every_rank(warm, llama_reference, rtol=1e-4, atol=1e-5)
