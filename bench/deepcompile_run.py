"""One DeepSpeed training run of a small model with frozen params, reported as JSON.

Used by tests/gpu/test_deepcompile_train.py (one run per process: dynamo, the DeepCompile handle
and the native runtime are process-wide), and by hand for the closing note's timing:

    # ds_z3native's op (install()): time from engine.compile() to the end of the first step
    python bench/deepcompile_run.py --mode deepcompile --native ours
    # DeepSpeed's own op, JIT-built into a fresh extension cache (no install())
    python bench/deepcompile_run.py --mode deepcompile --native deepspeed --fresh-extension-cache

Models (``--model``): ``frozen-linear``, a frozen Linear feeding a trainable one (the minimal
reproduction); ``reuse3``, one frozen Linear applied three times between trainable layers;
``eager-head``, the frozen-linear model whose trainable head runs outside Dynamo
(``torch._dynamo.disable``: a forced eager fallback);
``eager-frozen``, the same with a frozen eager layer before a trainable one;
``eager-frozen-flagged``, that eager layer run with torch's compile-session flag up; ``llama``, an HF
``LlamaForCausalLM`` from a config (``--size``, see ``ds_z3native.models``) with PEFT LoRA on
every linear layer, optionally with gradient checkpointing (``--checkpointing``), with
``--layers N`` decoder layers instead of the size's; ``--family`` builds another transformers
model type at that shape instead (``ds_z3native.models.build_lora_model``).
``--time-scheduler`` times DeepCompile's ZeRO-3 scheduler on each graph with ds_z3native's
requirement walk and with DeepSpeed's own (made to follow keyword inputs too), and checks the two
orders are the same (the result's ``scheduler``).
``--ab-grad-norm`` measures the ``zero3-flat-grad-norm`` patch in one process: even steps take the
optimizer's gradient norms through it, odd steps through DeepSpeed's own per-param loop, each norm
call timed with the device synchronized around it (the result's ``grad_norm_ab``).
``--mode eager`` trains the same model without compile, with ZeRO stage ``--eager-stage``
(default 0: the reference). Under a launcher each rank trains on batches of its own
(``--same-batch-on-every-rank``: rank 0's on every rank). One process, one device; sets the
launcher environment (RANK=0, WORLD_SIZE=1, MASTER_ADDR, a free MASTER_PORT) unless already set.
Without CUDA (or with
``DS_ACCELERATOR=cpu``) it runs on the CPU over gloo: DeepCompile itself runs there with
ds_z3native's CPU build (DeepSpeed >= 0.19.4; its profiler falls back to default estimates).
The result holds the losses, the trainable params after training (and before: ``initial_params``;
every param of the small models), the Dynamo graph-break count, whether ds_z3native was installed
and, with it, what its DeepCompile patches did (hooks removed, eager-fallback gathers).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

log = logging.getLogger("bench.deepcompile_run")

WIDTH = 64
BATCH = 8
_WATCHDOG_OUT = None  # where the watchdog writes (kept open for the process's life)
_GIL_BACKSTOP_S = 60.0  # faulthandler's timer fires this long after the watchdog thread's


def _inductor_arg(text: str) -> "tuple[str, Any]":
    """``NAME=VALUE`` -> (NAME, VALUE as a Python literal, else the text)."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a torch._inductor.config "
                                         f"setting), got {text!r}")
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name.strip(), value


def add_inductor_option(parser: argparse.ArgumentParser, kept_in: str) -> None:
    """``--inductor NAME=VALUE`` (repeatable, into ``args.inductor``); ``kept_in`` says where the
    run's output keeps what was set."""
    parser.add_argument("--inductor", type=_inductor_arg, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="set torch._inductor.config.NAME (dotted: triton.cudagraphs) to VALUE "
                             "(a Python literal, else the text) before anything compiles; "
                             f"repeatable; kept in {kept_in}")


def add_skip_patch_option(parser: argparse.ArgumentParser, kept_in: str) -> None:
    """``--skip-patch NAME`` (repeatable, into ``args.skip_patch``); ``kept_in`` says where the
    run's output keeps it."""
    parser.add_argument("--skip-patch", action="append", default=[], metavar="NAME",
                        help="with ds_z3native: leave this compat patch out (repeatable), e.g. "
                             f"deepcompile-attention-rng; kept in {kept_in}")


def skip_patches(names: Sequence[str]) -> None:
    """Make ``ds_z3native.install()`` in this process leave the patches ``names`` out (before it
    runs). A name no patch has raises ValueError naming it and the known ones."""
    if not names:
        return
    from ds_z3native.compat import registry

    every = registry.all_patches
    known = {p.name for p in every()}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"--skip-patch {', '.join(unknown)}: no such ds_z3native patch (known: "
                         f"{', '.join(sorted(known))})")
    registry.all_patches = lambda: [p for p in every() if p.name not in names]


