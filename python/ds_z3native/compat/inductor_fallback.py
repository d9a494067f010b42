"""Inductor lowerings of ds_z3native's own ops that DeepCompile graphs call (``ds_z3native::``).

Inductor calls such an op as a fallback kernel. What it must not do is plan another buffer into
memory the op's outputs or inputs still own: a ``gather_persistent`` output is the runtime's
long-lived gathered copy, not the graph's own buffer, and a ``reduce_grads`` input is read by the
native copy stream after the call returns (``record_stream`` holds the caching allocator off,
not inductor's in-place reuse). DeepSpeed registers its own ``dc`` ops the same way.
"""

from __future__ import annotations

from typing import Any, Set

__all__ = ["register_fallback_lowering"]

_registered: Set[str] = set()


def register_fallback_lowering(op: Any, never_reuse_inputs: bool) -> None:
    """Register ``op`` (an OpOverload) with inductor as a fallback kernel whose outputs, and with
    ``never_reuse_inputs`` its tensor inputs, no other buffer is planned into. Once per op."""
    name = str(op)
    if name in _registered:
        return
    from torch._inductor import ir
    from torch._inductor.lowering import add_needs_realized_inputs, register_lowering
    from torch._inductor.virtualized import V
    from torch.utils import _pytree as pytree

    def never_reuse(x: Any) -> None:
        if isinstance(x, ir.IRNode):
            try:
                V.graph.never_reuse_buffers.add(x.get_name())
            except (AttributeError, NotImplementedError):  # not a named buffer: nothing to plan
                pass

    class KeepingInputs(ir.FallbackKernel):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for leaf in pytree.tree_leaves((args, kwargs)):
                never_reuse(leaf)

    kernel = KeepingInputs if never_reuse_inputs else ir.FallbackKernel

    def keep(out: Any) -> Any:
        if isinstance(out, ir.IRNode):
            never_reuse(out)
            return ir.TensorBox.create(out)
        return out

    def lower(*args: Any, **kwargs: Any) -> Any:
        return pytree.tree_map(keep, kernel.create(op, *args, **kwargs))

    add_needs_realized_inputs(op)
    register_lowering(op, type_promotion_kind=None)(lower)
    _registered.add(name)
