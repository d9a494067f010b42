"""Replace a function everywhere DeepSpeed holds it, and put it back.

Every edit a patch makes goes through these helpers (each returns the undo); edits of modules
DeepSpeed imports late wait for their import (:mod:`ds_z3native.compat.import_hooks`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Callable, List, Sequence, Tuple

from . import Undo
from .import_hooks import when_imported

__all__ = ["wrap_function", "wrap_method", "replace_attributes", "when_module_imported",
           "rebind_when_imported", "undo_all"]

log = logging.getLogger(__name__)


def wrap_function(owners: Sequence[ModuleType], attr: str,
                  make_wrapper: Callable[[Callable], Callable]) -> Undo:
    """Replace ``owners[0].<attr>`` by ``make_wrapper(original)`` in every owner that holds the
    same function object (a module that did ``from x import attr`` holds its own reference).

    The undo restores the original in each owner that still holds the wrapper; an owner where
    someone replaced the wrapper since is left alone (with a warning), so their change survives.
    """
    original = getattr(owners[0], attr)
    wrapper = functools.wraps(original)(make_wrapper(original))
    patched: List[ModuleType] = []
    for owner in owners:
        if getattr(owner, attr, None) is original and owner not in patched:
            setattr(owner, attr, wrapper)
            patched.append(owner)

    def undo() -> None:
        for owner in patched:
            if getattr(owner, attr, None) is wrapper:
                setattr(owner, attr, original)
            else:
                log.warning("%s.%s was replaced after ds_z3native patched it; leaving the newer "
                            "object in place", owner.__name__, attr)

    return undo


def when_module_imported(module_name: str, apply: Callable[[], Undo]) -> Undo:
    """Run ``apply`` now if ``module_name`` is imported, else right after DeepSpeed imports it
    (so that patching a lazily imported module does not import it early). The undo removes the
    pending hook, or undoes what ``apply`` did."""
    applied: List[Undo] = []
    cancel = when_imported(module_name, lambda _module: applied.append(apply()))

    def undo() -> None:
        cancel()
        while applied:
            applied.pop()()

    return undo


def rebind_when_imported(module_name: str, original: Callable, wrapper: Callable) -> Undo:
    """Point ``module_name``'s own reference to ``original`` (a ``from x import f`` binding) at
    ``wrapper``, now if the module is imported, else when DeepSpeed imports it.

    The module may already hold ``wrapper`` (it imported the name after the wrapper was put in
    place) or an earlier wrapper of the same original (``__wrapped__``: a binding left from an
    earlier install): both are rebound, and the undo puts ``original`` back wherever ``wrapper``
    still is, so nothing of ours outlives an uninstall. The module may also hold a later patch's
    wrapper around ``wrapper`` (two patches wrap the same function and the module imported the
    name after both): it stays, and the undo still puts ``original`` back once that later
    patch's undo has put ``wrapper`` there. Any other object there is someone else's and stays.
    """
    name = original.__name__

    def wraps_ours(obj: Any) -> bool:
        seen = 0
        while obj is not None and seen < 16:  # a chain of __wrapped__, bounded
            obj = getattr(obj, "__wrapped__", None)
            if obj is wrapper:
                return True
            seen += 1
        return False

    def rebind() -> Undo:
        import sys

        module = sys.modules[module_name]
        current = getattr(module, name, None)
        ours = current is original or current is wrapper or (
            getattr(current, "__wrapped__", None) is original)

        def undo() -> None:
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)

        if not ours and wraps_ours(current):
            return undo  # a later wrapper of ours stays; its undo puts ours back first
        if not ours:
            log.debug("%s.%s is neither DeepSpeed's nor ours; left as it is", module_name, name)
            return lambda: None
        setattr(module, name, wrapper)
        return undo

    return when_module_imported(module_name, rebind)


def undo_all(undos: Sequence[Undo]) -> Undo:
    """One undo for several edits: undoes them last first, once."""
    pending = list(undos)

    def undo() -> None:
        while pending:
            pending.pop()()

    return undo


def wrap_method(cls: type, attr: str, make_wrapper: Callable[[Callable], Callable]) -> Undo:
    """Replace the method ``cls.<attr>`` by ``make_wrapper(original)``. The undo restores it if the
    wrapper is still in place (else warns and leaves the newer object, as :func:`wrap_function`)."""
    original = cls.__dict__[attr]
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(cls, attr, wrapper)

    def undo() -> None:
        if cls.__dict__.get(attr) is wrapper:
            setattr(cls, attr, original)
        else:
            log.warning("%s.%s was replaced after ds_z3native patched it; leaving the newer "
                        "object in place", cls.__qualname__, attr)

    return undo


_INHERITED = object()  # an attribute the owner inherits: the undo deletes the override


def replace_attributes(edits: Sequence[Tuple[Any, str, Any]]) -> Undo:
    """Set ``owner.<name> = new`` for each ``(owner, name, new)`` (classes or modules), in order.
    The undo, last first, puts back what each owner held itself (an override of an inherited
    attribute is deleted) where ``new`` is still in place; an attribute replaced since is left
    alone with a warning, as :func:`wrap_function`."""
    originals = [(owner, name, vars(owner).get(name, _INHERITED), new)
                 for owner, name, new in edits]
    for owner, name, new in edits:
        setattr(owner, name, new)

    def undo() -> None:
        while originals:
            owner, name, original, new = originals.pop()
            if vars(owner).get(name) is not new:
                log.warning("%s.%s was replaced after ds_z3native patched it; leaving the newer "
                            "object in place", getattr(owner, "__name__", owner), name)
            elif original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    return undo
