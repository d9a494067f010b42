"""The dc op list, ``python/ds_z3native/dc_ops.def``: the one source of the ops for the C++ build
and for :mod:`ds_z3native.dc_ops`.

The reader refuses a malformed list naming the file, the line and the problem; the list is exactly
what the loaded ``_C`` registers (same ops, same schemas, a device and a Meta kernel each); the
file ships with the package; the schemas are DeepSpeed's text.
"""

from __future__ import annotations

import importlib.resources
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

import ds_z3native
from ds_z3native import dc_ops
from ds_z3native.compat.contract import NATIVE_SCHEMAS, read_deepspeed_interface
from ds_z3native.compat.deepcompile_graph_ids import OWN_GRAPH_ID_ARG
from ds_z3native.dc_ops import (ALL_OPS, DC_OPS, OWN_OPS, Argument, OpListError,
                                graph_id_position, load_op_list)

ROOT = Path(__file__).resolve().parents[1]
SOURCE_LIST = ROOT / "python" / "ds_z3native" / "dc_ops.def"
# Defined from Python by DeepSpeed >= 0.19.5 (Library("dc", "FRAGMENT")) once its passes are
# imported; never by us.
FRAGMENT_OPS = {"offload_opt_launch", "reload_opt", "opt_empty_cache", "reload_copy_stream_sync"}

GOOD = 'DC_OP(foo, "foo(Tensor a, int graph_id) -> Tensor", foo_meta)'


def _registered() -> Dict[str, torch._C.FunctionSchema]:
    ds_z3native.native()
    return {s.name.split("::", 1)[1]: s for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("dc::")}


# ---- the reader -------------------------------------------------------------------------------

def test_the_package_reads_this_trees_list() -> None:
    # The list the package reads (installed or in place) is the file csrc/ includes.
    installed = importlib.resources.files("ds_z3native").joinpath(dc_ops.OP_LIST_NAME)
    assert installed.read_text() == SOURCE_LIST.read_text()
    assert load_op_list(SOURCE_LIST) == ALL_OPS == DC_OPS + OWN_OPS
    assert NATIVE_SCHEMAS == tuple(op.schema for op in DC_OPS)


def test_reads_names_schemas_meta_kernels_and_arguments(tmp_path: Path) -> None:
    path = tmp_path / "ops.def"
    path.write_text("// a comment\n\n" + GOOD + "\n"
                    '  DC_OP(bar,"bar(Tensor(a) a, ScalarType[]? dtypes = None) -> Tensor(a)",'
                    "like_meta)  \n")
    foo, bar = load_op_list(path)
    assert (foo.name, foo.schema, foo.meta, foo.line) == (
        "foo", "foo(Tensor a, int graph_id) -> Tensor", "foo_meta", 3)
    assert bar.arguments == (Argument("Tensor(a)", "a"),
                             Argument("ScalarType[]?", "dtypes", "None"))
    assert (bar.meta, bar.line) == ("like_meta", 4)


