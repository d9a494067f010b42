"""transformers' grouped-matmul fallback under torch.compile: a backward AOTAutograd can trace.

transformers runs the experts of its mixture-of-experts models (Qwen3-MoE, Mixtral, ...) through
``transformers.integrations.moe._grouped_mm``. Under torch.compile with expert weights that are
not bf16 (fp32, fp16) it falls back to its custom op ``transformers::grouped_mm_fallback``: one
``torch.mm`` per expert, over the rows between consecutive entries of ``offs`` (cumulative end
offsets). The op is opaque to the compiler, but transformers 5.17 registers its backward
(``torch.library.register_autograd``) as a Python loop over ``offs.tolist()``, which AOTAutograd
traces with fake tensors and cannot (a data-dependent ``aten._local_scalar_dense``): the backend
fails with ``BackendCompilerFailed``, and under DeepCompile the first training step then fails
with DeepSpeed's ``GraphOrder.get_graph_order`` assertion (Qwen3-MoE and Mixtral with LoRA).
transformers 5.25 registers that loop as an op of its own
(``transformers::grouped_mm_fallback_backward``), which AOTAutograd does not trace into.

* :data:`HF_GROUPED_MM_FALLBACK_BACKWARD` (every DeepSpeed release): once
  ``transformers.integrations.moe`` is imported, where ``transformers::grouped_mm_fallback`` is
  defined with ``torch.library.custom_op`` and transformers defines no
  ``transformers::grouped_mm_fallback_backward`` (feature detection, not a version check: a
  transformers that has its own backward op is left as it is), the op's autograd formula is
  registered again with a backward that calls :func:`grouped_mm_fallback_backward`
  (``ds_z3native::grouped_mm_fallback_backward``, opaque like transformers 5.25's). It computes
  only the gradients autograd asks for: a frozen expert weight (LoRA on the rest of the model)
  gets no ``grad_weight``, half the backward's matmuls, and the forward's input is then not saved
  for the backward (nor the weight when the input needs no gradient). What was done, or why
  nothing was, is logged. The undo registers transformers' own backward and setup_context again.

  Targets: transformers' ``_grouped_mm_fallback_backward`` and
  ``_grouped_mm_fallback_setup_context`` (replaced as the op's autograd formula) and
  ``_grouped_mm_fallback`` (the forward whose math the backward follows), recorded for the
  transformers versions tested; on another version they are reported *unverified*, not refused.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple, cast

import torch
from packaging.version import Version

from . import Patch, Undo
from ._rebind import when_module_imported

__all__ = ["HF_GROUPED_MM_FALLBACK_BACKWARD", "PATCHES", "BACKWARD_OP", "FALLBACK_OP",
           "grouped_mm_fallback_backward", "patch_grouped_mm_fallback_backward",
           "fallback_backward_state"]

log = logging.getLogger(__name__)

MOE_MODULE = "transformers.integrations.moe"
FALLBACK_OP = "transformers::grouped_mm_fallback"
# transformers' own opaque backward (5.25): where it exists, the patch does nothing.
THEIR_BACKWARD_OP = "transformers::grouped_mm_fallback_backward"
BACKWARD_OP = "ds_z3native::grouped_mm_fallback_backward"


# ---- the op -----------------------------------------------------------------------------------

def _check_args(input: Optional[torch.Tensor], weight: Optional[torch.Tensor], offs: torch.Tensor,
                grad_output: torch.Tensor, input_grad: bool, weight_grad: bool) -> None:
    """Validates the op's arguments (real and fake kernels alike); each message names the op and
    the bad value."""
    def check(cond: Any, message: Any) -> None:
        torch._check(cond, lambda: f"{BACKWARD_OP}: {message()}")

    check(not input_grad or weight is not None,
          lambda: "input_grad=True needs weight (grad_input = grad_output @ weight[e].T), got None")
    check(not weight_grad or input is not None,
          lambda: "weight_grad=True needs input (grad_weight[e] = input.T @ grad_output), got None")
    check(grad_output.dim() == 2,
          lambda: f"grad_output must be 2-D (rows, output_dim), got shape "
                  f"{tuple(grad_output.shape)}")
    check(offs.dim() == 1,
          lambda: f"offs must be 1-D (num_experts,), got shape {tuple(offs.shape)}")
    check(not (offs.is_floating_point() or offs.is_complex() or offs.dtype == torch.bool),
          lambda: f"offs must be an integer tensor (cumulative end offsets), got {offs.dtype}")
    if input is not None:
        check(input.dim() == 2,
              lambda: f"input must be 2-D (rows, input_dim), got shape {tuple(input.shape)}")
        check(input.size(0) == grad_output.size(0),
              lambda: f"grad_output has {grad_output.size(0)} rows, input has {input.size(0)}")
    if weight is not None:
        check(weight.dim() == 3,
              lambda: f"weight must be 3-D (num_experts, input_dim, output_dim), got shape "
                      f"{tuple(weight.shape)}")
        check(offs.size(0) == weight.size(0),
              lambda: f"offs has {offs.size(0)} entries, weight has {weight.size(0)} experts")
        check(weight.size(2) == grad_output.size(1),
              lambda: f"grad_output has {grad_output.size(1)} columns, weight's output_dim is "
                      f"{weight.size(2)}")
        if input is not None:
            check(input.size(1) == weight.size(1),
                  lambda: f"input_dim mismatch: input has {input.size(1)}, weight has "
                          f"{weight.size(1)}")
    for name, t in (("input", input), ("weight", weight)):
        if t is not None:
            check(t.dtype == grad_output.dtype,
                  lambda: f"{name} is {t.dtype}, grad_output is {grad_output.dtype}")
            check(t.device == grad_output.device,
                  lambda: f"{name} is on {t.device}, grad_output on {grad_output.device}")


def _grad_shapes(input: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                 offs: torch.Tensor, grad_output: torch.Tensor, input_grad: bool,
                 weight_grad: bool) -> Tuple[List[Any], List[Any]]:
    rows, output_dim = grad_output.size(0), grad_output.size(1)
    grad_input = [rows, weight.size(1)] if input_grad and weight is not None else [0]
    grad_weight = ([offs.size(0), input.size(1), output_dim] if weight_grad and input is not None
                   else [0])
    return grad_input, grad_weight


@torch.library.custom_op(BACKWARD_OP, mutates_args=(), schema=(
    "(Tensor? input, Tensor? weight, Tensor offs, Tensor grad_output, bool input_grad, "
    "bool weight_grad) -> (Tensor, Tensor)"))
def grouped_mm_fallback_backward(input: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                                 offs: torch.Tensor, grad_output: torch.Tensor, input_grad: bool,
                                 weight_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight) of ``transformers::grouped_mm_fallback(input, weight, offs)``:
    rows ``offs[e-1]:offs[e]`` of ``input`` (rows, input_dim) times ``weight[e]`` (num_experts,
    input_dim, output_dim); rows past ``offs[-1]`` have a zero gradient, an expert with no rows a
    zero ``grad_weight[e]``. Only the gradients asked for are computed (``input_grad`` needs
    ``weight``, ``weight_grad`` needs ``input``; the other may be None); one not asked for is
    returned as an empty tensor (shape ``[0]``) of ``grad_output``'s dtype and device."""
    _check_args(input, weight, offs, grad_output, input_grad, weight_grad)
    in_shape, w_shape = _grad_shapes(input, weight, offs, grad_output, input_grad, weight_grad)
    grad_input = grad_output.new_zeros(in_shape) if input_grad else grad_output.new_empty(0)
    grad_weight = grad_output.new_zeros(w_shape) if weight_grad else grad_output.new_empty(0)
    # _check_args: each is given where its gradient is asked for.
    x, w = cast(torch.Tensor, input), cast(torch.Tensor, weight)
    ends = offs.tolist()  # one device-to-host copy, not one per expert
    start = 0
    for expert, end in enumerate(ends):
        torch._check(start <= end <= grad_output.size(0), lambda: (
            f"{BACKWARD_OP}: offs must be non-decreasing cumulative end offsets of at most "
            f"{grad_output.size(0)} (grad_output's rows), got {ends}"))
        if end > start:
            grad = grad_output[start:end]
            if input_grad:
                torch.mm(grad, w[expert].t(), out=grad_input[start:end])
            if weight_grad:
                torch.mm(x[start:end].t(), grad, out=grad_weight[expert])
        start = end
    return grad_input, grad_weight


