"""The source distribution (what ``pip install ds_z3native`` builds from when no wheel fits) holds
everything the extension's build reads: every C++/CUDA source and header, the CUDA discovery the
build runs, and the package data (the dc op list the C++ includes); and the license. The version is
written once, in python/ds_z3native/_version.py, which setup.py reads as text."""

from __future__ import annotations

import ast
import email.parser
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Dict, Set

import pytest

from ds_z3native._version import __version__

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# Where the build looks for quoted includes (setup.py's include_dirs): csrc/, the package root.
INCLUDE_ROOTS = ("csrc", "python")


def _tracked(*dirs: str) -> Set[str]:
    out = subprocess.run(["git", "ls-files", *dirs], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return set(out.stdout.split())


@pytest.fixture(scope="module")
def sdist_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--formats=gztar", "-d", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    (archive,) = out.glob("*.tar.gz")
    return archive


@pytest.fixture(scope="module")
def sdist_files(sdist_archive: Path) -> Set[str]:
    with tarfile.open(sdist_archive) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    # Paths inside the archive start with its "<name>-<version>/" folder.
    return {n.split("/", 1)[1] for n in names if "/" in n}


def _setup_call_keywords(tree: ast.Module) -> Dict[str, ast.expr]:
    (call,) = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Name) and node.func.id == "setup"]
    return {kw.arg: kw.value for kw in call.keywords if kw.arg}


def test_setup_py_reads_the_version_from_the_package_and_writes_none_of_its_own() -> None:
    source = (ROOT / "setup.py").read_text()
    tree = ast.parse(source)
    version = _setup_call_keywords(tree)["version"]
    assert isinstance(version, ast.Call) and isinstance(version.func, ast.Name), \
        f"setup(version=...) is {ast.unparse(version)}, not read from _version.py"
    assert not re.search(r"""\bversion\s*=\s*["'0-9]""", source)
    # The function setup() calls, run on its own (setup.py cannot be imported: it builds).
    (func,) = [node for node in tree.body
               if isinstance(node, ast.FunctionDef) and node.name == version.func.id]
    namespace: Dict[str, Any] = {"os": os, "re": re, "sys": sys,
                                 "PACKAGE_ROOT": str(ROOT / "python")}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "setup.py", "exec"), namespace)
    assert namespace[func.name]() == __version__


@pytest.mark.slow
def test_sdist_holds_every_native_source_and_the_build_helpers(sdist_files: Set[str]) -> None:
    needed = _tracked("csrc", "build_support") | {
        "setup.py", "pyproject.toml", "python/ds_z3native/dc_ops.def",
        "python/ds_z3native/compat/fingerprints.json"}
    assert needed - sdist_files == set()


@pytest.mark.slow
def test_every_quoted_include_of_the_native_sources_is_in_the_sdist(sdist_files: Set[str]) -> None:
    sources = [p for p in sdist_files if p.startswith("csrc/")]
    assert any(p.endswith(".cpp") for p in sources), sorted(sdist_files)[:20]
    missing = []
    for path in sources:
        for inc in INCLUDE.findall((ROOT / path).read_text(errors="replace")):
            candidates = [f"{root}/{inc}" for root in INCLUDE_ROOTS]
            candidates.append(str(Path(path).parent / inc))
            if not any(c in sdist_files for c in candidates):
                missing.append(f"{path}: #include \"{inc}\"")
    assert missing == []


@pytest.mark.slow
def test_sdist_carries_no_build_outputs(sdist_files: Set[str]) -> None:
    assert [p for p in sdist_files if p.endswith((".so", ".o", ".pyc"))] == []


@pytest.mark.slow
def test_sdist_carries_the_license_and_the_package_version(sdist_archive: Path,
                                                           sdist_files: Set[str]) -> None:
    assert sdist_archive.name == f"ds_z3native-{__version__}.tar.gz"
    with tarfile.open(sdist_archive) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.count("/") == 1
                     and m.name.endswith("/PKG-INFO")]
        handle = tar.extractfile(member)
        assert handle is not None
        meta = email.parser.Parser().parsestr(handle.read().decode())
    assert meta["Version"] == __version__
    assert meta["License"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert "LICENSE" in sdist_files
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
