"""DeepSpeed's CPU (gloo) collectives issued under torch.compile's Python dispatcher: a deadlock.

DeepCompile runs collectives while it compiles: its passes and profiler agree on budgets and
profiles across ranks (``dist.all_reduce`` on small real tensors) with AOTAutograd's Python
dispatcher enabled and, in the passes, a ``FakeTensorMode`` active. Each such call then reaches
gloo's ``ProcessGroupGloo::enqueue`` from a Python dispatch handler, holding the GIL. Gloo's
worker thread destroys a finished work while holding the queue lock, and dropping the work's
last tensor reference takes the GIL when a Python object owns the tensor. When the two meet,
the caller waits for the queue lock holding the GIL and the worker waits for the GIL holding the
queue lock: the process hangs for good (seen once in six CPU DeepCompile runs, inside
``deepspeed.compile.passes.zero3_compile._reduce_int``). The worker also inherits the caller's
Python dispatcher, so executing the collective itself needs the GIL.

* :data:`GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH` (every release): each collective of DeepSpeed's
  torch backend, called with real CPU tensors while the Python dispatcher or a dispatch mode is
  active (and not while Dynamo traces), runs with both switched off. A real tensor's collective
  means the same with or without them (a fake mode passes real tensors through to the kernel);
  without them it goes through pybind's GIL release straight to gloo. CUDA tensors (NCCL) and
  traced collectives are left as they are. ds_z3native's own op issues its collectives the same
  way in C++ (``csrc/comm/c10d_collectives.cpp``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

import torch
from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, wrap_method

__all__ = ["COLLECTIVES", "GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH", "PATCHES",
           "python_dispatch_active", "outside_python_dispatch", "patch_gloo_collectives"]

# DeepSpeed's TorchBackend methods that issue a collective on tensors (barrier has none of ours).
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "broadcast",
               "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
               "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter")


def python_dispatch_active() -> bool:
    """Whether an op called now would be dispatched through Python: the Python dispatcher is
    enabled (AOTAutograd, DeepCompile's profiler) or a ``TorchDispatchMode`` is active."""
    return bool(torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
                or torch._C._len_torch_dispatch_stack() > 0)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _real_cpu_tensors(args: tuple, kwargs: dict) -> bool:
    """Every tensor argument is a real (not fake, not a wrapper subclass) CPU tensor, and there
    is at least one."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    found = False
    for t in _tensors(list(args) + list(kwargs.values())):
        if t.device.type != "cpu" or is_fake(t) or is_traceable_wrapper_subclass(t):
            return False
        found = True
    return found


def outside_python_dispatch(collective: Callable) -> Callable:
    """Wrap a DeepSpeed backend collective to run without the Python dispatcher and dispatch
    modes when given real CPU tensors under them (see the module doc)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def collective_outside_python_dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        # is_dynamo_compiling() first: Dynamo traces it as a constant True (the rest it cannot
        # trace) and it is False when this runs. Not is_compiling(): that flag stays True for a
        # whole torch.compile session, backends included, which is where DeepCompile's passes
        # issue their collectives.
        if (torch.compiler.is_dynamo_compiling() or not python_dispatch_active()
                or not _real_cpu_tensors(args, kwargs)):
            return collective(self, *args, **kwargs)
        with torch._C._DisablePythonDispatcher(), _disable_current_modes():
            return collective(self, *args, **kwargs)

    return collective_outside_python_dispatch


def patch_gloo_collectives() -> Undo:
    """Every collective of DeepSpeed's TorchBackend this DeepSpeed has, wrapped."""
    from deepspeed.comm.torch import TorchBackend

    return undo_all([wrap_method(TorchBackend, name, outside_python_dispatch)
                     for name in COLLECTIVES if name in TorchBackend.__dict__])


GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH = Patch(
    name="gloo-collectives-outside-python-dispatch",
    summary="DeepSpeed's collectives on real CPU tensors, called under torch.compile's Python "
            "dispatcher or a dispatch mode (DeepCompile's passes and profiler), run without "
            "them: gloo's queue lock and the GIL no longer deadlock",
    apply=patch_gloo_collectives,
    first=Version("0.19.0"),
    last=None,
)

PATCHES: List[Patch] = [GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH]
