"""1 B Llama + PEFT LoRA training: step time, throughput and peak memory per variant.

The setup (``--size 1b``, the default): an HF ``LlamaForCausalLM`` of ~0.96 B params built from a
``LlamaConfig`` (hidden 2048, MLP 5632, 16 layers, 32 heads, vocab 32000, random init, no
download), PEFT LoRA r=16 on every linear layer, bf16, micro-batch 4 x 1024 tokens per GPU, AdamW
(lr 1e-4). ``--size toy`` is the same at a size a CPU runs.

One variant per process (DeepSpeed keeps process-wide hooks and state); the DeepSpeed version is
whatever ``import deepspeed`` finds (choose it with PYTHONPATH):

* ``plain``: plain PyTorch, no DeepSpeed, no ZeRO, no checkpointing (the ceiling);
* ``compiled``: ``plain`` with ``torch.compile(model)``;
* ``fsdp2-ckpt-compile``: the peer recipe: PyTorch FSDP2, transformers' non-reentrant
  checkpointing, each decoder layer ``.compile()``d and ``fully_shard``ed, then the root (what
  accelerate's regional compilation with FSDP2 does), AdamW over the LoRA params;
* ``none``: eager ZeRO-3, no checkpointing, DeepSpeed alone;
* ``upstream``: eager ZeRO-3, non-reentrant checkpointing, DeepSpeed alone (fails before 0.19.3);
* ``ours``: eager ZeRO-3, non-reentrant checkpointing with ds_z3native's recompute holds
  (``compat.checkpoint_recompute.apply_recompute_fix(holds=True)``, which on DeepSpeed >= 0.19.3
  replaces DeepSpeed's own fix);
* ``reentrant``: eager ZeRO-3, reentrant checkpointing, DeepSpeed alone;
* ``dc``: DeepCompile ZeRO-3 with ``ds_z3native.install()``, no checkpointing;
* ``dc-warm``: ``dc`` again, its inductor cache filled by ``dc`` and DeepCompile's profiles
  replayed from the profile store ``dc`` wrote (``python -m bench`` gives each invocation one
  fresh cache and store directory and runs ``dc-warm`` after ``dc``): what compiling costs a
  second run of the same job;
* ``dc-ckpt``: the same with non-reentrant checkpointing;
* ``dc-ckpt-lowmem``: ``dc-ckpt`` with ``ds_z3native.set_persistence_budget(0)``: DeepCompile's
  selective gather keeps no param gathered between uses (DeepCompile registers every param
  non-persistent, norm weights included);
* ``dc-ckpt-lean``: ``dc-ckpt-lowmem`` with ``ds_z3native.set_prefetch_budget(0)`` as well: each
  param is gathered just before its first use (DeepSpeed prefetches up to 4e9 bytes ahead);
* ``dc-ckpt-ungrouped``: ``dc-ckpt`` with ``ds_z3native.set_group_persistent(False)``: the
  params DeepCompile keeps gathered are reached as DeepSpeed's graphs do, an ``allgather_param``,
  ``wait_allgather`` and ``release_param`` call per use (run only when named);
* ``dc-ckpt-single``: ``dc-ckpt`` with ``ds_z3native.set_single_cycle(True)``: one profiling
  cycle, the re-plan's passes at the first step and no re-plan at step 6 (run only when named);
* ``dc-ckpt-single-reduce-each``: ``dc-ckpt-single`` with ``ds_z3native.set_group_reduce(False)``:
  the backward graph hands each gradient to the reduction in its own ``reduce_grad`` call, as
  DeepSpeed's graphs do (run only when named; against ``dc-ckpt-single``, the grouped reduce alone);
* ``dc-upstream``: DeepCompile ZeRO-3 with DeepSpeed's own op (JIT-built), no checkpointing;
* ``dc-ckpt-upstream``: ``dc-ckpt``'s setup (non-reentrant checkpointing) with DeepSpeed's own op
  and without ds_z3native; run only when named (``--variants``), not by a full ``lora_llama`` run.
  DeepSpeed 0.19.8 alone fails on it at the first forward (``'weight' must be 2-D``: after a
  graph break the embedding sees its partitioned weight), which the run records;
* ``trainer-dc-ckpt``: ``dc-ckpt`` driven by HF ``transformers.Trainer`` as a Trainer user runs it
  (``TrainingArguments(deepspeed=<the same config>, torch_compile=True, gradient_checkpointing=True,
  gradient_checkpointing_kwargs={"use_reentrant": False})``; accelerate calls ``engine.compile()``),
  random token batches from a dataset through Trainer's data loader, a loss logged every step. Its
  step time is the time between the ends of consecutive optimizer steps (what the loop costs:
  data loading, the step, clipping's norm query, logging), against ``dc-ckpt`` of the same run.

Variable lengths: ``dc-ckpt-varlen`` and ``dc-ckpt-single-varlen`` are ``dc-ckpt`` and
``dc-ckpt-single`` on batches whose length changes from step to step, which DeepCompile serves
through Dynamo's dynamic shapes (``deepcompile-symbolic-input-guards``,
``deepcompile-keep-automatic-dynamic``). ``--lengths uniform:LO:HI[:STEP]`` (default
``uniform:128:2048``) draws each step's length uniformly from LO, LO+STEP, ... up to HI, from a
fixed seed and the same on every rank (ranks whose lengths differ at one step would compile
different graphs). Each of the micro-batch's rows is that long: every position a real token, no
attention mask, so a step's tokens are micro-batch x length and the only change against the fixed
run is the length. ``--pad-rows`` instead pads as a collator does: the first row is the step's
length, each other row a real length drawn from half of it up to all of it, right-padded (pad
id 0, ``attention_mask`` 0, labels -100 there); tokens are then still counted as padded positions
(``step_real_tokens`` keeps the real ones). The baseline is the base variant at the lengths'
mean (``--seq 1088`` for 128-2048): the same tokens per step on average. A record keeps each
step's length and tokens (``step_lengths``, ``step_tokens``), the time per token over the timed
steps (``us_per_token``: their summed time over their summed tokens; ``us_per_token_steady``
without the timed steps in which something compiled), Dynamo's graph count after each step
(``dynamo_graphs_by_step``; ``compile_steps``: the steps that compiled) and DeepCompile's own
compiles (``deepcompile_compiles``: forward and backward graphs its passes ran on); ``merge``
gives a varlen run ``vs["fixed"]``: its time per token over the base variant's of the same
invocation. ``python -m bench lora_llama --variants dc-ckpt-single,dc-ckpt-single-varlen`` runs
the pair (the fixed run 40 steps at the mean length, the varlen run 100) into
``lora_llama_varlen.json``; a varlen variant is not run without its base variant.

DeepCompile variants run ``--dc-steps`` steps (default 20) and report the time from
``engine.compile()`` to the end of the first step, the step where DeepCompile re-plans (its 6th:
profiling and a full recompile), the wall time to the last step, and step statistics over the
steps after the re-plan; ``compile_seconds`` says where the first step's and the re-plan's
compile time went (torch's own counters: Dynamo's tracing, AOTAutograd, inductor...). Eager
variants time ``--steps`` steps after ``--warmup``. ``--layers N`` gives the size N decoder
layers (the ``compile_scaling`` benchmark's depths); ``--build-op-first`` loads a DeepSpeed-op
variant's op before the clock starts (its JIT build is then not counted as compiling), and
records the run as not available where DeepSpeed has no such op for its accelerator.

Throughput: tokens/s = micro-batch x seq x world size / step time. Model FLOPs per step (what the
model needs, not what the run executed: checkpointing's recompute is not counted) =
tokens x (4 x N + 12 x layers x seq x hidden) for a frozen base of N matmul params (the input
embedding, a lookup, excluded): forward 2N and backward 2N for the input gradients; attention
scores and values 4 x layers x seq x hidden forward, 8 x ... backward. LoRA's own weight gradients
are negligible. The share of peak uses the GPU's dense bf16 peak (H100/H200:
989 TFLOP/s).

Each run writes one JSON file (setup, versions, step-time median/min/max, peak memory, tokens/s,
TFLOP/s, peak share, ``gpu_conditions``: the GPU's clocks, power, temperature, clock-event reasons
and other processes over the timed steps, and the host's load, see ``bench/conditions.py``; eager
ZeRO-3 variants also the bytes held by gathered params, from one extra instrumented step); ``merge`` combines such files into one (``bench/results/lora_llama.json``),
with each run's ratio to the same run's ``upstream`` (eager checkpointing) and ``none``.
A failed run still writes its file, with ``error``.

On a CPU: ``DS_ACCELERATOR=cpu python bench/lora_llama.py --size toy --variant ours``.

Two variants measured side by side: ``--take-turns DIR:N`` on each of N processes started
together (one GPU each run, world size 1) lets them compile at the same time, waits until all N
reach their first timed step, then runs one process's timed steps (and ``--trace`` steps) at a
time, under an exclusive lock on ``DIR/turn.lock``; the others wait idle with their memory held.
Each record's ``turns`` gives the waits and its timed window (epoch seconds), so two variants get
one machine, one GPU and one time span without their timed steps overlapping. ``DIR:N:K``
interleaves them instead: each process runs K timed steps per turn and passes the turn on, in a
fixed order, so a machine that drifts during the run (clocks, the host's other load) reaches every
variant alike (``turns.windows``: one window per turn):

    turns=$(mktemp -d)
    python bench/lora_llama.py --variant trainer-dc-ckpt --take-turns $turns:2 --run pair \
        --output trainer.json &
    python bench/lora_llama.py --variant dc-ckpt --take-turns $turns:2 --run pair \
        --output own.json; wait

An experiment with inductor's own settings: ``--inductor NAME=VALUE`` (repeatable) sets
``torch._inductor.config.NAME`` before anything compiles (``--inductor triton.cudagraphs=True
--inductor graph_partition=True``: CUDA graphs between the dc ops; ``--inductor cpp_wrapper=True``:
inductor's C++ wrapper); the record's ``setup.inductor`` keeps what was set.
``--skip-patch NAME`` (repeatable) leaves one of ds_z3native's patches out of ``install()``, to
measure what it does against the same build (``setup.skipped_patches``).

Where the time goes: ``--trace DIR`` runs two more steps after the timed ones under
``torch.profiler`` and writes, per rank, a Chrome trace (``DIR/<variant>-rank<r>.json``) and
the ops ranked by self device time (self CPU time on a CPU), ``DIR/<variant>-rank<r>-top.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from packaging.version import Version

try:  # run as bench/lora_llama.py, its folder is on the path; imported as bench.lora_llama
    from bench.conditions import GpuConditions
    from bench.core.variants import (CHECKPOINTING, OURS_DC, TRAINER, UPSTREAM_DC,
                                     VARIANT_BY_NAME, VARIANTS, VARLEN, Variant)
    from bench.deepcompile_run import (GcClock, add_inductor_option, add_skip_patch_option,
                                       apply_inductor_config, skip_patches,
                                       deepcompile_pass_seconds)
    from bench.trace_breakdown import PHASE_PREFIX, breakdown_file
except ImportError:
    from conditions import GpuConditions
    from core.variants import (CHECKPOINTING, OURS_DC, TRAINER, UPSTREAM_DC, VARIANT_BY_NAME,
                               VARIANTS, VARLEN, Variant)
    from deepcompile_run import (GcClock, add_inductor_option, add_skip_patch_option,
                                 apply_inductor_config, skip_patches,
                                 deepcompile_pass_seconds)
    from trace_breakdown import PHASE_PREFIX, breakdown_file

log = logging.getLogger("bench.lora_llama")

DEFAULT_LENGTHS = "uniform:128:2048"
LENGTHS_SEED = 0  # one draw of lengths for every rank and run
# Steps of a varlen invocation of the suite: the varlen run and its fixed-length baseline.
VARLEN_DC_STEPS, FIXED_DC_STEPS = 100, 40
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM
SIZES: Dict[str, Dict[str, int]] = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=32),
    "toy": dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4),
}
# stage3_param_persistence_threshold per size: DeepSpeed's default (1e5 elements) at 1b keeps the
# norms whole and partitions every linear; at toy size it would keep everything whole.
PERSISTENCE = {"1b": None, "toy": 1000}
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """``uniform:LO:HI[:STEP]``: each step's length drawn uniformly from LO, LO+STEP, ... up to
    HI (``--lengths``)."""

    lo: int
    hi: int
    step: int = 1

    @property
    def values(self) -> range:
        return range(self.lo, self.hi + 1, self.step)

    @property
    def mean(self) -> float:
        """The mean length of the draw (the fixed-length baseline's, rounded)."""
        return (self.values[0] + self.values[-1]) / 2

    @property
    def text(self) -> str:
        return f"uniform:{self.lo}:{self.hi}" + (f":{self.step}" if self.step != 1 else "")

    def record(self) -> Dict[str, Any]:
        """What a record's ``setup.lengths`` keeps of the draw."""
        return {"spec": self.text, "min": self.lo, "max": self.values[-1], "step": self.step,
                "mean": self.mean, "seed": LENGTHS_SEED}


def parse_lengths(text: str) -> LengthSpec:
    """``uniform:LO:HI[:STEP]`` -> :class:`LengthSpec`; ``argparse.ArgumentTypeError`` naming the
    value where it is not one (2 <= LO <= HI, STEP >= 1)."""
    kind, _, rest = text.partition(":")
    parts = rest.split(":")
    try:
        numbers = [int(x) for x in parts]
    except ValueError:
        numbers = []
    if kind != "uniform" or len(numbers) not in (2, 3):
        raise argparse.ArgumentTypeError(
            f"--lengths: expected uniform:LO:HI or uniform:LO:HI:STEP, got {text!r}")
    lo, hi, step = numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 1
    if lo < 2 or hi < lo or step < 1:
        raise argparse.ArgumentTypeError(
            f"--lengths: needs 2 <= LO <= HI and STEP >= 1, got {text!r}")
    return LengthSpec(lo, hi, step)


def fixed_length(spec: LengthSpec) -> int:
    """The fixed-length baseline's ``--seq`` for ``spec``: its mean length, rounded."""
    return int(round(spec.mean))


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the size's own)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dc-steps", type=int, default=20,
                   help="steps of a DeepCompile variant (timed after its 6th, the re-plan)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per row (default 1024; a varlen variant's is its lengths' mean, "
                        "rounded)")
    p.add_argument("--lengths", type=parse_lengths, default=None, metavar="uniform:LO:HI[:STEP]",
                   help=f"a varlen variant's length per step, drawn uniformly (default "
                        f"{DEFAULT_LENGTHS})")
    p.add_argument("--pad-rows", action="store_true",
                   help="pad the rows as a collator does: each row after the first shorter, "
                        "right-padded, with attention_mask and labels -100 on the pads")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold (default: DeepSpeed's at 1b, 1000 "
                        "at toy size)")
    p.add_argument("--no-track-gathered", action="store_true",
                   help="skip the extra instrumented step")
    p.add_argument("--build-op-first", action="store_true",
                   help="a DeepSpeed-op variant: load (JIT-build) DeepSpeed's op before the clock "
                        "starts; not available where DeepSpeed has none for its accelerator")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="profile two more steps after the timed ones; traces and op tables here")
    p.add_argument("--run", default=None, metavar="LABEL",
                   help="the benchmark invocation this run belongs to (``python -m bench`` gives "
                        "one label to all its runs); a merged file's ratios compare runs with "
                        "the same label only")
    p.add_argument("--take-turns", type=_turns_arg, default=None, metavar="DIR:N[:K]",
                   help="one of N processes started together: compile alongside the others, "
                        "then run the timed steps one process at a time (lock in DIR); with K, "
                        "K timed steps per turn, the N processes taking turns in a fixed order")
    add_inductor_option(p, "the record's setup.inductor")
    add_skip_patch_option(p, "the record's setup.skipped_patches")
    p.add_argument("--remark", default=None, metavar="TEXT",
                   help="what sets this run apart from others of its variant and label that the "
                        "setup does not say (another build of ds_z3native, say); kept in the "
                        "record's ``remark``")
    p.add_argument("--output", type=Path, required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if args.trace is not None and args.variant in TRAINER:
        p.error(f"--trace profiles steps of our own loop; {args.variant} runs HF Trainer's")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    if args.variant in VARLEN:
        if args.seq is not None:
            p.error(f"--seq: {args.variant} draws its lengths (--lengths); its tokens per row "
                    f"are their mean, got --seq {args.seq}")
        args.lengths = args.lengths or parse_lengths(DEFAULT_LENGTHS)
        args.seq = fixed_length(args.lengths)
    elif args.lengths is not None:
        p.error(f"--lengths applies to the varlen variants ({', '.join(VARLEN)}), got "
                f"--variant {args.variant}")
    if args.seq is None:
        args.seq = 1024
    if args.pad_rows and args.variant in TRAINER:
        p.error(f"--pad-rows pads our own loop's batches; {args.variant} runs HF Trainer's")
    return args


def _turns_arg(text: str) -> "tuple[Path, int, Optional[int]]":
    """``DIR:N`` -> (DIR, N, None); ``DIR:N:K`` -> (DIR, N, K)."""
    head, sep, last = text.rpartition(":")
    folder, sep2, middle = head.rpartition(":")
    if sep2 and folder and middle.isdigit() and last.isdigit():
        count, per_turn = int(middle), int(last)
    else:
        folder, count, per_turn = head, int(last) if last.isdigit() else 0, None
    if not sep or not folder or count < 1 or (per_turn is not None and per_turn < 1):
        raise argparse.ArgumentTypeError(
            f"expected DIR:N with N >= 1 (or DIR:N:K, K >= 1 timed steps per turn), got {text!r}")
    return Path(folder), count, per_turn


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a mark's suffix) runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class Turns:
    """Timed steps one process at a time among ``count`` processes sharing ``folder``
    (``--take-turns``). Made when a process starts (mark ``started-<pid>``); :meth:`take` marks
    it ready, waits until ``count`` are, then holds an exclusive ``flock`` on ``folder/turn.lock``
    until :meth:`give_back` (or exit: the OS drops the lock of a process that dies). A partner
    that ends before it is ready (a crash while compiling) makes the others fail at once, naming
    its pid; one that never gets ready, after ``timeout`` seconds. Each pair needs a folder of its
    own: one holding marks of processes that ended is refused.

    With ``per_turn`` (K), :meth:`step_done` passes the turn on after every K timed steps: the
    processes take turns in the order of their pids, through ``folder/ticket`` (whose turn it
    is; a process that is done, mark ``done-<pid>``, is skipped), the lock still held for each
    turn. A partner that ends between its turns without being done fails the others."""

    def __init__(self, folder: Path, count: int, timeout: float = 3600.0,
                 per_turn: Optional[int] = None) -> None:
        self.folder, self.count, self.timeout, self.per_turn = folder, count, timeout, per_turn
        self._lock: Optional[Any] = None
        self._order: List[str] = []  # the ready processes' pids, in turn order
        self._steps_in_turn = 0
        self.record: Dict[str, Any] = {"dir": str(folder), "processes": count}
        if per_turn is not None:
            self.record["steps_per_turn"] = per_turn
        folder.mkdir(parents=True, exist_ok=True)
        ended = sorted(f"{kind}-{pid}" for kind in ("started", "ready")
                       for pid in self._pids(kind) if not _alive(pid))
        if ended:
            raise RuntimeError(f"--take-turns {folder}:{count}: the folder holds marks of "
                               f"processes that ended ({', '.join(ended)}); give each set of "
                               f"processes a new folder")
        (folder / f"started-{os.getpid()}").touch()

    def _pids(self, kind: str) -> List[str]:
        """The processes with a ``kind`` mark (``started`` or ``ready``) in the folder."""
        return [f.name.split("-", 1)[1] for f in self.folder.glob(f"{kind}-*")]

    def take(self) -> None:
        import fcntl

        (self.folder / f"ready-{os.getpid()}").touch()
        start = time.perf_counter()
        last_log = start
        while True:
            ready = set(self._pids("ready"))
            if len(ready) >= self.count:
                break
            gone = sorted(pid for pid in self._pids("started")
                          if pid not in ready and not _alive(pid))
            if gone:
                raise RuntimeError(f"--take-turns {self.folder}:{self.count}: process "
                                   f"{', '.join(gone)} ended before its timed steps (see its "
                                   f"log); {len(ready)} of {self.count} were ready")
            now = time.perf_counter()
            if now - start > self.timeout:
                raise RuntimeError(f"--take-turns {self.folder}:{self.count}: only {len(ready)} "
                                   f"of {self.count} processes reached their timed steps within "
                                   f"{self.timeout:.0f} s")
            if now - last_log >= 30.0:
                log.info("waiting for the other processes of %s: %d of %d ready", self.folder,
                         len(ready), self.count)
                last_log = now
            time.sleep(0.2)
        self.record["ready_wait_s"] = time.perf_counter() - start
        self._order = sorted(self._pids("ready"), key=int)
        start = time.perf_counter()
        self._acquire()
        self.record["turn_wait_s"] = time.perf_counter() - start
        self.record["window"] = [time.time(), None]
        if self.per_turn is not None:
            self.record["windows"] = [[self.record["window"][0], None]]
        log.info("timed steps start (waited %.1f s for the others, %.1f s for the turn)",
                 self.record["ready_wait_s"], self.record["turn_wait_s"])

    def _whose_turn(self) -> str:
        """The pid whose turn it is (``per_turn``): the ticket's, or the next not done after it;
        empty once every process is done."""
        try:
            ticket = int((self.folder / "ticket").read_text())
        except (FileNotFoundError, ValueError):
            ticket = 0
        done = set(self._pids("done"))
        n = len(self._order)
        for j in range(n):
            pid = self._order[(ticket + j) % n]
            if pid not in done:
                return pid
        return ""

    def _acquire(self) -> None:
        import fcntl

        if self.per_turn is not None:
            me, start = str(os.getpid()), time.perf_counter()
            while (owner := self._whose_turn()) != me:
                if owner and not _alive(owner):
                    raise RuntimeError(f"--take-turns {self.folder}:{self.count}: process "
                                       f"{owner} ended between its turns (see its log)")
                if time.perf_counter() - start > self.timeout:
                    raise RuntimeError(f"--take-turns {self.folder}:{self.count}: the turn did "
                                       f"not come back within {self.timeout:.0f} s (process "
                                       f"{owner} holds it)")
                time.sleep(0.002)
        self._lock = open(self.folder / "turn.lock", "a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def _release(self, done: bool) -> None:
        import fcntl

        if self.per_turn is not None:
            me = str(os.getpid())
            if done:
                (self.folder / f"done-{me}").touch()
            ticket = self.folder / f"ticket.{me}"
            ticket.write_text(str((self._order.index(me) + 1) % len(self._order)))
            os.replace(ticket, self.folder / "ticket")
        assert self._lock is not None
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None

    def step_done(self, remaining: int, drain: Callable[[], None]) -> None:
        """After a timed step, ``remaining`` timed steps still to run: with ``per_turn``, every
        K-th passes the turn on (``drain`` first: the device must be idle for the next process)
        and waits for it to come back."""
        if self.per_turn is None or self._lock is None:
            return
        self._steps_in_turn += 1
        if self._steps_in_turn < self.per_turn or remaining <= 0:
            return
        self._steps_in_turn = 0
        drain()
        self.record["windows"][-1][1] = time.time()
        self._release(done=False)
        start = time.perf_counter()
        self._acquire()
        self.record["turn_wait_s"] += time.perf_counter() - start
        self.record["windows"].append([time.time(), None])

    def give_back(self) -> None:
        if self._lock is None:
            return
        self.record["window"][1] = time.time()
        if self.per_turn is not None:
            self.record["windows"][-1][1] = self.record["window"][1]
        self._release(done=True)


class NotAvailable(RuntimeError):
    """A variant this host cannot run at all (the message says why): a result, not a failure."""


def model_config(args: argparse.Namespace) -> Dict[str, int]:
    """The ``LlamaConfig`` fields of ``--size``, with ``--layers`` decoder layers where given."""
    config = dict(SIZES[args.size])
    if getattr(args, "layers", None) is not None:
        config["num_hidden_layers"] = args.layers
    return config


def load_upstream_op() -> float:
    """Loads DeepSpeed's own DeepCompile op the way its DeepCompile does (``get_deepcompile_handle``:
    a JIT build into ``TORCH_EXTENSIONS_DIR`` the first time), so that a run's compile times
    leave the build out; the seconds it took. ``NotAvailable`` where DeepSpeed's accelerator has
    no implementation of the op (its CPU accelerator: the op is CUDA and NCCL code)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.create_op_builder("DeepCompileBuilder")
    if builder is None or any(c.__name__ == "NotImplementedBuilder" for c in type(builder).__mro__):
        raise NotAvailable(f"DeepSpeed has no DeepCompile op for its "
                           f"{accelerator.device_name()} accelerator "
                           f"({type(builder).__name__ if builder is not None else 'no builder'})")
    start = time.perf_counter()
    try:
        from deepspeed.compile.util import get_deepcompile_handle
    except ImportError:  # where DeepSpeed keeps no handle: its builder alone
        builder.load()
    else:
        get_deepcompile_handle()
    seconds = time.perf_counter() - start
    log.info("DeepSpeed's DeepCompile op loaded in %.1f s (before the clock)", seconds)
    return seconds


def compile_seconds() -> Dict[str, float]:
    """torch's compile-time counters (``torch._dynamo.utils.compile_times``, seconds summed per
    timed function since the process started): Dynamo's tracing, the backend (for DeepCompile:
    AOTAutograd, its passes and profiling runs, inductor), inductor's code generation..."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)  # type: ignore[misc]
        return {str(n): float(v) for n, v in zip(names, values)}
    except Exception as e:  # noqa: BLE001 - a figure missing, not a failed run
        log.warning("torch's compile-time counters are not readable here (%s)", e)
        return {}