@grouped_mm_fallback_backward.register_fake
def _grouped_mm_fallback_backward_fake(input: Optional[torch.Tensor],
                                       weight: Optional[torch.Tensor], offs: torch.Tensor,
                                       grad_output: torch.Tensor, input_grad: bool,
                                       weight_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_args(input, weight, offs, grad_output, input_grad, weight_grad)
    in_shape, w_shape = _grad_shapes(input, weight, offs, grad_output, input_grad, weight_grad)
    return grad_output.new_empty(in_shape), grad_output.new_empty(w_shape)


# ---- the autograd formula of transformers' op -------------------------------------------------

def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    """Saves what the gradients asked for need: the weight for grad_input, the input for
    grad_weight (a frozen expert weight: the input is not kept for the backward)."""
    input, weight, offs = inputs[:3]
    ctx.save_for_backward(input if ctx.needs_input_grad[1] else None,
                          weight if ctx.needs_input_grad[0] else None, offs)


def _backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    input_grad, weight_grad = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
    if not (input_grad or weight_grad):
        return None, None, None
    input, weight, offs = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.ds_z3native.grouped_mm_fallback_backward(
        input, weight, offs, grad_output, input_grad, weight_grad)
    return (grad_input if input_grad else None, grad_weight if weight_grad else None, None)


def _opdef(qualname: str) -> Any:
    """The ``torch.library.custom_op`` definition of ``qualname``, or None."""
    from torch._library import custom_ops

    return custom_ops._maybe_get_opdef(qualname)


def _op_exists(qualname: str) -> bool:
    namespace, name = qualname.split("::")
    return hasattr(getattr(torch.ops, namespace), name)


def fallback_backward_state() -> str:
    """Whose backward ``transformers::grouped_mm_fallback`` runs: ``"ds_z3native"`` (this
    patch's), ``"transformers"`` (transformers' own), ``"transformers-op"`` (transformers has its
    own backward op: the patch does not apply), or ``"absent"`` (no such op, or not a
    ``torch.library.custom_op``)."""
    if not _op_exists(FALLBACK_OP) or _opdef(FALLBACK_OP) is None:
        return "absent"
    if _op_exists(THEIR_BACKWARD_OP):
        return "transformers-op"
    return "ds_z3native" if _opdef(FALLBACK_OP)._backward_fn is _backward else "transformers"


def _register_our_backward() -> Undo:
    state = fallback_backward_state()
    if state == "absent":
        log.debug("%s is not defined (or not by torch.library.custom_op): transformers' "
                  "grouped-matmul fallback left as it is", FALLBACK_OP)
        return lambda: None
    if state == "transformers-op":
        log.info("transformers defines %s: its grouped-matmul fallback's backward is already an "
                 "op AOTAutograd does not trace into; left as it is", THEIR_BACKWARD_OP)
        return lambda: None
    opdef = _opdef(FALLBACK_OP)
    original = (opdef._backward_fn, opdef._setup_context_fn)
    torch.library.register_autograd(FALLBACK_OP, _backward, setup_context=_setup_context)
    log.info("%s: backward registered as %s (transformers' Python loop over offs.tolist() cannot "
             "be traced by AOTAutograd); it computes only the gradients autograd needs",
             FALLBACK_OP, BACKWARD_OP)

    def undo() -> None:
        if opdef._backward_fn is not _backward or opdef._setup_context_fn is not _setup_context:
            log.warning("%s's autograd formula was registered again after ds_z3native's; leaving "
                        "the newer one in place", FALLBACK_OP)
            return
        torch.library.register_autograd(FALLBACK_OP, original[0], setup_context=original[1])

    return undo


def patch_grouped_mm_fallback_backward() -> Undo:
    """Once transformers' MoE integration is imported, its grouped-matmul fallback op gets
    ds_z3native's backward (where transformers has no backward op of its own)."""
    return when_module_imported(MOE_MODULE, _register_our_backward)


HF_GROUPED_MM_FALLBACK_BACKWARD = Patch(
    name="hf-grouped-mm-fallback-backward",
    summary="transformers' grouped-matmul fallback op (mixture-of-experts experts under "
            "torch.compile, weights not bf16) gets an opaque backward op that computes only the "
            "gradients needed, where transformers' backward is a Python loop AOTAutograd cannot "
            "trace (transformers 5.17: BackendCompilerFailed at the first DeepCompile step)",
    apply=patch_grouped_mm_fallback_backward,
    first=Version("0.19.0"),
    last=None,
    wraps=(
        "transformers.integrations.moe:_grouped_mm_fallback_backward",
        "transformers.integrations.moe:_grouped_mm_fallback_setup_context",
        # Read, not replaced: the forward whose math the backward follows.
        "transformers.integrations.moe:_grouped_mm_fallback",
    ),
)

PATCHES: List[Patch] = [HF_GROUPED_MM_FALLBACK_BACKWARD]
