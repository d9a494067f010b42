"""HF Trainer's per-step walks of the module tree, made cheap (and its FLOP count right) under ZeRO-3.

Every optimizer step, ``transformers.Trainer`` walks the whole model three times outside the
DeepSpeed engine's forward, backward and step: ``model.train()`` (recursing into every module,
twice per micro-step), ``model.zero_grad()`` (``DeepSpeedEngine.zero_grad`` walks
``named_parameters()``) and ``floating_point_ops()`` (``num_parameters()`` walks
``named_modules()`` and ``named_parameters()``). On a 1 B LoRA model (16 layers, 1,338 modules,
371 params) that is about 9 ms of host time per step, paid where a DeepCompile step is host-bound.
And under ZeRO-3 the FLOP count is wrong: a partitioned param's ``numel()`` is 0 on every rank
(its size is ``ds_numel``), so the Trainer logs ``total_flos`` for the persistent params only.

* :data:`HF_TRAINER_ZERO3_FLOS`: ``Trainer.floating_point_ops`` counts a ZeRO-3 model's params by
  ``ds_numel`` (embeddings excluded, as transformers counts them) and keeps the count until a module
  of the model registers a parameter or a submodule. Other models (no ZeRO-3 params, 4-bit models) go
  to transformers' own count.
* :data:`ENGINE_TRAIN_UNCHANGED_MODE`: ``DeepSpeedEngine.train(mode)`` skips the recursion when
  every module already is in ``mode`` and every module's ``train`` is one known to do nothing
  else when the mode does not change (``torch.nn.Module.train``, transformers'
  ``PreTrainedModel.train``). A module with its own ``train`` (PEFT's DoRA layers clear a cache in
  theirs) gets the full call, as before.
* :data:`ENGINE_ZERO_GRAD_PARAM_LIST`: ``DeepSpeedEngine.zero_grad`` clears ``.grad`` over a list
  of the module's parameters instead of a ``named_parameters()`` walk.

The module and parameter lists are kept per root module and dropped whenever a module of the
tree registers a parameter or a submodule (torch's global registration hooks, installed with
the patches and removed by their undo; see :class:`~ds_z3native.compat.module_lists.TreeLists`),
so a model changed between steps is walked again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, when_module_imported, wrap_method
from .module_lists import LISTS, TreeLists, param_list, walk_modules

__all__ = ["ENGINE_TRAIN_UNCHANGED_MODE", "ENGINE_ZERO_GRAD_PARAM_LIST", "HF_TRAINER_ZERO3_FLOS",
           "PATCHES", "TreeLists", "walk_modules", "zero3_flops_param_count"]

log = logging.getLogger(__name__)




# ---- Trainer.floating_point_ops -------------------------------------------------------------------

def zero3_flops_param_count(model: Any) -> Optional[int]:
    """The parameter count transformers' FLOP estimate uses (``num_parameters(
    exclude_embeddings=True)``: every param but the weights of ``nn.Embedding`` modules), from
    ``ds_numel`` for ZeRO-3 partitioned params; None for a model whose first param is not
    ZeRO-3's (ZeRO-3 partitions all of a model's params or none) or a 4-bit one."""
    import torch

    first = next(iter(model.parameters()), None)
    if first is None or not hasattr(first, "ds_numel") or getattr(model, "is_loaded_in_4bit", False):
        return None
    embeddings = {f"{name}.weight" for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Embedding)}
    return sum(getattr(p, "ds_numel", p.numel()) for name, p in model.named_parameters()
               if name not in embeddings)


def _counting_zero3_params(floating_point_ops: Callable) -> Callable:
    def floating_point_ops_zero3(self: Any, inputs: Any) -> Any:
        model = self.model
        main_input = getattr(model, "main_input_name", "input_ids")
        if model is None or not hasattr(model, "num_parameters") or main_input not in inputs:
            return floating_point_ops(self, inputs)
        count = LISTS.get(model, "flops_params", lambda root, _: zero3_flops_param_count(root))
        if count is None:
            return floating_point_ops(self, inputs)
        return 6 * inputs[main_input].numel() * count

    return floating_point_ops_zero3


def _patch_trainer_flos() -> Undo:
    from transformers.trainer import Trainer

    if not callable(Trainer.__dict__.get("floating_point_ops")):
        log.debug("transformers.Trainer has no floating_point_ops of its own; not patched")
        return lambda: None
    return wrap_method(Trainer, "floating_point_ops", _counting_zero3_params)


def patch_trainer_flos() -> Undo:
    """``Trainer.floating_point_ops`` counts ZeRO-3 params by ``ds_numel``, once per model
    structure (applied when transformers' trainer module is imported)."""
    return undo_all([LISTS.track(),
                     when_module_imported("transformers.trainer", _patch_trainer_flos)])


# ---- DeepSpeedEngine.train ------------------------------------------------------------------------

def _no_effect_when_unchanged(train: Any) -> bool:
    """Whether a module class's ``train`` does nothing but set flags when the mode is unchanged:
    torch's own, or transformers' ``PreTrainedModel.train`` (which acts on a change only)."""
    import torch

    if train is torch.nn.Module.train:
        return True
    return (getattr(train, "__module__", None) == "transformers.modeling_utils"
            and getattr(train, "__qualname__", None) == "PreTrainedModel.train")


def _plain_train(root: Any, modules: List[Any]) -> Tuple[List[Any], bool]:
    return modules, all(_no_effect_when_unchanged(type(m).train) for m in modules)


def _skipping_unchanged_mode(train: Callable) -> Callable:
    def train_unless_unchanged(self: Any, mode: bool = True) -> Any:
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            modules, plain = LISTS.get(module, "plain_train", _plain_train)
            if isinstance(mode, bool) and plain and all(m.training is mode for m in modules):
                self.warn_unscaled_loss = True  # what the engine's train() sets besides the modes
                return None
        return train(self, mode)

    return train_unless_unchanged


def patch_engine_train() -> Undo:
    """``DeepSpeedEngine.train(mode)`` returns at once when nothing would change."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return undo_all([LISTS.track(), wrap_method(DeepSpeedEngine, "train", _skipping_unchanged_mode)])


# ---- DeepSpeedEngine.zero_grad --------------------------------------------------------------------

def _clearing_listed_grads(zero_grad: Callable) -> Callable:
    def zero_grad_listed(self: Any) -> None:
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None:
            return zero_grad(self)
        for param in LISTS.get(module, "params", param_list):
            param.grad = None
        return None

    return zero_grad_listed


def patch_engine_zero_grad() -> Undo:
    """``DeepSpeedEngine.zero_grad`` clears grads over a kept parameter list."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return undo_all([LISTS.track(),
                     wrap_method(DeepSpeedEngine, "zero_grad", _clearing_listed_grads)])


