"""``ds_z3native.stats()`` / ``reset_stats()``: every patch's counters in one call, cleared in one
call, as the benchmarks record them."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest

import ds_z3native
from ds_z3native import run_state
from ds_z3native.compat.registry import OPTIONAL_MODULES, PATCH_MODULES


def _counter_functions():
    """(module, name) of every public function of a patch module that reads counters: named
    ``*_stats``, ``*_counts`` or ``*_removed``, or returning what a module's log holds."""
    found = []
    for name in PATCH_MODULES + OPTIONAL_MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            fn = getattr(module, attr, None)
            if inspect.isfunction(fn) and attr.endswith(("_stats", "_counts", "_removed",
                                                         "bypasses")):
                found.append((name, attr))
    return found


def test_every_counter_of_a_patch_module_is_a_part_of_the_run_state() -> None:
    """A patch module's counters reach stats(): a new ``*_stats`` function that is not registered
    fails here."""
    ds_z3native.stats()  # imports every patch module
    parts = run_state.RUN_STATE.parts()
    registered = {p.module for p in parts}
    functions = _counter_functions()
    assert len(functions) >= 10, functions
    for module, attr in functions:
        assert module in registered, f"{module}.{attr} is not registered with the run state"
    assert len({p.name for p in parts}) == len(parts)


def test_stats_are_json_and_reset_clears_every_part() -> None:
    """Every part's counters made non-zero through its own module's state, then one
    reset_stats(): every count is zero again and stats() stays JSON-serialisable."""
    from ds_z3native.compat import (deepcompile_graph_ids, deepcompile_inductor_calls,
                                    deepcompile_leaf_modules, deepcompile_persistent,
                                    deepcompile_profile_store, deepcompile_profiling,
                                    deepcompile_reduce_group, deepcompile_regroup,
                                    deepcompile_warm_start, zero3_grad_norm)

    ds_z3native.reset_stats()  # what earlier tests of this process left
    deepcompile_graph_ids._BYPASSES._entries.append((3, "a reason"))
    deepcompile_inductor_calls._stats["attention_unwrapped"] += 2
    deepcompile_leaf_modules._STATS.hooks += 4
    deepcompile_persistent._stats["graphs"] += 1
    deepcompile_profile_store._stats["recorded"] += 5
    deepcompile_profiling._STATS.frozen += 1
    deepcompile_reduce_group._stats["groups"] += 7
    deepcompile_regroup._stats["kept"] += 1
    deepcompile_warm_start._state.stats["started"] += 1
    with zero3_grad_norm._COUNTS_LOCK:
        zero3_grad_norm._COUNTS["flat"] += 3

    before = ds_z3native.stats()
    json.dumps(before)
    bumped = {"compile_cache_bypasses": [[3, "a reason"]]}
    assert before["compile_cache_bypasses"] == bumped["compile_cache_bypasses"]
    nonzero = {name for name, value in before.items()
               if isinstance(value, dict) and any(v for v in value.values()
                                                  if isinstance(v, (int, float)))}
    assert {"inductor_calls", "leaf_module_hooks", "persistent_group", "profile_store", "pass_gc",
            "reduce_group", "single_cycle_regroup", "warm_start", "flat_grad_norm"} <= nonzero

    ds_z3native.reset_stats()
    after = ds_z3native.stats()
    assert after.keys() == before.keys()
    assert after["compile_cache_bypasses"] == []
    for name, value in after.items():
        if isinstance(value, dict):
            left = {k: v for k, v in value.items() if isinstance(v, (int, float)) and v}
            assert not left, f"{name} kept {left} after reset_stats()"


def test_a_part_name_belongs_to_one_module() -> None:
    own = run_state.RunState()
    own.register("x", lambda: {}, lambda: None)
    own.register("x", lambda: {"again": 1}, lambda: None)  # the same module: replaced
    assert own.stats() == {"x": {"again": 1}}

    def elsewhere() -> dict:
        return {}

    elsewhere.__module__ = "some.other.module"
    with pytest.raises(ValueError, match=r"part 'x' is registered by .*test_run_state; "
                                         r"some\.other\.module cannot take the name"):
        own.register("x", elsewhere, lambda: None)
