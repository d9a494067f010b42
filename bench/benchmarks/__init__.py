"""The benchmarks, one module each: its registration, GPU command builder, full and smoke runs
(the measuring scripts they run, ``bench/lora_llama.py``, ``bench/deepcompile_run.py`` and
``bench/native_micro.py``, stay beside ``bench/core``; ``compile_scaling`` runs
``bench/lora_llama.py`` too). Importing this package registers them all."""

from __future__ import annotations

from typing import Dict

from bench.benchmarks import compile_scaling, deepcompile_first_step, lora_llama, native_micro
from bench.core.registry import Benchmark, registered

__all__ = ["registry", "compile_scaling", "deepcompile_first_step", "lora_llama", "native_micro"]


def registry() -> Dict[str, Benchmark]:
    """Every benchmark by name."""
    return registered()
