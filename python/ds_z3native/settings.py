"""ds_z3native's settings: the persistence budget, the prefetch budget, the profile store and the
grouping of persistent params' gathers.

One :class:`Settings` value per process, held here and handed to those that use it: the native
runtime (``_C.set_default_persistence_budget``, pushed by ``ds_z3native``), DeepCompile's
prefetch pass (``compat.deepcompile_prefetch``), its profilers
(``compat.deepcompile_profile_store``), its re-plan (``compat.deepcompile_persistent``) and its
warm start (``compat.deepcompile_warm_start``).

The environment gives the defaults, read once: the first time a setting is needed in this
process (loading the native module, ``install()``, a setter, or a consumer, whichever comes
first). Later changes of ``os.environ`` are not seen; the setters
(``ds_z3native.set_persistence_budget`` and the others) change this process's settings and never
write ``os.environ``. A child process (a spawned rank, a subprocess) reads its own environment,
the variables below, which it inherits from this process's environment, not the setters' values.

Every value is checked by :func:`check_budget_mib` or :func:`check_profile_store`, and a bad one
is refused with a ValueError naming where it came from (the setter or the variable) and the value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional

__all__ = ["Settings", "PERSISTENCE_BUDGET_ENV", "PREFETCH_BUDGET_ENV", "PROFILE_STORE_ENV",
           "GROUP_PERSISTENT_ENV", "GROUP_REDUCE_ENV", "WARM_START_ENV", "SINGLE_CYCLE_ENV",
           "MAX_BUDGET_MIB", "BUDGET_RANGE",
           "check_budget_mib",
           "check_profile_store", "check_switch", "current",
           "subscribe", "update", "use"]

PERSISTENCE_BUDGET_ENV = "DS_Z3NATIVE_PERSISTENCE_BUDGET_MB"
PREFETCH_BUDGET_ENV = "DS_Z3NATIVE_PREFETCH_BUDGET_MB"
PROFILE_STORE_ENV = "DS_Z3NATIVE_PROFILE_STORE"
GROUP_PERSISTENT_ENV = "DS_Z3NATIVE_GROUP_PERSISTENT"
GROUP_REDUCE_ENV = "DS_Z3NATIVE_GROUP_REDUCE"
WARM_START_ENV = "DS_Z3NATIVE_WARM_START"
SINGLE_CYCLE_ENV = "DS_Z3NATIVE_SINGLE_CYCLE"
_SWITCH_VALUES = {"1": True, "true": True, "on": True, "yes": True,
                  "0": False, "false": False, "off": False, "no": False}
MAX_BUDGET_MIB = 1e12  # exclusive; far above any device, and still exact in int64 bytes
# The accepted budgets as the error messages and docs write them, from MAX_BUDGET_MIB.
BUDGET_RANGE = f"[0, {MAX_BUDGET_MIB:g})".replace("e+", "e")


def check_budget_mib(value: Any, what: str) -> Optional[float]:
    """``value`` as a budget in MiB: None (no cap) or a finite number in :data:`BUDGET_RANGE`
    (from 0 up to :data:`MAX_BUDGET_MIB`, exclusive); ValueError naming ``what`` (the setter or
    variable it came from) and the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value >= MAX_BUDGET_MIB:
        raise ValueError(f"{what}: expected MiB in {BUDGET_RANGE} or None, got {value!r}")
    return float(value)


def check_profile_store(value: Any, what: str) -> Optional[Path]:
    """``value`` as a profile store directory: None (no store) or a non-empty path; ValueError
    naming ``what`` and the value otherwise."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{what}: expected a directory (str or os.PathLike) or None, got "
                         f"{value!r}")
    path = os.fspath(value)
    if not str(path).strip():
        raise ValueError(f"{what}: the directory is empty ({value!r}); pass None to turn the "
                         "store off")
    return Path(path)


def check_switch(value: Any, what: str) -> bool:
    """``value`` as an on/off setting: a bool; ValueError naming ``what`` and the value
    otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected True or False, got {value!r}")
    return value


def _mib_to_bytes(mib: Optional[float]) -> Optional[int]:
    return None if mib is None else int(mib * 1024 * 1024)


