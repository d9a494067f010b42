"""Version-gated fixes for DeepSpeed's Python side.

Each fix is a :class:`Patch`: a small named function that edits one DeepSpeed attribute, the
DeepSpeed versions it targets written beside it, and the undo it returns. ``install()`` applies
the patches whose range contains the installed DeepSpeed; ``uninstall()`` undoes them in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from packaging.version import Version

__all__ = ["Patch", "Undo", "deepspeed_version", "SUPPORTED_MIN", "SUPPORTED_MAX"]

# An undo restores exactly what its patch replaced.
Undo = Callable[[], None]

# DeepSpeed releases whose dc interface we match (0.18.x and older have another op API).
SUPPORTED_MIN = Version("0.19.0")
SUPPORTED_MAX = Version("0.19.8")


@dataclass(frozen=True)
class Patch:
    """One fix of DeepSpeed's Python side.

    ``first``/``last`` bound the DeepSpeed versions it applies to (inclusive; None = open).
    ``apply`` makes the change and returns the undo.
    """

    name: str
    summary: str
    apply: Callable[[], Undo]
    first: Optional[Version] = None
    last: Optional[Version] = None

    def targets(self, version: Version) -> bool:
        """Whether this patch applies to DeepSpeed ``version`` (release part only)."""
        v = Version(version.base_version)
        return (self.first is None or v >= self.first) and (self.last is None or v <= self.last)


def deepspeed_version() -> Version:
    """The installed DeepSpeed's version (imports deepspeed)."""
    import deepspeed

    return Version(deepspeed.__version__.split("+")[0])
