"""Every module function DeepSpeed's Python calls exists on ds_z3native._C and accepts DeepSpeed's
arguments.

The calls are discovered by reading the installed DeepSpeed's ``compile/`` package and
``runtime/engine.py`` (AST: method calls on the native handle, whatever name holds it), then
made for real, with DeepSpeed-shaped arguments, on a one-rank gloo group. Marked ``deepspeed``:
CI runs it against 0.19.8 and again against 0.19.2.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

import pytest
import torch

import ds_z3native
from ds_z3native.settings import BUDGET_RANGE, MAX_BUDGET_MIB
from helpers.native_rt import compile_config, local_group

pytestmark = pytest.mark.deepspeed

# Functions returning the native handle, and the names DeepSpeed gives it where it is passed in.
HANDLE_FACTORIES = {"get_deepcompile_handle", "_initialize_deepcompile_native"}
HANDLE_NAMES = {"dc", "nz3", "_nz3"}
# Called by every 0.19.x release: a discovery that misses one of them is broken.
ALWAYS_CALLED = {"init", "cleanup", "reset", "register_z3_param", "register_graph_z3",
                 "register_param", "register_graph_z1", "register_graph_z2", "start_backward",
                 "set_persistent", "enable_profiling", "is_profiling"}


@dataclass(frozen=True)
class HandleCall:
    name: str
    n_args: int
    keywords: Tuple[str, ...]
    where: str


def _deepspeed_root() -> str:
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin
    return os.path.dirname(spec.origin)


def _target_key(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def _called_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return ""


def discover_handle_calls(root: str) -> List[HandleCall]:
    """Method calls on DeepSpeed's native handle in ``root``'s compile/ and runtime/engine.py."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "compile"))
             for f in fs if f.endswith(".py")]
    files.append(os.path.join(root, "runtime", "engine.py"))
    calls = []
    for path in sorted(files):
        tree = ast.parse(open(path).read(), path)
        handles = set(HANDLE_NAMES)
        for node in ast.walk(tree):  # x = get_deepcompile_handle(); self.nz3 = ...; nz3 = _nz3
            if isinstance(node, ast.Assign) and (
                    _called_name(node.value) in HANDLE_FACTORIES
                    or _target_key(node.value) in handles):
                handles.update(filter(None, map(_target_key, node.targets)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if _target_key(owner) in handles or _called_name(owner) in HANDLE_FACTORIES:
                    calls.append(HandleCall(node.func.attr, len(node.args),
                                            tuple(k.arg for k in node.keywords),
                                            f"{os.path.relpath(path, root)}:{node.lineno}"))
    return calls


def _split_top_level(params: str) -> List[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def pybind_params(fn) -> List[Tuple[str, bool]]:
    """(name, has_default) of a pybind11 function's parameters, from its signature line."""
    first = fn.__doc__.strip().splitlines()[0]
    m = re.match(r"\w+\((.*)\) -> ", first)
    assert m, f"unexpected signature line {first!r}"
    return [(p.split(":")[0].strip(), "=" in p) for p in _split_top_level(m.group(1))]


@pytest.fixture(scope="module")
def deepspeed_calls() -> Dict[str, Set[HandleCall]]:
    by_name: Dict[str, Set[HandleCall]] = {}
    for c in discover_handle_calls(_deepspeed_root()):
        by_name.setdefault(c.name, set()).add(c)
    return by_name


@pytest.fixture(scope="module")
def CompileConfig():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.compile.config import CompileConfig

    return CompileConfig


@pytest.fixture(scope="module")
def ds_version() -> Tuple[int, int, int]:
    import deepspeed

    return tuple(int(x) for x in re.findall(r"\d+", deepspeed.__version__)[:3])


@pytest.fixture()
def m():
    mod = ds_z3native.native()
    mod.cleanup()
    yield mod
    mod.cleanup()


def test_discovery_reads_the_handle_calls(deepspeed_calls) -> None:
    assert ALWAYS_CALLED <= set(deepspeed_calls), sorted(ALWAYS_CALLED - set(deepspeed_calls))
    assert all(c.n_args == 3 for c in deepspeed_calls["init"])
    assert all(c.n_args in (5, 6) for c in deepspeed_calls["register_z3_param"])


def test_every_deepspeed_call_exists_and_binds(deepspeed_calls) -> None:
    mod = ds_z3native.native()
    problems = []
    for name, calls in sorted(deepspeed_calls.items()):
        fn = getattr(mod, name, None)
        if not callable(fn):
            problems.append(f"{name} (called at {sorted(c.where for c in calls)}) is missing")
            continue
        params = pybind_params(fn)
        required = sum(1 for _, has_default in params if not has_default)
        names = {p for p, _ in params}
        for c in calls:
            if not required <= c.n_args <= len(params):
                problems.append(f"{c.where}: {name} with {c.n_args} arguments, ours takes "
                                f"{required}..{len(params)}")
            if not set(c.keywords) <= names:
                problems.append(f"{c.where}: {name} keywords {c.keywords} not in {names}")
    assert not problems, "\n".join(problems)


def test_init_with_deepspeeds_compile_config(m, CompileConfig) -> None:
    # free_activation_threshold is read from the config: only tensors above it are freed.
    config = CompileConfig(free_activation_threshold=16)
    m.init(local_group(), config, 4096)
    assert m.is_initialized() and m.runtime_info()["world_size"] == 1
    small, big = torch.ones(16), torch.ones(17)
    torch.ops.dc.free_tensors([small, big])
    assert small.numel() == 16 and big.numel() == 0
    m.cleanup()
    m.init(local_group(), CompileConfig(), 4096)  # DeepSpeed's defaults
    assert m.is_initialized()


def test_init_with_config_lacking_pin_memory_attribute(m) -> None:
    # 0.19.0-0.19.7's CompileConfig has no offload_activation_pin_memory.
    config = compile_config(free_activation_threshold=4)
    assert not hasattr(config, "offload_activation_pin_memory")
    m.init(local_group(), config, 4096)
    small, big = torch.ones(4), torch.ones(5)
    torch.ops.dc.free_tensors([small, big])
    assert small.numel() == 4 and big.numel() == 0


def _z3_param(numel: int) -> torch.Tensor:
    """A stand-in for DeepSpeed's ``p.ds_tensor`` at world size 1 (the whole param; DeepSpeed
    sets requires_grad=False on partitions)."""
    return torch.randn(numel)


def test_register_z3_param_deepspeed_arities_and_buffers(m) -> None:
    m.init(local_group(), compile_config(), 4096)
    t1, t2, t3, t4 = _z3_param(6), _z3_param(6), _z3_param(4), _z3_param(4)
    buf1, buf2 = torch.full((6,), 9.0), torch.full((6,), 9.0)
    # 0.19.2+: six arguments, the last the expected grad dtype (or None).
    m.register_z3_param(1, torch.Size([2, 3]), t1, buf1, False, torch.float32)
    # 0.19.0-0.19.1: five arguments.
    m.register_z3_param(2, torch.Size([2, 3]), t2, buf2, False)
    # Frozen params: an empty torch.Tensor() (>= 0.19.6) or None.
    m.register_z3_param(3, torch.Size([4]), t3, torch.Tensor(), False, torch.float32)
    m.register_z3_param(4, torch.Size([2, 2]), t4, None, True)
    assert [m.is_param_frozen(i) for i in (1, 2, 3, 4)] == [False, False, True, True]
    m.register_graph_z3(0, [1, 2, 3, 4])

    # Each registered param is usable the way DeepSpeed's graph uses it.
    for ds_id, shard, shape in ((1, t1, (2, 3)), (2, t2, (2, 3)), (3, t3, (4,)), (4, t4, (2, 2))):
        full = torch.ops.dc.allgather_param(torch.empty(0), 0, ds_id)
        full = torch.ops.dc.wait_allgather(full, 0, ds_id)
        assert full.shape == shape and torch.equal(full.reshape(-1), shard.detach())
        torch.ops.dc.release_param(full, 0, ds_id, 1)
    m.start_backward(True)
    g = torch.randn(2, 3)
    torch.ops.dc.reduce_grad(g, 0, 1)
    torch.ops.dc.reduce_grad(g.to(torch.bfloat16), 0, 2)
    torch.ops.dc.end_backward([None], 0, True)
    assert torch.equal(buf1, g.reshape(-1))
    assert torch.equal(buf2, g.to(torch.bfloat16).float().reshape(-1))
    # Buckets no larger than the trainable gradients (params 1 and 2, 6 elements each), not
    # the 4096 elements init was given: one fp32 and one bf16 bucket of 6 + 6 elements.
    assert m.comm_stats()["reduce_bucket_bytes"] == 12 * 4 + 12 * 2


def test_a_trainable_param_without_elements_stays_trainable(m) -> None:
    """A trainable param with no elements has an empty grad partition (DeepSpeed hands its view
    of the gradient buffer, 0 elements): it is registered trainable, its gradient is taken and
    reduces to nothing, as DeepSpeed's executor does, and the other gradients land as usual.
    An empty buffer cannot tell it from a frozen one of no elements (DeepSpeed registers those with
    torch.Tensor(), also empty): a frozen one is declared frozen (set_param_frozen, as ds_z3native
    does after init_z3 for every requires_grad=False param) or registered with None."""
    m.init(local_group(), compile_config(), 4096)
    flat = torch.zeros(6)
    m.register_z3_param(1, torch.Size([0]), _z3_param(0), flat[:0], False, torch.float32)
    m.register_z3_param(2, torch.Size([2, 3]), _z3_param(6), flat, False, torch.float32)
    m.register_z3_param(3, torch.Size([0, 4]), _z3_param(0), torch.Tensor(), False)
    m.register_z3_param(4, torch.Size([0]), _z3_param(0), None, False)
    assert [m.is_param_frozen(i) for i in (1, 2, 3, 4)] == [False, False, False, True]
    m.set_param_frozen(3, True)
    m.register_graph_z3(0, [1, 2, 3, 4])
    m.start_backward(True)
    g = torch.randn(2, 3)
    torch.ops.dc.reduce_grad(torch.empty(0), 0, 1)
    torch.ops.dc.reduce_grad(g, 0, 2)
    torch.ops.dc.end_backward([None], 0, True)
    assert torch.equal(flat, g.reshape(-1))
    assert m.comm_stats()["reduce_scatter_calls"] == 1  # param 2's; param 1 has nothing to reduce
    with pytest.raises(RuntimeError, match=r"reduce_grad: ds_id 3 is frozen"):
        torch.ops.dc.reduce_grad(torch.empty(0, 4), 0, 3)


def test_register_param_and_update_grad_buffer_z1_z2(m) -> None:
    m.init(local_group(), compile_config(), 4096)
    p1 = torch.nn.Parameter(torch.randn(3, 4))
    p2 = torch.nn.Parameter(torch.randn(5))
    flat = torch.zeros(12)
    # DeepSpeed's ZeRO-2 registration: (param_id, p.shape, p, partition view, offset).
    m.register_param(10, p1.shape, p1, flat.narrow(0, 2, 10), 2)
    m.register_param(11, p2.shape, p2, torch.empty([0], dtype=p2.dtype, device=p2.device), 0)
    m.register_graph_z2(5, [10, 11])
    m.start_backward(True)
    g1 = torch.randn(3, 4)
    torch.ops.dc.reduce_grad(g1, 5, 10)
    torch.ops.dc.end_backward([torch.empty(0)], 5, True)
    assert torch.equal(flat[:2], torch.zeros(2))
    assert torch.equal(flat[2:], g1.reshape(-1)[2:])

    # ZeRO-1: buffers are handed over per window with update_param_grad_buffer.
    m.register_param(20, p1.shape, p1, torch.empty([0]), 0)
    m.register_graph_z1(6, [20])
    buf = torch.zeros(12)
    m.update_param_grad_buffer(20, buf, 0)
    m.start_backward(False)
    ga, gb = torch.randn(3, 4), torch.randn(3, 4)
    torch.ops.dc.reduce_grad(ga, 6, 20)
    torch.ops.dc.end_backward([None], 6)
    m.start_backward(True)
    torch.ops.dc.reduce_grad(gb, 6, 20)
    torch.ops.dc.end_backward([None], 6)
    torch.testing.assert_close(buf, (ga + gb).reshape(-1))
    m.update_param_grad_buffer(20, torch.empty([0]), 0)  # DeepSpeed releases it again


def test_end_backward_two_and_three_arguments(m) -> None:
    m.init(local_group(), compile_config(), 4096)
    buf = torch.zeros(3)
    m.register_z3_param(1, [3], _z3_param(3), buf, False)
    m.register_graph_z3(0, [1])
    # DeepSpeed passes the list of reduce_grad outputs (never empty), None where they were freed.
    for args in (([None, None], 0), ([torch.empty(0)], 0, False), (None, 0, True)):
        m.start_backward(True)
        g = torch.randn(3)
        torch.ops.dc.reduce_grad(g, 0, 1)
        torch.ops.dc.end_backward(*args)
        assert torch.equal(buf, g), args
        assert m.runtime_info()["pending_gradients"] == 0


def test_profiler_and_persistence_functions(m) -> None:
    """What DeepSpeed's graph profiler and selective-gather pass call."""
    m.init(local_group(), compile_config(), 4096)
    shard = _z3_param(5)
    buf = torch.zeros(5)
    m.register_z3_param(1, [5], shard, buf, False)
    m.register_graph_z3(0, [1])
    m.start_forward()
    m.end_forward()
    m.enable_profiling(True)
    assert m.is_profiling()
    full = torch.ops.dc.allgather_param(torch.empty(0), 0, 1)
    m.invalidate_gathered_param(1)
    m.start_backward(True)
    torch.ops.dc.reduce_grad(torch.ones(5), 0, 1)  # ignored while profiling
    torch.ops.dc.end_backward([None], 0)
    m.clear_all_gathered_params()
    m.enable_profiling(False)
    assert not m.is_profiling()
    assert torch.equal(buf, torch.zeros(5))
    assert m.comm_stats()["reduce_scatter_calls"] == 0
    del full

    m.set_persistent(1)
    state = m.param_state(1)
    assert state["persistent"] and state["gathered"] and state["valid"]
    m.reset_comm_stats()
    full = torch.ops.dc.allgather_param(torch.empty(0), 0, 1)
    assert torch.equal(full, shard.detach()) and m.comm_stats()["allgather_calls"] == 0


def test_a_profiled_run_that_stopped_midway_leaves_no_use_count(m) -> None:
    """DeepSpeed's profiler carries on after an error in a graph's node (default figures for the
    rest) and then clears what was gathered. Its run may have stopped between two users of a
    gathered param: the real run's copy must still live until its own last user."""
    m.init(local_group(), compile_config(), 4096)
    shard = _z3_param(4)
    m.register_z3_param(1, [4], shard, torch.zeros(4), False)
    m.register_graph_z3(0, [1])
    m.enable_profiling(True)
    torch.ops.dc.allgather_param(torch.empty(0), 0, 1)
    m.invalidate_gathered_param(1)
    torch.ops.dc.release_param(torch.empty(0), 0, 1, 2)  # the first of two users, then the error
    m.clear_all_gathered_params()
    m.enable_profiling(False)

    full = torch.ops.dc.allgather_param(torch.empty(0), 0, 1)
    torch.ops.dc.wait_allgather(full, 0, 1)
    torch.ops.dc.release_param(full, 0, 1, 2)
    assert m.param_state(1)["gathered"] and torch.equal(full, shard.detach())
    torch.ops.dc.release_param(full, 0, 1, 2)
    assert not m.param_state(1)["gathered"]


def test_reset_and_cleanup_lifecycle(m) -> None:
    assert not m.is_initialized()
    m.reset()  # before init: nothing to reset, no error
    m.cleanup()
    m.init(local_group(), compile_config(), 4096)
    m.register_z3_param(1, [2], _z3_param(2), torch.zeros(2), False)
    m.register_graph_z3(7, [1])
    assert m.runtime_info()["graphs"] == [7]
    m.reset()  # DeepSpeed's backend before a recompile: graphs go, params stay
    assert m.runtime_info()["graphs"] == []
    assert not m.is_param_frozen(1)
    with pytest.raises(RuntimeError, match=r"allgather_param.*graph_id 7"):
        torch.ops.dc.allgather_param(torch.empty(0), 7, 1)
    m.register_graph_z3(7, [1])
    assert torch.ops.dc.allgather_param(torch.empty(0), 7, 1).shape == (2,)
    m.cleanup()
    m.cleanup()  # engine.destroy() and then __del__
    assert not m.is_initialized()
    with pytest.raises(RuntimeError, match="register_graph_z3.*not initialized"):
        m.register_graph_z3(7, [1])


def test_graph_alias_is_resolved_by_every_graph_op_until_reset(m) -> None:
    # ds_z3native hands DeepCompile's graphs to inductor with canonical ids (-1, -2, ...): each
    # is an alias of DeepSpeed's id(gm.graph) that the graph ops resolve.
    m.init(local_group(), compile_config(), 4096)
    m.register_z3_param(1, [2], _z3_param(2), torch.zeros(2), False)
    m.register_graph_z3(140001, [1])
    with pytest.raises(RuntimeError, match=r"allgather_param.*unknown graph_id -1"):
        torch.ops.dc.allgather_param(torch.empty(0), -1, 1)
    m.alias_graph(-1, 140001)
    m.alias_graph(-1, 140001)  # fw and bw compilers of one graph both ask: the same answer
    assert m.graph_aliases() == {-1: 140001}
    full = torch.ops.dc.allgather_param(torch.empty(0), -1, 1)
    assert full.shape == (2,)
    # The alias and the id name one executor: a use counted under either releases the param.
    torch.ops.dc.release_param(full, -1, 1, 1)
    assert not m.param_state(1)["valid"]
    m.start_backward(True)
    torch.ops.dc.reduce_grad(torch.ones(2), -1, 1)
    # Activation offload state is the graph's too: offloaded under the alias, reloaded under the id.
    act = torch.randn(3)
    off = torch.ops.dc.wait_offload(torch.ops.dc.offload_tensor(act, -1, 7), -1, 7)
    back = torch.ops.dc.wait_reload(torch.ops.dc.reload_tensor(off, 140001, 7), 140001, 7)
    assert torch.equal(back, act)
    torch.ops.dc.end_backward([None], -1)
    assert m.runtime_info()["graphs"] == [140001]  # an alias is not a graph
    with pytest.raises(RuntimeError, match=r"alias_graph.*alias -1 already names graph 140001, not 7"):
        m.register_graph_z3(7, [1])
        m.alias_graph(-1, 7)
    with pytest.raises(RuntimeError, match=r"alias_graph.*alias -2: graph_id 99 is not registered"):
        m.alias_graph(-2, 99)
    with pytest.raises(RuntimeError, match=r"alias_graph.*alias 7 is itself a registered graph_id"):
        m.alias_graph(7, 140001)
    with pytest.raises(RuntimeError, match=r"register_graph_z3.*graph_id -1 is already an alias of "
                                           r"graph 140001"):
        m.register_graph_z3(-1, [1])
    m.reset()  # DeepSpeed re-plans: graphs and their aliases go
    assert m.graph_aliases() == {}
    m.register_graph_z3(140002, [1])
    m.alias_graph(-1, 140002)
    assert torch.ops.dc.allgather_param(torch.empty(0), -1, 1).shape == (2,)


def test_persistence_budget_caps_set_persistent(m, clean_settings) -> None:
    # DeepCompile's selective gather marks params persistent while it estimates free memory;
    # with a budget only what fits stays gathered (here: one 1 MiB fp32 param of two). Their
    # shards are strided, so that even on one rank their kept copies are copies; a contiguous
    # shard on one rank is its own kept param and costs nothing (the last check).
    environ = dict(os.environ)
    ds_z3native.set_persistence_budget(1.5)
    assert dict(os.environ) == environ  # kept in the settings, not in the environment
    assert ds_z3native.current_settings().persistence_budget_mib == 1.5
    m.init(local_group(), compile_config(), 4096)
    n = 256 * 1024  # 1 MiB of fp32
    for ds_id in (101, 102):
        strided = torch.empty(2 * n)[::2].copy_(_z3_param(n))
        m.register_z3_param(ds_id, [n], strided, torch.Tensor(), False)
    m.register_z3_param(103, [n], _z3_param(n), torch.Tensor(), False)
    m.set_persistent(101)
    m.set_persistent(102)
    m.set_persistent(103)
    assert m.param_state(101)["persistent"] and not m.param_state(102)["persistent"]
    assert m.param_state(103)["persistent"]
    assert m.persistence_info() == {"budget_bytes": int(1.5 * 2**20), "selected_bytes": 4 * n,
                                    "selected": 2, "declined": 1}
    ds_z3native.set_persistence_budget(None)  # the live runtime too
    m.set_persistent(102)
    assert m.param_state(102)["persistent"]
    assert m.persistence_info()["budget_bytes"] is None
    m.init(local_group(), compile_config(), 4096)  # and the next init()
    assert m.persistence_info()["budget_bytes"] is None
    for bad in (-1, float("nan"), "2", True, MAX_BUDGET_MIB):
        with pytest.raises(ValueError, match=re.escape(
                f"set_persistence_budget: expected MiB in {BUDGET_RANGE} or None, got {bad!r}")):
            ds_z3native.set_persistence_budget(bad)
    assert ds_z3native.current_settings().persistence_budget_mib is None  # refused: unchanged


def test_init_takes_its_budget_from_the_settings_not_the_environment(
        m, clean_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is read once, by the settings; init() never looks at it.
    monkeypatch.setenv(ds_z3native.PERSISTENCE_BUDGET_ENV, "lots")
    ds_z3native.set_persistence_budget(2)
    m.init(local_group(), compile_config(), 4096)
    assert m.persistence_info()["budget_bytes"] == 2 * 2**20
    m.cleanup()
    m.set_default_persistence_budget(3 * 2**20)  # what the settings call: kept across cleanup()
    m.init(local_group(), compile_config(), 4096)
    assert m.persistence_info()["budget_bytes"] == 3 * 2**20
    m.set_default_persistence_budget(None)
    m.init(local_group(), compile_config(), 4096)
    assert m.persistence_info()["budget_bytes"] is None
    with pytest.raises(RuntimeError, match=r"ds_z3native set_default_persistence_budget: the "
                                           r"persistence budget must be >= 0 bytes, got -1"):
        m.set_default_persistence_budget(-1)
