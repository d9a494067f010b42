"""Eager ZeRO-3 LoRA training with activation checkpointing: step time and peak memory.

The setup (``--size 1b``, the default): an HF ``LlamaForCausalLM`` of ~0.96 B params built from a
``LlamaConfig`` (hidden 2048, MLP 5632, 16 layers, 32 heads, vocab 32000, random init, no
download), PEFT LoRA r=16 on every linear layer, bf16, micro-batch 4 x 1024 tokens per GPU, eager
ZeRO-3 (DeepSpeed's defaults otherwise), AdamW. ``--size toy`` is the same at a size a CPU runs.

One variant per process (DeepSpeed keeps process-wide hooks and state); the DeepSpeed version is
whatever ``import deepspeed`` finds (choose it with PYTHONPATH):

* ``ours``: non-reentrant checkpointing with ds_z3native's recompute holds
  (``compat.checkpoint_recompute.apply_recompute_fix(holds=True)``, which on DeepSpeed >= 0.19.3
  replaces DeepSpeed's own fix);
* ``upstream``: non-reentrant checkpointing, DeepSpeed alone (fails before 0.19.3);
* ``reentrant``: reentrant checkpointing, DeepSpeed alone;
* ``none``: no checkpointing, DeepSpeed alone.

Each run writes one JSON file (setup, versions, step-time median/min/max over the steps after
warm-up, peak memory, and the peak / backward mean of the bytes held by gathered ZeRO-3 params,
taken in one extra instrumented step); ``merge`` combines such files into one (e.g.
``bench/results/eager_lora.json``). A failed run still writes its file, with ``error``.

On the GPU host (one GPU; for several use ``torchrun --nproc_per_node=N``):

    bash .gpu/run.sh 0.19.8 'python3 -m pip install -q --no-index --no-deps --target /tmp/ds192 \\
        .gpu/wheels/deepspeed-0.19.2-py3-none-any.whl &&
      for v in upstream reentrant none ours; do
        python3 bench/eager_lora.py --variant $v --output out/eager_lora/$v-0.19.8.json; done &&
      PYTHONPATH=/tmp/ds192:$PYTHONPATH python3 bench/eager_lora.py --variant ours \\
        --output out/eager_lora/ours-0.19.2.json &&
      python3 bench/eager_lora.py merge out/eager_lora/*.json \\
        --output bench/results/eager_lora.json'

On a CPU: ``DS_ACCELERATOR=cpu python bench/eager_lora.py --size toy --variant ours``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger("bench.eager_lora")

VARIANTS = ("ours", "upstream", "reentrant", "none")
SIZES: Dict[str, Dict[str, int]] = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=32),
    "toy": dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4),
}
# stage3_param_persistence_threshold per size: DeepSpeed's default (1e5 elements) at 1b keeps the
# norms whole and partitions every linear; at toy size it would keep everything whole.
PERSISTENCE = {"1b": None, "toy": 1000}
GIB = 2**30


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold (default: DeepSpeed's at 1b, 1000 "
                        "at toy size)")
    p.add_argument("--no-track-gathered", action="store_true",
                   help="skip the extra instrumented step")
    p.add_argument("--output", type=Path, required=True, help="JSON file to write")
    return p.parse_args(argv)


def _launcher_env() -> None:
    """One process without a launcher: make it rank 0 of 1."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _versions() -> Dict[str, Any]:
    import deepspeed
    import peft
    import torch
    import transformers

    import ds_z3native

    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "peft": peft.__version__, "ds_z3native": ds_z3native.__version__,
            "python": platform.python_version()}


def _build_model(args: argparse.Namespace, device: Any, dtype: Any) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[args.size], max_position_embeddings=max(args.seq, 64),
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.train()
    if args.variant != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.variant == "reentrant"})
        if args.variant == "reentrant":
            model.enable_input_require_grads()  # reentrant checkpointing needs a grad input
    return model


