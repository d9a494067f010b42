"""Verified patches: every patch names what it wraps, the code it was tested against is recorded
per DeepSpeed release (compat/fingerprints.json), and install() refuses a patch whose DeepSpeed
target is not that code (another release's, an edited file, or an object replaced at run time)."""

from __future__ import annotations

import importlib
import json
import logging
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from packaging.version import Version

from ds_z3native.compat import Patch, SUPPORTED_MAX, SUPPORTED_MIN, fingerprints
from ds_z3native.compat.fingerprints import (MISSING, Fingerprint, Status, check_targets,
                                             load_table, source_fingerprint, split_target,
                                             target_package)
from ds_z3native.compat.registry import all_patches
from helpers.dist import run_python

SUPPORTED = [f"0.19.{i}" for i in range(SUPPORTED_MIN.micro,
                                         SUPPORTED_MAX.micro + 1)]


def _deepspeed_targets() -> Dict[str, Any]:
    return {t: p for p in all_patches() for t in p.wraps if target_package(t) == "deepspeed"}


# ---- the declarations and the table ---------------------------------------------------------

def test_every_patch_declares_module_qualified_targets() -> None:
    for patch in all_patches():
        assert patch.wraps, f"{patch.name} declares no target"
        for target in patch.wraps:
            module, qualname = split_target(target)
            assert module.split(".")[0] in ("deepspeed", "torch", "transformers"), target


def test_patch_names_are_kebab_case_and_targets_module_qualified() -> None:
    def noop() -> Any:
        return lambda: None

    with pytest.raises(ValueError, match="kebab-case"):
        Patch("checkpoint_recompute_frozen", "snake case", noop)
    with pytest.raises(ValueError, match="module:qualname"):
        Patch("a-patch", "dotted target", noop, wraps=("deepspeed.runtime.engine.DeepSpeedEngine",))


def test_every_supported_release_records_every_deepspeed_target() -> None:
    """Adding a patch (or a target) without recording its fingerprints fails here: run
    scripts/record_fingerprints.sh."""
    table = load_table()
    recorded = table.get("deepspeed", {})
    assert sorted(recorded, key=Version) == SUPPORTED
    for version in SUPPORTED:
        missing = sorted(set(_deepspeed_targets()) - set(recorded[version]))
        assert not missing, f"DeepSpeed {version}: no fingerprint for {missing}"


def test_every_deepspeed_target_exists_in_the_releases_its_patches_apply_to() -> None:
    """A target a release lacks is recorded as missing; a patch that applies to that release
    must then guard it (hasattr), which only the targets below do."""
    guarded = {
        "deepspeed.compile.profilers.graph_profile:MemoryProfilingInterpreter.run",
        "deepspeed.compile.profilers.comm_profile:run_all_gather",
        "deepspeed.runtime.zero.partitioned_param_coordinator:update_recompute_parameters",
        "deepspeed.compile.passes.prefetch:MAX_BUFFERED_SIZE",
        "deepspeed.compile.passes.prefetch:schedule_prefetch",
        "deepspeed.compile.inductor:patch_compiler",
    } | {f"deepspeed.comm.torch:TorchBackend.{n}" for n in
         importlib.import_module("ds_z3native.compat.gloo_collectives").COLLECTIVES}
    table = load_table()["deepspeed"]
    absent = []
    for patch in all_patches():
        for version in SUPPORTED:
            if not patch.targets(Version(version)):
                continue
            for target in patch.wraps:
                if target_package(target) == "deepspeed" and target not in guarded \
                        and table[version][target].missing:
                    absent.append(f"{patch.name} on {version}: {target}")
    assert not absent, absent


