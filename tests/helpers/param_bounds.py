"""Bounds on trained params that fail when a param did not train: per tensor, the distance from
the reference run relative to how far training moved the reference from the common initial value.

A bound of the form ``|ours - ref| <= 2 * lr * steps`` (Adam moves a weight by about ``lr`` per
step whatever its gradient) is met by a weight that got no gradient at all; one relative to the
reference's own move is not: a tensor left at its initial value is off by the whole move, which
fails for any ``rel`` below 1, and a reference that did not move fails the floor."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

__all__ = ["as_tensors", "relative_param_diffs", "assert_trained_alike"]


def as_tensors(params: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """``name -> values`` (tensors, or the flat float lists of a bench/deepcompile_run.py
    result) as float64 tensors, flattened."""
    return {n: torch.as_tensor(v).detach().to(torch.float64).flatten() for n, v in params.items()}


def relative_param_diffs(ours: Mapping[str, Any], ref: Mapping[str, Any],
                         init: Mapping[str, Any]) -> Dict[str, float]:
    """``name -> ||ours - ref|| / ||ref - init||`` (inf where the reference did not move)."""
    o, r, i = as_tensors(ours), as_tensors(ref), as_tensors(init)
    out = {}
    for name in r:
        moved = float((r[name] - i[name]).norm())
        diff = float((o[name] - r[name]).norm())
        out[name] = diff / moved if moved > 0 else float("inf")
    return out


def assert_trained_alike(ours: Mapping[str, Any], ref: Mapping[str, Any],
                         init: Mapping[str, Any], rel: float, min_rms_move: float,
                         what: str = "") -> Dict[str, float]:
    """Every tensor of ``ref`` (trained params by name; ``init``: their common values before
    training) trained, and ``ours`` trained alike:

    * the reference moved: ``rms(ref - init) > min_rms_move`` (give about half a step of the
      optimizer's size, e.g. ``lr / 2`` for Adam: every element with a gradient moves about
      ``lr`` in Adam's first step; well above the rounding of the initial value in the run's
      dtype). A param frozen in both runs, or an optimizer that never stepped, fails here;
    * ``||ours - ref|| <= rel * ||ref - init||`` (norms over the tensor, ``rel`` < 1). A param
      frozen in ``ours`` only is off by the whole move and fails here.

    Returns ``name -> ||ours - ref|| / ||ref - init||``."""
    assert 0 < rel < 1, f"rel must be in (0, 1) for the bound to catch an untrained param, got {rel}"
    o, r, i = as_tensors(ours), as_tensors(ref), as_tensors(init)
    prefix = f"{what}: " if what else ""
    assert r and o.keys() == r.keys() == i.keys(), \
        f"{prefix}param names differ: ours {sorted(o)}, ref {sorted(r)}, initial {sorted(i)}"
    ratios: Dict[str, float] = {}
    for name in r:
        assert o[name].shape == r[name].shape == i[name].shape, \
            f"{prefix}{name}: shapes {o[name].shape}, {r[name].shape}, initial {i[name].shape}"
        moved = float((r[name] - i[name]).norm())
        rms = moved / max(1, r[name].numel()) ** 0.5
        assert rms > min_rms_move, (
            f"{prefix}{name}: the reference moved {rms:.3g} (rms) from its initial value, not more "
            f"than {min_rms_move:.3g}: it did not train")
        diff = float((o[name] - r[name]).norm())
        ratios[name] = diff / moved
        assert diff <= rel * moved, (
            f"{prefix}{name}: ||ours - ref|| = {diff:.3g} is {diff / moved:.3g} of the reference's "
            f"move from its initial value ({moved:.3g}), above {rel}")
    return ratios