@dataclass(frozen=True)
class Settings:
    """The settings of this process; None in a field means DeepSpeed's behaviour."""

    persistence_budget_mib: Optional[float] = None
    prefetch_budget_mib: Optional[float] = None
    profile_store: Optional[Path] = None
    # False: DeepCompile's re-plan keeps DeepSpeed's three dc op calls per use of a param kept
    # gathered (compat.deepcompile_persistent).
    group_persistent: bool = True
    # False: DeepCompile's backward graphs keep DeepSpeed's reduce_grad call per gradient
    # (compat.deepcompile_reduce_group).
    group_reduce: bool = True
    # False: with a profile store, DeepCompile still compiles a first cycle and re-plans
    # (compat.deepcompile_warm_start).
    warm_start: bool = True
    # True: a DeepCompile run that does not start warm compiles the re-plan's passes at its first
    # step, once, and does not re-plan (compat.deepcompile_warm_start).
    single_cycle: bool = False

    def __post_init__(self) -> None:
        check_budget_mib(self.persistence_budget_mib, "Settings.persistence_budget_mib")
        check_budget_mib(self.prefetch_budget_mib, "Settings.prefetch_budget_mib")
        check_profile_store(self.profile_store, "Settings.profile_store")
        check_switch(self.group_persistent, "Settings.group_persistent")
        check_switch(self.group_reduce, "Settings.group_reduce")
        check_switch(self.warm_start, "Settings.warm_start")
        check_switch(self.single_cycle, "Settings.single_cycle")

    @property
    def persistence_budget_bytes(self) -> Optional[int]:
        """The persistence budget in bytes (what the native runtime takes), or None."""
        return _mib_to_bytes(self.persistence_budget_mib)

    @property
    def prefetch_budget_bytes(self) -> Optional[int]:
        """The prefetch budget in bytes, or None."""
        return _mib_to_bytes(self.prefetch_budget_mib)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """The settings ``environ`` gives (unset or empty: None); ValueError naming the variable
        and its value when one is malformed."""

        def budget(name: str) -> Optional[float]:
            raw = environ.get(name, "").strip()
            if not raw:
                return None
            try:
                return check_budget_mib(float(raw), name)
            except ValueError:
                raise ValueError(f"{name}: expected MiB in {BUDGET_RANGE}, got {raw!r} (unset it "
                                 "for no cap)") from None

        def switch(name: str, default: bool) -> bool:
            raw = environ.get(name, "").strip()
            if not raw:
                return default
            if raw.lower() not in _SWITCH_VALUES:
                raise ValueError(f"{name}: expected 1 or 0 (true/false, on/off, yes/no), got "
                                 f"{raw!r}")
            return _SWITCH_VALUES[raw.lower()]

        store = environ.get(PROFILE_STORE_ENV, "").strip()
        return cls(persistence_budget_mib=budget(PERSISTENCE_BUDGET_ENV),
                   prefetch_budget_mib=budget(PREFETCH_BUDGET_ENV),
                   profile_store=Path(store) if store else None,
                   group_persistent=switch(GROUP_PERSISTENT_ENV, True),
                   group_reduce=switch(GROUP_REDUCE_ENV, True),
                   warm_start=switch(WARM_START_ENV, True),
                   single_cycle=switch(SINGLE_CYCLE_ENV, False))


_lock = threading.Lock()
_current: Optional[Settings] = None  # None until first needed: then read from the environment
_subscribers: List[Callable[[Settings], None]] = []


def current() -> Settings:
    """This process's settings (on the first call: read from ``os.environ``)."""
    global _current
    with _lock:
        if _current is None:
            _current = Settings.from_env(os.environ)
        return _current


def subscribe(apply: Callable[[Settings], None]) -> None:
    """Call ``apply`` with the settings now and after every change (how the native module gets
    its persistence budget)."""
    settings = current()
    with _lock:
        _subscribers.append(apply)
    apply(settings)


def _publish(settings: Settings) -> Settings:
    with _lock:
        subscribers = list(_subscribers)
    for apply in subscribers:
        apply(settings)
    return settings


def update(**changes: Any) -> Settings:
    """Replace fields of this process's settings (each checked by the caller, whose name the
    message gives) and hand the result to the subscribers; returns it."""
    global _current
    base = current()
    with _lock:
        _current = new = dataclasses.replace(_current or base, **changes)
    return _publish(new)


def use(settings: Settings) -> Settings:
    """Make ``settings`` this process's settings (for tests, or ``Settings.from_env(os.environ)``
    in a process that changed its environment on purpose); returns the previous ones."""
    global _current
    if not isinstance(settings, Settings):
        raise TypeError(f"use: expected a Settings, got {type(settings).__name__}")
    previous = current()
    with _lock:
        _current = settings
    _publish(settings)
    return previous