def apply_inductor_config(settings: Sequence["tuple[str, Any]"]) -> Dict[str, Any]:
    """Sets each ``torch._inductor.config`` NAME (dotted for a sub-config) to its value; returns
    what each reads back. An unknown name raises ValueError naming it."""
    from torch._inductor import config

    applied: Dict[str, Any] = {}
    for name, value in settings:
        *path, last = name.split(".")
        target: Any = config
        try:
            for part in path:
                target = getattr(target, part)
            getattr(target, last)
            setattr(target, last, value)
        except AttributeError:
            raise ValueError(f"--inductor {name}={value!r}: torch._inductor.config has no "
                             f"setting {name!r}") from None
        applied[name] = getattr(target, last)
    return applied


def deepcompile_pass_seconds() -> Optional[List[Dict[str, Any]]]:
    """DeepCompile's own timing of each graph's passes (``deepspeed.compile.backend``'s
    ``opt_pass_times``), in the order they ran: per forward or backward graph compiled, the
    seconds its compiler spent in DeepSpeed's passes, their profiling runs and the scheduler
    (the part of AOTAutograd's time that is DeepCompile's). None where DeepSpeed keeps none."""
    backend = sys.modules.get("deepspeed.compile.backend")
    times = getattr(backend, "opt_pass_times", None)
    if times is None:
        return None
    return [{"graph": int(index), "direction": str(kind), "s": round(float(seconds), 3)}
            for kind, index, _graph_id, seconds in times]


class GcClock:
    """Counts the process's garbage collections and the seconds they take (``gc.callbacks``),
    per generation, from :meth:`start` to :meth:`stop`; ``on_collection(generation, seconds)``,
    if given, hears of each one as it ends."""

    def __init__(self, on_collection: Optional[Callable[[int, float], None]] = None) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._on_collection = on_collection
        self._began: Optional[float] = None

    def _callback(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            generation = int(info.get("generation", 2))
            seconds = time.perf_counter() - self._began
            self.seconds[generation] += seconds
            self.count[generation] += 1
            self._began = None
            if self._on_collection is not None:
                self._on_collection(generation, seconds)

    def start(self) -> "GcClock":
        import gc

        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        import gc

        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def record(self) -> Dict[str, Any]:
        """Collections and seconds per generation, and the seconds of all."""
        return {"count": list(self.count), "s": [round(x, 3) for x in self.seconds],
                "total_s": round(sum(self.seconds), 3)}


def arm_watchdog(seconds: float) -> None:
    """Past ``seconds``, print every thread's stack to stderr and exit with 1 (a hang becomes a
    diagnosable failure). The dump goes to a copy of the stderr descriptor taken now: libraries
    point fd 2 elsewhere for a while (DeepSpeed's op builder compiles a probe program with fd 2
    sent to a temporary file), and a dump written then would be lost.

    The dump is taken by a Python thread holding the GIL (``sys._current_frames``), the main
    thread's stack first: no other thread runs Python code while it reads the frames.
    faulthandler's own timer, which reads the other threads' frames while they run and can crash
    doing so (twice in CI: rc -11, once before the first frame was printed), is only the
    backstop for a hang that never releases the GIL, ``_GIL_BACKSTOP_S`` later."""
    global _WATCHDOG_OUT
    _WATCHDOG_OUT = os.fdopen(os.dup(sys.stderr.fileno()), "w")
    faulthandler.dump_traceback_later(seconds + _GIL_BACKSTOP_S, exit=True, file=_WATCHDOG_OUT)
    threading.Thread(target=_watchdog, args=(seconds, _WATCHDOG_OUT), name="bench-watchdog",
                     daemon=True).start()


def _watchdog(seconds: float, out: Any) -> None:
    time.sleep(seconds)
    me, main = threading.get_ident(), threading.main_thread().ident
    # Every stack first, without reading source files (no I/O, so the GIL is not let go
    # between threads and the stacks are one snapshot), newest frame first, at most 100.
    stacks = {ident: traceback.StackSummary.extract(traceback.walk_stack(frame), limit=100,
                                                    lookup_lines=False)
              for ident, frame in sys._current_frames().items() if ident != me}
    # faulthandler's format (a header, then each thread's frames), so readers of either dump
    # parse both.
    lines = [f"Timeout ({datetime.timedelta(seconds=round(seconds))})!"]
    for ident in sorted(stacks, key=lambda i: i != main):
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in stacks[ident]]
        lines.append("")
    out.write("\n".join(lines) + "\n")
    out.flush()
    os._exit(1)


def _launcher_env() -> None:
    # One process without a launcher: rank 0 of 1; what a launcher set stays.
    from ds_z3native._net import free_port
    from ds_z3native.launch import rank_env

    port = os.environ.get("MASTER_PORT") or str(free_port())
    for key, value in rank_env(0, 1, int(port)).items():
        os.environ.setdefault(key, value)


