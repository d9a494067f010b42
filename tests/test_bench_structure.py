"""bench/ is a small core plus one module per benchmark: its import statements (module level and
inside functions alike) form a DAG, the core knows no benchmark, and the report reads results
through the core only (never the CLI or a benchmark's registration)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Set

from test_import_cycles import _imports, _modules, find_cycle

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_import_graph(root: Path = BENCH) -> Dict[str, Set[str]]:
    """module -> the modules of bench/ it imports, for every module under bench/."""
    modules = {".".join(filter(None, ("bench", name))): path
               for name, path in _modules(root).items()}
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: Set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_bench_has_no_import_cycle() -> None:
    graph = bench_import_graph()
    # The graph sees what it must: the CLI's import of the report inside main() as well.
    assert {"bench.core.cli", "bench.core.schema", "bench.report",
            "bench.benchmarks.lora_llama"} <= set(graph)
    assert "bench.report" in graph["bench.core.cli"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_the_core_knows_no_benchmark_and_the_report_only_the_core() -> None:
    graph = bench_import_graph()
    for module in ("bench.core.schema", "bench.core.runner", "bench.core.registry"):
        outside = {m for m in _reach(graph, module) if not m.startswith("bench.core")}
        assert outside == set(), f"{module} imports {sorted(outside)}"
    reached = _reach(graph, "bench.report")
    assert reached and all(m.startswith("bench.core.") for m in reached), sorted(reached)
    assert "bench.core.cli" not in reached


def test_every_benchmark_module_registers_one_benchmark() -> None:
    from bench.benchmarks import registry

    names = sorted(p.stem for p in (BENCH / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert sorted(registry()) == names
