"""python/ has no import cycle: the import statements of every module (module level and inside
functions alike), plus the modules the patch registry imports by name, form a DAG. Also: the
zero-code start-up shim loads the post-import hooks without importing the package."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

PYTHON = Path(__file__).resolve().parents[1] / "python"


def _modules(root: Path) -> Dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The modules of ``modules`` that ``name`` imports (the deepest existing prefix of each
    imported name: ``from pkg import sub`` is pkg.sub when that is a module, else pkg)."""
    is_package = path.name == "__init__.py"
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        for imported in names:
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                found.add(imported)
    return found


def import_graph(root: Path = PYTHON) -> Dict[str, Set[str]]:
    """module -> modules it imports, for every module under ``root``."""
    modules = _modules(root)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    from ds_z3native.compat import registry

    graph["ds_z3native.compat.registry"] |= set(registry.PATCH_MODULES + registry.OPTIONAL_MODULES)
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or [] when there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_python_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "ds_z3native.compat.import_hooks" in graph["ds_z3native.compat._rebind"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_hooks_the_patches_use_are_the_start_up_shims() -> None:
    """The post-import hook machinery is one module: the start-up shim loads it without
    importing ds_z3native (or torch), and the package later finds that same module."""
    code = """
import sys
import ds_z3native_autoload as shim
hooks = shim._import_hooks()
early = sorted(m for m in ("torch", "ds_z3native", "ds_z3native.compat") if m in sys.modules)
from ds_z3native.compat import _rebind, import_hooks
print("RESULT", early, hooks is import_hooks, import_hooks.when_imported is _rebind.when_imported)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT [] True True" in r.stdout, r.stdout


def test_every_patch_module_is_registered() -> None:
    """A module of ds_z3native.compat with PATCHES is listed in the registry (adding a patch
    module is one line there)."""
    from ds_z3native import compat
    from ds_z3native.compat import registry

    listed = set(registry.PATCH_MODULES + registry.OPTIONAL_MODULES)
    for info in pkgutil.iter_modules(compat.__path__, "ds_z3native.compat."):
        if info.name == "ds_z3native.compat.registry":
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "PATCHES"):
            assert info.name in listed, f"{info.name} has PATCHES but is not in PATCH_MODULES"


# ds_z3native.__main__ runs the CLI when imported (tests/test_cli.py runs it as a program).
@pytest.mark.parametrize("module", sorted(set(_modules(PYTHON)) - {"ds_z3native.__main__"}))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)
