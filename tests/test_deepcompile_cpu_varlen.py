"""DeepCompile on padded batches of varying length (``deepcompile-symbolic-input-guards``,
``deepcompile-keep-automatic-dynamic``): the rows of a batch padded to its longest, as
``DataCollatorWithPadding`` and TRL's collator pad, each batch of another length.

DeepSpeed's ``patch_fake_tensor`` guarded every graph input on its concrete size, so each new
length was a new DeepCompile compile and profile (35-47 s each for a 1 B model on a GPU) until
Dynamo's ``recompile_limit`` (8) sent the frame to eager, where the run stopped. With the patches
a run compiles a number of times that does not grow with the number of lengths, and trains like
eager ZeRO-3 on the same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest

from helpers.dc_cpu import CPU_ENV, assert_same_training, ok, run
from helpers.dc_runner import needs_cpu_deepcompile

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

# 12 steps, 10 distinct lengths (more than Dynamo's recompile_limit of 8 would allow, had each
# length compiled), every batch padded.
LENGTHS = "12,17,9,20,14,23,11,26,15,29,12,17"
STEPS = 12
LLAMA = ("--model", "llama", "--checkpointing", "non-reentrant", "--lengths", LENGTHS,
         "--eval-every", "6")

_GUARDS_SCRIPT = r"""
import json, os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
import torch
import deepspeed.compile.init_z3 as init_z3
if sys.argv[1] == "ours":
    import ds_z3native
    ds_z3native.install()
init_z3.patch_fake_tensor()  # what init_z3 runs at engine.compile()
compiles = []
def backend(gm, example_inputs):
    compiles.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
    return gm.forward
lin = torch.nn.Linear(8, 8)
@torch.compile(backend=backend)
def f(x, mask):
    return (lin(x) * mask[..., None]).sum()
for n in [5, 7, 9, 11, 13, 4, 6, 8, 10, 12]:
    f(torch.randn(2, n, 8), torch.ones(2, n))
print(json.dumps(len(compiles)))
"""


def _compiles_over_ten_lengths(which: str) -> int:
    env = {**os.environ, **CPU_ENV}
    out = subprocess.run([sys.executable, "-c", _GUARDS_SCRIPT, which], env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deepspeeds_guard_patch_compiles_each_length_and_ours_compiles_twice() -> None:
    """DeepSpeed's ``patch_fake_tensor`` alone (no engine): a function of ten input lengths compiles
    for each until Dynamo's limit; with ``install()`` the second length makes the dimension
    symbolic and one graph serves the rest (plain torch.compile's behaviour)."""
    assert _compiles_over_ten_lengths("deepspeed") >= 8
    assert _compiles_over_ten_lengths("ours") == 2


@needs_cpu_deepcompile
def test_varying_lengths_compile_a_bounded_number_of_times_and_train_like_eager() -> None:
    """A tiny Llama + LoRA + non-reentrant checkpointing under DeepCompile over 12 padded batches of
    10 lengths, with evaluation forwards of varying length: at most 3 training graphs and 2
    evaluation graphs (the first length, the symbolic one, the re-plan's), losses and adapters
    as eager ZeRO-3's with DeepSpeed's own code (no ds_z3native patch in the reference)."""
    ours = ok(run(*LLAMA, steps=STEPS), steps=STEPS)
    ref = ok(run(*LLAMA, "--mode", "eager", "--eager-stage", "3", "--native", "deepspeed",
                 steps=STEPS),
             steps=STEPS)
    assert_same_training(ours, ref, rtol=2e-5, atol=2e-6, steps=STEPS)
    assert len(ours["eval_losses"]) == len(ref["eval_losses"]) == 2
    for a, b in zip(ours["eval_losses"], ref["eval_losses"]):
        assert a == pytest.approx(b, rel=2e-5)
    assert ours["dynamo_graphs"] <= 5, ours["dynamo_graphs"]
    lengths: List[int] = [int(x) for x in LENGTHS.split(",")]
    assert len(set(lengths)) == 10 and ours["graph_breaks"] == 0
