"""A seeded random campaign of dc op and module-function sequences against the native runtime.

Each case (one seed) starts a fresh runtime over the given process group, registers a few ZeRO-3
params, and runs a random sequence of calls drawn from valid calls and bad ones (unknown ids,
overflowing or negative shapes, small or meta or freed buffers, unsupported dtypes, released
tensors, gathers in other dtypes, release/wait without a gather, changes that would drop a
queued gradient, non-bool flags, refused init()s, reset()). Every call must either succeed or
raise a RuntimeError/TypeError naming the op and one of the ids or values it was given. A Python
model follows what succeeded; gathers that succeed must equal the model exactly, and at the end
of each case the runtime must still gather every param exactly and reduce a fresh gradient into
every trainable one exactly (a refused call that changed state shows up there).

Every rank draws the same calls from the same seed (only shard and gradient values differ by
rank), so errors are the same on every rank and collectives stay matched.
"""

from __future__ import annotations

import random
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["run_campaign"]

PH = torch.empty(0)
GATHER_DTYPES: List[Optional[torch.dtype]] = [None, None, torch.float32, torch.bfloat16,
                                              torch.float16, torch.int32, torch.complex64,
                                              torch.float8_e4m3fn, torch.bool]
CHECK_GRAPH = 999_999


def _config(**kw: Any) -> types.SimpleNamespace:
    values = dict(double_buffer=True, symmetric_memory=False, free_activation_threshold=0,
                  sync_before_reduce=False, sync_after_reduce=False, sync_before_allgather=False,
                  sync_after_allgather=False)
    values.update(kw)
    return types.SimpleNamespace(**values)


