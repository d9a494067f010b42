"""Lists of a module tree's modules and parameters, kept between the per-step walks that need them.

DeepSpeed and HF Trainer walk the whole model (``named_modules()``, ``named_parameters()``)
several times per optimizer step; on a 1 B LoRA model (16 layers, about 1,300 modules) each walk
costs milliseconds of host time, paid where a DeepCompile step is host-bound. :data:`LISTS` keeps
what such walks find per root module and drops it whenever a module of the tree registers a
parameter or a submodule, so a model changed between steps is walked again. The patches that use
it (``hf_trainer_loop``, ``zero3_walks``) start tracking with :meth:`TreeLists.track` and
stop with its undo.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List

from . import Undo

__all__ = ["LISTS", "TreeLists", "param_list", "walk_modules"]


def walk_modules(root: Any) -> List[Any]:
    """``list(root.modules())``, breadth first: each module once (by identity), None skipped,
    without ``named_modules()``'s generators and name strings (about half its time)."""
    seen = {id(root)}
    found = [root]
    i = 0
    while i < len(found):
        for child in found[i]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
        i += 1
    return found


class TreeLists:
    """What walks of a module tree find (its modules, and what is built from them), kept per root
    module until a module of a kept tree registers a parameter or a submodule.

    torch's global registration hooks (installed by :meth:`track`) see every registration; one on
    a module of a kept tree drops everything kept. Registrations elsewhere keep it (transformers
    slices a ``ModuleList`` in every forward: a new container each time). In code Dynamo traces,
    the hook does nothing (``torch.compiler.is_compiling()`` is constant there), so no compiled
    graph guards on this state. Deleting a submodule registers nothing: the kept lists hold it
    until the next registration."""

    def __init__(self) -> None:
        self.generation = 0
        # root module -> {"generation": built at, "modules": [...], kind: value, ...}
        self._kept: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()
        self._members: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._tracking = 0
        self._handles: List[Any] = []

    def _registered(self, module: Any, name: str, value: Any) -> None:
        import torch

        if torch.compiler.is_compiling():
            return None
        if module in self._members:
            self.generation += 1
            self._members = weakref.WeakSet()
        return None  # a registration hook returning None keeps the registered object

    def track(self) -> Undo:
        """Watch registrations from now on (torch's global hooks); the undo stops watching, and
        drops what is kept, when no other user still tracks."""
        from torch.nn.modules import module as torch_module

        if self._tracking == 0:
            self._handles = [
                torch_module.register_module_parameter_registration_hook(self._registered),
                torch_module.register_module_module_registration_hook(self._registered)]
        self._tracking += 1
        done: List[bool] = []

        def undo() -> None:
            if done:
                return
            done.append(True)
            self._tracking -= 1
            if self._tracking == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []
                self._kept = weakref.WeakKeyDictionary()
                self._members = weakref.WeakSet()
            self.generation += 1

        return undo

    def get(self, root: Any, kind: str, build: Callable[[Any, List[Any]], Any]) -> Any:
        """``build(root, modules)`` for ``kind`` (``modules``: :func:`walk_modules`), kept while
        the tree is unchanged; built each call while nothing tracks."""
        if self._tracking == 0:
            return build(root, walk_modules(root))
        entry = self._kept.get(root)
        if entry is None or entry["generation"] != self.generation:
            modules = walk_modules(root)
            entry = {"generation": self.generation, "modules": modules}
            self._kept[root] = entry
            self._members.update(modules)
        if kind not in entry:
            entry[kind] = build(root, entry["modules"])
        return entry[kind]

    def modules(self, root: Any) -> List[Any]:
        """The tree's modules (:func:`walk_modules`), kept while the tree is unchanged."""
        return self.get(root, "modules", lambda _root, modules: modules)


def param_list(root: Any, modules: List[Any]) -> List[Any]:
    """``list(root.parameters())`` from the modules' own parameter dicts."""
    seen = set()
    params = []
    for module in modules:
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


# The one instance the patches share: one set of registration hooks, one generation.
LISTS = TreeLists()
