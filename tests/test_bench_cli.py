"""``bench/core/cli.py``: both entry points (``python -m bench``, ``ds-z3native bench``) answer
``--help`` and ``list``, and a dry run leaves no temporary work folder behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench_cli import bench_env as _env, run_bench as _bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package


@pytest.mark.parametrize("cmd", [[sys.executable, "-m", "bench"],
                                 [sys.executable, "-m", "ds_z3native", "bench"]])
def test_bench_help(cmd: list, tmp_path: Path) -> None:
    # ds-z3native from another directory: it finds the checkout it was installed from.
    r = subprocess.run(cmd + ["--help"], cwd=ROOT if cmd[2] == "bench" else tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--smoke" in r.stdout and "--output-dir" in r.stdout
    r = subprocess.run(cmd + ["list"], cwd=ROOT if cmd[2] == "bench" else tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("native_micro", "deepcompile_first_step", "lora_llama", "compile_scaling"):
        assert name in r.stdout


def test_a_dry_run_leaves_no_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    # A plan names folders under a new temporary work folder; printing it leaves none behind
    # (a real run's folder, with its logs, stays). --work-dir given: the caller's, left as it is.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for argv in (["compile_scaling", "--layers", "2,4"], ["lora_llama", "--variants", "dc,dc-warm"],
                 ["all"]):
        r = _bench(*argv, "--dry-run")
        assert r.returncode == 0, r.stderr
        assert "bench-" in r.stdout or "python" in r.stdout  # a plan was printed
        assert list((tmp_path / "tmp").iterdir()) == [], argv
    mine = tmp_path / "mine"
    r = _bench("compile_scaling", "--layers", "2", "--dry-run", "--work-dir", str(mine))
    assert r.returncode == 0 and str(mine) in r.stdout, r.stdout


def test_remove_if_empty_keeps_a_folder_with_a_file(tmp_path: Path) -> None:
    from bench.core.cli import _remove_if_empty

    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "d").mkdir()
    _remove_if_empty(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "e" / "f").mkdir(parents=True)
    (tmp_path / "e" / "f" / "log.txt").write_text("kept")
    _remove_if_empty(tmp_path / "e")
    assert (tmp_path / "e" / "f" / "log.txt").read_text() == "kept"
    _remove_if_empty(None)
    _remove_if_empty(tmp_path / "missing")