def build_model(kind: str) -> Any:
    import torch
    from torch import nn

    class FrozenLinear(nn.Module):
        """A frozen Linear feeding a trainable one."""

        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = self.head(torch.relu(self.frozen(x)))
            return nn.functional.mse_loss(out.float(), y.float())

    class Reuse3(nn.Module):
        """One frozen Linear used three times in forward."""

        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.mid1 = nn.Linear(WIDTH, WIDTH)
            self.mid2 = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.mid1(self.frozen(x)))
            h = torch.tanh(self.mid2(self.frozen(h)))
            out = self.head(torch.relu(self.frozen(h)))
            return nn.functional.mse_loss(out.float(), y.float())

    class EagerHead(FrozenLinear):
        """The frozen-linear model whose trainable head Dynamo must not compile: the head always runs
        eagerly, between compiled graphs (an eager fallback after a graph break)."""

        def __init__(self) -> None:
            super().__init__()
            self.head.forward = torch._dynamo.disable(self.head.forward)

    class EagerFrozen(nn.Module):
        """A frozen Linear that runs eagerly (outside Dynamo), feeding a trainable compiled one;
        its weight is needed again in backward for the input gradient of ``pre``."""

        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(WIDTH, WIDTH)
            self.frozen = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, 16)
            self.frozen.requires_grad_(False)
            self.frozen.forward = torch._dynamo.disable(self.frozen.forward)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = self.head(torch.relu(self.frozen(torch.tanh(self.pre(x)))))
            return nn.functional.mse_loss(out.float(), y.float())

    class EagerFrozenFlagged(EagerFrozen):
        """``EagerFrozen`` whose eager frozen layer runs with ``torch.compiler.is_compiling()``
        True, as torch raises it for a whole compile session (backends included), not only while
        Dynamo traces: the layer is still eager and needs the gathered weight."""

        def __init__(self) -> None:
            super().__init__()
            eager = self.frozen.forward

            def forward_with_compiling_flag(*args: Any, **kwargs: Any) -> Any:
                with compiling_flag():
                    return eager(*args, **kwargs)

            self.frozen.forward = torch._dynamo.disable(forward_with_compiling_flag)

    return {"frozen-linear": FrozenLinear, "reuse3": Reuse3, "eager-head": EagerHead,
            "eager-frozen": EagerFrozen, "eager-frozen-flagged": EagerFrozenFlagged}[kind]()


