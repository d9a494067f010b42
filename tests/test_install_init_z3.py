"""DeepCompile ZeRO-3 registration of frozen params, driven through DeepSpeed on CPU.

DeepCompile itself only runs on CUDA, but its registration step does not: these tests build a
real ZeRO-3 engine on two gloo ranks and call ``engine.get_deepcompile_backend(...)``, the engine
method ``engine.compile()`` uses, which runs DeepSpeed's ``init_z3`` against whatever native
module DeepSpeed's loader returns. Then they read the native registry (``param_state``).

* with ``install()``: every param registered; frozen ones frozen with no buffer; trainable ones
  with a buffer of their shard's size that is the optimizer's own gradient partition (a reduce
  lands there, averaged over the ranks); a frozen param's gradient raises our error naming the
  ds_id; a param unfrozen after registration fails DeepSpeed's next backward prologue with our
  error naming it, and its gradient, should one reach the native layer, is refused too;
* without the patches (our module handed to the loader, nothing else): DeepSpeed 0.19.2 raises
  the KeyError the patch fixes; 0.19.8 registers; a param frozen after ``deepspeed.initialize``
  is registered unfrozen with a buffer on 0.19.2 unless the declare-frozen patch runs.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest

from helpers.dist import run_ranks
from helpers.zero import install_without

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

WORLD = 2


def _config() -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "compile": {"deepcompile": True}}


def _model(frozen_at_init: bool) -> Any:
    import torch

    torch.manual_seed(0)
    # Odd sizes: numel not divisible by the world size, so shards are padded.
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 3))
    if frozen_at_init:
        model[0].requires_grad_(False)
    return model


def _engine(frozen_at_init: bool) -> Any:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=_model(frozen_at_init), config=_config())
    return engine


def _register(engine: Any) -> None:
    # What engine.compile() calls for ZeRO-3 with "deepcompile": true; it runs init_z3.
    engine.get_deepcompile_backend("inductor", {}, None)


def _states(engine: Any) -> List[Dict[str, Any]]:
    import ds_z3native

    native = ds_z3native.native()
    return [dict(name=n, ds_id=p.ds_id, requires_grad=p.requires_grad, ds_numel=p.ds_numel,
                 **native.param_state(p.ds_id))
            for n, p in engine.module.named_parameters()]


def _installed_scenario(rank: int, world_size: int) -> Dict[str, Any]:
    import torch
    import deepspeed
    import ds_z3native
    from deepspeed.compile.util import deepcompile_backward_prologue
    from ds_z3native.compat.deepcompile_frozen import UnfrozenAfterCompile

    ds_z3native.install()
    engine = _engine(frozen_at_init=True)
    engine.module[2].requires_grad_(False)  # frozen after deepspeed.initialize
    _register(engine)
    out: Dict[str, Any] = {"version": deepspeed.__version__, "states": _states(engine)}

    native = ds_z3native.native()
    params = dict(engine.module.named_parameters())
    ids = [p.ds_id for p in params.values()]
    graph_id = 7
    native.register_graph_z3(graph_id, ids)

    # A reduce of the trainable weight lands, averaged, in the optimizer's own partition.
    deepcompile_backward_prologue(True)
    weight = params["1.weight"]
    done = torch.ops.dc.reduce_grad(torch.full(tuple(weight.ds_shape), float(rank + 1)), graph_id,
                                    weight.ds_id)
    torch.ops.dc.end_backward([done], graph_id, True)
    partitions = engine.optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    out["reduced"] = partitions[weight.ds_id].tolist()

    errors: Dict[str, str] = {}
    for name in ("0.weight", "2.bias"):  # frozen at initialize; frozen after initialize
        p = params[name]
        try:
            torch.ops.dc.reduce_grad(torch.ones(tuple(p.ds_shape)), graph_id, p.ds_id)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    # Unfrozen after registration (after engine.compile() in a real run): the next backward
    # fails in DeepSpeed's backward prologue, naming it; a gradient that still reached the
    # native layer is refused there too.
    unfrozen = params["0.bias"]
    unfrozen.requires_grad_(True)
    try:
        deepcompile_backward_prologue(True)
        out["prologue"] = "no error"
    except UnfrozenAfterCompile as e:
        out["prologue"] = str(e)
    try:
        torch.ops.dc.reduce_grad(torch.ones(tuple(unfrozen.ds_shape)), graph_id, unfrozen.ds_id)
        errors["unfrozen 0.bias"] = "no error"
    except RuntimeError as e:
        errors["unfrozen 0.bias"] = str(e)
    out["errors"] = errors
    out["comm"] = native.comm_stats()
    ds_z3native.uninstall()
    return out


@pytest.mark.release_matrix
def test_init_z3_registers_frozen_and_trainable_params_with_install() -> None:
    results = run_ranks(_installed_scenario, WORLD, timeout=600)
    for rank, r in enumerate(results):
        by_name = {s["name"]: s for s in r["states"]}
        assert set(by_name) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}
        for s in r["states"]:
            shard = math.ceil(s["ds_numel"] / WORLD)
            assert s["numel"] == s["ds_numel"] and s["shard_numel"] == shard, s
            assert s["partitioned"] and not s["persistent"], s
            if s["requires_grad"]:
                assert not s["frozen"] and s["grad_numel"] == shard, s
            else:
                assert s["frozen"] and s["grad_numel"] == 0, s
        assert not by_name["2.weight"]["requires_grad"] and by_name["2.weight"]["frozen"]

        # 1.weight: 15 elements, shards of 8; rank 1's shard holds 7 real elements + 1 padding.
        real = 15 - rank * 8 if rank == WORLD - 1 else 8
        assert r["reduced"][:real] == pytest.approx([1.5] * real), r["reduced"]

        for name, message in r["errors"].items():
            ds_id = by_name[name.split()[-1]]["ds_id"]
            assert f"ds_id {ds_id}" in message and "frozen" in message, (name, message)
        bias = by_name["0.bias"]
        assert f"0.bias (ds_id {bias['ds_id']}) had requires_grad=False at engine.compile()" in r["prologue"]
        assert "0.weight" not in r["prologue"] and "2.bias" not in r["prologue"]
        # The refused gradients issued no collective: one reduce-scatter, the trainable weight's.
        assert r["comm"]["reduce_scatter_calls"] == 1, r["comm"]


def _unpatched_scenario(rank: int, world_size: int) -> Dict[str, Any]:
    """Our module handed to DeepSpeed's loader, but none of the init_z3 patches applied."""
    import deepspeed
    import ds_z3native
    from deepspeed.compile import util
    from ds_z3native.compat.deepcompile_frozen import DECLARE_FROZEN

    util.dc_handle = ds_z3native.native()
    out: Dict[str, Any] = {"version": deepspeed.__version__}
    try:
        _register(_engine(frozen_at_init=True))
        out["frozen_at_init"] = "registered"
    except KeyError as e:
        out["frozen_at_init"] = f"KeyError {e}"

    engine = _engine(frozen_at_init=False)
    engine.module[0].requires_grad_(False)  # frozen after deepspeed.initialize
    _register(engine)
    out["late_frozen_plain"] = _states(engine)[0]
    undo = DECLARE_FROZEN.apply()
    try:
        _register(engine)
        out["late_frozen_declared"] = _states(engine)[0]
    finally:
        undo()
    return out


