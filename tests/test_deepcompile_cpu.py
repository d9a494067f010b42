"""DeepCompile ZeRO-3 on the CPU (gloo, ds_z3native's CPU build): the eager-fallback gather and
the removal of transformers' checkpointing graph breaks (the device-independent part of the GPU
tests).

DeepCompile runs on the CPU accelerator of DeepSpeed >= 0.19.4 (its profiler falls back to default
estimates without CUDA events; 0.19.2's raises KeyError 'device_time'; see
``helpers.dc_runner.needs_cpu_deepcompile`` for 0.19.3), with ds_z3native's op.
Each training run is its own process (``bench/deepcompile_run.py``: dynamo caches, DeepSpeed's
hooks and the native runtime are process-wide), 7 steps: past DeepCompile's step-5 re-planning.
The GPU side (bf16, 20 steps, DeepSpeed 0.19.2 too, torch 2.11 where the failure was seen) is
tests/gpu/test_deepcompile_llama.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from ds_z3native.compat.hf_graph_breaks import is_kernels_routing
from ds_z3native.settings import PROFILE_STORE_ENV, WARM_START_ENV
from helpers.dc_runner import RUNNER, needs_cpu_deepcompile, run_alone, run_together
from helpers.old_transformers import old_transformers_env

# The watchdog tests and the checkpoint-mode helper test exercise our own harness and HF code,
# the same whatever the DeepSpeed release: not marked ``deepspeed`` (not rerun on 0.19.2).
pytestmark = pytest.mark.slow

STEPS = 7
_EAGER_FROZEN_REF = ("--model", "eager-frozen", "--mode", "eager", "--native", "deepspeed")
_runs: Dict[Tuple[str, ...], Dict[str, Any]] = {}



def run(*args: str, steps: int = STEPS) -> Dict[str, Any]:
    """One training run of the runner on the CPU; its JSON result."""
    return run_alone("cpu-run", args, steps, env={"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})


def run_once(*args: str) -> Dict[str, Any]:
    """``run(*args)``, once per test process: tests comparing with the same reference run share
    it (its result is only read)."""
    if args not in _runs:
        _runs[args] = run(*args)
    return _runs[args]


def _ok(result: Dict[str, Any], steps: int = STEPS) -> Dict[str, Any]:
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}\n{result['log_tail']}"
    assert len(result["losses"]) == len(result["step_s"]) == steps
    return result


def _assert_same_training(ours: Dict[str, Any], ref: Dict[str, Any], rtol: float,
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


@pytest.mark.deepspeed
@needs_cpu_deepcompile
@pytest.mark.release_matrix
def test_frozen_layer_run_eagerly_is_gathered_and_trains_like_eager() -> None:
    # The frozen Linear runs outside Dynamo (torch._dynamo.disable): its weight must be gathered
    # for the forward and kept for the backward of the trainable layer before it.
    ours = _ok(run("--model", "eager-frozen"))
    ref = _ok(run_once(*_EAGER_FROZEN_REF))
    _assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
    gather = ours["eager_gather"]
    assert gather["params"] == ["frozen.weight", "frozen.bias"]
    assert gather["gathered_total"] == 2 * STEPS  # gathered every step: released after backward
    assert gather["held_after_training"] == []
    # The run's record of its garbage collections: DeepCompile's passes collected fully (in
    # generation 2) at least once per compiled graph.
    collections = ours["gc_collections"]
    assert collections["count"][2] >= 2 and collections["total_s"] > 0
    # deepcompile-pass-gc: every run of the passes (each graph's, first compile and re-plan) ran
    # with the heap frozen.
    assert ours["pass_gc"]["frozen"] >= 2, ours["pass_gc"]


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_frozen_layer_run_eagerly_under_torchs_compiling_flag_is_gathered() -> None:
    # torch raises torch.compiler.is_compiling() for a whole compile session (backends
    # included), not only while Dynamo traces. Eager code running under it is still eager: a
    # getter that trusted the flag handed it the shape-[0] partition (DeepSpeed's own getter
    # returns early there too).
    ours = _ok(run("--model", "eager-frozen-flagged"))
    ref = _ok(run_once(*_EAGER_FROZEN_REF))
    _assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours["eager_gather"]["params"] == ["frozen.weight", "frozen.bias"]
    assert ours["eager_gather"]["held_after_training"] == []


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_eager_gathers_survive_an_evaluation_forward_before_backward() -> None:
    # forward (grad) -> no-grad forward -> backward: the eagerly gathered frozen weight that the
    # first forward's graph saved must still be whole at its backward.
    ours = _ok(run("--model", "eager-frozen", "--eval-between"))
    ref = _ok(run("--model", "eager-frozen", "--eval-between", "--mode", "eager",
                  "--native", "deepspeed"))
    _assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours["eager_gather"]["held_after_training"] == []


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_frozen_layer_run_eagerly_fails_without_the_gather() -> None:
    # The weak behaviour the patch replaces: the eager code reads the shape-[0] partition.
    weak = run("--model", "eager-frozen", "--skip-patch", "deepcompile-z3-eager-gather",
               "--no-deepspeed-fallback", steps=2)
    assert "error" in weak
    assert "mat2 must be a matrix, got 1-D tensor" in weak["error"], weak["error"]


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_trainable_param_read_eagerly_is_refused_by_name() -> None:
    result = run("--model", "eager-head", steps=2)
    assert result.get("error_type") == "EagerTrainableParam", result.get("error")
    assert "head.weight (ds_id" in result["error"] and "graph_breaks" in result["error"]
    assert result["losses"] == []  # refused in the first forward, before any step


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_hf_llama_lora_evaluates_between_steps_like_eager_zero3() -> None:
    # Without checkpointing (the trainer tests cover it with): model.eval() and two no-grad
    # forwards after steps 3 and 6, as Trainer's eval_strategy="steps" does. The no-grad graph
    # hands SDPA its mask by keyword; DeepSpeed's scheduler failed on it (KeyError 'where').
    common = ("--model", "llama", "--size", "tiny", "--eval-every", "3")
    ours = _ok(run(*common))
    ref = _ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed"))
    _assert_same_training(ours, ref, rtol=1e-4, atol=1e-5)
    assert len(ours["eval_losses"]) == 2
    torch.testing.assert_close(torch.tensor(ours["eval_losses"]), torch.tensor(ref["eval_losses"]),
                               rtol=1e-4, atol=1e-5)


def _llama_attention_is_routed() -> bool:
    """Whether this transformers wraps LlamaAttention.forward in that wrapper (5.25 does)."""
    from transformers.models.llama import modeling_llama

    return is_kernels_routing(modeling_llama.LlamaAttention.forward)


@pytest.mark.deepspeed
@needs_cpu_deepcompile
@pytest.mark.release_matrix
def test_hf_llama_lora_nonreentrant_checkpointing_trains_like_eager_zero3() -> None:
    common = ("--model", "llama", "--size", "tiny", "--checkpointing", "non-reentrant")
    ours = _ok(run(*common, "--time-scheduler"))
    ref = _ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed"))
    loss_diff, param_diff = _assert_same_training(ours, ref, rtol=1e-4, atol=1e-5)
    # DeepCompile's scheduler ordered each graph (forward and backward, at step 0 and at the
    # re-plan) with ds_z3native's requirement walk as DeepSpeed's own walk orders it (DeepSpeed's
    # made to follow keyword inputs too: without, it fails on graphs that have them).
    scheduled = ours["scheduler"]
    assert len(scheduled) == 4 and all(g["allgathers"] > 0 for g in scheduled), scheduled
    assert all(g.get("same_order") is True for g in scheduled), scheduled
    fixes = ours["graph_break_fixes"]
    assert fixes["removed_hooks"] == ["base_model.model.model.embed_tokens"]
    assert fixes["use_cache_off"]
    routed = _llama_attention_is_routed()
    assert len(fixes["kernel_routing_off"]) == (2 if routed else 0)  # the tiny model's 2 layers
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]
    # The same model with the hook, the use_cache warning and the kernels routing left in place.
    kept = run(*common, "--skip-patch", "deepcompile-hf-checkpoint-graph-breaks", steps=2)
    if routed:
        # The routing wrapper's context-variable write ends every checkpointed layer's graph:
        # the layers run eagerly and their LoRA params would lose their gradients.
        assert kept.get("error_type") == "EagerTrainableParam", kept
        assert "lora_A" in kept["error"]
    else:
        kept = _ok(kept, steps=2)
        assert kept["graph_breaks"] > 0
        assert any("requires_grad_" in r for r in kept["graph_break_reasons"])
    weak = kept.get("error_type") or f"{kept['graph_breaks']} graph breaks"
    print(f"without the patch: {weak}; "
          f"max |loss diff| {loss_diff:.2e}, max |LoRA param diff| {param_diff:.2e}")


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_inductors_cpp_wrapper_compiles_a_checkpointed_lora_llama_that_trains_like_eager_zero3(
) -> None:
    # inductor's C++ wrapper cannot call dc.end_backward(Any deps), nor torch's random-state
    # wrappers that AOTAutograd puts around recomputed attention; ds_z3native rewrites both
    # (compat.deepcompile_inductor_calls). Without either rewrite the compile fails.
    common = ("--model", "llama", "--size", "tiny", "--checkpointing", "non-reentrant")
    cpp = (*common, "--single-cycle", "--inductor", "cpp_wrapper=True")
    runs = run_together({
        "cpp": (cpp, STEPS),
        "reference": ((*common, "--mode", "eager", "--eager-stage", "3", "--native",
                       "deepspeed"), STEPS),
        "end_backward_any": ((*cpp, "--skip-patch", "deepcompile-typed-end-backward"), 1),
        "attention_wrapped": ((*cpp, "--skip-patch", "deepcompile-attention-rng"), 1),
    }, env={"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    ours = _ok(runs["cpp"])
    assert ours["inductor"] == {"cpp_wrapper": True}
    loss_diff, param_diff = _assert_same_training(ours, _ok(runs["reference"]), rtol=1e-4,
                                                  atol=1e-5)
    calls = ours["inductor_calls"]
    assert calls["end_backward_typed"] >= 1, calls
    assert calls["attention_unwrapped"] >= 4, calls  # 2 layers: each forward and its recompute
    assert "arg type Any is not yet supported" in runs["end_backward_any"].get("error", ""), \
        runs["end_backward_any"].get("error")
    assert "RunAndSaveRngState" in runs["attention_wrapped"].get("error", ""), \
        runs["attention_wrapped"].get("error")
    print(f"C++ wrapper: {calls}; max |loss diff| {loss_diff:.2e}, max |LoRA param diff| "
          f"{param_diff:.2e}")


# Two ranks of a LoRA Llama with non-reentrant checkpointing, the last step's op calls counted.
_LLAMA_KEPT = ["--model", "llama", "--size", "tiny", "--checkpointing", "non-reentrant",
               "--count-ops"]


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
    return root, _ok(runs["cold"])


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_params_kept_gathered_and_gradients_are_reached_by_one_call_per_group_and_train_the_same(
        llama_kept_gathered: Tuple[Path, Dict[str, Any]]) -> None:
    # Two ranks (gloo), a LoRA Llama with non-reentrant checkpointing, every param kept gathered
    # from the re-plan on (--persist-all stands in for DeepCompile's memory policy, which keeps
    # nothing on a CPU). Grouped: each re-planned graph reaches them with one gather_persistent
    # call, the trainable LoRA params re-gathered in it after every optimizer step, and the
    # backward graph hands its gradients to the reduction in one reduce_grads call. Ungrouped:
    # DeepSpeed's three dc op calls per use and one reduce_grad call per gradient. The last
    # step's op calls are counted. The grouped run is the fixture's (its empty profile store
    # changes nothing before the re-plan writes a manifest; the single-cycle test's two-cycle
    # run groups without a store).
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    argv = [*_LLAMA_KEPT, "--persist-all", "--no-group-persistent", "--no-group-reduce"]
    ungrouped = _ok(run_together({"ungrouped": (argv, STEPS)}, env=env,
                                 nprocs={"ungrouped": 2})["ungrouped"])
    grouped = llama_kept_gathered[1]
    _assert_same_training(grouped, ungrouped, rtol=1e-5, atol=1e-6)
    for rank in grouped["other_ranks"]:
        assert rank["losses"] == grouped["losses"]
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


def _cached_env(tmp_path: Path) -> Tuple[Path, Dict[str, str]]:
    """A profile store and the environment of CPU runs sharing it and an inductor cache."""
    store = tmp_path / "profiles"
    return store, {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
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
    return root, _ok(run_alone("cold", ["--model", "frozen-linear"], STEPS, env=env))


def _copy_caches(cold: Tuple[Path, Dict[str, Any]], tmp_path: Path
                 ) -> Tuple[Path, Dict[str, str], Dict[str, Any]]:
    """A module fixture's first run (its ``_cached_env`` folder, its result): the store and
    inductor cache it left, copied into ``tmp_path``; the store, the environment of runs
    sharing both, and the first run's result."""
    import shutil

    root, result = cold
    for name in ("profiles", "inductor"):
        shutil.copytree(root / name, tmp_path / name, symlinks=True)
    store, env = _cached_env(tmp_path)
    return store, env, result


