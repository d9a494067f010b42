"""``bench/lora_llama.py --inductor NAME=VALUE``: inductor settings for an experiment (CUDA graphs,
the C++ wrapper) set before anything compiles, refused by name when torch has no such setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench.lora_llama import _parse, apply_inductor_config  # noqa: E402


def _args(*extra: str):
    return _parse(["--variant", "dc-ckpt", "--output", "x.json", *extra])


def test_settings_parse_as_python_literals_else_text() -> None:
    args = _args("--inductor", "triton.cudagraphs=True", "--inductor", "graph_partition=1",
                 "--inductor", "max_autotune_gemm_backends=ATEN,TRITON")
    assert args.inductor == [("triton.cudagraphs", True), ("graph_partition", 1),
                             ("max_autotune_gemm_backends", "ATEN,TRITON")]
    assert _args().inductor == []


@pytest.mark.parametrize("bad", ["cpp_wrapper", "=True"])
def test_a_setting_wants_a_name_and_a_value(bad: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _args("--inductor", bad)
    assert "expected NAME=VALUE" in capsys.readouterr().err


def test_settings_reach_inductors_config_and_read_back() -> None:
    from torch._inductor import config

    saved = config.save_config()
    try:
        before = config.triton.cudagraphs
        applied = apply_inductor_config([("triton.cudagraphs", not before),
                                         ("cpp_wrapper", True)])
        assert applied == {"triton.cudagraphs": not before, "cpp_wrapper": True}
        assert config.triton.cudagraphs is (not before) and config.cpp_wrapper is True
    finally:
        config.load_config(saved)


@pytest.mark.parametrize("name", ["no_such_setting", "triton.no_such_setting",
                                  "no_such_group.cudagraphs"])
def test_an_unknown_setting_is_refused_by_name(name: str) -> None:
    from torch._inductor import config

    saved = config.save_config()
    try:
        with pytest.raises(ValueError, match=rf"torch._inductor.config has no setting '{name}'"):
            apply_inductor_config([("triton.cudagraphs", True), (name, 1)])
    finally:
        config.load_config(saved)


def test_the_deepcompile_runner_takes_the_same_settings() -> None:
    # bench/deepcompile_run.py (the GPU tests' runner) shares the option: a setting is applied and
    # kept in the result; an unknown one ends the run with the error naming it.
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.dc_runner import run_together

    base = ("--mode", "eager", "--native", "deepspeed", "--model", "frozen-linear")
    results = run_together(
        {"set": ((*base, "--inductor", "triton.cudagraphs=True", "--inductor", "cpp_wrapper=1"), 1),
         "unknown": ((*base, "--inductor", "triton.no_such_setting=1"), 1)},
        env={"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    ok = results["set"]
    assert "error" not in ok, ok.get("error")
    assert ok["inductor"] == {"triton.cudagraphs": True, "cpp_wrapper": 1}
    assert len(ok["losses"]) == 1
    bad = results["unknown"]
    assert "torch._inductor.config has no setting 'triton.no_such_setting'" in bad.get("error", ""), bad
    assert bad["losses"] == []
