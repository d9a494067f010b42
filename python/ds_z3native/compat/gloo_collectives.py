"""DeepSpeed's CPU (gloo) collectives issued under torch.compile's Python dispatcher: a deadlock.

DeepCompile runs collectives while it compiles: its passes and profiler agree on budgets and
profiles across ranks (``dist.all_reduce`` on small real tensors) with AOTAutograd's Python
dispatcher enabled and, in the passes, a ``FakeTensorMode`` active. Each such call then reaches
gloo's ``ProcessGroupGloo::enqueue`` from a Python dispatch handler, holding the GIL. Gloo's
worker thread destroys a finished work while holding the queue lock, and dropping the work's
last tensor reference takes the GIL when a Python object owns the tensor. When the two meet,
the caller waits for the queue lock holding the GIL and the worker waits for the GIL holding the
queue lock: the process hangs for good (a CI run hung inside
``deepspeed.compile.passes.zero3_compile._reduce_int``; a loop of that call in a fake mode hangs
within 2,000 collectives here). The worker also inherits the caller's Python dispatcher, so
executing the collective itself needs the GIL.

* :data:`GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH` (every release): each collective of DeepSpeed's
  torch backend, called while the Python dispatcher or a dispatch mode is active or given a fake
  tensor (which dispatches through its fake mode even after the mode exited), and not while a
  graph is recorded (Dynamo, or ``make_fx``/AOTAutograd's proxy or functionalization mode),
  runs with the dispatcher and the modes switched off when every tensor it is given has a real
  CPU value: a real CPU tensor, or a fake tensor carrying a real constant. The latter is what
  DeepCompile's passes reduce: they create ``torch.tensor([n])`` inside their
  ``FakeTensorMode``, which makes a fake tensor holding the real value as its constant and would
  run the collective on that constant, holding the GIL. The patch runs it on the constant
  itself, where a read of the fake tensor (``.item()``) finds the result. Without the modes the
  call goes through pybind's GIL release straight to gloo, and means the same. CUDA tensors
  (NCCL), fake tensors with no real value and collectives being traced into a graph are left as
  they are. ds_z3native's own op issues its collectives the same way in C++
  (``csrc/comm/c10d_collectives.cpp``).

* :data:`COALESCED_GATHER_WAITS_ON_EVERY_HANDLE` (0.19.0 - 0.19.7): ZeRO-3's
  ``Init._allgather_params_coalesced`` (``GatheredParameters`` and the other blocking gathers)
  launches one asynchronous all-gather per param and waits only on the last handle, assuming the
  handles complete in order and a device synchronize after it. Gloo's handles are independent
  and the CPU synchronize is a no-op, so the params are read while some gathers are still in
  flight: uninitialised memory now and then (2 of 300 gathers at world size 2 on DeepSpeed
  0.19.2). 0.19.8 waits on every handle. The patch makes each handle that DeepSpeed's all-gathers
  return inside that method wait, when waited on, for every handle issued before it in the same
  call, so the last one's wait covers all of them; the method itself is unchanged.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, wrap_function, wrap_method

__all__ = ["COLLECTIVES", "GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH",
           "COALESCED_GATHER_WAITS_ON_EVERY_HANDLE", "patch_coalesced_gather_waits", "PATCHES",
           "python_dispatch_active", "tracing_active", "outside_python_dispatch",
           "patch_gloo_collectives", "real_cpu_arguments"]

# DeepSpeed's TorchBackend methods that issue a collective on tensors (barrier has none of ours).
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "broadcast",
               "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
               "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter")


def python_dispatch_active() -> bool:
    """Whether an op called now would be dispatched through Python: the Python dispatcher is
    enabled (AOTAutograd, DeepCompile's profiler) or a ``TorchDispatchMode`` is active."""
    return bool(torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
                or torch._C._len_torch_dispatch_stack() > 0)


def tracing_active() -> bool:
    """Whether a graph is being recorded: Dynamo traces, or ``make_fx``/AOTAutograd's proxy or
    functionalization mode is active. A collective called then belongs in the graph."""
    if torch.compiler.is_dynamo_compiling():
        return True
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if keys is None:  # a torch without infra mode keys: nothing is known to trace
        return False
    return any(torch._C._get_dispatch_mode(getattr(keys, name)) is not None
               for name in ("PROXY", "FUNCTIONAL") if hasattr(keys, name))


# What _issuable returns for a tensor gloo cannot be given as it is.
_NOT_ISSUABLE = object()


def _issuable(value: Any) -> Any:
    """``value`` with each tensor as gloo would receive it: a real CPU tensor as it is, a fake
    tensor by the real CPU constant it carries (what ``FakeTensorMode`` would run the collective
    on); ``_NOT_ISSUABLE`` where a tensor is neither (meta, CUDA, a fake without a constant, a
    wrapper subclass). Lists and tuples are mapped item by item; a container in which nothing
    was replaced is returned as it is (the same object)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, torch.Tensor):
        if is_fake(value):
            value = getattr(value, "constant", None)
            if value is None or is_fake(value):
                return _NOT_ISSUABLE
        if value.device.type != "cpu" or is_traceable_wrapper_subclass(value):
            return _NOT_ISSUABLE
        return value
    if isinstance(value, (list, tuple)):
        items = [_issuable(item) for item in value]
        if any(item is _NOT_ISSUABLE for item in items):
            return _NOT_ISSUABLE
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _any_fake(args: tuple, kwargs: dict) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) for t in _tensors(list(args) + list(kwargs.values())))


def real_cpu_arguments(args: tuple, kwargs: dict) -> Optional[Tuple[tuple, Dict[str, Any]]]:
    """The collective's arguments with every tensor a real CPU tensor (fake tensors replaced by
    their constants, see :func:`_issuable`), or None when some tensor has no real CPU value or
    there is no tensor at all."""
    if next(_tensors(list(args) + list(kwargs.values())), None) is None:
        return None
    real_args = _issuable(tuple(args))
    real_kwargs = {key: _issuable(value) for key, value in kwargs.items()}
    if real_args is _NOT_ISSUABLE or any(v is _NOT_ISSUABLE for v in real_kwargs.values()):
        return None
    return real_args, real_kwargs


def outside_python_dispatch(collective: Callable) -> Callable:
    """Wrap a DeepSpeed backend collective to run without the Python dispatcher and dispatch
    modes when given real CPU tensors under them (see the module doc)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def collective_outside_python_dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        # is_dynamo_compiling() first: Dynamo traces it as a constant True (the rest it cannot
        # trace) and it is False when this runs. Not is_compiling(): that flag stays True for a
        # whole torch.compile session, backends included, which is where DeepCompile's passes
        # issue their collectives.
        if torch.compiler.is_dynamo_compiling():
            return collective(self, *args, **kwargs)
        # Every eager collective (ZeRO-3's gathers and reductions) leaves here: nothing would
        # dispatch through Python. A fake tensor would, through its fake mode, even after the
        # mode has exited.
        if not python_dispatch_active() and not _any_fake(args, kwargs):
            return collective(self, *args, **kwargs)
        if tracing_active():
            return collective(self, *args, **kwargs)
        real = real_cpu_arguments(args, kwargs)
        if real is None:
            return collective(self, *args, **kwargs)
        with torch._C._DisablePythonDispatcher(), _disable_current_modes():
            return collective(self, *real[0], **real[1])

    return collective_outside_python_dispatch


