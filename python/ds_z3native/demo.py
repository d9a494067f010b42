"""``ds-z3native demo``: a LoRA fine-tune under DeepSpeed ZeRO-3 with activation checkpointing.

A small Llama (random weights, built from a config: nothing is downloaded) with PEFT LoRA adapters
on its linear layers trains for a few steps under ZeRO-3 with non-reentrant gradient checkpointing
(``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``, what
HF Trainer / TRL do), with ``ds_z3native.install()`` applied. That combination fails on DeepSpeed
0.19.0 – 0.19.2 with ``CheckpointError ... recomputed {'shape': [0]}``; ``--without-fix`` runs the
same without ``install()`` to show it.

The demo starts its own ranks (one process each): 2 gloo ranks on CPU by default, one NCCL rank
per GPU when CUDA is available. Rank 0 reports every step to the parent process, which draws the
progress bar and prints the summary; the ranks' own output (DeepSpeed's logs) goes to one log file
per rank. A rank that fails stops the run: the others are killed and its error is reported.
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, TextIO, Tuple

from packaging.version import InvalidVersion, Version

from .launch import RankError, RanksFailed, run_ranks, send
from .models import DEFAULT_SIZE, MODEL_SIZES, ModelSize

__all__ = ["DemoOptions", "DemoResult", "DemoRefused", "run_demo", "format_summary",
           "Comparison", "compare_options", "run_comparison", "format_comparison",
           "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1  # a rank raised, died or stopped reporting
EXIT_REFUSED = 2  # the run could not start here (options, missing packages)

# DeepSpeed releases with their own fix for the eager recompute failure.
_UPSTREAM_RECOMPUTE_FIX = "0.19.3"
# DeepSpeed runs DeepCompile on its CPU accelerator from this release on.
_DEEPCOMPILE_ON_CPU = Version("0.19.4")
_RECOMPUTE_SHAPE0 = re.compile(r"recomputed metadata:.*'shape': torch\.Size\(\[0\]\)", re.S)


class DemoRefused(RuntimeError):
    """The demo cannot run with these options on this machine; the message says what to do."""


@dataclass
class DemoOptions:
    """What ``ds-z3native demo`` runs."""

    steps: int = 20
    ranks: Optional[int] = None  # None: one per GPU with CUDA, else 2
    model_size: str = DEFAULT_SIZE
    deepcompile: bool = False
    without_fix: bool = False
    device: str = "auto"  # "auto", "cpu" or "cuda"
    lr: float = 5e-3
    seed: int = 0
    timeout: float = 600.0  # seconds without any news from the ranks before giving up
    log_dir: Optional[str] = None  # default: a new temporary directory
    progress: bool = True


@dataclass
class DemoResult:
    """How the run went; ``exit_code`` is what the command returns."""

    exit_code: int
    options: Dict[str, Any]
    device: str = "cpu"
    world_size: int = 0
    deepspeed_version: str = ""
    torch_version: str = ""
    fix: str = ""  # what was applied: "ds_z3native.install(): <patches>" or "none"
    params: int = 0
    trainable: int = 0
    losses: List[float] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)
    # Steps (0-based) at which DeepCompile's pass schedule re-plans and recompiles (DeepSpeed
    # 0.19: 0 and 5); empty without DeepCompile.
    replan_steps: List[int] = field(default_factory=list)
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    setup_seconds: float = 0.0
    wall_seconds: float = 0.0
    log_dir: str = ""
    error: Optional[Dict[str, Any]] = None  # rank, step, type, message, why, traceback
    note: str = ""

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of the result."""
        return asdict(self)


# ---- one rank ------------------------------------------------------------------------------

def _zero3_config(size: ModelSize, opts: DemoOptions, cuda: bool) -> Dict[str, Any]:
    from .models import zero3_auto_values

    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": size.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "overlap_comm": cuda,
                              **zero3_auto_values(size.hidden)},
        # torch_adam: PyTorch's AdamW, no JIT build of DeepSpeed's fused Adam.
        "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.0,
                                                  "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cuda:
        config["bf16"] = {"enabled": True}
    if opts.deepcompile:
        config["compile"] = {"deepcompile": True}
    return config


