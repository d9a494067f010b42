"""Post-import hooks: run a callback right after a module is executed by its import.

This is how patches edit modules that DeepSpeed imports late (``deepspeed.compile.init_z3`` in
0.19.8, its compile passes and profilers) without importing them early, and how
``DS_Z3NATIVE=1`` runs ``install()`` at ``import deepspeed``.

Standard library only, and importing nothing of ds_z3native: the start-up hook
(``ds_z3native_autoload``) loads this file by its path at interpreter start-up, before (and
without) the ``ds_z3native`` package and torch, under this module's own name, so that the package
later finds the same module (one set of pending callbacks per process).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["Callback", "when_imported", "pending"]

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


def pending(name: str) -> List[Callback]:
    """The callbacks waiting for module ``name``'s import, in registration order."""
    with _lock:
        return [callback for _, callback in _pending.get(name, ())]
