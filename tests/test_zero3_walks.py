"""The patches of ``ds_z3native.compat.zero3_walks`` on real ZeRO-3 engines (one gloo rank,
DeepSpeed on CPU).

``zero3-release-param-list``: the optimizer step's release of every param walks no module tree,
and still waits for gathers in flight, clears active submodules, releases every gathered param (of
modules added since, and external params registered since, too) and refuses a param left
gathered; training with it loses exactly what training without it loses; ``uninstall()`` puts
DeepSpeed's methods back.

``deepcompile-z3-fallback-module-list``: a DeepCompile step walks no module tree; the eager
fallback still switches every module (one added since too) into and out of its forward mode and
releases a param left gathered before a forward, but not a persistent one."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from helpers.dc_runner import needs_cpu_deepcompile
from helpers.dist import run_ranks
from helpers.zero import install_without

pytestmark = pytest.mark.deepspeed

_CONFIG = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}


def _engine(patched: bool) -> Any:
    import deepspeed
    import torch

    import ds_z3native

    if patched:
        ds_z3native.install()
    else:
        install_without("zero3-release-param-list")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_CONFIG)
    return engine


def _losses(rank: int, world_size: int, patched: bool) -> List[float]:
    import torch

    engine = _engine(patched)
    torch.manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(2, 8)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _release_on_a_zero3_engine(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator

    import ds_z3native

    originals = (PartitionedParameterCoordinator.__dict__["release_and_reset_all"],
                 DeepSpeedZeRoOffload.__dict__["partition_all_parameters"])
    engine = _engine(patched=True)
    out: Dict[str, Any] = {}
    out["wrapped"] = (
        PartitionedParameterCoordinator.__dict__["release_and_reset_all"] is not originals[0]
        and DeepSpeedZeRoOffload.__dict__["partition_all_parameters"] is not originals[1])
    optimizer = engine.optimizer
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    registry = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry")
    root = engine.module

    def statuses() -> List[str]:
        return [p.ds_status.name for p in root.parameters()]

    # One step, so every list is built; then count the tree walks of a release.
    x = torch.randn(2, 8)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    walks = []
    named_modules = torch.nn.Module.named_modules

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        walks.append(type(self).__name__)
        return named_modules(self, *args, **kwargs)

    torch.nn.Module.named_modules = counted  # type: ignore[method-assign]
    try:
        optimizer._partition_all_parameters()
    finally:
        torch.nn.Module.named_modules = named_modules  # type: ignore[method-assign]
    out["walks"] = len(walks)

    # Gathered params, one with an active submodule, one with its gather in flight.
    first, second, third = root[0].weight, root[2].weight, root[4].bias
    first.all_gather()
    second.all_gather()
    second.ds_active_sub_modules.add(12345)
    handle = third.all_gather_coalesced([third])
    out["inflight_status"] = third.ds_status.name
    registry[third] = handle
    out["before"] = [first.ds_status.name, second.ds_status.name]
    optimizer._partition_all_parameters()
    out["after"] = statuses()
    out["active_left"] = len(second.ds_active_sub_modules)
    out["registry_left"] = len(registry)

    # A module added since the lists were built, and an external parameter registered since.
    later = torch.nn.Linear(4, 4)
    deepspeed.zero.Init(module=later, config_dict_or_path=_CONFIG)
    root.add_module("later", later)
    extra = torch.nn.Linear(4, 4)
    deepspeed.zero.Init(module=extra, config_dict_or_path=_CONFIG)
    deepspeed.zero.register_external_parameter(root, extra.weight)
    later.weight.all_gather()
    extra.weight.all_gather()
    out["added_before"] = [later.weight.ds_status.name, extra.weight.ds_status.name]
    optimizer._partition_all_parameters()
    out["added_after"] = [later.weight.ds_status.name, extra.weight.ds_status.name]

    # A release that leaves its param gathered is refused, naming the param.
    first.all_gather()
    release = "_PartitionedParameterCoordinator__release_param"
    setattr(coordinator, release, lambda param, free_data=True: None)
    try:
        optimizer._partition_all_parameters()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    finally:
        delattr(coordinator, release)
    optimizer._partition_all_parameters()
    out["released_after_refusal"] = first.ds_status == ZeroParamStatus.NOT_AVAILABLE

    ds_z3native.uninstall()
    out["restored"] = (
        PartitionedParameterCoordinator.__dict__["release_and_reset_all"] is originals[0]
        and DeepSpeedZeRoOffload.__dict__["partition_all_parameters"] is originals[1])
    return out


@pytest.fixture(scope="module")
def release() -> Dict[str, Any]:
    return run_ranks(_release_on_a_zero3_engine, 1, timeout=300)[0]


def test_a_release_walks_no_module_tree(release: Dict[str, Any]) -> None:
    assert release["wrapped"]
    assert release["walks"] == 0  # DeepSpeed's own: three named_parameters() walks


def test_every_gathered_param_is_released_and_reset(release: Dict[str, Any]) -> None:
    assert release["before"] == ["AVAILABLE", "AVAILABLE"]
    assert release["inflight_status"] == "INFLIGHT"
    assert release["after"] == ["NOT_AVAILABLE"] * 6
    assert release["active_left"] == 0
    assert release["registry_left"] == 0  # the gather in flight was waited for, then released


def test_params_of_modules_added_since_and_external_params_are_released(
        release: Dict[str, Any]) -> None:
    assert release["added_before"] == ["AVAILABLE", "AVAILABLE"]
    assert release["added_after"] == ["NOT_AVAILABLE", "NOT_AVAILABLE"]


def test_a_param_left_gathered_is_refused(release: Dict[str, Any]) -> None:
    assert release["refused"] is not None
    assert "expected to be released" in release["refused"]
    assert "AVAILABLE" in release["refused"]  # DeepSpeed's summary of the param
    assert release["released_after_refusal"]


def test_uninstall_restores_deepspeeds_methods(release: Dict[str, Any]) -> None:
    assert release["restored"]


def test_training_loses_exactly_what_it_loses_without_the_patch() -> None:
    patched = run_ranks(_losses, 1, True, timeout=300)[0]
    unpatched = run_ranks(_losses, 1, False, timeout=300)[0]
    assert len(patched) == 4 and patched[-1] < patched[0]
    assert patched == unpatched


def _fallback_on_a_deepcompile_engine(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import deepspeed.ops
    import torch

    import ds_z3native

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo, no JIT build
    from ds_z3native.models import MODEL_SIZES, build_lora_llama

    ds_z3native.install()
    size = MODEL_SIZES["tiny"]
    model, _ = build_lora_llama(size)
    config = dict(_CONFIG, compile={"deepcompile": True},
                  zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 1000})
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    engine.compile()
    fallback = engine._deepcompile_z3_eager_fallback
    out: Dict[str, Any] = {"losses": []}
    torch.manual_seed(1)
    named_modules = torch.nn.Module.named_modules
    walks: List[str] = []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        walks.append(type(self).__name__)
        return named_modules(self, *args, **kwargs)

    ids = torch.randint(0, size.vocab, (2, size.seq_len))  # one batch: the loss must fall
    for step in range(4):
        if step == 3:  # every list built: count the walks of one whole step
            torch.nn.Module.named_modules = counted  # type: ignore[method-assign]
        try:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        finally:
            torch.nn.Module.named_modules = named_modules  # type: ignore[method-assign]
        out["losses"].append(float(loss))
    out["walks"] = len(walks)

    root = engine.module
    root.add_module("later", torch.nn.LayerNorm(2))
    fallback._enable_forward_fallback()
    out["in_forward"] = [getattr(m._parameters, "_in_forward", None) for m in root.modules()]
    fallback._disable_forward_fallback()
    out["out_of_forward"] = [getattr(m._parameters, "_in_forward", None) for m in root.modules()]
    del root.later

    # Two frozen params gathered outside any graph, one of them marked persistent.
    params = dict(root.named_parameters())
    weight = next(p for n, p in params.items() if n.endswith("q_proj.base_layer.weight"))
    norm = next(p for n, p in params.items() if n.endswith("input_layernorm.weight"))
    persist = norm.ds_persist
    norm.ds_persist = True
    weight.all_gather()
    norm.all_gather()
    out["gathered"] = [weight.ds_status.name, norm.ds_status.name]
    fallback.release_available_params_for_next_forward()
    out["released"] = [weight.ds_status.name, norm.ds_status.name]
    out["released_ids"] = list(fallback._last_pre_forward_released_param_ids)
    out["ids"] = [weight.ds_id, norm.ds_id]
    norm.ds_persist = persist
    norm.partition()
    loss = engine(input_ids=ids, labels=ids).loss  # still trains after all that
    engine.backward(loss)
    engine.step()
    out["loss_after"] = float(loss)
    return out


@pytest.fixture(scope="module")
def fallback() -> Dict[str, Any]:
    return run_ranks(_fallback_on_a_deepcompile_engine, 1, timeout=600)[0]


@needs_cpu_deepcompile
def test_a_deepcompile_step_walks_no_module_tree(fallback: Dict[str, Any]) -> None:
    assert fallback["walks"] == 0  # DeepSpeed's own: three walks per forward, three per step
    assert fallback["losses"][-1] < fallback["losses"][0]


@needs_cpu_deepcompile
def test_the_fallback_switches_every_module_also_one_added_since(
        fallback: Dict[str, Any]) -> None:
    assert fallback["in_forward"] and all(v is True for v in fallback["in_forward"])
    assert all(v is False for v in fallback["out_of_forward"])


@needs_cpu_deepcompile
def test_the_fallback_releases_a_param_left_gathered_but_not_a_persistent_one(
        fallback: Dict[str, Any]) -> None:
    assert fallback["gathered"] == ["AVAILABLE", "AVAILABLE"]
    assert fallback["released"] == ["NOT_AVAILABLE", "AVAILABLE"]
    weight_id, norm_id = fallback["ids"]
    assert weight_id in fallback["released_ids"] and norm_id not in fallback["released_ids"]
    assert fallback["loss_after"] < fallback["losses"][-1]  # still trains after all that
