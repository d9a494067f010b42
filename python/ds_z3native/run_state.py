"""This process's ds_z3native run state, read in one call and cleared in one call.

Every patch that counts what it did (graphs rewritten, profiles stored and replayed, warm starts,
gradient norms taken over one span...) registers its counters here under one name, with the
function that reads them and the one that clears them (and the per-run state that goes with
them: a single cycle's kept graphs, the profiles seen, the warm start's phase).
:func:`stats` returns them all, by name; :func:`reset` clears them all, as in a new process.
``ds_z3native.stats()`` and ``ds_z3native.reset_stats()`` are these two after importing every
patch module (the patch registry's list); the benchmarks build their records from
``ds_z3native.stats()``.

A part's name is the key its counters have in :func:`stats` and in the benchmarks' JSON records.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

__all__ = ["Part", "RunState", "RUN_STATE", "stats", "reset"]


@dataclass(frozen=True)
class Part:
    """One patch's counters: ``read()`` returns them (JSON-serialisable), ``clear()`` zeroes them
    and forgets the per-run state they belong to."""

    name: str
    read: Callable[[], Any]
    clear: Callable[[], None]
    module: str


class RunState:
    """The registered :class:`Part` s of this process, in registration order."""

    def __init__(self) -> None:
        self._parts: Dict[str, Part] = {}
        self._lock = threading.Lock()

    def register(self, name: str, read: Callable[[], Any], clear: Callable[[], None]) -> None:
        """Register part ``name`` (its module is ``read``'s). Registering the same name again
        from the same module replaces it (a reloaded module); from another module it is a
        ValueError naming both."""
        module = getattr(read, "__module__", "?")
        with self._lock:
            old = self._parts.get(name)
            if old is not None and old.module != module:
                raise ValueError(f"RunState.register: part {name!r} is registered by {old.module}; "
                                 f"{module} cannot take the name")
            self._parts[name] = Part(name, read, clear, module)

    def parts(self) -> List[Part]:
        """Every registered part: those of the patch modules imported so far (each registers its
        own at import; ``ds_z3native.stats()`` imports them all first)."""
        with self._lock:
            return list(self._parts.values())

    def stats(self) -> Dict[str, Any]:
        """Each part's counters, by name."""
        return {part.name: part.read() for part in self.parts()}

    def reset(self) -> None:
        """Clear every part (as a new process)."""
        for part in self.parts():
            part.clear()


RUN_STATE = RunState()


def stats() -> Dict[str, Any]:
    """This process's counters of every patch, by name (:meth:`RunState.stats`)."""
    return RUN_STATE.stats()


def reset() -> None:
    """Clear every patch's counters and per-run state (:meth:`RunState.reset`)."""
    RUN_STATE.reset()
