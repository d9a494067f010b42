"""One DeepSpeed training run of a small model with frozen params, reported as JSON.

Used by tests/gpu/test_deepcompile_train.py (one run per process: dynamo, the DeepCompile handle
and the native runtime are process-wide), and by hand for the closing note's timing:

    # ds_z3native's op (install()): time from engine.compile() to the end of the first step
    python bench/deepcompile_run.py --mode deepcompile --native ours
    # DeepSpeed's own op, JIT-built into a fresh extension cache (no install())
    python bench/deepcompile_run.py --mode deepcompile --native deepspeed --fresh-extension-cache

Models (``--model``): ``seed``, a frozen Linear feeding a trainable one; ``reuse3``, one frozen
Linear applied three times between trainable layers. ``--mode eager`` trains the same model with
ZeRO stage 0 and no compile (the reference). One process, one GPU; sets the launcher
environment (RANK=0, WORLD_SIZE=1, MASTER_ADDR, a free MASTER_PORT) unless already set.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

WIDTH = 64
BATCH = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env() -> None:
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def build_model(kind: str) -> Any:
    import torch
    from torch import nn

    class Seed(nn.Module):
        """A frozen Linear feeding a trainable one."""

        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = self.head(torch.relu(self.frozen(x)))
            return nn.functional.mse_loss(out.float(), y.float())

    class Reuse3(nn.Module):
        """One frozen Linear used three times in forward."""

        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.mid1 = nn.Linear(WIDTH, WIDTH)
            self.mid2 = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.mid1(self.frozen(x)))
            h = torch.tanh(self.mid2(self.frozen(h)))
            out = self.head(torch.relu(self.frozen(h)))
            return nn.functional.mse_loss(out.float(), y.float())

    return {"seed": Seed, "reuse3": Reuse3}[kind]()


def _batch(step: int, seed: int, dtype: Any, device: Any) -> List[Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, 16, generator=g)
    return [x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)]


def run(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """Train as ``args`` say, filling ``result`` as it goes (so a failure keeps what ran)."""
    _launcher_env()
    if args.fresh_extension_cache:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="ds_ext_")
    import torch

    # fp32 comparisons must not run matmuls in TF32 on one side only.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import deepspeed

    result.update(deepspeed=deepspeed.__version__, torch=torch.__version__, losses=[])
    if args.native == "ours":
        import ds_z3native

        result["install"] = ds_z3native.install().__dict__
    bf16 = args.dtype == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    deepcompile = args.mode == "deepcompile"
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": 3 if deepcompile else 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    device = engine.device
    t_compile = time.perf_counter()
    if deepcompile:
        engine.compile()
    step_times: List[float] = []
    for step in range(args.steps):
        if args.unfreeze_after is not None and step == args.unfreeze_after:
            engine.module.frozen.requires_grad_(True)
            result["unfrozen_at_step"] = step
        t0 = time.perf_counter()
        x, y = _batch(step, args.seed, dtype, device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_times.append(now - t0)
        if step == 0:
            result["compile_to_first_step_end_s"] = now - t_compile
        result["losses"].append(float(loss.detach().float().item()))
    result["step_ms_after_warmup"] = (1000 * sum(step_times[6:]) / max(1, len(step_times[6:])))
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=deepcompile):
        result["params"] = {n: p.detach().float().cpu().flatten().tolist() for n, p in params}
    result["requires_grad"] = {n: p.requires_grad for n, p in params}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["deepcompile", "eager"], default="deepcompile")
    parser.add_argument("--native", choices=["ours", "deepspeed"], default="ours",
                        help="ours: ds_z3native.install(); deepspeed: DeepSpeed's own op (JIT)")
    parser.add_argument("--model", choices=["seed", "reuse3"], default="seed")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unfreeze-after", type=int, default=None,
                        help="set the frozen layer's requires_grad=True before this step")
    parser.add_argument("--fresh-extension-cache", action="store_true",
                        help="TORCH_EXTENSIONS_DIR = a new temporary directory (forces a JIT build)")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout)")
    args = parser.parse_args(argv)
    result: Dict[str, Any] = {"args": vars(args)}
    try:
        run(args, result)
    except Exception as e:  # noqa: BLE001 - reported as data: the caller asserts on it
        result.update(error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                      traceback=traceback.format_exc())
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    summary = {k: v for k, v in result.items() if k not in ("params", "traceback")}
    print("RESULT " + json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
