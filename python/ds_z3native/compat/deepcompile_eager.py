"""DeepCompile ZeRO-3: code that runs outside the compiled graphs sees gathered params.

Once ``engine.compile()`` has run with ``"compile": {"deepcompile": true}``, DeepCompile owns the
ZeRO-3 params: it removes ZeRO-3's module hooks and gathers each param inside its compiled graphs
(``dc::allgather_param``). Code that Dynamo does not compile still runs, eagerly: the rest of a
frame Dynamo gave up on after a graph break it could not handle (for example inside a context
manager), a module called from such a frame, a hook. That code reads the param's partitioned
storage, a shape-``[0]`` tensor. Seen on one H200 (DeepSpeed 0.19.2 and 0.19.8, torch 2.11,
transformers 5.17): an HF Llama + PEFT LoRA with non-reentrant gradient checkpointing fails before
its first step with ``RuntimeError: 'weight' must be 2-D`` from the input embedding. DeepSpeed
0.19.2 has no eager fallback at all; 0.19.8's (a parameter getter) did not gather there.

* :data:`EAGER_GATHER` (every release): after ``engine.compile()`` every module with ZeRO-3 params
  of its own gets a parameter dict (a subclass of DeepSpeed's ``ZeROOrderedDict``, so DeepSpeed's
  own getter still runs after ours) whose getter, traced by Dynamo, is the plain lookup
  (``torch.compiler.is_dynamo_compiling()`` is constant there), and read eagerly inside the engine's
  forward or backward gathers a partitioned frozen param (``param.all_gather``), held until the
  end of the engine backward of every grad-enabled forward run since (a frozen Linear's backward
  needs its weight for the input gradient; ``retain_graph=True`` keeps them), or until the end of a
  no-grad forward when no backward is pending. A *trainable* param read
  eagerly with grad enabled raises :class:`EagerTrainableParam`: its gradient would bypass
  DeepCompile's ``reduce_grad`` (DeepSpeed 0.19.8's own fallback lets it through and the optimizer
  step then fails on a full-size gradient), so we refuse instead.
  Dynamo reading a param while it traces or builds guards is left alone. The engine's forward and backward are
  wrapped to mark the window and release. The gather runs with Dynamo disabled (eager code is
  still under Dynamo's frame hook, and a compiled frame of the gather would hand the param to
  DeepCompile's backend, whose profiler partitions it), and a held param's ``partition`` is
  deferred until the release: DeepCompile's profiler partitions the params of every graph it
  profiles, whoever gathered them.
* :data:`EAGER_GENERATE` (every release): transformers' ``generate()`` on an engine's model (an
  evaluation callback's samples) runs outside the engine's forward. Where the model Dynamo
  compiled is not the one ``generate()`` forwards through (PEFT's ``generate`` calls its wrapped
  model's, which ``engine.compile()`` never compiled), those forwards are eager and read
  partitioned params: ``'weight' must be 2-D``. The patch makes a ``generate()`` call on a model
  of such an engine an eager-gather window (:meth:`EagerFallbackGather.inference`): what its
  forwards read is gathered, trainable params too (``generate()`` runs under ``no_grad``: no
  gradient to lose), and partitioned again when it returns. It is called on every rank, as
  ZeRO-3 needs of any forward.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from packaging.version import Version

from . import Patch, Undo
from ._rebind import undo_all, when_module_imported, wrap_method

__all__ = ["EAGER_GATHER", "EAGER_GENERATE", "PATCHES", "EagerFallbackGather",
           "EagerTrainableParam", "patch_eager_gather", "patch_eager_generate", "eager_gather_of"]

log = logging.getLogger(__name__)

_ATTR = "_ds_z3native_eager_gather"
_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()  # engines given an eager gather


class EagerTrainableParam(RuntimeError):
    """A trainable ZeRO-3 param ran outside DeepCompile's graphs; its gradient would be lost."""


# Dynamo modules that run user code for real rather than inspect it: the wrapper of a
# torch._dynamo.disable'd function and of a compiled module's call.
_DYNAMO_RUNNERS = ("torch._dynamo.eval_frame", "torch._dynamo.external_utils")


