"""The native runtime's lifetime: calls racing cleanup(), init() and reset() from other threads,
init() refusals, and tensors whose memory is gone.

Every case that crashed or hung before runs in a fresh interpreter (or in spawned ranks), so a
segfault or a deadlock is a failed test, not a dead pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Dict, List

import pytest
import torch

from helpers.dist import run_python, run_ranks
from helpers.native_rt import compile_config, live_runtime, local_group

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SUBPROCESS_ENV = {"PYTHONPATH": os.pathsep.join(
    filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))}
PH = torch.empty(0)

# Messages a call racing cleanup()/init()/reset() may end with: each names what is missing.
_RACE_ERRORS = ("not initialized", "unknown graph_id", "unknown ds_id",
                "is not gathered",  # released on a runtime that replaced the one it gathered on
                "no backward has begun")  # ended on a runtime that replaced the one it began on

_PRELUDE = r'''
import json, threading, torch, torch.distributed as dist
from helpers.dist import free_port
from helpers.native_rt import compile_config
import ds_z3native

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
m = ds_z3native.native()
dc = torch.ops.dc
SHARD = torch.arange(64.0)

def setup():
    m.register_z3_param(1, [8, 8], SHARD, torch.zeros(64), False)
    m.register_graph_z3(0, [1])

def report(errors, done):
    kinds = sorted({f"{type(e).__name__}: {str(e).splitlines()[0]}" for e in errors})
    print(json.dumps({"done": done, "errors": kinds[:20]}), flush=True)
'''


def _run(script: str, timeout: float = 90.0) -> Dict[str, Any]:
    """Runs ``script`` after _PRELUDE in a fresh interpreter; returns its JSON lines merged."""
    try:
        proc = run_python(_PRELUDE + script, timeout=timeout, env=SUBPROCESS_ENV)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout:.0f} s (deadlock)")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stderr[-3000:]}"
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, proc.stderr[-3000:]
    merged: Dict[str, Any] = {}
    for line in lines:
        merged.update(line)
    return merged


def _assert_clear(errors: List[str]) -> None:
    bad = [e for e in errors
           if not e.startswith("RuntimeError: ds_z3native ") or not any(s in e for s in _RACE_ERRORS)]
    assert not bad, bad


def test_reset_from_another_thread_while_gathering_does_not_deadlock() -> None:
    # reset() used to wait for the runtime's lock holding the GIL, while the gathering thread held
    # the lock and needed the GIL to drop the gathered copy it had handed to Python.
    r = _run(r'''
m.init(dist.new_group(backend="gloo"), compile_config(), 1 << 16)
setup()
errors, stop = [], threading.Event()

def gather():
    # Under saved-tensor hooks (as in a checkpointed forward) the gather copies Python objects,
    # which takes the GIL, while it holds the runtime's lock.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        while not stop.is_set():
            try:
                t = dc.allgather_param(torch.empty(0), 0, 1)
                assert torch.equal(t.reshape(-1), SHARD)
                dc.release_param(t, 0, 1, 1)
            except Exception as e:
                errors.append(e)

worker = threading.Thread(target=gather)
worker.start()
for _ in range(3000):
    m.reset()
    m.register_graph_z3(0, [1])
stop.set()
worker.join()
m.cleanup()
report(errors, True)
''')
    assert r["done"]
    _assert_clear(r["errors"])


@pytest.mark.parametrize("what", ["cleanup_init", "init"])
def test_cleanup_and_init_from_another_thread_while_ops_run(what: str) -> None:
    # The runtime used to be freed under running ops (SIGSEGV, shapes read from freed memory).
    # Now each call holds the runtime it started on: it completes on it, or, started after the
    # swap, gets an error naming what the new runtime lacks. A result is always exact.
    r = _run(f"WHAT = {what!r}\n" + r'''
pg = dist.new_group(backend="gloo")
m.init(pg, compile_config(), 1 << 16)
setup()
errors, stop, calls = [], threading.Event(), [0]

def ops():
    while not stop.is_set():
        calls[0] += 1
        try:
            t = dc.allgather_param(torch.empty(0), 0, 1)
            assert t.shape == (8, 8) and torch.equal(t.reshape(-1), SHARD), t.shape
            m.start_backward(True)
            dc.reduce_grad(torch.ones(8, 8), 0, 1)
            dc.end_backward([None], 0)
            dc.release_param(t, 0, 1, 1)
        except Exception as e:
            errors.append(e)

workers = [threading.Thread(target=ops)]  # one: two would release each other's gathers
for w in workers:
    w.start()
for i in range(2000):
    if WHAT == "cleanup_init":
        m.cleanup()
    m.init(pg, compile_config(), 1 << 16)
    if i % 2 == 0:
        setup()
stop.set()
for w in workers:
    w.join()
# Afterwards, on a runtime nobody swaps, results are exact.
m.init(pg, compile_config(), 1 << 16)
buf = torch.zeros(64)
m.register_z3_param(1, [8, 8], SHARD, buf, False)
m.register_graph_z3(0, [1])
exact = torch.equal(dc.allgather_param(torch.empty(0), 0, 1).reshape(-1), SHARD)
m.start_backward(True)
dc.reduce_grad(torch.full((8, 8), 2.0), 0, 1)
dc.end_backward([None], 0)
m.cleanup()
print(json.dumps({"calls": calls[0]}), flush=True)
report(errors, exact and torch.equal(buf, torch.full((64,), 2.0)))
''')
    assert r["done"], "the results after the swaps were not exact"
    assert r["calls"] > 0
    _assert_clear(r["errors"])


def _cleanup_while_a_gather_waits(rank: int, world_size: int) -> Dict[str, Any]:
    import threading
    import time

    import torch.distributed as dist

    import ds_z3native
    from helpers.native_rt import compile_config as config

    m = ds_z3native.native()
    store = dist.distributed_c10d._get_default_store()
    m.init(dist.group.WORLD, config(), 1 << 16)
    m.register_z3_param(1, [8], torch.arange(4.0) + 4 * rank, torch.Tensor(), False)
    m.register_graph_z3(0, [1])
    dist.barrier()
    if rank == 1:
        store.wait(["cleaned"])  # rank 0's gather waits in gloo for this one
        got = torch.ops.dc.allgather_param(torch.empty(0), 0, 1).tolist()
        m.cleanup()
        return {"gathered": got}
    out: Dict[str, Any] = {}

    def gather() -> None:
        out["gathered"] = torch.ops.dc.allgather_param(torch.empty(0), 0, 1).tolist()

    worker = threading.Thread(target=gather, daemon=True)
    worker.start()
    time.sleep(1)  # lets the gather reach gloo; the outcome is the same if it has not yet
    m.cleanup()  # the gather holds the runtime: it ends when the gather returns
    out["initialized_after_cleanup"] = m.is_initialized()
    store.set("cleaned", "1")
    worker.join(timeout=60)
    out["worker_done"] = not worker.is_alive()
    return out


def test_cleanup_while_a_gather_waits_on_the_other_rank() -> None:
    r0, r1 = run_ranks(_cleanup_while_a_gather_waits, 2, timeout=120)
    assert r0["worker_done"] and r0["initialized_after_cleanup"] is False
    assert r0["gathered"] == r1["gathered"] == [float(i) for i in range(8)]


def test_released_tensor_is_never_read() -> None:
    # release_param frees the gathered memory under every view: reading such a view segfaulted.
    # On one rank a gather in the shard's own dtype is the shard itself and its release frees
    # nothing; a gather in another dtype is a copy, freed at its release.
    proc = run_python(_PRELUDE + r'''
m.init(dist.new_group(backend="gloo"), compile_config(), 1 << 16)
setup()
m.register_z3_param(2, [4], torch.arange(4.0), torch.zeros(4), False)
m.register_graph_z3(1, [1, 2])
s = dc.allgather_param(torch.empty(0), 0, 1)
dc.release_param(s, 0, 1, 1)
out = {"shard_after_release": torch.equal(s.reshape(-1), SHARD)}
t = dc.allgather_param(torch.empty(0), 0, 1, torch.float64)
dc.release_param(t, 0, 1, 1)
m.start_backward(True)
for name, fn in {"reduce_grad": lambda: dc.reduce_grad(t, 0, 1),
                 "offload_tensor": lambda: dc.offload_tensor(t, 0, 7),
                 "test_call": lambda: dc.test_call(t)}.items():
    try:
        fn()
        out[name] = "accepted"
    except RuntimeError as e:
        out[name] = str(e).splitlines()[0]
# A ZeRO-3 shard whose storage was freed after registration, and the same for a grad buffer.
m.register_z3_param(3, [4], torch.arange(4.0), torch.zeros(4), False)
m.register_graph_z3(2, [3])
shard = torch.arange(4.0)
buf = torch.zeros(4)
m.register_z3_param(3, [4], shard, buf, False)
shard.untyped_storage().resize_(0)
for name, fn in {"allgather_param": lambda: dc.allgather_param(torch.empty(0), 2, 3),
                 "prefetch_params_fused": lambda: dc.prefetch_params_fused(2, [torch.empty(0)], [3]),
                 "set_persistent": lambda: m.set_persistent(3)}.items():
    try:
        fn()
        out[name] = "accepted"
    except RuntimeError as e:
        out[name] = str(e).splitlines()[0]
out["gathered_after"] = m.param_state(3)["gathered"]
buf.untyped_storage().resize_(0)
try:
    dc.reduce_grad(torch.ones(4), 2, 3)
    out["reduce_into_freed_buffer"] = "accepted"
except RuntimeError as e:
    out["reduce_into_freed_buffer"] = str(e).splitlines()[0]
dc.end_backward([None], 0)
# The runtime still works.
g = torch.ones(4) * 3
m.register_z3_param(2, [4], torch.arange(4.0), buf2 := torch.zeros(4), False)
dc.reduce_grad(g, 1, 2)
dc.end_backward([None], 1)
out["valid_after"] = torch.equal(buf2, g)
m.cleanup()
print(json.dumps(out), flush=True)
''', env=SUBPROCESS_ENV)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("reduce_grad", "offload_tensor", "test_call"):
        assert name in out[name] and "has no data" in out[name], out
    assert "ds_id 1 " in out["reduce_grad"] and "activation id 7" in out["offload_tensor"]
    for name in ("allgather_param", "prefetch_params_fused", "set_persistent"):
        assert name in out[name] and "shard of ds_id 3 has no data" in out[name], out
    assert out["gathered_after"] is False
    assert "grad buffer of ds_id 3 has no data" in out["reduce_into_freed_buffer"], out
    assert out["valid_after"] is True
    assert out["shard_after_release"] is True


@pytest.mark.parametrize("bad", [dict(bucket_size=0), dict(free_activation_threshold=-1),
                                 dict(group=None)], ids=["bucket_size_0", "threshold", "no_group"])
def test_refused_init_keeps_the_live_runtime(bad: Dict[str, Any]) -> None:
    import ds_z3native

    with live_runtime() as m:
        shard = torch.arange(6.0)
        m.register_z3_param(4, [6], shard, torch.zeros(6), False)
        m.register_graph_z3(0, [4])
        config = compile_config(**{k: v for k, v in bad.items() if k == "free_activation_threshold"})
        with pytest.raises((RuntimeError, TypeError), match=r"init|process_group|incompatible"):
            m.init(bad.get("group", local_group()), config, bad.get("bucket_size", 1024))
        assert m.is_initialized() and ds_z3native.native() is m
        assert torch.equal(torch.ops.dc.allgather_param(PH, 0, 4), shard)


def test_refused_init_names_the_value() -> None:
    with live_runtime() as m:
        with pytest.raises(RuntimeError, match=r"init: initial_reduce_bucket_size must be >= 1, got 0"):
            m.init(local_group(), compile_config(), 0)
        with pytest.raises(RuntimeError, match=r"init: free_activation_threshold must be >= 0, got -5"):
            m.init(local_group(), compile_config(free_activation_threshold=-5), 1024)
        assert m.is_initialized()