HF_TRAINER_ZERO3_FLOS = Patch(
    name="hf-trainer-zero3-flos",
    summary="transformers.Trainer.floating_point_ops counts ZeRO-3 params by ds_numel (it counted "
            "0 for every partitioned one), once per model structure instead of two walks a step",
    apply=patch_trainer_flos,
    wraps=("transformers.trainer:Trainer.floating_point_ops",),
    first=Version("0.19.0"),
    last=None,
)

ENGINE_TRAIN_UNCHANGED_MODE = Patch(
    name="engine-train-unchanged-mode",
    summary="DeepSpeedEngine.train(mode) skips the walk of every module when all already are in "
            "mode and none has a train() of its own (HF Trainer calls it every micro-step)",
    apply=patch_engine_train,
    wraps=("deepspeed.runtime.engine:DeepSpeedEngine.train",),
    first=Version("0.19.0"),
    last=None,
)

ENGINE_ZERO_GRAD_PARAM_LIST = Patch(
    name="engine-zero-grad-param-list",
    summary="DeepSpeedEngine.zero_grad clears .grad over a kept parameter list instead of a "
            "named_parameters() walk (HF Trainer calls it every step)",
    apply=patch_engine_zero_grad,
    wraps=("deepspeed.runtime.engine:DeepSpeedEngine.zero_grad",),
    first=Version("0.19.0"),
    last=None,
)

PATCHES: List[Patch] = [HF_TRAINER_ZERO3_FLOS, ENGINE_TRAIN_UNCHANGED_MODE,
                        ENGINE_ZERO_GRAD_PARAM_LIST]