@pytest.mark.parametrize("line, problem", [
    ('DC_OP(foo, "foo(Tensor a) -> Tensor")', 'not a DC_OP(name, "schema", meta_kernel) or DSZ_OP'),
    (GOOD + "  // trailing comment", 'not a DC_OP(name, "schema", meta_kernel) or DSZ_OP'),
    ('OP(foo, "foo(Tensor a) -> Tensor", foo_meta)', 'not a DC_OP(name, "schema", meta_kernel) or DSZ_OP'),
    ('DC_OP(foo, "foo(str s = \\"x\\") -> ()", foo_meta)', "a backslash in the schema"),
    ("/* " + GOOD + " */", "block comments are not read"),
    ('DC_OP(foo bar, "foo(Tensor a) -> Tensor", foo_meta)', "the op name 'foo bar' is not an"),
    ('DC_OP(foo, "foo(Tensor a) -> Tensor", 2meta)', "the meta kernel '2meta' is not an"),
    ('DC_OP(foo, "bar(Tensor a) -> Tensor", foo_meta)',
     "the schema defines 'bar' but the line names 'foo'"),
    ('DC_OP(foo, "foo(Tensor a -> Tensor", foo_meta)', "schema of foo: the argument list is not"),
    ('DC_OP(foo, "foo(Tensor a) Tensor", foo_meta)', "schema of foo: expected ' -> returns'"),
    ('DC_OP(foo, "foo(Tensor) -> Tensor", foo_meta)', "schema of foo: cannot read the argument"),
    ('DC_OP(foo, "foo(Tensor[ a) -> Tensor", foo_meta)', "schema of foo: unbalanced"),
    (GOOD, "foo is listed again (first on line 2)"),
    ('DSZ_OP(foo, "foo(Tensor a) -> Tensor", foo_meta)', 'not a DC_OP(name, "schema", '
                                                         'meta_kernel) or DSZ_OP'),
    ('DSZ_OP(foo, "foo(Tensor a) -> Tensor", 1k, foo_meta)', "the kernel '1k' is not an"),
    ('DSZ_OP(foo, "bar(Tensor a) -> Tensor", foo, foo_meta)',
     "the schema defines 'bar' but the line names 'foo'"),
])
def test_a_malformed_line_is_refused_naming_file_line_and_problem(
        tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "ops.def"
    path.write_text("// the list\n" + GOOD + "\n" + line + "\n")
    with pytest.raises(OpListError) as caught:
        load_op_list(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: "), message
    assert problem in message, message
    assert line.strip() in message  # the offending text is quoted
    assert (caught.value.line, caught.value.source) == (3, str(path))


def test_our_own_ops_are_lines_of_the_same_list(tmp_path: Path) -> None:
    """A DSZ_OP line is an op of library ds_z3native with its kernel; it may share a dc op's name
    (end_backward) but not another DSZ_OP's; its graph id is found as for a dc op."""
    path = tmp_path / "ops.def"
    own = 'DSZ_OP(foo, "foo(Tensor[] xs, int graph_id) -> ()", foo_kernel, foo_meta)'
    path.write_text(GOOD + "\n" + own + "\n")
    dc, ours = load_op_list(path)
    assert (dc.library, dc.kernel, dc.qualified_name) == ("dc", None, "dc::foo")
    assert (ours.library, ours.kernel, ours.meta) == ("ds_z3native", "foo_kernel", "foo_meta")
    assert ours.qualified_name == "ds_z3native::foo" and ours.graph_id_arg == 1
    path.write_text(GOOD + "\n" + own + "\n" + own + "\n")
    with pytest.raises(OpListError, match=r":3: ds_z3native::foo is listed again \(first on line "
                                          r"2\)"):
        load_op_list(path)
    path.write_text(own + "\n")
    with pytest.raises(OpListError, match="lists no op"):
        load_op_list(path)


def test_the_extension_registers_our_own_ops_from_the_list() -> None:
    """ds_z3native::'s ops: exactly the list's DSZ_OP lines (with Python-defined ones of other
    modules left aside), each schema as written there, a kernel for every device and a Meta
    kernel; the graph-id positions DeepCompile's graph-id patch rewrites are the list's."""
    ds_z3native.native()
    listed = {op.name: op for op in OWN_OPS}
    assert set(listed) >= {"gather_persistent", "reduce_grads", "end_backward"}
    for name, op in listed.items():
        registered = getattr(torch.ops.ds_z3native, name).default._schema
        assert str(registered) == str(torch._C.parse_schema("ds_z3native::" + op.schema)), name
        dump = torch._C._dispatch_dump(op.qualified_name)
        assert re.search(r"registered at .*csrc/ops/group_ops\.cpp", dump), (name, dump)
        for key in ("CompositeExplicitAutograd", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.qualified_name, key), \
                (name, key)
    assert OWN_GRAPH_ID_ARG == {"gather_persistent": 0, "reduce_grads": 0, "end_backward": 1}


def test_an_empty_or_missing_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ops.def"
    path.write_text("// nothing yet\n")
    with pytest.raises(OpListError, match=re.escape(f"{path}: lists no op")):
        load_op_list(path)
    with pytest.raises(OpListError, match=re.escape(f"{tmp_path / 'none.def'}: no such file")):
        load_op_list(tmp_path / "none.def")


# ---- the list against the built extension --------------------------------------------------

def test_the_list_is_exactly_what_the_extension_registers() -> None:
    registered = _registered()
    ours = {name for name in registered if name not in FRAGMENT_OPS}
    listed = [op.name for op in DC_OPS]
    assert sorted(listed) == sorted(ours), (
        f"listed only: {sorted(set(listed) - ours)}, registered only: {sorted(ours - set(listed))}")
    for op in DC_OPS:
        assert str(registered[op.name]) == str(torch._C.parse_schema("dc::" + op.schema)), op.name


def test_the_extension_registered_its_schemas_from_the_list() -> None:
    # Every listed op's schema was registered by our schema.cpp (an op of the list that only
    # DeepSpeed's Python defined would pass the test above and fail here).
    _registered()
    for op in DC_OPS:
        dump = torch._C._dispatch_dump(f"dc::{op.name}")
        assert re.search(r"registered at .*csrc/ops/schema\.cpp", dump), (op.name, dump)


@pytest.mark.parametrize("key", ["CPU", "Meta"])
def test_every_listed_op_has_a_kernel(key: str) -> None:
    _registered()
    missing = [op.name for op in DC_OPS
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{op.name}", key)]
    assert not missing, f"no {key} kernel for {missing}"


def test_every_listed_op_has_a_cuda_kernel_in_a_cuda_build() -> None:
    # Reads the dispatcher only: no CUDA call, so it runs on CPU machines too.
    _registered()
    has = {op.name: torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{op.name}", "CUDA")
           for op in DC_OPS}
    if ds_z3native.build_info()["flavour"] == "cuda":
        assert all(has.values()), [n for n, v in has.items() if not v]
    else:
        assert not any(has.values()), "a CPU build registered CUDA kernels"


# ---- the list in the package ------------------------------------------------------------------

@pytest.mark.slow
def test_the_list_ships_with_the_package(tmp_path: Path) -> None:
    # What a wheel holds of the package is what build_py puts in build_lib.
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    shipped = tmp_path / "ds_z3native" / dc_ops.OP_LIST_NAME
    assert shipped.is_file(), sorted(p.name for p in (tmp_path / "ds_z3native").iterdir())
    assert shipped.read_text() == SOURCE_LIST.read_text()


# ---- the schemas against DeepSpeed's ------------------------------------------------------------

def _with_our_defaults(name: str, theirs: str) -> str:
    """DeepSpeed's schema text with the one default we add: end_backward's
    release_reduce_buckets = True (an argument DeepSpeed 0.19.0 - 0.19.1 lack)."""
    if name != "end_backward":
        return theirs
    if "release_reduce_buckets" in theirs:
        return theirs.replace("bool release_reduce_buckets)", "bool release_reduce_buckets = True)")
    return theirs.replace("int graph_id)", "int graph_id, bool release_reduce_buckets = True)")


@pytest.mark.deepspeed
def test_the_schemas_are_deepspeeds_text() -> None:
    ds = read_deepspeed_interface()
    assert not ds.problems, ds.problems
    assert [op.name for op in DC_OPS if op.name not in ds.schemas] == []
    for op in DC_OPS:
        assert op.schema == _with_our_defaults(op.name, ds.schemas[op.name]), op.name


# ---- the graph id -----------------------------------------------------------------------------

@pytest.mark.parametrize("schema, position", [
    ("a(Tensor a, int graph_id, int id) -> Tensor", 1),
    ("a(int graph_id, Tensor[] params, int[] ids) -> ()", 0),
    ("a(Tensor a, int id, int id) -> Tensor", 1),  # DeepSpeed's offload ops: graph id first
    ("a(Tensor a, int id) -> Tensor", None),
    ("a(Tensor[] a) -> ()", None),
    ("a(Tensor graph_id, int id) -> ()", None),  # not an int
])
def test_graph_id_position(schema: str, position: int) -> None:
    assert graph_id_position(dc_ops.parse_schema(schema)[1]) == position


# ---- CUDA graphs ------------------------------------------------------------------------------

def _native_ops() -> Dict[str, "torch._ops.OpOverload"]:
    """Every op ``_C`` defines, dc::* and ds_z3native::*, by qualified name."""
    ds_z3native.native()
    ops = {f"dc::{op.name}": getattr(torch.ops.dc, op.name).default for op in DC_OPS}
    for op in OWN_OPS:  # ds_z3native::'s ops of _C
        ops[op.qualified_name] = getattr(torch.ops.ds_z3native, op.name).default
    return ops


def test_every_native_op_is_tagged_cudagraph_unsafe() -> None:
    # Each op changes host-side state a CUDA graph's replay would skip (the registry, the use
    # counts, a collective on another stream): inductor must never record one.
    untagged = sorted(name for name, op in _native_ops().items()
                      if torch.Tag.cudagraph_unsafe not in op.tags)
    assert untagged == []


def test_inductor_keeps_a_graph_with_dc_ops_out_of_cuda_graphs() -> None:
    # The check inductor's cudagraph trees run on a graph before recording it (and the reason
    # graph_partition splits at a node): it must stop at the dc op, not record past it.
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    _native_ops()
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    gathered = graph.call_function(torch.ops.dc.allgather_param.default, (shard, 0, 3))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (gathered, 2.0))
    released = graph.call_function(torch.ops.dc.release_param.default, (doubled, 0, 3, 1))
    graph.output(released)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert get_first_incompatible_cudagraph_node(module) is gathered

    plain = torch.fx.Graph()
    x = plain.placeholder("x")
    plain.output(plain.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)))
    assert get_first_incompatible_cudagraph_node(torch.fx.GraphModule(torch.nn.Module(), plain)) is None
