"""The README and docs/: the README stays a short page, every relative link between them
resolves (files and headings), docs/patches.md lists the registry's patches with their DeepSpeed
ranges, and neither they, the benchmark results' prose nor the code (every tracked Python, shell
and TOML file) speak of how the project was built (work periods, issue numbers, test-machine
labels): a result names its date, command, hardware and software instead.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from ds_z3native.compat.registry import all_patches

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_BYTES = 10_000

# Words of the project's own making-of, and labels of the machines it was measured on.
HISTORY = re.compile(r"\bissue\s*#?\d+|(?<![\w&#/])#\d+\b|\bsessions?\b|\bstop\s+#?\d+\b|"
                     r"\bwork periods?\b|\bGPU-[0-9a-f]{8}\b|\bnvidia-h200-x\d|\blending\b|\.gpu/|"
                     r"\bthe\s+(?:GPU|CPU|CUDA|test|build|remote)\s+(?:host|box|machine|node)\b",
                     re.I)
# Technical terms with one of those words, taken out before the check: torch's compile session
# (torch.compiler's flag and context), a POSIX session (a process group leader's) and pytest's
# Session object (a fixture's request.session).
TERMS = re.compile(r"\bcompile[-_ ]sessions?\b|_compile_session_context|\bsession of its own\b|"
                   r"\brequest\.session\b", re.I)
# Code files the check reads (git ls-files patterns), and extension-less scripts with a shebang.
CODE_PATTERNS = ("*.py", "*.sh", "*.toml")
# The file that holds the pattern and the examples it must catch.
SELF = Path(__file__).resolve()
# Result fields that are prose (the rest are measured values, e.g. gpu_conditions' device).
PROSE_FIELDS = ("note", "replaced_notes", "source")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> List[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)]


def _links(page: Path) -> Iterator[Tuple[str, Path, str]]:
    """(link, target file, anchor) of each relative link of ``page``, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for match in LINK.finditer(text):
        link = match.group(1)
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        yield link, (page.parent / path).resolve() if path else page, anchor


def test_readme_is_short_and_links_to_every_docs_page() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/"
    linked = {target for _, target, _ in _links(README)}
    assert DOCS and set(DOCS) <= linked, sorted(str(d) for d in set(DOCS) - linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link, target, anchor in _links(page):
        if not target.exists():
            broken.append(f"{link}: no {target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, broken


def _range(first: Any, last: Any) -> str:
    if last is None:
        return f"{first} and later"
    return str(first) if first == last else f"{first} – {last}"


def test_patches_page_lists_the_registry_in_order() -> None:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in (ROOT / "docs" / "patches.md").read_text().splitlines()
            if line.startswith("| `")]
    shown = [(row[0].strip("`"), row[1]) for row in rows]
    patches = all_patches()
    assert [name for name, _ in shown] == [p.name for p in patches]
    for (name, versions), patch in zip(shown, patches):
        assert versions.startswith(_range(patch.first, patch.last)), (name, versions)


def _prose(value: Any, key: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _prose(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _prose(v, key)
    elif isinstance(value, str) and key in PROSE_FIELDS:
        yield value


def _history(text: str) -> List[str]:
    """The history words in ``text`` (technical terms that share a word excepted)."""
    return HISTORY.findall(TERMS.sub(" ", text))


def _tracked_code() -> List[Path]:
    """Every git-tracked Python, shell and TOML file, and every tracked script without an
    extension that starts with a shebang; this file excepted."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    paths = []
    for name in filter(None, out.stdout.split("\0")):
        path = ROOT / name
        if path.resolve() == SELF or not path.is_file():
            continue
        if any(path.match(pattern) for pattern in CODE_PATTERNS):
            paths.append(path)
        elif not path.suffix and path.read_bytes()[:2] == b"#!":
            paths.append(path)
    return paths


def test_docs_and_results_speak_of_the_project_only() -> None:
    found: Dict[str, List[str]] = {}
    for page in PAGES:
        hits = _history(page.read_text())
        if hits:
            found[str(page.relative_to(ROOT))] = hits
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        hits = [h for text in _prose(json.loads(path.read_text())) for h in _history(text)]
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found


def test_code_speaks_of_the_project_only() -> None:
    paths = _tracked_code()
    names = {str(p.relative_to(ROOT)) for p in paths}
    # The kinds of file the check covers are all there (a pattern that matches nothing checks
    # nothing): a package module, a shell script, the TOML, an extension-less script.
    assert {"python/ds_z3native/settings.py", "scripts/run_tests.sh", "pyproject.toml",
            ".ci/run"} <= names, sorted(names)
    assert "tests/test_docs.py" not in names
    found: Dict[str, List[str]] = {}
    for path in paths:
        hits = _history(path.read_text(errors="replace"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found


def test_the_history_check_catches_what_it_should() -> None:
    for text in ("as issue 5 asks", "in session 3", "at stop 12", "on GPU-28b808b3",
                 "an nvidia-h200-x2 host", "bash .gpu/run.sh", "# fixed for #20",
                 "# seen on the GPU host", "measured on the CPU machine", "this session's run",
                 "torch's compile session, as in session 2"):
        assert _history(text), text
    for text in ("no collective issued", "2026-12-01 on one H200 and 16 cores", "a GPU machine",
                 "#include <vector>", "${#need[@]}", "a, b = x[0], y  # 0-based", "&#20;",
                 "torch raises it for a whole compile session", "torch's compile-session flag",
                 'getattr(torch.compiler, "_compile_session_context", None)',
                 "torchrun starts each rank in a session of its own",
                 "for item in request.session.items"):
        assert not _history(text), text
    results = {"note": "on GPU-28b808b3", "runs": {"x": {"gpu_conditions": {
        "device": "GPU-28b808b3-99dd"}}}, "replaced_notes": ["fine"]}
    assert list(_prose(results)) == ["on GPU-28b808b3", "fine"]
