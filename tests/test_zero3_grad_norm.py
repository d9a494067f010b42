"""``zero3-flat-grad-norm`` (``ds_z3native.compat.zero3_grad_norm``): ZeRO-3's optimizer step takes
each param group's gradient norm in one reduction over the span of the gradient buffer its
partitions cover.

On real ZeRO-3 engines (DeepSpeed on CPU, gloo, one and two ranks; two param groups, frozen params
beside trainable ones): the step takes one norm per group instead of one per param; the norm is
DeepSpeed's own to float64 rounding, also where it is inf or NaN (-1); partitions that are not
one span, another norm type and a tensor-parallel rank other than 0 take DeepSpeed's loop;
training with gradient clipping loses what it loses without the patch."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest

from helpers.dist import run_ranks
from helpers.env import without_autoload
from helpers.zero import install_without

_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}


# ---- the span itself ------------------------------------------------------------------------

def test_consecutive_views_of_one_buffer_are_one_span_over_their_storage() -> None:
    import torch

    from ds_z3native.compat.zero3_grad_norm import contiguous_span

    buf = torch.arange(20.0)
    parts = [buf.narrow(0, 2, 3), buf.narrow(0, 5, 4), buf.narrow(0, 9, 0), buf.narrow(0, 9, 6)]
    span = contiguous_span(parts)
    assert span is not None and span.data_ptr() == parts[0].data_ptr()
    assert torch.equal(span, buf[2:15])
    span[0] = -1.0  # a view: no copy
    assert buf[2] == -1.0
    assert torch.equal(contiguous_span([buf.view(4, 5)]), buf)


@pytest.mark.parametrize("case", ["gap", "order", "storages", "strided", "dtype", "empty",
                                  "not-a-tensor"])
def test_tensors_that_are_not_one_span_have_none(case: str) -> None:
    import torch

    from ds_z3native.compat.zero3_grad_norm import contiguous_span

    buf = torch.zeros(32)
    parts: List[Any] = {
        "gap": [buf.narrow(0, 0, 4), buf.narrow(0, 5, 4)],
        "order": [buf.narrow(0, 4, 4), buf.narrow(0, 0, 4)],
        "storages": [torch.zeros(4), torch.zeros(4)],
        "strided": [buf.view(4, 8)[:, :2], buf.narrow(0, 30, 2)],
        "dtype": [buf.narrow(0, 0, 4), buf.narrow(0, 4, 4).to(torch.float64)],
        "empty": [],
        "not-a-tensor": [buf.narrow(0, 0, 4), 4],
    }[case]
    assert contiguous_span(parts) is None


# ---- on ZeRO-3 engines ----------------------------------------------------------------------

def _engine(patched: bool, config: Dict[str, Any] = _CONFIG) -> Any:
    import deepspeed
    import torch

    import ds_z3native

    if patched:
        ds_z3native.install()
    else:
        install_without("zero3-flat-grad-norm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12),
                                torch.nn.ReLU(), torch.nn.Linear(12, 6), torch.nn.ReLU(),
                                torch.nn.Linear(6, 4))
    model[0].requires_grad_(False)
    model[4].weight.requires_grad_(False)
    groups = [{"params": [model[2].weight, model[2].bias, model[4].bias]},
              {"params": [model[6].weight, model[6].bias], "lr": 5e-3}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def _batch(rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=g)


class _NormCounter:
    """Counts the norms taken through torch's Python API while active (a function mode, which
    sees no collective: those run as they do without it)."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        norms = {torch.Tensor.norm, torch.norm, torch.linalg.vector_norm, torch.linalg.norm}
        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                if func in norms:
                    counter.calls += 1
                return func(*args, **(kwargs or {}))

        self.calls = 0
        self.mode = Mode()