def _peak_memory(cuda: bool) -> int:
    if cuda:
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _why(exc: BaseException, text: str, ds_version: str, fixed: bool) -> str:
    """One line on why a known failure happens, or ''."""
    if type(exc).__name__ == "CheckpointError" and _RECOMPUTE_SHAPE0.search(text):
        if fixed:
            return ("a frozen param was partitioned during the checkpoint recompute although "
                    "ds_z3native.install() was applied: please report this with "
                    "`ds-z3native doctor --json`")
        return (f"DeepSpeed {ds_version}'s ZeRO-3 frees frozen params (the base model's "
                "weights under LoRA) in place while torch.utils.checkpoint recomputes a layer "
                "inside backward, so the "
                "recompute sees shape [0]; ds_z3native.install() (or DS_Z3NATIVE=1) keeps them "
                f"gathered until their module's backward ends (DeepSpeed fixed it in "
                f"{_UPSTREAM_RECOMPUTE_FIX}).")
    if "Error building extension 'dc'" in text:
        return ("DeepSpeed builds its DeepCompile op (dc) from CUDA sources when DeepCompile "
                "starts, which a CPU-only torch (or a machine without a matching CUDA toolkit) "
                "cannot compile; ds_z3native ships that op prebuilt, CPU and CUDA "
                "(ds_z3native.install() or DS_Z3NATIVE=1).")
    return ""


def _deepcompile_replan_steps() -> List[int]:
    """The engine steps (0-based) at which DeepCompile applies its scheduled passes, read after
    ``engine.compile()``: each resets Dynamo and compiles the graphs again, so those steps are
    not steady-state steps (DeepSpeed 0.19: 0, and 5 where profiling ends). [] if unreadable."""
    try:
        from deepspeed.compile import backend

        return sorted({int(step) for step, _ in (backend.remaining_schedule or ())})
    except Exception as e:  # noqa: BLE001 - the summary then counts from the second step
        log.debug("DeepCompile's pass schedule: %s", e)
        return []


def _rank_main(rank: int, world: int, cuda: bool, opts: DemoOptions) -> None:
    """One rank: train, and send what happens to the parent (rank 0: set-up and every step). A
    failure is sent with the step and why, then raised: the launcher reports it and stops the
    other ranks."""
    step = None
    stage = "set-up"  # where a failure before the first step happened
    ds_version = "?"
    try:
        import torch
        import torch.distributed as dist

        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)

        import ds_z3native_autoload

        if opts.without_fix:
            ds_z3native_autoload.deactivate()  # DS_Z3NATIVE=1 must not install it behind our back
        import deepspeed
        import deepspeed.ops

        ds_version = deepspeed.__version__
        if not cuda:
            # gloo for DeepSpeed's collectives: its optional shared-memory comm op is otherwise
            # JIT-compiled at the first engine (about a minute on 2 cores).
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        import ds_z3native

        if opts.without_fix:
            if ds_z3native.installed():
                raise RuntimeError("--without-fix, but ds_z3native is already installed in "
                                   "this process")
            fix, n_patches = "none (--without-fix)", 0
        else:
            report = ds_z3native.install()
            fix = "ds_z3native.install(): " + (", ".join(report.patches) or "no patches")
            n_patches = len(report.patches)

        from .models import build_lora_llama, synthetic_batch

        size = MODEL_SIZES[opts.model_size]
        model, counts = build_lora_llama(size, seed=opts.seed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable,
                                          config=_zero3_config(size, opts, cuda))
        replan: List[int] = []
        if opts.deepcompile:
            stage = "engine.compile()"
            engine.compile()
            replan = _deepcompile_replan_steps()
        device = engine.device
        if rank == 0:
            send({"kind": "ready", "deepspeed": ds_version, "torch": torch.__version__,
                  "fix": fix, "patches": n_patches, "params": counts["params"],
                  "trainable": counts["trainable"],
                  "memory_kind": "max GPU memory allocated" if cuda else "peak RSS",
                  "replan_steps": replan})
        for step in range(opts.steps):
            ids = synthetic_batch(size, step, rank, seed=opts.seed).to(device)
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            value = mean.item() / world
            elapsed = time.perf_counter() - t0
            if rank == 0:
                send({"kind": "step", "step": step, "loss": value, "step_s": elapsed,
                      "peak": _peak_memory(cuda)})
        step = None
        engine.destroy()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the context of the error, then the error itself
        send({"kind": "failing", "step": step, "stage": None if step is not None else stage,
              "why": _why(e, f"{type(e).__name__}: {e}", ds_version, not opts.without_fix)})
        raise


