"""ds_z3native's settings: the memory budgets of DeepCompile's gathers, its profile store, and the
switches of ds_z3native's DeepCompile passes.

One :class:`Settings` value per process, held here and handed to those that use it: the native
runtime (``_C.set_default_persistence_budget``, pushed by ``ds_z3native``), DeepCompile's
prefetch pass (``compat.deepcompile_prefetch``), its profilers
(``compat.deepcompile_profile_store``), its re-plan (``compat.deepcompile_persistent``) and its
warm start (``compat.deepcompile_warm_start``).

Each field is declared once, in :class:`Settings`, with what it does, the values it takes and the
``DS_Z3NATIVE_*`` variable that gives its default (:func:`markdown_table` writes them as
docs/usage.md shows them). Three places set them; the last one applied wins:

1. The environment gives the defaults, read once: the first time a setting is needed in this
   process (loading the native module, ``install()``, ``configure()``, or a consumer, whichever
   comes first). Later changes of ``os.environ`` are not seen.
2. ``ds_z3native.configure(**fields)`` (and the older one-field setters, such as
   ``set_persistence_budget``) replaces the fields it names in this process; it never writes
   ``os.environ``, so a child process (a spawned rank, a subprocess) reads its own environment.
3. A ``"ds_z3native"`` section of the DeepSpeed config (keys: the field names) replaces the
   fields it names when an engine is created with that config, while ds_z3native is installed
   (patch ``engine-config-section``): over the environment and over what ``configure()`` set
   before. A ``configure()`` call after that replaces them again.

Every value is checked once, by its field's check (:func:`check_budget_mib`,
:func:`check_profile_store`, :func:`check_switch`), and a bad one is refused with a ValueError
naming where it came from (the variable, ``configure(<field>=...)``, the setter, or
``ds_z3native.<field>`` of the DeepSpeed config) and the value, before anything changes.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import math
import os
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

__all__ = ["Settings", "PERSISTENCE_BUDGET_ENV", "PREFETCH_BUDGET_ENV", "PROFILE_STORE_ENV",
           "GROUP_PERSISTENT_ENV", "GROUP_REDUCE_ENV", "WARM_START_ENV", "SINGLE_CYCLE_ENV",
           "CONFIG_SECTION", "MAX_BUDGET_MIB", "BUDGET_RANGE",
           "check_budget_mib", "check_profile_store", "check_switch",
           "apply", "apply_config", "markdown_table", "unknown_variables", "OTHER_VARIABLES",
           "current", "subscribe", "update", "use"]

log = logging.getLogger(__name__)

# The key of the DeepSpeed config whose object holds settings (keys: the field names).
CONFIG_SECTION = "ds_z3native"
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


# ---- How each kind of setting is checked, read from its variable and written in the docs -------

def _budget_from_variable(name: str, raw: str) -> Optional[float]:
    try:
        return check_budget_mib(float(raw), name)
    except ValueError:
        raise ValueError(f"{name}: expected MiB in {BUDGET_RANGE}, got {raw!r} (unset it for no "
                         "cap)") from None


def _store_from_variable(name: str, raw: str) -> Path:
    return Path(raw)


def _switch_from_variable(name: str, raw: str) -> bool:
    if raw.lower() not in _SWITCH_VALUES:
        raise ValueError(f"{name}: expected 1 or 0 (true/false, on/off, yes/no), got {raw!r}")
    return _SWITCH_VALUES[raw.lower()]


@dataclass(frozen=True)
class _Kind:
    check: Callable[[Any, str], Any]  # (value, where it came from) -> the value, or ValueError
    from_variable: Callable[[str, str], Any]  # (variable, its non-empty value) -> the value
    values: str  # the values it takes, as the settings table writes them


_BUDGET = _Kind(check_budget_mib, _budget_from_variable,
                f"MiB in {BUDGET_RANGE}, or `None` (`null`): no cap")
_STORE = _Kind(check_profile_store, _store_from_variable, "a directory, or `None` (`null`): none")
_SWITCH = _Kind(check_switch, _switch_from_variable,
                "`True` / `False` (`true` / `false`); the variable: `1` / `0` (also `true` / "
                "`false`, `on` / `off`, `yes` / `no`)")


def _setting(default: Any, variable: str, kind: _Kind, doc: str) -> Any:
    """A field of :class:`Settings`: its default, the variable that replaces that default, its
    kind, and what it does (the one place that says so)."""
    return dataclasses.field(default=default, metadata={"variable": variable, "kind": kind,
                                                        "doc": " ".join(doc.split())})


@dataclass(frozen=True)
class Settings:
    """The settings of this process (``ds_z3native.current_settings()``); None in a field means
    DeepSpeed's behaviour. Set them with ``ds_z3native.configure(**fields)``, a ``"ds_z3native"``
    section of the DeepSpeed config, or the ``DS_Z3NATIVE_*`` variables (the defaults); see
    :mod:`ds_z3native.settings` for which wins."""

    persistence_budget_mib: Optional[float] = _setting(
        None, "DS_Z3NATIVE_PERSISTENCE_BUDGET_MB", _BUDGET, """
        Cap, in MiB, on the memory DeepCompile's selective gather keeps gathered between uses
        (`None`: no cap, DeepSpeed's behaviour). After profiling, DeepCompile marks params
        persistent while it estimates free GPU memory; with a cap only what fits stays
        gathered, and the others are gathered and released at each use. `0` keeps nothing
        gathered, small norm weights included (DeepCompile registers every param
        non-persistent). On one rank a gathered param is its shard itself and counts 0 bytes.
        Applies to the live native runtime and to every later `init()`. Use the same value on
        every rank: keeping a param gathered is a collective.""")
    prefetch_budget_mib: Optional[float] = _setting(
        None, "DS_Z3NATIVE_PREFETCH_BUDGET_MB", _BUDGET, """
        Cap, in MiB, on the gathered bytes DeepCompile's prefetch pass keeps in flight (`None`:
        DeepSpeed's window, up to 4e9 bytes or 90% of the device's
        memory). `0` gathers each param just before its first use (least memory, least
        overlap); with a persistence budget of `0` too, DeepCompile's peak comes close to eager
        ZeRO-3's. Read when DeepCompile plans (its 6th step, or a recompile; patch
        `deepcompile-prefetch-budget`). Use the same value on every rank: it shapes the compiled
        graphs' collectives.""")
    profile_store: Optional[Path] = _setting(
        None, "DS_Z3NATIVE_PROFILE_STORE", _STORE, """
        Directory where DeepCompile's graph profiles are kept and replayed from in later runs
        (`None`: profiled afresh in each run, DeepSpeed's behaviour). Timings vary from run to
        run, so without it two runs of a job compile differently ordered graphs and inductor's
        cache (`TORCHINDUCTOR_CACHE_DIR`) cannot serve the second; with it they compile the
        same graphs, and a replayed graph is not profiled again. A profile describes the
        hardware it was measured on: delete the directory to measure again. Patch
        `deepcompile-profile-store`; use the same directory on every rank.""")
    group_persistent: bool = _setting(
        True, "DS_Z3NATIVE_GROUP_PERSISTENT", _SWITCH, """
        Whether DeepCompile's re-plan reaches the params it keeps gathered with one
        `ds_z3native::gather_persistent` call per graph (`True`), or with DeepSpeed's
        `allgather_param`, `wait_allgather` and `release_param` at each use (`False`). On,
        DeepSpeed's own selective-gather pass chooses those params at the start of the re-plan,
        from the first cycle's profiles; the values computed are the same. Read at each re-plan
        (patch `deepcompile-persistent-group`); use the same value on every rank.""")
    group_reduce: bool = _setting(
        True, "DS_Z3NATIVE_GROUP_REDUCE", _SWITCH, """
        Whether DeepCompile's backward graphs hand their gradients to the reduction in groups,
        one `ds_z3native::reduce_grads` call per up to 64 gradients or 64 MiB of them (`True`),
        or one `reduce_grad` call per gradient as DeepSpeed compiles them (`False`). The values
        reduced are the same. Read when DeepCompile hands a graph to inductor (patch
        `deepcompile-grouped-reduce`); use the same value on every rank.""")
    warm_start: bool = _setting(
        True, "DS_Z3NATIVE_WARM_START", _SWITCH, """
        Whether a DeepCompile run whose profile store holds its job's re-plan compiles the
        re-plan's graphs at its first step, from the stored profiles and inductor's cache, and
        does not re-plan (`True`), or compiles and re-plans as a first run does (`False`). No
        effect without a profile store; a store without the job's first graph gives a first
        run. Read at DeepCompile's first step (patch `deepcompile-warm-start`); use the same
        value on every rank.""")
    single_cycle: bool = _setting(
        False, "DS_Z3NATIVE_SINGLE_CYCLE", _SWITCH, """
        Whether a DeepCompile run that does not start warm compiles its graphs once (`True`:
        its first step runs the re-plan's passes on the profiles that step measures, and no
        re-plan follows) or twice, as DeepSpeed does (`False`). The params kept gathered are
        then chosen at the last backward graph, with the memory an Adam-like optimizer's states
        will take (two fp32 values per trainable element) held back, and the graphs compiled
        before that are compiled again by inductor alone, those params reached by one call per
        graph (patch `deepcompile-single-cycle-regroup`). With a profile store it records what
        a re-plan would, so the next run starts warm. Only for DeepSpeed's default schedule.
        Read at DeepCompile's first step (patch `deepcompile-warm-start`); use the same value
        on every rank.""")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            f.metadata["kind"].check(getattr(self, f.name), f"Settings.{f.name}")

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
        """The settings ``environ`` gives (a variable unset or empty: the field's default);
        ValueError naming the variable and its value when one is malformed."""
        values = {}
        for f in dataclasses.fields(cls):
            variable = f.metadata["variable"]
            raw = environ.get(variable, "").strip()
            if raw:
                values[f.name] = f.metadata["kind"].from_variable(variable, raw)
        return cls(**values)


