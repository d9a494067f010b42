"""``ds_z3native.settings``: the persistence and prefetch budgets and the profile store are one
settings value per process. The environment gives the defaults, read once; the setters change the
settings and never ``os.environ``; the consumers get the values from the settings; bad values are
refused with a message naming the setter or variable and the value; a child process reads its
own environment, not the parent's setters."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

import ds_z3native
from ds_z3native import settings
from ds_z3native.compat import deepcompile_prefetch, deepcompile_profile_store
from ds_z3native.settings import (BUDGET_RANGE, GROUP_PERSISTENT_ENV, MAX_BUDGET_MIB,
                                  PERSISTENCE_BUDGET_ENV, PREFETCH_BUDGET_ENV, PROFILE_STORE_ENV,
                                  Settings)
from helpers.dist import run_python


def test_the_environment_gives_the_defaults() -> None:
    s = Settings.from_env({PERSISTENCE_BUDGET_ENV: "1.5", PREFETCH_BUDGET_ENV: " 0 ",
                           PROFILE_STORE_ENV: "/tmp/profiles"})
    assert s == Settings(1.5, 0.0, Path("/tmp/profiles"))
    assert (s.persistence_budget_bytes, s.prefetch_budget_bytes) == (1572864, 0)
    assert Settings.from_env({}) == Settings.from_env(
        {PERSISTENCE_BUDGET_ENV: "", PREFETCH_BUDGET_ENV: "", PROFILE_STORE_ENV: " "}) == Settings()


@pytest.mark.parametrize("name", [PERSISTENCE_BUDGET_ENV, PREFETCH_BUDGET_ENV])
@pytest.mark.parametrize("raw", ["lots", "-1", "nan", "inf", str(MAX_BUDGET_MIB)])
def test_a_malformed_variable_is_refused_naming_it_and_its_value(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: expected MiB in {re.escape(BUDGET_RANGE)}.*"
                                         rf"{re.escape(repr(raw))}"):
        Settings.from_env({name: raw})


def test_each_value_is_checked_once_whoever_sets_it() -> None:
    for bad in (-1, math.nan, math.inf, MAX_BUDGET_MIB, True, "2"):
        with pytest.raises(ValueError, match=re.escape(f"Settings.prefetch_budget_mib: expected "
                                                       f"MiB in {BUDGET_RANGE} or None, got {bad!r}")):
            Settings(prefetch_budget_mib=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_profile_store: the directory is empty \(''\)"):
        ds_z3native.set_profile_store("")
    with pytest.raises(ValueError, match=r"set_profile_store: expected a directory .* got 5"):
        ds_z3native.set_profile_store(5)  # type: ignore[arg-type]
    assert settings.check_budget_mib(0, "x") == 0.0 and settings.check_budget_mib(None, "x") is None


@pytest.mark.parametrize("raw,on", [("0", False), (" off ", False), ("No", False),
                                    ("1", True), ("true", True), ("", True)])
def test_the_grouping_switch_reads_its_variable(raw: str, on: bool) -> None:
    assert Settings.from_env({GROUP_PERSISTENT_ENV: raw}).group_persistent is on
    assert Settings.from_env({}).group_persistent is True


def test_a_malformed_grouping_switch_is_refused_naming_it(clean_settings) -> None:
    with pytest.raises(ValueError, match=rf"^{GROUP_PERSISTENT_ENV}: expected 1 or 0 .*'2'"):
        Settings.from_env({GROUP_PERSISTENT_ENV: "2"})
    for bad in (0, 1, "false", None):
        with pytest.raises(ValueError, match=rf"set_group_persistent: expected True or False, "
                                             rf"got {re.escape(repr(bad))}"):
            ds_z3native.set_group_persistent(bad)  # type: ignore[arg-type]
    assert settings.current().group_persistent is True  # a refusal changes nothing
    environ = dict(os.environ)
    ds_z3native.set_group_persistent(False)
    assert settings.current().group_persistent is False and dict(os.environ) == environ


def test_the_budget_range_the_messages_and_docs_state_is_the_bound_checked() -> None:
    # The range the messages write is made from MAX_BUDGET_MIB: its upper end reads back as the
    # bound, the values on either side of that bound are accepted and refused, and the docs that
    # state the range (Settings' doc of each budget, the settings table, the error table) write
    # the same text.
    assert re.fullmatch(r"\[0, [0-9.e]+\)", BUDGET_RANGE), BUDGET_RANGE
    assert float(BUDGET_RANGE[len("[0, "):-1]) == MAX_BUDGET_MIB
    below = math.nextafter(MAX_BUDGET_MIB, 0)
    assert settings.check_budget_mib(below, "x") == below
    with pytest.raises(ValueError, match=re.escape(f"x: expected MiB in {BUDGET_RANGE} or None")):
        settings.check_budget_mib(MAX_BUDGET_MIB, "x")
    errors = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    fields = ("persistence_budget_mib", "prefetch_budget_mib")
    for where, text in [*[(f, Settings.__doc__.split(f"\n{f} = ")[1].split("\n\n")[0])
                          for f in fields],
                        *[(f"table: {f}", next(row for row in settings.markdown_table()
                                               .splitlines() if row.startswith(f"| `{f}`")))
                          for f in fields],
                        ("docs/errors.md", errors)]:
        assert f"MiB in {BUDGET_RANGE}" in " ".join((text or "").split()), where


def test_the_setters_keep_their_state_out_of_the_environment(clean_settings, tmp_path: Path) -> None:
    environ = dict(os.environ)
    ds_z3native.set_persistence_budget(4)
    ds_z3native.set_prefetch_budget(8)
    ds_z3native.set_profile_store(tmp_path)
    assert dict(os.environ) == environ
    assert ds_z3native.current_settings() == Settings(4.0, 8.0, tmp_path)
    # ... and the consumers see them.
    assert deepcompile_prefetch.prefetch_budget_bytes() == 8 * 2**20
    assert deepcompile_profile_store.profile_store() == tmp_path
    ds_z3native.set_profile_store(None)
    ds_z3native.set_prefetch_budget(None)
    ds_z3native.set_persistence_budget(None)
    assert ds_z3native.current_settings() == Settings()
    assert dict(os.environ) == environ


def test_the_environment_is_read_once(clean_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFETCH_BUDGET_ENV, "3")
    assert deepcompile_prefetch.prefetch_budget_bytes() is None  # read before: not looked at again
    settings.use(Settings.from_env(os.environ))  # reading it again is explicit
    assert deepcompile_prefetch.prefetch_budget_bytes() == 3 * 2**20


def test_a_child_reads_its_own_environment_not_the_parents_setters(clean_settings) -> None:
    ds_z3native.set_prefetch_budget(7)
    code = ("import json, ds_z3native; s = ds_z3native.current_settings(); "
            "print(json.dumps([s.persistence_budget_mib, s.prefetch_budget_mib, "
            "None if s.profile_store is None else str(s.profile_store)]))")
    env = {k: "" for k in (PERSISTENCE_BUDGET_ENV, PREFETCH_BUDGET_ENV, PROFILE_STORE_ENV)}
    r = run_python(code, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [None, None, None]
    env.update({PERSISTENCE_BUDGET_ENV: "2", PREFETCH_BUDGET_ENV: "3", PROFILE_STORE_ENV: "/p"})
    r = run_python(code, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [2.0, 3.0, "/p"]


def test_a_malformed_variable_is_refused_before_the_native_module_loads() -> None:
    code = """
        import sys
        import ds_z3native
        try:
            ds_z3native.native()
        except ValueError as e:
            print("refused:", e)
        print("loaded:", "ds_z3native._C" in sys.modules)
    """
    r = run_python(code, env={PERSISTENCE_BUDGET_ENV: "lots"})
    assert r.returncode == 0, r.stderr
    assert (f"refused: {PERSISTENCE_BUDGET_ENV}: expected MiB in {BUDGET_RANGE}, got 'lots'"
            in r.stdout), r.stdout
    assert "loaded: False" in r.stdout, r.stdout


def test_the_native_default_follows_the_settings() -> None:
    # In a fresh interpreter: the budget the environment gives reaches init() (through
    # set_default_persistence_budget, not getenv), and a setter's value replaces it.
    code = """
        import os
        import torch.distributed as dist
        from types import SimpleNamespace
        import ds_z3native
        m = ds_z3native.native()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % PORT, rank=0,
                                world_size=1)
        cfg = SimpleNamespace(double_buffer=True, free_activation_threshold=0)
        os.environ["ENV_NAME"] = "lots"  # read already: not looked at
        m.init(dist.group.WORLD, cfg, 64)
        print("env:", m.persistence_info()["budget_bytes"])
        ds_z3native.set_persistence_budget(0.5)
        m.cleanup()
        m.init(dist.group.WORLD, cfg, 64)
        print("setter:", m.persistence_info()["budget_bytes"])
        m.cleanup()
        dist.destroy_process_group()
    """
    from ds_z3native._net import free_port

    code = code.replace("PORT", str(free_port())).replace("ENV_NAME", PERSISTENCE_BUDGET_ENV)
    r = run_python(code, env={PERSISTENCE_BUDGET_ENV: "2"})
    assert r.returncode == 0, r.stderr
    assert "env: 2097152" in r.stdout and "setter: 524288" in r.stdout, r.stdout
