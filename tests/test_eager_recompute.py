"""Eager ZeRO-3 + activation checkpointing + frozen params, on real DeepSpeed engines over gloo.

Every case trains a small model for 3 steps under ZeRO-3 and the same model in plain PyTorch
(no ZeRO, no checkpointing; fp32, every rank's micro-batches) and asserts: no error, equal losses
(bf16/fp16 cases: within the half type's rounding), every trainable tensor trained like the
reference after the last step (moved from its initial value, and within a share of that move of
the reference's; fp32 also equal element-wise), and after every backward no non-persistent param
gathered, no param listing an active submodule (or a recompute hold), and ZeRO's forward module
stack as long as before the first forward.

Cases run in groups, one spawned process group each (engine creation costs seconds on CPU):

* ``ours`` (1 rank): the recompute holds forced on, whatever the DeepSpeed version
  (``apply_recompute_fix(holds=True)``; on >= 0.19.3 they replace DeepSpeed's own attribution);
* ``install`` (2 ranks): ``ds_z3native.install()``, i.e. the patches the registry picks for the
  running version (holds on <= 0.19.2, hardening beside DeepSpeed's fix on >= 0.19.3);
* ``unpatched`` (1 rank): DeepSpeed alone, pinning the failures the patches fix.

Run on both DeepSpeed versions: ``pytest tests/test_eager_recompute.py`` and
``PYTHONPATH=/opt/ds-0.19.2 pytest tests/test_eager_recompute.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
from packaging.version import Version

from helpers.dist import run_ranks
from helpers.param_bounds import assert_trained_alike
from helpers.zero import assert_unpatched_outcome, gathered_trainable

pytestmark = pytest.mark.deepspeed

deepspeed = pytest.importorskip("deepspeed")
DS_VERSION = Version(deepspeed.__version__.split("+")[0])
UPSTREAM_FIX = DS_VERSION >= Version("0.19.3")  # DeepSpeed's own recompute attribution

# AdamW with a step size that keeps 3 steps tame at every width, and an eps above the rounding
# noise of near-zero gradients (Adam's first step is lr * sign(grad) otherwise).
ADAM = {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0}
RANK_TIMEOUT = 300.0


# ---- models -------------------------------------------------------------------------------

class LoraLinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank pair (randomly initialised, so that both
    factors get gradients from the first step)."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class Tripwire(nn.Module):
    """Raises once, inside the next recompute (a forward that runs inside backward), when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch._C._current_graph_task_id() != -1:
            self.armed = False
            raise RuntimeError("tripwire: injected failure inside the recompute")
        return x