_FIELDS: Dict[str, "dataclasses.Field[Any]"] = {f.name: f for f in dataclasses.fields(Settings)}


def _field_doc(f: "dataclasses.Field[Any]") -> str:
    def fill(text: str) -> str:
        return textwrap.fill(text.replace("`", ""), 92, initial_indent="    ",
                             subsequent_indent="    ", break_on_hyphens=False)

    return (f"{f.name} = {f.default!r}\n"
            + fill(f"Variable {f.metadata['variable']}; {f.metadata['kind'].values}.") + "\n"
            + fill(f.metadata["doc"]))


# help(Settings) shows every field's doc (dataclasses keep field metadata out of it).
Settings.__doc__ = inspect.cleandoc(Settings.__doc__ or "") + "\n\nFields:\n\n" + "\n\n".join(
    _field_doc(f) for f in _FIELDS.values())


def _variable(field: str) -> str:
    return _FIELDS[field].metadata["variable"]


PERSISTENCE_BUDGET_ENV = _variable("persistence_budget_mib")
PREFETCH_BUDGET_ENV = _variable("prefetch_budget_mib")
PROFILE_STORE_ENV = _variable("profile_store")
GROUP_PERSISTENT_ENV = _variable("group_persistent")
GROUP_REDUCE_ENV = _variable("group_reduce")
WARM_START_ENV = _variable("warm_start")
SINGLE_CYCLE_ENV = _variable("single_cycle")