# ---- the parent ----------------------------------------------------------------------------

def _check_dependencies() -> None:
    import importlib.util

    # find_spec, not import: the ranks import them; the parent stays quick to start.
    missing = [name for name in ("deepspeed", "transformers", "peft", "tqdm")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoRefused(f"the demo needs {', '.join(missing)}: install the demo extra with "
                          "`pip install --no-build-isolation -e \".[demo]\"` (from the "
                          "ds_z3native checkout) or `pip install transformers peft tqdm "
                          "'deepspeed>=0.19,<0.20'`")


def _resolve(opts: DemoOptions) -> tuple:
    """(cuda, world_size) for ``opts`` on this machine; DemoRefused when they cannot run here."""
    import torch

    if opts.model_size not in MODEL_SIZES:
        raise DemoRefused(f"unknown --model-size {opts.model_size!r}; choose one of "
                          f"{', '.join(MODEL_SIZES)}")
    if opts.steps < 1:
        raise DemoRefused(f"--steps must be at least 1, got {opts.steps}")
    if opts.device not in ("auto", "cpu", "cuda"):
        raise DemoRefused(f"--device must be auto, cpu or cuda, got {opts.device!r}")
    has_cuda = torch.cuda.is_available()
    if opts.device == "cuda" and not has_cuda:
        raise DemoRefused("--device cuda, but torch sees no CUDA GPU here "
                          f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda})")
    cuda = has_cuda and opts.device != "cpu"
    if opts.deepcompile and not cuda:
        ds_version = _deepspeed_version()
        if ds_version is not None and ds_version < _DEEPCOMPILE_ON_CPU:
            raise DemoRefused(f"--deepcompile on the CPU needs DeepSpeed >= {_DEEPCOMPILE_ON_CPU} "
                              f"(DeepSpeed {ds_version} runs DeepCompile only on the CUDA "
                              "accelerator): `pip install 'deepspeed>=0.19.4,<0.20'`, or run the "
                              "eager demo (without --deepcompile).")
    if opts.deepcompile and cuda and not opts.without_fix:
        from . import build_info

        if build_info()["flavour"] != "cuda":
            raise DemoRefused("--deepcompile on GPUs runs ds_z3native's dc op over NCCL, but this "
                              "ds_z3native was built without CUDA (CPU flavour): reinstall it "
                              "with `DS_Z3NATIVE_CUDA=1 pip install --no-build-isolation -v -e .`, "
                              "which says what it is missing (`ds-z3native doctor` says why "
                              "this build has none)")
    world = opts.ranks if opts.ranks is not None else (torch.cuda.device_count() if cuda else 2)
    if world < 1:
        raise DemoRefused(f"--ranks must be at least 1, got {world}")
    if cuda and world > torch.cuda.device_count():
        raise DemoRefused(f"--ranks {world}, but only {torch.cuda.device_count()} GPU(s) are "
                          "visible: one rank per GPU")
    return cuda, world


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


