"""DeepCompile + Hugging Face gradient checkpointing: remove the graph breaks that are not needed.

``PreTrainedModel.gradient_checkpointing_enable()`` (transformers 5.x, for every model whose main
input is ``input_ids``; PEFT does the same) registers ``make_inputs_require_grads``, a forward hook
on the input embedding that calls ``output.requires_grad_(True)``: *reentrant* checkpointing needs
an input that requires grad, or the checkpointed blocks get no backward. Dynamo cannot trace
``requires_grad_()``: it breaks the graph there, and inside transformers' output-capturing context
manager it gives up on the whole frame, which then runs eagerly (see
:mod:`ds_z3native.compat.deepcompile_eager`). Non-reentrant checkpointing (``use_reentrant=False``,
PyTorch's recommendation) does not need the hook. Also, with checkpointing on, every training
forward logs ``use_cache=True is incompatible with gradient checkpointing`` through
``logger.warning_once``, another graph break, then sets ``use_cache=False`` itself.

* :data:`HF_CHECKPOINT_GRAPH_BREAKS` (every release): ``engine.compile()`` with DeepCompile first
  removes the input-require-grads hooks when every checkpointed layer is non-reentrant, and sets
  ``config.use_cache = False`` on checkpointed models (what transformers does on the first
  training forward). On checkpointed models, a layer whose class carries the ``kernels``
  package's per-instance routing wrapper (``use_kernelized_func``: transformers 5.25 puts it on
  its attention layers) and whose kernel functions were not replaced (no ``kernelize()``) gets
  its unwrapped forward as an instance attribute: the wrapper routes to the same functions and
  writes a context variable, which Dynamo refuses inside a checkpointed region ("HOP: Unsafe side
  effect"), so every checkpointed layer ran eagerly. Each change is logged; reentrant
  checkpointing is left as it is. The
  user's ``use_cache`` is what the config saves (``save_pretrained``, ``to_dict``): a model
  trained here and saved generates with its cache when loaded. On every model, checkpointed or
  not, a transformers model whose class name names no loss type (``GPT2LMHeadModel``) gets the
  loss type transformers falls back to (:func:`settle_default_loss`): its ``loss_function``
  property warned on every forward, a graph break that made Dynamo run PEFT's whole forward
  frame eagerly.

  Targets: ``DeepSpeedEngine.compile`` (verified: ``install()`` refuses the patch where its
  fingerprint is not the one recorded for the running DeepSpeed) and transformers'
  ``PreTrainedConfig.to_dict``, whose fingerprint is recorded for the transformers versions it
  was tested with: on another version it is reported *unverified* (a warning at ``install()``
  and a doctor line), not refused, since users run many transformers releases.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Set

from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, when_module_imported, wrap_method

__all__ = ["HF_CHECKPOINT_GRAPH_BREAKS", "PATCHES", "checkpoint_modes",
           "remove_checkpoint_graph_breaks", "settle_default_loss", "patch_checkpoint_graph_breaks",
           "is_kernels_routing"]

log = logging.getLogger(__name__)

# id() of each live config whose use_cache=True we turned off (configs are unhashable; an entry
# goes with its config): to_dict() serializes the user's True.
_USE_CACHE_TURNED_OFF: Set[int] = set()

# transformers' PreTrainedModel.enable_input_require_grads and PEFT's own copy of it.
_INPUT_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def checkpoint_modes(model: Any) -> List[str]:
    """How each checkpointed transformers layer checkpoints: ``"non-reentrant"``,
    ``"reentrant"`` or ``"unknown"`` (a checkpoint function we cannot read)."""
    modes = []
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(fn, functools.partial) and "use_reentrant" in fn.keywords:
            modes.append("reentrant" if fn.keywords["use_reentrant"] else "non-reentrant")
        else:
            modes.append("unknown")
    return modes


def is_kernels_routing(fn: Any) -> bool:
    """Whether ``fn`` is the ``kernels`` package's per-instance routing wrapper
    (``use_kernelized_func``'s inner ``new_forward``; by qualified name where Python records it,
    3.11+, else by name and file)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    qualname = getattr(code, "co_qualname", None)
    if qualname is not None:
        return "use_kernelized_func" in qualname
    return code.co_name == "new_forward" and "kernels" in code.co_filename


def _unkernelized_routing_forward(module: Any) -> Optional[Callable]:
    """The forward under the ``kernels`` package's per-instance routing wrapper of ``module``
    (``use_kernelized_func``, which transformers puts on attention layers), where the module's
    kernel functions were not replaced (``kernelize()``), so the routing changes nothing; else
    None."""
    forward = type(module).__dict__.get("forward")
    original = getattr(forward, "__wrapped__", None)
    if original is None or not is_kernels_routing(forward):
        return None
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return None
    for func in funcs.values():
        bound = getattr(func, "forward", None)
        if getattr(bound, "__func__", None) is not type(func).__dict__.get("forward"):
            return None  # kernelized: a hub kernel's forward was put in place
    return original