def markdown_table() -> str:
    """The settings as docs/usage.md's table shows them: one row per field of :class:`Settings`
    (its name, variable, values, default and doc)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| setting | variable | values | default | effect |", "|---|---|---|---|---|"]
    for f in _FIELDS.values():
        rows.append("| " + " | ".join(cell(c) for c in (
            f"`{f.name}`", f"`{f.metadata['variable']}`", f.metadata["kind"].values,
            f"`{f.default!r}`", f.metadata["doc"])) + " |")
    return "\n".join(rows)


_lock = threading.Lock()
_current: Optional[Settings] = None  # None until first needed: then read from the environment
_subscribers: List[Callable[[Settings], None]] = []


# ds_z3native's variables read elsewhere: the start-up hook, the build, install().
OTHER_VARIABLES = ("DS_Z3NATIVE", "DS_Z3NATIVE_CUDA", "DS_Z3NATIVE_UNVERIFIED_PATCHES")


def unknown_variables(environ: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """(name, the known variable it is closest to, or None) of each ``DS_Z3NATIVE_*`` variable in
    ``environ`` that ds_z3native does not read: a misspelt one (``..._BUDGET_MIB`` for
    ``..._BUDGET_MB``) would otherwise be ignored without a word."""
    known = sorted({f.metadata["variable"] for f in _FIELDS.values()} | set(OTHER_VARIABLES))
    found = []
    for name in sorted(environ):
        if name.startswith("DS_Z3NATIVE_") and name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.9)
            found.append((name, near[0] if near else None))
    return found


def current() -> Settings:
    """This process's settings (on the first call: read from ``os.environ``, with a
    ``UserWarning`` for each ``DS_Z3NATIVE_*`` variable that is not one of ds_z3native's)."""
    global _current
    with _lock:
        if _current is None:
            _current = Settings.from_env(os.environ)
            for name, near in unknown_variables(os.environ):
                # A warning, not a log record: the package's logger has no handler of its own.
                warnings.warn(f"{name} is not a ds_z3native variable: ignored"
                              + (f" (did you mean {near}?)" if near else ""), stacklevel=2)
        return _current