def test_other_packages_are_recorded_for_a_tested_version() -> None:
    table = load_table()
    others = {t for p in all_patches() for t in p.wraps if target_package(t) != "deepspeed"}
    for target in others:
        package = target_package(target)
        assert any(target in prints for prints in table.get(package, {}).values()), target


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_the_installed_deepspeed_matches_its_recorded_fingerprints() -> None:
    """The live code of the installed (supported) DeepSpeed against the table: fails when a
    release's code differs from what was recorded (regenerate after reviewing the change)."""
    import deepspeed  # noqa: F401

    version = str(Version(Version(deepspeed.__version__.split("+")[0]).base_version))
    assert version in load_table()["deepspeed"], f"DeepSpeed {version} is not recorded"
    for module in sorted({split_target(t)[0] for t in _deepspeed_targets()}):
        try:  # the live objects too, where this torch can import them
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - their source is still compared
            logging.getLogger(__name__).info("%s not importable here: %s", module, e)
    checks = [c for p in all_patches() for c in check_targets(p.name, p.wraps)
              if c.package == "deepspeed"]
    assert checks
    wrong = [f"{c.patch}: {c.target}: {c.status.value}: {c.explain()}" for c in checks
             if c.status is not Status.MATCHES]
    assert not wrong, "\n".join(wrong)


# ---- the comparison, on a package of our own ----------------------------------------------------

