"""Every H row of the hardening table in docs/design.md as behaviour: each test fails on DeepSpeed
0.19.x's weak behaviour.

H8 (NCCL return codes) needs NCCL: tests/gpu/test_nccl_native.py. H12 (the whole op on CPU) is
shown by tests/test_native_gloo.py, which runs gathers, padded reduce-scatter with averaging,
buckets, release, prefetch, persistence and ZeRO-1/2 over gloo. Crash-prone cases (H4, H9, H10,
H11) run in a fresh interpreter, so an abort or a segfault is a failure, not a dead pytest.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List

import pytest
import torch
import torch.utils.checkpoint

import ds_z3native
from helpers.dist import run_python
from helpers.native_rt import live_runtime, per_rank
from helpers.native_scenarios import BUCKET, GARBAGE, Z3_PARAMS, scenario

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SUBPROCESS_ENV = {"PYTHONPATH": os.pathsep.join(
    filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))}
PH = torch.empty(0)  # what DeepCompile passes for a released ZeRO-3 param


def _dc():
    return torch.ops.dc


def _stats_unchanged_collectives(m) -> Dict[str, int]:
    s = m.comm_stats()
    return {k: s[k] for k in ("reduce_scatter_calls", "allreduce_calls", "bucket_flushes")}


NO_COLLECTIVE = {"reduce_scatter_calls": 0, "allreduce_calls": 0, "bucket_flushes": 0}


def _assert_gradient_refused(m, ds_id: int, grad: torch.Tensor, match: str) -> None:
    """In a backward pass of graph 0, reduce_grad(grad) for ``ds_id`` raises ``match``; the pass
    ends without a collective."""
    m.reset_comm_stats()
    m.start_backward(True)
    with pytest.raises(RuntimeError, match=match):
        _dc().reduce_grad(grad, 0, ds_id)
    _dc().end_backward([None], 0)
    assert _stats_unchanged_collectives(m) == NO_COLLECTIVE


# ---------------------------------------------------------------------------------------- H1

def test_h1_empty_and_undefined_buffers_register_frozen() -> None:
    with live_runtime() as m:
        m.register_z3_param(1, [4], torch.randn(4), torch.Tensor(), False)      # >= 0.19.6
        m.register_z3_param(2, [4], torch.randn(4), None, False)                # undefined
        m.register_z3_param(3, [4], torch.randn(4), torch.empty([0], dtype=torch.bfloat16), False)
        m.register_z3_param(4, [4], torch.randn(4), torch.zeros(4), False)
        assert [m.is_param_frozen(i) for i in (1, 2, 3, 4)] == [True, True, True, False]
        assert m.param_state(1)["frozen"] and m.param_state(1)["grad_numel"] == 0
        # The explicit flag, settable from Python, both ways.
        m.set_param_frozen(4, True)
        assert m.is_param_frozen(4) and m.param_state(4)["frozen"]
        m.set_param_frozen(4, False)
        assert not m.is_param_frozen(4)
        m.set_param_frozen(1, False)
        assert not m.is_param_frozen(1)


# ---------------------------------------------------------------------------------------- H2

def test_h2_gradient_for_frozen_param_raises_without_collective() -> None:
    with live_runtime() as m:
        m.register_z3_param(1, [3], torch.randn(3), torch.Tensor(), False)
        buf = torch.zeros(5)
        m.register_z3_param(2, [5], torch.randn(5), buf, False)
        m.register_graph_z3(0, [1, 2])
        m.reset_comm_stats()
        m.start_backward(True)
        g2 = torch.randn(5)
        _dc().reduce_grad(g2, 0, 2)  # queued before the refused one: must still arrive
        with pytest.raises(RuntimeError, match=r"reduce_grad.*ds_id 1 .*frozen"):
            _dc().reduce_grad(torch.ones(3), 0, 1)
        assert m.comm_stats()["reduce_scatter_calls"] == 0
        _dc().end_backward([None], 0)
        assert m.comm_stats()["reduce_scatter_calls"] == 1  # only ds_id 2's
        assert torch.equal(buf, g2)
        assert not m.param_state(1)["grad_accumulated"]


def test_h2_explicitly_frozen_param_refused() -> None:
    with live_runtime() as m:
        buf = torch.zeros(3)
        m.register_z3_param(1, [3], torch.randn(3), buf, False)
        m.register_graph_z3(0, [1])
        m.set_param_frozen(1, True)
        _assert_gradient_refused(m, 1, torch.ones(3), r"reduce_grad.*ds_id 1 .*frozen")
        assert torch.equal(buf, torch.zeros(3))


def test_h2_freezing_a_param_with_a_queued_gradient_is_refused() -> None:
    """Freezing while its gradient waits in a bucket would make the flush drop it: refused, the
    gradient lands. (A flush that finds a frozen param anyway reduces the bucket's other
    gradients and names the refused one: tests/native/test_reduce.cpp.)"""
    with live_runtime() as m:
        buf = torch.zeros(3)
        m.register_z3_param(1, [3], torch.randn(3), buf, False)
        m.register_graph_z3(0, [1])
        m.reset_comm_stats()
        m.start_backward(True)
        _dc().reduce_grad(torch.ones(3), 0, 1)
        with pytest.raises(RuntimeError, match=r"set_param_frozen: ds_id 1 has a gradient queued"):
            m.set_param_frozen(1, True)
        assert not m.is_param_frozen(1)
        _dc().end_backward([None], 0)
        assert torch.equal(buf, torch.ones(3))
        m.set_param_frozen(1, True)
        _assert_gradient_refused(m, 1, torch.ones(3), r"reduce_grad.*ds_id 1 .*frozen")


def test_h2_unfrozen_param_without_buffer_raises() -> None:
    """Registered frozen (empty buffer), unfrozen after initialize: DeepSpeed reduce-scatters
    with receive count 0 and drops the gradient."""
    with live_runtime() as m:
        m.register_z3_param(7, [6], torch.randn(6), torch.Tensor(), False)
        m.register_graph_z3(0, [7])
        m.set_param_frozen(7, False)
        _assert_gradient_refused(m, 7, torch.ones(6),
                                 r"reduce_grad.*ds_id 7 .*grad buffer of 0 elements")
        assert not m.param_state(7)["grad_accumulated"]


# ---------------------------------------------------------------------------------------- H3

def test_h3_buffer_checked_at_registration() -> None:
    with live_runtime() as m:
        with pytest.raises(RuntimeError, match=r"register_z3_param.*ds_id 3 .*6 elements.*7"):
            m.register_z3_param(3, [7], torch.randn(7), torch.zeros(6), False)
        with pytest.raises(RuntimeError, match=r"register_z3_param.*ds_id 3 .*floating point.*Long"):
            m.register_z3_param(3, [7], torch.randn(7), torch.zeros(7, dtype=torch.long), False)
        with pytest.raises(RuntimeError, match=r"register_z3_param.*ds_id 3 .*Int"):
            m.register_z3_param(3, [7], torch.randn(7), torch.zeros(7), False, torch.int32)
        m.register_z3_param(3, [7], torch.randn(7), torch.zeros(7), False)
        with pytest.raises(RuntimeError, match=r"update_param_grad_buffer.*ds_id 3 .*5 elements"):
            m.update_param_grad_buffer(3, torch.zeros(5), 0)
        with pytest.raises(RuntimeError, match=r"register_param.*ds_id 9\b.*does not fit"):
            m.register_param(9, [4], torch.randn(4), torch.zeros(3), 2)


@pytest.mark.parametrize("ws", [2, 3])
def test_h3_small_buffer_at_world_size(ws: int) -> None:
    need = per_rank(15, ws)
    for r in scenario(ws, "z3"):
        msg = r["small_buffer_error"]
        assert "register_z3_param" in msg and "ds_id 99 " in msg, msg
        assert f"has {need - 1} elements" in msg and f"ceil(15 / {ws}) = {need}" in msg, msg


def test_h3_gradient_and_buffer_checked_at_reduce() -> None:
    with live_runtime() as m:
        m.register_z3_param(3, [7], torch.randn(7), torch.zeros(7), False)
        m.register_graph_z3(0, [3])
        m.reset_comm_stats()
        m.start_backward(True)
        with pytest.raises(RuntimeError, match=r"reduce_grad.*ds_id 3 .*6 elements.*7"):
            _dc().reduce_grad(torch.ones(6), 0, 3)
        with pytest.raises(RuntimeError, match=r"reduce_grad.*ds_id 3 .*floating point"):
            _dc().reduce_grad(torch.ones(7, dtype=torch.int64), 0, 3)
        # A buffer taken away after registration (empty, as DeepSpeed's ZeRO-1 hook passes) is
        # caught when the gradient arrives.
        m.update_param_grad_buffer(3, torch.empty(0), 0)
        with pytest.raises(RuntimeError, match=r"reduce_grad.*ds_id 3 .*grad buffer of 0"):
            _dc().reduce_grad(torch.ones(7), 0, 3)
        _dc().end_backward([None], 0)
        assert _stats_unchanged_collectives(m) == NO_COLLECTIVE


# ---------------------------------------------------------------------------------------- H4

_H4_SCRIPT = r'''
import json, sys
import torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from helpers.dist import free_port
from helpers.native_rt import compile_config
import ds_z3native

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
m = ds_z3native.native()
dc = torch.ops.dc
G, ID, ACT = 90001, 90002, 90003   # unknown graph, param and activation ids
PH = torch.empty(0)
t = torch.ones(4)

def case(name, expect, fn):
    print(json.dumps({"case": name, "started": True}), flush=True)
    try:
        fn()
        r = {"case": name, "expect": expect, "type": None, "msg": ""}
    except BaseException as e:
        r = {"case": name, "expect": expect, "type": type(e).__name__, "msg": str(e).splitlines()[0]}
    print(json.dumps(r), flush=True)

def cases_without_runtime():
    for name, fn in [("allgather_param", lambda: dc.allgather_param(PH, 0, 1)),
                     ("reduce_grad", lambda: dc.reduce_grad(t, 0, 1)),
                     ("end_backward", lambda: dc.end_backward(None, 0)),
                     ("register_z3_param", lambda: m.register_z3_param(1, [4], t, t, False)),
                     ("register_graph_z3", lambda: m.register_graph_z3(0, [1])),
                     ("start_backward", lambda: m.start_backward(True)),
                     ("set_persistent", lambda: m.set_persistent(1))]:
        case(f"uninitialized:{name}", [name, "not initialized"], fn)

cases_without_runtime()
m.init(dist.new_group(backend="gloo"), compile_config(), 1024)
m.register_z3_param(1, [4], torch.randn(4), torch.zeros(4), False)
m.register_z3_param(2, [4], torch.randn(4), torch.zeros(4), False)
m.register_graph_z3(0, [1])
dc.offload_tensor(torch.ones(2), 0, 5)

graph_ops = {
    "allgather_param": lambda g, i: dc.allgather_param(PH, g, i),
    "prefetch_params_fused": lambda g, i: dc.prefetch_params_fused(g, [PH], [i]),
    "wait_allgather": lambda g, i: dc.wait_allgather(t, g, i),
    "release_param": lambda g, i: dc.release_param(t, g, i, 1),
    "reduce_grad": lambda g, i: dc.reduce_grad(t, g, i),
    "offload_parameter": lambda g, i: dc.offload_parameter(PH, g, i),
    "reload_parameter": lambda g, i: dc.reload_parameter(PH, g, i),
}
for op, fn in graph_ops.items():
    case(f"unknown_graph:{op}", [op, f"graph_id {G}"], lambda: fn(G, 1))
    case(f"unknown_id:{op}", [op, f"ds_id {ID}"], lambda: fn(0, ID))
    case(f"not_in_graph:{op}", [op, "ds_id 2 ", "graph 0"], lambda: fn(0, 2))
for op, fn in {"end_backward": lambda g: dc.end_backward(None, g, True),
               "offload_tensor": lambda g: dc.offload_tensor(t, g, 5),
               "reload_tensor": lambda g: dc.reload_tensor(t, g, 5),
               "wait_offload": lambda g: dc.wait_offload(t, g, 5),
               "wait_reload": lambda g: dc.wait_reload(t, g, 5)}.items():
    case(f"unknown_graph:{op}", [op, f"graph_id {G}"], lambda: fn(G))
for op, fn in {"reload_tensor": lambda: dc.reload_tensor(t, 0, ACT),
               "wait_offload": lambda: dc.wait_offload(t, 0, ACT),
               "wait_reload": lambda: dc.wait_reload(t, 0, ACT)}.items():
    case(f"unknown_activation:{op}", [op, f"id {ACT}"], fn)

def meta_gather():
    with FakeTensorMode():
        dc.allgather_param(torch.empty(0), 0, ID)
case("unknown_id:allgather_param(meta)", ["allgather_param (meta)", f"ds_id {ID}"], meta_gather)

functions = {
    "register_graph_z3": lambda: m.register_graph_z3(4, [1, ID]),
    "set_persistent": lambda: m.set_persistent(ID),
    "set_param_frozen": lambda: m.set_param_frozen(ID, True),
    "is_param_frozen": lambda: m.is_param_frozen(ID),
    "invalidate_gathered_param": lambda: m.invalidate_gathered_param(ID),
    "update_param_grad_buffer": lambda: m.update_param_grad_buffer(ID, t, 0),
    "param_state": lambda: m.param_state(ID),
}
for op, fn in functions.items():
    case(f"unknown_id:{op}", [op, f"ds_id {ID}"], fn)

# A graph dropped by reset() (DeepSpeed resets before a recompile) is unknown afterwards.
m.register_graph_z3(3, [1])
m.reset()
for op, fn in graph_ops.items():
    case(f"after_reset:{op}", [op, "graph_id 3"], lambda: fn(3, 1))
case("after_reset:end_backward", ["end_backward", "graph_id 3"], lambda: dc.end_backward(None, 3))
m.cleanup()
print(json.dumps({"done": True}), flush=True)
'''


def _json_lines(stdout: str) -> List[dict]:
    """The JSON records of ``stdout``; a line cut short by a crash is left out, so that the exit
    code (asserted next, naming the case that was running) reports the crash."""
    records = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def test_h4_unknown_ids_raise_naming_id_and_op() -> None:
    proc = run_python(_H4_SCRIPT, env=SUBPROCESS_ENV)
    records = _json_lines(proc.stdout)
    started = [r["case"] for r in records if r.get("started")]
    assert proc.returncode == 0, (f"exit code {proc.returncode} during case {started[-1:]}\n"
                                  f"{proc.stderr[-3000:]}")
    assert records and records[-1] == {"done": True}
    results = [r for r in records if "expect" in r]
    assert len(results) == len(started) >= 40
    bad = [r for r in results
           if r["type"] != "RuntimeError" or not all(s in r["msg"] for s in r["expect"])]
    assert not bad, "\n".join(f"{r['case']}: {r['type']}: {r['msg']!r} (wanted {r['expect']})"
                              for r in bad)


# ---------------------------------------------------------------------------------------- H5

def _bucket_groups(padded: List[int], capacity: int) -> List[List[int]]:
    groups: List[List[int]] = [[]]
    used = 0
    for i, n in enumerate(padded):
        if used > 0 and used + n > capacity:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


@pytest.mark.parametrize("ws", [2, 3])
def test_h5_odd_sizes_padded_slots_zeroed(ws: int) -> None:
    trainable = [i for i, (_, frozen, _) in Z3_PARAMS.items() if not frozen]
    numel = {i: torch.Size(Z3_PARAMS[i][0]).numel() for i in trainable}
    padded = [per_rank(numel[i], ws) * ws for i in trainable]
    groups = [[trainable[k] for k in g] for g in _bucket_groups(padded, BUCKET)]
    # The design: an odd-sized param shares its bucket with the next one, and one with fewer
    # elements than ranks ends its bucket (see helpers/native_scenarios.py).
    assert any(g[:2] == [10, 11] for g in groups) and numel[10] % ws != 0
    assert any(g[-1] == 12 for g in groups) and numel[12] < ws
    for rank, r in enumerate(scenario(ws, "z3")):
        assert r["reduce_stats"]["bucket_flushes"] == 3 * len(groups)  # three backward passes
        for window, per_param in r["reduce"].items():
            for ds_id, (got, expected) in per_param.items():
                slot = per_rank(numel[ds_id], ws)
                real = max(0, min(slot, numel[ds_id] - rank * slot))
                torch.testing.assert_close(got[:real], expected[:real])
                # Padding is exactly zero: no neighbour's gradient, no stale bucket memory,
                # not the GARBAGE the buffer held before.
                assert torch.equal(got[real:], torch.zeros(slot - real)), (
                    f"rank {rank} {window} ds_id {ds_id}: padding {got[real:].tolist()}")
                assert not torch.any(got == GARBAGE)


# ---------------------------------------------------------------------------------------- H6

def test_h6_register_again_replaces() -> None:
    with live_runtime() as m:
        old_shard, new_shard = torch.full((4,), 1.0), torch.full((4,), 2.0)
        old_buf, new_buf = torch.zeros(4), torch.zeros(4)
        m.register_z3_param(5, [2, 2], old_shard, old_buf, True)
        m.register_graph_z3(0, [5])
        assert torch.equal(_dc().allgather_param(PH, 0, 5), old_shard.view(2, 2))
        m.register_z3_param(5, [4], new_shard, new_buf, False)
        m.reset_comm_stats()
        got = _dc().allgather_param(PH, 0, 5)
        assert got.shape == (4,) and torch.equal(got, new_shard)
        assert m.comm_stats()["allgather_calls"] == 1  # the old gathered copy was dropped
        assert not m.param_state(5)["persistent"]
        m.start_backward(True)
        g = torch.randn(4)
        _dc().reduce_grad(g, 0, 5)
        _dc().end_backward([None], 0)
        assert torch.equal(new_buf, g) and torch.equal(old_buf, torch.zeros(4))
        m.register_z3_param(5, [4], new_shard, torch.Tensor(), False)
        assert m.is_param_frozen(5)


# ---------------------------------------------------------------------------------------- H7

def test_h7_frozen_persistent_gathered_once() -> None:
    steps = 3
    with live_runtime() as m:
        trainable, frozen, frozen_late = torch.zeros(6), torch.randn(5), torch.randn(3)
        m.register_z3_param(1, [6], trainable, torch.zeros(6), True)
        m.register_z3_param(2, [5], frozen, torch.Tensor(), True)
        m.register_z3_param(3, [3], frozen_late, torch.Tensor(), False)
        m.register_graph_z3(0, [1, 2, 3])
        m.reset_comm_stats()
        m.set_persistent(3)  # DeepSpeed's selective-gather pass
        calls = []
        for step in range(steps):
            m.start_backward(True)
            for ds_id, ref in ((1, trainable), (2, frozen), (3, frozen_late)):
                got = _dc().wait_allgather(_dc().allgather_param(PH, 0, ds_id), 0, ds_id)
                assert torch.equal(got, ref), (step, ds_id)
                _dc().release_param(got, 0, ds_id, 1)
            _dc().reduce_grad(torch.ones(6), 0, 1)
            _dc().end_backward([None], 0)
            assert m.param_state(2)["valid"] and m.param_state(3)["valid"]
            assert not m.param_state(1)["valid"]
            trainable.add_(1.0)  # the optimizer step updates the trainable shard
            calls.append(m.comm_stats()["allgather_calls"])
        # Step 0: 3 gathers (1, 2; 3 at set_persistent); later steps re-gather only 1.
        assert calls == [3 + k for k in range(steps)]


# ---------------------------------------------------------------------------------------- H9

_H9_DEFINE_DC = '''
import torch
lib = torch.library.Library("dc", "DEF")  # another library got there first
lib.define("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor")
'''


def test_h9_dc_namespace_taken_raises() -> None:
    proc = run_python(_H9_DEFINE_DC + '''
import ds_z3native
try:
    ds_z3native.native()
except ds_z3native.DcNamespaceTaken as e:
    print("TAKEN:", e)
else:
    print("LOADED")
''', env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("TAKEN:"), proc.stdout + proc.stderr[-2000:]
    assert re.search(r"already registered by another library \(schema defined at \S*<string>",
                     proc.stdout), proc.stdout


def test_h9_loading_the_extension_anyway_aborts() -> None:
    """What the check prevents: the shared object's TORCH_LIBRARY(dc) aborts the process."""
    proc = run_python(_H9_DEFINE_DC + '''
import ds_z3native._C
print("LOADED")
''', env=SUBPROCESS_ENV)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "Only a single TORCH_LIBRARY can be used to register the namespace dc" in proc.stderr