def subscribe(on_change: Callable[[Settings], None]) -> None:
    """Call ``on_change`` with the settings now and after every change (how the native module
    gets its persistence budget)."""
    settings = current()
    with _lock:
        _subscribers.append(on_change)
    on_change(settings)


def _publish(settings: Settings) -> Settings:
    with _lock:
        subscribers = list(_subscribers)
    for on_change in subscribers:
        on_change(settings)
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


def apply(where: str, fields: Mapping[str, Any]) -> Settings:
    """Check every field of ``fields`` (a name of a :class:`Settings` field -> its value), then
    make them this process's settings at once; returns the new settings. The persistence budget
    also reaches the live native runtime, if one is initialized (every later ``init()`` gets it
    as its default, a subscriber). ``where`` names the source in the messages, ``{}`` standing
    for the field (``"configure({}=...)"``, ``"set_prefetch_budget"``): ValueError naming it and
    the value for a bad value, naming it and listing the settings for an unknown field; nothing
    changes then."""
    checked: Dict[str, Any] = {}
    for name, value in fields.items():
        what = where.format(name)
        if name not in _FIELDS:
            raise ValueError(f"{what}: no such setting; the settings are "
                             f"{', '.join(_FIELDS)}")
        checked[name] = _FIELDS[name].metadata["kind"].check(value, what)
    new = update(**checked)
    # A live runtime exists only where the native module is loaded (it reads these settings when
    # it loads, and follows their default from then on): looked up, not imported.
    runtime = sys.modules.get("ds_z3native._C")
    if "persistence_budget_mib" in checked and runtime is not None and runtime.is_initialized():
        runtime.set_persistence_budget(new.persistence_budget_bytes)
    return new


def apply_config(config: Any) -> Optional[Settings]:
    """Apply the ``"ds_z3native"`` section of the DeepSpeed config ``config`` (its dict), as
    :func:`apply` does, each field named ``ds_z3native.<field>`` in the messages; returns the
    new settings, or None where the config has no such section."""
    if not isinstance(config, Mapping) or CONFIG_SECTION not in config:
        return None
    section = config[CONFIG_SECTION]
    if not isinstance(section, Mapping):
        raise ValueError(f"{CONFIG_SECTION} (DeepSpeed config): expected an object whose keys are "
                         f"settings ({', '.join(_FIELDS)}), got {section!r}")
    new = apply(CONFIG_SECTION + ".{} (DeepSpeed config)", section)
    log.info("ds_z3native settings from the DeepSpeed config: %s",
             ", ".join(f"{name}={getattr(new, name)!r}" for name in section))
    return new
