"""``ds-z3native doctor``: versions, build, would install() work, zero-code activation, self-test.

Each case runs the doctor in a fresh interpreter, as a user does. The first runs it from a
virtual environment whose site-packages holds the start-up file (as a pip install puts it
there), so that its activation check sees a real ``import deepspeed`` under DS_Z3NATIVE=1
whatever this machine's own site-packages holds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from helpers.env import without_autoload
from helpers.venv_site import see_outer_site, venv_site

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return without_autoload(**(extra or {}))


def _by_name(report: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def _show(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv that sees this interpreter's packages, whose own site-packages holds the start-up
    file, behind a path entry for the directory ds_z3native_autoload is imported from.

    ``--system-site-packages`` gives the base interpreter's packages only: when the tests run
    from a virtualenv, torch and DeepSpeed live in that virtualenv's site-packages, so a .pth
    adds those as site directories (their own .pth files, editable installs', run too)."""
    import ds_z3native_autoload

    root = tmp_path_factory.mktemp("venv")
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                        str(root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, _show(r)
    python = str(root / "bin" / "python")
    # .pth files run in name order: the path entries first, as pip's editable install does.
    see_outer_site(python, "00-ds_z3native-path.pth",
                   [os.path.dirname(ds_z3native_autoload.__file__)])
    site_dir, _ = venv_site(python)
    ds_z3native_autoload.write_pth(site_dir)
    r = subprocess.run([python, "-c", "import torch, deepspeed, ds_z3native"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, "the test venv does not see this environment's packages:\n" + \
        _show(r)
    return python


@pytest.mark.deepspeed
@pytest.mark.slow
def test_doctor_json_reports_a_ready_environment(venv_python: str) -> None:
    """Valid JSON naming the running DeepSpeed; every check passes where ds_z3native is installed
    with its start-up file: install() would succeed with this version's patches, DS_Z3NATIVE=1
    installs it at `import deepspeed` (checked in a fresh interpreter), the self-test passes."""
    import deepspeed

    from ds_z3native.compat import deepspeed_version
    from ds_z3native.compat.registry import patches_for

    r = subprocess.run([venv_python, "-m", "ds_z3native", "doctor", "--json"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, _show(r)
    report = json.loads(r.stdout)  # stdout holds the JSON alone (DeepSpeed's logs go to stderr)
    assert report["versions"]["deepspeed"] == deepspeed.__version__
    checks = _by_name(report)
    assert [c["name"] for c in report["checks"]] == [
        "python", "torch", "cuda", *(["nccl"] if "nccl" in checks else []), "native extension",
        "deepspeed", "install() would succeed", "patches for this DeepSpeed", "patch fingerprints",
        "DS_Z3NATIVE activation", "demo packages", "self-test"]
    failed = [c for c in report["checks"] if c["status"] == "FAIL"]
    assert report["ok"] and not failed, failed
    assert checks["deepspeed"]["data"]["version"] == deepspeed.__version__
    install = checks["install() would succeed"]
    assert install["status"] == "PASS" and install["data"]["verdict"] == "supported", install
    assert install["data"]["mismatches"] == [] and install["data"]["dc_owner"] is None
    assert [p["name"] for p in checks["patches for this DeepSpeed"]["data"]["patches"]] == \
        [p.name for p in patches_for(deepspeed_version())]
    prints = checks["patch fingerprints"]
    assert prints["status"] in ("PASS", "WARN"), prints  # WARN: an unrecorded torch/transformers
    assert {(t["patch"], t["target"]) for t in prints["data"]["targets"]} == \
        {(p.name, t) for p in patches_for(deepspeed_version()) for t in p.wraps}
    assert all(t["verdict"] == "matches" for t in prints["data"]["targets"]
               if t["package"] == "deepspeed"), prints
    activation = checks["DS_Z3NATIVE activation"]
    assert activation["status"] == "PASS", activation
    assert activation["data"]["probe"] == {"hook_armed": True, "installed": True,
                                           "deepspeed": deepspeed.__version__}
    assert activation["data"]["requested"] is False
    selftest = checks["self-test"]
    assert selftest["status"] == "PASS", selftest
    names = [c["name"] for c in selftest["data"]["checks"]]
    assert "a gradient for a frozen param is refused" in names
    assert all(c["ok"] for c in selftest["data"]["checks"])


def test_unreadable_ds_z3native_fails() -> None:
    """DS_Z3NATIVE=maybe would make `import deepspeed` raise: FAIL, exit 1, with what to do."""
    r = subprocess.run([sys.executable, "-m", "ds_z3native", "doctor", "--json", "--no-selftest"],
                       cwd=ROOT, env=_env({"DS_Z3NATIVE": "maybe"}), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 1, _show(r)
    report = json.loads(r.stdout)
    assert report["ok"] is False and report["counts"]["FAIL"] >= 1
    activation = _by_name(report)["DS_Z3NATIVE activation"]
    assert activation["status"] == "FAIL", activation
    assert "'maybe' is not understood" in activation["detail"]
    assert activation["fix"] == "set DS_Z3NATIVE=1 or unset it"


def test_ds_z3native_set_without_the_startup_hook_fails() -> None:
    """DS_Z3NATIVE=1 set after the interpreter started (so the start-up file never armed the
    hook): DeepSpeed would run without ds_z3native although the user asked for it. One verdict
    line per check, the FAIL followed by what to do, and a closing NOT ready line; exit 1."""
    code = textwrap.dedent("""
        import os, sys
        os.environ["DS_Z3NATIVE"] = "1"
        from ds_z3native.cli import main
        sys.exit(main(["doctor", "--no-selftest"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 1, _show(r)
    lines: List[str] = r.stdout.splitlines()
    verdicts = [ln for ln in lines if ln.startswith("[")]
    assert all(ln[:6] in ("[PASS]", "[WARN]", "[FAIL]") for ln in verdicts), verdicts
    fail = [i for i, ln in enumerate(lines) if ln.startswith("[FAIL] DS_Z3NATIVE activation")]
    assert len(fail) == 1, _show(r)
    assert "the start-up hook did not run" in lines[fail[0]]
    assert lines[fail[0] + 1].strip().startswith("-> "), lines[fail[0] + 1]
    assert "ds_z3native.install()" in lines[fail[0] + 1]
    assert lines[-1].endswith("NOT ready: fix the FAIL lines above"), lines[-1]


@pytest.mark.deepspeed
@pytest.mark.parametrize("tables", [False, True], ids=["default", "tables"])
def test_text_report_has_one_aligned_verdict_per_check_and_no_deepspeed_notice(
        tables: bool) -> None:
    """As a terminal shows it (stderr and stdout in one stream), with DeepSpeed left to detect
    its accelerator: between the title and the closing line there are only verdict lines and
    their fixes; every label fits the label column, two spaces before each detail; DeepSpeed's
    'Setting accelerator to CPU' notice is not among them and the deepspeed line names the
    accelerator DeepSpeed chose. The fingerprints' table follows its verdict with ``--tables``,
    or when that verdict is not PASS."""
    from ds_z3native.doctor import LABEL_WIDTH, LABELS

    env = _env()
    env.pop("DS_ACCELERATOR", None)
    r = subprocess.run([sys.executable, "-m", "ds_z3native", "doctor", "--no-selftest"]
                       + (["--tables"] if tables else []), cwd=ROOT,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-6000:]}"
    lines = r.stdout.splitlines()
    title = lines.index("ds-z3native doctor")
    body = lines[title + 1:-1]
    assert re.match(r"\d+ PASS, \d+ WARN, 0 FAIL in [0-9.]+ s: ready", lines[-1]), lines[-1]
    assert not [ln for ln in r.stdout.splitlines() if "Setting accelerator" in ln], r.stdout
    detail_at = len("[PASS] ") + LABEL_WIDTH + 2
    # Under a verdict, at the detail column: its fix (WARN, FAIL) or its table.
    verdicts = [ln for ln in body if not ln.startswith(" " * detail_at)]
    assert verdicts and all(re.match(r"\[(PASS|WARN|FAIL)\] ", ln) for ln in verdicts), body
    fingerprints = next(i for i, ln in enumerate(body) if ln[7:detail_at].rstrip()
                        == "patch fingerprints")
    if tables or not body[fingerprints].startswith("[PASS]"):
        header = next(ln for ln in body[fingerprints + 1:] if not ln.strip().startswith("-> "))
        assert header.split()[:3] == ["patch", "target", "fingerprint"], body
        rows = [ln.split() for ln in body[body.index(header) + 1:]
                if ln.startswith(" " * detail_at) and not ln.strip().startswith("-> ")]
        assert rows and all(row[2] in ("matches", "unverified", "REFUSED") for row in rows), rows
    else:  # all match: the verdict's count says so, no table
        assert re.search(r": (\d+) match the fingerprints", body[fingerprints]), body[fingerprints]
        assert not body[fingerprints + 1].startswith(" " * detail_at), body
    for ln in verdicts:
        assert ln[7:detail_at].rstrip() in LABELS, ln
        assert ln[detail_at - 2:detail_at] == "  " and ln[detail_at] != " ", ln
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    deepspeed_line = next(ln for ln in verdicts if ln[7:detail_at].rstrip() == "deepspeed")
    assert deepspeed_line.endswith(f", accelerator {expected}"), deepspeed_line


def test_every_check_label_fits_the_label_column() -> None:
    """The labels a report produces are the ones the column is sized for."""
    from ds_z3native.doctor import LABEL_WIDTH, LABELS, run_doctor

    report = run_doctor(selftest=False)
    names = [c.name for c in report.checks]
    assert set(names) <= set(LABELS), names
    assert LABEL_WIDTH == max(len(n) for n in LABELS) >= len("patches for this DeepSpeed")


def test_the_native_check_reports_how_this_build_got_its_flavour() -> None:
    """The build info names where the CUDA runtime came from, or why the build has none; on a
    CPU torch a CPU build is no warning, on a CUDA torch it is a WARN naming the reason."""
    import torch

    import ds_z3native
    from ds_z3native.doctor import _check_native

    info = ds_z3native.build_info()
    assert {"cuda_source", "cpu_reason"} <= set(info), info
    if info["flavour"] == "cuda":
        assert info["cuda_source"] in ("toolkit", "wheels") and info["cpu_reason"] is None
    else:
        assert info["cuda_source"] is None
        assert info["cpu_reason"] in ("cpu-torch", "forced", "no-cuda-runtime", "no-nccl",
                                      "cuda-headers-incomplete", "cuda-headers-unusable")
    check = _check_native({})
    if info["flavour"] == "cpu" and torch.version.cuda:
        assert check.status == "WARN" and "without CUDA" in check.detail, check
        assert "refused at init()" in check.detail and "-v -e ." in check.fix
    elif info["torch_matches_build"]:
        assert check.status == "PASS", check


@pytest.mark.deepspeed
def test_fingerprint_table_names_each_patch_target_and_a_replaced_one_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per (patch, target) of the patches install() would apply, each matching the
    record of the installed release; a DeepSpeed function replaced at run time turns the check
    (and install() would succeed) into a FAIL that names the patch and what to do."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_z3native.compat import deepspeed_version
    from ds_z3native.compat.fingerprints import UNVERIFIED_ENV
    from ds_z3native.compat.registry import patches_for
    from ds_z3native.doctor import _check_fingerprints, format_check

    monkeypatch.delenv(UNVERIFIED_ENV, raising=False)
    version = deepspeed_version()
    expected = [[p.name, t] for p in patches_for(version) for t in p.wraps]
    check = _check_fingerprints(version)
    assert [row[:2] for row in check.table[1:]] == expected
    deepspeed_rows = [row for row in check.table[1:] if row[1].startswith("deepspeed.")]
    assert deepspeed_rows and all(row[2] == "matches" for row in deepspeed_rows), check.table
    assert check.status in ("PASS", "WARN"), check
    shown = format_check(check, tables=True)
    assert "patch fingerprints" in shown and "DeepSpeedEngine.forward" in shown
    # Without --tables the table follows a WARN only; a PASS is its one line.
    assert ("DeepSpeedEngine.forward" in format_check(check)) == (check.status == "WARN")

    monkeypatch.setattr(DeepSpeedEngine, "forward", lambda self, *a, **k: None)
    check = _check_fingerprints(version)
    assert check.status == "FAIL", check
    row = next(r for r in check.table if r[1] == "deepspeed.runtime.engine:DeepSpeedEngine.forward")
    assert row[0] == "deepcompile-z3-eager-gather" and row[2] == "REFUSED (replaced)", row
    assert f"{UNVERIFIED_ENV}=deepcompile-z3-eager-gather" in check.fix
    assert "REFUSED (replaced)" in format_check(check)  # a FAIL shows its table
