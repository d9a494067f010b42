"""The ``gloo-collectives-outside-python-dispatch`` patch: DeepSpeed's collectives on real CPU
tensors, called under torch.compile's Python dispatcher or a dispatch mode (as DeepCompile's
passes and profiler call them), no longer go through Python to reach gloo (which could deadlock
gloo's queue lock against the GIL), and still compute the same results.

Two real gloo ranks, real DeepSpeed comm. A recording dispatch mode shows the path a collective
takes: unpatched, DeepSpeed's c10d ops pass through it (``c10d.allreduce_``,
``c10d._allgather_base_``): the path that reaches gloo holding the GIL. No test runs that path on
purpose: it is the deadlock (a run of it hung here once). Patched, they do not pass through it.
"""

from __future__ import annotations

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
    # is True there (the patch's first check was that, and let this deadlock through: a CI hang).
    session = getattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)
    in_session = Recording()
    with session():
        compiling = torch.compiler.is_compiling()
        with enable_python_dispatcher(), in_session:
            smallest = torch.tensor([rank + 5])
            ds_dist.all_reduce(smallest, op=ds_dist.ReduceOp.MIN)
    return {"ops": seen.ops, "max": int(biggest.item()), "gathered": gathered.tolist(),
            "broadcast": float(shared.item()), "sum": int(total.item()),
            "session_ops": in_session.ops, "session_is_compiling": compiling,
            "min": int(smallest.item())}


def test_patched_collectives_skip_python_dispatch_and_compute_the_same() -> None:
    for result in run_ranks(_collectives_under_python_dispatch, 2, timeout=120):
        assert [op for op in result["ops"] if op.startswith("c10d.")] == []
        assert result["max"] == 6
        assert result["gathered"] == [0.0, 1.0]
        assert result["broadcast"] == 11.0
        assert result["sum"] == 3
        assert [op for op in result["session_ops"] if op.startswith("c10d.")] == []
        assert result["min"] == 5
    assert result["session_is_compiling"] or not hasattr(torch.compiler, "_compile_session_context")


def test_only_real_cpu_tensors_are_taken_out_of_python_dispatch() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ds_z3native.compat.gloo_collectives import _real_cpu_tensors

    assert _real_cpu_tensors((torch.zeros(2), [torch.ones(1)]), {"group": None})
    assert not _real_cpu_tensors((), {"group": None})  # nothing to send
    assert not _real_cpu_tensors((torch.zeros(2, device="meta"),), {})
    with FakeTensorMode() as fake:
        fake_tensor = fake.from_tensor(torch.zeros(2))
    assert not _real_cpu_tensors((torch.zeros(2), fake_tensor), {})  # traced: left as it is


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
