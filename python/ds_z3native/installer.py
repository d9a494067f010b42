"""Make DeepSpeed use ds_z3native's native op, and fix its Python side for frozen params.

``install()``:

1. checks the DeepSpeed version (:mod:`ds_z3native.compat.gate`): 0.19.0 – 0.19.8 supported,
   0.18.x and older refused, newer allowed with a warning only if its op contract still matches;
2. loads ``ds_z3native._C`` (which registers ``torch.ops.dc``), refusing if another library
   already registered those ops, or if a ``DS_Z3NATIVE_*`` setting in the environment is
   malformed (the settings are read then, if nothing needed them before: :mod:`ds_z3native.settings`);
3. hands the module to every place DeepSpeed's loader looks: ``OpBuilder._loaded_ops["dc"]`` in
   ``deepspeed.ops.op_builder.builder`` (and in a source checkout's top-level ``op_builder.builder``,
   a second copy of the class), and ``deepspeed.compile.util.dc_handle``. From then on
   ``get_deepcompile_handle()`` and ``DeepCompileBuilder().load()`` return it; nothing is built;
4. applies the patches of :mod:`ds_z3native.compat.registry` that target that DeepSpeed version,
   once every DeepSpeed function they wrap is found to be the code recorded for that release
   (:mod:`ds_z3native.compat.fingerprints`): a patch whose target differs is refused
   (:class:`UnverifiedPatchTarget`, nothing changed) unless ``DS_Z3NATIVE_UNVERIFIED_PATCHES``
   names it (or is ``all``); targets in torch or transformers that differ from the record of the
   running version are logged as unverified and patched.

``uninstall()`` undoes 4 and 3 in reverse order, restoring exactly what was there. ``installed()``
says whether ``install()`` is in effect. Both are idempotent and thread-safe.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from packaging.version import Version

from ._native import DcNamespaceTaken, load
from ._version import __version__
from .compat import Undo, deepspeed_version
from .compat import Patch
from .compat.fingerprints import UNVERIFIED_ENV, TargetCheck, allowed_unverified, check_patches
from .compat.gate import UnsupportedDeepSpeed, Verdict, check_deepspeed_version
from .compat.registry import patches_for

__all__ = ["install", "uninstall", "installed", "InstallReport", "InstallError",
           "UnverifiedPatchTarget", "UnsupportedDeepSpeed", "DcNamespaceTaken", "loader_status",
           "verify_patches"]

log = logging.getLogger(__name__)

_OP_NAME = "dc"  # DeepCompileBuilder.NAME: the key of OpBuilder._loaded_ops


class InstallError(RuntimeError):
    """install() failed part-way; everything it had changed was undone."""


class UnverifiedPatchTarget(InstallError):
    """A DeepSpeed function a patch wraps is not the code ds_z3native was tested against (another
    release's, a local edit, or replaced at run time); nothing was changed. ``checks`` holds the
    targets that failed."""

    def __init__(self, message: str, checks: Sequence[TargetCheck]) -> None:
        super().__init__(message)
        self.checks = tuple(checks)


@dataclass(frozen=True)
class InstallReport:
    """What ``install()`` did."""

    deepspeed_version: str
    verdict: str  # "supported" or "newer-compatible"
    loader_sites: Tuple[str, ...]  # where DeepSpeed's loader now finds our module
    patches: Tuple[str, ...]  # names of the applied compat patches, in order
    # "patch: target" of each target patched although its fingerprint is not the recorded one
    # (torch/transformers targets, or DeepSpeed ones allowed by DS_Z3NATIVE_UNVERIFIED_PATCHES).
    unverified: Tuple[str, ...] = ()


@dataclass
class _State:
    report: InstallReport
    undos: List[Tuple[str, Undo]]  # applied in this order, undone in reverse


_lock = threading.RLock()
_state: Optional[_State] = None
_MISSING = object()


# ---- where DeepSpeed's loader looks ---------------------------------------------------------

@dataclass(frozen=True)
class _Site:
    name: str
    get: Callable[[], Any]  # current value, or _MISSING
    put: Callable[[Any], None]  # set a value; _MISSING removes it


def _loaded_ops_site(builder_module: ModuleType, label: str) -> _Site:
    table: Dict[str, Any] = builder_module.OpBuilder._loaded_ops

    def put(value: Any) -> None:
        if value is _MISSING:
            table.pop(_OP_NAME, None)
        else:
            table[_OP_NAME] = value

    return _Site(f"{label}.OpBuilder._loaded_ops[{_OP_NAME!r}]",
                 lambda: table.get(_OP_NAME, _MISSING), put)


def _attr_site(module: ModuleType, attr: str) -> _Site:
    def put(value: Any) -> None:
        setattr(module, attr, None if value is _MISSING else value)

    return _Site(f"{module.__name__}.{attr}", lambda: getattr(module, attr, _MISSING), put)


def _source_checkout_builder() -> Optional[ModuleType]:
    """A source checkout's top-level ``op_builder.builder``, when it is DeepSpeed's (DeepSpeed's
    accelerators then build ops through it, with its own ``OpBuilder._loaded_ops``)."""
    try:
        if importlib.util.find_spec("op_builder") is None:
            return None
        top = importlib.import_module("op_builder")
    except ImportError:
        return None
    if not getattr(top, "__deepspeed__", False):
        return None  # some other project's op_builder
    return importlib.import_module("op_builder.builder")


def _sites() -> List[_Site]:
    builder = importlib.import_module("deepspeed.ops.op_builder.builder")
    sites = [_loaded_ops_site(builder, builder.__name__)]
    top = _source_checkout_builder()
    if top is not None and top.OpBuilder is not builder.OpBuilder:
        sites.append(_loaded_ops_site(top, top.__name__))
    util = importlib.import_module("deepspeed.compile.util")
    sites.append(_attr_site(util, "dc_handle"))
    return sites


def loader_status() -> Dict[str, bool]:
    """For each place DeepSpeed's loader looks: whether it holds ds_z3native's module now."""
    ours = load() if installed() else None
    return {site.name: ours is not None and site.get() is ours for site in _sites()}


def _describe(value: Any) -> str:
    return f"{getattr(value, '__name__', value)!s} ({getattr(value, '__file__', 'no file')})"


def _hand_over(module: ModuleType, site: _Site) -> Undo:
    previous = site.get()
    site.put(module)

    def undo() -> None:
        if site.get() is module:
            site.put(previous)
        else:
            log.warning("%s was changed after install(); leaving it as it is", site.name)

    return undo


# ---- install / uninstall -----------------------------------------------------------------------

def _load_native(sites: List[_Site]) -> ModuleType:
    try:
        return load()
    except DcNamespaceTaken as e:
        holders = [f"{s.name} = {_describe(v)}" for s in sites
                   if (v := s.get()) is not _MISSING and v is not None]
        where = ("; DeepSpeed's loader already holds " + ", ".join(holders)) if holders else ""
        raise DcNamespaceTaken(
            f"ds_z3native.install(): {e}{where}. Nothing was changed. Restart the process and "
            "install ds_z3native before the first engine.compile() (or set DS_Z3NATIVE=1 so "
            "it happens at `import deepspeed`).") from e


def install() -> InstallReport:
    """Make DeepSpeed's DeepCompile use ds_z3native's op and apply the version's patches.

    Idempotent: a second call returns the first call's report. Raises
    :class:`UnsupportedDeepSpeed` for a DeepSpeed outside the supported range (nothing changed),
    :class:`UnverifiedPatchTarget` if a DeepSpeed function a patch wraps is not the code recorded
    for that release (nothing changed), :class:`DcNamespaceTaken` if another library registered
    ``torch.ops.dc`` first (nothing changed), and :class:`InstallError` if a patch fails
    (everything undone).
    """
    global _state
    with _lock:
        if _state is not None:
            log.debug("ds_z3native is already installed")
            return _state.report
        try:
            version = deepspeed_version()
        except ImportError as e:
            raise ImportError(f"ds_z3native.install() wires ds_z3native into DeepSpeed, which is "
                              f"not importable here: {e}") from e
        gate = check_deepspeed_version(version)
        if not gate.allowed:
            raise UnsupportedDeepSpeed(gate.message)
        if gate.verdict is Verdict.NEWER_COMPATIBLE:
            log.warning(gate.message)
        patches = patches_for(version)
        unverified = verify_patches(patches, version)
        sites = _sites()
        module = _load_native(sites)
        undos: List[Tuple[str, Undo]] = []
        try:
            for site in sites:
                undos.append((site.name, _hand_over(module, site)))
            for patch in patches:
                undos.append((patch.name, patch.apply()))
                log.debug("applied %s: %s", patch.name, patch.summary)
        except BaseException as e:
            _undo_all(undos)
            raise InstallError(f"ds_z3native.install() failed while applying "
                               f"{_next_step(sites, patches, len(undos))} for DeepSpeed "
                               f"{version}: {e}; every change was undone") from e
        report = InstallReport(str(version), gate.verdict.value,
                               tuple(s.name for s in sites), tuple(p.name for p in patches),
                               tuple(f"{c.patch}: {c.target}" for c in unverified))
        _state = _State(report, undos)
        flavour = module.build_info()["flavour"]
        log.info("ds_z3native installed into DeepSpeed %s (%s build): loader sites %s; patches %s",
                 version, flavour, ", ".join(report.loader_sites),
                 ", ".join(report.patches) or "none")
        _announce(report, flavour)
        return report


# The start-up line's logger. A library's loggers print nothing until the application configures
# logging; this one line is meant to be seen in a training log, so where nothing is configured
# (no handler on it or on the root logger) it gets a stderr handler of its own, as DeepSpeed's
# logger has. `logging.getLogger("ds_z3native.startup").setLevel(logging.WARNING)` silences it.
STARTUP_LOGGER = "ds_z3native.startup"


def _startup_logger() -> logging.Logger:
    logger = logging.getLogger(STARTUP_LOGGER)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _announce(report: InstallReport, flavour: str) -> None:
    """One line on rank 0 of the launch (or in a process started without a rank) saying that
    ds_z3native is active, what it applied and where to read more."""
    if os.environ.get("RANK", "0") != "0":
        return
    _startup_logger().info(
        "ds_z3native %s active in DeepSpeed %s: its %s build of the dc op and %d patches "
        "(`ds-z3native doctor` checks this environment; docs/patches.md lists the patches)",
        __version__, report.deepspeed_version, "CPU" if flavour == "cpu" else "CUDA",
        len(report.patches))


def verify_patches(patches: Sequence[Patch], version: Version) -> List[TargetCheck]:
    """Compare the targets of ``patches`` with the fingerprints recorded for DeepSpeed
    ``version`` (and the running torch/transformers). Raises :class:`UnverifiedPatchTarget`
    naming each patch, target and version where a DeepSpeed target differs and
    ``DS_Z3NATIVE_UNVERIFIED_PATCHES`` does not allow the patch; returns the checks that are not
    verified but allowed (logged: a warning for a DeepSpeed target, info for the others)."""
    release = str(Version(version.base_version))
    checks = check_patches(patches, versions={"deepspeed": release})
    allow_all, allowed = allowed_unverified()
    refused = [c for c in checks
               if not c.status.ok and c.strict and not allow_all and c.patch not in allowed]
    if refused:
        names = sorted({c.patch for c in refused})
        lines = "\n".join(f"  - patch {c.patch}: {c.target}: {c.explain()}" for c in refused)
        raise UnverifiedPatchTarget(
            f"ds_z3native.install(): DeepSpeed {version}: {len(refused)} target(s) of patch(es) "
            f"{', '.join(names)} are not the code ds_z3native was tested with:\n{lines}\n"
            "Nothing was changed. Use an unmodified supported DeepSpeed release "
            f"(pip install --force-reinstall 'deepspeed>=0.19.0,<=0.19.8'), or, to apply these "
            f"patches anyway, set {UNVERIFIED_ENV}={','.join(names)} (or {UNVERIFIED_ENV}=all).",
            refused)
    unverified = [c for c in checks if not c.status.ok]
    for c in unverified:
        # A DeepSpeed target let through by the override is the user's risk: a warning. A torch or
        # transformers version without a record is the common case (users run many): an info
        # line, and the doctor's table.
        if c.strict:
            log.warning("ds_z3native: patch %s wraps %s, unverified on %s %s (allowed by %s): %s",
                        c.patch, c.target, c.package, c.version, UNVERIFIED_ENV, c.explain())
        else:
            log.info("ds_z3native: patch %s wraps %s, unverified on %s %s (%s targets are "
                     "reported, not refused): %s", c.patch, c.target, c.package, c.version,
                     c.package, c.explain())
    return unverified


def _next_step(sites: List[_Site], patches: List[Any], done: int) -> str:
    if done < len(sites):
        return f"loader site {sites[done].name}"
    return f"patch {patches[done - len(sites)].name}"


def _undo_all(undos: List[Tuple[str, Undo]]) -> None:
    errors = []
    for name, undo in reversed(undos):
        try:
            undo()
        except Exception as e:  # noqa: BLE001 - undo the rest, then report
            errors.append(f"{name}: {e}")
    if errors:
        raise InstallError("could not undo " + "; ".join(errors))


def uninstall() -> None:
    """Undo ``install()``: remove the patches and give DeepSpeed's loader back what it held.

    Idempotent. ``torch.ops.dc`` stays registered by ``ds_z3native._C`` for the life of the
    process (a loaded extension cannot be unloaded), so DeepSpeed's own dc op cannot be loaded in
    this process afterwards: loading it would abort on the duplicate registration.
    """
    global _state
    with _lock:
        if _state is None:
            return
        state, _state = _state, None
        _undo_all(state.undos)
        log.info("ds_z3native uninstalled; torch.ops.dc stays registered by ds_z3native._C until "
                 "the process exits")


def installed() -> bool:
    """Whether ``install()`` is in effect in this process."""
    return _state is not None
