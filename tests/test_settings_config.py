"""One place to configure ds_z3native: ``configure(**fields)`` checks every field before it applies
any, the setters are ``configure()`` with one field, each field's doc, variable and values are
stated once (in ``Settings``), and a ``"ds_z3native"`` section of the DeepSpeed config is applied
when a real engine is created with it (one gloo rank, DeepSpeed on the CPU): over the
environment and what ``configure()`` set before, refused by name when malformed, ignored by
DeepSpeed without ds_z3native installed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Dict

import pytest

import ds_z3native
from ds_z3native import settings
from ds_z3native.compat import deepcompile_prefetch, deepcompile_profile_store
from ds_z3native.settings import (BUDGET_RANGE, PERSISTENCE_BUDGET_ENV, PREFETCH_BUDGET_ENV,
                                  Settings)
from helpers.dist import run_python, run_ranks

FIELDS = [f.name for f in dataclasses.fields(Settings)]
SETTERS = {"persistence_budget_mib": (ds_z3native.set_persistence_budget, 2.5),
           "prefetch_budget_mib": (ds_z3native.set_prefetch_budget, 0.0),
           "profile_store": (ds_z3native.set_profile_store, Path("/tmp/dsz-profiles")),
           "group_persistent": (ds_z3native.set_group_persistent, False),
           "group_reduce": (ds_z3native.set_group_reduce, False),
           "warm_start": (ds_z3native.set_warm_start, False),
           "single_cycle": (ds_z3native.set_single_cycle, True)}
# A bad value of each field and what its message says of it.
BAD = [("persistence_budget_mib", -1, f"expected MiB in {BUDGET_RANGE} or None, got -1"),
       ("persistence_budget_mib", True, "expected MiB in"),
       ("prefetch_budget_mib", "2", f"expected MiB in {BUDGET_RANGE} or None, got '2'"),
       ("profile_store", "", "the directory is empty ('')"),
       ("profile_store", 5, "expected a directory (str or os.PathLike) or None, got 5"),
       ("group_persistent", 1, "expected True or False, got 1"),
       ("group_reduce", "no", "expected True or False, got 'no'"),
       ("warm_start", None, "expected True or False, got None"),
       ("single_cycle", "yes", "expected True or False, got 'yes'")]


# ---- configure() ---------------------------------------------------------------------------------

def test_configure_sets_the_named_fields_at_once_and_returns_them(clean_settings,
                                                                  tmp_path: Path) -> None:
    environ = dict(os.environ)
    new = ds_z3native.configure(persistence_budget_mib=4, prefetch_budget_mib=8,
                                profile_store=str(tmp_path), single_cycle=True)
    assert new == ds_z3native.current_settings() == Settings(
        persistence_budget_mib=4.0, prefetch_budget_mib=8.0, profile_store=tmp_path,
        single_cycle=True)
    # Values as the checks give them: a float budget, a Path.
    assert type(new.persistence_budget_mib) is float and isinstance(new.profile_store, Path)
    assert dict(os.environ) == environ  # this process's settings, not the environment
    assert deepcompile_prefetch.prefetch_budget_bytes() == 8 * 2**20  # the consumers see them
    assert deepcompile_profile_store.profile_store() == tmp_path
    # Fields not named keep their values; no field at all changes nothing.
    assert ds_z3native.configure(group_reduce=False) == dataclasses.replace(new, group_reduce=False)
    assert ds_z3native.configure() == ds_z3native.current_settings()


def test_configure_refuses_an_unknown_field_naming_it_and_the_settings(clean_settings) -> None:
    with pytest.raises(ValueError) as e:
        ds_z3native.configure(single_cycle=True, persistence_budget=512)
    assert str(e.value) == ("configure(persistence_budget=...): no such setting; the settings are "
                            + ", ".join(FIELDS))
    assert ds_z3native.current_settings() == Settings()  # nothing applied, single_cycle neither


@pytest.mark.parametrize("field, bad, says", BAD, ids=[f"{f}-{b!r}" for f, b, _ in BAD])
def test_configure_refuses_a_bad_value_naming_the_field_and_the_value(
        clean_settings, field: str, bad: Any, says: str) -> None:
    good = {"warm_start": False} if field == "group_reduce" else {"group_reduce": False}
    with pytest.raises(ValueError) as e:
        ds_z3native.configure(**good, **{field: bad})
    assert str(e.value).startswith(f"configure({field}=...): {says}"), str(e.value)
    assert ds_z3native.current_settings() == Settings()  # checked before any is applied


def test_configure_reaches_the_live_native_runtime() -> None:
    # In a fresh interpreter: a runtime initialized with the environment's budget takes
    # configure()'s at once, and the next init() starts from it; other fields leave it alone.
    code = """
        import torch.distributed as dist
        from types import SimpleNamespace
        import ds_z3native
        m = ds_z3native.native()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
        cfg = SimpleNamespace(double_buffer=True, free_activation_threshold=0)
        m.init(dist.group.WORLD, cfg, 64)
        print("env:", m.persistence_info()["budget_bytes"])
        ds_z3native.configure(persistence_budget_mib=0.5, group_reduce=False)
        print("live:", m.persistence_info()["budget_bytes"])
        m.set_persistence_budget(1024)
        ds_z3native.configure(single_cycle=True)
        print("other field:", m.persistence_info()["budget_bytes"])
        m.cleanup()
        m.init(dist.group.WORLD, cfg, 64)
        print("next init:", m.persistence_info()["budget_bytes"])
        m.cleanup()
        dist.destroy_process_group()
    """
    from ds_z3native._net import free_port

    r = run_python(code.replace("PORT", str(free_port())), env={PERSISTENCE_BUDGET_ENV: "2"})
    assert r.returncode == 0, r.stderr
    for line in ("env: 2097152", "live: 524288", "other field: 1024", "next init: 524288"):
        assert line in r.stdout, r.stdout


def test_each_setter_is_configure_with_one_field(clean_settings) -> None:
    assert set(SETTERS) == set(FIELDS)
    for field, (setter, value) in SETTERS.items():
        assert setter(value) is None
        assert getattr(ds_z3native.current_settings(), field) == value, field
        doc = setter.__doc__ or ""
        assert "\n" not in doc.strip() and f"configure({field}=" in doc, (setter.__name__, doc)
        # A refusal names the setter that was called.
        with pytest.raises(ValueError, match=rf"^{setter.__name__}: expected"):
            setter(object())
    assert ds_z3native.current_settings() == Settings(
        **{field: value for field, (_, value) in SETTERS.items()})


# ---- each field documented once ------------------------------------------------------------------

def test_each_field_states_its_doc_variable_and_values_once_and_the_rest_derive_from_it() -> None:
    doc = Settings.__doc__ or ""
    table = settings.markdown_table().splitlines()
    assert len(table) == 2 + len(FIELDS)
    for field, row in zip(dataclasses.fields(Settings), table[2:]):
        variable, text = field.metadata["variable"], field.metadata["doc"]
        assert variable.startswith("DS_Z3NATIVE_") and len(text) > 100, field.name
        # help(Settings) and the docs' table show the field's doc and variable.
        assert f"\n{field.name} = {field.default!r}\n" in doc and variable in doc, field.name
        assert " ".join(text.replace("`", "").split()[:8]) in " ".join(doc.split()), field.name
        assert row.startswith(f"| `{field.name}` | `{variable}` |") and text in row, field.name
        # The exported constant is the field's variable, and the variable gives its default.
        constant = [name for name in ds_z3native.__all__ if name.endswith("_ENV")
                    and getattr(ds_z3native, name) == variable]
        assert len(constant) == 1, (field.name, constant)
        raw = {"persistence_budget_mib": "3", "prefetch_budget_mib": "3",
               "profile_store": "/p"}.get(field.name, "0" if field.default else "1")
        assert getattr(Settings.from_env({variable: raw}), field.name) != field.default, field.name
    assert len({f.metadata["variable"] for f in dataclasses.fields(Settings)}) == len(FIELDS)


# ---- the DeepSpeed config's "ds_z3native" section, on a real engine ------------------------------

_CONFIG = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _engine(config: Any) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    return engine


def _refusal(config: Any) -> str:
    try:
        _engine(config)
    except ValueError as e:
        return str(e)
    return "accepted"


def _fields(s: Settings) -> Dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(s).items()}


def _sections_on_real_engines(rank: int, world_size: int, config_dir: str) -> Dict[str, Any]:
    import torch

    import ds_z3native

    if ds_z3native.installed():  # DS_Z3NATIVE=1 in the environment installed it at import
        ds_z3native.uninstall()
    out: Dict[str, Any] = {}
    section = {"persistence_budget_mib": 512, "single_cycle": True}
    config = {**_CONFIG, "ds_z3native": section}
    ds_z3native.configure(group_reduce=False, single_cycle=False)  # before the engine
    out["before"] = _fields(ds_z3native.current_settings())
    # Without ds_z3native installed: DeepSpeed takes the config, and the section does nothing.
    _engine(config)
    out["uninstalled"] = _fields(ds_z3native.current_settings())
    ds_z3native.install()
    try:
        engine = _engine(config)
        out["installed"] = _fields(ds_z3native.current_settings())
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        out["trained"] = bool(torch.isfinite(loss).item())
        out["config_kept"] = engine._config._param_dict.get("ds_z3native") == section
        ds_z3native.configure(single_cycle=False)  # after the engine: the last one wins
        out["after_configure"] = _fields(ds_z3native.current_settings())
        # A config file: the dict DeepSpeed parsed from it.
        path = Path(config_dir) / "ds_config.json"
        path.write_text(json.dumps({**_CONFIG, "ds_z3native": {"prefetch_budget_mib": 7,
                                                               "profile_store": None}}))
        _engine(str(path))
        out["from_file"] = _fields(ds_z3native.current_settings())
        before_refusals = ds_z3native.current_settings()
        out["refused"] = {
            "bad value": _refusal({**_CONFIG, "ds_z3native": {"persistence_budget_mib": 1,
                                                              "single_cycle": "yes"}}),
            "unknown key": _refusal({**_CONFIG, "ds_z3native": {"persistence_budget": 1}}),
            "not an object": _refusal({**_CONFIG, "ds_z3native": [1]})}
        out["unchanged_by_refusals"] = ds_z3native.current_settings() == before_refusals
    finally:
        ds_z3native.uninstall()
    return out


@pytest.fixture(scope="module")
def sections(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    pytest.importorskip("deepspeed")
    env = {PERSISTENCE_BUDGET_ENV: "2", PREFETCH_BUDGET_ENV: "3"}
    return run_ranks(_sections_on_real_engines, 1, str(tmp_path_factory.mktemp("ds_config")),
                     env=env, timeout=300)[0]


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_the_config_section_is_applied_when_an_engine_is_created(sections: Dict[str, Any]) -> None:
    before = sections["before"]
    assert (before["persistence_budget_mib"], before["prefetch_budget_mib"]) == (2.0, 3.0)  # env
    assert (before["group_reduce"], before["single_cycle"]) == (False, False)  # configure()
    # The section's fields win over the environment and over configure() before the engine;
    # the fields it does not name keep theirs.
    assert sections["installed"] == {**before, "persistence_budget_mib": 512.0,
                                     "single_cycle": True}
    assert sections["trained"] and sections["config_kept"]
    # configure() after the engine replaces the section's value again.
    assert sections["after_configure"] == {**sections["installed"], "single_cycle": False}
    # A config given as a file: the section DeepSpeed read from it.
    assert sections["from_file"] == {**sections["after_configure"], "prefetch_budget_mib": 7.0}


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_deepspeed_takes_the_section_and_ignores_it_without_ds_z3native(
        sections: Dict[str, Any]) -> None:
    assert sections["uninstalled"] == sections["before"]


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_a_malformed_section_is_refused_naming_the_field_and_the_value(
        sections: Dict[str, Any]) -> None:
    refused = sections["refused"]
    assert refused["bad value"] == ("ds_z3native.single_cycle (DeepSpeed config): expected True "
                                    "or False, got 'yes'")
    assert refused["unknown key"] == ("ds_z3native.persistence_budget (DeepSpeed config): no such "
                                      "setting; the settings are " + ", ".join(FIELDS))
    assert re.match(r"ds_z3native \(DeepSpeed config\): expected an object whose keys are "
                    r"settings \(persistence_budget_mib, .*\), got \[1\]$",
                    refused["not an object"]), refused["not an object"]
    assert sections["unchanged_by_refusals"]  # nothing applied, the good field neither


def test_a_misspelt_variable_is_named_with_the_one_it_is_closest_to() -> None:
    """A DS_Z3NATIVE_* variable ds_z3native does not read (``..._MIB`` for ``..._MB``) is warned
    about when the settings are first read, with the closest real name; real ones are not."""
    import subprocess
    import sys

    from ds_z3native import settings

    assert settings.unknown_variables({
        "DS_Z3NATIVE_PERSISTENCE_BUDGET_MIB": "256", "DS_Z3NATIVE_PREFETCH_BUDGET_MB": "8",
        "DS_Z3NATIVE": "1", "DS_Z3NATIVE_CUDA": "0", "DS_Z3NATIVE_XYZ": "1", "OTHER": "1"}) == [
        ("DS_Z3NATIVE_PERSISTENCE_BUDGET_MIB", "DS_Z3NATIVE_PERSISTENCE_BUDGET_MB"),
        ("DS_Z3NATIVE_XYZ", None)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_Z3NATIVE")}
    env["DS_Z3NATIVE_PERSISTENCE_BUDGET_MIB"] = "256"
    r = subprocess.run([sys.executable, "-c", "import ds_z3native; "
                        "print(ds_z3native.current_settings().persistence_budget_mib)"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "None", r.stderr
    assert ("DS_Z3NATIVE_PERSISTENCE_BUDGET_MIB is not a ds_z3native variable: ignored (did you "
            "mean DS_Z3NATIVE_PERSISTENCE_BUDGET_MB?)") in r.stderr, r.stderr
