"""Native reduce/gather microbenchmark: ds_z3native's dc op vs DeepSpeed's own, one graph.

500 params of mixed sizes (deterministic), 90% frozen, some small enough to be persistent
(``stage3_param_persistence_threshold``), registered as DeepCompile's ``init_z3`` registers them
and driven as a compiled ZeRO-3 graph drives them, through the module functions and
``torch.ops.dc``:

* forward: ``allgather_param`` / ``wait_allgather`` / ``release_param`` of every param in order;
* backward: ``start_backward(True)``, the same gathers in reverse order, ``reduce_grad`` of every
  trainable param (a gradient tensor made once), ``end_backward`` (which ends the step: an
  optimizer step follows).

Per implementation (``ours``; ``deepspeed``: ``DeepCompileBuilder().load()``, CUDA only), each in
processes of its own since both register ``torch.ops.dc``: per-step, forward (gather) and
backward (gather + reduce) times in ms over the timed steps, peak memory, and the collectives of
a step: all-gathers, reduce-scatters, bucket flushes and bytes, at the first step and at a later
one, with the all-gather bytes of the persistent frozen params split out (gathered once, or
again every step). ours counts with ``comm_stats()``; DeepSpeed's op has no counters, so its
collectives are counted in a separate, untimed run from NCCL's own log
(``NCCL_DEBUG_SUBSYS=COLL``), split per category by marker all-reduces. The per-category count
of ours happens in untimed steps only (the first warm-up and one after the timed steps).

``per_call_us`` separates the op calls' own host cost from the step: microseconds per
allgather/wait/release triple on a persistent param already gathered (``kept``: dispatch and
bookkeeping only) and of the smallest non-persistent one (``gathered``: a real all-gather and
free each time), over 2,000 calls each, after the steps.

``python -m bench native_micro [--smoke]`` runs it through the suite
(``bench/benchmarks/native_micro.py`` registers it);
``python -m bench.native_micro --impl ours --ranks 2 --smoke --output x.json`` runs one
implementation alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import math
import os
import random
import re
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ds_z3native.launch import RanksFailed, run_ranks
from bench.core.schema import peak_memory_gib, summarize, versions

log = logging.getLogger("bench.native_micro")

__all__ = ["ParamSpec", "MicroConfig", "make_params", "deepspeed_op_available", "run_impl",
           "measure", "main"]

GRAPH = 0
# Calls per probe of the op calls' host cost (_Driver.probe).
PROBE_CALLS = 2000
PROBE_CALLS_SMOKE = 200
N_PARAMS = 500
FROZEN_SHARE = 0.9
# Shapes of a Llama-1B-like layer stack (hidden 2048, MLP 5632, LoRA r=16), plus odd sizes.
FULL_SHAPES: Tuple[Tuple[int, ...], ...] = (
    (2048, 2048), (5632, 2048), (2048, 5632), (2048,), (16, 2048), (2048, 16), (256, 2048),
    (4096,), (1000, 3), (7,))
SMOKE_DIVISOR = 32
FULL_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
SMOKE_PERSISTENCE = 100
CATEGORIES = ("frozen", "trainable", "persistent_frozen", "persistent_trainable")
MARKER_BASE = 7_770_000  # element count of the marker all-reduces in the NCCL log
IMPLS = ("ours", "deepspeed")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One registered param."""

    ds_id: int
    shape: Tuple[int, ...]
    frozen: bool
    persistent: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def category(self) -> str:
        return ("persistent_" if self.persistent else "") + ("frozen" if self.frozen
                                                             else "trainable")


@dataclasses.dataclass
class MicroConfig:
    """Size and length of a run."""

    smoke: bool = False
    n_params: int = N_PARAMS
    frozen_share: float = FROZEN_SHARE
    ranks: int = 1
    warmup: int = 2
    steps: int = 20
    bucket_elems: int = 1 << 24
    dtype: str = "bf16"
    seed: int = 0

    def __post_init__(self) -> None:
        # The first step is the cold one whose collectives are counted per category; it must
        # not be a timed one.
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"native_micro needs warmup >= 1 and steps >= 1, got warmup="
                             f"{self.warmup}, steps={self.steps}")

    @classmethod
    def for_mode(cls, smoke: bool, ranks: Optional[int] = None,
                 steps: Optional[int] = None) -> "MicroConfig":
        """The full (GPU) or smoke (CPU toy) configuration."""
        if smoke:
            return cls(smoke=True, ranks=ranks or 2, warmup=1, steps=steps or 3,
                       bucket_elems=1 << 14, dtype="fp32")
        return cls(ranks=ranks or 1, steps=steps or 20)


