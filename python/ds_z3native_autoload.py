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

The post-import hooks live in :mod:`ds_z3native.compat.import_hooks` (with which the patches
also edit modules DeepSpeed imports late). This module is a thin top-level shim that uses the
standard library only: the start-up line imports it, and it loads the hook module from its file,
without importing the ds_z3native package (and torch); it imports the package only when
``import deepspeed`` calls ``install()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Callable, List, Optional, Sequence

__all__ = ["ENV_VAR", "PTH_NAME", "PTH_LINE", "AutoloadError", "activate", "deactivate",
           "is_active", "requested", "when_imported", "installed_pth_files", "write_pth"]

ENV_VAR = "DS_Z3NATIVE"
PTH_NAME = "ds_z3native_autoload.pth"
# Runs at every interpreter start-up: an environment lookup, nothing more, unless activated.
PTH_LINE = ("import os; os.environ.get('DS_Z3NATIVE', '') not in ('', '0') "
            "and __import__('ds_z3native_autoload').activate()\n")

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})

_lock = threading.RLock()


# ---- post-import hooks --------------------------------------------------------------------------

_HOOKS = "ds_z3native.compat.import_hooks"


def _import_hooks() -> ModuleType:
    """``ds_z3native.compat.import_hooks`` (the post-import hook machinery, standard library
    only). Before the ``ds_z3native`` package is imported it is loaded from its file, under its
    own name, without importing the package (which imports torch): the package then finds this
    same module in ``sys.modules``."""
    module = sys.modules.get(_HOOKS)
    if module is not None:
        return module
    if "ds_z3native" in sys.modules:
        return importlib.import_module(_HOOKS)
    package = importlib.util.find_spec("ds_z3native")
    if package is None or not package.submodule_search_locations:
        raise ImportError(f"{ENV_VAR}: the ds_z3native package is not importable here")
    path = os.path.join(list(package.submodule_search_locations)[0], "compat", "import_hooks.py")
    spec = importlib.util.spec_from_file_location(_HOOKS, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{ENV_VAR}: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    with _lock:
        if _HOOKS in sys.modules:  # another thread got there first
            return sys.modules[_HOOKS]
        sys.modules[_HOOKS] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_HOOKS]
            raise
    return module


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> Callable[[], None]:
    """:func:`ds_z3native.compat.import_hooks.when_imported` (kept here for callers of this
    module): run ``callback(module)`` right after ``name`` is imported, or now if it is."""
    return _import_hooks().when_imported(name, callback)


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
    return any(cb is _install_into for cb in _import_hooks().pending("deepspeed"))


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
