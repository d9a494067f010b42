"""Zero-code activation: with ``DS_Z3NATIVE=1``, ``import deepspeed`` runs ``ds_z3native.install()``.

``ds_z3native_autoload.pth`` (installed into site-packages beside the package) holds one line,
:data:`PTH_LINE`, that the interpreter runs at start-up. With ``DS_Z3NATIVE`` unset, empty or
``0`` it only reads the environment: nothing is imported. Otherwise it imports this module and
calls :func:`activate`, which registers a post-import hook for ``deepspeed`` (still importing
neither torch nor DeepSpeed). ``import deepspeed`` then executes DeepSpeed normally and calls
``ds_z3native.install()`` before the import returns; if install fails, the import of deepspeed
fails with :class:`AutoloadError` instead of running DeepSpeed without ds_z3native.

Values of ``DS_Z3NATIVE``: ``1``/``true``/``yes``/``on`` activate; unset, ``""``,
``0``/``false``/``no``/``off`` do not; anything else makes ``import deepspeed`` raise.

The post-import hooks (:func:`when_imported`) are also how ds_z3native patches DeepSpeed modules
that DeepSpeed itself imports late (``deepspeed.compile.init_z3`` in 0.19.8), without importing
them early. This module is top-level and uses the standard library only, so the start-up line
can import it without importing the ds_z3native package (and torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ENV_VAR", "PTH_NAME", "PTH_LINE", "AutoloadError", "activate", "deactivate",
           "is_active", "requested", "when_imported", "installed_pth_files", "write_pth"]

ENV_VAR = "DS_Z3NATIVE"
PTH_NAME = "ds_z3native_autoload.pth"
# Runs at every interpreter start-up: an environment lookup, nothing more, unless activated.
PTH_LINE = ("import os; os.environ.get('DS_Z3NATIVE', '') not in ('', '0') "
            "and __import__('ds_z3native_autoload').activate()\n")

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


# ---- post-import hooks --------------------------------------------------------------------------

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: Dict[str, List[Tuple[object, Callback]]] = {}


class _RunCallbacksAfterExec(importlib.abc.Loader):
    """Wraps a module's loader: executes the module, then runs its pending callbacks."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader (importlib.resources and friends look there).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_callbacks(module.__name__, module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path while callbacks are pending; answers only for their modules, with
    the spec the other finders give, its loader wrapped."""

    def __init__(self) -> None:
        self._searching = threading.local()

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _pending or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._searching.on = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RunCallbacksAfterExec(spec.loader)
        return spec


_finder = _PostImportFinder()


def _sync_finder() -> None:
    with _lock:
        present = _finder in sys.meta_path
        if _pending and not present:
            sys.meta_path.insert(0, _finder)
        elif not _pending and present:
            sys.meta_path.remove(_finder)


def _run_callbacks(name: str, module: ModuleType) -> None:
    with _lock:
        entries = _pending.pop(name, [])
    done = 0
    try:
        for _, callback in entries:
            callback(module)
            done += 1
    except BaseException:
        # Unfinished callbacks stay pending: a retried import runs (and fails) them again rather
        # than quietly going on without them.
        with _lock:
            _pending.setdefault(name, [])[:0] = entries[done:]
        raise
    finally:
        _sync_finder()


def when_imported(name: str, callback: Callback) -> Callable[[], None]:
    """Run ``callback(module)`` right after module ``name`` is executed by its import (before the
    import statement returns; an exception fails the import), or now if it is already imported.
    Returns a function that cancels the callback if it has not run yet."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return lambda: None
    token = object()
    with _lock:
        _pending.setdefault(name, []).append((token, callback))
        _sync_finder()

    def cancel() -> None:
        with _lock:
            entries = _pending.get(name, [])
            entries[:] = [e for e in entries if e[0] is not token]
            if not entries:
                _pending.pop(name, None)
            _sync_finder()

    return cancel


# ---- DS_Z3NATIVE --------------------------------------------------------------------------------

class AutoloadError(RuntimeError):
    """``import deepspeed`` with DS_Z3NATIVE set, but ds_z3native could not be installed.

    Deliberately not an ImportError: code that guards ``import deepspeed`` with
    ``except ImportError`` must not quietly run without DeepSpeed (or without ds_z3native).
    """


def requested(value: Optional[str] = None) -> bool:
    """Whether ``DS_Z3NATIVE`` (or ``value``) asks for activation; ValueError if unreadable."""
    raw = os.environ.get(ENV_VAR, "") if value is None else value
    norm = raw.strip().lower()
    if norm in _ON:
        return True
    if norm in _OFF:
        return False
    raise ValueError(f"{ENV_VAR}={raw!r} is not understood: set {ENV_VAR}=1 to install ds_z3native "
                     f"at `import deepspeed`, or unset it (or {ENV_VAR}=0) to run without it")


def _install_into(deepspeed: ModuleType) -> None:
    try:
        wanted = requested()
    except ValueError as e:
        raise AutoloadError(str(e)) from None
    if not wanted:
        return
    try:
        import ds_z3native

        ds_z3native.install()
    except Exception as e:  # noqa: BLE001 - re-raised with the cause attached
        raise AutoloadError(
            f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: ds_z3native.install() failed while importing "
            f"deepspeed ({getattr(deepspeed, '__file__', '?')}): {type(e).__name__}: {e}\n"
            f"Fix the cause, or unset {ENV_VAR} to run DeepSpeed without ds_z3native.") from e


_cancel_activation: Optional[Callable[[], None]] = None


def activate() -> None:
    """Arrange for ``ds_z3native.install()`` to run when deepspeed is imported (now, if it is
    already imported). Idempotent. Called by the ``.pth`` line when DS_Z3NATIVE is set."""
    global _cancel_activation
    if not is_active():
        _cancel_activation = when_imported("deepspeed", _install_into)


def deactivate() -> None:
    """Cancel a pending activation (does not uninstall ds_z3native)."""
    global _cancel_activation
    with _lock:
        if _cancel_activation is not None:
            _cancel_activation()
            _cancel_activation = None


def is_active() -> bool:
    """Whether an activation is waiting for ``import deepspeed``."""
    with _lock:
        return any(cb is _install_into for _, cb in _pending.get("deepspeed", ()))


# ---- the start-up file ---------------------------------------------------------------------------

def _site_dirs() -> List[str]:
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def installed_pth_files() -> List[str]:
    """The ``ds_z3native_autoload.pth`` files in this interpreter's site directories (setup.py's
    build_py puts one there at install time, editable installs included)."""
    return [os.path.join(d, PTH_NAME) for d in _site_dirs() if os.path.isfile(os.path.join(d, PTH_NAME))]


def write_pth(directory: str) -> str:
    """Write the start-up file into ``directory`` (a site directory) and return its path. Only
    needed where the installer did not (a legacy ``setup.py develop``); pip does not record it."""
    path = os.path.join(directory, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "--write":
        print(write_pth(argv[1]))
        return 0
    if argv:
        print("usage: python -m ds_z3native_autoload [--write SITE_DIR]", file=sys.stderr)
        return 2
    files = installed_pth_files()
    for path in files:
        with open(path) as f:
            state = "current" if f.read() == PTH_LINE else "stale (reinstall ds_z3native)"
        print(f"{path}: {state}")
    if not files:
        print(f"no {PTH_NAME} in {', '.join(_site_dirs())}: DS_Z3NATIVE has no effect; reinstall "
              f"ds_z3native, or run `python -m ds_z3native_autoload --write <site-packages>`")
    print(f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r}")
    return 0 if files else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