def make_params(cfg: MicroConfig) -> List[ParamSpec]:
    """The params of a run: shapes drawn from ``FULL_SHAPES`` (divided by ``SMOKE_DIVISOR`` at
    smoke size) by a seeded generator; every tenth param trainable (90% frozen); persistent
    when at most the persistence threshold."""
    rng = random.Random(cfg.seed)
    threshold = SMOKE_PERSISTENCE if cfg.smoke else FULL_PERSISTENCE
    every = max(1, round(1 / (1 - cfg.frozen_share))) if cfg.frozen_share < 1 else 0
    params = []
    for i in range(cfg.n_params):
        shape = rng.choice(FULL_SHAPES)
        if cfg.smoke:
            shape = tuple(max(1, math.ceil(d / SMOKE_DIVISOR)) if d > 64 else d for d in shape)
        frozen = not (every and i % every == every - 1)
        params.append(ParamSpec(i, shape, frozen, math.prod(shape) <= threshold))
    return params


def deepspeed_op_available() -> Tuple[bool, str]:
    """Whether DeepSpeed's own dc op can run here, and why not (checked without loading it)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return False, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return False, ("DeepSpeed's dc op (DeepCompileBuilder) is CUDA-only (NCCL, CUDA "
                       "streams); this host has no CUDA")
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
        from deepspeed.ops.op_builder import DeepCompileBuilder

        if not DeepCompileBuilder().is_compatible(verbose=False):
            return False, "DeepCompileBuilder().is_compatible() is False on this host"
    except Exception as e:  # noqa: BLE001 - any reason is the answer
        return False, f"DeepSpeed's DeepCompileBuilder not usable: {type(e).__name__}: {e}"
    return True, ""


# ------------------------------------------------------------------------------ in a rank

def _compile_config() -> types.SimpleNamespace:
    # The attributes both ops read at init (DeepSpeed 0.19.8's CompileConfig has them all).
    return types.SimpleNamespace(double_buffer=True, symmetric_memory=False,
                                 free_activation_threshold=0, sync_before_reduce=False,
                                 sync_after_reduce=False, sync_before_allgather=False,
                                 sync_after_allgather=False, offload_activation_pin_memory=False)


class _Driver:
    """One implementation's module and the registered graph, in one rank."""

    def __init__(self, impl: str, cfg: MicroConfig, params: Sequence[ParamSpec], rank: int,
                 world_size: int, device: Any, marker: bool) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if impl == "ours":
            import ds_z3native

            self.m = ds_z3native.native()
        else:
            from deepspeed.ops.op_builder import DeepCompileBuilder

            self.m = DeepCompileBuilder().load()
        self.impl, self.params, self.device, self.marker = impl, list(params), device, marker
        self.dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.has_stats = hasattr(self.m, "comm_stats")
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.m.init(dist.new_group(backend=backend), _compile_config(), cfg.bucket_elems)
        g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
        self.grads: Dict[int, Any] = {}
        for p in self.params:
            n = math.ceil(p.numel / world_size)
            shard = torch.randn(n, generator=g).to(device=device, dtype=self.dtype)
            buf = (torch.empty(0, device=device, dtype=self.dtype) if p.frozen
                   else torch.zeros(n, device=device, dtype=self.dtype))
            self.m.register_z3_param(p.ds_id, list(p.shape), shard, buf, p.persistent, self.dtype)
            if not p.frozen:
                self.grads[p.ds_id] = torch.randn(p.shape, generator=g).to(device=device,
                                                                          dtype=self.dtype)
        self.m.register_graph_z3(GRAPH, [p.ds_id for p in self.params])
        self.ph = torch.empty(0, device=device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _mark(self, code: int) -> None:
        # An all-reduce of MARKER_BASE + code elements: a line in the NCCL log that tells which
        # category the collectives after it belong to.
        if self.marker:
            self.dist.all_reduce(self.torch.zeros(MARKER_BASE + code, device=self.device))

    def _stats(self) -> Optional[Dict[str, int]]:
        return dict(self.m.comm_stats()) if self.has_stats else None

    def _gather(self, p: ParamSpec, per_cat: Optional[Dict[str, Dict[str, int]]]) -> None:
        ops = self.torch.ops.dc
        self._mark(CATEGORIES.index(p.category))
        before = self._stats() if per_cat is not None else None
        t = ops.wait_allgather(ops.allgather_param(self.ph, GRAPH, p.ds_id), GRAPH, p.ds_id)
        ops.release_param(t, GRAPH, p.ds_id, 1)
        if per_cat is not None and before is not None:
            after = self._stats()
            cat = per_cat.setdefault(p.category, {"allgather_calls": 0, "allgather_bytes": 0})
            for k in cat:
                cat[k] += after[k] - before[k]  # type: ignore[index]

    def step(self, account: bool = False) -> Dict[str, Any]:
        """One forward + backward; times in ms, and (``account``) collectives per category."""
        ops = self.torch.ops.dc
        per_cat: Optional[Dict[str, Dict[str, int]]] = {} if account else None
        if self.has_stats:
            self.m.reset_comm_stats()
        self.sync()
        t0 = time.perf_counter()
        for p in self.params:
            self._gather(p, per_cat)
        self.sync()
        t1 = time.perf_counter()
        self.m.start_backward(True)
        deps = []
        for p in reversed(self.params):
            self._gather(p, per_cat)
            if not p.frozen:
                self._mark(len(CATEGORIES))
                deps.append(ops.reduce_grad(self.grads[p.ds_id], GRAPH, p.ds_id))
        self._mark(len(CATEGORIES) + 1)
        ops.end_backward(deps, GRAPH, True)
        self.sync()
        t2 = time.perf_counter()
        self._mark(len(CATEGORIES) + 2)
        return {"step_ms": (t2 - t0) * 1e3, "forward_ms": (t1 - t0) * 1e3,
                "backward_ms": (t2 - t1) * 1e3, "comm": self._stats(), "per_category": per_cat}

    def probe(self, calls: int) -> Dict[str, float]:
        """Host cost of the op calls themselves: microseconds per allgather/wait/release triple
        on one param, repeated ``calls`` times. ``kept``: a persistent param already gathered
        (no collective, no allocation: dispatch and bookkeeping only); ``gathered``: the
        smallest non-persistent param (a real all-gather and free each time)."""
        ops = self.torch.ops.dc
        kept = next((p for p in self.params if p.persistent), None)
        small = min((p for p in self.params if not p.persistent), key=lambda p: p.numel,
                    default=None)
        out: Dict[str, float] = {}
        for name, p in (("kept", kept), ("gathered", small)):
            if p is None:
                continue
            for timed in (False, True):  # an untimed pass first: gathers the persistent one
                self.sync()
                t0 = time.perf_counter()
                for _ in range(calls if timed else 10):
                    t = ops.wait_allgather(ops.allgather_param(self.ph, GRAPH, p.ds_id), GRAPH,
                                           p.ds_id)
                    ops.release_param(t, GRAPH, p.ds_id, 1)
                self.sync()
            out[name] = (time.perf_counter() - t0) / calls * 1e6
        return out

    def close(self) -> None:
        self.m.cleanup()


def _rank_main(rank: int, world_size: int, impl: str, cfg_dict: Dict[str, Any],
               account_only: bool) -> Dict[str, Any]:
    """One rank: init the process group, drive the op; rank 0's result (others: ``ok`` only)."""
    cfg = MicroConfig(**cfg_dict)
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not cfg.smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    driver = _Driver(impl, cfg, make_params(cfg), rank, world_size, device, marker=account_only)
    result: Dict[str, Any] = {"ok": True}
    if account_only:  # DeepSpeed's op under NCCL's COLL log: two steps, markers on
        driver.step()
        driver.step()
    else:
        # Per-category accounting (a comm_stats() call around every gather) runs in the first
        # warm-up step and in one untimed step after the timed ones, never in a timed step:
        # DeepSpeed's op has no counters and would not pay for it.
        steps = []
        for i in range(cfg.warmup + cfg.steps):
            steps.append(driver.step(account=i == 0 and driver.has_stats))
            if rank == 0 and (i + 1) % 10 == 0:
                logging.getLogger("bench.native_micro").info(
                    "%s: step %d/%d", impl, i + 1, cfg.warmup + cfg.steps)
        accounted = driver.step(account=driver.has_stats)
        per_call_us = driver.probe(PROBE_CALLS_SMOKE if cfg.smoke else PROBE_CALLS)
        peak, kind = peak_memory_gib(device.type)
        result.update(steps=steps, accounted_step=accounted, per_call_us=per_call_us,
                      peak_gib=peak, peak_kind=kind,
                      device=torch.cuda.get_device_name() if cuda else "cpu")
    driver.close()
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else {"ok": True}


def _spawn(impl: str, cfg: MicroConfig, env: Dict[str, str], account_only: bool,
           timeout: float) -> Dict[str, Any]:
    """Run ``cfg.ranks`` fresh processes of ``_rank_main`` with ``env`` set; rank 0's result, or
    ``ok`` False and the error of each failed rank."""
    try:
        results = run_ranks(_rank_main, cfg.ranks, impl, dataclasses.asdict(cfg), account_only,
                            env=env, timeout=timeout, name=f"native-micro-{impl}-rank")
    except RanksFailed as e:
        return {"ok": False, "error": str(e)}
    return results[0]


_NCCL_LINE = re.compile(r"\b(AllGather|ReduceScatter|AllReduce|Broadcast|Reduce)\b: opCount \S+"
                        r".*?\bcount (\d+) datatype (\d+).*?\[nranks=(\d+)\]")
_NCCL_DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}