def _compile_window(before: Dict[str, float], after: Dict[str, float],
                    floor_s: float = 0.05) -> Dict[str, float]:
    """``after - before`` per counter (those of at least ``floor_s``), largest first; the
    counters nest (``_compile.compile_inner`` holds the rest), so they do not add up.
    ``torch._dynamo.reset()`` (DeepCompile calls it when it re-plans) clears torch's counters:
    where one went down, ``after`` alone is what compiled since then."""
    if any(v < before.get(k, 0.0) for k, v in after.items()) or not before.keys() <= after.keys():
        before = {}
    delta = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in delta.items() if v >= floor_s), key=lambda kv: -kv[1]))


def _compile_total(before: Dict[str, float], replan_before: Dict[str, float],
                   last: Dict[str, float], floor_s: float = 0.05) -> Dict[str, float]:
    """Compile seconds per counter from ``engine.compile()`` to the last step: up to the step
    before the re-plan plus from there on (torch's counters restart where the re-plan resets
    Dynamo, so one window across it would lose the first compile), largest first."""
    first = _compile_window(before, replan_before, 0.0)
    rest = _compile_window(replan_before, last, 0.0)
    total = {k: round(first.get(k, 0.0) + rest.get(k, 0.0), 3) for k in first.keys() | rest.keys()}
    return dict(sorted(((k, v) for k, v in total.items() if v >= floor_s), key=lambda kv: -kv[1]))


