"""Version-gated fixes for DeepSpeed's Python side.

Each fix is a :class:`Patch`: a small named function that edits DeepSpeed attributes, written
beside the DeepSpeed versions it applies to, the exact targets it wraps or replaces (``wraps``)
and the undo it returns. ``install()`` applies the patches whose range contains the installed
DeepSpeed, once each target's fingerprint is found to be the one recorded for that release
(:mod:`ds_z3native.compat.fingerprints`); ``uninstall()`` undoes them in reverse.

Adding a patch is one declaration: a ``Patch(...)`` in a module of this package listed in
:data:`ds_z3native.compat.registry.PATCH_MODULES` (its ``PATCHES`` list), then
``scripts/record_fingerprints.sh`` to record its targets for every supported release.

The wrapping helpers are in :mod:`ds_z3native.compat._rebind`; the post-import hooks, with which
patches edit modules DeepSpeed imports late, in :mod:`ds_z3native.compat.import_hooks`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from packaging.version import Version

_KEBAB = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")

__all__ = ["Patch", "Undo", "deepspeed_version", "SUPPORTED_MIN", "SUPPORTED_MAX"]

# An undo restores exactly what its patch replaced.
Undo = Callable[[], None]

# DeepSpeed releases whose dc interface we match (0.18.x and older have another op API).
SUPPORTED_MIN = Version("0.19.0")
SUPPORTED_MAX = Version("0.19.8")


@dataclass(frozen=True)
class Patch:
    """One fix of DeepSpeed's Python side.

    ``name`` is kebab-case and unique. ``first``/``last`` bound the DeepSpeed versions it applies
    to (inclusive; None = open). ``apply`` makes the change and returns the undo. ``wraps``
    names every function, method or attribute ``apply`` wraps, replaces or swaps, as
    ``"module:qualname"`` (a private name as the source spells it, e.g.
    ``"deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition"``);
    their fingerprints must match the recorded ones for ``install()`` to apply the patch
    (DeepSpeed targets; others are only reported when unverified).
    """

    name: str
    summary: str
    apply: Callable[[], Undo]
    first: Optional[Version] = None
    last: Optional[Version] = None
    wraps: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _KEBAB.fullmatch(self.name):
            raise ValueError(f"patch name {self.name!r} is not kebab-case (a-z, 0-9, '-')")
        for target in self.wraps:
            module, sep, qualname = target.partition(":")
            if not (sep and module and qualname):
                raise ValueError(f"patch {self.name}: target {target!r} is not 'module:qualname'")

    def targets(self, version: Version) -> bool:
        """Whether this patch applies to DeepSpeed ``version`` (release part only)."""
        v = Version(version.base_version)
        return (self.first is None or v >= self.first) and (self.last is None or v <= self.last)


def deepspeed_version() -> Version:
    """The installed DeepSpeed's version (imports deepspeed)."""
    import deepspeed

    return Version(deepspeed.__version__.split("+")[0])