# --------------------------------------------------------------------------------------- H10

_H10_SCRIPT = '''
import torch, torch.distributed as dist
from helpers.dist import free_port
from helpers.native_rt import compile_config
import ds_z3native

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
m = ds_z3native.native()
m.init(dist.new_group(backend="gloo"), compile_config(), 1024)
m.register_z3_param(1, [4], torch.randn(4), torch.zeros(4), False)
m.init(dist.new_group(backend="gloo"), compile_config(), 1024)  # replaces the first runtime
try:
    m.is_param_frozen(1)
    print("STALE")
except RuntimeError as e:
    assert "ds_id 1" in str(e)
m.cleanup()
m.cleanup()
assert not m.is_initialized()
m.init(dist.new_group(backend="gloo"), compile_config(), 1024)
shard = torch.randn(4)
m.register_z3_param(1, [4], shard, torch.zeros(4), True)
m.register_graph_z3(0, [1])
assert torch.equal(torch.ops.dc.allgather_param(torch.empty(0), 0, 1), shard)
if DESTROY:
    dist.destroy_process_group()
print("EXITING")  # no cleanup(): the interpreter exits with the runtime alive
'''


@pytest.mark.parametrize("destroy_group", [False, True], ids=["group_alive", "group_destroyed"])
def test_h10_init_twice_cleanup_twice_exit_without_cleanup(destroy_group: bool) -> None:
    proc = run_python(f"DESTROY = {destroy_group}\n" + _H10_SCRIPT, env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "EXITING" and "STALE" not in proc.stdout
    for sign in ("terminate called", "Aborted", "Segmentation fault", "Traceback"):
        assert sign not in proc.stderr, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------- H11

def test_h11_test_call_prints_nothing() -> None:
    proc = run_python('''
import sys, torch, ds_z3native
ds_z3native.native()
sys.stdout.write("BEGIN\\n"); sys.stdout.flush()
a = torch.arange(6.0).reshape(2, 3)
for _ in range(3):
    out = torch.ops.dc.test_call(a)
    assert torch.equal(out, a) and out.data_ptr() != a.data_ptr()
out = torch.ops.dc.test_call(torch.empty(2, 3, device="meta"))
assert out.shape == (2, 3) and out.is_meta
sys.stdout.write("END\\n"); sys.stdout.flush()
''', env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Captured at the file-descriptor level: C++ std::cout would show up here too.
    assert proc.stdout == "BEGIN\nEND\n", repr(proc.stdout)
    assert proc.stderr == "", proc.stderr[-3000:]


# ------------------------------------------------------------------ current_graph_task_id

def test_current_graph_task_id_outside_backward() -> None:
    assert ds_z3native.current_graph_task_id() == -1
    assert ds_z3native.native().current_graph_task_id() == -1


def test_current_graph_task_id_inside_backward_hook() -> None:
    seen = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append((ds_z3native.current_graph_task_id(), torch._C._current_graph_task_id()))
        return grad

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    (ours, torchs), = seen
    assert ours != -1 and ours == torchs
    assert ds_z3native.current_graph_task_id() == -1


def test_current_graph_task_id_during_checkpoint_recompute() -> None:
    seen = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(ds_z3native.current_graph_task_id())
        return torch.sin(x) * 3

    x = torch.randn(4, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert seen == [-1]  # the forward
    out.sum().backward()
    assert len(seen) == 2 and seen[1] != -1  # the recompute runs inside the backward's task
