"""ZeRO-3 engines in tests: reading partitioned params back, one training run's record, and what
DeepSpeed alone does with the minimal reproduction."""

from __future__ import annotations

import traceback
from typing import Any, Callable, Dict

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


def train_and_collect(engine: Any, model: torch.nn.Module, reference: Dict[str, Any],
                      out: Dict[str, Any], train: Callable[[], None]) -> Dict[str, Any]:
    """Runs ``train`` (the engine's steps, recording into ``out``), then destroys ``engine``.

    An exception becomes ``out["error"]`` (its traceback), for the parent process to assert on;
    otherwise ``out`` gets the gathered trainable params and, beside them, ``reference`` (what
    plain PyTorch reached).
    """
    try:
        train()
    except Exception:  # noqa: BLE001 - the parent asserts on it
        out["error"] = traceback.format_exc()
        engine.destroy()
        return out
    out["params"] = gathered_trainable(model)
    out["reference"] = reference
    engine.destroy()
    return out


def assert_unpatched_outcome(unpatched: Dict[str, Any], upstream_fix: bool) -> None:
    """DeepSpeed alone on a checkpointed block with a frozen param: from 0.19.3
    (``upstream_fix``) no error; before, the CheckpointError of the minimal reproduction (a frozen
    weight recomputed as [0]).

    A helper module's asserts are not rewritten by pytest: each names what it saw.
    """
    if upstream_fix:
        assert "error" not in unpatched, unpatched["error"]
    else:
        assert "CheckpointError" in unpatched.get("error", ""), unpatched
        assert "recomputed metadata: {'shape': torch.Size([0])" in unpatched["error"], \
            unpatched["error"]


def install_without(*names: str) -> None:
    """``ds_z3native.install()`` with every patch but ``names`` (in this process: a rank's or a
    subprocess's), to show what those patches change."""
    import ds_z3native
    from ds_z3native.compat import registry

    every = registry.all_patches
    registry.all_patches = lambda: [p for p in every() if p.name not in names]
    ds_z3native.install()
