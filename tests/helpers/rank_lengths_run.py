"""One rank of a training run in which each rank has batches of its own lengths (as with per-rank
packing): the tiny LoRA Llama of ``ds_z3native.models`` under DeepCompile ZeRO-3, or at ZeRO-0
(the reference), on DeepSpeed's CPU accelerator. ``train`` is one rank's run (the tests call it
through ``helpers.dist.run_ranks``); as a script under ``torch.distributed.run``, rank r writes
``<json>.rank<r>``.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/rank_lengths_run.py \
        --lengths "12,12,9,20,14,14,23;17,9,9,11,26,14,15" --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence


def _skip_patches(names: List[str]) -> None:
    from ds_z3native.compat import registry

    every = registry.all_patches
    unknown = sorted(set(names) - {p.name for p in every()})
    if unknown:
        raise ValueError(f"--skip-patch {unknown}: no such ds_z3native patch")
    registry.all_patches = lambda: [p for p in every() if p.name not in names]


def train(rank: int, world_size: int, mode: str, lengths: str, eval_lengths: str = "",
          skip_patches: Sequence[str] = ()) -> Dict[str, Any]:
    """This rank's run (``torch.distributed`` set up by the caller or DeepSpeed): its losses,
    step times, evaluation losses and, under DeepCompile, the ranks' vote counters and the
    number of graphs Dynamo compiled. ``lengths``/``eval_lengths``: as ``--lengths``."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import deepspeed
    import torch

    import ds_z3native
    from ds_z3native.models import MODEL_SIZES, build_lora_model, synthetic_batch, zero3_auto_values

    _skip_patches(list(skip_patches))
    ds_z3native.install()
    mine = [int(x) for x in lengths.split(";")[rank].split(",")]
    mine_eval = [int(x) for x in eval_lengths.split(";")[rank].split(",")] if eval_lengths else []
    size = MODEL_SIZES["tiny"]
    deepcompile = mode == "deepcompile"
    zero: Dict[str, Any] = {"stage": 3 if deepcompile else 0}
    if deepcompile:
        zero.update(zero3_auto_values(size.hidden))
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": size.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    model, _ = build_lora_model(size)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trained)
    if deepcompile:
        engine.compile()

    def batch(step: int, length: int) -> Dict[str, Any]:
        shape = dataclasses.replace(size, seq_len=length)
        ids = synthetic_batch(shape, step, rank).to(engine.device)
        return {"input_ids": ids, "labels": ids}

    result: Dict[str, Any] = {"rank": rank, "lengths": mine, "losses": [], "step_s": [],
                              "eval_losses": []}
    for step, length in enumerate(mine):
        t0 = time.perf_counter()
        loss = engine(**batch(step, length)).loss
        engine.backward(loss)
        engine.step()
        result["losses"].append(float(loss.detach().item()))
        result["step_s"].append(time.perf_counter() - t0)
    engine.eval()
    with torch.no_grad():
        for i, length in enumerate(mine_eval):
            result["eval_losses"].append(float(engine(**batch(10**6 + i, length)).loss.item()))
    if deepcompile:
        from torch._dynamo.utils import counters

        from ds_z3native.compat.deepcompile_rank_sync import rank_sync_stats

        result["rank_sync"] = rank_sync_stats()
        result["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["deepcompile", "zero0"], default="deepcompile")
    parser.add_argument("--lengths", required=True,
                        help="each rank's batch lengths, one step each: comma-separated, ranks "
                             "separated by ';'")
    parser.add_argument("--eval-lengths", default="",
                        help="after training, one no-grad forward per length (ranks as above)")
    parser.add_argument("--skip-patch", action="append", default=[])
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    result = train(rank, int(os.environ["WORLD_SIZE"]), args.mode, args.lengths,
                   args.eval_lengths, args.skip_patch)
    with open(f"{args.json}.rank{rank}", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
