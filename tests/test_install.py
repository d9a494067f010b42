"""install() / uninstall() / installed() against the installed DeepSpeed (0.19.8, or 0.19.2 on
PYTHONPATH): the loader hand-over, idempotence, exact restoration, the version gate, the patch
registry, rollback on failure, and the refusal when another library owns torch.ops.dc."""

from __future__ import annotations

import logging
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from packaging.version import Version

import ds_z3native
from ds_z3native import installer
from ds_z3native.compat import registry
from helpers.dist import run_python

pytestmark = [pytest.mark.deepspeed, pytest.mark.release_matrix]

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.compile import util as ds_util  # noqa: E402
from deepspeed.ops.op_builder import builder as ds_builder  # noqa: E402
from deepspeed.ops.op_builder.dc import DeepCompileBuilder  # noqa: E402

DS_VERSION = Version(deepspeed.__version__.split("+")[0])
OLD = DS_VERSION < Version("0.19.6")  # releases that need the init_z3 KeyError fix
# Releases whose engine module imports deepspeed.compile.init_z3 at its top (0.19.8 imports it
# inside engine.compile()).
EAGER_INIT_Z3 = DS_VERSION < Version("0.19.8")


def _loader_state() -> Dict[str, Any]:
    return {"loaded_ops": dict(ds_builder.OpBuilder._loaded_ops), "dc_handle": ds_util.dc_handle,
            "meta_path": list(sys.meta_path), "init_z3": _init_z3_bindings()}


def _init_z3_bindings() -> Dict[str, Any]:
    out = {}
    for name in ("deepspeed.compile.init_z3", "deepspeed.runtime.engine"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "init_z3"):
            out[name] = module.init_z3
    return out


def _wrapper_depth(fn: Any) -> int:
    depth = 0
    while hasattr(fn, "__wrapped__"):
        fn, depth = fn.__wrapped__, depth + 1
    return depth


@pytest.fixture
def before() -> Iterator[Dict[str, Any]]:
    """DeepSpeed's loader state before the test; the test must leave it so."""
    installer.uninstall()
    state = _loader_state()
    yield state
    installer.uninstall()
    after = _loader_state()
    assert after["loaded_ops"] == state["loaded_ops"] and after["dc_handle"] is state["dc_handle"]
    assert after["meta_path"] == state["meta_path"]
    assert {k: v for k, v in after["init_z3"].items() if k in state["init_z3"]} == state["init_z3"]


def test_install_hands_our_module_to_every_loader_site(before: Dict[str, Any]) -> None:
    report = ds_z3native.install()
    ours = ds_z3native.native()
    assert ds_z3native.installed()
    assert ds_util.get_deepcompile_handle() is ours
    assert DeepCompileBuilder().load() is ours
    assert ds_builder.OpBuilder._loaded_ops["dc"] is ours
    assert installer.loader_status() == {s: True for s in report.loader_sites}
    assert report.deepspeed_version == str(DS_VERSION) and report.verdict == "supported"
    expected = (["deepcompile-z3-frozen-grad-buffer"] if OLD else []) + \
        ["deepcompile-z3-declare-frozen", "deepcompile-z3-unfrozen-guard",
         "deepcompile-z3-leaf-module-hooks", "deepcompile-z3-eager-gather",
         "deepcompile-z3-eager-generate"] + \
        (["deepcompile-z3-fallback-module-list"] if DS_VERSION >= Version("0.19.4") else [])
    assert [p for p in report.patches if p.startswith("deepcompile-z3")] == expected
    assert "deepcompile-hf-checkpoint-graph-breaks" in report.patches
    assert "gloo-collectives-outside-python-dispatch" in report.patches


