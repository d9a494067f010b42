"""The DeepSpeed version gate (pure logic; the installed DeepSpeed is not involved)."""

from __future__ import annotations

from typing import List

import pytest
from packaging.version import Version

from ds_z3native.compat.gate import Verdict, check_deepspeed_version


def _never_called() -> List[str]:
    raise AssertionError("the contract is only read for releases newer than the tested range")


@pytest.mark.parametrize("version", ["0.19.0", "0.19.2", "0.19.5", "0.19.8", "0.19.8+cu130",
                                     "0.19.3rc1", "0.19.8.post1"])
def test_supported_range(version: str) -> None:
    r = check_deepspeed_version(Version(version), _never_called)
    assert r.verdict is Verdict.SUPPORTED and r.allowed


@pytest.mark.parametrize("version", ["0.18.9", "0.18.0", "0.16.4", "0.18.9.post1"])
def test_older_releases_are_refused_with_what_to_do(version: str) -> None:
    r = check_deepspeed_version(Version(version), _never_called)
    assert r.verdict is Verdict.REFUSED and not r.allowed
    assert version in r.message
    assert "0.19.0–0.19.8" in r.message and "pip install" in r.message and "DS_Z3NATIVE" in r.message


@pytest.mark.parametrize("version", ["0.19.9", "0.20.0", "1.0.0", "0.19.9.dev0"])
def test_newer_release_with_matching_contract_is_allowed(version: str) -> None:
    r = check_deepspeed_version(Version(version), lambda: [])
    assert r.verdict is Verdict.NEWER_COMPATIBLE and r.allowed
    assert "newer than the tested range" in r.message


def test_newer_release_with_changed_contract_is_refused_with_the_differences() -> None:
    found = ["op dc::reduce_grad: ...", "module function set_stream() is not provided by ds_z3native"]
    r = check_deepspeed_version(Version("0.20.1"), lambda: found)
    assert r.verdict is Verdict.REFUSED and r.mismatches == found
    for line in found:
        assert line in r.message
