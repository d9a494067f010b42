"""The source distribution (what ``pip install ds_z3native`` builds from when no wheel fits) holds
everything the extension's build reads: every C++/CUDA source and header, the CUDA discovery the
build runs, and the package data (the dc op list the C++ includes)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Set

import pytest

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
def sdist_files(tmp_path_factory: pytest.TempPathFactory) -> Set[str]:
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--formats=gztar", "-d", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    (archive,) = out.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    # Paths inside the archive start with its "<name>-<version>/" folder.
    return {n.split("/", 1)[1] for n in names if "/" in n}


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
