"""Which DeepSpeed releases ds_z3native may be installed into.

* ``SUPPORTED_MIN`` .. ``SUPPORTED_MAX`` (0.19.0 – 0.19.8): tested, supported.
* Older (0.18.x and before): refused. Their dc op has another API (``init`` arguments, the
  ``end_backward`` schema), so handing them our module would fail in the middle of a compile.
* Newer: allowed with a warning, but only if that DeepSpeed's sources still describe the contract
  we implement (:func:`ds_z3native.compat.contract.contract_mismatches` is empty); refused with
  the list of differences otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from packaging.version import Version

from . import SUPPORTED_MAX, SUPPORTED_MIN

__all__ = ["Verdict", "GateResult", "check_deepspeed_version", "UnsupportedDeepSpeed"]


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is one ds_z3native cannot serve."""


class Verdict(enum.Enum):
    SUPPORTED = "supported"
    NEWER_COMPATIBLE = "newer-compatible"  # untested release whose contract still matches ours
    REFUSED = "refused"


@dataclass(frozen=True)
class GateResult:
    """The gate's decision for one DeepSpeed version, and why."""

    version: Version
    verdict: Verdict
    message: str
    mismatches: List[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return self.verdict is not Verdict.REFUSED


def check_deepspeed_version(version: Version,
                            mismatches: Optional[Callable[[], List[str]]] = None) -> GateResult:
    """Decide whether ds_z3native may be installed into DeepSpeed ``version``.

    ``mismatches`` returns the contract differences of that DeepSpeed (default:
    :func:`~ds_z3native.compat.contract.contract_mismatches` of the importable one); it is only
    called for releases newer than the supported range.
    """
    release = Version(version.base_version)
    span = f"{SUPPORTED_MIN}–{SUPPORTED_MAX}"
    if release < SUPPORTED_MIN:
        return GateResult(version, Verdict.REFUSED,
                          f"DeepSpeed {version} is not supported: ds_z3native serves DeepSpeed {span}. "
                          f"Releases before {SUPPORTED_MIN} have a different DeepCompile op API "
                          "(init arguments, the end_backward schema). Upgrade DeepSpeed "
                          f"(pip install 'deepspeed>={SUPPORTED_MIN},<0.20') or do not install "
                          "ds_z3native (unset DS_Z3NATIVE).")
    if release <= SUPPORTED_MAX:
        return GateResult(version, Verdict.SUPPORTED, f"DeepSpeed {version} is supported ({span})")
    if mismatches is None:
        from .contract import contract_mismatches as mismatches
    found = list(mismatches())
    if found:
        listing = "\n  - ".join(found)
        return GateResult(version, Verdict.REFUSED,
                          f"DeepSpeed {version} is newer than the tested range ({span}) and its "
                          "DeepCompile op contract differs from ds_z3native's:\n  - " + listing +
                          f"\nUse DeepSpeed {span}, or a ds_z3native release that supports "
                          f"{version}, or run without ds_z3native (unset DS_Z3NATIVE).",
                          found)
    return GateResult(version, Verdict.NEWER_COMPATIBLE,
                      f"DeepSpeed {version} is newer than the tested range ({span}); its DeepCompile "
                      "op schemas and the module functions its Python calls still match "
                      "ds_z3native's, so it is allowed, untested. Report problems with the "
                      "DeepSpeed version.")