@contextlib.contextmanager
def compiling_flag() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` reads True inside (torch's own compile-session context
    where the release has one, else its flag set and restored)."""
    import torch

    compile_session = getattr(torch.compiler, "_compile_session_context", None)
    if compile_session is not None:
        with compile_session():
            yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def model_size(name: str, layers: Optional[int] = None) -> Any:
    """The ``ds_z3native.models`` size ``name``, with ``layers`` decoder layers if given."""
    import dataclasses

    from ds_z3native.models import MODEL_SIZES

    size = MODEL_SIZES[name]
    if layers is None:
        return size
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    return dataclasses.replace(size, layers=layers)


def build_llama(size: Any, checkpointing: str, family: str = "llama") -> Any:
    """The LoRA model of ``ds_z3native.models`` at ``size`` (a ``ModelSize``): a Llama, or
    another transformers decoder family (``build_lora_model``), with gradient checkpointing
    ``checkpointing`` (``none``, ``non-reentrant``, ``reentrant``) enabled the HF way."""
    from ds_z3native.models import build_lora_model

    model, _ = build_lora_model(size, family)
    if checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return model


def data_rank(same_batch_on_every_rank: bool = False) -> int:
    """The rank whose batches this process trains on: its own (``RANK``), so that a reduction
    that skipped its collective shows in the result; 0 with ``same_batch_on_every_rank`` (every
    rank the batches of one process)."""
    return 0 if same_batch_on_every_rank else int(os.environ.get("RANK", "0"))


def _llama_batch(size: Any, step: int, seed: int, device: Any,
                 lengths: Optional[List[int]] = None, rank: int = 0) -> Dict[str, Any]:
    """The llama's keyword inputs for one step of rank ``rank``: ``input_ids`` and ``labels`` of
    the size's sequence length; with ``lengths``, a batch padded to ``lengths[step % len(lengths)]``
    as ``DataCollatorWithPadding`` pads (each row after the first shorter by a few tokens: pad id 0,
    ``attention_mask`` 0 and ``labels`` -100 there)."""
    import dataclasses

    import torch

    from ds_z3native.models import synthetic_batch

    if not lengths:
        ids = synthetic_batch(size, step, rank, seed).to(device)
        return {"input_ids": ids, "labels": ids}
    length = lengths[step % len(lengths)]
    ids = synthetic_batch(dataclasses.replace(size, seq_len=length), step, rank, seed)
    mask = torch.ones_like(ids)
    for row in range(1, ids.shape[0]):
        mask[row, max(1, length - row - step % 3):] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu"


def cpu_deepspeed() -> None:
    """DeepSpeed on the CPU accelerator without a JIT build of its shared-memory comm op.
    DeepCompile's passes also need a device string they can parse, which ``install()``'s
    ``deepcompile-cpu-device`` patch gives them (from DeepSpeed 0.19.3 its profiler then falls back
    to default estimates; 0.19.0 - 0.19.2's needs CUDA events, and with host stand-ins it
    deadlocks in its own gloo all_reduce under the Python dispatcher, seen with torch 2.13, so
    DeepCompile on the CPU starts at 0.19.4: on 0.19.3 DeepSpeed's own eager-fallback getter
    gathers a frozen param between Dynamo's guard building and checking)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _evaluate(engine: Any, args: Any, size: Any, dtype: Any, device: Any, step: int) -> float:
    """The mean loss of two evaluation forwards (eval mode, no_grad), then back to training;
    ``size`` is the llama's ``ModelSize``, None for the other models."""
    import torch

    rank = data_rank(args.same_batch_on_every_rank)
    engine.eval()
    losses = []
    with torch.no_grad():
        for i in range(2):
            if size is not None:
                batch = _llama_batch(size, 10**6 + 2 * step + i, args.seed, device, args.lengths,
                                     rank)
                losses.append(float(engine(**batch).loss.float()))
            else:
                losses.append(float(engine(*_batch(10**6 + 2 * step + i, args.seed, dtype, device,
                                                   rank))))
    engine.train()
    return sum(losses) / len(losses)


def _generate(engine: Any, args: Any, size: Any, device: Any, step: int) -> List[List[int]]:
    """Greedy generation of 4 tokens after an 8-token prompt through the engine's model
    (``engine.module.generate``, as an evaluation callback calls it: outside the engine's
    forward); the prompt and the new tokens."""
    import torch

    ids = _llama_batch(size, 2 * 10**6 + step, args.seed, device,
                       rank=data_rank(args.same_batch_on_every_rank))["input_ids"]
    with torch.no_grad():
        out = engine.module.generate(input_ids=ids[:1, :8], max_new_tokens=4, do_sample=False,
                                     pad_token_id=0)
    return out.tolist()


def _batch(step: int, seed: int, dtype: Any, device: Any, rank: int = 0) -> List[Any]:
    """Inputs and targets of the small models for one step of rank ``rank``."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step + 1_000_003 * rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, 16, generator=g)
    return [x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)]


def gathered_at_end(engine: Any) -> Optional[Dict[str, Any]]:
    """What the native runtime holds gathered after training: the params whose full copy is
    still there (kept persistent), their padded bytes (world size x shard; on one rank a copy may
    be the shard's own memory), and its record of the persistence budget
    (``persistence_info``). None without a live runtime."""
    import ds_z3native
    import torch.distributed as dist

    m = ds_z3native.native()
    if not m.is_initialized():
        return None
    ws = dist.get_world_size() if dist.is_initialized() else 1
    params, nbytes = 0, 0
    for p in engine.module.parameters():
        if not hasattr(p, "ds_id"):
            continue
        try:
            state = m.param_state(p.ds_id)
        except RuntimeError:  # a param DeepCompile never registered (outside its graphs)
            continue
        if state["gathered"]:
            params += 1
            nbytes += state["shard_numel"] * ws * p.ds_tensor.element_size()
    return {"params": params, "bytes": nbytes, "persistence": dict(m.persistence_info())}


def _trainable_params(engine: Any, gathered: bool) -> Dict[str, List[float]]:
    import deepspeed

    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=gathered):
        return {n: p.detach().float().cpu().flatten().tolist() for n, p in params}


def run(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    """Train as ``args`` say, filling ``result`` as it goes (so a failure keeps what ran)."""
    _launcher_env()
    if args.fresh_extension_cache:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="ds_ext_")
    import torch

    cpu = _on_cpu()
    if cpu:
        cpu_deepspeed()
    # fp32 comparisons must not run matmuls in TF32 on one side only.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import deepspeed
    from torch._dynamo.utils import counters

    result.update(deepspeed=deepspeed.__version__, torch=torch.__version__, losses=[], eval_losses=[],
                  generated=[], device="cpu" if cpu else torch.cuda.get_device_name())
    if args.native == "ours":
        import ds_z3native

        if args.no_deepspeed_fallback:
            # The fallback is turned off (its method replaced): nothing for the patch of its walks.
            args.skip_patch = [*args.skip_patch, "deepcompile-z3-fallback-module-list"]
        skip_patches(args.skip_patch)
        if args.no_deepspeed_fallback:
            _disable_deepspeed_eager_fallback()
        result["install"] = ds_z3native.install().__dict__
        if args.no_group_persistent:
            ds_z3native.set_group_persistent(False)
        if args.no_group_reduce:
            ds_z3native.set_group_reduce(False)
        if args.single_cycle:
            ds_z3native.set_single_cycle(True)
    if args.inductor:
        result["inductor"] = apply_inductor_config(args.inductor)
    if args.time_scheduler:
        result["scheduler"] = []
        time_scheduler(result["scheduler"])
    bf16, fp16 = args.dtype == "bf16", args.dtype == "fp16"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, torch.float32)
    if args.sdpa_backend != "default":
        result["sdpa_backend"] = only_sdpa_backend(args.sdpa_backend)
    deepcompile = args.mode == "deepcompile"
    llama = args.model == "llama"
    stage = 3 if deepcompile else args.eager_stage
    zero: Dict[str, Any] = {"stage": stage}
    batch = BATCH
    size = model_size(args.size, args.layers) if llama else None
    if llama:
        from ds_z3native.models import zero3_auto_values

        batch = size.batch
        if stage == 3:
            zero.update(zero3_auto_values(size.hidden))
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    if fp16:  # dynamic loss scaling, as users run fp16
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    if deepcompile:
        config["compile"] = {"deepcompile": True}

    torch.manual_seed(args.seed)
    model = build_llama(size, args.checkpointing, args.family) if llama else build_model(args.model)
    if llama and args.attn_implementation:
        # transformers picks the attention function from the config at every forward.
        model.config._attn_implementation = args.attn_implementation
    # What training moves the params from (the same set as ``params`` below), before
    # deepspeed.initialize partitions them.
    result["initial_params"] = {n: p.detach().float().cpu().flatten().tolist()
                                for n, p in model.named_parameters() if p.requires_grad or not llama}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    device = engine.device
    gc_clock = GcClock().start()
    t_compile = time.perf_counter()
    if deepcompile:
        engine.compile()
    if args.persist_all:
        # After install(), which checks that DeepSpeed's pass is its own, and after compile(),
        # whose pass schedule keeps DeepSpeed's pass.
        _persist_all_when_chosen_early()
    step_times: List[float] = []
    rank = data_rank(args.same_batch_on_every_rank)
    norm_ab = _GradNormAB(result, cpu) if args.ab_grad_norm else None
    for step in range(args.steps):
        if norm_ab is not None:
            norm_ab.per_param = step % 2 == 1
        if args.unfreeze_after is not None and step == args.unfreeze_after:
            engine.module.frozen.requires_grad_(True)
            result["unfrozen_at_step"] = step
        profiler = None
        if args.count_ops and step == args.steps - 1:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        t0 = time.perf_counter()
        if llama:
            loss = engine(**_llama_batch(size, step, args.seed, device, args.lengths, rank)).loss
        else:
            x, y = _batch(step, args.seed, dtype, device, rank)
            loss = engine(x, y)
        if args.eval_between:
            # An evaluation forward between a training forward and its backward.
            with torch.no_grad():
                if llama:
                    engine(input_ids=_llama_batch(size, step + 10**6, args.seed, device,
                                                  args.lengths, rank)["input_ids"])
                else:
                    engine(*_batch(step + 10**6, args.seed, dtype, device, rank))
        engine.backward(loss)
        engine.step()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            result["op_calls_last_step"] = _op_calls(profiler)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            result["eval_losses"].append(_evaluate(engine, args, size, dtype, device, step))
        if args.generate_every and (step + 1) % args.generate_every == 0:
            result["generated"].append(_generate(engine, args, size, device, step))
        if not cpu:
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_times.append(now - t0)
        if step == 0:
            result["compile_to_first_step_end_s"] = now - t_compile
        result["losses"].append(float(loss.detach().float().item()))
        result["step_s"] = step_times
        log.info("step %d/%d: loss %.5f, %.3f s", step + 1, args.steps, result["losses"][-1],
                 step_times[-1])
    result["deepcompile_pass_seconds"] = deepcompile_pass_seconds()
    gc_clock.stop()
    result["gc_collections"] = gc_clock.record()
    result["step_ms_after_warmup"] = (1000 * sum(step_times[6:]) / max(1, len(step_times[6:])))
    if norm_ab is not None:
        norm_ab.finish(step_times)
    result["graph_breaks"] = int(sum(counters["graph_break"].values()))
    # Graphs Dynamo compiled (each one a DeepCompile compile and profile), re-plans included.
    result["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    result["graph_break_reasons"] = sorted({k.splitlines()[0] for k in counters["graph_break"]})
    result["graph_break_fixes"] = getattr(engine, "_ds_z3native_graph_break_fixes", None)
    # Inductor's FX-graph cache outcomes: whether a warm cache directory served the graphs.
    result["compile_caches"] = {k: int(v) for k, v in sorted(counters["inductor"].items())
                                if k.startswith("fxgraph_cache")}
    # Inductor's CUDA-graph counters (with --inductor triton.cudagraphs=True): graphs it skipped,
    # graphs it split at the ops it must not record (partitions), inputs it copies in.
    result["cudagraphs"] = {k: int(v) for k, v in sorted(counters["inductor"].items())
                            if k.startswith("cudagraph")}
    if args.native == "ours":
        import ds_z3native
        from ds_z3native.compat.deepcompile_eager import eager_gather_of

        # Every patch's counters (ds_z3native.run_state), each under its part's name.
        result.update(ds_z3native.stats())

        result["gathered_at_end"] = gathered_at_end(engine) if deepcompile else None

        gather = eager_gather_of(engine)
        result["eager_gather"] = None if gather is None else {
            "params": gather.eager_params, "gathered_total": gather.gathered_total,
            "held_after_training": gather.held(), "deferred_partitions": gather.deferred_partitions,
            "generations": gather.generations}
    gathered = stage == 3
    if llama:
        result["params"] = _trainable_params(engine, gathered)
    else:
        params = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=gathered):
            result["params"] = {n: p.detach().float().cpu().flatten().tolist() for n, p in params}
    result["requires_grad"] = {n: p.requires_grad for n, p in engine.module.named_parameters()}
    ours = sys.modules.get("ds_z3native")
    result["ds_z3native_installed"] = bool(ours is not None and ours.installed())


class _GradNormAB:
    """``--ab-grad-norm``: even steps take ZeRO-3's gradient norms through the installed
    ``zero3-flat-grad-norm`` patch, odd steps through DeepSpeed's own per-param loop (the function
    the patch wraps), in one process on the same graphs. Each norm call is timed with the device
    synchronized before and after it (host and device time of the norm alone); the first calls
    also compute the other way's norm, untimed, to compare the two. ``finish`` writes
    ``result["grad_norm_ab"]``: per way, the calls, their median and total milliseconds per step,
    and the median step time of the steps after the 6th (the same synchronizations in both)."""

    CHECKED_CALLS = 6

    def __init__(self, result: Dict[str, Any], cpu: bool) -> None:
        import torch
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

        patched = Stage3.__dict__["get_grad_norm_direct"]
        original = getattr(patched, "__wrapped__", None)
        if original is None:
            raise RuntimeError("--ab-grad-norm: DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct "
                               "is not wrapped (run with --native ours, without --skip-patch "
                               "zero3-flat-grad-norm)")
        self.result, self.per_param = result, False
        self.calls: Dict[str, List[float]] = {"flat": [], "per_param": []}
        self.diffs: List[float] = []
        sync = (lambda: None) if cpu else torch.cuda.synchronize
        ab = self

        def get_grad_norm_direct(this: Any, gradients: Any, params: Any, norm_type: Any = 2) -> Any:
            way = "per_param" if ab.per_param else "flat"
            fn, other = (original, patched) if ab.per_param else (patched, original)
            sync()
            began = time.perf_counter()
            norm = fn(this, gradients, params, norm_type)
            sync()
            ab.calls[way].append(1000 * (time.perf_counter() - began))
            if len(ab.diffs) < ab.CHECKED_CALLS:
                theirs = float(other(this, gradients, params, norm_type))
                ours = float(norm)
                ab.diffs.append(abs(ours - theirs) / max(abs(theirs), 1e-30))
            return norm

        Stage3.get_grad_norm_direct = get_grad_norm_direct

    def finish(self, step_times: List[float]) -> None:
        import statistics

        timed = [(i, t) for i, t in enumerate(step_times) if i >= 6]
        out: Dict[str, Any] = {"max_rel_diff_checked": max(self.diffs, default=None),
                               "checked_calls": len(self.diffs)}
        for way, odd in (("flat", 0), ("per_param", 1)):
            calls = self.calls[way]
            steps = [1000 * t for i, t in timed if i % 2 == odd]
            per_step = len(calls) / max(1, len(range(odd, len(step_times), 2)))
            out[way] = {
                "calls": len(calls), "calls_per_step": per_step,
                "norm_call_ms_median": statistics.median(calls) if calls else None,
                "norm_ms_per_step": per_step * statistics.median(calls) if calls else None,
                "step_ms_median": statistics.median(steps) if steps else None,
                "timed_steps": len(steps)}
        self.result["grad_norm_ab"] = out


@contextlib.contextmanager
def _deepspeed_walk_reading_kwargs(graph: Any) -> Iterator[None]:
    """DeepSpeed's own requirement walk, run as it is, also following keyword inputs: its walk
    reads a node's inputs through ``list_schedule.map_arg(node.args, ...)`` (its one use of
    ``map_arg``), which here also maps that node's ``kwargs``. Without it DeepSpeed's walk cannot
    order a graph that passes a tensor by keyword (SDPA's ``attn_mask``: ``KeyError``), and the
    order of ds_z3native's walk (which reads keyword inputs) would have nothing to compare with.
    A node is found by its ``args`` tuple; an empty tuple is shared, so a node without positional
    arguments that takes a node by keyword makes the comparison impossible (``ValueError``)."""
    from deepspeed.compile import list_schedule
    from torch.fx.node import map_arg

    by_args: Dict[int, Any] = {}
    for node in graph.nodes:
        if node.args:
            by_args[id(node.args)] = node
        elif _kwarg_inputs(node):
            raise ValueError(f"node {node.name} takes a node by keyword and has no positional "
                             "argument: DeepSpeed's walk cannot be extended to it")

    def map_arg_and_kwargs(args: Any, fn: Callable) -> Any:
        mapped = map_arg(args, fn)
        node = by_args.get(id(args))
        if node is not None and node.args is args:
            map_arg(node.kwargs, fn)
        return mapped

    original = list_schedule.map_arg
    list_schedule.map_arg = map_arg_and_kwargs
    try:
        yield
    finally:
        list_schedule.map_arg = original


def _kwarg_inputs(node: Any) -> List[Any]:
    from torch.fx.node import map_arg

    found: List[Any] = []
    map_arg(node.kwargs, found.append)
    return found


def time_scheduler(records: List[Dict[str, Any]]) -> None:
    """Time DeepCompile's ZeRO-3 scheduler (``fast_free_schedule``) on each graph it orders in
    this run, twice: as installed (with ds_z3native, its requirement walk) and with DeepSpeed's
    own ``get_node_requirements`` (extended to keyword inputs where the graph has some:
    :func:`_deepspeed_walk_reading_kwargs`). The run goes on with the first schedule. Appends
    per graph ``nodes``, ``allgathers``, ``kwarg_inputs`` (nodes taking a node by keyword),
    ``installed_s``, ``deepspeed_s`` and ``same_order`` (whether the two schedules are the same
    node order), or ``deepspeed_error``, to ``records``."""
    from deepspeed.compile import list_schedule
    from deepspeed.compile.passes import zero3_compile

    schedule = zero3_compile.fast_free_schedule

    def timed_schedule(graph: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        walk = list_schedule.get_node_requirements
        theirs_walk = getattr(walk, "__wrapped__", walk)
        gathers = sum(1 for n in graph.nodes if n.target == torch.ops.dc.allgather_param.default)
        with_kwargs = sum(1 for n in graph.nodes if _kwarg_inputs(n))
        record: Dict[str, Any] = {"nodes": len(graph.nodes), "allgathers": gathers,
                                  "kwarg_inputs": with_kwargs}
        start = time.perf_counter()
        ours = schedule(graph, *args, **kwargs)
        record["installed_s"] = round(time.perf_counter() - start, 3)
        list_schedule.get_node_requirements = theirs_walk
        try:
            with (_deepspeed_walk_reading_kwargs(graph) if with_kwargs
                  else contextlib.nullcontext()):
                start = time.perf_counter()
                theirs = schedule(graph, *args, **kwargs)
            record["deepspeed_s"] = round(time.perf_counter() - start, 3)
            record["same_order"] = [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
        except Exception as e:  # noqa: BLE001 - recorded: the test reading the record fails
            record["deepspeed_error"] = f"{type(e).__name__}: {e}"
        finally:
            list_schedule.get_node_requirements = walk
        records.append(record)
        log.info("DeepCompile's scheduler on a graph of %d nodes: %s", record["nodes"], record)
        return ours

    zero3_compile.fast_free_schedule = timed_schedule


def _persist_all_when_chosen_early() -> None:
    """Stand in for DeepCompile's persistence policy where it cannot run (on a CPU its memory
    profiles are incomplete and ``selective_gather`` keeps nothing): the re-plan's early choice
    (patch deepcompile-persistent-group) keeps every parameter gathered, as an H200 does for a
    small model. DeepSpeed's own pass in the schedule is left as it is."""
    from deepspeed.compile.passes import selective_gather as module
    from deepspeed.compile.util import get_deepcompile_handle

    def selective_gather(gm: Any, graph_id: int, graph_order: Any, profiling_results: Any,
                         create_inputs_fn: Any, mem_budget: Any, param_manager: Any,
                         bwd: bool) -> Any:
        handle = get_deepcompile_handle()
        for manager in param_manager.values():
            for name in manager.params:
                handle.set_persistent(manager.ds_ids[name])
        return gm

    module.selective_gather = selective_gather


def _op_calls(profiler: Any) -> Dict[str, int]:
    """Calls of the dc and ds_z3native ops in a profiled step, by op."""
    calls: Dict[str, int] = {}
    for event in profiler.events():
        if event.name.startswith(("dc::", "ds_z3native::")):
            calls[event.name] = calls.get(event.name, 0) + 1
    return dict(sorted(calls.items()))


def _disable_deepspeed_eager_fallback() -> None:
    """Turn DeepSpeed's own eager fallback (0.19.8's parameter getter) off, as it behaves with
    torch 2.11 on an H200, so that ds_z3native's eager gather is what is tested."""
    try:
        from deepspeed.compile import z3_eager_fallback
    except ImportError:  # DeepSpeed < 0.19.8 has none
        return
    z3_eager_fallback.DeepCompileZ3EagerFallback._enable_forward_fallback = lambda self: None


def only_sdpa_backend(name: str) -> Dict[str, bool]:
    """Leaves one of SDPA's CUDA backends enabled (``cudnn``, ``flash``, ``efficient``, ``math``),
    process-wide, before anything is traced; the flags as set."""
    import torch

    b = torch.backends.cuda
    flags = {"cudnn": name == "cudnn", "flash": name == "flash",
             "efficient": name == "efficient", "math": name == "math"}
    b.enable_cudnn_sdp(flags["cudnn"])
    b.enable_flash_sdp(flags["flash"])
    b.enable_mem_efficient_sdp(flags["efficient"])
    b.enable_math_sdp(flags["math"])
    return flags


def _lengths_arg(text: str) -> List[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths takes integers separated by commas, got {text!r}")
    if not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"--lengths: every length must be >= 2, got {text!r}")
    return lengths


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["deepcompile", "eager"], default="deepcompile")
    parser.add_argument("--native", choices=["ours", "deepspeed"], default="ours",
                        help="ours: ds_z3native.install(); deepspeed: DeepSpeed's own op (JIT)")
    parser.add_argument("--model", choices=["frozen-linear", "reuse3", "eager-head", "eager-frozen",
                                            "eager-frozen-flagged", "llama"],
                        default="frozen-linear")
    parser.add_argument("--generate-every", type=int, default=0, metavar="N",
                        help="--model llama: after every N-th step, greedy generation of 4 "
                             "tokens through engine.module.generate (result: generated)")
    parser.add_argument("--size", default="tiny", help="llama size (ds_z3native.models)")
    parser.add_argument("--family", default="llama",
                        help="--model llama: this transformers model type at the size's shape "
                             "instead (ds_z3native.models.build_lora_model: gpt2, qwen3_moe, "
                             "mixtral, or any type whose config takes Llama's names)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the llama size's decoder layers, this many instead")
    parser.add_argument("--checkpointing", choices=["none", "non-reentrant", "reentrant"],
                        default="none", help="llama: HF gradient checkpointing")
    parser.add_argument("--eager-stage", type=int, choices=[0, 3], default=0,
                        help="ZeRO stage of --mode eager")
    add_skip_patch_option(parser, "the result's args.skip_patch")
    add_inductor_option(parser, "the result's inductor")
    parser.add_argument("--eval-between", action="store_true",
                        help="run a no-grad forward between each forward and its backward")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="after every N steps, evaluate as HF Trainer does: model.eval(), "
                             "two forwards under no_grad, model.train()")
    parser.add_argument("--no-deepspeed-fallback", action="store_true",
                        help="turn DeepSpeed 0.19.8's own eager fallback off")
    parser.add_argument("--persist-all", action="store_true",
                        help="with ds_z3native: the re-plan's early persistence choice keeps every "
                             "param gathered (DeepCompile's own policy keeps none on a CPU)")
    parser.add_argument("--no-group-persistent", action="store_true",
                        help="with ds_z3native: ds_z3native.set_group_persistent(False)")
    parser.add_argument("--no-group-reduce", action="store_true",
                        help="with ds_z3native: ds_z3native.set_group_reduce(False)")
    parser.add_argument("--single-cycle", action="store_true",
                        help="with ds_z3native: ds_z3native.set_single_cycle(True)")
    parser.add_argument("--time-scheduler", action="store_true",
                        help="time DeepCompile's scheduler on each graph, as installed and with "
                             "DeepSpeed's own requirement walk (result: scheduler)")
    parser.add_argument("--count-ops", action="store_true",
                        help="profile the last step and record its dc / ds_z3native op calls")
    parser.add_argument("--ab-grad-norm", action="store_true",
                        help="with ds_z3native: even steps take the optimizer's gradient norms "
                             "through the zero3-flat-grad-norm patch, odd steps through DeepSpeed's "
                             "per-param loop, each norm call timed (result: grad_norm_ab)")
    parser.add_argument("--lengths", type=_lengths_arg, default=None, metavar="L1,L2,...",
                        help="llama: step i's batch padded to length L[i %% n] (rows of varying "
                             "length, attention_mask and labels -100 on the pads); default: the "
                             "size's fixed sequence length")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="fp16: DeepSpeed's fp16 with dynamic loss scaling")
    parser.add_argument("--sdpa-backend", default="default",
                        choices=["default", "cudnn", "flash", "efficient", "math"],
                        help="CUDA: leave only this SDPA backend enabled (default: torch's choice)")
    parser.add_argument("--attn-implementation", choices=["sdpa", "eager"], default=None,
                        help="llama: transformers' attention implementation (default: the "
                             "model's, sdpa)")
    parser.add_argument("--same-batch-on-every-rank", action="store_true",
                        help="under a launcher: every rank trains on rank 0's batches (default: "
                             "each rank its own, as a data-parallel loader gives them)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unfreeze-after", type=int, default=None,
                        help="set the frozen layer's requires_grad=True before this step")
    parser.add_argument("--fresh-extension-cache", action="store_true",
                        help="TORCH_EXTENSIONS_DIR = a new temporary directory (forces a JIT build)")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout)")
    parser.add_argument("--watchdog-s", type=float, default=None,
                        help="past this many seconds, print every thread's stack to stderr and "
                             "exit (a hang becomes a diagnosable failure)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.watchdog_s:
        arm_watchdog(args.watchdog_s)
    result: Dict[str, Any] = {"args": vars(args)}
    try:
        run(args, result)
    except Exception as e:  # noqa: BLE001 - reported as data: the caller asserts on it
        result.update(error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                      traceback=traceback.format_exc())
    rank = int(os.environ.get("RANK", "0"))
    result["rank"], result["world_size"] = rank, int(os.environ.get("WORLD_SIZE", "1"))
    text = json.dumps(result)
    if args.json:
        # Under a launcher every rank reports; rank r > 0 writes <json>.rank<r>.
        path = args.json if rank == 0 else f"{args.json}.rank{rank}"
        with open(path, "w") as f:
            f.write(text)
    else:
        print(text)
    summary = {k: v for k, v in result.items() if k not in ("params", "initial_params", "traceback")}
    print("RESULT " + json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
