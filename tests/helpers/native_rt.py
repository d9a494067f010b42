"""A live ds_z3native runtime inside the test process, and the ZeRO-3 shard arithmetic tests need.

``local_group()`` returns a one-rank gloo ProcessGroup of this process (over an in-memory store,
leaving torch.distributed's default group alone). ``live_runtime()`` runs
``init`` over it and ``cleanup`` at the end; ``opcheck_on_fresh_runtimes()`` runs
``torch.library.opcheck`` on a fresh one per sub-test. ``padded_full`` / ``padded_shard`` are the reference
partition arithmetic (equal shards of ceil(numel / world_size), zero padding at the tail),
written out here independently of the C++ so that tests compare against it.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["local_group", "compile_config", "live_runtime", "OPCHECK_UTILS",
           "opcheck_on_fresh_runtimes", "per_rank", "padded_shard", "padded_full"]

_GROUP: Optional[Any] = None


def _standalone_gloo_group() -> Any:
    # A ProcessGroup over an in-memory store: the process's default group (which other tests
    # may want to create themselves) stays untouched.
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def local_group() -> Any:
    """A one-rank gloo ProcessGroup of this process (cached).

    Built without the default group where torch allows it; otherwise through a one-rank
    default group (initialized here if there is none)."""
    global _GROUP
    if _GROUP is None:
        try:
            _GROUP = _standalone_gloo_group()
        except (AttributeError, TypeError, RuntimeError):  # private API moved: use the default
            if not dist.is_initialized():
                from helpers.dist import free_port

                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                        rank=0, world_size=1)
            if dist.get_world_size() != 1:
                raise RuntimeError("local_group() needs a one-rank process (the default group "
                                   f"has {dist.get_world_size()} ranks)") from None
            _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def compile_config(**overrides: Any) -> types.SimpleNamespace:
    """An object with the attributes DeepSpeed 0.19.0-0.19.7's CompileConfig has that init reads
    (no ``offload_activation_pin_memory``: 0.19.8 added it)."""
    values = dict(double_buffer=True, symmetric_memory=False, free_activation_threshold=0,
                  sync_before_reduce=False, sync_after_reduce=False, sync_before_allgather=False,
                  sync_after_allgather=False)
    values.update(overrides)
    return types.SimpleNamespace(**values)


@contextlib.contextmanager
def live_runtime(config: Any = None, bucket_size: int = 1 << 16, group: Any = None
                 ) -> Iterator[Any]:
    """``init`` the native runtime over ``group`` (default: ``local_group()``); ``cleanup`` after."""
    import ds_z3native

    m = ds_z3native.native()
    m.init(group if group is not None else local_group(),
           config if config is not None else compile_config(), bucket_size)
    try:
        yield m
    finally:
        m.cleanup()


# The torch.library.opcheck sub-tests the native ops' tests run.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def opcheck_on_fresh_runtimes(op: Any, args: Callable[[Any], Tuple[Any, ...]],
                              prepare: Callable[[Any], Any], what: str,
                              kwargs: Optional[Dict[str, Any]] = None, config: Any = None,
                              skip: Sequence[str] = ()) -> None:
    """``torch.library.opcheck(op, args(m), kwargs)`` for each of :data:`OPCHECK_UTILS` but
    ``skip``, each on a fresh runtime ``m`` (``live_runtime(config)``, then ``prepare(m)``): the
    ops are stateful and each sub-test runs the op. A failure names ``what`` and the sub-test."""
    for util in OPCHECK_UTILS:
        if util in skip:
            continue
        with live_runtime(config) as m:
            prepare(m)
            built = args(m)
            try:
                torch.library.opcheck(op, built, kwargs, test_utils=util)
            except Exception as e:
                raise AssertionError(f"{what}, {util}: {e}") from e


def per_rank(numel: int, world_size: int) -> int:
    """Elements of one ZeRO-3 shard, padding included."""
    return math.ceil(numel / world_size)


def padded_full(full: torch.Tensor, world_size: int) -> torch.Tensor:
    """``full`` flattened and zero-padded to world_size * ceil(numel / world_size) elements."""
    flat = full.detach().reshape(-1)
    out = torch.zeros(per_rank(flat.numel(), world_size) * world_size, dtype=flat.dtype)
    out[: flat.numel()] = flat
    return out


def padded_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 shard of ``full`` (a copy), padding zeroed."""
    n = per_rank(full.numel(), world_size)
    return padded_full(full, world_size)[rank * n:(rank + 1) * n].clone()
