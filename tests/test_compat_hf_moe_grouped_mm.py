"""``hf-grouped-mm-fallback-backward`` (``ds_z3native.compat.hf_moe_grouped_mm``): transformers'
grouped-matmul fallback op, which runs mixture-of-experts experts under torch.compile with
weights that are not bf16, gets a backward AOTAutograd can trace where transformers' own is a
Python loop it cannot (transformers 5.17).

* the op ``ds_z3native::grouped_mm_fallback_backward`` against a reference computed by autograd
  through one ``torch.mm`` per expert: every gradient combination, empty experts, rows past the
  last offset, a transposed weight, int32 and int64 offsets (opcheck: tests/test_native_opcheck.py);
* its refusals, each naming the op and the bad value;
* with the installed transformers (5.25, which has its own backward op): nothing changes, through
  the patch alone and through ``install()``;
* with transformers 5.17 first on the path (``tests/helpers/old_transformers.py``), in a fresh
  interpreter: without the patch ``torch.compile(fullgraph=True)`` of the op and its backward
  fails (``BackendCompilerFailed``); with it (applied before transformers' module is imported,
  so at that import) the gradients under ``aot_eager`` and ``inductor`` equal the reference, a
  frozen weight gets no gradient and the op computes none (and its input is not saved), and the
  undo gives transformers' backward back (the compile fails again).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from ds_z3native.compat import hf_moe_grouped_mm as gmm
from helpers.dist import run_python
from helpers.old_transformers import OLD_TRANSFORMERS_VERSION, old_transformers_env

OP = torch.ops.ds_z3native.grouped_mm_fallback_backward.default


def _case(rows: int = 7, experts: int = 3, in_dim: int = 4, out_dim: int = 5,
          ends: Tuple[int, ...] = (2, 2, 6), transposed: bool = False,
          offs_dtype: torch.dtype = torch.int32) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(experts, in_dim, out_dim, generator=g)
    if transposed:  # how transformers passes a (experts, out, in) weight
        weight = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    return {"input": torch.randn(rows, in_dim, generator=g), "weight": weight,
            "offs": torch.tensor(ends, dtype=offs_dtype),
            "grad_output": torch.randn(rows, out_dim, generator=g)}


def _reference(c: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight) by autograd through one mm per expert (rows past the last offset
    are zero, as in transformers' forward)."""
    x = c["input"].clone().requires_grad_(True)
    w = c["weight"].clone().requires_grad_(True)
    out = torch.zeros(x.size(0), w.size(2))
    start = 0
    for e, end in enumerate(c["offs"].tolist()):
        out = out.index_put((torch.arange(start, end),), x[start:end] @ w[e])
        start = end
    out.backward(c["grad_output"])
    return x.grad, w.grad


