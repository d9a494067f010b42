"""Inductor's checks on the outputs of attention kernels that may leave an output undefined.

Inductor calls an op it has no lowering for as a fallback kernel and, after the call, asserts the
size, stride and 16-byte alignment of each output it keeps (``assert_alignment(buf, 16, ...)``).
SDPA's fused kernels return auxiliary outputs beside the attention output (the log-sum-exp, the
cumulative sequence lengths, the philox seed and offset, the debug mask), and leave some of them
undefined when they are not needed: cuDNN's attention without ``compute_log_sumexp`` (a forward
under ``no_grad``: evaluation) returns no log-sum-exp. The assert then gets ``None``:

    TypeError: expected Tensor() for op: torch.ops.aten._scaled_dot_product_cudnn_attention.default

Seen with DeepCompile on an H100 (torch 2.11, bf16: SDPA picks cuDNN there; fp32 never does) at
the first evaluation of a Trainer run; torch's tracker has the same crash for
``_native_multi_head_attention(need_weights=False)``.

:data:`INDUCTOR_ATTENTION_AUX_OUTPUTS` writes no size or alignment assert for the auxiliary
outputs (index 1 and up) of those kernels. The attention output itself keeps its asserts; an
auxiliary output that exists is a fresh allocation of the kernel, aligned as any.
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, List

from packaging.version import Version

from . import Patch, Undo

__all__ = ["ATTENTION_KERNELS", "INDUCTOR_ATTENTION_AUX_OUTPUTS", "PATCHES", "may_be_undefined"]

# Fallback kernels whose outputs after the first may be undefined (aten's names).
ATTENTION_KERNELS: FrozenSet[str] = frozenset({
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten._native_multi_head_attention.default",
})


def may_be_undefined(node: Any) -> bool:
    """Whether ``node`` (an inductor IR node) is an auxiliary output of an attention kernel."""
    from torch._inductor import ir

    if not isinstance(node, ir.MultiOutput) or not node.indices:
        return False
    kernel = node.inputs[0] if node.inputs else None
    op = getattr(kernel, "op_overload", None)
    if op is None or str(op) not in ATTENTION_KERNELS:
        return False
    first = node.indices[0]
    return len(first) == 2 and isinstance(first[1], int) and first[1] >= 1


def _skipping_aux_outputs(check: Callable) -> Callable:
    def codegen_check(self: Any, wrapper: Any) -> None:
        if may_be_undefined(self):
            # A comment in the wrapper's own language (inductor's C++ wrapper comments with //).
            comment = getattr(wrapper, "comment", "#")
            wrapper.writeline(f"{comment} {self.get_name()}: an attention kernel's auxiliary "
                              "output, which the kernel may leave undefined (not checked)")
            return
        check(self, wrapper)

    return codegen_check


def patch_attention_aux_outputs() -> Undo:
    from torch._inductor import ir

    from ._rebind import undo_all, wrap_method

    undos = [wrap_method(ir.ExternKernel, "codegen_alignment_asserts", _skipping_aux_outputs),
             wrap_method(ir.ExternKernel, "codegen_size_asserts", _skipping_aux_outputs)]
    return undo_all(undos)


INDUCTOR_ATTENTION_AUX_OUTPUTS = Patch(
    name="inductor-attention-aux-outputs",
    summary="inductor writes no size or alignment assert for the auxiliary outputs of SDPA's "
            "fused kernels, which they may leave undefined (cuDNN's log-sum-exp under no_grad): "
            "evaluation under DeepCompile in bf16 crashed on 'expected Tensor()'",
    apply=patch_attention_aux_outputs,
    wraps=("torch._inductor.ir:ExternKernel.codegen_alignment_asserts",
           "torch._inductor.ir:ExternKernel.codegen_size_asserts"),
    first=Version("0.19.0"),
    last=None,
)

PATCHES: List[Patch] = [INDUCTOR_ATTENTION_AUX_OUTPUTS]