def parse_nccl_coll_log(text: str) -> List[Dict[str, Any]]:
    """Per step (split by the step-end markers), the collectives NCCL logged
    (``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL``): counts and bytes per category, as
    ``comm_stats()`` counts them (all-gather bytes: received per rank)."""
    steps: List[Dict[str, Any]] = [_empty_counts()]
    category = "other"
    names = list(CATEGORIES) + ["reduce", "end_backward"]
    for m in _NCCL_LINE.finditer(text):
        op, count, dtype, nranks = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        if op == "AllReduce" and MARKER_BASE <= count < MARKER_BASE + 100:
            code = count - MARKER_BASE
            if code == len(CATEGORIES) + 2:
                steps.append(_empty_counts())
                category = "other"
            else:
                category = names[code] if code < len(names) else "other"
            continue
        nbytes = count * _NCCL_DTYPE_BYTES.get(dtype, 0)
        cur = steps[-1]
        if op == "AllGather":
            cur["allgather_calls"] += 1
            cur["allgather_bytes"] += nbytes * nranks
            cat = cur["per_category"].setdefault(category, {"allgather_calls": 0,
                                                            "allgather_bytes": 0})
            cat["allgather_calls"] += 1
            cat["allgather_bytes"] += nbytes * nranks
        elif op == "ReduceScatter":
            cur["reduce_scatter_calls"] += 1
            cur["reduce_scatter_bytes"] += nbytes * nranks
        elif op == "AllReduce":
            cur["allreduce_calls"] += 1
            cur["allreduce_bytes"] += nbytes
    return [s for s in steps if s["allgather_calls"] or s["reduce_scatter_calls"]]


