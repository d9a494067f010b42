"""One small ZeRO-3 training run for the native-contract GPU tests, reported as JSON.

Run as a script (one run per process: Dynamo, the DeepCompile handle and the native runtime are
process-wide); :func:`run_together` starts several and collects their results.

Models (``--model``):

``inject``
    ``first`` (trainable) -> ``frozen`` -> ``mid`` (trainable) -> ``head`` (trainable). Input
    feature :data:`INJECT_FEATURE` is 0 in every batch but those of ``--inject-steps``, where
    every row holds :data:`INJECT_VALUE` there; ``first.weight``'s column for that feature starts
    at zero (so it gets no gradient and stays zero at the other steps, and the forward stays
    finite at the injected ones). At an injected step ``first.weight``'s gradient is
    ``dL/dh^T @ x``, whose column for that feature overflows to inf in fp16 under any loss scale
    above about 1; nothing else sees the value. ``first.weight``'s gradient is the last one
    backward produces (it needs the gradient through every layer above it), so it is reduced in
    the last bucket.
``noncontig``
    ``inp`` -> a permuted clone (dense, non-contiguous: strides (1, S*W, W) for a (W, B, S)
    tensor) -> ``bmm`` with the trainable ``mix`` -> ``frozen`` -> ``head``. For ``mix``'s
    gradient the backward needs the clone with its last two dims swapped, (W, S, B) with strides
    (1, W, S*W): what the forward saves, and activation offload moves, is a dense non-contiguous
    tensor in any orientation. (A permutation of the last two dims alone would not do: AOTAutograd
    saves the transposed clone, which is contiguous again.)

Per step the result records the loss, DeepSpeed's skipped-step counter and loss scale, whether
each trainable param's partition changed (bit for bit), the params whose reduced gradient
partition holds a non-finite value (read after the step: a skipped step leaves the partitions
as they were reduced), the native runtime's bucket flushes and, for fp16, whether the host
reached ZeRO-3's overflow check while the compute stream was still in the ``--sleep-cycles``
sleep queued before the backward (the reductions had not landed yet).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()

__all__ = ["INJECT_FEATURE", "INJECT_VALUE", "run_together", "main"]

WIDTH = 64
BATCH = 8
SEQ = 32  # noncontig: rows per sample
INJECT_FEATURE = 5
# The largest fp16 values are about 6.5e4: the input itself is finite, its product with any
# scaled output gradient above ~1 is not.
INJECT_VALUE = 6.0e4
TIMEOUT_S = 900
WATCHDOG_S = 600


def _steps_arg(text: str) -> List[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def build_model(kind: str) -> Any:
    import torch
    from torch import nn

    class Inject(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(WIDTH, WIDTH)
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.mid = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)
            with torch.no_grad():
                self.first.weight[:, INJECT_FEATURE] = 0.0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            h = torch.tanh(self.frozen(h))
            out = self.head(torch.tanh(self.mid(h)))
            return nn.functional.mse_loss(out.float(), y.float())

    class NonContig(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.mix = nn.Parameter(torch.randn(SEQ, SEQ) / SEQ ** 0.5)
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)                                   # (B, S, W)
            c = h.permute(2, 0, 1).clone()                    # (W, B, S), strides (1, S*W, W)
            z = torch.bmm(c, self.mix.unsqueeze(0).expand(WIDTH, SEQ, SEQ))
            z = torch.tanh(z).permute(1, 2, 0)                # (B, S, W)
            out = self.head(torch.relu(self.frozen(z)))
            return nn.functional.mse_loss(out.float(), y.float())

    return {"inject": Inject, "noncontig": NonContig}[kind]()


def batch(kind: str, step: int, seed: int, injected: bool, dtype: Any, device: Any) -> List[Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    if kind == "inject":
        x = torch.randn(BATCH, WIDTH, generator=g)
        x[:, INJECT_FEATURE] = INJECT_VALUE if injected else 0.0
        y = torch.randn(BATCH, 16, generator=g)
    else:
        x = torch.randn(BATCH // 2, SEQ, WIDTH, generator=g)
        y = torch.randn(BATCH // 2, SEQ, 16, generator=g)
    return [x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)]


def _launcher_env() -> None:
    from ds_z3native._net import free_port
    from ds_z3native.launch import rank_env

    port = os.environ.get("MASTER_PORT") or str(free_port())
    for key, value in rank_env(0, 1, int(port)).items():
        os.environ.setdefault(key, value)


class OverflowProbe:
    """Wraps ZeRO-3's ``has_overflow`` (outside whatever ``install()`` put there) to record, per
    call, whether the event recorded after the pre-backward sleep had not completed yet: the host
    launched the check before the backward's kernels, hence before its reductions, ran."""

    def __init__(self) -> None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

        self.late: Optional[Any] = None
        self.calls: List[bool] = []
        inner = Stage3.has_overflow
        probe = self

        def has_overflow(opt: Any, partition_gradients: bool = True) -> Any:
            probe.calls.append(probe.late is not None and not probe.late.query())
            return inner(opt, partition_gradients)

        Stage3.has_overflow = has_overflow

    def take(self) -> List[bool]:
        calls, self.calls = self.calls, []
        return calls