def _norms_on_an_engine(rank: int, world_size: int) -> Dict[str, Any]:
    import torch

    from ds_z3native.compat.zero3_grad_norm import flat_norm_counts

    engine = _engine(patched=True)
    opt = engine.optimizer
    cls = type(opt)
    ours, theirs = cls.get_grad_norm_direct, cls.get_grad_norm_direct.__wrapped__
    out: Dict[str, Any] = {"wrapped": ours is not theirs, "groups": len(opt.fp16_groups),
                           "params": sum(len(g) for g in opt.fp16_groups)}

    loss = engine(_batch(rank, 0)).float().pow(2).mean()
    engine.backward(loss)
    grads = [opt.averaged_gradients[i] for i in range(len(opt.fp16_groups))]
    flat_norm_counts(reset=True)
    pairs = []
    for i, group in enumerate(opt.fp16_groups):
        pairs.append((float(ours(opt, grads[i], group)), float(theirs(opt, grads[i], group))))
    out["pairs"] = pairs
    out["counts"] = flat_norm_counts(reset=True)

    # Not one span: every partition copied apart (the loop's result, through DeepSpeed's loop).
    apart = [g.clone() for g in grads[0]]
    out["apart"] = (float(ours(opt, apart, opt.fp16_groups[0])),
                    float(theirs(opt, apart, opt.fp16_groups[0])))
    # Another norm type.
    out["inf"] = (float(ours(opt, grads[0], opt.fp16_groups[0], norm_type=math.inf)),
                  float(theirs(opt, grads[0], opt.fp16_groups[0], norm_type=math.inf)))
    # A tensor-parallel rank other than 0 counts only tensor-parallel params: DeepSpeed's loop.
    rank_before = opt.model_parallel_rank
    opt.model_parallel_rank = 1
    try:
        out["tp_rank"] = (float(ours(opt, grads[0], opt.fp16_groups[0])),
                          float(theirs(opt, grads[0], opt.fp16_groups[0])))
    finally:
        opt.model_parallel_rank = rank_before
    out["fallback_counts"] = flat_norm_counts(reset=True)

    # An inf or NaN gradient: -1, as DeepSpeed's.
    saved = grads[1][0].clone()
    grads[1][0].view(-1)[0] = float("nan") if rank == 0 else 1.0
    out["nan"] = (float(ours(opt, grads[1], opt.fp16_groups[1])),
                  float(theirs(opt, grads[1], opt.fp16_groups[1])))
    grads[1][0].copy_(saved)

    flat_norm_counts(reset=True)
    counter = _NormCounter()
    with counter.mode:
        engine.step()
    out["step_norms"] = counter.calls
    out["step_counts"] = flat_norm_counts(reset=True)
    return out


def _step_norms_unpatched(rank: int, world_size: int) -> int:
    engine = _engine(patched=False)
    loss = engine(_batch(rank, 0)).float().pow(2).mean()
    engine.backward(loss)
    counter = _NormCounter()
    with counter.mode:
        engine.step()
    return counter.calls


@pytest.fixture(scope="module")
def norms() -> List[Dict[str, Any]]:
    return run_ranks(_norms_on_an_engine, 2, timeout=300)


@pytest.mark.deepspeed
def test_each_group_norm_is_deepspeeds_own(norms: List[Dict[str, Any]]) -> None:
    for r in norms:
        assert r["wrapped"] and r["groups"] == 2
        assert len(r["pairs"]) == 2
        for ours, theirs in r["pairs"]:
            assert theirs > 0
            assert ours == pytest.approx(theirs, rel=1e-12)
        assert r["counts"] == {"flat": 2, "per_param": 0}


@pytest.mark.deepspeed
def test_the_step_takes_one_norm_per_group_not_one_per_param(norms: List[Dict[str, Any]]) -> None:
    unpatched = run_ranks(_step_norms_unpatched, 1, timeout=300)[0]
    for r in norms:
        assert r["step_counts"] == {"flat": 2, "per_param": 0}
        # DeepSpeed's loop: one norm per trainable param; ours: one per group (any other norm
        # of the step is taken on both sides).
        assert unpatched - r["step_norms"] == r["params"] - r["groups"], (unpatched, r)


@pytest.mark.deepspeed
def test_partitions_apart_another_norm_type_and_a_tensor_parallel_rank_take_deepspeeds_loop(
        norms: List[Dict[str, Any]]) -> None:
    for r in norms:
        for key in ("apart", "inf", "tp_rank"):
            ours, theirs = r[key]
            assert ours == theirs, (key, r[key])
        assert r["fallback_counts"] == {"flat": 0, "per_param": 3}


@pytest.mark.deepspeed
def test_an_inf_or_nan_gradient_on_any_rank_gives_minus_one(norms: List[Dict[str, Any]]) -> None:
    for r in norms:
        assert r["nan"] == (-1.0, -1.0)


