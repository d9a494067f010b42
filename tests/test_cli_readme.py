"""The README opens with two commands, and they are the ones CI runs.

Command 1 (set up + run the demo) installs what ``.ci/run`` installs, with the ``demo`` extra, and
runs ``ds-z3native demo`` (``test_demo.py`` runs that last step as written). Command 2 (set up +
run the tests) is ``.ci/run``'s installs followed by its test command, ``bash
scripts/run_tests.sh``. The ``demo`` extra brings what the demo imports; the core install stays
light.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> List[str]:
    """The command lines of the README's first ```bash block (comments dropped), in order."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```bash\n(.*?)```", text, re.S)
    assert match, "README.md has no ```bash block"
    assert text.index(match.group(0)) < text.index("\n## "), \
        "the two commands must come before the README's first section"
    return [ln.strip() for ln in match.group(1).splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def _segments(command: str) -> List[List[str]]:
    return [shlex.split(part) for part in command.split("&&")]


def _pip_installs(segments: List[List[str]]) -> List[List[str]]:
    """The arguments of each ``pip install`` / ``python -m pip install``, without -q."""
    out = []
    for words in segments:
        if "pip" in words and "install" in words and words.index("install") == words.index("pip") + 1:
            out.append([w for w in words[words.index("install") + 1:] if w not in ("-q", "--quiet")])
    return out


def _apt_packages(segments: List[List[str]]) -> Set[str]:
    found: Set[str] = set()
    for words in segments:
        if "apt-get" in words and "install" in words:
            found |= {w for w in words[words.index("install") + 1:] if not w.startswith("-")}
    return found


def _ci_run() -> Tuple[List[List[str]], Set[str], List[str]]:
    """(pip installs, apt packages, other commands) of .ci/run."""
    text = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    pips = _pip_installs([shlex.split(ln) for ln in lines if " pip install " in ln])
    apt = set(re.findall(r"need\+=\(([\w.-]+)\)", text))
    return pips, apt, lines


def _extras() -> Tuple[List[str], Dict[str, List[str]]]:
    """setup.py's install_requires and extras_require, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found: Dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg in ("install_requires", "extras_require"):
                    found[kw.arg] = ast.literal_eval(kw.value)
    return found["install_requires"], found["extras_require"]  # type: ignore[return-value]


def _names(requirements: List[str]) -> Set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, 1)[0].lower() for r in requirements}


def test_readme_opens_with_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].split("&&")[-1].strip() == "ds-z3native demo --compare", commands[0]
    assert commands[1].split("&&")[-1].strip() == "bash scripts/run_tests.sh", commands[1]


def test_test_command_is_what_ci_runs() -> None:
    """Command 2 = .ci/run: the same apt packages, the same pip installs in the same order, then
    the test script .ci/run calls."""
    ci_pips, ci_apt, ci_lines = _ci_run()
    segments = _segments(readme_commands()[1])
    assert _pip_installs(segments) == ci_pips
    assert _apt_packages(segments) == ci_apt
    assert "bash scripts/run_tests.sh" in ci_lines
    assert (ROOT / "scripts" / "run_tests.sh").is_file()


def test_demo_command_installs_what_ci_installs_with_the_demo_extra() -> None:
    """Command 1 pins torch and DeepSpeed as CI does and installs the package (built against
    that torch: --no-build-isolation) with the demo extra."""
    ci_pips, _, _ = _ci_run()
    pips = _pip_installs(_segments(readme_commands()[0]))
    assert pips[:-1] == ci_pips[:-1], (pips, ci_pips)
    assert pips[-1] == ["--no-build-isolation", "-e", ".[demo]"], pips[-1]
    assert ci_pips[-1][:2] == ["--no-build-isolation", "-e"]
    assert "demo" in re.search(r"\[(.*)\]", ci_pips[-1][2]).group(1).split(","), \
        "CI must install the demo extra: its tests run the demo"


def test_demo_extra_brings_what_the_demo_needs_and_core_stays_light() -> None:
    core, extras = _extras()
    assert {"transformers", "peft", "tqdm", "deepspeed"} <= _names(extras["demo"])
    assert "torch" in _names(core)
    assert not _names(core) & {"transformers", "peft", "tqdm", "deepspeed"}, core
