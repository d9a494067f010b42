"""Reading ZeRO-3 partitioned params back in tests."""

from __future__ import annotations

from typing import Dict

import torch


def gathered_trainable(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full CPU copies of every trainable param of a ZeRO-3 model, by name.

    Gathered one at a time: DeepSpeed 0.19.2's coalesced gather waits on the last gloo handle
    only, so the other params of a list may be read before their data arrives.
    """
    import deepspeed

    out: Dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().cpu().clone()
    return out