def _clipped_training(rank: int, world_size: int, patched: bool) -> Dict[str, Any]:
    import torch

    engine = _engine(patched)
    losses, norms = [], []
    for step in range(5):
        loss = engine(_batch(rank, step)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        norms.append(float(engine.get_global_grad_norm()))
    params = {n: p.ds_tensor.detach().clone().tolist() for n, p in engine.module.named_parameters()
              if p.requires_grad}
    del torch
    return {"losses": losses, "norms": norms, "params": params}


@pytest.mark.deepspeed
@pytest.mark.release_matrix
@pytest.mark.slow
def test_training_with_clipping_loses_what_it_loses_without_the_patch() -> None:
    patched = run_ranks(_clipped_training, 2, True, timeout=300)
    unpatched = run_ranks(_clipped_training, 2, False, timeout=300)
    for p, u in zip(patched, unpatched):
        # Clipping is active (the norms exceed 0.05) and the losses fall.
        assert min(u["norms"]) > _CONFIG["gradient_clipping"] and p["losses"][-1] < p["losses"][0]
        assert p["norms"] == pytest.approx(u["norms"], rel=1e-9)
        assert p["losses"] == pytest.approx(u["losses"], rel=1e-6)
        for name, values in u["params"].items():
            assert p["params"][name] == pytest.approx(values, rel=1e-6, abs=1e-7), name


def test_a_long_span_is_handed_over_in_pieces_no_larger_than_the_largest_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed converts each gradient it is handed to the norm dtype (float64): the copy of one
    # piece stays no larger than that of the loop's largest partition.
    import types

    import torch

    from ds_z3native.compat import zero3_grad_norm

    monkeypatch.setattr(zero3_grad_norm, "MIN_PIECE", 4)
    handed: List[Any] = []

    def deepspeeds(self: Any, gradients: Any, params: Any, norm_type: Any = 2) -> Any:
        handed.append((list(gradients), list(params)))
        return torch.stack([g.double().norm() for g in gradients]).pow(2).sum().sqrt()

    flat = zero3_grad_norm._flat_norm(deepspeeds)
    buf = torch.randn(27)
    grads = [buf.narrow(0, 0, 3), buf.narrow(0, 3, 10), buf.narrow(0, 13, 4), buf.narrow(0, 17, 10)]
    params = [types.SimpleNamespace(name=str(i)) for i in range(4)]
    norm = flat(types.SimpleNamespace(model_parallel_rank=0), grads, params)
    ((pieces, owners),) = handed
    assert [p.numel() for p in pieces] == [10, 10, 7]
    assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in pieces)
    assert owners == [params[0]] * 3
    assert float(norm) == pytest.approx(float(buf.double().norm()), rel=1e-12)


# ---- the benchmark's A/B of the patch in one process ----------------------------------------

def _ab_run(tmp_path: Any, *argv: str) -> Dict[str, Any]:
    """``bench/deepcompile_run.py --ab-grad-norm`` on eager ZeRO-3 (any release), the tiny Llama
    LoRA on the CPU: its JSON result."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    env = without_autoload(DS_ACCELERATOR="cpu")
    r = subprocess.run([sys.executable, str(root / "bench" / "deepcompile_run.py"), "--mode",
                        "eager", "--eager-stage", "3", "--model", "llama", "--size", "tiny",
                        "--ab-grad-norm", *argv, "--json", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.deepspeed
def test_the_benchmarks_ab_alternates_the_patch_and_deepspeeds_loop_step_by_step(
        tmp_path: Any) -> None:
    # How the patch's effect is measured on a GPU: even steps through the patch, odd steps
    # through the function it wraps, every call timed, the first ones checked against the other.
    steps = 8
    result = _ab_run(tmp_path, "--steps", str(steps))
    assert "error" not in result, result.get("traceback")
    ab = result["grad_norm_ab"]
    # One norm call per step (one param group), each way on its own steps.
    assert ab["flat"]["calls"] == ab["per_param"]["calls"] == steps // 2
    assert ab["flat"]["calls_per_step"] == ab["per_param"]["calls_per_step"] == 1.0
    for way in ("flat", "per_param"):
        assert ab[way]["norm_call_ms_median"] > 0 and ab[way]["timed_steps"] == 1
    # The two ways agree where both were taken (the first calls), to float64 rounding.
    assert ab["checked_calls"] == 6 and ab["max_rel_diff_checked"] < 1e-12
    # The per-param steps really took DeepSpeed's loop: the patch saw its own steps (4) and the
    # checks of the first three per-param steps (3), never a step of DeepSpeed's loop.
    assert result["flat_grad_norm"] == {"flat": steps // 2 + 3, "per_param": 0}
    assert len(result["losses"]) == steps


@pytest.mark.deepspeed
def test_the_benchmarks_ab_refuses_to_run_without_the_patch(tmp_path: Any) -> None:
    result = _ab_run(tmp_path, "--steps", "2", "--skip-patch", "zero3-flat-grad-norm")
    assert "--ab-grad-norm" in result["error"] and "zero3-flat-grad-norm" in result["error"]
    assert result["losses"] == []