def _dynamo_is_inspecting() -> bool:
    """Whether Dynamo itself reads the param: tracing a frame (it looks at real values to build
    variables) or building guards. Gathering then would change the param under the guards being
    built (seen with torch 2.11: "Guard failed on the same frame it was created ... rank
    mismatch"), and torch 2.11 does not report that as torch.compiler.is_compiling()."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("torch._dynamo.") and name not in _DYNAMO_RUNNERS:
            return True
        frame = frame.f_back
    return False


def _never_compiled(fn: Callable) -> Callable:
    """``fn`` and what it calls always run eagerly. The eager code that reads a param is still
    under Dynamo's frame hook: each function it calls starts a frame Dynamo may compile, with
    the backend in use, here DeepCompile's. Seen on one H200 (torch 2.11): Dynamo compiled
    :meth:`EagerFallbackGather.gather` around DeepSpeed's ``all_gather`` with the param as a
    graph input, and DeepCompile's graph profiler, which partitions every param of a graph it
    profiles, undid the gather: the embedding then read a shape-[0] weight (``'weight' must be
    2-D``)."""
    import torch

    return torch.compiler.disable(fn, recursive=True)


def _eager_params_class() -> type:
    """A ZeRO-3 parameter dict (DeepSpeed's ZeROOrderedDict, so DeepSpeed's own getter logic
    still runs and DeepSpeed keeps it in place) that, read eagerly inside the engine's forward
    or backward, hands partitioned params to :class:`EagerFallbackGather` first."""
    global _EAGER_PARAMS_CLS
    if _EAGER_PARAMS_CLS is not None:
        return _EAGER_PARAMS_CLS
    from collections import OrderedDict

    import torch
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    not_available = ZeroParamStatus.NOT_AVAILABLE

    class EagerGatherParams(ZeROOrderedDict):
        def __init__(self, parent_module: Any, owner: "EagerFallbackGather", name: str,
                     items: Any) -> None:
            super().__init__(parent_module, items)
            self._dsz_owner = owner
            self._dsz_name = name

        def __reduce__(self) -> Any:
            # A copy (deepcopy, torch.save of the module) is DeepSpeed's plain parameter dict:
            # the eager-gather owner belongs to this engine only.
            _, _, *rest = OrderedDict.__reduce__(self)
            return (ZeROOrderedDict, (self._parent_module,)) + tuple(rest)

        def __getitem__(self, key: str) -> Any:
            param = OrderedDict.__getitem__(self, key)
            # is_dynamo_compiling(): a constant True where Dynamo traces this getter, False
            # whenever this body runs. Not is_compiling(): torch raises that flag for a whole
            # compile session (backends included), not only while Dynamo traces; eager code run
            # under it is still eager and must get a gathered param. Dynamo reading the
            # param for real (while tracing or building guards) is told apart by its frames.
            if param is None or torch.compiler.is_dynamo_compiling():
                return param
            return self._eager_getitem(key, param)

        @_never_compiled
        def _eager_getitem(self, key: str, param: Any) -> Any:
            # Eager from here on, DeepSpeed's getter included (see _never_compiled).
            owner = self._dsz_owner
            if (owner.active and getattr(param, "ds_status", None) == not_available
                    and not _dynamo_is_inspecting()):
                owner.gather(f"{self._dsz_name}.{key}" if self._dsz_name else key, param)
            return super().__getitem__(key)

    _EAGER_PARAMS_CLS = EagerGatherParams
    return EagerGatherParams


_EAGER_PARAMS_CLS: Optional[type] = None


class EagerFallbackGather:
    """The eager-fallback gather of one engine: the parameter dicts it put on the engine's
    modules, and the params gathered through them (held until :meth:`release`)."""

    def __init__(self, engine: Any) -> None:
        cls = _eager_params_class()
        self._held: Dict[int, Tuple[Any, Optional[Callable]]] = {}  # ds_id -> (param, its partition)
        self._modules: List[Tuple[Any, Any]] = []  # (module, the dict it had)
        self.active = False  # inside the engine's forward or backward, or a generate()
        self.pending_backwards = 0  # grad-enabled forwards whose engine.backward has not run
        self.gathered_total = 0  # params gathered eagerly since the engine compiled
        self.deferred_partitions = 0  # partitions of held params others asked for (see _hold)
        self.eager_params: List[str] = []  # names, first time each was gathered
        self.generations = 0  # generate() windows entered
        for mod_name, module in engine.module.named_modules():
            own = module.__dict__.get("_parameters")
            if not own or not any(hasattr(p, "ds_id") for p in own.values() if p is not None):
                continue
            self._modules.append((module, own))
            module._parameters = cls(module, self, mod_name, own)

    @_never_compiled
    def gather(self, name: str, param: Any) -> None:
        """Gather ``param`` (partitioned) for eager code, or refuse a trainable one."""
        import torch

        if param.requires_grad and torch.is_grad_enabled():
            raise EagerTrainableParam(
                f"ds_z3native: {name} (ds_id {param.ds_id}) was read by code running outside "
                "DeepCompile's compiled graphs (eager code after a graph break Dynamo could not "
                "handle). DeepCompile reduces gradients only inside its graphs, so this "
                "trainable param's gradient would be lost. Find the graph break with "
                "TORCH_LOGS=graph_breaks and remove it, or train without DeepCompile.")
        param.all_gather()
        self._hold(name, param)
        self.gathered_total += 1
        if name not in self.eager_params:
            self.eager_params.append(name)
            log.info("%s (ds_id %d) was read outside DeepCompile's graphs (eager fallback); "
                     "gathered until the end of backward", name, param.ds_id)

    def _hold(self, name: str, param: Any) -> None:
        """Keep ``param`` gathered until :meth:`release`: its ``partition`` (DeepSpeed's, an
        attribute of each ZeRO-3 param) is deferred meanwhile. Others partition params they did
        not gather: DeepCompile's graph profiler partitions every param of a graph it profiles,
        whoever gathered it, and a compile can come between an eager read and its use, or
        between a frozen Linear's forward and the backward that needs its saved weight."""
        if param.ds_id in self._held:
            return
        partition = param.__dict__.get("partition")
        if partition is None:  # not a ZeRO-3 param as DeepSpeed makes them: nothing to defer
            self._held[param.ds_id] = (param, None)
            return
        owner = weakref.ref(self)

        def partition_unless_held(*args: Any, **kwargs: Any) -> Any:
            me = owner()
            if me is None or me._held.get(param.ds_id, (None,))[0] is not param:
                return partition(*args, **kwargs)
            me.deferred_partitions += 1
            log.debug("deferred a partition of %s (ds_id %d): held for eager code until the "
                      "end of backward", name, param.ds_id)
            # partition(param_list=None, ...): a list naming other params too partitions those.
            in_kwargs = "param_list" in kwargs
            params = kwargs["param_list"] if in_kwargs else (args[0] if args else None)
            others = [q for q in params or () if q is not param]
            if not others:
                return None
            if in_kwargs:
                return partition(*args, **{**kwargs, "param_list": others})
            return partition(others, *args[1:], **kwargs)

        param.partition = partition_unless_held
        self._held[param.ds_id] = (param, partition)

    def held(self) -> List[int]:
        """ds_ids gathered eagerly and not released yet."""
        return sorted(self._held)

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """A window of eager inference outside the engine's forward (``generate()``): params
        read in it are gathered, and released at its end unless a backward is pending (then at
        that backward's end). Nests."""
        was_active = self.active
        self.active = True
        self.generations += 1
        try:
            yield
        finally:
            self.active = was_active
            if not was_active and self.pending_backwards == 0:
                self.release()

    @_never_compiled
    def release(self) -> None:
        """Partition again every param this object gathered (persistent ones stay whole)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        held, self._held = list(self._held.values()), {}
        for p, partition in held:
            if partition is not None:
                p.partition = partition
            if p.ds_status == ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False):
                p.partition()

    def remove(self) -> None:
        """Give the modules plain parameter dicts back and release what is held."""
        from collections import OrderedDict

        from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

        cls = _eager_params_class()
        for module, own in self._modules:
            current = module.__dict__.get("_parameters")
            if isinstance(current, cls) and current._dsz_owner is self:
                # The kind of dict it had, with the params it has now.
                items = list(OrderedDict.items(current))
                if isinstance(own, ZeROOrderedDict):
                    module._parameters = ZeROOrderedDict(module, items)
                else:
                    module._parameters = type(own)(items)
        self._modules.clear()
        self.release()


def eager_gather_of(engine: Any) -> Optional[EagerFallbackGather]:
    """The engine's eager-fallback gather, if ``engine.compile()`` ran with the patch applied."""
    return getattr(engine, _ATTR, None)