def test_init_z3_without_patches_shows_what_they_fix() -> None:
    from packaging.version import Version

    for r in run_ranks(_unpatched_scenario, WORLD, timeout=600):
        old = Version(r["version"].split("+")[0]) < Version("0.19.6")
        if old:
            # The failure FROZEN_GRAD_BUFFER fixes: the first frozen param's ds_id is missing
            # from the optimizer's grad partition map.
            assert r["frozen_at_init"] == "KeyError 0", r
        else:
            assert r["frozen_at_init"] == "registered", r
        plain, declared = r["late_frozen_plain"], r["late_frozen_declared"]
        assert plain["name"] == declared["name"] == "0.weight"
        # 0.19.2 passes the optimizer slot of a param frozen after initialize: without the
        # declare-frozen patch the native layer would treat it as trainable.
        assert plain["frozen"] is (not old), plain
        assert plain["grad_numel"] == (15 if old else 0), plain
        assert declared["frozen"] is True, declared


def _leaf_module_scenario(rank: int, world_size: int, patched: bool) -> Dict[str, Any]:
    """A ZeRO-3 leaf module (a block of two Linears, as DeepSpeed treats mixture-of-experts
    blocks) with a trainable param: DeepCompile's registration with or without the patch that
    removes ZeRO-3's backward hook on it."""
    import torch
    import deepspeed
    import ds_z3native
    from deepspeed.utils import set_z3_leaf_modules
    from ds_z3native.compat.deepcompile_leaf_modules import leaf_module_hooks_removed

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(5, 7), torch.nn.Linear(7, 5)

        def forward(self, x: Any) -> Any:
            return self.down(torch.relu(self.up(x)))

    if patched:
        ds_z3native.install()
    else:
        install_without("deepcompile-z3-leaf-module-hooks")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), Block(), torch.nn.Linear(5, 3))
    model[0].requires_grad_(False)
    model[1].up.requires_grad_(False)  # the block's down projection trains
    set_z3_leaf_modules(model, [Block])
    engine, *_ = deepspeed.initialize(model=model, config=_config(),
                                      model_parameters=[p for p in model.parameters()
                                                        if p.requires_grad])
    before = len(engine.module[1]._backward_hooks)
    _register(engine)
    out = {"before": before, "after": len(engine.module[1]._backward_hooks),
           "kept": len(engine.optimizer._leaf_module_hooks), "stats": leaf_module_hooks_removed(),
           "states": _states(engine)}
    ds_z3native.uninstall()
    return out


@pytest.mark.release_matrix
@pytest.mark.parametrize("patched", [True, False], ids=["installed", "without-the-patch"])
def test_init_z3_removes_zero3s_backward_hook_on_a_leaf_module(patched: bool) -> None:
    # Dynamo cannot trace a module with a full backward hook: under DeepCompile the graph broke
    # at every mixture-of-experts block, whose trainable params were then read eagerly.
    for r in run_ranks(_leaf_module_scenario, WORLD, patched, timeout=600):
        assert r["before"] == 1, r
        if patched:
            assert r["after"] == 0 and r["kept"] == 0, r
            assert r["stats"] == {"engines": 1, "hooks": 1}, r
        else:
            assert r["after"] == 1 and r["kept"] == 1, r
            assert r["stats"] == {"engines": 0, "hooks": 0}, r
        # Registration itself is the same either way: the block's trainable param has its
        # gradient buffer, the frozen ones none.
        states = {s["name"]: s for s in r["states"]}
        assert states["1.down.weight"]["frozen"] is False and states["1.down.weight"]["grad_numel"] > 0
        assert states["1.up.weight"]["frozen"] is True