def test_init_z3_is_patched_where_deepspeed_holds_it_and_restored(before: Dict[str, Any]) -> None:
    ds_z3native.install()
    import deepspeed.compile.init_z3 as init_z3_module  # 0.19.8 imports it only at compile()

    wrapped = init_z3_module.init_z3
    assert _wrapper_depth(wrapped) == (4 if OLD else 3)
    engine_module = sys.modules["deepspeed.runtime.engine"]
    if hasattr(engine_module, "init_z3"):  # 0.19.2 binds it at import
        assert engine_module.init_z3 is wrapped
    ds_z3native.uninstall()
    assert _wrapper_depth(init_z3_module.init_z3) == 0
    if hasattr(engine_module, "init_z3"):
        assert engine_module.init_z3 is init_z3_module.init_z3


def test_install_twice_is_install_once(before: Dict[str, Any]) -> None:
    first = ds_z3native.install()
    import deepspeed.compile.init_z3 as init_z3_module

    depth = _wrapper_depth(init_z3_module.init_z3)
    assert ds_z3native.install() is first
    assert _wrapper_depth(init_z3_module.init_z3) == depth
    ds_z3native.uninstall()
    ds_z3native.uninstall()
    assert not ds_z3native.installed()
    assert ds_util.dc_handle is None


def test_uninstall_restores_exactly_what_was_there(before: Dict[str, Any]) -> None:
    placeholder = types.ModuleType("placeholder_dc")  # not a dc library: torch.ops.dc stays ours
    ds_builder.OpBuilder._loaded_ops["dc"] = placeholder
    try:
        ds_z3native.install()
        assert ds_builder.OpBuilder._loaded_ops["dc"] is ds_z3native.native()
        ds_z3native.uninstall()
        assert ds_builder.OpBuilder._loaded_ops["dc"] is placeholder
        assert ds_util.dc_handle is None
    finally:
        del ds_builder.OpBuilder._loaded_ops["dc"]