def remove_checkpoint_graph_breaks(model: Any) -> Dict[str, Any]:
    """Removes from ``model`` what breaks Dynamo graphs under non-reentrant checkpointing; returns
    what was done (``removed_hooks``: module names, ``use_cache_off``: config owners,
    ``kernel_routing_off``: modules that run their forward without the routing wrapper)."""
    done: Dict[str, Any] = {"removed_hooks": [], "use_cache_off": [], "kernel_routing_off": []}
    modes = checkpoint_modes(model)
    if not modes:
        return done
    for name, module in model.named_modules():
        original = _unkernelized_routing_forward(module)
        if original is not None and "forward" not in module.__dict__:
            module.forward = types.MethodType(original, module)
            done["kernel_routing_off"].append(name or "<root>")
    if done["kernel_routing_off"]:
        log.info("gradient checkpointing: %d module(s) (%s, ...) run their forward without the "
                 "kernels package's routing wrapper, which changes nothing for a model whose "
                 "kernels were not replaced and whose context-variable writes Dynamo cannot trace "
                 "inside a checkpointed region", len(done["kernel_routing_off"]),
                 done["kernel_routing_off"][0])
    if set(modes) == {"non-reentrant"}:
        for name, module in model.named_modules():
            for key, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__name__", "") in _INPUT_GRAD_HOOKS:
                    del module._forward_hooks[key]
                    module._forward_hooks_with_kwargs.pop(key, None)
                    module._forward_hooks_always_called.pop(key, None)
                    done["removed_hooks"].append(name or "<root>")
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            if id(config) not in _USE_CACHE_TURNED_OFF:
                _USE_CACHE_TURNED_OFF.add(id(config))
                weakref.finalize(config, _USE_CACHE_TURNED_OFF.discard, id(config))
            done["use_cache_off"].append(name or "<root>")
    if done["removed_hooks"]:
        log.info("non-reentrant checkpointing: removed the input-require-grads hook of %s "
                 "(only reentrant checkpointing needs it; Dynamo cannot trace it)",
                 ", ".join(done["removed_hooks"]))
    if done["use_cache_off"]:
        log.info("gradient checkpointing: use_cache=False on %s (as transformers sets it in "
                 "training, without its per-forward warning)", ", ".join(done["use_cache_off"]))
    return done


def settle_default_loss(model: Any) -> List[str]:
    """Gives each transformers model in ``model`` whose forward computes its loss through
    ``self.loss_function`` and whose class name names no loss transformers knows
    (``GPT2LMHeadModel``, ``CTRLLMHeadModel``, ...: ``loss_type`` None) the loss type transformers
    falls back to for it. The ``loss_function`` property logs a ``warning_once`` on every such
    forward, which Dynamo cannot trace: a graph break in each compiled forward, inside PEFT's
    forward-hook context, where Dynamo then gives up on the whole frame. The property is read
    here once, outside compiled code (its warning is logged then, as on a first forward), and
    ``loss_type`` is set to the entry of transformers' loss table it returned: the same loss
    function, no warning. A ``loss_type`` set to a name transformers does not know falls back
    the same way and is settled the same way. Returns ``"<module name>: <loss type>"`` for each
    module changed."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # a transformers without a loss table has no such property
        return []
    changed: List[str] = []
    for name, module in model.named_modules():
        if getattr(module, "loss_type", None) in LOSS_MAPPING or hasattr(module, "_loss_function"):
            continue
        if not isinstance(getattr(type(module), "loss_function", None), property):
            continue
        forward = getattr(type(module), "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward else None
        if code is None or "loss_function" not in code.co_names:
            continue  # a base model (GPT2Model, LlamaModel): its forward computes no loss
        fallback = module.loss_function
        # Several names may share the function (ForCausalLM, ForConditionalGeneration): the first.
        known = [key for key, fn in LOSS_MAPPING.items() if fn is fallback]
        if not known:
            continue
        module.loss_type = known[0]
        changed.append(f"{name or '<root>'}: {known[0]}")
    if changed:
        log.info("transformers' default loss: loss_type set on %s (the loss transformers falls "
                 "back to for that class, without its per-forward warning)", ", ".join(changed))
    return changed


def _compiling_without_breaks(compile_fn: Callable) -> Callable:
    def compile_without_checkpoint_breaks(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.is_deepcompile_enabled():
            fixes = remove_checkpoint_graph_breaks(self.module)
            fixes["default_loss"] = settle_default_loss(self.module)
            self._ds_z3native_graph_break_fixes = fixes
        return compile_fn(self, *args, **kwargs)

    return compile_without_checkpoint_breaks


def _serializing_users_use_cache(to_dict: Callable) -> Callable:
    def to_dict_with_users_use_cache(self: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        output = to_dict(self, *args, **kwargs)
        if id(self) in _USE_CACHE_TURNED_OFF and "use_cache" in output:
            output["use_cache"] = True
        return output

    return to_dict_with_users_use_cache


def _patch_config_to_dict() -> Undo:
    from transformers import configuration_utils

    config_cls = getattr(configuration_utils, "PreTrainedConfig", None) or \
        configuration_utils.PretrainedConfig
    return wrap_method(config_cls, "to_dict", _serializing_users_use_cache)


def patch_checkpoint_graph_breaks() -> Undo:
    """engine.compile() with DeepCompile first removes the checkpointing graph breaks; configs
    whose use_cache it turned off serialize the user's value."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return undo_all([
        wrap_method(DeepSpeedEngine, "compile", _compiling_without_breaks),
        when_module_imported("transformers.configuration_utils", _patch_config_to_dict)])


HF_CHECKPOINT_GRAPH_BREAKS = Patch(
    name="deepcompile-hf-checkpoint-graph-breaks",
    summary="engine.compile() with DeepCompile removes transformers' input-require-grads hook "
            "under non-reentrant checkpointing and turns use_cache off (two graph breaks), and "
            "settles the default loss of a model whose class names none (GPT2LMHeadModel: a "
            "warning and a graph break in every forward)",
    apply=patch_checkpoint_graph_breaks,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.runtime.engine:DeepSpeedEngine.compile",
        "transformers.configuration_utils:PreTrainedConfig.to_dict",
        # Read once per model (settle_default_loss); the loss_type it then finds is ours.
        "transformers.modeling_utils:PreTrainedModel.loss_function",
    ),
)

PATCHES: List[Patch] = [HF_CHECKPOINT_GRAPH_BREAKS]