def _compiling_with_eager_gather(compile_fn: Callable) -> Callable:
    def compile_with_eager_gather(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = compile_fn(self, *args, **kwargs)
        if (eager_gather_of(self) is None and self.is_deepcompile_active()
                and self.zero_optimization_partition_weights()):
            setattr(self, _ATTR, EagerFallbackGather(self))
            _ENGINES.add(self)
        return result

    return compile_with_eager_gather


def _forward_releasing(forward: Callable) -> Callable:
    def forward_releasing_eager_gathers(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        gather = eager_gather_of(self)
        if gather is None:
            return forward(self, *args, **kwargs)
        if gather.pending_backwards == 0:
            gather.release()  # leftovers of a no-grad forward
        gather.active = True
        try:
            out = forward(self, *args, **kwargs)
        finally:
            gather.active = False
        if torch.is_grad_enabled():
            # Its autograd graph may have saved eagerly gathered weights: they stay gathered
            # until the engine's backward of this forward.
            gather.pending_backwards += 1
        elif gather.pending_backwards == 0:
            gather.release()
        return out

    return forward_releasing_eager_gathers


def _backward_releasing(backward: Callable) -> Callable:
    def backward_releasing_eager_gathers(self: Any, *args: Any, **kwargs: Any) -> Any:
        gather = eager_gather_of(self)
        if gather is None:
            return backward(self, *args, **kwargs)
        retain_graph = bool(kwargs.get("retain_graph", args[1] if len(args) > 1 else False))
        gather.active = True  # a checkpoint recompute of eager code reads params again
        try:
            return backward(self, *args, **kwargs)
        finally:
            gather.active = False
            if not retain_graph:  # the graph may be run again: keep what it saved
                gather.pending_backwards = max(0, gather.pending_backwards - 1)
                if gather.pending_backwards == 0:
                    gather.release()

    return backward_releasing_eager_gathers


def patch_eager_gather() -> Undo:
    """engine.compile() adds the eager-fallback gather; engine.forward/backward release it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    unwrap = undo_all([wrap_method(DeepSpeedEngine, "compile", _compiling_with_eager_gather),
                       wrap_method(DeepSpeedEngine, "forward", _forward_releasing),
                       wrap_method(DeepSpeedEngine, "backward", _backward_releasing)])

    def undo() -> None:
        unwrap()
        for engine in list(_ENGINES):  # uninstall(): the engines' modules get their dicts back
            gather = eager_gather_of(engine)
            if gather is not None:
                gather.remove()
                delattr(engine, _ATTR)
        _ENGINES.clear()

    return undo


def _gather_owner(module: Any) -> Optional[EagerFallbackGather]:
    """The eager-fallback gather of the engine whose modules ``module`` holds, if any."""
    cls = _EAGER_PARAMS_CLS
    if cls is None or not _ENGINES or not hasattr(module, "modules"):
        return None
    for sub in module.modules():
        params = sub.__dict__.get("_parameters")
        if isinstance(params, cls):
            return params._dsz_owner
    return None


def _generating_with_gathers(generate: Callable) -> Callable:
    def generate_with_eager_gathers(self: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _gather_owner(self)
        if owner is None or owner.active:
            return generate(self, *args, **kwargs)
        with owner.inference():
            return generate(self, *args, **kwargs)

    return generate_with_eager_gathers


def patch_eager_generate() -> Undo:
    """transformers' generate() on a model of a DeepCompile ZeRO-3 engine gathers the params its
    eager forwards read, and partitions them again when it returns."""

    def apply() -> Undo:
        from transformers.generation import utils

        return wrap_method(utils.GenerationMixin, "generate", _generating_with_gathers)

    return when_module_imported("transformers.generation.utils", apply)


EAGER_GATHER = Patch(
    name="deepcompile-z3-eager-gather",
    summary="after engine.compile(), modules that run outside DeepCompile's graphs (graph-break "
            "fallbacks) gather their frozen params, and trainable ones fail clearly",
    apply=patch_eager_gather,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "deepspeed.runtime.engine:DeepSpeedEngine.compile",
        "deepspeed.runtime.engine:DeepSpeedEngine.forward",
        "deepspeed.runtime.engine:DeepSpeedEngine.backward",
        "deepspeed.runtime.zero.parameter_offload:ZeROOrderedDict.__init__",
        "deepspeed.runtime.zero.parameter_offload:ZeROOrderedDict.__getitem__",
    ),
)

EAGER_GENERATE = Patch(
    name="deepcompile-z3-eager-generate",
    summary="after engine.compile(), transformers' generate() on the engine's model gathers the "
            "params its eager forwards read and partitions them again when it returns (it "
            "failed with 'weight' must be 2-D)",
    apply=patch_eager_generate,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "transformers.generation.utils:GenerationMixin.generate",
        "deepspeed.runtime.engine:DeepSpeedEngine.compile",  # the gather it finds (EAGER_GATHER)
    ),
)

PATCHES: List[Patch] = [EAGER_GATHER, EAGER_GENERATE]
