"""ds_z3native's settings from the DeepSpeed config: a ``"ds_z3native"`` section, read when an
engine is created with it.

* :data:`ENGINE_CONFIG_SECTION` (every release): ``DeepSpeedEngine.__init__`` (and so every
  engine class built on it: the hybrid and pipeline engines) first applies the ``"ds_z3native"``
  object of the config it was created with, its keys the fields of
  :class:`ds_z3native.Settings` (``{"ds_z3native": {"persistence_budget_mib": 512,
  "single_cycle": true}}``), as :func:`ds_z3native.configure` would
  (:func:`ds_z3native.settings.apply_config`). A bad key or value is refused with a ValueError
  naming ``ds_z3native.<field>`` and the value, before DeepSpeed builds anything. The config is
  the dict DeepSpeed parsed (``config_class._param_dict``), so a file, a dict and HF Trainer's
  filled-in config all work alike. DeepSpeed itself ignores top-level keys it does not know, so
  the section stays in the config (and in what DeepSpeed logs of it); without ds_z3native
  installed it is ignored.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, List

from packaging.version import Version

from . import Patch, Undo
from ._rebind import wrap_method
from .. import settings

__all__ = ["ENGINE_CONFIG_SECTION", "PATCHES", "patch_engine_config_section"]

log = logging.getLogger(__name__)


def _applying_section(init: Callable) -> Callable:
    signature = inspect.signature(init)

    def init_with_settings(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # arguments DeepSpeed's own __init__ refuses: its error, below
            bound = {}
        parsed = getattr(bound.get("config_class"), "_param_dict", None)
        settings.apply_config(parsed if parsed is not None else bound.get("config"))
        init(self, *args, **kwargs)

    return init_with_settings


def patch_engine_config_section() -> Undo:
    """``DeepSpeedEngine.__init__`` applies the config's ``"ds_z3native"`` section first."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return wrap_method(DeepSpeedEngine, "__init__", _applying_section)


ENGINE_CONFIG_SECTION = Patch(
    name="engine-config-section",
    summary="a DeepSpeed engine applies the \"ds_z3native\" section of its config (keys: the "
            "fields of ds_z3native.Settings) before DeepSpeed builds it, refusing a bad key or "
            "value by name",
    apply=patch_engine_config_section,
    first=Version("0.19.0"),
    last=None,
    wraps=("deepspeed.runtime.engine:DeepSpeedEngine.__init__",),
)

PATCHES: List[Patch] = [ENGINE_CONFIG_SECTION]