@pytest.mark.deepspeed
@needs_cpu_deepcompile
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
    again = _ok(run_alone("again", ["--model", "frozen-linear"], STEPS,
                          env={**env, WARM_START_ENV: "0"}))
    warm = _ok(run_alone("warm", ["--model", "frozen-linear"], STEPS, env=env))
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


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_a_store_without_the_jobs_first_graph_compiles_and_re_plans_as_a_first_run(
        tmp_path: Path, frozen_linear_cold: Tuple[Path, Dict[str, Any]]) -> None:
    # The store holds another job's re-plan: the warm start is tried (a manifest is there) and
    # dropped at the first profile, whose graph has none; the run compiles its first cycle and
    # re-plans at step 6 as without a store, and its own manifest then lets the next run start
    # warm. The other job: the frozen-linear model's first run.
    store, env, _ = _copy_caches(frozen_linear_cold, tmp_path)
    first = _ok(run_alone("first", ["--model", "reuse3"], STEPS, env=env))
    second = _ok(run_alone("second", ["--model", "reuse3"], STEPS, env=env))
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


@pytest.mark.deepspeed
@needs_cpu_deepcompile
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
    store, env = _cached_env(tmp_path)
    args = ["--model", "frozen-linear", "--persist-all", "--count-ops"]

    def on_two_ranks(name: str, argv: List[str], environ: Dict[str, str]) -> Dict[str, Any]:
        result = _ok(run_together({name: (argv, STEPS)}, env=environ, nprocs={name: 2})[name])
        for rank in result["other_ranks"]:
            assert rank["losses"] == result["losses"]
        return result

    single = on_two_ranks("single", args + ["--single-cycle"], env)
    manifests = {p.name: json.loads(p.read_text()) for p in store.iterdir()}
    warm = on_two_ranks("warm", args, env)
    twice = on_two_ranks("twice", args, {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
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
    _assert_same_training(single, twice, rtol=1e-5, atol=1e-6)
    assert warm["warm_start"]["started"] == 1 and warm["warm_start"]["single_cycles"] == 0
    assert warm["compile_caches"] == {"fxgraph_cache_hit": 2}
    assert warm["op_calls_last_step"] == single["op_calls_last_step"]
    assert warm["losses"] == single["losses"]
    assert warm["params"] == single["params"]


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_a_warm_start_keeps_the_re_plans_params_gathered_in_one_call_per_graph(
        tmp_path: Path, llama_kept_gathered: Tuple[Path, Dict[str, Any]]) -> None:
    # Two ranks (gloo), a LoRA Llama with non-reentrant checkpointing. The first run (the
    # fixture's) keeps every param gathered (--persist-all stands in for DeepCompile's memory
    # policy, which keeps nothing on a CPU) and groups them at its re-plan; the second run is told
    # nothing of that and gets it from the store's manifest: from step 0 its graphs reach the
    # params with one gather_persistent call each, and it trains as the first.
    store, env, cold = _copy_caches(llama_kept_gathered, tmp_path)
    warm = _ok(run_together({"warm": (_LLAMA_KEPT, STEPS)}, env=env, nprocs={"warm": 2})["warm"])
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
    _assert_same_training(warm, cold, rtol=1e-5, atol=1e-6)
    for rank in warm["other_ranks"]:
        assert rank["losses"] == warm["losses"]


def test_reentrant_checkpointing_keeps_the_input_grad_hook() -> None:
    from ds_z3native.compat.hf_graph_breaks import checkpoint_modes, remove_checkpoint_graph_breaks
    from ds_z3native.models import MODEL_SIZES, build_lora_llama

    model, _ = build_lora_llama(MODEL_SIZES["tiny"])
    assert checkpoint_modes(model) == [] and remove_checkpoint_graph_breaks(model) == \
        {"removed_hooks": [], "use_cache_off": [], "kernel_routing_off": []}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    emb = model.get_input_embeddings()
    hooks = dict(emb._forward_hooks)
    assert set(checkpoint_modes(model)) == {"reentrant"}
    done = remove_checkpoint_graph_breaks(model)
    assert done["removed_hooks"] == [] and dict(emb._forward_hooks) == hooks
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert set(checkpoint_modes(model)) == {"non-reentrant"}
    # Each enable call registered a hook on the embedding; both go.
    assert set(remove_checkpoint_graph_breaks(model)["removed_hooks"]) == \
        {"base_model.model.model.embed_tokens"}
    assert not emb._forward_hooks


def test_attention_runs_without_the_kernels_routing_wrapper_when_nothing_was_kernelized() -> None:
    # transformers 5.25 puts the kernels package's per-instance routing wrapper on its attention
    # layers; it writes a context variable, which Dynamo cannot do inside a checkpointed region:
    # every checkpointed layer fell back to eager (EagerTrainableParam under DeepCompile).
    import torch

    from ds_z3native.compat.hf_graph_breaks import remove_checkpoint_graph_breaks
    from ds_z3native.models import MODEL_SIZES, build_lora_llama

    model, _ = build_lora_llama(MODEL_SIZES["tiny"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    attn = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "LlamaAttention"]
    wrapped = [n for n, m in attn if is_kernels_routing(type(m).forward)]
    print(f"\n[kernels routing] {len(wrapped)} of {len(attn)} attention layers wrapped")
    ids = torch.randint(0, 64, (1, 8))
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    done = remove_checkpoint_graph_breaks(model)
    assert done["kernel_routing_off"] == wrapped  # every wrapped attention layer, nothing else
    for name, module in attn:
        assert ("forward" in module.__dict__) == (name in wrapped)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # the routing changed nothing
    assert remove_checkpoint_graph_breaks(model)["kernel_routing_off"] == []  # once


def test_a_model_whose_class_names_no_loss_compiles_without_the_loss_warnings_graph_break() -> None:
    # GPT2LMHeadModel: transformers resolves no loss type from the class name, and its
    # loss_function property logs a warning_once on every forward, which Dynamo cannot trace
    # (a graph break inside PEFT's forward-hook context: the frame ran eagerly).
    import torch

    from ds_z3native.compat.hf_graph_breaks import settle_default_loss
    from ds_z3native.models import MODEL_SIZES, build_lora_model

    model, _ = build_lora_model(MODEL_SIZES["tiny"], "gpt2")
    head = model.get_base_model()
    assert head.loss_type is None
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count >= 1
    loss_function = head.loss_function
    assert settle_default_loss(model) == ["base_model.model: ForCausalLM"]
    assert head.loss_function is loss_function  # the same loss as before
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert torch.equal(model(input_ids=ids, labels=ids).loss, expected)
    assert settle_default_loss(model) == []  # once
    # A Llama's class names its loss (LlamaForCausalLM): nothing to settle; its base model
    # computes no loss.
    llama, _ = build_lora_model(MODEL_SIZES["tiny"], "llama")
    assert settle_default_loss(llama) == []


@pytest.mark.deepspeed
@needs_cpu_deepcompile
@pytest.mark.release_matrix
@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe"])
def test_other_decoder_families_train_like_eager_zero3(family: str) -> None:
    # LoRA with non-reentrant checkpointing and evaluations between steps on two more decoder
    # families: GPT-2 (Conv1D layers; GPT2LMHeadModel names no loss type, whose warning broke
    # every compiled forward) and Qwen3-MoE (a mixture-of-experts block, a ZeRO-3 leaf module by
    # DeepSpeed's default, with its router trained in full: ZeRO-3's backward hook on it broke
    # the graph at every layer, and the trainable params then ran eagerly).
    # 4 steps, an evaluation and a generation (engine.module.generate, outside the engine's
    # forward) after steps 2 and 4: the training and the evaluation graphs, and eager decoding
    # (DeepCompile's re-plan, at step 6, is the Llama tests' business).
    common = ("--model", "llama", "--family", family, "--size", "tiny",
              "--checkpointing", "non-reentrant", "--eval-every", "2", "--generate-every", "2")
    ours = _ok(run(*common, steps=4), steps=4)
    ref = _ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed",
                  steps=4), steps=4)
    _assert_same_training(ours, ref, rtol=1e-4, atol=1e-5, steps=4)
    assert len(ours["eval_losses"]) == 2
    assert len(ours["generated"]) == 2 and ours["generated"] == ref["generated"]
    assert ours["eager_gather"]["generations"] == 2
    assert ours["eager_gather"]["held_after_training"] == []
    torch.testing.assert_close(torch.tensor(ours["eval_losses"]), torch.tensor(ref["eval_losses"]),
                               rtol=1e-4, atol=1e-5)
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]
    trained_in_full = [n for n, rg in ours["requires_grad"].items() if rg and "lora_" not in n]
    if family == "gpt2":
        assert ours["graph_break_fixes"]["default_loss"] == ["base_model.model: ForCausalLM"]
        assert trained_in_full == []
    else:
        assert trained_in_full == [f"base_model.model.model.layers.{i}.mlp.gate.weight"
                                   for i in range(2)]
        assert ours["leaf_module_hooks"] == {"engines": 1, "hooks": 2}
        # Without the patch the leaf modules keep ZeRO-3's backward hooks.
        weak = run(*common, "--skip-patch", "deepcompile-z3-leaf-module-hooks", steps=1)
        assert weak.get("error_type") == "EagerTrainableParam", weak.get("error", weak.keys())


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_mixture_of_experts_on_transformers_5_17_trains_like_eager_zero3(tmp_path: Path) -> None:
    # transformers 5.17 runs Qwen3-MoE's experts under torch.compile with fp32 weights through
    # its grouped-matmul fallback op, whose backward (a Python loop over offs.tolist())
    # AOTAutograd could not trace: the first DeepCompile step failed with BackendCompilerFailed.
    # With hf-grouped-mm-fallback-backward that backward is ds_z3native's op (4 calls a step: two
    # layers, two grouped matmuls each) and the run trains like eager ZeRO-3 (which compiles
    # nothing) on the same transformers. One pair of runs (each DeepCompile run takes about a
    # minute on two cores); the failure without the patch is shown by
    # tests/test_compat_hf_moe_grouped_mm.py. A fresh inductor cache: AOTAutograd's cache key does
    # not cover a custom op's autograd formula.
    env = old_transformers_env({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
                                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    common = ("--model", "llama", "--family", "qwen3_moe", "--size", "tiny",
              "--checkpointing", "non-reentrant", "--eval-every", "2")
    runs = run_together({"ours": ((*common, "--count-ops"), 4),
                         "eager": ((*common, "--mode", "eager", "--eager-stage", "3",
                                    "--native", "deepspeed"), 4)}, env=env)
    ours, ref = _ok(runs["ours"], steps=4), _ok(runs["eager"], steps=4)
    assert "hf-grouped-mm-fallback-backward" in ours["install"]["patches"]
    assert not [u for u in ours["install"]["unverified"] if "hf-grouped-mm" in u], ours["install"]
    assert ours["op_calls_last_step"].get("ds_z3native::grouped_mm_fallback_backward") == 4, \
        ours["op_calls_last_step"]
    _assert_same_training(ours, ref, rtol=1e-4, atol=1e-5, steps=4)
    torch.testing.assert_close(torch.tensor(ours["eval_losses"]), torch.tensor(ref["eval_losses"]),
                               rtol=1e-4, atol=1e-5)
    assert len(ours["eval_losses"]) == 2
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]


@pytest.mark.deepspeed
@needs_cpu_deepcompile
@pytest.mark.release_matrix
def test_generate_through_the_engines_peft_model_fails_without_its_gather() -> None:
    # PEFT's generate() runs the wrapped model's own forward, which DeepCompile never compiled:
    # eagerly, outside the engine's forward, on partitioned params. With install() it gathers
    # them (the family tests above generate as eager ZeRO-3 does); without the patch:
    weak = run("--model", "llama", "--size", "tiny", "--checkpointing", "non-reentrant",
               "--generate-every", "1", "--skip-patch", "deepcompile-z3-eager-generate", steps=1)
    assert "'weight' must be 2-D" in weak.get("error", ""), weak.get("error", weak.keys())


@pytest.mark.deepspeed
def test_use_cache_turned_off_for_training_is_not_saved(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import ds_z3native
    from ds_z3native.compat.hf_graph_breaks import remove_checkpoint_graph_breaks
    from ds_z3native.models import MODEL_SIZES, build_lora_llama

    def saved_use_cache(name: str) -> bool:
        model, _ = build_lora_llama(MODEL_SIZES["tiny"])
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base = model.get_base_model()
        assert base.config.use_cache is True
        assert remove_checkpoint_graph_breaks(model)["use_cache_off"]
        assert base.config.use_cache is False  # what the training forwards see
        base.save_pretrained(tmp_path / name)
        assert base.config.use_cache is False
        saved = json.loads((tmp_path / name / "config.json").read_text())
        return saved.get("use_cache", True)

    assert saved_use_cache("weak") is False  # without install(): the training value is saved
    ds_z3native.install()
    try:
        assert saved_use_cache("ours") is True
    finally:
        ds_z3native.uninstall()


def _hang_under_watchdog(hang: str, timeout_text: str, setup: str = "") -> None:
    """Run ``hang`` (Python source) in a fresh interpreter with the runner's watchdog armed at
    1 s (after ``setup``): it must exit 1 with the dump's header ``timeout_text`` and a stack."""
    import subprocess
    import sys

    code = ("import ctypes, os, sys, time\n"
            f"sys.path.insert(0, {str(RUNNER.parent)!r})\n"
            "import deepcompile_run\n"
            f"{setup}deepcompile_run.arm_watchdog(1)\n"
            f"{hang}\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"Timeout ({timeout_text})!" in r.stderr, r.stderr
    assert "most recent call first" in r.stderr and 'File "<string>"' in r.stderr, r.stderr


def test_the_watchdog_dump_survives_a_redirected_stderr() -> None:
    # DeepSpeed's op builder sends fd 2 to a temporary file while it compiles a probe program; a
    # watchdog firing then (CI, under load) left an empty log. The dump goes to its own copy.
    _hang_under_watchdog("os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # as the op builder's probe does\n"
                         "time.sleep(30)", "0:00:01")


def test_a_hang_holding_the_gil_is_still_dumped() -> None:
    # The watchdog's Python thread needs the GIL; a hang in C code that never releases it is
    # dumped by faulthandler's timer, _GIL_BACKSTOP_S later.
    _hang_under_watchdog("ctypes.PyDLL(None).sleep(30)  # libc sleep() with the GIL held", "0:00:02",
                         setup="deepcompile_run._GIL_BACKSTOP_S = 1\n")


def test_a_hung_run_fails_with_its_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The runners' watchdog: a run past WATCHDOG_S prints every thread's stack and exits, and
    # the failure message carries the stack (a hang in CI is diagnosable from its output).
    from helpers import dc_runner

    # 30 s: long enough that even a loaded CI machine is in the training loop by then (at 2 s a
    # run can still be starting, its main thread caught without a Python frame).
    monkeypatch.setattr(dc_runner, "WATCHDOG_S", 30)
    # The dump is the main thread's stack first (the runner's training loop), taken under the GIL,
    # then the process exits with 1. faulthandler's timer, which reads running threads' frames,
    # crashed mid-dump in CI (rc -11, once before any frame): that is a failure here.
    with pytest.raises(AssertionError, match=r"(?s)runner died \(rc 1\):\n"
                                             r"Timeout \(0:00:30\)!\n"
                                             r"Thread 0x[0-9a-f]+ \(most recent call first\):\n"
                                             r'  File "[^\n]*", line \d+ in [^\n]+\n.*'
                                             r'deepcompile_run\.py", line \d+ in main\n'):
        run("--model", "frozen-linear", "--mode", "eager", steps=10**6)
