"""DeepCompile ZeRO-3 on the CPU (gloo, ds_z3native's CPU build): the eager-fallback gather, the
removal of transformers' checkpointing graph breaks, inductor's C++ wrapper, and the runners'
watchdog (the device-independent part of the GPU tests).

DeepCompile runs on the CPU accelerator of DeepSpeed >= 0.19.4 (its profiler falls back to default
estimates without CUDA events; 0.19.2's raises KeyError 'device_time'; see
``helpers.dc_runner.needs_cpu_deepcompile`` for 0.19.3), with ds_z3native's op.
Each training run is its own process (``bench/deepcompile_run.py``: dynamo caches, DeepSpeed's
hooks and the native runtime are process-wide), 7 steps: past DeepCompile's step-6 re-planning.
The warm start, the profile store and the kept-gathered groups are
``tests/test_deepcompile_cpu_warm_start.py``; other model families
``tests/test_deepcompile_cpu_families.py`` (separate files, so that pytest-xdist spreads them over
its workers). The GPU side (bf16, 20 steps, DeepSpeed 0.19.2 too, torch 2.11 where the failure was
seen) is tests/gpu/test_deepcompile_llama.py.
"""

from __future__ import annotations

import pytest
import torch

from ds_z3native.compat.hf_graph_breaks import is_kernels_routing
from helpers.dc_cpu import CPU_ENV, STEPS, assert_same_training, ok, run, run_once
from helpers.dc_runner import RUNNER, needs_cpu_deepcompile, run_together

# The watchdog tests and the checkpoint-mode helper test exercise our own harness and HF code,
# the same whatever the DeepSpeed release: not marked ``deepspeed`` (not rerun on 0.19.2).
pytestmark = pytest.mark.slow

_EAGER_FROZEN_REF = ("--model", "eager-frozen", "--mode", "eager", "--native", "deepspeed")


@pytest.mark.deepspeed
@needs_cpu_deepcompile
@pytest.mark.release_matrix
@pytest.mark.every_release
def test_frozen_layer_run_eagerly_is_gathered_and_trains_like_eager() -> None:
    # The frozen Linear runs outside Dynamo (torch._dynamo.disable): its weight must be gathered
    # for the forward and kept for the backward of the trainable layer before it.
    ours = ok(run("--model", "eager-frozen"))
    ref = ok(run_once(*_EAGER_FROZEN_REF))
    assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
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
    ours = ok(run("--model", "eager-frozen-flagged"))
    ref = ok(run_once(*_EAGER_FROZEN_REF))
    assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours["eager_gather"]["params"] == ["frozen.weight", "frozen.bias"]
    assert ours["eager_gather"]["held_after_training"] == []


@pytest.mark.deepspeed
@needs_cpu_deepcompile
def test_eager_gathers_survive_an_evaluation_forward_before_backward() -> None:
    # forward (grad) -> no-grad forward -> backward: the eagerly gathered frozen weight that the
    # first forward's graph saved must still be whole at its backward.
    ours = ok(run("--model", "eager-frozen", "--eval-between"))
    ref = ok(run("--model", "eager-frozen", "--eval-between", "--mode", "eager",
                 "--native", "deepspeed"))
    assert_same_training(ours, ref, rtol=1e-5, atol=1e-6)
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
    ours = ok(run(*common))
    ref = ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed"))
    assert_same_training(ours, ref, rtol=1e-4, atol=1e-5)
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
    ours = ok(run(*common, "--time-scheduler"))
    ref = ok(run(*common, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed"))
    loss_diff, param_diff = assert_same_training(ours, ref, rtol=1e-4, atol=1e-5)
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
        kept = ok(kept, steps=2)
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
    }, env=CPU_ENV)
    ours = ok(runs["cpp"])
    assert ours["inductor"] == {"cpp_wrapper": True}
    loss_diff, param_diff = assert_same_training(ours, ok(runs["reference"]), rtol=1e-4,
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