def _empty_counts() -> Dict[str, Any]:
    return {"allgather_calls": 0, "allgather_bytes": 0, "reduce_scatter_calls": 0,
            "reduce_scatter_bytes": 0, "allreduce_calls": 0, "allreduce_bytes": 0,
            "bucket_flushes": None, "per_category": {}}


def _collectives(first: Optional[Dict[str, Any]], later: Optional[Dict[str, Any]],
                 source: str) -> Dict[str, Any]:
    def persistent_frozen(s: Optional[Dict[str, Any]]) -> Optional[int]:
        if not s or s.get("per_category") is None:
            return None
        return int(s["per_category"].get("persistent_frozen", {}).get("allgather_bytes", 0))

    def totals(s: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        return None if s is None else {k: v for k, v in s.items() if k != "per_category"}

    return {"source": source, "first_step": totals(first), "later_step": totals(later),
            "persistent_frozen_allgather_bytes": {"first_step": persistent_frozen(first),
                                                  "later_step": persistent_frozen(later)},
            "per_category": {"first_step": (first or {}).get("per_category"),
                             "later_step": (later or {}).get("per_category")}}


def run_impl(impl: str, cfg: MicroConfig, timeout: float = 1800.0) -> Dict[str, Any]:
    """Benchmark one implementation in fresh processes; its run record (suite format)."""
    log.info("%s: %d ranks, %d params, %d warm-up + %d timed steps", impl, cfg.ranks,
             cfg.n_params, cfg.warmup, cfg.steps)
    env = {"DS_ACCELERATOR": "cpu"} if cfg.smoke else {}
    res = _spawn(impl, cfg, env, account_only=False, timeout=timeout)
    if not res.get("ok"):
        return {"variant": impl, "status": "failed", "error": res.get("error")}
    steps = res["steps"]
    timed = steps[cfg.warmup:]
    record: Dict[str, Any] = {
        "variant": impl, "status": "ok",
        "step_ms": summarize([s["step_ms"] for s in timed]),
        "forward_gather_ms": summarize([s["forward_ms"] for s in timed]),
        "backward_gather_reduce_ms": summarize([s["backward_ms"] for s in timed]),
        "peak_gib": res["peak_gib"], "peak_kind": res["peak_kind"], "device": res["device"],
        "per_call_us": res["per_call_us"],
    }
    if steps[0].get("comm") is not None:
        last = res["accounted_step"]
        first, later = dict(steps[0]["comm"]), dict(last["comm"])
        first["per_category"], later["per_category"] = (steps[0]["per_category"],
                                                         last["per_category"])
        record["collectives"] = _collectives(first, later, "comm_stats()")
        record["collectives"]["timed_steps_identical"] = all(
            s["comm"] == timed[0]["comm"] for s in timed + [last])
    else:
        record["collectives"] = _count_with_nccl_log(impl, cfg, timeout)
    return record


def _count_with_nccl_log(impl: str, cfg: MicroConfig, timeout: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL",
               "NCCL_DEBUG_FILE": os.path.join(d, "nccl.%h.%p.log")}
        # The account-only run makes two steps of its own (the cold one, one later), whatever
        # cfg's warm-up and timed steps say.
        res = _spawn(impl, cfg, env, account_only=True, timeout=timeout)
        if not res.get("ok"):
            return {"source": "NCCL COLL log", "error": res.get("error")}
        texts = [Path(p).read_text(errors="replace") for p in sorted(glob.glob(
            os.path.join(d, "nccl.*.log")))]
        # Rank 0's file: the one that logged the most (every rank logs the same collectives).
        steps = max((parse_nccl_coll_log(t) for t in texts), key=len, default=[])
    if len(steps) < 2:
        return {"source": "NCCL COLL log", "error": f"found {len(steps)} step(s) in NCCL's log"}
    return _collectives(steps[0], steps[1], "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL, separate "
                                            "untimed run")


def _setup(cfg: MicroConfig, params: Sequence[ParamSpec]) -> Dict[str, Any]:
    cats = {c: [p for p in params if p.category == c] for c in CATEGORIES}
    return {
        "params": len(params), "frozen": sum(p.frozen for p in params),
        "trainable": sum(not p.frozen for p in params),
        "persistent": sum(p.persistent for p in params),
        "numel": {c: sum(p.numel for p in ps) for c, ps in cats.items()},
        "count": {c: len(ps) for c, ps in cats.items()},
        "shapes": sorted({str(list(p.shape)) for p in params}),
        "persistence_threshold": SMOKE_PERSISTENCE if cfg.smoke else FULL_PERSISTENCE,
        "ranks": cfg.ranks, "dtype": cfg.dtype, "bucket_elems": cfg.bucket_elems,
        "warmup": cfg.warmup, "steps": cfg.steps, "seed": cfg.seed, "graphs": 1,
        "step": "forward: allgather/wait/release every param; backward: start_backward(True), "
                "allgather/wait/release in reverse, reduce_grad per trainable, end_backward",
    }


def measure(cfg: MicroConfig, timeout: float) -> Dict[str, Any]:
    """Both implementations at ``cfg`` (DeepSpeed's where its op is available and the run is not
    a smoke run): the result's setup, versions and runs."""
    params = make_params(cfg)
    runs: Dict[str, Any] = {"ours": run_impl("ours", cfg, timeout)}
    ok, reason = deepspeed_op_available()
    if cfg.smoke and ok:  # the toy run is CPU-only; DeepSpeed's op needs NCCL
        ok, reason = False, "smoke run (CPU, gloo): DeepSpeed's dc op runs in the full run only"
    runs["deepspeed"] = (run_impl("deepspeed", cfg, timeout) if ok else
                         {"variant": "deepspeed", "status": "not_available", "reason": reason})
    device = runs["ours"].get("device") or ("cpu" if cfg.smoke else None)
    return {"setup": _setup(cfg, params), "versions": versions(device), "runs": runs}


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m bench.native_micro``: one implementation, one JSON record."""
    p = argparse.ArgumentParser(prog="python -m bench.native_micro", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--impl", choices=IMPLS, default="ours")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = MicroConfig.for_mode(args.smoke, args.ranks, args.steps)
    record = run_impl(args.impl, cfg)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0 if record.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