class OffloadRecord:
    """Records what DeepSpeed's activation-offload pass selected: each activation's shape,
    strides and whether it is contiguous."""

    def __init__(self) -> None:
        from deepspeed.compile.passes import offload_activation as module

        self.module = module
        self.selected: List[Dict[str, Any]] = []
        inner = module._eligible_activations
        record = self

        def eligible(*args: Any, **kwargs: Any) -> Any:
            chosen = inner(*args, **kwargs)
            for node, size, _resident in chosen:
                val = node.meta.get("val")
                record.selected.append({
                    "name": node.name, "bytes": int(size), "shape": list(val.shape),
                    "stride": list(val.stride()), "contiguous": bool(val.is_contiguous())})
            return chosen

        module._eligible_activations = eligible

    def stats(self) -> Dict[str, Any]:
        return {"selected": self.selected, "counts": self.module.get_offload_activation_stats()}


def _loss_scale(opt: Any) -> float:
    return float(getattr(opt, "loss_scale", 1.0))


def run(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    _launcher_env()
    if args.offload_activation:
        # DeepSpeed's own test hooks: consider activations of any size, and plan against a
        # budget of nothing, so that every eligible one stays on the host after the re-plan.
        os.environ["DS_DC_OFFLOAD_ACT_MIN_SIZE_MB"] = "0"
        os.environ["DS_DC_OFFLOAD_ACT_BUDGET_GB"] = "0"
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.deepcompile_run import cpu_deepspeed, skip_patches

    # The GPU tests run on CUDA; the CPU (DS_ACCELERATOR=cpu, no sleep) only checks the runner.
    cpu = not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu"
    if cpu:
        cpu_deepspeed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    result.update(deepspeed=deepspeed.__version__, torch=torch.__version__, steps=[],
                  device="cpu" if cpu else torch.cuda.get_device_name())
    native = None
    if args.native == "ours":
        import ds_z3native

        skip_patches(args.skip_patch)
        result["install"] = ds_z3native.install().__dict__
        native = ds_z3native.native()
    deepcompile = args.mode == "deepcompile"
    fp16, bf16 = args.dtype == "fp16", args.dtype == "bf16"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, torch.float32)
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        # One bucket per weight matrix: several buckets a backward, first.weight's the last.
        "zero_optimization": {"stage": 3, "reduce_bucket_size": WIDTH * WIDTH},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    if fp16:
        # Dynamic loss scaling; hysteresis 1: every overflow halves the scale.
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1,
                          "loss_scale_window": 1000}
    if deepcompile:
        config["compile"] = {"deepcompile": True, "offload_activation": args.offload_activation}
    probe = OverflowProbe() if fp16 else None
    offload = OffloadRecord() if args.offload_activation else None

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters()
                                                        if p.requires_grad])
    if deepcompile:
        engine.compile()
    opt = engine.optimizer
    partitions = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    device = engine.device
    result["init_params"] = _gathered(trainable)
    injected_steps = set(args.inject_steps)
    for step in range(args.steps):
        injected = step in injected_steps
        before = {n: p.ds_tensor.detach().clone() for n, p in trainable}
        scale_before = _loss_scale(opt)
        skipped_before = engine.skipped_steps
        flushes_before = native.comm_stats()["bucket_flushes"] if native is not None else 0
        x, y = batch(args.model, step, args.seed, injected, dtype, device)
        loss = engine(x, y)
        if args.sleep_cycles and not cpu:
            # The backward's kernels, and the reductions after them, queue behind this.
            torch.cuda._sleep(args.sleep_cycles)
            late = torch.cuda.Event()
            late.record()
            if probe is not None:
                probe.late = late
        engine.backward(loss)
        engine.step()
        get_accelerator().synchronize()
        if probe is not None:
            probe.late = None
        result["steps"].append({
            "step": step, "injected": injected, "loss": float(loss.float()),
            "skipped": engine.skipped_steps - skipped_before,
            "loss_scale_before": scale_before, "loss_scale_after": _loss_scale(opt),
            "moved": {n: not torch.equal(before[n], p.ds_tensor) for n, p in trainable},
            "nonfinite_grads": sorted(n for n, p in trainable
                                      if not torch.isfinite(partitions[p.ds_id]).all()),
            "bucket_flushes": (native.comm_stats()["bucket_flushes"] - flushes_before
                               if native is not None else None),
            "overflow_check_before_backward_ran": probe.take() if probe is not None else [],
        })
    result["skipped_steps"] = engine.skipped_steps
    if offload is not None:
        result["offload"] = offload.stats()
    result["params"] = _gathered(trainable)