def patch_gloo_collectives() -> Undo:
    """Every collective of DeepSpeed's TorchBackend this DeepSpeed has, wrapped."""
    from deepspeed.comm.torch import TorchBackend

    return undo_all([wrap_method(TorchBackend, name, outside_python_dispatch)
                     for name in COLLECTIVES if name in TorchBackend.__dict__])


GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH = Patch(
    name="gloo-collectives-outside-python-dispatch",
    summary="DeepSpeed's collectives on real CPU tensors (or the real constants of fake "
            "tensors), called under torch.compile's Python dispatcher or a dispatch mode "
            "(DeepCompile's passes and profiler), run without them: gloo's queue lock and the "
            "GIL no longer deadlock",
    apply=patch_gloo_collectives,
    first=Version("0.19.0"),
    last=None,
    wraps=tuple(f"deepspeed.comm.torch:TorchBackend.{name}" for name in COLLECTIVES),
)


# ---- _allgather_params_coalesced: wait on every handle -------------------------------------

# DeepSpeed's all-gathers whose handles _allgather_params_coalesced collects.
_COALESCED_GATHERS = ("all_gather_into_tensor", "all_gather")
_coalesced = threading.local()  # .issued: the handles of the coalesced gather running here


class _WaitsForEarlier:
    """A collective's handle whose ``wait()`` first waits on the handles issued before it in the
    same coalesced gather. Everything else is the handle's own."""

    __slots__ = ("_handle", "_earlier")

    def __init__(self, handle: Any, earlier: List[Any]) -> None:
        self._handle = handle
        self._earlier = earlier

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        for handle in self._earlier:
            handle.wait()
        return self._handle.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _collecting(gather: Callable) -> Callable:
    def gather_collecting_handles(*args: Any, **kwargs: Any) -> Any:
        handle = gather(*args, **kwargs)
        issued = getattr(_coalesced, "issued", None)
        if issued is None or handle is None:  # outside the coalesced gather, or synchronous
            return handle
        waiting = _WaitsForEarlier(handle, list(issued))
        issued.append(handle)
        return waiting

    return gather_collecting_handles


def _waiting_on_every_handle(method: Callable) -> Callable:
    def allgather_params_coalesced(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_coalesced, "issued", None)
        _coalesced.issued = []
        try:
            return method(self, *args, **kwargs)
        finally:
            _coalesced.issued = outer

    return allgather_params_coalesced


def patch_coalesced_gather_waits() -> Undo:
    """``Init._allgather_params_coalesced`` made to wait on every all-gather it launched."""
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.zero import partition_parameters

    owners = [ds_comm, getattr(ds_comm, "comm", ds_comm)]
    return undo_all([wrap_function(owners, name, _collecting) for name in _COALESCED_GATHERS]
                    + [wrap_method(partition_parameters.Init, "_allgather_params_coalesced",
                                   _waiting_on_every_handle)])


COALESCED_GATHER_WAITS_ON_EVERY_HANDLE = Patch(
    name="zero3-coalesced-gather-waits-on-every-handle",
    summary="ZeRO-3's blocking coalesced all-gather (GatheredParameters) waits on every gloo "
            "handle it launched, not only the last, so no param is read while its gather is "
            "still in flight (uninitialised values on CPU)",
    apply=patch_coalesced_gather_waits,
    first=Version("0.19.0"),
    last=Version("0.19.7"),  # 0.19.8 waits on every handle itself
    wraps=(
        "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced",
        "deepspeed.comm.comm:all_gather_into_tensor",
        "deepspeed.comm.comm:all_gather",
    ),
)

PATCHES: List[Patch] = [GLOO_COLLECTIVES_OUTSIDE_PYTHON_DISPATCH,
                        COALESCED_GATHER_WAITS_ON_EVERY_HANDLE]