def compile_counters() -> Dict[str, Dict[str, int]]:
    """torch's compile event counters (``torch._dynamo.utils.counters``: frames, graph breaks,
    captured calls, inductor's and AOTAutograd's cache outcomes...), counted since the process
    started (Dynamo's reset at the re-plan keeps them); the groups this torch has, {} where it
    has none."""
    try:
        from torch._dynamo.utils import counters
    except Exception as e:  # noqa: BLE001 - a figure missing, not a failed run
        log.warning("torch's compile counters are not readable here (%s)", e)
        return {}
    out: Dict[str, Dict[str, int]] = {}
    for group, values in sorted(counters.items(), key=lambda kv: str(kv[0])):
        numbers = {str(k): int(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            out[str(group)] = dict(sorted(numbers.items()))
    return out


def dynamo_graphs() -> Optional[int]:
    """Graphs Dynamo compiled since the process started (``counters["stats"]["unique_graphs"]``;
    under DeepCompile each one a DeepCompile compile and profile, its re-plan's included: Dynamo's
    reset at the re-plan keeps the counters); None where this torch has no such counter."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a figure missing, not a failed run
        return None
    value = counters.get("stats", {}).get("unique_graphs")
    return int(value) if isinstance(value, (int, float)) else None


def deepcompile_compiles(passes: Optional[List[Dict[str, Any]]]) -> Optional[Dict[str, int]]:
    """DeepCompile's own compiles from its pass timings (:func:`deepcompile_pass_seconds`): the
    forward and backward graphs its passes ran on; None where DeepSpeed keeps no timings."""
    if passes is None:
        return None
    return {d: sum(1 for p in passes if p["direction"] == d) for d in ("fwd", "bwd")}


def _launcher_env() -> None:
    """One process without a launcher: make it rank 0 of 1."""
    if "RANK" in os.environ:
        return
    from ds_z3native._net import free_port
    from ds_z3native.launch import rank_env

    os.environ.update(rank_env(0, 1, free_port()))


def _versions() -> Dict[str, Any]:
    import deepspeed
    import peft
    import torch
    import transformers

    import ds_z3native

    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "peft": peft.__version__, "ds_z3native": ds_z3native.__version__,
            "python": platform.python_version()}


def _build_model(args: argparse.Namespace, device: Any, dtype: Any) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    lengths = getattr(args, "lengths", None)
    longest = max(args.seq, lengths.values[-1] if lengths is not None else 0, 64)
    config = LlamaConfig(**model_config(args), max_position_embeddings=longest,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.train()
    mode = CHECKPOINTING[args.variant]
    if mode != "none" and args.variant not in TRAINER:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        if mode == "reentrant":
            model.enable_input_require_grads()  # reentrant checkpointing needs a grad input
    return model


def model_flops_per_step(n_matmul_params: int, layers: int, hidden: int, seq: int,
                         tokens: int) -> float:
    """Model FLOPs of one LoRA training step on a frozen base (see the module docstring):
    ``n_matmul_params`` excludes the input embedding (a lookup, not a matmul)."""
    return float(tokens) * (4.0 * n_matmul_params + 12.0 * layers * seq * hidden)


def _peak_tflops(device_name: str) -> Optional[float]:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


class _GatheredBytes:
    """Samples the bytes held by gathered non-persistent ZeRO-3 params at every fetch and release
    of DeepSpeed's parameter coordinator (outermost wrapper, so it sees the patched behaviour)."""

    def __init__(self, params: List[Any]) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import (
            PartitionedParameterCoordinator as Coordinator)

        import torch

        self._available = ZeroParamStatus.AVAILABLE
        self._params = [p for p in params if not p.ds_persist]
        self._cls = Coordinator
        self._originals = (Coordinator.fetch_sub_module, Coordinator.release_sub_module)
        self.samples: List[tuple] = []  # (in backward, bytes)
        task_id: Callable[[], int] = torch._C._current_graph_task_id
        fetch, release = self._originals

        def sample() -> None:
            held = sum(p.ds_numel * p.element_size() for p in self._params
                       if p.ds_status == self._available)
            self.samples.append((task_id() != -1, held))

        def fetch_sampled(coordinator: Any, *args: Any, **kwargs: Any) -> Any:
            result = fetch(coordinator, *args, **kwargs)
            sample()
            return result

        def release_sampled(coordinator: Any, *args: Any, **kwargs: Any) -> Any:
            result = release(coordinator, *args, **kwargs)
            sample()
            return result

        Coordinator.fetch_sub_module = fetch_sampled
        Coordinator.release_sub_module = release_sampled

    def close(self) -> Dict[str, float]:
        self._cls.fetch_sub_module, self._cls.release_sub_module = self._originals
        backward = [b for in_bwd, b in self.samples if in_bwd]
        return {"peak_gib": max((b for _, b in self.samples), default=0) / GIB,
                "backward_peak_gib": max(backward, default=0) / GIB,
                "backward_mean_gib": (statistics.fmean(backward) if backward else 0.0) / GIB,
                "samples": len(self.samples)}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux

class _StepClock:
    """Times a run's steps the same way whichever loop drives them: ``begin()`` before the
    first step, ``ready(i)`` before step ``i`` (at the first timed step: the device drained, its
    peak-memory counter reset, the GPU sampler started; none of that inside a timed step), then
    ``ended(i, seconds, loss)``. Keeps every step's time, the timed ones in ms, the losses and,
    for DeepCompile, torch's compile counters around the first step and the re-plan."""

    def __init__(self, variant: str, total: int, first_timed: int, deepcompile: bool,
                 on_gpu: bool, conditions: GpuConditions, turns: Optional[Turns] = None) -> None:
        self.turns = turns
        self.variant, self.total, self.first_timed = variant, total, first_timed
        self.deepcompile, self.on_gpu, self.conditions = deepcompile, on_gpu, conditions
        self.all_steps: List[float] = []
        self.times: List[float] = []
        self.losses: List[float] = []
        self.compile_marks: Dict[str, Dict[str, float]] = {}
        self.graphs: List[Optional[int]] = []  # Dynamo's graph count after each step (DeepCompile)
        self.compiled_before: Dict[str, float] = {}
        self.marks: Dict[str, float] = {}  # compile_to_first_step_s, wall_to_last_step_s
        self._t0 = 0.0
        # Host time per timed step inside the engine's forward / backward / step and in
        # Python's garbage collector (see watch()), and the collections by generation.
        self._current: Dict[str, float] = {}
        self._timed = False  # whether the step running now is a timed one
        self.host: Dict[str, List[float]] = {}
        self.gc_collections = [0, 0, 0]
        self._unwatch: List[Callable[[], None]] = []

    def watch(self, engine: Any) -> None:
        """Adds up, per step, the host time spent in ``engine``'s forward, backward and step
        calls (the engine instance's own attributes: whoever calls them, our loop or a
        trainer's) and in garbage collection; the rest of a step is the loop's own."""
        for name in ("forward", "backward", "step"):
            inner = getattr(engine, name)

            def timed(*a: Any, _inner: Callable = inner, _name: str = name, **k: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    self._add(_name, time.perf_counter() - start)

            setattr(engine, name, timed)
            self._unwatch.append(lambda name=name: engine.__dict__.pop(name, None))

        def collected(generation: int, seconds: float) -> None:
            self._add("gc", seconds)
            if self._timed:
                self.gc_collections[generation] += 1

        self._unwatch.append(GcClock(collected).start().stop)

    def unwatch(self) -> None:
        while self._unwatch:
            self._unwatch.pop()()

    def _add(self, name: str, seconds: float) -> None:
        self._current[name] = self._current.get(name, 0.0) + seconds

    def host_ms(self) -> Optional[Dict[str, float]]:
        """Median host ms per timed step in each part (``other``: the step's time outside the
        engine's calls, garbage collection there included)."""
        if not self.host:
            return None
        out = {k: statistics.median(v) for k, v in sorted(self.host.items())}
        out["gc_collections_by_generation"] = list(self.gc_collections)  # type: ignore[assignment]
        return out

    def begin(self) -> None:
        self._t0 = time.perf_counter()
        self.compiled_before = compile_seconds() if self.deepcompile else {}

    def _drain(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def ready(self, i: int) -> None:
        self._current = {}
        self._timed = i >= self.first_timed
        if i != self.first_timed:
            return
        if self.turns is not None:  # both loops drained the device at the end of the last step
            self.turns.take()
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.conditions.start()

    def ended(self, i: int, elapsed: float, loss: Optional[float]) -> None:
        self.all_steps.append(elapsed)
        if loss is not None:
            self.losses.append(loss)
        if i == 0:
            self.marks["compile_to_first_step_s"] = time.perf_counter() - self._t0
        if self.deepcompile:
            self.graphs.append(dynamo_graphs())
        if self.deepcompile and i in (0, 4, 5):  # the first step, the re-plan's (6th) either side
            self.compile_marks[str(i)] = compile_seconds()
        if self.deepcompile and i == self.total - 1:
            self.compile_marks["last"] = compile_seconds()
        if i >= self.first_timed:
            self.times.append(elapsed * 1e3)
            if self.turns is not None:
                self.turns.step_done(self.total - 1 - i, self._drain)
            if self._unwatch:
                parts = {k: self._current.get(k, 0.0) * 1e3
                         for k in ("forward", "backward", "step", "gc")}
                parts["other"] = elapsed * 1e3 - parts["forward"] - parts["backward"] - parts["step"]
                for k, v in parts.items():
                    self.host.setdefault(k, []).append(v)
        if i == self.total - 1:
            self.marks["wall_to_last_step_s"] = time.perf_counter() - self._t0
        log.info("%s step %d/%d: %.1f ms%s%s", self.variant, i + 1, self.total, elapsed * 1e3,
                 "" if loss is None else f", loss {loss:.4f}",
                 "" if i >= self.first_timed else " (warm-up)")


class _Batches:
    """Our loop's batches, one per :meth:`next` call: random token ids (seeded per rank) of
    ``micro_batch`` rows of ``--seq`` tokens, or of a length drawn per step (``--lengths``: from
    ``LENGTHS_SEED``, the same on every rank); ``--pad-rows`` pads the rows after the first as a
    collator does. Keeps each batch's length, its positions (``tokens``: micro-batch x length x
    world size) and its real tokens (this rank's, x world size)."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        import torch

        self.micro_batch, self.seq, self.world_size = args.micro_batch, args.seq, world_size
        self.spec: Optional[LengthSpec] = getattr(args, "lengths", None)
        self.pad_rows = bool(getattr(args, "pad_rows", False))
        self.vocab = SIZES[args.size]["vocab_size"]
        self._ids = torch.Generator().manual_seed(1000 + rank)
        self._lengths = random.Random(LENGTHS_SEED)
        self._rows = random.Random(LENGTHS_SEED + 1)  # the padded rows' real lengths
        self.lengths: List[int] = []
        self.tokens: List[int] = []
        self.real_tokens: List[int] = []

    def next(self, device: Any) -> Dict[str, Any]:
        import torch

        length = self.seq if self.spec is None else self._lengths.choice(self.spec.values)
        ids = torch.randint(0, self.vocab, (self.micro_batch, length), generator=self._ids)
        real = ids.numel()
        if self.pad_rows:
            mask = torch.ones_like(ids)
            for row in range(1, self.micro_batch):
                mask[row, self._rows.randint(max(1, length // 2), length):] = 0
            ids = ids.masked_fill(mask == 0, 0)
            batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                     "labels": ids.masked_fill(mask == 0, -100).to(device)}
            real = int(mask.sum())
        else:
            ids = ids.to(device)
            batch = {"input_ids": ids, "labels": ids}  # one tensor, as the model's labels
        self.lengths.append(length)
        self.tokens.append(self.micro_batch * length * self.world_size)
        self.real_tokens.append(real * self.world_size)
        return batch


def _peer_recipe(spec: Variant, model: Any, device: Any) -> Any:
    """``model`` as a peer variant runs it, its checkpointing already set (transformers' own,
    inside each decoder layer's ``forward``, as accelerate and TRL users get it). ``fsdp2``: each
    decoder layer ``.compile()``d (``compile == "layers"``), then ``fully_shard`` on each decoder
    layer and on the root over every rank. ``compile == "model"``: the whole model
    ``torch.compile``d. Where Dynamo cannot trace a checkpointed layer (a graph break inside
    the checkpoint), that layer runs eagerly: the record's ``dynamo`` counts say what compiled."""
    import torch

    if spec.framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        if not layers:
            raise RuntimeError(f"{spec.name}: the model has no *DecoderLayer module")
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in layers:
            if spec.compile == "layers":
                layer.compile()
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if spec.compile == "model":
        model = torch.compile(model)
    return model


def _own_loop(args: argparse.Namespace, model: Any, config: Dict[str, Any], device: Any,
              clock: _StepClock, batches: _Batches) -> "tuple[Any, Callable[[], float]]":
    """Our loop: ``engine(...)``, ``engine.backward``, ``engine.step`` (or plain PyTorch with
    AdamW for ``plain``) on ``batches``; returns the engine (None for ``plain``) and the step
    function."""
    import torch

    def phase(name: str) -> Any:
        # A host span the profiler records (--trace: bench.trace_breakdown's device_idle splits
        # the device's waits by phase); without a profiler it costs a few microseconds.
        return torch.profiler.record_function(PHASE_PREFIX + name)

    spec = VARIANT_BY_NAME[args.variant]
    if spec.framework != "deepspeed":
        model = _peer_recipe(spec, model, device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def forward_backward(batch: Dict[str, Any]) -> Any:
            with phase("forward"):
                loss = model(**batch).loss
            with phase("backward"):
                loss.backward()
            with phase("optimizer_step"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return loss

        engine = None
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config)
        clock.watch(engine)

        def forward_backward(batch: Dict[str, Any]) -> Any:
            with phase("forward"):
                loss = engine(**batch).loss
            with phase("backward"):
                engine.backward(loss)
            with phase("optimizer_step"):
                engine.step()
            return loss

    def step() -> float:
        return forward_backward(batches.next(device)).item()  # .item() also waits for the device

    clock.begin()
    if clock.deepcompile:
        engine.compile()
    for i in range(clock.total):
        clock.ready(i)
        start = time.perf_counter()
        loss = step()
        clock.ended(i, time.perf_counter() - start, loss)
    return engine, step


def _trainer_steps(args: argparse.Namespace, model: Any, config: Dict[str, Any], dtype: Any,
                   clock: _StepClock, world_size: int) -> Any:
    """HF Trainer runs the steps (see ``trainer-dc-ckpt`` in the module docstring); a callback
    feeds the clock: a step's time runs from the end of the previous optimizer step (from the
    start of training for the first) to the end of this one, the device drained at each end.
    Returns the DeepSpeed engine Trainer built."""
    import copy
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    vocab, seq = SIZES[args.size]["vocab_size"], args.seq

    class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        """Row i: random token ids drawn from seed i (labels: the inputs, shifted by the model)."""

        def __len__(self) -> int:
            return clock.total * args.micro_batch * world_size

        def __getitem__(self, i: int) -> Dict[str, Any]:
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def drain() -> None:
        if clock.on_gpu:
            torch.cuda.synchronize()

    class Clocked(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.last = 0.0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock.watch(trainer.model_wrapped)  # the engine accelerate built (and compiled)
            drain()
            clock.begin()
            clock.ready(0)
            self.last = time.perf_counter()

        def on_step_end(self, targs: Any, state: Any, *a: Any, **k: Any) -> None:
            drain()
            i = state.global_step - 1
            clock.ended(i, time.perf_counter() - self.last, None)
            clock.ready(i + 1)
            self.last = time.perf_counter()

        def on_log(self, targs: Any, state: Any, control: Any, logs: Optional[Dict] = None,
                   **k: Any) -> None:
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    if not clock.on_gpu:  # DeepSpeed's CPU ranks: accelerate is to use a gloo state
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    with tempfile.TemporaryDirectory(prefix="lora_llama_trainer_") as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=clock.total, per_device_train_batch_size=args.micro_batch,
            learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
            bf16=dtype is torch.bfloat16, deepspeed=copy.deepcopy(config), torch_compile=True,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            dataloader_num_workers=0, disable_tqdm=True, seed=0,
            **({} if clock.on_gpu else {"accelerator_config": {"use_configured_state": True}}))
        trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(),
                          callbacks=[Clocked()])
        trainer.train()
        return trainer.model_wrapped


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Builds the setup, trains the variant's steps, returns the record."""
    _launcher_env()
    import torch

    variant = args.variant
    inductor = apply_inductor_config(args.inductor)
    # Marked at once: a partner that waits for this process learns if it ends before its turn.
    turns = None
    if args.take_turns is not None:
        folder, count, per_turn = args.take_turns
        turns = Turns(folder, count, per_turn=per_turn)
    spec = VARIANT_BY_NAME[variant]
    deepcompile = spec.deepcompile
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if variant in OURS_DC:
        import ds_z3native  # before DeepSpeed builds anything: its loader gets our op

        skip_patches(args.skip_patch)
        ds_z3native.install()
        ds_z3native.configure(**dict(spec.settings))
    import deepspeed

    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        try:  # run as bench/lora_llama.py, its folder is on the path; imported as bench.lora_llama
            from bench.deepcompile_run import cpu_deepspeed
        except ImportError:
            from deepcompile_run import cpu_deepspeed

        cpu_deepspeed()
        device = torch.device("cpu")
    op_load_s = load_upstream_op() if variant in UPSTREAM_DC and args.build_op_first else None
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    if spec.framework == "torch":
        rank, world_size = 0, 1
    else:
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

    record: Dict[str, Any] = {"bench": "lora_llama", "variant": variant, "versions": _versions(),
                              "run": args.run}
    if args.remark:
        record["remark"] = args.remark
    if op_load_s is not None:
        record["upstream_op_load_s"] = op_load_s  # not in any compile time below
    fix_mode = None
    if variant == "ours":
        from ds_z3native.compat.checkpoint_recompute import apply_recompute_fix, applied_mode

        apply_recompute_fix(holds=True)
        fix_mode = applied_mode()
    record["fix"] = fix_mode if variant == "ours" else (
        "ds_z3native.install()" if variant in OURS_DC else None)

    t0 = time.perf_counter()
    model = _build_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s: %.3f B params, %.2f M trainable (LoRA r=%d), built in %.1f s", variant,
             n_params / 1e9, n_trainable / 1e6, args.lora_r, time.perf_counter() - t0)
    zero: Dict[str, Any] = {"stage": 3}
    threshold = (args.persistence_threshold if args.persistence_threshold is not None
                 else PERSISTENCE[args.size])
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if dtype is torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    record["setup"] = {
        "size": args.size, "layers": args.layers,
        "model": {**model_config(args), "params": n_params,
                                     "trainable": n_trainable, "lora_r": args.lora_r,
                                     "lora_targets": "all-linear"},
        "dtype": dtype_name, "micro_batch": args.micro_batch, "seq": args.seq,
        "world_size": world_size, "device": device_name,
        "checkpointing": CHECKPOINTING[variant], "deepcompile": deepcompile,
        "persistence_budget_mb": spec.setting("persistence_budget_mib"),
        "prefetch_budget_mb": spec.setting("prefetch_budget_mib"),
        "group_persistent": spec.setting("group_persistent", True) if spec.op == "ours" else None,
        "single_cycle": spec.setting("single_cycle", False) if spec.op == "ours" else None,
        "group_reduce": spec.setting("group_reduce", True) if spec.op == "ours" else None,
        "framework": spec.framework, "compile": spec.compile,
        "zero": 3 if spec.framework == "deepspeed" else None,
        "deepspeed_config": config if spec.framework == "deepspeed" else None,
        "loop": "transformers.Trainer" if variant in TRAINER else "own",
        # Per step: a length drawn from these (varlen) or --seq; rows full or collator-padded.
        "lengths": args.lengths.record() if args.lengths is not None else None,
        "rows": "padded" if args.pad_rows else "full",
    }
    if inductor:
        record["setup"]["inductor"] = inductor
    if args.skip_patch:
        record["setup"]["skipped_patches"] = list(args.skip_patch)
    if deepcompile and args.dc_steps < 7:
        raise SystemExit("--dc-steps must be >= 7: DeepCompile re-plans at its 6th step and the "
                         "steps after it are the timed ones")
    total = args.dc_steps if deepcompile else args.warmup + args.steps
    first_timed = 6 if deepcompile else args.warmup  # DeepCompile re-plans at its 6th step
    # GPU clocks, throttling and neighbours over the timed steps; its queries before the clock.
    conditions = GpuConditions(device.index if on_gpu else None)
    conditions.prepare()
    if turns is not None and world_size != 1:
        raise SystemExit(f"--take-turns runs processes of world size 1 (each on its own); "
                         f"this one has {world_size} ranks")
    clock = _StepClock(variant, total, first_timed, deepcompile, on_gpu, conditions, turns)
    batches = _Batches(args, rank, world_size)
    step: Optional[Callable[[], float]] = None  # one more step, for --trace and instrumenting
    try:
        if variant in TRAINER:
            engine = _trainer_steps(args, model, config, dtype, clock, world_size)
        else:
            engine, step = _own_loop(args, model, config, device, clock, batches)
    finally:  # a failed step too: no sampler left running, no wrapper or gc callback left
        record["gpu_conditions"] = conditions.stop()
        clock.unwatch()
    record["host_ms"] = clock.host_ms()
    record.update(clock.marks)
    all_steps, losses, times, compile_marks = (clock.all_steps, clock.losses, clock.times,
                                               clock.compile_marks)
    record["step_s_all"] = all_steps
    if spec.compile:
        import torch._dynamo.utils

        # What torch.compile made of the peer's model: a checkpointed layer Dynamo could not
        # trace (a graph break inside the checkpoint) ran eagerly, and compiled nothing.
        dynamo = torch._dynamo.utils.counters
        record["dynamo"] = {"unique_graphs": int(dynamo["stats"]["unique_graphs"]),
                            "graph_breaks": int(sum(dynamo["graph_break"].values()))}
    if deepcompile:
        record["replan_step_s"] = all_steps[5] if len(all_steps) > 5 else None
        # Where the compile time went (torch's counters): to the end of step 1, and in the re-plan.
        record["compile_seconds"] = {
            "first_step": _compile_window(clock.compiled_before, compile_marks["0"]),
            "replan": _compile_window(compile_marks["4"], compile_marks["5"]),
            "to_last_step": _compile_total(clock.compiled_before, compile_marks["4"],
                                           compile_marks["last"])}
        record["compile_counters"] = compile_counters()
        record["deepcompile_pass_seconds"] = deepcompile_pass_seconds()
        import torch._dynamo.utils

        record["graph_breaks"] = int(sum(torch._dynamo.utils.counters["graph_break"].values()))
        # Compiles: Dynamo's graphs in all, after each step, and the steps that compiled one.
        graphs = clock.graphs
        record["dynamo_graphs"] = graphs[-1] if graphs else None
        record["dynamo_graphs_by_step"] = graphs
        record["compile_steps"] = [i for i, n in enumerate(graphs)
                                   if n is not None and n > (graphs[i - 1] if i else 0)]
        record["deepcompile_compiles"] = deepcompile_compiles(record["deepcompile_pass_seconds"])
        # Whether a warm cache could help: inductor's FX-graph and AOTAutograd cache outcomes.
        record["compile_caches"] = {
            k: int(v) for k, v in sorted(torch._dynamo.utils.counters["inductor"].items())
            if k.startswith(("fxgraph_cache", "aot_autograd_cache"))} or None
        record["compile_caches_aot"] = {
            k: int(v) for k, v in sorted(torch._dynamo.utils.counters["aot_autograd"].items())
            if "cache" in k} or None
        if variant in OURS_DC:
            import ds_z3native

            # What the patches did (ds_z3native.run_state): graphs compiled without inductor's
            # FX-graph cache and why; profiles kept (dc) and replayed (dc-warm); re-plans whose
            # kept-gathered params were chosen early and grouped; a single cycle's graphs compiled
            # again grouped; gradients reaching the reduction in groups; end_backward calls
            # retyped and attention calls unwrapped; a run started from the store (dc-warm).
            counters = ds_z3native.stats()
            for part in ("compile_cache_bypasses", "profile_store", "persistent_group",
                         "single_cycle_regroup", "reduce_group", "inductor_calls", "warm_start"):
                record[part] = counters[part]
            record["persistence"] = dict(ds_z3native.native().persistence_info())
            # Reduce-bucket memory at its most (bytes): sized to the trainable gradients.
            record["reduce_bucket_bytes"] = int(
                ds_z3native.native().comm_stats().get("reduce_bucket_bytes", -1))
    if record["fix"] == "ds_z3native.install()":
        import ds_z3native

        # The optimizer steps' gradient norms: over one span of the buffer, or DeepSpeed's loop.
        record["flat_grad_norm"] = ds_z3native.stats()["flat_grad_norm"]
    record["step_ms"] = {"median": statistics.median(times), "min": min(times),
                         "max": max(times), "n": len(times), "all": times}
    tokens = args.micro_batch * args.seq * world_size
    median_s = record["step_ms"]["median"] / 1e3
    cfg = model_config(args)
    n_matmul = n_params - cfg["vocab_size"] * cfg["hidden_size"]  # minus the input embedding
    # Each step's length and tokens (HF Trainer's batches: --seq, as its data set draws them).
    lengths = batches.lengths[:total] if variant not in TRAINER else [args.seq] * len(all_steps)
    step_tokens = batches.tokens[:total] if variant not in TRAINER else [tokens] * len(all_steps)
    record["step_lengths"], record["step_tokens"] = lengths, step_tokens
    if args.pad_rows:
        record["step_real_tokens"] = batches.real_tokens[:total]
    # Time per token over the timed steps: their time over their tokens (any length mix).
    timed = range(first_timed, len(all_steps))
    record["timed_tokens"] = sum(step_tokens[i] for i in timed)
    record["us_per_token"] = sum(times) * 1e3 / record["timed_tokens"]
    compiled = set(record.get("compile_steps") or ())
    steady = [i for i in timed if i not in compiled]
    record["us_per_token_steady"] = (sum(all_steps[i] for i in steady) * 1e6
                                     / sum(step_tokens[i] for i in steady)) if steady else None
    if args.lengths is None:
        record["tokens_per_s"] = tokens / median_s
        flops = model_flops_per_step(n_matmul, cfg["num_hidden_layers"], cfg["hidden_size"],
                                     args.seq, tokens // world_size)
        record["tflops"] = flops / median_s / 1e12  # per GPU
    else:  # no typical step: the timed steps' tokens and model FLOPs over their time
        timed_s = sum(times) / 1e3
        record["tokens_per_s"] = record["timed_tokens"] / timed_s
        flops = sum(model_flops_per_step(n_matmul, cfg["num_hidden_layers"], cfg["hidden_size"],
                                         lengths[i], step_tokens[i] // world_size) for i in timed)
        record["tflops"] = flops / timed_s / 1e12  # per GPU
    peak = _peak_tflops(device_name)
    record["peak_share"] = record["tflops"] / peak if peak else None
    if on_gpu:
        record["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        record["peak_kind"] = "torch.cuda.max_memory_allocated over the timed steps"
    else:
        record["peak_gib"] = _peak_rss_gib()
        record["peak_kind"] = "process peak RSS (ru_maxrss), whole run"
    record["losses"] = losses
    if args.trace is not None and step is not None:
        record["trace"] = trace_steps(step, args.trace, f"{variant}-rank{rank}", on_gpu)
    if step is not None and engine is not None and not deepcompile and not args.no_track_gathered:
        tracker = _GatheredBytes(list(model.parameters()))
        try:
            record["losses_instrumented_step"] = step()
        finally:
            record["gathered_params"] = tracker.close()
    if turns is not None:  # after the traced and instrumented steps: they use the GPU too
        if on_gpu:
            torch.cuda.synchronize()
        turns.give_back()
        record["turns"] = turns.record
    if engine is not None:
        engine.destroy()
    log.info("%s: median %.1f ms (min %.1f, max %.1f), %.0f tokens/s, %.1f TFLOP/s, peak %.2f GiB",
             variant, record["step_ms"]["median"], record["step_ms"]["min"],
             record["step_ms"]["max"], record["tokens_per_s"], record["tflops"], record["peak_gib"])
    if args.lengths is not None or deepcompile:
        log.info("%s: %.2f us per token over %d timed steps (%d tokens; %s without the steps "
                 "that compiled); Dynamo graphs: %s, compiled at steps %s", variant,
                 record["us_per_token"], len(times), record["timed_tokens"],
                 "-" if record["us_per_token_steady"] is None
                 else f"{record['us_per_token_steady']:.2f}",
                 record.get("dynamo_graphs"), [i + 1 for i in record.get("compile_steps") or []])
    host = record["host_ms"]
    if host:
        log.info("%s: host ms per timed step (median): forward %.1f, backward %.1f, step %.1f, "
                 "outside the engine %.1f; garbage collection %.1f (collections by generation "
                 "%s)", variant, host["forward"], host["backward"], host["step"], host["other"],
                 host["gc"], host["gc_collections_by_generation"])
    return record


def trace_steps(step: Callable[[], float], directory: Path, label: str, on_gpu: bool,
                n: int = 2) -> Dict[str, Any]:
    """Runs ``n`` more steps under ``torch.profiler``; writes ``directory/<label>.json`` (a Chrome
    trace) and ``directory/<label>-top.txt`` (ops by self device time, or self CPU time without a
    GPU). Returns the two paths, the number of distinct ops profiled and the per-step
    ``breakdown`` of :mod:`bench.trace_breakdown` (device busy share, launches by kind, host
    time in dc ops and in compiled graphs)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    step_ms = []
    with profile(activities=activities) as prof:
        for _ in range(n):
            start = time.perf_counter()
            with record_function(PHASE_PREFIX + "step"):
                step()  # returns the loss as a Python float: the device has finished the step
            step_ms.append((time.perf_counter() - start) * 1000.0)
    trace = directory / f"{label}.json"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    top = directory / f"{label}-top.txt"
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    top.write_text(averages.table(sort_by=sort_by, row_limit=40) + "\n")
    split = breakdown_file(trace, n, step_ms)
    log.info("%s: profiled %d steps (%.1f ms each under the profiler): %s, %s; device busy %s, "
             "%.0f launches per step, host in dc ops %.1f ms, in compiled graphs' wrapper %.1f ms",
             label, n, split["wall_ms"], trace, top,
             "n/a" if split["device_busy_share"] is None else f"{split['device_busy_share']:.0%}",
             split["launches"]["total"], split["host_ms"]["dc_ops"],
             split["host_ms"]["graph_wrapper"])
    if split["device_idle"] is not None:
        log.info("%s: device idle %.1f ms per step, by the host's phase meanwhile: %s", label,
                 split["device_idle"]["ms"], split["device_idle"]["by_phase"])
    return {"steps": n, "chrome_trace": str(trace), "top_ops": str(top), "ops": len(averages),
            "breakdown": split}


def _comparable_setup(record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What must match for two runs to be compared (None for a run that failed before it)."""
    setup = record.get("setup")
    if not setup:
        return None
    return {k: setup.get(k) for k in ("size", "layers", "world_size", "seq", "micro_batch",
                                      "device")}


def bench_name(world_size: int, varlen: bool = False) -> str:
    """The result's name: ``lora_llama`` on one GPU, ``lora_llama_ws<N>`` on N (one file and one
    table of docs/benchmarks.md per world size); ``lora_llama_varlen`` (``_ws<N>``) for the runs
    of an invocation with varlen variants (their fixed-length baselines at the lengths' mean)."""
    name = "lora_llama_varlen" if varlen else "lora_llama"
    return name if world_size <= 1 else f"{name}_ws{world_size}"


def is_varlen_invocation(variants: Sequence[str]) -> bool:
    """Whether an invocation running ``variants`` is a varlen one (any varlen variant)."""
    return any(v in VARLEN for v in variants)


def _measured(record: Mapping[str, Any]) -> Dict[str, Any]:
    """A run's record without what merging and the suite derive from it (ratios, status)."""
    return {k: v for k, v in record.items() if k not in ("vs", "ratio", "status")}


def _machines(record: Mapping[str, Any], ref: Mapping[str, Any]) -> Optional[int]:
    """How many GPUs two runs' timed steps ran on, from the devices their gpu_conditions name
    (None where either run recorded none: a CPU run, or a record from before they were kept)."""
    def device(r: Mapping[str, Any]) -> Optional[str]:
        return (r.get("gpu_conditions") or {}).get("device") or None
    a, b = device(record), device(ref)
    return None if a is None or b is None else len({a, b})


def _run_key(record: Mapping[str, Any]) -> str:
    """A record's key in a merged file's ``runs``: ``<variant>@<deepspeed version>``."""
    return f"{record['variant']}@{record['versions']['deepspeed']}"


def merge(paths: List[Path], output: Path, beside: Sequence[Path] = ()) -> Dict[str, Any]:
    """Combines per-variant records into ``{"bench": "lora_llama", "runs": {"<variant>@<deepspeed>":
    ...}}`` (``lora_llama_ws<N>`` for runs on N GPUs; existing runs in ``output`` are kept unless
    replaced, and a replaced run moves, with the ratios it had, to the file's ``replaced`` list:
    the numbers the docs cited stay in the JSON), and gives each run its ratios
    to the ``upstream`` (eager, non-reentrant checkpointing) and ``none`` (eager, no
    checkpointing) runs of the newest DeepSpeed in the file: ``speedup`` = baseline step time /
    this step time, ``peak_ratio`` = this peak / baseline peak, ``baseline_ms`` and ``run``
    the baseline's step time and run label. A Trainer-driven run (``trainer-dc-ckpt``) also gets
    ``vs["own_loop"]``: its step time over that of our loop's run of the same variant
    (``dc-ckpt``), DeepSpeed version and invocation (``step_ratio``; 1.0: the trainer costs
    nothing). Every run but ``plain`` also gets ``vs["plain"]`` where its invocation ran
    ``plain`` (PyTorch without ZeRO and without checkpointing, the ceiling): its step time over
    plain's (``step_ratio``; at most 1.0: as fast as unsharded PyTorch) and ``peak_ratio``.
    A varlen run (``dc-ckpt-single-varlen``...) gets ``vs["fixed"]`` instead, against its base
    variant of the same invocation and DeepSpeed, run at the lengths' mean: ``token_time_ratio``
    (its ``us_per_token`` over the base run's; 1.0: varying lengths cost nothing per token) and
    ``steady_ratio`` (the same without the timed steps that compiled); the file is then
    ``lora_llama_varlen`` (``_ws<N>``).
    Each ratio also names ``devices``: on how many GPUs the two runs' timed steps
    ran (2: one invocation's processes landed on two machines; None: not recorded).

    ``beside``: records kept next to the table's runs, in ``replaced``, without taking their
    place (a profiled run, or the own-loop half of a Trainer pair, where the table keeps a run
    with its baseline); they get their ratios too.

    Ratios compare runs of one invocation only (the same ``run`` label; records without one
    count as one run): the baseline is that invocation's record of the baseline variant, a
    table row or one kept beside. A run whose baseline a later invocation replaced keeps the
    ratios it got against its own run's baseline; a run with no baseline of its own run gets
    none."""
    merged: Dict[str, Any] = {"bench": "lora_llama", "runs": {}}
    if output.exists():
        merged = json.loads(output.read_text())

    def check_setup(path: Path, record: Mapping[str, Any], key: str) -> None:
        setup = _comparable_setup(record)
        others = {k: _comparable_setup(r) for k, r in merged["runs"].items() if k != key}
        clash = next(((k, s) for k, s in others.items() if s and setup and s != setup), None)
        if clash is not None:
            raise ValueError(f"{path}: run {key} has setup {setup}, but {output} holds run "
                             f"{clash[0]} with {clash[1]}; one file compares one setup (write "
                             f"this one to another --output)")

    for path in paths:
        record = json.loads(path.read_text())
        key = _run_key(record)
        check_setup(path, record, key)
        old = merged["runs"].get(key)
        if old is not None and _measured(old) != _measured(record):  # not the same file again
            merged.setdefault("replaced", []).append(old)
        merged["runs"][key] = record
    kept_beside: List[Dict[str, Any]] = []
    for path in beside:
        record = json.loads(path.read_text())
        check_setup(path, record, _run_key(record))
        held = list(merged["runs"].values()) + merged.get("replaced", [])
        if any(_measured(r) == _measured(record) for r in held):
            continue  # the same file again
        merged.setdefault("replaced", []).append(record)
        kept_beside.append(record)
    sizes = {(r.get("setup") or {}).get("world_size") for r in merged["runs"].values()} - {None}
    variants = [str(r.get("variant")) for r in merged["runs"].values()]
    name = bench_name(max(sizes, default=1), is_varlen_invocation(variants))
    # An output named after the bench with a suffix (lora_llama_h100.json: runs on another kind
    # of GPU) is a result of its own, with its own table.
    merged["bench"] = output.stem if output.stem.startswith(name + "_") else name

    def usable(r: Mapping[str, Any]) -> bool:
        return "error" not in r and "step_ms" in r

    ok = {k: r for k, r in merged["runs"].items() if usable(r)}
    # Records a ratio may take its baseline from: the table's runs first, then those kept
    # beside them (the newest first), these only with a run label (unlabelled records of
    # ``replaced`` came from several invocations).
    pool = list(ok.values()) + [r for r in reversed(merged.get("replaced", []))
                                if usable(r) and r.get("run") is not None]

    def same_run(variant: str, deepspeed: Optional[str], run: Any) -> Optional[Dict[str, Any]]:
        return next((r for r in pool if r.get("variant") == variant and r.get("run") == run
                     and (r.get("versions") or {}).get("deepspeed") == deepspeed), None)

    targets = list(ok.values()) + [r for r in kept_beside if usable(r)]
    earlier = {id(r): r.pop("vs", None) or {} for r in targets}
    newest = max((k.split("@")[1] for k in ok), default=None,
                 key=lambda v: Version(v).release)
    def ms(r: Mapping[str, Any]) -> float:
        return r["step_ms"]["median"]

    def attach(record: Dict[str, Any], name: str, ref: Optional[Mapping[str, Any]],
               ratios: Callable[[Mapping[str, Any], Mapping[str, Any]], Dict[str, Any]]) -> None:
        """``record["vs"][name]``: ``ratios(record, ref)`` with the baseline's step time, run
        label and GPU count where the record's invocation has the baseline ``ref``; else the
        ratio the record had against its own invocation's baseline, if it had one."""
        run = record.get("run")
        if ref is not None:
            record.setdefault("vs", {})[name] = {
                **ratios(record, ref), "baseline_ms": ms(ref), "run": run,
                "devices": _machines(record, ref)}
            return
        kept = earlier[id(record)].get(name)
        if kept and run is not None and kept.get("run") == run:
            record.setdefault("vs", {})[name] = kept  # against its own run's baseline

    def speedup(r: Mapping[str, Any], ref: Mapping[str, Any]) -> Dict[str, Any]:
        return {"speedup": ms(ref) / ms(r),
                "peak_ratio": r["peak_gib"] / ref["peak_gib"] if ref.get("peak_gib") else None}

    def against_plain(r: Mapping[str, Any], ref: Mapping[str, Any]) -> Dict[str, Any]:
        return {"step_ratio": ms(r) / ms(ref),
                "peak_ratio": (r["peak_gib"] / ref["peak_gib"]
                               if ref.get("peak_gib") and r.get("peak_gib") else None)}

    def per_token(r: Mapping[str, Any], ref: Mapping[str, Any]) -> Dict[str, Any]:
        mine, theirs = r.get("us_per_token"), ref.get("us_per_token")
        steady, theirs_steady = r.get("us_per_token_steady"), ref.get("us_per_token_steady")
        return {"variant": ref["variant"], "baseline_us_per_token": theirs,
                "token_time_ratio": mine / theirs if mine and theirs else None,
                "steady_ratio": steady / theirs_steady if steady and theirs_steady else None}

    for record in targets:
        run = record.get("run")
        fixed = VARLEN.get(record["variant"])
        if fixed is not None:  # against its fixed-length run, per token; no other baseline
            attach(record, "fixed", same_run(fixed, record["versions"]["deepspeed"], run),
                   per_token)
            continue
        for base in ("upstream", "none"):
            attach(record, base, same_run(base, newest, run), speedup)
        attach(record, "plain",
               same_run("plain", newest, run) if record.get("variant") != "plain" else None,
               against_plain)
        own = TRAINER.get(record["variant"])  # a Trainer-driven run against our loop's
        attach(record, "own_loop",
               same_run(own, record["versions"]["deepspeed"], run) if own else None,
               lambda r, ref: {"variant": own, "step_ratio": ms(r) / ms(ref)})
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return merged


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="lora_llama.py merge")
        p.add_argument("inputs", type=Path, nargs="*")
        p.add_argument("--beside", type=Path, nargs="+", default=[], metavar="RECORD",
                       help="records kept next to the table's runs (in 'replaced') without "
                            "taking their place, e.g. a profiled run")
        p.add_argument("--output", type=Path, required=True)
        m = p.parse_args(argv[1:])
        if not m.inputs and not m.beside:
            p.error("name at least one record (as an input or after --beside)")
        merged = merge(m.inputs, m.output, m.beside)
        log.info("wrote %s (%d runs)", m.output, len(merged["runs"]))
        return 0
    args = _parse(argv)
    try:
        record = run(args)
        code = 0
    except NotAvailable as e:  # not a failure: this host has no way to run it
        log.warning("%s: not available: %s", args.variant, e)
        record = {"bench": "lora_llama", "variant": args.variant, "status": "not_available",
                  "reason": str(e), "versions": _versions(), "run": args.run}
        code = 0
    except Exception as e:  # noqa: BLE001 - a failed variant is a result too
        log.error("%s failed: %s", args.variant, e)
        record = {"bench": "lora_llama", "variant": args.variant, "error": traceback.format_exc()}
        try:
            record["versions"] = _versions()
        except Exception:  # noqa: BLE001
            record["versions"] = {"deepspeed": "unknown"}
        code = 1
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        log.info("wrote %s", args.output)
    return code


if __name__ == "__main__":
    sys.exit(main())
