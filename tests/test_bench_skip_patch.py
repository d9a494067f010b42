"""``--skip-patch NAME`` of ``bench/lora_llama.py`` and ``bench/deepcompile_run.py``: one of
ds_z3native's patches left out of ``install()`` for an A/B run, a name no patch has refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench.deepcompile_run import skip_patches  # noqa: E402
from bench.lora_llama import _parse  # noqa: E402
from ds_z3native.compat import registry  # noqa: E402


def test_lora_llama_takes_the_option_repeated() -> None:
    args = _parse(["--variant", "dc-ckpt", "--output", "x.json", "--skip-patch",
                   "deepcompile-attention-rng", "--skip-patch", "deepcompile-grouped-reduce"])
    assert args.skip_patch == ["deepcompile-attention-rng", "deepcompile-grouped-reduce"]
    assert _parse(["--variant", "dc-ckpt", "--output", "x.json"]).skip_patch == []


def test_a_skipped_patch_is_left_out_of_install_and_an_unknown_name_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "all_patches", registry.all_patches)
    every = [p.name for p in registry.all_patches()]
    assert "deepcompile-attention-rng" in every
    with pytest.raises(ValueError, match=r"--skip-patch deepcompile-no-such: no such ds_z3native "
                                         r"patch \(known: .*deepcompile-attention-rng"):
        skip_patches(["deepcompile-attention-rng", "deepcompile-no-such"])
    assert [p.name for p in registry.all_patches()] == every  # nothing changed
    skip_patches(["deepcompile-attention-rng"])
    assert [p.name for p in registry.all_patches()] == \
        [n for n in every if n != "deepcompile-attention-rng"]
    skip_patches([])
    assert len(registry.all_patches()) == len(every) - 1