def _gathered(params: List[Tuple[str, Any]]) -> Dict[str, List[float]]:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().float().cpu().flatten().tolist() for n, p in params}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["deepcompile", "eager"], default="deepcompile",
                        help="eager: ZeRO-3 without compile")
    parser.add_argument("--native", choices=["ours", "deepspeed"], default="ours",
                        help="ours: ds_z3native.install(); deepspeed: DeepSpeed alone")
    parser.add_argument("--model", choices=["inject", "noncontig"], default="inject")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--inject-steps", type=_steps_arg, default=[], metavar="I,J,...",
                        help="--model inject: the steps whose batches carry the huge feature")
    parser.add_argument("--sleep-cycles", type=int, default=0,
                        help="torch.cuda._sleep this many cycles on the compute stream before "
                             "each backward")
    parser.add_argument("--offload-activation", action="store_true",
                        help="DeepCompile's activation offload, every eligible activation kept "
                             "on the host")
    parser.add_argument("--skip-patch", action="append", default=[], metavar="NAME",
                        help="with ds_z3native: leave this compat patch out (repeatable)")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout)")
    parser.add_argument("--watchdog-s", type=float, default=None)
    args = parser.parse_args(argv)
    if args.watchdog_s:
        sys.path.insert(0, str(ROOT))
        from bench.deepcompile_run import arm_watchdog

        arm_watchdog(args.watchdog_s)
    result: Dict[str, Any] = {"args": vars(args)}
    try:
        run(args, result)
    except Exception as e:  # noqa: BLE001 - reported as data: the test asserts on it
        result.update(error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                      traceback=traceback.format_exc())
    text = json.dumps(result)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


def _start(name: str, args: Iterable[str], tmp: Path) -> Tuple[subprocess.Popen, Path]:
    from helpers.dc_runner import child_env

    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), *args, "--json", str(out), "--watchdog-s",
           str(WATCHDOG_S)]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                            cwd=ROOT), out


def run_together(runs: Mapping[str, Iterable[str]]) -> Dict[str, Dict[str, Any]]:
    """Start every ``name -> runner arguments`` at once (the compiles are CPU-bound and
    overlap), then collect them (``helpers.dc_runner.collect``: the result with ``log_tail``)."""
    from helpers.dc_runner import collect

    with tempfile.TemporaryDirectory() as tmp:
        started = {name: _start(name, args, Path(tmp)) for name, args in runs.items()}
        t0 = time.perf_counter()
        results = {name: collect(*p, timeout=TIMEOUT_S) for name, p in started.items()}
        print(f"\n[runs] {len(results)} runs together in {time.perf_counter() - t0:.0f} s")
        return results


if __name__ == "__main__":
    sys.exit(main())
