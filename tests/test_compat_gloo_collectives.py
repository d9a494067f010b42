"""The ``gloo-collectives-outside-python-dispatch`` patch: DeepSpeed's collectives on real CPU
tensors, called under torch.compile's Python dispatcher or a dispatch mode (as DeepCompile's
passes and profiler call them), no longer go through Python to reach gloo (which could deadlock
gloo's queue lock against the GIL), and still compute the same results.

Two real gloo ranks, real DeepSpeed comm. A recording dispatch mode shows the path a collective
takes: unpatched, DeepSpeed's c10d ops pass through it (``c10d.allreduce_``,
``c10d._allgather_base_``): the path that reaches gloo holding the GIL. No test runs that path on
purpose on two ranks: it is the deadlock. Patched, they do not pass through it. DeepCompile's
passes create their small integer tensors inside their ``FakeTensorMode``, where
``torch.tensor([n])`` is a fake tensor carrying a real constant and the fake mode runs the
collective on that constant holding the GIL (the case the patch first missed: a CI run hung in
``_reduce_int``); a one-rank stress run of that pattern hangs within a few thousand collectives
unpatched and must finish patched.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, List

import pytest
import torch

from helpers.dist import run_ranks

pytestmark = pytest.mark.deepspeed


def _collectives_under_python_dispatch(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import deepspeed.comm as ds_dist
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_z3native

    ds_z3native.install()
    deepspeed.init_distributed(dist_backend="gloo")

    class Recording(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: List[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    seen = Recording()
    biggest = torch.tensor([rank + 5])
    gathered = torch.empty(world_size)
    shared = torch.tensor([float(rank + 10)])
    with enable_python_dispatcher(), seen:
        ds_dist.all_reduce(biggest, op=ds_dist.ReduceOp.MAX)
        ds_dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
        ds_dist.broadcast(shared, src=1)
    # As DeepCompile's passes: real tensors under a fake mode and the Python dispatcher.
    with enable_python_dispatcher(), FakeTensorMode(allow_non_fake_inputs=True):
        with unset_fake_temporarily():
            total = torch.tensor([rank + 1])
        ds_dist.all_reduce(total)
    # ...and inside a torch.compile session, as a backend runs them: torch.compiler.is_compiling()
    # is True there (a patch that checks is_compiling() alone lets this deadlock through).
    compile_session = getattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)
    in_session = Recording()
    with compile_session():
        compiling = torch.compiler.is_compiling()
        with enable_python_dispatcher(), in_session:
            smallest = torch.tensor([rank + 5])
            ds_dist.all_reduce(smallest, op=ds_dist.ReduceOp.MIN)
    # ...and as DeepSpeed's ``_reduce_int`` does: the tensor made inside the fake mode (a fake
    # tensor whose constant is the real value), reduced, read back with .item().
    in_fake = Recording()
    with enable_python_dispatcher(), FakeTensorMode(), in_fake:
        least = torch.tensor([rank + 7], dtype=torch.int64)
        ds_dist.all_reduce(least, op=ds_dist.ReduceOp.MIN)
        least_value = int(least.item())
    # A fake tensor reduced after its fake mode exited still dispatches through that mode.
    late_mode = FakeTensorMode()
    through_fake: List[str] = []
    dispatch = late_mode.dispatch
    late_mode.dispatch = lambda func, types, args=(), kwargs=None: (  # type: ignore[method-assign]
        through_fake.append(str(func)), dispatch(func, types, args, kwargs))[1]
    with late_mode:
        late = torch.tensor([rank + 20], dtype=torch.int64)
    ds_dist.all_reduce(late, op=ds_dist.ReduceOp.MIN)
    late_value = int(late.constant.item())
    # Traced into a graph (make_fx's proxy mode, as AOTAutograd traces): the collective stays in
    # the graph. Traced on real tensors, so that it also runs, waited, on both ranks: traced in a
    # fake mode, the fake tensor's constant has the fake mode run the collective for real too,
    # and nobody waits for that work.
    from torch.fx.experimental.proxy_tensor import make_fx

    def traced(x: torch.Tensor) -> torch.Tensor:
        made = torch.tensor([rank + 30], dtype=torch.int64)
        ds_dist.all_reduce(made, op=ds_dist.ReduceOp.MIN)
        return x + made

    graph_code = make_fx(traced, tracing_mode="real")(torch.zeros(1, dtype=torch.int64)).code
    return {"ops": seen.ops, "max": int(biggest.item()), "gathered": gathered.tolist(),
            "broadcast": float(shared.item()), "sum": int(total.item()),
            "session_ops": in_session.ops, "session_is_compiling": compiling,
            "min": int(smallest.item()), "fake_ops": in_fake.ops, "fake_min": least_value,
            "late_ops": through_fake, "late_min": late_value, "graph_code": graph_code}


def test_patched_collectives_skip_python_dispatch_and_compute_the_same() -> None:
    for result in run_ranks(_collectives_under_python_dispatch, 2, timeout=120):
        assert [op for op in result["ops"] if op.startswith("c10d.")] == []
        assert result["max"] == 6
        assert result["gathered"] == [0.0, 1.0]
        assert result["broadcast"] == 11.0
        assert result["sum"] == 3
        assert [op for op in result["session_ops"] if op.startswith("c10d.")] == []
        assert result["min"] == 5
        assert "aten.lift_fresh" in result["fake_ops"]  # the fake mode saw the tensor being made
        assert [op for op in result["fake_ops"] if op.startswith("c10d.")] == []
        assert result["fake_min"] == 7
        assert [op for op in result["late_ops"] if op.startswith("c10d.")] == []
        assert result["late_min"] == 20
        assert "torch.ops.c10d.allreduce_" in result["graph_code"]
    assert result["session_is_compiling"] or not hasattr(torch.compiler, "_compile_session_context")


def test_collectives_get_real_cpu_tensors_or_are_left_alone() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ds_z3native.compat.gloo_collectives import real_cpu_arguments

    a, b = torch.zeros(2), torch.ones(1)
    args, kwargs = real_cpu_arguments((a, [b]), {"group": None})
    assert args[0] is a and isinstance(args[1], list) and args[1][0] is b
    assert kwargs == {"group": None}
    assert real_cpu_arguments((), {"group": None}) is None  # nothing to send
    assert real_cpu_arguments((torch.zeros(2, device="meta"),), {}) is None
    with FakeTensorMode() as fake:
        traced = fake.from_tensor(torch.zeros(2))  # a fake with no real value: left as it is
        made_here = torch.tensor([3])  # what DeepCompile's passes reduce: carries its constant
    assert real_cpu_arguments((a, traced), {}) is None
    args, _ = real_cpu_arguments((made_here,), {})
    assert args[0] is made_here.constant and args[0].tolist() == [3]
    _, kwargs = real_cpu_arguments((), {"tensor": made_here})
    assert kwargs["tensor"] is made_here.constant
    # Mixed, and in lists: each fake replaced, each real tensor kept; a container with nothing
    # to replace is passed on as the same object (a collective may write into the list).
    outputs = [torch.zeros(1), torch.zeros(1)]
    args, _ = real_cpu_arguments((outputs, made_here), {})
    assert args[0] is outputs and args[1] is made_here.constant
    args, _ = real_cpu_arguments(([a, made_here],), {})
    assert args[0][0] is a and args[0][1] is made_here.constant
    Pair = collections.namedtuple("Pair", "first second")
    args, _ = real_cpu_arguments((Pair(a, made_here),), {})
    assert isinstance(args[0], Pair) and args[0].second is made_here.constant


def _reduce_ints_in_a_fake_mode(rank: int, world_size: int, count: int) -> int:
    import deepspeed
    import deepspeed.comm as ds_dist
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ds_z3native

    ds_z3native.install()
    deepspeed.init_distributed(dist_backend="gloo")
    done = 0
    with enable_python_dispatcher(), FakeTensorMode():
        for i in range(count):
            value = torch.tensor([i], dtype=torch.int64)
            ds_dist.all_reduce(value, op=ds_dist.ReduceOp.MIN)
            done += int(value.item()) == i
    return done


@pytest.mark.slow
def test_many_collectives_in_a_fake_mode_do_not_deadlock() -> None:
    # Unpatched (or patched for real tensors only) this hung before 2,000 collectives in each of
    # four runs here; patched, 30,000 ran in 35 s.
    count = 6000
    assert run_ranks(_reduce_ints_in_a_fake_mode, 1, count, timeout=240) == [count]


def test_uninstall_restores_deepspeeds_collectives() -> None:
    from deepspeed.comm.torch import TorchBackend

    import ds_z3native
    from ds_z3native.compat.gloo_collectives import COLLECTIVES

    before = {name: TorchBackend.__dict__[name] for name in COLLECTIVES if name in TorchBackend.__dict__}
    assert "all_reduce" in before and "all_gather_into_tensor" in before
    ds_z3native.install()
    try:
        assert all(TorchBackend.__dict__[name] is not fn for name, fn in before.items())
    finally:
        ds_z3native.uninstall()
    assert {name: TorchBackend.__dict__[name] for name in before} == before


# ---- zero3-coalesced-gather-waits-on-every-handle ------------------------------------------

_GATHER_ROUNDS = 60


def _coalesced_gathers(rank: int, world_size: int, rounds: int) -> Dict[str, Any]:
    import deepspeed
    import deepspeed.ops

    import ds_z3native

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo, no JIT build
    patches = list(ds_z3native.install().patches)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(3)
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    with deepspeed.zero.Init(config_dict_or_path=config):
        # A large first param and small later ones: with gloo's two worker threads the last
        # all-gather finishes while the first is still in flight.
        model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(3, 3),
                                    torch.nn.Linear(2, 2))
    params = list(model.parameters())
    reference = []
    for p in params:  # one param at a time: DeepSpeed's sequential gather, one handle
        with deepspeed.zero.GatheredParameters([p]):
            reference.append(p.detach().clone())
    wrong = 0
    for _ in range(rounds):
        with deepspeed.zero.GatheredParameters(params):  # the coalesced gather
            wrong += not all(torch.equal(p.detach(), r) for p, r in zip(params, reference))
    ds_z3native.uninstall()
    return {"wrong": wrong, "patches": patches}


def test_coalesced_gather_reads_every_param_after_its_gather() -> None:
    # DeepSpeed 0.19.2 alone: 4 and 12 of 60 rounds read a param still in flight (ranks 0 and 1).
    from packaging.version import Version

    import deepspeed

    results = run_ranks(_coalesced_gathers, 2, _GATHER_ROUNDS, timeout=300)
    assert [r["wrong"] for r in results] == [0, 0]
    patched = Version(deepspeed.__version__.split("+")[0]) <= Version("0.19.7")
    for r in results:
        assert ("zero3-coalesced-gather-waits-on-every-handle" in r["patches"]) == patched


def test_uninstall_restores_the_coalesced_gather() -> None:
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.zero.partition_parameters import Init

    from ds_z3native.compat.gloo_collectives import patch_coalesced_gather_waits

    before = (Init.__dict__["_allgather_params_coalesced"], ds_comm.all_gather_into_tensor,
              ds_comm.all_gather)
    undo = patch_coalesced_gather_waits()
    try:
        assert Init.__dict__["_allgather_params_coalesced"] is not before[0]
        assert ds_comm.all_gather_into_tensor is not before[1]
    finally:
        undo()
    assert (Init.__dict__["_allgather_params_coalesced"], ds_comm.all_gather_into_tensor,
            ds_comm.all_gather) == before