@pytest.fixture
def toy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "dszfp_toy"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(textwrap.dedent('''
        import functools
        import os.path as paths

        LIMIT = 4e9

        def deco(fn):
            @functools.wraps(fn)
            def inner(*a, **k):
                return fn(*a, **k)
            return inner

        class Engine:
            def __init__(self):
                self.__table = {}

            @deco
            def step(self, loss, retain=False):
                return loss
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.startswith("dszfp_toy")]:
        del sys.modules[name]


def test_fingerprints_read_signature_and_source(toy_package: Path) -> None:
    step = source_fingerprint("dszfp_toy.mod:Engine.step")
    assert step.signature == "(self, loss, retain=False)" and len(step.source_sha256 or "") == 64
    assert source_fingerprint("dszfp_toy.mod:LIMIT").signature == "attribute"
    assert source_fingerprint("dszfp_toy.mod:Engine.__table").signature == "attribute"
    assert source_fingerprint("dszfp_toy.mod:Engine.absent") is MISSING
    # A module's import binds a name like an assignment does: its statement is the source.
    for bound in ("paths", "functools"):
        assert source_fingerprint(f"dszfp_toy.mod:{bound}").signature == "attribute"
    assert source_fingerprint("dszfp_toy.mod:os") is MISSING  # `import os.path as paths`
    assert "dszfp_toy.mod" not in sys.modules  # read from the file, nothing imported
    text = (toy_package / "mod.py").read_text()
    (toy_package / "mod.py").write_text(text.replace("return loss", "return loss * 2"))
    changed = source_fingerprint("dszfp_toy.mod:Engine.step")
    assert changed.signature == step.signature and changed.source_sha256 != step.source_sha256


def _table(target: str, version: str, fp: Fingerprint) -> Dict[str, Any]:
    return {"dszfp_toy": {version: {target: fp}}}


def test_check_statuses(toy_package: Path) -> None:
    target = "dszfp_toy.mod:Engine.step"
    fp = source_fingerprint(target)
    other = Fingerprint(fp.signature, "0" * 64)
    versions = {"dszfp_toy": "1.0.0"}

    def status(table: Dict[str, Any], version: str = "1.0.0") -> Status:
        return check_targets("toy-patch", [target], table, {"dszfp_toy": version})[0].status

    assert status(_table(target, "1.0.0", fp)) is Status.MATCHES
    assert status(_table(target, "1.0.0", other)) is Status.CHANGED
    assert status(_table(target, "0.9.0", fp), "1.0.0") is Status.MATCHES_RECORDED
    assert status(_table(target, "0.9.0", other), "1.0.0") is Status.UNKNOWN
    two = {"dszfp_toy": {"0.8.0": {target: fp}, "0.9.0": {target: other}}}
    check = check_targets("toy-patch", [target], two, {"dszfp_toy": "1.0.0"})[0]
    assert check.status is Status.MATCHES_RECORDED and check.verdict == "matches 0.8.0", check
    check = check_targets("toy-patch", [target], _table(target, "1.0.0", other), versions)[0]
    assert not check.strict and check.verdict == "unverified"  # only DeepSpeed's are strict

    module = importlib.import_module("dszfp_toy.mod")
    assert status(_table(target, "1.0.0", fp)) is Status.MATCHES  # the decorated original
    module.Engine.step = lambda self, loss, retain=False: loss
    check = check_targets("toy-patch", [target], _table(target, "1.0.0", fp), versions)[0]
    assert check.status is Status.REPLACED and "replaced by" in check.found, check


def test_a_target_in_a_package_that_is_not_installed_is_no_warning() -> None:
    """transformers for a user without it: the patch never edits it, so nothing to report."""
    check = check_targets("toy-patch", ["dszfp_absent.mod:f"], {}, {"dszfp_absent": None})[0]
    assert check.status is Status.NOT_INSTALLED and check.status.ok, check
    assert fingerprints.package_version("dszfp_absent_package") is None


# ---- install() ------------------------------------------------------------------------------

_REPLACED = "deepspeed.runtime.engine:DeepSpeedEngine.forward"

_REFUSAL = """
    import sys, json, deepspeed
    import ds_z3native
    from ds_z3native.compat import import_hooks
    from deepspeed.compile import util
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.runtime.engine import DeepSpeedEngine
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    def forward(self, *inputs, **kwargs):  # not DeepSpeed's
        return self.module(*inputs, **kwargs)

    DeepSpeedEngine.forward = forward
    before = {name: DeepSpeedEngine.__dict__[name] for name in ("compile", "backward")}
    fetch = coordinator.PartitionedParameterCoordinator.fetch_sub_module
    meta_path = list(sys.meta_path)
    out = {}
    try:
        out["report"] = repr(ds_z3native.install())
    except ds_z3native.UnverifiedPatchTarget as e:
        out["error"] = str(e)
        out["checks"] = [(c.patch, c.target, c.status.value) for c in e.checks]
    out["installed"] = ds_z3native.installed()
    out["untouched"] = (all(DeepSpeedEngine.__dict__[n] is f for n, f in before.items())
                        and DeepSpeedEngine.forward is forward
                        and coordinator.PartitionedParameterCoordinator.fetch_sub_module is fetch
                        and "dc" not in OpBuilder._loaded_ops and util.dc_handle is None
                        and sys.meta_path == meta_path
                        and not any(import_hooks.pending(m) for m in list(sys.modules) + [
                            "deepspeed.compile.init_z3", "deepspeed.compile.backend"]))
    out["native_loaded"] = "ds_z3native._C" in sys.modules
    out["version"] = deepspeed.__version__
    print("RESULT " + json.dumps(out))
"""


def _result(stdout: str) -> Dict[str, Any]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_a_replaced_deepspeed_function_makes_install_refuse_and_change_nothing() -> None:
    r = run_python(_REFUSAL, timeout=300, env={fingerprints.UNVERIFIED_ENV: ""})
    assert r.returncode == 0, r.stderr[-3000:]
    out = _result(r.stdout)
    assert "report" not in out, out
    version = out["version"].split("+")[0]
    error = out["error"]
    assert "deepcompile-z3-eager-gather" in error  # the patch that wraps it
    assert _REPLACED in error  # the target
    assert f"DeepSpeed {version}" in error  # the version
    assert "replaced by forward defined at <string>" in error
    assert fingerprints.UNVERIFIED_ENV + "=deepcompile-z3-eager-gather" in error  # what to do
    assert [c for c in out["checks"] if c[1] != _REPLACED] == []
    assert out["installed"] is False and out["untouched"] is True, out
    assert out["native_loaded"] is False, out  # refused before anything was loaded


@pytest.mark.deepspeed
def test_the_override_applies_an_unverified_patch_with_a_warning() -> None:
    code = "import logging; logging.basicConfig()\n" + textwrap.dedent(_REFUSAL).replace(
        'out["report"] = repr(ds_z3native.install())',
        'out["report"] = list(ds_z3native.install().unverified)')
    r = run_python(code, timeout=300,
                   env={fingerprints.UNVERIFIED_ENV: "deepcompile-z3-eager-gather"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = _result(r.stdout)
    assert out["installed"] is True, out
    assert out["report"] == [f"deepcompile-z3-eager-gather: {_REPLACED}"], out
    assert "unverified" in r.stderr and "allowed by " + fingerprints.UNVERIFIED_ENV in r.stderr


@pytest.mark.deepspeed
def test_an_unrecorded_transformers_version_is_unverified_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """transformers (and torch) targets vary with the versions users run: without a record of
    the running version, install() patches and says so (an info line; doctor's table)."""
    import ds_z3native
    from ds_z3native import installer

    raw = json.loads(fingerprints.TABLE_PATH.read_text())
    raw["packages"].pop("transformers", None)
    table = tmp_path / "fingerprints.json"
    table.write_text(json.dumps(raw))
    monkeypatch.setattr(fingerprints, "TABLE_PATH", table)
    installer.uninstall()
    try:
        with caplog.at_level(logging.INFO, logger="ds_z3native"):
            report = ds_z3native.install()
        target = "transformers.configuration_utils:PreTrainedConfig.to_dict"
        assert f"deepcompile-hf-checkpoint-graph-breaks: {target}" in report.unverified
        assert any(target in r.getMessage() and "unverified" in r.getMessage()
                   for r in caplog.records)
    finally:
        installer.uninstall()


@pytest.mark.deepspeed
def test_the_generator_records_the_running_release(tmp_path: Path) -> None:
    table = tmp_path / "fingerprints.json"
    shutil.copy(fingerprints.TABLE_PATH, table)
    assert fingerprints.main(["--check", "--table", str(table), "--package", "deepspeed"]) == 0
    raw = json.loads(table.read_text())
    raw["packages"]["deepspeed"] = {}
    table.write_text(json.dumps(raw))
    assert fingerprints.main(["--check", "--table", str(table), "--package", "deepspeed"]) == 1
    assert fingerprints.main(["--write", "--table", str(table), "--package", "deepspeed"]) == 0
    assert fingerprints.main(["--check", "--table", str(table), "--package", "deepspeed"]) == 0
    assert list(load_table(table)["deepspeed"]) == [fingerprints.package_version("deepspeed")]


# ---- the declarations are complete ------------------------------------------------------------

_WHAT_EACH_PATCH_CHANGES = """
import importlib, json, sys, types
import deepspeed
from ds_z3native.compat import deepspeed_version
from ds_z3native.compat.fingerprints import split_target
from ds_z3native.compat.registry import all_patches, patches_for

for p in all_patches():
    for t in p.wraps:
        try:
            importlib.import_module(split_target(t)[0])
        except Exception:
            pass
import transformers.configuration_utils

WATCHED = ("deepspeed", "transformers.configuration_utils", "torch._dynamo.backends.common")

def snapshot():
    slots = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or not name.startswith(WATCHED):
            continue
        for attr, value in list(vars(module).items()):
            slots[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for member, obj in list(vars(value).items()):
                    slots[(name, value.__qualname__ + "." + member)] = obj
    return slots

def unmangle(qualname):
    *outer, last = qualname.split(".")
    if outer and last.startswith("_" + outer[-1].lstrip("_") + "__"):
        last = last[len(outer[-1].lstrip("_")) + 1:]
    return ".".join(outer + [last])

def resolve(target):
    module, qualname = split_target(target)
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        if isinstance(obj, type) and part.startswith("__") and not part.endswith("__"):
            part = "_" + obj.__name__.lstrip("_") + part
        obj = vars(obj).get(part) if isinstance(obj, type) else getattr(obj, part, None)
    return obj

out = {}
for patch in patches_for(deepspeed_version()):
    before = snapshot()
    declared = {t: resolve(t) for t in patch.wraps}
    undo = patch.apply()
    try:
        after = snapshot()
    finally:
        undo()
    changed = [k for k in before if k in after and after[k] is not before[k]]
    changed += [k for k in after if k not in before]
    undeclared = []
    for module, qualname in changed:
        target = module + ":" + unmangle(qualname)
        if target in declared:
            continue
        original = before.get((module, qualname))
        if original is not None and any(original is obj for obj in declared.values()):
            continue  # a module's own `from x import f` binding of a declared target
        undeclared.append(target)
    out[patch.name] = sorted(undeclared)
    assert snapshot().keys() == before.keys()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_each_patch_changes_only_what_it_declares() -> None:
    """Every patch for the installed release, applied alone: each attribute of DeepSpeed (and of
    the transformers/torch modules patched) that it replaces is one of its declared targets, or
    a module's ``from`` import binding of one."""
    r = run_python(_WHAT_EACH_PATCH_CHANGES, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = _result(r.stdout)
    assert out, r.stdout
    assert {name: wrong for name, wrong in out.items() if wrong} == {}
