"""Zero-code activation: DS_Z3NATIVE=1 and ``import deepspeed`` installs ds_z3native.

Each case runs a fresh interpreter that processes a site directory holding the start-up file
(``site.addsitedir``: what the interpreter does with site-packages at start-up), so the cases
exercise the shipped line itself, whether or not this environment's install already has it.
``test_startup_file_is_installed`` checks that the installed package put it into site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest

import ds_z3native_autoload as autoload

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("site")
    autoload.write_pth(str(d))
    return d


def _run(site_dir: Path, value: Optional[str], body: str) -> subprocess.CompletedProcess:
    env: Dict[str, str] = {k: v for k, v in os.environ.items() if k != autoload.ENV_VAR}
    if value is not None:
        env[autoload.ENV_VAR] = value
    env.setdefault("DS_ACCELERATOR", "cpu")
    code = f"import site, sys\nsite.addsitedir({str(site_dir)!r})\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)


def _fields(stdout: str) -> Dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if line.startswith("@"))


def test_startup_file_is_installed() -> None:
    files = autoload.installed_pth_files()
    assert files, ("ds_z3native_autoload.pth is not in site-packages: the installed ds_z3native "
                   "predates the build_py hook; rebuild with pip install --no-build-isolation -e .")
    for path in files:
        assert Path(path).read_text() == autoload.PTH_LINE, f"{path} is stale"


@pytest.mark.parametrize("value", [None, "off"])
def test_unset_or_off_imports_nothing_and_installs_nothing(site_dir: Path, value: Optional[str]) -> None:
    r = _run(site_dir, value, """
        print("@startup", sorted(m for m in ("torch", "ds_z3native", "ds_z3native_autoload", "deepspeed")
                                 if m in sys.modules))
        import deepspeed, ds_z3native
        from deepspeed.compile import util
        print("@after", ds_z3native.installed(), util.dc_handle is None)
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    f = _fields(r.stdout)
    # "off" is read by the module (the start-up line only skips "" and "0"), which then does nothing.
    expected = "['ds_z3native_autoload']" if value == "off" else "[]"
    assert f["@startup"] == expected, r.stdout
    assert f["@after"] == "False True"


@pytest.mark.parametrize("value", ["", "0"])
def test_empty_or_zero_costs_an_environment_lookup(site_dir: Path, value: str) -> None:
    r = _run(site_dir, value, """
        print("@startup", sorted(m for m in ("torch", "ds_z3native", "ds_z3native_autoload")
                                 if m in sys.modules))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _fields(r.stdout)["@startup"] == "[]"


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                             ("", False), ("0", False), ("off", False), ("No", False)])
def test_values_of_the_variable(value: str, expected: bool) -> None:
    assert autoload.requested(value) is expected


def test_set_installs_at_import_deepspeed(site_dir: Path) -> None:
    r = _run(site_dir, "1", """
        print("@startup", sorted(m for m in ("torch", "ds_z3native", "deepspeed") if m in sys.modules))
        import deepspeed
        print("@imported", "ds_z3native" in sys.modules)
        import ds_z3native
        from deepspeed.compile.util import get_deepcompile_handle
        from deepspeed.ops.op_builder.dc import DeepCompileBuilder
        ours = ds_z3native.native()
        print("@installed", ds_z3native.installed(), get_deepcompile_handle() is ours,
              DeepCompileBuilder().load() is ours)
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    f = _fields(r.stdout)
    assert f["@startup"] == "[]"  # the hook waits for deepspeed; torch is not imported early
    assert f["@imported"] == "True"
    assert f["@installed"] == "True True True"


def test_unreadable_value_fails_the_import(site_dir: Path) -> None:
    r = _run(site_dir, "maybe", """
        try:
            import deepspeed
            print("@result imported")
        except Exception as e:
            print("@result", type(e).__name__, str(e).splitlines()[0])
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _fields(r.stdout)["@result"].startswith("AutoloadError DS_Z3NATIVE='maybe' is not understood")


def test_install_failure_fails_import_deepspeed_every_time(site_dir: Path) -> None:
    # Another library owns torch.ops.dc: install() must refuse, and `import deepspeed` with it,
    # rather than run DeepSpeed without ds_z3native. A retried import fails the same way.
    r = _run(site_dir, "1", """
        import torch
        lib = torch.library.Library("dc", "DEF")
        lib.define("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor")
        for attempt in (1, 2):
            try:
                import deepspeed
                print("@attempt%d imported" % attempt)
            except Exception as e:
                cause = e.__cause__
                print("@attempt%d" % attempt, type(e).__name__, isinstance(e, ImportError),
                      type(cause).__name__, "already registered by another library" in str(e))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    f = _fields(r.stdout)
    assert f["@attempt1"] == "AutoloadError False DcNamespaceTaken True", r.stdout
    assert f["@attempt2"] == f["@attempt1"]