def _per_rank(numel: int, ws: int) -> int:
    return -(-numel // ws)


class _Param:
    def __init__(self, ds_id: int, shape: List[int], ws: int, rank: int, seed: int) -> None:
        numel = 1
        for d in shape:
            numel *= d
        self.ds_id, self.shape, self.numel = ds_id, shape, numel
        # Values exact in float32 and distinct per element, id and seed.
        self.full = (torch.arange(numel, dtype=torch.float32) + ds_id * 1000 + seed % 997) / 4
        n = _per_rank(numel, ws)
        padded = torch.zeros(n * ws)
        padded[:numel] = self.full
        self.shard = padded[rank * n:(rank + 1) * n].clone()
        self.per_rank = n
        self.buf: Optional[torch.Tensor] = None
        self.frozen = True
        self.persistent = False


class _Campaign:
    def __init__(self, m: Any, pg: Any, rank: int, ws: int, seed: int,
                 stats: Dict[str, Any]) -> None:
        self.m, self.pg, self.rank, self.ws, self.seed = m, pg, rank, ws, seed
        self.rng = random.Random(seed)
        self.dc = torch.ops.dc
        self.stats = stats
        self.params: Dict[int, _Param] = {}
        self.graphs: Dict[int, List[int]] = {}
        self.held: List[Tuple[int, torch.Tensor]] = []  # (ds_id, gathered tensor) handed out
        self.call = 0

    # --------------------------------------------------------------------------- recording

    def _do(self, op: str, needles: Sequence[Any], fn: Callable[[], Any]) -> Tuple[bool, Any]:
        self.call += 1
        key = f"{op}"
        try:
            out = fn()
        except (RuntimeError, TypeError) as e:
            text = str(e)
            msg = text.splitlines()[0] if text else ""
            named_op = op in msg
            # pybind's TypeError gives the values on its last line ("Invoked with: ...").
            named_value = any(str(n) in text for n in needles) if needles else True
            if not (named_op and named_value) or (
                    isinstance(e, RuntimeError) and not msg.startswith("ds_z3native ")):
                self.stats["unclear"].append(f"seed {self.seed} call {self.call} {op}: "
                                             f"{type(e).__name__}: {msg[:300]}")
            self.stats["refused"][key] = self.stats["refused"].get(key, 0) + 1
            return False, None
        except Exception as e:  # noqa: BLE001 - any other type is a finding
            self.stats["unclear"].append(f"seed {self.seed} call {self.call} {op}: "
                                         f"{type(e).__name__}: {str(e)[:300]}")
            return False, None
        self.stats["ok"][key] = self.stats["ok"].get(key, 0) + 1
        return True, out

    def _mismatch(self, what: str) -> None:
        self.stats["mismatch"].append(f"seed {self.seed} call {self.call}: {what}")

    # ----------------------------------------------------------------------------- pickers

    def _any_id(self) -> int:
        ids = list(self.params)
        if ids and self.rng.random() < 0.85:
            return self.rng.choice(ids)
        return self.rng.choice([424242, -1, 2**40])

    def _any_graph(self) -> int:
        gids = list(self.graphs)
        if gids and self.rng.random() < 0.85:
            return self.rng.choice(gids)
        return self.rng.choice([777777, -5])

    def _shape(self) -> List[int]:
        r = self.rng.random()
        if r < 0.08:
            return self.rng.choice([[274177, 67280421310721], [2**32, 2**32], [3, -2], [2**62, 4]])
        return [self.rng.randint(1, 5) for _ in range(self.rng.randint(1, 3))]

    def _grad(self, p: Optional[_Param]) -> Tuple[torch.Tensor, str]:
        numel = p.numel if p is not None else 4
        r = self.rng.random()
        if r < 0.55:
            return torch.full((numel,), float(self.rank + 1)), "valid"
        if r < 0.65:
            return torch.ones(numel + 1), "size"
        if r < 0.72:
            return torch.ones(numel, dtype=torch.int64), "int"
        if r < 0.79:
            return torch.ones(numel).to(torch.float8_e4m3fn), "fp8"
        if r < 0.86:
            return torch.empty(numel, device="meta"), "meta"
        if self.held:
            return self.held[-1][1], "held"
        return torch.ones(numel, dtype=torch.bfloat16), "bf16"

    # ------------------------------------------------------------------------------- ops

    def register(self) -> None:
        ds_id = self.rng.choice(list(self.params) + [len(self.params) + 1] * 2)
        shape = self._shape()
        valid_shape = all(d >= 0 for d in shape) and len(shape) <= 3 and max(shape) < 2**20
        p = _Param(ds_id, shape if valid_shape else [4], self.ws, self.rank, self.seed)
        shard = p.shard
        r = self.rng.random()
        if r < 0.5:
            buf: Optional[torch.Tensor] = torch.full((p.per_rank,), 7.0)  # zeroed by the runtime
        elif r < 0.65:
            buf = None
        elif r < 0.72:
            buf = torch.zeros(max(0, p.per_rank - 1))
        elif r < 0.78:
            buf = torch.zeros(p.per_rank, dtype=torch.int32)
        elif r < 0.84:
            buf = torch.empty(p.per_rank, device="meta")
        elif r < 0.9:
            shard = torch.ones(p.per_rank + 1)
            buf = torch.zeros(p.per_rank)
        else:
            buf = torch.zeros(p.per_rank)
            shard = p.shard.clone()
            shard.untyped_storage().resize_(0)
        persistent = self.rng.random() < 0.2
        expected = self.rng.choice([None] * 6 + [torch.float8_e4m3fn, torch.int32])
        ok, _ = self._do("register_z3_param", [ds_id],
                         lambda: self.m.register_z3_param(ds_id, shape, shard, buf, persistent,
                                                          expected))
        if ok:
            if not valid_shape or shard is not p.shard or expected is not None:
                self._mismatch(f"register_z3_param accepted {shape} / shard {tuple(shard.shape)}"
                               f" / expected {expected}")
                return
            p.buf = buf if buf is not None and buf.numel() > 0 else None
            p.frozen = p.buf is None
            p.persistent = persistent
            self.params[ds_id] = p
            self.held = [(i, t) for i, t in self.held if i != ds_id]

    def register_graph(self) -> None:
        gid = self.rng.choice([1, 2, 3])
        ids = [self._any_id() for _ in range(self.rng.randint(1, 3))]
        if self.rng.random() < 0.5:
            ids = list(dict.fromkeys(ids))
        ok, _ = self._do("register_graph_z3", [gid] + ids,
                         lambda: self.m.register_graph_z3(gid, ids))
        if ok:
            self.graphs[gid] = ids

    def _member(self) -> Tuple[int, int]:
        gid = self._any_graph()
        ids = self.graphs.get(gid)
        if ids and self.rng.random() < 0.85:
            return gid, self.rng.choice(ids)
        return gid, self._any_id()

    def _check_gathered(self, ds_id: int, t: torch.Tensor, dtype: Optional[torch.dtype]) -> None:
        p = self.params[ds_id]
        want = p.full.view(p.shape)
        if dtype is not None:
            want = want.to(dtype)
        if t.shape != want.shape or t.dtype != want.dtype or not torch.equal(t, want):
            self._mismatch(f"allgather_param ds_id {ds_id} dtype {dtype}: got {t.flatten()[:6]}"
                           f" {t.dtype}, want {want.flatten()[:6]}")

    def allgather(self) -> None:
        gid, ds_id = self._member()
        dtype = self.rng.choice(GATHER_DTYPES)
        ok, t = self._do("allgather_param", [gid, ds_id],
                         lambda: self.dc.allgather_param(PH, gid, ds_id, dtype=dtype))
        if ok:
            t = self.dc.wait_allgather(t, gid, ds_id)
            self._check_gathered(ds_id, t, dtype)
            self.held.append((ds_id, t))

    def prefetch(self) -> None:
        gid = self._any_graph()
        ids = list(dict.fromkeys(self._member()[1] for _ in range(self.rng.randint(1, 3))))
        dtypes = [self.rng.choice(GATHER_DTYPES[2:]) for _ in ids]
        use_dtypes = self.rng.random() < 0.6
        self._do("prefetch_params_fused", [gid] + ids,
                 lambda: self.dc.prefetch_params_fused(gid, [PH] * len(ids), ids,
                                                       dtypes if use_dtypes else None))

    def wait(self) -> None:
        gid, ds_id = self._member()
        self._do("wait_allgather", [gid, ds_id], lambda: self.dc.wait_allgather(PH, gid, ds_id))

    def release(self) -> None:
        gid, ds_id = self._member()
        n_users = self.rng.choice([1, 1, 1, 2, 0, -3])
        t = next((t for i, t in reversed(self.held) if i == ds_id), PH)
        self._do("release_param", [gid, ds_id, n_users],
                 lambda: self.dc.release_param(t, gid, ds_id, n_users))

    def reduce(self) -> None:
        gid, ds_id = self._member()
        grad, _ = self._grad(self.params.get(ds_id))
        self._do("reduce_grad", [gid, ds_id], lambda: self.dc.reduce_grad(grad, gid, ds_id))

    def end_backward(self) -> None:
        gid = self._any_graph()
        self._do("end_backward", [gid],
                 lambda: self.dc.end_backward([None], gid, self.rng.random() < 0.5))

    def start_backward(self) -> None:
        flag = self.rng.choice([True, False, True, None, 1.0])
        self._do("start_backward", [repr(flag)], lambda: self.m.start_backward(flag))

    def set_frozen(self) -> None:
        ds_id = self._any_id()
        frozen = self.rng.choice([True, False, None])
        ok, _ = self._do("set_param_frozen", [ds_id, repr(frozen)],
                         lambda: self.m.set_param_frozen(ds_id, frozen))
        if ok:
            self.params[ds_id].frozen = frozen

    def set_persistent(self) -> None:
        ds_id = self._any_id()
        ok, _ = self._do("set_persistent", [ds_id], lambda: self.m.set_persistent(ds_id))
        if ok:
            self.params[ds_id].persistent = True

    def invalidate(self) -> None:
        if self.rng.random() < 0.5:
            ds_id = self._any_id()
            self._do("invalidate_gathered_param", [ds_id],
                     lambda: self.m.invalidate_gathered_param(ds_id))
        else:
            self._do("clear_all_gathered_params", [], self.m.clear_all_gathered_params)

    def update_buffer(self) -> None:
        ds_id = self._any_id()
        p = self.params.get(ds_id)
        n = p.per_rank if p is not None else 4
        buf = self.rng.choice([torch.zeros(n), torch.zeros(max(0, n - 1)), torch.empty(0)])
        ok, _ = self._do("update_param_grad_buffer", [ds_id],
                         lambda: self.m.update_param_grad_buffer(ds_id, buf, 0))
        if ok:
            p.buf = buf if buf.numel() > 0 else None

    def read_held(self) -> None:
        t = self.held[-1][1] if self.held and self.rng.random() < 0.8 else torch.ones(3)
        gid = self._any_graph()
        which = self.rng.choice(["test_call", "offload_tensor"])
        if which == "test_call":
            ok, out = self._do("test_call", ["tensor"], lambda: self.dc.test_call(t))
        else:
            # offload_tensor returns a stand-in; the values come back through the reload.
            def round_trip() -> torch.Tensor:
                standin = self.dc.wait_offload(self.dc.offload_tensor(t, gid, 5), gid, 5)
                return self.dc.wait_reload(self.dc.reload_tensor(standin, gid, 5), gid, 5)

            ok, out = self._do("offload_tensor", [gid, 5], round_trip)
        if ok and not torch.equal(out, t):
            self._mismatch(f"{which} returned other values")

    def activation(self) -> None:
        gid = self._any_graph()
        aid = self.rng.choice([5, 6, 123456])
        op = self.rng.choice(["reload_tensor", "wait_offload", "wait_reload"])
        self._do(op, [gid, aid], lambda: getattr(self.dc, op)(PH, gid, aid))

    def param_offload(self) -> None:
        gid, ds_id = self._member()
        op = self.rng.choice(["offload_parameter", "reload_parameter"])
        self._do(op, [gid, ds_id], lambda: getattr(self.dc, op)(PH, gid, ds_id))

    def meta_op(self) -> None:
        gid, ds_id = self._member()
        meta = torch.empty(4, device="meta")
        op = self.rng.choice(["wait_allgather", "release_param", "reduce_grad"])
        args = (meta, gid, ds_id, 1) if op == "release_param" else (meta, gid, ds_id)
        self._do(op, [gid, ds_id], lambda: getattr(self.dc, op)(*args))

    def bad_init(self) -> None:
        choice = self.rng.choice(["bucket", "threshold"])
        if choice == "bucket":
            self._do("init", [0], lambda: self.m.init(self.pg, _config(), 0))
        else:
            self._do("init", [-7], lambda: self.m.init(
                self.pg, _config(free_activation_threshold=-7), 1 << 12))

    def reset(self) -> None:
        self._do("reset", [], self.m.reset)
        self.graphs.clear()

    OPS: List[Tuple[str, float]] = [
        ("register", 1.5), ("register_graph", 1.0), ("allgather", 2.0), ("prefetch", 1.0),
        ("wait", 0.7), ("release", 1.5), ("reduce", 2.0), ("end_backward", 1.0),
        ("start_backward", 1.0), ("set_frozen", 0.6), ("set_persistent", 0.4),
        ("invalidate", 0.5), ("update_buffer", 0.5), ("read_held", 0.8), ("activation", 0.4),
        ("param_offload", 0.3), ("meta_op", 0.5), ("bad_init", 0.2), ("reset", 0.2)]

    # ------------------------------------------------------------------------------ case

    def run(self, n_calls: int) -> None:
        self.m.init(self.pg, _config(), self.rng.choice([8, 64, 1 << 12]))
        try:
            for _ in range(self.rng.randint(1, 3)):
                self.register()
            self.register_graph()
            names = [n for n, _ in self.OPS]
            weights = [w for _, w in self.OPS]
            for _ in range(n_calls):
                getattr(self, self.rng.choices(names, weights)[0])()
            try:
                self.final_check()
            except Exception as e:  # noqa: BLE001 - a poisoned runtime is a finding
                self._mismatch(f"final check: {type(e).__name__}: {str(e)[:300]}")
        finally:
            self.m.cleanup()

    def final_check(self) -> None:
        """The runtime still gathers and reduces every param exactly."""
        m, dc = self.m, self.dc
        self.held.clear()
        ids = list(self.params)
        if not ids:
            return
        m.reset()
        m.register_graph_z3(CHECK_GRAPH, ids)
        m.start_backward(False)  # the sequence may have drawn none: end_backward needs one
        try:
            dc.end_backward([None], CHECK_GRAPH)  # flushes what the sequence left queued
        except RuntimeError as e:
            self._mismatch(f"flushing the queued gradients failed: {e}")
        m.clear_all_gathered_params()
        for ds_id in ids:
            p = self.params[ds_id]
            t = dc.allgather_param(PH, CHECK_GRAPH, ds_id)
            self._check_gathered(ds_id, dc.wait_allgather(t, CHECK_GRAPH, ds_id), None)
            if not p.persistent:
                dc.release_param(t, CHECK_GRAPH, ds_id, 1)
            state = m.param_state(ds_id)
            if state["frozen"] != p.frozen:
                self._mismatch(f"ds_id {ds_id} frozen {state['frozen']}, model {p.frozen}")
        m.start_backward(True)
        dc.end_backward([None], CHECK_GRAPH)  # closes the window: the next gradients overwrite
        m.start_backward(True)
        expected: Dict[int, torch.Tensor] = {}
        for ds_id in ids:
            p = self.params[ds_id]
            grad = (torch.arange(p.numel, dtype=torch.float32) + 1) * (self.rank + 1)
            reducible = not p.frozen and p.buf is not None and p.buf.numel() >= p.per_rank
            try:
                dc.reduce_grad(grad.view(p.shape), CHECK_GRAPH, ds_id)
                if not reducible:
                    self._mismatch(f"ds_id {ds_id} reduced but the model says it cannot be")
            except RuntimeError:
                if reducible:
                    self._mismatch(f"ds_id {ds_id} refused a valid gradient")
                continue
            mean = (torch.arange(p.numel, dtype=torch.float32) + 1) * sum(
                r + 1 for r in range(self.ws)) / self.ws
            padded = torch.zeros(p.per_rank * self.ws)
            padded[:p.numel] = mean
            expected[ds_id] = padded[self.rank * p.per_rank:(self.rank + 1) * p.per_rank]
        dc.end_backward([None], CHECK_GRAPH)
        for ds_id, want in expected.items():
            got = self.params[ds_id].buf[:want.numel()]
            if not torch.equal(got, want):
                self._mismatch(f"ds_id {ds_id} reduced {got[:6]}, want {want[:6]}")
        self.stats["checked"] += 1


def run_campaign(pg: Any, seeds: Sequence[int], rank: int = 0, world_size: int = 1,
                 calls_per_case: int = 14, on_case: Optional[Callable[[int], None]] = None
                 ) -> Dict[str, Any]:
    """Runs one case per seed; returns counts of accepted and refused calls per op, the refusals
    that did not name op and value ("unclear"), and exactness failures ("mismatch")."""
    import ds_z3native

    m = ds_z3native.native()
    stats: Dict[str, Any] = {"ok": {}, "refused": {}, "unclear": [], "mismatch": [], "cases": 0,
                             "checked": 0}
    for seed in seeds:
        if on_case is not None:
            on_case(seed)
        _Campaign(m, pg, rank, world_size, seed, stats).run(calls_per_case)
        stats["cases"] += 1
    return stats
