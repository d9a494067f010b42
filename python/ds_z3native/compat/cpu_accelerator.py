"""DeepCompile on DeepSpeed's CPU accelerator: a device its passes can parse.

DeepSpeed >= 0.19.4 runs DeepCompile on its CPU accelerator (``DS_ACCELERATOR=cpu``; the
profiler falls back to default estimates without CUDA events; 0.19.3 compiles there too, but its
eager-fallback getter breaks Dynamo's guards), which is how a training script is tried on a
machine without a GPU, and how this project's CI drives HF Trainer with DeepCompile.
Its passes build devices as ``torch.device(get_accelerator().current_device())``; the CPU
accelerator answers ``os.environ["LOCAL_RANK"]``, a bare index string under every launcher
(torchrun, accelerate, deepspeed), which ``torch.device`` refuses: ``Invalid device string: '0'``
at the first compiled forward.

* :data:`DEEPCOMPILE_CPU_DEVICE` (0.19.3 and later, applied only when DeepSpeed's accelerator
  is the CPU one): the CPU accelerator's ``current_device()`` answers ``"cpu"``. Everything else
  DeepSpeed does on the CPU takes that as well (``torch.device("cpu")``; setting the device is a
  no-op there).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List

from packaging.version import Version

from . import Patch, Undo
from ._rebind import wrap_method

__all__ = ["DEEPCOMPILE_CPU_DEVICE", "PATCHES", "patch_cpu_current_device"]

log = logging.getLogger(__name__)


def _answering_cpu(current_device: Callable) -> Callable:
    def current_device_cpu(self: Any) -> str:
        return "cpu"

    return current_device_cpu


def patch_cpu_current_device() -> Undo:
    """The CPU accelerator's ``current_device()`` answers ``"cpu"`` (a no-op undo on any other
    accelerator)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return lambda: None
    cls = type(accelerator)
    owner = next(c for c in cls.__mro__ if "current_device" in c.__dict__)
    log.debug("DeepSpeed's CPU accelerator: current_device() answers 'cpu' (was %r)",
              accelerator.current_device())
    return wrap_method(owner, "current_device", _answering_cpu)


DEEPCOMPILE_CPU_DEVICE = Patch(
    name="deepcompile-cpu-device",
    summary="on DeepSpeed's CPU accelerator, current_device() answers 'cpu' (DeepCompile's "
            "passes pass it to torch.device, which refuses the bare rank index)",
    apply=patch_cpu_current_device,
    first=Version("0.19.3"),
    last=None,
    wraps=(
        "deepspeed.accelerator.cpu_accelerator:CPU_Accelerator.current_device",
    ),
)

PATCHES: List[Patch] = [DEEPCOMPILE_CPU_DEVICE]
