"""The contract check: DeepSpeed's dc op interface (read from its sources) against ours."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from packaging.version import Version

import ds_z3native
from ds_z3native.compat.contract import (Arity, contract_mismatches, declared_interface,
                                         native_interface, read_deepspeed_interface,
                                         schema_compatible)


def _canonical(schema: str) -> str:
    return str(torch._C.parse_schema(schema if "::" in schema else "dc::" + schema))


def test_declared_interface_is_what_the_extension_registers() -> None:
    # install() gates newer DeepSpeed releases on the declaration before _C is loaded; it must
    # not drift from the binary.
    loaded = native_interface(ds_z3native.native())
    declared = declared_interface()
    assert {k: _canonical(v) for k, v in declared.schemas.items()} == \
        {k: _canonical(v) for k, v in loaded.schemas.items()}
    assert declared.functions == loaded.functions


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_installed_deepspeed_matches_our_contract() -> None:
    import deepspeed

    ds = read_deepspeed_interface()
    assert ds.root == Path(deepspeed.__file__).parent
    assert not ds.problems
    assert len(ds.schemas) == 14 and "reduce_grad" in ds.schemas
    assert {"init", "register_z3_param", "register_graph_z3", "start_backward"} <= ds.functions
    # 0.19.0 - 0.19.1 register params without expected_grad_dtype: five arguments, six after.
    z3 = [c for c in ds.calls if c.function == "register_z3_param"]
    z3_args = 5 if Version(deepspeed.__version__.split("+")[0]) < Version("0.19.2") else 6
    assert z3 and all(c.n_positional == z3_args for c in z3), z3
    assert any(c.function == "cleanup" and "engine.py" in c.where for c in ds.calls)
    assert contract_mismatches(ds) == []


# ---- a DeepSpeed tree written by the test --------------------------------------------------------

_SCHEMAS = [
    "allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor",
    "reduce_grad(Tensor a, int graph_id, int id) -> Tensor",
    "end_backward(Any deps, int graph_id, bool release_reduce_buckets) -> ()",
]
_FUNCTIONS = ["init", "register_z3_param", "start_backward"]
_PYTHON = {
    "compile/util.py": """
        def get_deepcompile_handle():
            return None

        def deepcompile_backward_prologue(flag):
            dc = get_deepcompile_handle()
            dc.start_backward(flag)
        """,
    "compile/init_z3.py": """
        from .util import get_deepcompile_handle

        def init_z3(engine, p):
            dc = get_deepcompile_handle()
            dc.init(engine.group, engine.config, 100)
            dc.register_z3_param(p.ds_id, p.ds_shape, p.ds_tensor, None, False, None)
            dc = {}  # an unrelated local of the same name: its methods are not handle calls
            dc.update(x=1)
        """,
}


def _tree(root: Path, schemas=_SCHEMAS, functions=_FUNCTIONS,
          python: Optional[Dict[str, str]] = None) -> Path:
    ds = root / "deepspeed"
    (ds / "ops" / "csrc" / "compile").mkdir(parents=True)
    defs = "\n".join(f'    m.def("{s}");' for s in schemas)
    fns = "\n".join(f'    m.def("{f}", &dc::{f}, "doc");' for f in functions)
    (ds / "ops" / "csrc" / "compile" / "init.cpp").write_text(
        f"// header\nTORCH_LIBRARY(dc, m)\n{{\n{defs}\n}}\n\n"
        f"TORCH_LIBRARY_IMPL(dc, CPU, m) {{ m.impl(\"reduce_grad\", &dc::reduce_grad); }}\n\n"
        f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)\n{{\n{fns}\n}}\n")
    for rel, text in (python if python is not None else _PYTHON).items():
        (ds / rel).parent.mkdir(parents=True, exist_ok=True)
        (ds / rel).write_text(textwrap.dedent(text))
    return ds


def test_reads_schemas_functions_and_handle_calls(tmp_path: Path) -> None:
    ds = read_deepspeed_interface(_tree(tmp_path))
    assert ds.problems == []
    assert set(ds.schemas) == {"allgather_param", "reduce_grad", "end_backward"}
    assert ds.functions == set(_FUNCTIONS)
    assert sorted((c.function, c.n_positional) for c in ds.calls) == \
        [("init", 3), ("register_z3_param", 6), ("start_backward", 1)]
    # end_backward without a default in theirs, with one in ours: compatible.
    assert contract_mismatches(ds) == []


def test_schema_split_over_adjacent_literals(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    init = root / "ops" / "csrc" / "compile" / "init.cpp"
    init.write_text(init.read_text().replace(
        '"reduce_grad(Tensor a, int graph_id, int id) -> Tensor"',
        '"reduce_grad(Tensor a, int graph_id,"\n        "            int id) -> Tensor"'))
    assert contract_mismatches(read_deepspeed_interface(root)) == []


@pytest.mark.parametrize("change, expected", [
    ({"schemas": [s.replace("int id)", "int id, int extra)") for s in _SCHEMAS]},
     "op dc::reduce_grad"),
    ({"schemas": _SCHEMAS + ["gather_fused(Tensor[] a) -> ()"]},
     "op dc::gather_fused (gather_fused(Tensor[] a) -> ()) is not provided"),
    ({"functions": _FUNCTIONS + ["set_stream"]}, "module function set_stream() is not provided"),
    ({"python": {**_PYTHON, "compile/fx.py": """
        def f(nz3):
            nz3.start_backward(True, False)

        def g():
            nz3 = get_deepcompile_handle()
        """}}, "calls start_backward() with 2 positional arguments"),
    ({"python": {**_PYTHON, "compile/passes/ops.py": """
        import torch
        lib = torch.library.Library("dc", "FRAGMENT")
        lib.define("reduce_grad(Tensor a) -> ()")
        """}}, "op dc::reduce_grad is defined by DeepSpeed's Python"),
])
def test_detects_contract_changes(tmp_path: Path, change: dict, expected: str) -> None:
    found = contract_mismatches(read_deepspeed_interface(_tree(tmp_path, **change)))
    assert any(expected in m for m in found), found


def test_missing_sources_make_the_contract_unverifiable(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "ops" / "csrc" / "compile" / "init.cpp").unlink()
    found = contract_mismatches(read_deepspeed_interface(root))
    assert any(m.startswith("unverifiable: cannot read") for m in found), found
    assert "no dc operator schemas found in DeepSpeed's sources" in found


@pytest.mark.parametrize("theirs, ours, compatible", [
    ("f(Tensor a, int n) -> Tensor", "f(Tensor a, int n = 1) -> Tensor", True),
    ("f(Tensor a, int n = 1) -> Tensor", "f(Tensor a, int n) -> Tensor", False),
    ("f(Tensor a, int n = 1) -> Tensor", "f(Tensor a, int n = 2) -> Tensor", False),
    ("f(Tensor(a) a) -> Tensor(a)", "f(Tensor a) -> Tensor", False),
    ("f(Tensor a, int n) -> Tensor", "f(Tensor a, int m) -> Tensor", False),
    ("f(Tensor a) -> Tensor", "f(Tensor a) -> ()", False),
    ("f(Tensor a, int id, int id) -> Tensor", "f(Tensor a, int id, int id) -> Tensor", True),
    # A trailing argument ours adds binds a caller of theirs only with a default (DeepSpeed
    # 0.19.0 - 0.19.1's two-argument end_backward).
    ("f(Any deps, int g) -> ()", "f(Any deps, int g, bool r = True) -> ()", True),
    ("f(Any deps, int g) -> ()", "f(Any deps, int g, bool r) -> ()", False),
    ("f(Any deps, int g, bool r) -> ()", "f(Any deps, int g) -> ()", False),
])
def test_schema_compatibility(theirs: str, ours: str, compatible: bool) -> None:
    assert (schema_compatible(theirs, ours) is None) is compatible


def test_arity_binding() -> None:
    a = Arity(2, 3, ("x", "y", "z"))
    assert a.accepts(2) and a.accepts(3) and a.accepts(1, ["y"]) and a.accepts(2, ["z"])
    assert not a.accepts(1) and not a.accepts(4) and not a.accepts(2, ["x"])
    assert not a.accepts(2, ["w"])


def test_deepspeed_root_is_found_without_importing_deepspeed() -> None:
    from helpers.dist import run_python

    r = run_python("""
        import sys
        from ds_z3native.compat.contract import deepspeed_root
        root = deepspeed_root()
        print(root is not None and (root / "ops" / "csrc" / "compile" / "init.cpp").exists(),
              "deepspeed" in sys.modules)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