class _GatheredBytes:
    """Samples the bytes held by gathered non-persistent ZeRO-3 params at every fetch and release
    of DeepSpeed's parameter coordinator (outermost wrapper, so it sees the patched behaviour)."""

    def __init__(self, params: List[Any]) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import (
            PartitionedParameterCoordinator as Coordinator)

        import torch

        self._available = ZeroParamStatus.AVAILABLE
        self._params = [p for p in params if not p.ds_persist]
        self._cls = Coordinator
        self._originals = (Coordinator.fetch_sub_module, Coordinator.release_sub_module)
        self.samples: List[tuple] = []  # (in backward, bytes)
        task_id: Callable[[], int] = torch._C._current_graph_task_id
        fetch, release = self._originals

        def sample() -> None:
            held = sum(p.ds_numel * p.element_size() for p in self._params
                       if p.ds_status == self._available)
            self.samples.append((task_id() != -1, held))

        def fetch_sampled(coordinator: Any, *args: Any, **kwargs: Any) -> Any:
            result = fetch(coordinator, *args, **kwargs)
            sample()
            return result

        def release_sampled(coordinator: Any, *args: Any, **kwargs: Any) -> Any:
            result = release(coordinator, *args, **kwargs)
            sample()
            return result

        Coordinator.fetch_sub_module = fetch_sampled
        Coordinator.release_sub_module = release_sampled

    def close(self) -> Dict[str, float]:
        self._cls.fetch_sub_module, self._cls.release_sub_module = self._originals
        backward = [b for in_bwd, b in self.samples if in_bwd]
        return {"peak_gib": max((b for _, b in self.samples), default=0) / GIB,
                "backward_peak_gib": max(backward, default=0) / GIB,
                "backward_mean_gib": (statistics.fmean(backward) if backward else 0.0) / GIB,
                "samples": len(self.samples)}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Builds the setup, trains ``warmup + steps`` steps (+1 instrumented), returns the record."""
    _launcher_env()
    import deepspeed
    import torch

    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        import deepspeed.ops

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # gloo, and no JIT build of DeepSpeed's optional shared-memory comm kernel
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        device = torch.device("cpu")
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

    record: Dict[str, Any] = {"bench": "eager_lora", "variant": args.variant,
                              "versions": _versions()}
    fix_mode = None
    if args.variant == "ours":
        from ds_z3native.compat.checkpoint_recompute import apply_recompute_fix, applied_mode

        apply_recompute_fix(holds=True)
        fix_mode = applied_mode()
    record["fix"] = fix_mode

    t0 = time.perf_counter()
    model = _build_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model: %.3f B params, %.2f M trainable (LoRA r=%d), built in %.1f s",
             n_params / 1e9, n_trainable / 1e6, args.lora_r, time.perf_counter() - t0)
    zero: Dict[str, Any] = {"stage": 3}
    threshold = (args.persistence_threshold if args.persistence_threshold is not None
                 else PERSISTENCE[args.size])
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if dtype is torch.bfloat16:
        config["bf16"] = {"enabled": True}
    record["setup"] = {
        "size": args.size, "model": {**SIZES[args.size], "params": n_params,
                                     "trainable": n_trainable, "lora_r": args.lora_r,
                                     "lora_targets": "all-linear"},
        "dtype": dtype_name, "micro_batch": args.micro_batch, "seq": args.seq,
        "world_size": world_size, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "checkpointing": {"ours": "non-reentrant", "upstream": "non-reentrant",
                          "reentrant": "reentrant", "none": "none"}[args.variant],
        "deepspeed_config": config, "warmup": args.warmup, "steps": args.steps,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    g = torch.Generator().manual_seed(1000 + rank)
    vocab = SIZES[args.size]["vocab_size"]

    def step() -> float:
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()  # also waits for the device

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(step())
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed * 1e3)
        log.info("step %d/%d: %.1f ms, loss %.4f%s", i + 1, args.warmup + args.steps,
                 elapsed * 1e3, losses[-1], " (warm-up)" if i < args.warmup else "")
    record["step_ms"] = {"median": statistics.median(times), "min": min(times),
                         "max": max(times), "all": times}
    if on_gpu:
        record["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        record["peak_kind"] = "torch.cuda.max_memory_allocated over the timed steps"
    else:
        record["peak_gib"] = _peak_rss_gib()
        record["peak_kind"] = "process peak RSS (ru_maxrss), whole run"
    record["losses"] = losses
    if not args.no_track_gathered:
        tracker = _GatheredBytes(list(model.parameters()))
        try:
            record["losses_instrumented_step"] = step()
        finally:
            record["gathered_params"] = tracker.close()
    engine.destroy()
    log.info("%s: median %.1f ms (min %.1f, max %.1f), peak %.2f GiB", args.variant,
             record["step_ms"]["median"], record["step_ms"]["min"], record["step_ms"]["max"],
             record["peak_gib"])
    return record


def merge(paths: List[Path], output: Path) -> Dict[str, Any]:
    """Combines per-variant records into ``{"bench": ..., "runs": {"<variant>@<deepspeed>": ...}}``
    (existing runs in ``output`` are kept unless replaced)."""
    merged: Dict[str, Any] = {"bench": "eager_lora", "runs": {}}
    if output.exists():
        merged = json.loads(output.read_text())
    for path in paths:
        record = json.loads(path.read_text())
        key = f"{record['variant']}@{record['versions']['deepspeed']}"
        merged["runs"][key] = record
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return merged


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="eager_lora.py merge")
        p.add_argument("inputs", type=Path, nargs="+")
        p.add_argument("--output", type=Path, required=True)
        m = p.parse_args(argv[1:])
        merged = merge(m.inputs, m.output)
        log.info("wrote %s (%d runs)", m.output, len(merged["runs"]))
        return 0
    args = _parse(argv)
    try:
        record = run(args)
        code = 0
    except Exception as e:  # noqa: BLE001 - a failed variant is a result too
        log.error("%s failed: %s", args.variant, e)
        record = {"bench": "eager_lora", "variant": args.variant, "error": traceback.format_exc()}
        try:
            record["versions"] = _versions()
        except Exception:  # noqa: BLE001
            record["versions"] = {"deepspeed": "unknown"}
        code = 1
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        log.info("wrote %s", args.output)
    return code


if __name__ == "__main__":
    sys.exit(main())