@pytest.mark.parametrize("input_grad,weight_grad", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("case", ["empty_expert", "rows_past_the_end", "leading_empty",
                                  "transposed_weight_int64"])
def test_the_op_computes_the_gradients_asked_for(case: str, input_grad: bool,
                                                 weight_grad: bool) -> None:
    c = {"empty_expert": lambda: _case(ends=(2, 2, 7)),
         "rows_past_the_end": lambda: _case(ends=(2, 2, 6)),
         "leading_empty": lambda: _case(ends=(0, 0, 7)),
         "transposed_weight_int64": lambda: _case(transposed=True, offs_dtype=torch.int64)}[case]()
    ref_input, ref_weight = _reference(c)
    # What the autograd formula passes: the weight only for grad_input, the input only for
    # grad_weight.
    grad_input, grad_weight = OP(c["input"] if weight_grad else None,
                                 c["weight"] if input_grad else None, c["offs"],
                                 c["grad_output"], input_grad, weight_grad)
    if input_grad:
        torch.testing.assert_close(grad_input, ref_input)
    else:
        assert grad_input.shape == (0,) and grad_input.dtype == torch.float32
    if weight_grad:
        torch.testing.assert_close(grad_weight, ref_weight)
        if case == "empty_expert":
            assert not grad_weight[1].any()
    else:
        assert grad_weight.shape == (0,) and grad_weight.dtype == torch.float32
    if case == "rows_past_the_end" and input_grad:
        assert not grad_input[6].any()


def _args(**change: Any) -> Tuple[Any, ...]:
    c = _case()
    args: Dict[str, Any] = {**c, "input_grad": True, "weight_grad": True}
    args.update(change)
    return tuple(args[k] for k in ("input", "weight", "offs", "grad_output", "input_grad",
                                   "weight_grad"))


@pytest.mark.parametrize("change,message", [
    ({"input": torch.randn(7, 4, 1)}, r"input must be 2-D .* got shape \(7, 4, 1\)"),
    ({"weight": torch.randn(3, 4)}, r"weight must be 3-D .* got shape \(3, 4\)"),
    ({"offs": torch.tensor([[2, 2, 6]])}, r"offs must be 1-D .* got shape \(1, 3\)"),
    ({"offs": torch.tensor([2.0, 2.0, 6.0])}, r"offs must be an integer tensor .* torch.float32"),
    ({"offs": torch.tensor([2, 6])}, r"offs has 2 entries, weight has 3 experts"),
    ({"grad_output": torch.randn(6, 5)}, r"grad_output has 6 rows, input has 7"),
    ({"grad_output": torch.randn(7, 3)}, r"grad_output has 3 columns, weight's output_dim is 5"),
    ({"input": torch.randn(7, 2)}, r"input_dim mismatch: input has 2, weight has 4"),
    ({"input": torch.randn(7, 4, dtype=torch.float64)}, r"input is torch.float64, grad_output is "
                                                        r"torch.float32"),
    ({"weight": None}, r"input_grad=True needs weight .* got None"),
    ({"input": None}, r"weight_grad=True needs input .* got None"),
    ({"offs": torch.tensor([2, 1, 6])}, r"offs must be non-decreasing .* got \[2, 1, 6\]"),
    ({"offs": torch.tensor([2, 2, 8])},
     r"offs must be .* at most 7 \(grad_output's rows\), got \[2, 2, 8\]"),
])
def test_the_op_refuses_bad_arguments_by_name(change: Dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeError, match=r"ds_z3native::grouped_mm_fallback_backward: "
                       + message):
        OP(*_args(**change))


def test_the_fake_kernel_refuses_as_the_real_one() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _args(grad_output=torch.randn(6, 5))
        with pytest.raises(RuntimeError, match=r"grouped_mm_fallback_backward: grad_output has 6 "
                                               r"rows, input has 7"):
            OP(*args)
        grad_input, grad_weight = OP(*_args(input=None, weight_grad=False))
        assert grad_input.shape == (7, 4) and grad_weight.shape == (0,)


# ---- the installed transformers (5.25: a backward op of its own) -----------------------------

def _installed_has_their_op() -> bool:
    pytest.importorskip("transformers.integrations.moe")
    return gmm._op_exists(gmm.THEIR_BACKWARD_OP)


def test_a_transformers_with_its_own_backward_op_is_left_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    if not _installed_has_their_op():
        pytest.skip("the installed transformers has no backward op of its own")
    opdef = gmm._opdef(gmm.FALLBACK_OP)
    before = (opdef._backward_fn, opdef._setup_context_fn)
    with caplog.at_level(logging.INFO, logger="ds_z3native"):
        undo = gmm.patch_grouped_mm_fallback_backward()
    try:
        assert gmm.fallback_backward_state() == "transformers-op"
        assert (opdef._backward_fn, opdef._setup_context_fn) == before
        assert any("transformers defines transformers::grouped_mm_fallback_backward" in
                   r.getMessage() and "left as it is" in r.getMessage() for r in caplog.records)
    finally:
        undo()
    assert (opdef._backward_fn, opdef._setup_context_fn) == before


@pytest.mark.deepspeed
def test_install_leaves_the_installed_transformers_op_alone_and_verifies_its_targets() -> None:
    if not _installed_has_their_op():
        pytest.skip("the installed transformers has no backward op of its own")
    import ds_z3native
    from ds_z3native import installer

    opdef = gmm._opdef(gmm.FALLBACK_OP)
    before = opdef._backward_fn
    installer.uninstall()
    try:
        report = ds_z3native.install()
        assert "hf-grouped-mm-fallback-backward" in report.patches
        assert not [u for u in report.unverified if "hf-grouped-mm" in u], report.unverified
        assert gmm.fallback_backward_state() == "transformers-op"
        assert opdef._backward_fn is before
    finally:
        installer.uninstall()


# ---- transformers 5.17 (its backward a Python loop) ------------------------------------------

_ON_5_17 = """
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from ds_z3native.compat import hf_moe_grouped_mm as gmm

out = {}
# Applied before transformers' module is imported: it acts at that import.
undo = gmm.patch_grouped_mm_fallback_backward()
out["state_before_import"] = gmm.fallback_backward_state()
import transformers
import transformers.integrations.moe as moe
out["version"] = transformers.__version__
out["state_after_import"] = gmm.fallback_backward_state()
undo()
out["state_unpatched"] = gmm.fallback_backward_state()

g = torch.Generator().manual_seed(0)
X, W = torch.randn(7, 4, generator=g), torch.randn(3, 4, 5, generator=g)
OFFS = torch.tensor([2, 2, 6], dtype=torch.int32)  # expert 1 empty, row 6 past the last offset

def loss(x, w, offs):
    return (torch.ops.transformers.grouped_mm_fallback(x, w, offs) ** 2).sum()

def reference(weight_grad):
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(weight_grad)
    y = torch.zeros(7, 5)
    start = 0
    for e, end in enumerate(OFFS.tolist()):
        y = y.index_put((torch.arange(start, end),), x[start:end] @ w[e])
        start = end
    (y ** 2).sum().backward()
    return x.grad, w.grad

class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.ds_z3native.grouped_mm_fallback_backward.default:
            self.calls.append({"input_saved": args[0] is not None,
                               "weight_saved": args[1] is not None,
                               "flags": [args[4], args[5]],
                               "shapes": [list(t.shape) for t in result]})
        return result

def train(backend, weight_grad):
    torch._dynamo.reset()
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(weight_grad)
    fn = loss if backend == "eager" else torch.compile(loss, backend=backend, fullgraph=True)
    try:
        value = fn(x, w, OFFS)
        with Calls() as calls:
            value.backward()
    except Exception as e:
        return {"error_type": type(e).__name__, "error": str(e)[:2000]}
    ref_x, ref_w = reference(weight_grad)
    ok_w = (w.grad is None) if not weight_grad else torch.allclose(w.grad, ref_w, atol=1e-5)
    return {"input_ok": torch.allclose(x.grad, ref_x, atol=1e-5), "weight_ok": ok_w,
            "weight_grad_none": w.grad is None, "calls": calls.calls}

out["unpatched"] = train("aot_eager", True)
undo = gmm.patch_grouped_mm_fallback_backward()
out["state_patched"] = gmm.fallback_backward_state()
for backend in ("eager", "aot_eager", "inductor"):
    for weight_grad in (True, False):
        out[f"{backend}-{'both' if weight_grad else 'frozen'}"] = train(backend, weight_grad)
undo()
opdef = gmm._opdef(gmm.FALLBACK_OP)
out["restored"] = (opdef._backward_fn is moe._grouped_mm_fallback_backward
                   and opdef._setup_context_fn is moe._grouped_mm_fallback_setup_context)
out["undone"] = train("aot_eager", True)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def on_5_17(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    # A fresh inductor cache: AOTAutograd's cache key does not cover a custom op's autograd
    # formula, so a graph compiled with the patch in an earlier process would be served to a run
    # without it.
    cache = tmp_path_factory.mktemp("inductor-cache")
    r = run_python(_ON_5_17, timeout=600,
                   env=old_transformers_env({"TORCHINDUCTOR_CACHE_DIR": str(cache)}))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["version"] == OLD_TRANSFORMERS_VERSION, out["version"]
    return out


@pytest.mark.slow
def test_without_the_patch_compiling_its_backward_fails_on_5_17(on_5_17: Dict[str, Any]) -> None:
    assert on_5_17["state_unpatched"] == "transformers"
    for key in ("unpatched", "undone"):  # before the patch, and after its undo
        failed: Optional[Dict[str, Any]] = on_5_17[key]
        assert failed is not None and failed.get("error_type") == "BackendCompilerFailed", failed
        assert "_grouped_mm_fallback_backward" in failed["error"], failed["error"]
    assert on_5_17["restored"] is True


@pytest.mark.slow
def test_the_patch_acts_at_the_import_of_transformers_moe_module(on_5_17: Dict[str, Any]) -> None:
    # Applied before transformers' MoE module is imported (the op is not defined yet), it
    # registers its backward at that import; applied after it, at once.
    assert on_5_17["state_before_import"] == "absent"
    assert on_5_17["state_after_import"] == "ds_z3native"
    assert on_5_17["state_patched"] == "ds_z3native"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_with_the_patch_the_compiled_gradients_are_eagers_on_5_17(
        on_5_17: Dict[str, Any], backend: str) -> None:
    both = on_5_17[f"{backend}-both"]
    assert "error" not in both, both
    assert both["input_ok"] and both["weight_ok"], both
    assert both["calls"] == [{"input_saved": True, "weight_saved": True, "flags": [True, True],
                              "shapes": [[7, 4], [3, 4, 5]]}]
    # A frozen expert weight (LoRA): no grad_weight asked for, none computed, the input not
    # saved for the backward.
    frozen = on_5_17[f"{backend}-frozen"]
    assert "error" not in frozen, frozen
    assert frozen["input_ok"] and frozen["weight_grad_none"], frozen
    assert frozen["calls"] == [{"input_saved": False, "weight_saved": True,
                                "flags": [True, False], "shapes": [[7, 4], [0]]}]
