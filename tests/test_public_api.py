"""Each public name of ``ds_z3native`` does what its docstring says; the ones other test files
drive at length (``install``, the budgets, the profile store) are named there, the rest here."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ds_z3native
from ds_z3native.settings import Settings


def test_every_public_name_is_documented_and_importable() -> None:
    for name in ds_z3native.__all__:
        value = getattr(ds_z3native, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"ds_z3native.{name} has no docstring"


def test_existing_dc_owner_names_the_registration_or_none() -> None:
    # Loaded here: the registration is ours, named by the source file that defined the schema.
    ds_z3native.native()
    owner = ds_z3native.existing_dc_owner()
    assert owner is not None and "csrc" in owner, owner
    # A fresh process that never loaded an op library has none.
    r = subprocess.run([sys.executable, "-c", "from ds_z3native import existing_dc_owner; "
                        "print(existing_dc_owner())"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "None", r.stderr


def test_install_returns_its_report_and_installed_says_whether_it_is_in_effect() -> None:
    pytest.importorskip("deepspeed")
    was = ds_z3native.installed()
    report = ds_z3native.install()
    try:
        assert isinstance(report, ds_z3native.InstallReport)
        assert report.patches and all(isinstance(p, str) for p in report.patches)
        assert ds_z3native.install() is report  # idempotent: the first call's report
        assert ds_z3native.installed() is True
    finally:
        if not was:
            ds_z3native.uninstall()
            assert ds_z3native.installed() is False


@pytest.mark.parametrize("setter, field, env", [
    (ds_z3native.set_group_persistent, "group_persistent", ds_z3native.GROUP_PERSISTENT_ENV),
    (ds_z3native.set_group_reduce, "group_reduce", ds_z3native.GROUP_REDUCE_ENV),
    (ds_z3native.set_warm_start, "warm_start", ds_z3native.WARM_START_ENV),
    (ds_z3native.set_single_cycle, "single_cycle", ds_z3native.SINGLE_CYCLE_ENV),
])
def test_each_switch_is_read_from_its_setter_and_its_environment_variable(
        setter, field: str, env: str) -> None:  # type: ignore[no-untyped-def]
    before = getattr(ds_z3native.current_settings(), field)
    try:
        for value in (True, False):
            setter(value)
            assert getattr(ds_z3native.current_settings(), field) is value
        with pytest.raises(ValueError):
            setter("yes")  # type: ignore[arg-type]
    finally:
        setter(before)
    assert getattr(Settings.from_env({env: "0"}), field) is False
    assert getattr(Settings.from_env({env: "1"}), field) is True
