"""DeepCompile on inputs whose sizes change from step to step (padded batches of varying length).

Dynamo marks a dimension dynamic when a second size is seen (automatic dynamic shapes) and then
serves every later size from one graph. Two things in DeepSpeed defeat that:

* :data:`DEEPCOMPILE_SYMBOLIC_INPUT_GUARDS` (every release this package supports):
  ``deepspeed/compile/patch_fake_tensor.py`` wraps Dynamo's ``wrap_to_fake_tensor_and_record``
  and overwrites ``tx.output.input_source_to_sizes_strides[source]`` with
  ``_get_guard_sizes_strides(t)`` for *every* input tensor: the released ``empty(0)`` shape for a
  ZeRO-3 param (what it is meant for), but the *real* tensor's ``t.size()``/``t.stride()`` for any
  other input. Dynamo builds each input's ``TENSOR_MATCH`` guard from that entry, so a graph
  traced with a symbolic sequence length still guards on the concrete one
  (``tensor 'labels' size mismatch at index 1. expected 17, actual 9``): every new length
  compiles a new (already dynamic) graph until ``recompile_limit`` sends the frame to eager.
  With the patch, after DeepSpeed's wrapper has run, an input that is not a ZeRO-3 param gets
  back the sizes and strides of its fake tensor, which Dynamo itself recorded.
* :data:`DEEPCOMPILE_KEEP_AUTOMATIC_DYNAMIC` (every release): the re-plan
  (``launch_compile_passes``) calls ``torch._dynamo.reset()``, which also drops Dynamo's record of
  which input dimensions were seen to change (``torch._dynamo.pgo``'s code state): the re-plan's
  first graph is static again and the next new length compiles once more. The record is kept
  across DeepSpeed's reset (compiled code and caches are still dropped).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, List

from packaging.version import Version

from . import Patch, Undo
from ._rebind import when_module_imported, wrap_function
from .deepcompile_schedule import wrap_launch_compile_passes

__all__ = ["DEEPCOMPILE_SYMBOLIC_INPUT_GUARDS", "DEEPCOMPILE_KEEP_AUTOMATIC_DYNAMIC",
           "PATCHES"]

FAKE_MODULE = "deepspeed.compile.patch_fake_tensor"
INIT_Z3_MODULE = "deepspeed.compile.init_z3"
_FIXED = "_ds_z3native_symbolic_guards"


def _keeping_symbolic_sizes(ds_wrapper: Callable) -> Callable:
    def wrap_to_fake_tensor_and_record(t: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        fake = ds_wrapper(t, *args, **kwargs)
        source = kwargs.get("source")
        if source is not None and not hasattr(t, "ds_id") and isinstance(fake, torch.Tensor):
            tx = kwargs["tx"] if "tx" in kwargs else args[0]
            entry = tx.output.input_source_to_sizes_strides.get(source)
            if entry is not None and "values_size" not in entry:  # sparse: as DeepSpeed left it
                entry["size"], entry["stride"] = fake.size(), fake.stride()
        return fake

    setattr(wrap_to_fake_tensor_and_record, _FIXED, True)
    return wrap_to_fake_tensor_and_record


def _then_symbolic_guards(patch_fake_tensor: Callable) -> Callable:
    def patch_fake_tensor_keeping_symbols() -> None:
        from torch._dynamo.variables import builder

        patch_fake_tensor()  # DeepSpeed's wrapper goes on (init_z3 calls this at each compile)
        if not getattr(builder.wrap_to_fake_tensor_and_record, _FIXED, False):
            builder.wrap_to_fake_tensor_and_record = _keeping_symbolic_sizes(
                builder.wrap_to_fake_tensor_and_record)

    return patch_fake_tensor_keeping_symbols


def patch_symbolic_input_guards() -> Undo:
    """``patch_fake_tensor`` (in its module and in ``init_z3``) is followed by the restore of
    Dynamo's own size/stride guard entries for inputs that are not ZeRO-3 params. The undo puts
    ``patch_fake_tensor`` back; a wrapper already installed on Dynamo stays (DeepSpeed never
    removes its own either) and only restores what Dynamo recorded."""
    def apply() -> Undo:
        owners = [importlib.import_module(FAKE_MODULE), importlib.import_module(INIT_Z3_MODULE)]
        return wrap_function(owners, "patch_fake_tensor", _then_symbolic_guards)

    return when_module_imported(INIT_Z3_MODULE, apply)


def _keeping_automatic_dynamic(launch: Callable) -> Callable:
    def launch_compile_passes(*args: Any, **kwargs: Any) -> Any:
        try:
            from torch._dynamo import pgo
        except ImportError:  # a torch without the record: nothing to keep
            return launch(*args, **kwargs)
        kept = getattr(pgo, "_CODE_STATE", None)
        try:
            return launch(*args, **kwargs)
        finally:
            if kept is not None and getattr(pgo, "_CODE_STATE", kept) is None:
                pgo._CODE_STATE = kept  # reset() ran: the record comes back

    return launch_compile_passes


def patch_keep_automatic_dynamic() -> Undo:
    """DeepCompile's re-plan (``launch_compile_passes``) keeps Dynamo's record of which input
    dimensions were seen to change across the ``torch._dynamo.reset()`` it runs."""
    return wrap_launch_compile_passes(_keeping_automatic_dynamic)


DEEPCOMPILE_SYMBOLIC_INPUT_GUARDS = Patch(
    name="deepcompile-symbolic-input-guards",
    summary="inputs that are not ZeRO-3 params keep Dynamo's symbolic size guards (DeepSpeed's "
            "patch_fake_tensor guards every input on its concrete size: one DeepCompile compile "
            "per sequence length, then eager at recompile_limit)",
    apply=patch_symbolic_input_guards,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.patch_fake_tensor:patch_fake_tensor",
        "deepspeed.compile.patch_fake_tensor:_get_guard_sizes_strides",  # what it overwrites with
    ),
)

DEEPCOMPILE_KEEP_AUTOMATIC_DYNAMIC = Patch(
    name="deepcompile-keep-automatic-dynamic",
    summary="DeepCompile's re-plan keeps Dynamo's automatic-dynamic record across its "
            "torch._dynamo.reset() (the re-plan's first graph is dynamic where the first cycle's "
            "became dynamic)",
    apply=patch_keep_automatic_dynamic,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.compile.backend:launch_compile_passes",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_SYMBOLIC_INPUT_GUARDS, DEEPCOMPILE_KEEP_AUTOMATIC_DYNAMIC]
