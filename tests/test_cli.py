"""The ``ds-z3native`` command line: its commands, and the entry points that reach them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.env import without_autoload

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_z3native", *args], cwd=ROOT,
                          env=without_autoload(),
                          capture_output=True, text=True, timeout=120)


def test_help_lists_every_command() -> None:
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for command in ("demo", "doctor", "selftest", "build-info"):
        assert command in r.stdout


def test_demo_help_names_the_options_and_model_sizes() -> None:
    from ds_z3native.models import MODEL_SIZES

    r = _run("demo", "--help")
    assert r.returncode == 0, r.stderr
    for option in ("--steps", "--ranks", "--model-size", "--deepcompile", "--without-fix"):
        assert option in r.stdout
    for name in MODEL_SIZES:
        assert name in r.stdout


def test_build_info_is_json_of_the_loaded_extension() -> None:
    import ds_z3native

    r = _run("build-info")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["flavour"] == ds_z3native.build_info()["flavour"]
    assert info["torch_matches_build"] is True


def test_help_texts_are_plain_text() -> None:
    """argparse prints descriptions as written: no reST or Markdown literal markup in any
    command's --help."""
    for command in ([], ["demo"], ["doctor"], ["selftest"], ["build-info"]):
        r = _run(*command, "--help")
        assert r.returncode == 0, r.stderr
        assert "`" not in r.stdout, f"markup in `ds-z3native {' '.join(command)} --help`:\n{r.stdout}"
    r = _run("--help")
    assert "demo (a LoRA fine-tune" in r.stdout and "python -m bench" in r.stdout, r.stdout