def test_lazily_imported_init_z3_is_patched_at_its_import_and_never_imported_early() -> None:
    # Fresh interpreter: 0.19.8 imports deepspeed.compile.init_z3 only inside engine.compile()
    # (it is slow to import); install() must not import it, only patch it when DeepSpeed does.
    # 0.19.0 - 0.19.7 import it with deepspeed, so there it is patched at once.
    r = run_python("""
        import sys
        import deepspeed, ds_z3native
        early = "deepspeed.compile.init_z3" in sys.modules
        ds_z3native.install()
        print("EARLY", early, "deepspeed.compile.init_z3" in sys.modules)
        ds_z3native.uninstall()
        print("HOOKS_AFTER_UNINSTALL", [type(f).__name__ for f in sys.meta_path
                                        if type(f).__name__ == "_PostImportFinder"])
        ds_z3native.install()
        from deepspeed.compile import init_z3
        print("WRAPPED", hasattr(init_z3.init_z3, "__wrapped__"))
        """, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["EARLY"] == ("True True" if EAGER_INIT_Z3 else "False False"), r.stdout
    assert lines["HOOKS_AFTER_UNINSTALL"] == "[]"
    assert lines["WRAPPED"] == "True"


# ---- version gate --------------------------------------------------------------------------------

def test_older_deepspeed_is_refused_and_nothing_changes(before: Dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installer, "deepspeed_version", lambda: Version("0.18.9"))
    with pytest.raises(ds_z3native.UnsupportedDeepSpeed, match=r"DeepSpeed 0\.18\.9 is not supported"):
        ds_z3native.install()
    assert not ds_z3native.installed()
    assert _loader_state() == before


def test_newer_deepspeed_with_our_contract_installs_with_a_warning(
        before: Dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The contract read is the real one, of the DeepSpeed installed here (which matches ours).
    monkeypatch.setattr(installer, "deepspeed_version", lambda: Version("0.20.0"))
    with caplog.at_level(logging.WARNING, logger="ds_z3native"):
        report = ds_z3native.install()
    assert report.verdict == "newer-compatible"
    assert "frozen-grad-buffer" not in " ".join(report.patches)  # targets 0.19.0 - 0.19.5 only
    assert "deepcompile-z3-declare-frozen" in report.patches
    assert any("newer than the tested range" in r.getMessage() for r in caplog.records)
    assert ds_util.get_deepcompile_handle() is ds_z3native.native()


def test_newer_deepspeed_with_a_changed_contract_is_refused(
        before: Dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A copy of the installed DeepSpeed's init.cpp in which reduce_grad gained an argument.
    from ds_z3native.compat import contract

    real = contract.deepspeed_root()
    fake = tmp_path / "deepspeed"
    (fake / "ops" / "csrc" / "compile").mkdir(parents=True)
    (fake / "compile").mkdir()
    text = (real / "ops" / "csrc" / "compile" / "init.cpp").read_text()
    changed = text.replace('"reduce_grad(Tensor a, int graph_id, int id)',
                           '"reduce_grad(Tensor a, int graph_id, int id, int bucket)')
    assert changed != text
    (fake / "ops" / "csrc" / "compile" / "init.cpp").write_text(changed)
    monkeypatch.setattr(contract, "deepspeed_root", lambda: fake)
    monkeypatch.setattr(installer, "deepspeed_version", lambda: Version("0.20.0"))
    with pytest.raises(ds_z3native.UnsupportedDeepSpeed, match=r"op dc::reduce_grad"):
        ds_z3native.install()
    assert not ds_z3native.installed()
    assert _loader_state() == before


# ---- patch registry and rollback ------------------------------------------------------------------

def _write_module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(body))


_PATCH_MODULE = """
    from packaging.version import Version
    from ds_z3native.compat import Patch

    applied = []

    def _apply_good():
        applied.append("good")
        return lambda: applied.remove("good")

    def _apply_bad():
        raise RuntimeError("boom in bad patch")

    GOOD = Patch("test-good", "records itself", _apply_good, Version("0.19.0"), None)
    BAD = Patch("test-bad", "fails", _apply_bad, Version("0.19.0"), None)
    OLD_ONLY = Patch("test-old-only", "targets 0.18", _apply_bad, Version("0.18.0"), Version("0.18.9"))
    PATCHES = [GOOD, OLD_ONLY] + ({FAIL})
    """


def _patch_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, fail: bool) -> types.ModuleType:
    _write_module(tmp_path, name, _PATCH_MODULE.replace("{FAIL}", "[BAD]" if fail else "[]"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "OPTIONAL_MODULES", (name,))
    import importlib

    return importlib.import_module(name)


def test_optional_patch_module_is_applied_and_undone(before: Dict[str, Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _patch_module(tmp_path, monkeypatch, "dsz_test_patches_ok", fail=False)
    report = ds_z3native.install()
    assert "test-good" in report.patches and "test-old-only" not in report.patches
    assert mod.applied == ["good"]
    ds_z3native.uninstall()
    assert mod.applied == []


def test_failing_patch_undoes_everything(before: Dict[str, Any], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _patch_module(tmp_path, monkeypatch, "dsz_test_patches_bad", fail=True)
    with pytest.raises(ds_z3native.InstallError, match=r"patch test-bad .*boom in bad patch.*undone"):
        ds_z3native.install()
    assert mod.applied == []
    assert not ds_z3native.installed()
    assert _loader_state() == before


def test_registry_tolerates_an_absent_optional_module_but_not_a_broken_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "OPTIONAL_MODULES", ("dsz_no_such_patch_module",))
    assert [p.name for p in registry.all_patches()] == \
        ["deepcompile-z3-frozen-grad-buffer", "deepcompile-z3-declare-frozen",
         "deepcompile-z3-unfrozen-guard", "deepcompile-z3-leaf-module-hooks",
         "deepcompile-hf-checkpoint-graph-breaks", "hf-grouped-mm-fallback-backward",
         "deepcompile-z3-eager-gather",
         "deepcompile-z3-eager-generate", "deepcompile-prefetch-budget",
         "deepcompile-canonical-graph-ids", "deepcompile-cache-checkpoint-rng",
         "deepcompile-generator-cache-key", "deepcompile-sourceless-symbols",
         "deepcompile-single-cycle-regroup", "deepcompile-grouped-reduce",
         "deepcompile-typed-end-backward", "deepcompile-attention-rng",
         "inductor-attention-aux-outputs",
         "deepcompile-profile-store", "deepcompile-warm-start",
         "deepcompile-kwargs-dependencies", "deepcompile-resume-schedule",
         "deepcompile-persistent-group", "deepcompile-symbolic-input-guards",
         "deepcompile-keep-automatic-dynamic", "deepcompile-ranks-compile-together",
         "deepcompile-aot-partial-constructions",
         "deepcompile-cpu-device", "cuda-memory-counters", "deepcompile-pass-gc",
         "deepcompile-one-rank-profile",
         "gloo-collectives-outside-python-dispatch",
         "zero3-coalesced-gather-waits-on-every-handle", "hf-trainer-zero3-flos",
         "engine-train-unchanged-mode", "engine-zero-grad-param-list",
         "zero3-release-param-list", "deepcompile-z3-fallback-module-list",
         "zero3-flat-grad-norm", "zero3-overflow-after-reductions", "engine-config-section"]
    _write_module(tmp_path, "dsz_test_patches_broken", "raise ImportError('half-written module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "OPTIONAL_MODULES", ("dsz_test_patches_broken",))
    with pytest.raises(ImportError, match="half-written"):
        registry.all_patches()


def test_registry_lists_the_checkpoint_recompute_module() -> None:
    assert "ds_z3native.compat.checkpoint_recompute" in registry.OPTIONAL_MODULES
    names: List[str] = [p.name for p in registry.all_patches()]
    assert len(names) == len(set(names))


# ---- another library owns torch.ops.dc ----------------------------------------------------------

def test_refuses_when_another_library_registered_the_dc_ops() -> None:
    # In a fresh interpreter: a dc namespace defined first (as DeepSpeed's own op would), and
    # DeepSpeed's loader holding that library's module.
    r = run_python("""
        import sys, types, torch
        lib = torch.library.Library("dc", "DEF")
        lib.define("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor")
        import deepspeed, ds_z3native
        from deepspeed.compile import util
        from deepspeed.ops.op_builder.builder import OpBuilder
        theirs = types.ModuleType("deepspeed.ops.dc_op")
        OpBuilder._loaded_ops["dc"] = theirs
        try:
            ds_z3native.install()
            print("INSTALLED")
        except ds_z3native.DcNamespaceTaken as e:
            print("REFUSED", e)
        print("STATE", ds_z3native.installed(), OpBuilder._loaded_ops["dc"] is theirs,
              util.dc_handle is None, "ds_z3native._C" in sys.modules)
        """, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "REFUSED" in out and "INSTALLED" not in out, out
    assert "already registered by another library" in out
    assert "deepspeed.ops.dc_op" in out and "Restart the process" in out
    assert "STATE False True True False" in out


def test_install_says_on_rank_0_that_it_is_active(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up line names the version, the build and the patch count, on rank 0 only, and
    reaches stderr where the application configured no logging."""
    import logging

    from ds_z3native import installer

    report = installer.InstallReport("0.19.8", "supported", (), ("a", "b", "c"))
    logger = logging.getLogger(installer.STARTUP_LOGGER)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logger.level)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    records: List[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    monkeypatch.setenv("RANK", "1")
    installer._announce(report, "cuda")
    assert logger.handlers == []
    monkeypatch.setenv("RANK", "0")
    installer._announce(report, "cuda")
    assert len(logger.handlers) == 1 and not logger.propagate
    logger.addHandler(Keep())
    installer._announce(report, "cpu")
    assert [r.getMessage() for r in records] == [
        f"ds_z3native {ds_z3native.__version__} active in DeepSpeed 0.19.8: its CPU build of the dc "
        "op and 3 patches (`ds-z3native doctor` checks this environment; docs/patches.md lists "
        "the patches)"]