class _Progress:
    """Status lines and the tqdm bar on ``stream``; the bar starts with the first step, so its
    rate is the training's, not the set-up's. Nothing at all when disabled."""

    def __init__(self, total: int, enabled: bool, stream: TextIO) -> None:
        self.total, self.enabled, self.stream = total, enabled, stream
        self.bar: Any = None

    def step(self, event: Dict[str, Any], memory_kind: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="LoRA fine-tune", unit="step",
                            file=self.stream, dynamic_ncols=True, leave=True)
        self.bar.set_postfix_str(f"step {event['step'] + 1} loss {event['loss']:.4f} "
                                 f"{event['step_s']:.2f}s/step {memory_kind} "
                                 f"{_fmt_bytes(event['peak'])}", refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _error_of(error: RankError, failing: Dict[int, Dict[str, Any]],
              timeout: float) -> Dict[str, Any]:
    """The result's ``error`` for the launcher's first error (with the step and why the rank sent
    before raising)."""
    if error.kind == "timeout":
        return {"rank": None, "step": None, "type": "Timeout",
                "message": f"no progress from the ranks for {timeout:.0f} s", "why": "",
                "traceback": ""}
    context = failing.get(error.rank, {}) if error.rank is not None else {}
    return {"rank": error.rank, "step": context.get("step"), "stage": context.get("stage"),
            "type": error.type,
            "message": error.message, "why": context.get("why", ""),
            "traceback": error.traceback}


def run_demo(opts: DemoOptions, stream: Optional[TextIO] = None) -> DemoResult:
    """Run the demo as ``opts`` say; the progress bar goes to ``stream`` (default stderr).

    Raises :class:`DemoRefused` when the run cannot start here; a run that starts and fails
    returns a result with ``exit_code`` :data:`EXIT_FAILED` and ``error`` set.
    """
    _check_dependencies()
    cuda, world = _resolve(opts)
    stream = stream if stream is not None else sys.stderr
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="ds-z3native-demo-")
    os.makedirs(log_dir, exist_ok=True)
    result = DemoResult(EXIT_FAILED, asdict(opts), device="cuda" if cuda else "cpu",
                        world_size=world, log_dir=log_dir)
    start = time.monotonic()
    bar = _Progress(opts.steps, opts.progress, stream)
    failing: Dict[int, Dict[str, Any]] = {}  # rank -> the step and why it sent before raising

    def on_message(rank: int, event: Dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "ready":
            result.deepspeed_version = event["deepspeed"]
            result.torch_version = event["torch"]
            result.fix = event["fix"]
            result.params, result.trainable = event["params"], event["trainable"]
            result.setup_seconds = time.monotonic() - start  # start-up to engine ready
            result.peak_memory_kind = event["memory_kind"]
            result.replan_steps = list(event.get("replan_steps", []))
            bar.write(f"DeepSpeed {result.deepspeed_version}, torch "
                      f"{result.torch_version}; Llama '{opts.model_size}' with LoRA, ZeRO-3, non-reentrant "
                      f"checkpointing; fix: {_fix_shown(result.fix, event['patches'])} (set-up "
                      f"{result.setup_seconds:.1f} s)")
            if opts.deepcompile:
                again = [s + 1 for s in result.replan_steps if s > 0]
                bar.write("DeepCompile compiles the model's graphs at step 1"
                          + (f" and again at step {', '.join(map(str, again))} (its re-plan)"
                             if again else "") + ": those steps take longer, and the bar "
                          "appears once step 1 is done")
        elif kind == "step":
            result.losses.append(event["loss"])
            result.step_seconds.append(event["step_s"])
            result.peak_memory_bytes = max(result.peak_memory_bytes, event["peak"])
            bar.step(event, result.peak_memory_kind)
        elif kind == "failing":
            failing[rank] = event

    bar.write(f"ds-z3native demo: starting {world} {'NCCL' if cuda else 'gloo'} rank(s) on "
              f"{'GPU' if cuda else 'CPU'} (logs: {log_dir})")
    try:
        run_ranks(_rank_main, world, cuda, opts, env={} if cuda else {"DS_ACCELERATOR": "cpu"},
                  timeout=None, idle_timeout=opts.timeout, log_dir=log_dir,
                  name="ds-z3native-demo-rank", on_message=on_message)
    except RanksFailed as e:
        result.error = _error_of(e.first, failing, opts.timeout)
    except KeyboardInterrupt:
        result.error = {"rank": None, "step": None, "type": "KeyboardInterrupt",
                        "message": "interrupted", "why": "", "traceback": ""}
    finally:
        bar.close()
    result.wall_seconds = time.monotonic() - start
    if result.error is None:
        bad = [v for v in result.losses if not math.isfinite(v)]
        if bad:
            result.error = {"rank": 0, "step": result.losses.index(bad[0]), "type": "NonFiniteLoss",
                            "message": f"the loss became {bad[0]}", "why": "", "traceback": ""}
    if result.error is None:
        result.exit_code = EXIT_OK
        if opts.without_fix and _has_upstream_fix(result.deepspeed_version):
            result.note = (f"DeepSpeed {result.deepspeed_version} carries its own fix for the "
                           f"checkpoint-recompute failure (since {_UPSTREAM_RECOMPUTE_FIX}), so "
                           "this run succeeds without ds_z3native; on DeepSpeed 0.19.0 - 0.19.2 "
                           "it fails.")
    return result


def _release(text: str) -> Optional[Version]:
    """The DeepSpeed release ``text`` names (without a local part such as ``+cu130``), or None
    where it names none."""
    try:
        return Version(Version(text.split("+")[0]).base_version)
    except InvalidVersion:
        return None


def _deepspeed_version() -> Optional[Version]:
    """The installed DeepSpeed's release (without a local part), or None where unreadable."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _release(version("deepspeed"))
    except PackageNotFoundError:  # not installed: the run says so later
        return None


def _has_upstream_fix(version: str) -> bool:
    release = _release(version)
    return release is not None and release >= Version(_UPSTREAM_RECOMPUTE_FIX)


def _error_excerpt(message: str, limit: int = 6) -> List[str]:
    """The lines of an error message worth showing (CheckpointError's are very long)."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return []
    keep = [lines[0]]
    for i, ln in enumerate(lines[1:], 1):
        if "saved metadata" in ln or "recomputed metadata" in ln:
            keep.append(ln.strip())
            if "recomputed metadata" in ln and i > 1:
                break
    if len(keep) == 1:
        keep = lines[:limit]
    return [k[:300] for k in keep]


def _steady(result: DemoResult) -> Tuple[int, List[float]]:
    """(first steady step, 0-based; their times): the steps after the first and, under
    DeepCompile, after its last scheduled re-plan (which compiles every graph again)."""
    times = result.step_seconds
    start = max([0] + [s for s in result.replan_steps if s < len(times)]) + 1
    return start, times[start:]


def _step_time(result: DemoResult) -> str:
    """The median step time of the steady steps (:func:`_steady`), with the slow steps left out
    named."""
    times = result.step_seconds
    start, steady = _steady(result)
    slow = [f"{times[0]:.2f} s first"]
    slow += [f"{times[s]:.2f} s at DeepCompile's re-plan, step {s + 1}"
             for s in result.replan_steps if 0 < s < len(times)]
    if not steady:
        return (f"no steps after {'the re-plan' if start > 1 else 'the first'} to measure "
                f"({', '.join(slow)})")
    steps = f"step {start + 1}" if len(steady) == 1 else f"steps {start + 1}-{len(times)}"
    return f"{statistics.median(steady):.3f} s median of {steps} ({', '.join(slow)})"


def _fix_shown(fix: str, patches: int) -> str:
    """The fix as the start-up line shows it: the number of patches ``install()`` applied (the
    summary's ``fix`` row counts them by group, ``--json`` names them); ``fix`` itself where none
    were."""
    if not patches:
        return fix
    return f"ds_z3native.install(), {patches} patch{'' if patches == 1 else 'es'}"


# What each patch module of ds_z3native.compat fixes, as the summary's fix row groups the patches
# (any module named deepcompile_* is DeepCompile's); a module not listed is shown by its own name.
_FIX_GROUP_PREFIXES = (("deepcompile_", "DeepCompile"),)
_FIX_GROUPS = {
    "checkpoint_recompute": "ZeRO-3", "zero3_walks": "ZeRO-3", "zero3_grad_norm": "ZeRO-3",
    "zero3_overflow_order": "ZeRO-3",
    "hf_trainer_loop": "HF Trainer",
    "hf_graph_breaks": "transformers", "hf_moe_grouped_mm": "transformers",
    "cpu_accelerator": "accelerators", "cuda_memory_counters": "accelerators",
    "inductor_attention_outputs": "inductor",
    "gloo_collectives": "accelerators",  # DeepSpeed's collectives on the CPU accelerator's gloo
    "config_section": "settings",
}
_INSTALLED = "ds_z3native.install(): "


def _fix_group(module: str) -> str:
    """The summary's group of the patches of ``ds_z3native.compat`` module ``module`` (its last
    dotted part)."""
    for prefix, group in _FIX_GROUP_PREFIXES:
        if module.startswith(prefix):
            return group
    return _FIX_GROUPS.get(module, module)


def _patch_modules() -> Dict[str, str]:
    """Each known patch's name -> the last part of the name of its module."""
    from .compat.registry import patch_modules

    return {name: module.rsplit(".", 1)[-1] for name, module in patch_modules().items()}


def _fix_groups(patches: List[str]) -> List[Tuple[str, int]]:
    """(group, number of patches) of the patch names ``patches``, the largest group first (ties
    in the order the patches apply); a name no patch module holds counts as "other"."""
    modules = _patch_modules()
    counts: Dict[str, int] = {}
    for name in patches:
        group = _fix_group(modules[name]) if name in modules else "other"
        counts[group] = counts.get(group, 0) + 1
    order = list(counts)
    return sorted(counts.items(), key=lambda kv: (-kv[1], order.index(kv[0])))


def _fix_row(fix: str) -> str:
    """The summary's fix row: install()'s patches counted by what they fix (the names are in
    ``fix``, which ``--json`` writes); ``fix`` itself where install() was not called or applied
    nothing."""
    if not fix.startswith(_INSTALLED) or fix == _INSTALLED + "no patches":
        return fix or "?"
    names = fix[len(_INSTALLED):].split(", ")
    groups = ", ".join(f"{group} ({n})" for group, n in _fix_groups(names))
    return f"{_fix_shown(fix, len(names))}: {groups}; names in --json"


def format_summary(result: DemoResult) -> str:
    """The table (and, on failure, the error and why) printed after the run."""
    rows = [("outcome", "OK" if result.exit_code == EXIT_OK else "FAILED"),
            ("DeepSpeed / torch", f"{result.deepspeed_version or '?'} / "
                                  f"{result.torch_version or '?'}"),
            ("ranks", f"{result.world_size} on {result.device.upper()}"
                      f"{' (DeepCompile)' if result.options.get('deepcompile') else ''}"),
            ("model", f"Llama '{result.options['model_size']}', "
                      f"{_fmt_count(result.params)} params, {_fmt_count(result.trainable)} "
                      "trainable (LoRA)" if result.params else
                      f"Llama '{result.options['model_size']}'"),
            ("fix", _fix_row(result.fix)),
            ("steps", f"{len(result.losses)} of {result.options['steps']}")]
    if result.losses:
        rows.append(("loss first -> last", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}"))
    if result.step_seconds:
        rows.append(("step time", _step_time(result)))
    if result.peak_memory_bytes:
        rows.append((f"peak memory ({result.peak_memory_kind}, rank 0)",
                     _fmt_bytes(result.peak_memory_bytes)))
    setup = f" (setup {result.setup_seconds:.1f} s)" if result.setup_seconds else ""
    rows.append(("wall time", f"{result.wall_seconds:.1f} s{setup}"))
    rows.append(("rank logs", result.log_dir))
    width = max(len(k) for k, _ in rows)
    out = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if result.losses:
        out.append(f"  {'loss by step'.ljust(width)}  " +
                   " ".join(f"{v:.4f}" for v in result.losses))
    err = result.error
    if err is not None:
        where = f"rank {err['rank']}" if err.get("rank") is not None else "the run"
        at = _where(err)
        out.append("")
        out.append(f"error ({where}{at}): {err['type']}")
        out += [f"  {ln}" for ln in _error_excerpt(err["message"])]
        if err.get("why"):
            out.append(f"why: {err['why']}")
        if err.get("rank") is not None:
            log_file = os.path.join(result.log_dir, f"rank{err['rank']}.log")
            out.append(f"full traceback: {log_file}" if err.get("traceback") else
                       f"rank log: {log_file}")
        else:
            out.append(f"rank logs: {result.log_dir}")
    if result.note:
        out.append("")
        out.append(f"note: {result.note}")
    return "\n".join(out)


# ---- --compare: DeepSpeed alone, then with ds_z3native ---------------------------------------

@dataclass
class Comparison:
    """``ds-z3native demo --compare``: the same run by DeepSpeed alone and with ds_z3native."""

    alone: DemoResult
    fixed: DemoResult

    @property
    def exit_code(self) -> int:
        """The run with ds_z3native decides: DeepSpeed alone failing is what the comparison
        shows, not a failure of the demo."""
        return self.fixed.exit_code

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of both results."""
        return {"alone": self.alone.to_json(), "with_ds_z3native": self.fixed.to_json()}


def compare_options(opts: DemoOptions) -> DemoOptions:
    """The options ``--compare`` runs: ``opts`` under DeepCompile where DeepCompile runs here
    (GPUs with a CUDA build, or CPU ranks from DeepSpeed 0.19.4), where every DeepSpeed 0.19.x
    alone differs from it; else eager, where DeepSpeed 0.19.0 - 0.19.2 alone differ. An explicit
    ``--deepcompile`` stays (and is refused where it cannot run)."""
    if opts.deepcompile:
        return opts
    try:
        _resolve(replace(opts, deepcompile=True))
    except DemoRefused as e:
        log.debug("--compare runs eager: %s", e)
        return opts
    return replace(opts, deepcompile=True)


def run_comparison(opts: DemoOptions, stream: Optional[TextIO] = None) -> Comparison:
    """Run ``compare_options(opts)`` twice, DeepSpeed alone (``without_fix``) and then with
    ``ds_z3native.install()``, on the same model, data and ranks. Raises :class:`DemoRefused` as
    :func:`run_demo` does (``without_fix`` in ``opts`` is refused: the comparison runs both)."""
    if opts.without_fix:
        raise DemoRefused("--compare runs DeepSpeed alone and then with ds_z3native: leave out "
                          "--without-fix")
    opts = compare_options(opts)
    _resolve(opts)  # refuse before the first run starts
    stream = stream if stream is not None else sys.stderr
    results = []
    for label, without_fix in (("DeepSpeed alone", True), ("with ds_z3native", False)):
        log_dir = os.path.join(opts.log_dir, "without-fix" if without_fix else "with-fix") \
            if opts.log_dir else None
        if opts.progress:
            stream.write(f"[{len(results) + 1}/2] {label}\n")
        results.append(run_demo(replace(opts, without_fix=without_fix, log_dir=log_dir), stream))
    return Comparison(*results)


def _where(err: Dict[str, Any]) -> str:
    """Where a run failed: " at step N", " in engine.compile()", " in set-up" or ""."""
    if err.get("step") is not None:
        return f" at step {err['step'] + 1}"
    return f" in {err['stage']}" if err.get("stage") else ""


def _outcome(result: DemoResult) -> str:
    if result.exit_code == EXIT_OK:
        return "OK"
    err = result.error or {}
    return f"FAILED{_where(err)}: {err.get('type', '?')}"


def _first_lines(message: str) -> List[str]:
    """What the comparison shows of an error: its first line and, for a failed build (whose next
    lines are compiler command lines), the compiler's first ``error:`` line."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return []
    shown = [lines[0]]
    if lines[0].startswith("Error building extension"):
        shown = [lines[0].split(":", 1)[0]]
        shown += [ln for ln in lines[1:] if "error:" in ln][:1]
    return shown


def _median_step(result: DemoResult) -> Optional[float]:
    _, steady = _steady(result)
    return statistics.median(steady) if steady else None


def _gain(c: Comparison) -> str:
    """One line: what ds_z3native changed in this comparison."""
    version = c.fixed.deepspeed_version or c.alone.deepspeed_version or "?"
    if c.fixed.exit_code != EXIT_OK:
        return ("the run failed with ds_z3native too (above); please report it with "
                "`ds-z3native doctor --json` and the rank logs")
    if c.alone.exit_code != EXIT_OK:
        err = c.alone.error or {}
        return (f"with ds_z3native this run trains; DeepSpeed {version} alone fails "
                f"({err.get('type', '?')}{_where(err)})")
    alone, fixed = _median_step(c.alone), _median_step(c.fixed)
    speed = (f"; steady step {alone:.3f} s alone, {fixed:.3f} s with ds_z3native "
             f"({alone / fixed:.2f}x)" if alone and fixed else "")
    return f"both train: DeepSpeed {version} runs this without ds_z3native{speed}"


def format_comparison(c: Comparison) -> str:
    """The side-by-side table printed after ``--compare``, the error of a run that failed, and
    one line on what ds_z3native changed."""
    opts = c.fixed.options
    mode = "DeepCompile" if opts.get("deepcompile") else "eager"
    head = (f"DeepSpeed {c.fixed.deepspeed_version or c.alone.deepspeed_version or '?'} / torch "
            f"{c.fixed.torch_version or c.alone.torch_version or '?'}: Llama "
            f"'{opts['model_size']}' with LoRA, ZeRO-3 ({mode}), non-reentrant checkpointing, "
            f"{c.fixed.world_size} rank(s) on {c.fixed.device.upper()}")

    def cells(r: DemoResult) -> List[str]:
        median = _median_step(r)
        start, _ = _steady(r)
        return [_outcome(r), f"{len(r.losses)} of {opts['steps']}",
                f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else "-",
                f"{median:.3f} s (steps {start + 1}-{len(r.step_seconds)})" if median else "-",
                _fmt_bytes(r.peak_memory_bytes) if r.peak_memory_bytes else "-",
                f"{r.wall_seconds:.1f} s", r.log_dir]

    kind = c.fixed.peak_memory_kind or c.alone.peak_memory_kind or "peak"
    names = ["outcome", "steps", "loss first -> last", "step time, median", f"{kind}, rank 0",
             "wall time", "rank logs"]
    rows = [("", "DeepSpeed alone", "with ds_z3native")]
    rows += list(zip(names, cells(c.alone), cells(c.fixed)))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    out = [head, ""] + [f"  {a.ljust(w0)}  {b.ljust(w1)}  {d}".rstrip() for a, b, d in rows]
    for label, r in (("DeepSpeed alone", c.alone), ("with ds_z3native", c.fixed)):
        err = r.error
        if err is None:
            continue
        where = f"rank {err['rank']}" if err.get("rank") is not None else "the run"
        out += ["", f"{label}: {err['type']} ({where}{_where(err)})"]
        out += [f"  {ln[:200]}" for ln in _first_lines(err["message"])]
        if err.get("why"):
            out.append(f"why: {err['why']}")
    out += ["", f"fix: {_fix_row(c.fixed.fix)}", f"gain: {_gain(c)}"]
    return "\n".join(out)
