"""``inductor-attention-aux-outputs``: inductor writes no size or alignment assert for the auxiliary
outputs of SDPA's fused kernels, which may be undefined (cuDNN's log-sum-exp under ``no_grad`` on
a GPU crashed DeepCompile's first evaluation with ``expected Tensor()``); the attention output
keeps its asserts. Shown on the CPU's fused kernel, whose code inductor generates the same way
(the GPU crash itself: tests/gpu/test_deepcompile_eval_gpu.py)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest
import torch


def _generated(fn, *args) -> str:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), *args)
    return "\n".join(codes)


def attention_and_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out * 2, lse + 1


def _checked_buffers(code: str) -> set:
    # assert_size_stride, or assert_tensor_metadata from torch 2.14 on; assert_alignment.
    return set(re.findall(r"assert_(?:size_stride|tensor_metadata|alignment)\((buf\d+),", code))


@pytest.fixture
def qkv() -> Iterator[tuple]:
    g = torch.Generator().manual_seed(0)
    yield tuple(torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))


def test_aux_outputs_of_attention_kernels_are_not_asserted(qkv: tuple) -> None:
    from ds_z3native.compat.inductor_attention_outputs import INDUCTOR_ATTENTION_AUX_OUTPUTS

    plain = _generated(attention_and_lse, *qkv)
    checked_plain = _checked_buffers(plain)
    assert len(checked_plain) == 2, plain  # the output and the log-sum-exp, without the patch
    undo = INDUCTOR_ATTENTION_AUX_OUTPUTS.apply()
    try:
        patched = _generated(attention_and_lse, *qkv)
    finally:
        undo()
    checked = _checked_buffers(patched)
    assert len(checked) == 1 and checked < checked_plain, patched
    assert "auxiliary output" in patched
    # What the patch leaves unchecked is the second output only; the results are eager's.
    out, lse = torch.compile(attention_and_lse)(*qkv)
    want_out, want_lse = attention_and_lse(*qkv)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    # The undo restored inductor's own checks.
    assert _checked_buffers(_generated(attention_and_lse, *qkv)) == checked_plain