class NormLinearBlock(nn.Module):
    """The minimal reproduction's block: a frozen LayerNorm feeding a trainable Linear."""

    def __init__(self, dim: int, frozen: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(not frozen)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class LoraBlock(nn.Module):
    """Frozen LayerNorm, two LoRA linears, a residual. ``reuse`` calls the norm and the first LoRA
    linear twice; ``gated`` ends in an op of the block itself (sigmoid gate through a frozen
    Linear), so that the block, not a leaf, starts the recompute in backward."""

    def __init__(self, dim: int, reuse: bool = False, gated: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(False)
        self.q = LoraLinear(dim)
        self.trip = Tripwire()
        self.o = LoraLinear(dim)
        self.reuse = reuse
        self.gate = None
        if gated:
            self.gate = nn.Linear(dim, dim)
            self.gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trip(self.q(self.norm(x)))
        if self.reuse:
            h = self.norm(self.q(torch.relu(h)))
        h = self.o(torch.relu(h))
        if self.gate is not None:
            return x + torch.sigmoid(self.gate(x)) * h
        return x + h


class Net(nn.Module):
    """``blocks`` blocks, each run through torch.utils.checkpoint when ``checkpoint`` is
    "nonreentrant" or "reentrant" (None: plain). ``input_grad`` puts a trainable Linear in front,
    so that the first block's input needs grad; without it the first block gets the raw input."""

    def __init__(self, case: "Case") -> None:
        super().__init__()
        dim = case.dim
        self.proj = nn.Linear(dim, dim) if case.input_grad else None
        if case.model == "norm-linear":
            blocks = [NormLinearBlock(dim, frozen=case.frozen) for _ in range(case.blocks)]
        else:
            blocks = [LoraBlock(dim, reuse=case.reuse, gated=case.model == "gated")
                      for _ in range(case.blocks)]
        self.blocks = nn.ModuleList(blocks)
        self.checkpoint: Optional[str] = case.checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj is not None:
            x = self.proj(x)
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpoint == "reentrant")
        return x.pow(2).mean()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str = "lora"  # "norm-linear" | "lora" | "gated"
    frozen: bool = True  # "norm-linear": whether the norm is frozen
    dim: int = 64
    blocks: int = 2
    checkpoint: str = "nonreentrant"  # or "reentrant"
    input_grad: bool = True
    reuse: bool = False
    persistence: Optional[int] = 0  # stage3_param_persistence_threshold; None: DeepSpeed's default
    gas: int = 1
    raise_at_step: Optional[int] = None  # the last block's recompute raises once in this step
    early_stop: bool = True  # torch.utils.checkpoint's early stop
    probe_last_use: bool = False  # record what is gathered while the block's backward runs
    # "engine": engine.backward(loss); "torch": loss.backward(); "scale":
    # engine.scale(loss).backward(). Nothing is released by hand after any of them.
    backward: str = "engine"
    # "bf16" (DeepSpeed's bf16 mode) or "fp16" (its fp16 mode, static loss scale 256: a GPU only)
    precision: str = "fp32"
    steps: int = 3
    rows: int = 4  # per micro-batch and rank

    @property
    def lr(self) -> float:
        return 0.1 / self.dim


NORM_LINEAR = Case("norm-linear", model="norm-linear", dim=1024, input_grad=False)
NORM_LINEAR_DEFAULT_PERSISTENCE = dataclasses.replace(NORM_LINEAR,
                                                      name="norm-linear-default-persistence",
                                                      persistence=None)
LORA = Case("lora")
LORA_NO_INPUT_GRAD = Case("lora-no-input-grad", input_grad=False)
LORA_GAS2 = Case("lora-gas2", gas=2)
LORA_REUSE = Case("lora-reuse", reuse=True)
LORA_RAISE_RETRY = Case("lora-raise-retry", raise_at_step=1)
LORA_REENTRANT = Case("lora-reentrant", checkpoint="reentrant")
LORA_DEFAULT_PERSISTENCE = Case("lora-default-persistence", dim=512, persistence=None)
NO_EARLY_STOP = Case("no-early-stop", early_stop=False)
TORCH_BACKWARD = Case("lora-torch-backward", input_grad=False, backward="torch")
TORCH_BACKWARD_GAS2 = Case("lora-torch-backward-gas2", input_grad=False, backward="torch", gas=2)
SCALE_BACKWARD = Case("lora-scale-backward", input_grad=False, backward="scale")
SCALE_BACKWARD_BF16 = Case("lora-scale-backward-bf16", input_grad=False, backward="scale",
                           precision="bf16")
SCALE_BACKWARD_FP16 = Case("lora-scale-backward-fp16", input_grad=False, backward="scale",
                           precision="fp16")
NO_EARLY_STOP_TRAINABLE = Case("no-early-stop-trainable", model="norm-linear", frozen=False,
                               early_stop=False)
GATED_LAST_USE = Case("gated-last-use", model="gated", probe_last_use=True)


# ---- one rank's work ------------------------------------------------------------------------

def _ds_config(case: Case) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": 3}
    if case.persistence is not None:
        zero["stage3_param_persistence_threshold"] = case.persistence
    return {
        "train_micro_batch_size_per_gpu": case.rows,
        "gradient_accumulation_steps": case.gas,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": case.lr, **ADAM, "torch_adam": True}},
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the reference does not clip
        "steps_per_print": 10**9,
        **({"bf16": {"enabled": True}} if case.precision == "bf16" else {}),
        # A static scale: every step is taken (a dynamic scale's first overflows would skip some).
        **({"fp16": {"enabled": True, "loss_scale": 256}} if case.precision == "fp16" else {}),
    }


def _batches(case: Case, world_size: int) -> List[List[List[torch.Tensor]]]:
    """[step][micro][rank] inputs, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return [[[torch.randn(case.rows, case.dim, generator=g) for _ in range(world_size)]
             for _ in range(case.gas)] for _ in range(case.steps)]


def _reference(model: Net, case: Case, batches: Sequence, rank: int, world_size: int
               ) -> Dict[str, Any]:
    """Plain PyTorch: the mean over ranks and micro-batches of the loss, AdamW."""
    model.checkpoint = None
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=case.lr, **ADAM)
    losses = []
    for step_batches in batches:
        opt.zero_grad()
        for micro in step_batches:
            for r, x in enumerate(micro):
                loss = model(x)
                (loss / (case.gas * world_size)).backward()
                if r == rank:
                    losses.append(loss.item())
        opt.step()
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()
                       if p.requires_grad}}


def _engine(case: Case, rank: int, world_size: int) -> Tuple[Net, Any, Dict[str, Any]]:
    """A fresh model of ``case`` under a ZeRO-3 engine, and the plain PyTorch reference trained
    from a copy of it: (model, engine, reference)."""
    torch.manual_seed(7)
    model = Net(case)
    reference = _reference(copy.deepcopy(model), case, _batches(case, world_size), rank,
                           world_size)
    reference["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()
                            if p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable,
                                      config=_ds_config(case))
    return model, engine, reference


def _zero_state_violations(model: nn.Module, stack_len: int) -> List[str]:
    """What a finished backward must not leave behind (empty list: nothing)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    bad = []
    for name, p in model.named_parameters():
        if p.ds_active_sub_modules:
            bad.append(f"{name} lists {sorted(map(str, p.ds_active_sub_modules))}")
        if not p.ds_persist and (p.ds_status != ZeroParamStatus.NOT_AVAILABLE
                                 or p.data.numel() != 0):
            bad.append(f"{name} is {p.ds_status.name} with {p.data.numel()} elements")
    if len(parameter_offload.FWD_MODULE_STACK) != stack_len:
        bad.append(f"FWD_MODULE_STACK holds {len(parameter_offload.FWD_MODULE_STACK)} entries, "
                   f"{stack_len} before the first forward")
    return bad


class _LastUseProbe:
    """Records, when the gradient w.r.t. the last block's ``q`` output arrives (after ``o``'s
    backward, before ``q``'s, while the block's backward is under way), which frozen params of
    that block are gathered. Its gate and ``o.base`` were last used before that moment."""

    def __init__(self, block: LoraBlock) -> None:
        self.block = block
        self.seen: List[Dict[str, str]] = []
        self.handle = block.q.register_forward_hook(self._on_q_output)

    def _on_q_output(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad and torch._C._current_graph_task_id() == -1:
            output.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        named = {"gate.weight": self.block.gate.weight, "o.base.weight": self.block.o.base.weight,
                 "norm.weight": self.block.norm.weight}
        self.seen.append({n: p.ds_status.name for n, p in named.items()})


def _train(case: Case, rank: int, world_size: int) -> Dict[str, Any]:
    """Trains ``case`` under ZeRO-3 and in plain PyTorch; returns what the parent compares."""
    from deepspeed.runtime.zero import parameter_offload

    model, engine, reference = _engine(case, rank, world_size)
    probe = _LastUseProbe(model.blocks[-1]) if case.probe_last_use else None
    stack_len = len(parameter_offload.FWD_MODULE_STACK)
    out: Dict[str, Any] = {"losses": [], "violations": [], "raised": None}

    def forward_backward(x: torch.Tensor) -> float:
        x = x.to(engine.device, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            case.precision, torch.float32))
        with torch.utils.checkpoint.set_checkpoint_early_stop(case.early_stop):
            loss = engine(x)
        if case.backward == "torch":
            loss.backward()
        elif case.backward == "scale":
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        out["violations"] += [f"step {step}: {v}" for v in
                              _zero_state_violations(model, stack_len)]
        return loss.item()

    try:
        for step, step_batches in enumerate(_batches(case, world_size)):
            for micro in step_batches:
                x = micro[rank]
                if case.raise_at_step == step and out["raised"] is None:
                    model.blocks[-1].trip.armed = True
                    try:
                        forward_backward(x)
                    except RuntimeError as e:
                        out["raised"] = str(e)
                        out["violations"] += [f"after the failed backward: {v}" for v in
                                              _zero_state_violations(model, stack_len)]
                out["losses"].append(forward_backward(x))
                engine.step()  # DeepSpeed counts micro-batches here; it steps at the boundary
    except Exception:  # noqa: BLE001 - the parent asserts on it
        out["error"] = traceback.format_exc()
        return out
    finally:
        if probe is not None:
            probe.handle.remove()
            out["probe"] = probe.seen
    out["params"] = gathered_trainable(model)
    out["reference"] = reference
    engine.destroy()
    return out


def _no_shm_comm() -> None:
    """Use gloo for DeepSpeed's collectives. On CPU DeepSpeed otherwise JIT-compiles its optional
    shared-memory comm kernel at every first engine (~1 min on 2 cores, again whenever the build
    cache last held another DeepSpeed version's sources)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run_group(rank: int, world_size: int, fix: str, cases: Sequence[Case]) -> Dict[str, Any]:
    """Applies ``fix`` ("ours", "install", "unpatched"), trains every case, undoes the fix."""
    _no_shm_comm()
    import ds_z3native
    from ds_z3native.compat import checkpoint_recompute as cr

    undo = None
    applied: List[str] = []
    coordinator_cls = cr._DeepSpeed().coordinator_cls
    originals = dict(vars(coordinator_cls))
    if fix == "ours":
        undo = cr.apply_recompute_fix(holds=True)
    elif fix == "install":
        applied = list(ds_z3native.install().patches)
    results = {case.name: _train(case, rank, world_size) for case in cases}
    results["_mode"] = cr.applied_mode()
    results["_patches"] = applied
    if undo is not None:
        undo()
    if fix == "install":
        ds_z3native.uninstall()
    results["_restored"] = dict(vars(coordinator_cls)) == originals and cr.applied_mode() is None
    return results


# ---- assertions ---------------------------------------------------------------------------

# The half types' runs against the fp32 reference: the params in 16 bits (one bf16 ulp = 3.9e-3
# relative, of values about 0.1 here, against a move of a few lr = 1.6e-3 in 3 steps) and
# gradients that differ by a few ulps, so each trainable tensor is bounded by this share of the
# reference's move from the initial value (a tensor that did not train is off by 1).
HALF_PARAMS_REL = 0.35
# fp32: the same sums; element-wise equal params are also within this share of their move.
FP32_PARAMS_REL = 1e-3


def _assert_trained_like_pytorch(name: str, got: Dict[str, Any], case: Case) -> None:
    """No error, ZeRO's state clean after every backward, the losses of plain PyTorch, and every
    trainable tensor trained like it: moved from its initial value by more than half an Adam step
    (rms) in the reference, and within a share of that move of the reference (fp32 also
    element-wise)."""
    assert "error" not in got, f"{name}: {got['error']}"
    assert got["violations"] == [], f"{name}: ZeRO state after backward:\n" + \
        "\n".join(got["violations"])
    ref = got["reference"]
    half = case.precision in ("bf16", "fp16")
    assert got["params"].keys() == ref["params"].keys()
    if half:  # the fp32 reference within the half type's rounding
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=3e-2, atol=1e-3, msg=lambda m: f"{name} losses: {m}")
    else:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} losses: {m}")
        for pname, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][pname], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} {pname}: {m}")
    assert_trained_alike(got["params"], ref["params"], ref["initial"],
                         rel=HALF_PARAMS_REL if half else FP32_PARAMS_REL,
                         min_rms_move=case.lr / 2, what=name)


PATCHED_CASES = [NORM_LINEAR, NORM_LINEAR_DEFAULT_PERSISTENCE, LORA, LORA_NO_INPUT_GRAD, LORA_GAS2,
                 LORA_REUSE, LORA_RAISE_RETRY, LORA_REENTRANT, LORA_DEFAULT_PERSISTENCE, NO_EARLY_STOP,
                 NO_EARLY_STOP_TRAINABLE, TORCH_BACKWARD, TORCH_BACKWARD_GAS2, SCALE_BACKWARD,
                 SCALE_BACKWARD_BF16]


def _assert_group(results: List[Dict[str, Any]], cases: Sequence[Case]) -> None:
    for rank, per_rank in enumerate(results):
        for case in cases:
            got = per_rank[case.name]
            _assert_trained_like_pytorch(f"rank {rank} {case.name}", got, case)
            if case.raise_at_step is not None:
                assert got["raised"] is not None and "tripwire" in got["raised"], got["raised"]


@pytest.mark.slow
def test_ours_one_rank() -> None:
    """The recompute holds (any DeepSpeed version) on every case, plus release at last use."""
    cases = PATCHED_CASES + [GATED_LAST_USE]
    results = run_ranks(run_group, 1, "ours", cases, timeout=RANK_TIMEOUT)
    _assert_group(results, cases)
    assert results[0]["_mode"] == "holds"
    assert results[0]["_restored"], "undo left DeepSpeed's coordinator patched"
    # The gate and o.base were last used in backward before q's gradient arrived: released.
    # DeepSpeed >= 0.19.3 keeps them until the whole block's backward ends (the block's own
    # gate op starts the recompute). norm is used later: still gathered.
    probe = results[0][GATED_LAST_USE.name]["probe"]
    assert len(probe) == GATED_LAST_USE.steps
    for seen in probe:
        assert seen == {"gate.weight": "NOT_AVAILABLE", "o.base.weight": "NOT_AVAILABLE",
                        "norm.weight": "AVAILABLE"}, seen


@pytest.mark.slow
@pytest.mark.release_matrix
def test_install_two_ranks() -> None:
    """What install() applies for the running DeepSpeed, at world size 2."""
    results = run_ranks(run_group, 2, "install", PATCHED_CASES, timeout=RANK_TIMEOUT)
    _assert_group(results, PATCHED_CASES)
    expected = "checkpoint-recompute-hardening" if UPSTREAM_FIX else "checkpoint-recompute-frozen"
    for per_rank in results:
        assert expected in per_rank["_patches"]
        assert per_rank["_mode"] == ("hardening" if UPSTREAM_FIX else "holds")
        assert per_rank["_restored"], "uninstall() left DeepSpeed's coordinator patched"


@pytest.mark.slow
@pytest.mark.release_matrix
def test_unpatched_deepspeed_fails() -> None:
    """DeepSpeed alone: the minimal reproduction raises CheckpointError before 0.19.3; from 0.19.3
    recomputed frozen params stay gathered past their last use when the block's own op starts the
    recompute; with early stop off every 0.19.x partitions a param its running backward still
    needs (no frozen params needed for that one)."""
    results = run_ranks(run_group, 1, "unpatched",
                        [NORM_LINEAR, NO_EARLY_STOP_TRAINABLE, GATED_LAST_USE],
                        timeout=RANK_TIMEOUT)[0]
    assert results["_mode"] is None
    minimal = results[NORM_LINEAR.name]
    assert_unpatched_outcome(minimal, UPSTREAM_FIX)
    if UPSTREAM_FIX:
        # No error, but its forward module stack grows with every recompute cut short by early
        # stop.
        assert any("FWD_MODULE_STACK" in v for v in minimal["violations"]), minimal["violations"]
    gated = results[GATED_LAST_USE.name]
    if UPSTREAM_FIX:
        # DeepSpeed attributes the recomputed frozen params to the block (its gate op starts the
        # recompute) and keeps them all until the block's backward ends.
        assert "error" not in gated, gated["error"]
        for seen in gated["probe"]:
            assert seen == {"gate.weight": "AVAILABLE", "o.base.weight": "AVAILABLE",
                            "norm.weight": "AVAILABLE"}, seen
    else:
        assert "CheckpointError" in gated.get("error", ""), gated
    no_early_stop = results[NO_EARLY_STOP_TRAINABLE.name]
    assert "The size of tensor a (0) must match" in no_early_stop.get("error", ""), no_early_stop
