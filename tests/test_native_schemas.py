"""The dc operator schemas equal the ones of the installed DeepSpeed, parsed from its C++ source.

DeepSpeed ships ``ops/csrc/compile/init.cpp``; its ``TORCH_LIBRARY(dc, m)`` block holds one
``m.def("...")`` per operator (a schema may be split over adjacent string literals). Each must
equal our registered schema up to default values: we add ``release_reduce_buckets=True`` to
end_backward so that DeepSpeed 0.19.0-0.19.1's two-argument call binds. Marked ``deepspeed``: it
reads whichever DeepSpeed is importable, so CI runs it against 0.19.8 and 0.19.2.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Dict, List

import pytest
import torch

import ds_z3native

pytestmark = pytest.mark.deepspeed

# Defined from Python by DeepSpeed >= 0.19.5 (Library("dc", "FRAGMENT")); never by us.
FRAGMENT_OPS = {"offload_opt_launch", "reload_opt", "opt_empty_cache", "reload_copy_stream_sync"}
# Defaults we add to DeepSpeed's schemas: (op, argument) -> value.
ADDED_DEFAULTS = {("end_backward", "release_reduce_buckets"): True}


def deepspeed_init_cpp() -> str:
    """Path of the installed DeepSpeed's dc TORCH_LIBRARY source (found without importing it)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin, "DeepSpeed is not installed"
    path = os.path.join(os.path.dirname(spec.origin), "ops", "csrc", "compile", "init.cpp")
    assert os.path.isfile(path), f"DeepSpeed at {os.path.dirname(spec.origin)} ships no {path}"
    return path


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def parse_library_defs(src: str, namespace: str = "dc") -> List[str]:
    """The schema strings of every ``m.def(...)`` in ``TORCH_LIBRARY(<namespace>, m) { ... }``,
    adjacent string literals concatenated and whitespace normalised."""
    src = _strip_comments(src)
    head = re.search(r"TORCH_LIBRARY\s*\(\s*" + namespace + r"\s*,\s*(\w+)\s*\)\s*\{", src)
    assert head, f"no TORCH_LIBRARY({namespace}, ...) block"
    lib_var = head.group(1)
    depth, i = 1, head.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    block = src[head.end():i - 1]
    schemas = []
    for call in re.finditer(re.escape(lib_var) + r"\s*\.\s*def\s*\(((?:\s*\"(?:[^\"\\]|\\.)*\")+)",
                            block):
        literal = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", call.group(1)))
        schemas.append(" ".join(literal.split()))
    assert len(schemas) == block.count(f"{lib_var}.def"), "an m.def(...) the parser did not read"
    return schemas


def _alias(info) -> object:
    return None if info is None else (info.is_write, sorted(info.before_set), sorted(info.after_set))


def _without_defaults(schema: str) -> str:
    return re.sub(r"\s*=\s*[^,)]+", "", schema)


@pytest.fixture(scope="module")
def deepspeed_schemas() -> Dict[str, torch._C.FunctionSchema]:
    with open(deepspeed_init_cpp()) as f:
        parsed = [torch._C.parse_schema(s) for s in parse_library_defs(f.read())]
    return {s.name: s for s in parsed}


@pytest.fixture(scope="module")
def our_ops() -> Dict[str, torch._C.FunctionSchema]:
    ds_z3native.native()
    return {s.name.split("::", 1)[1]: s for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("dc::") and s.name.split("::", 1)[1] not in FRAGMENT_OPS}


def test_parser_concatenates_adjacent_literals() -> None:
    src = '''
    // m.def("commented_out(Tensor a) -> Tensor");
    TORCH_LIBRARY(dc, m)
    {
        m.def("one(Tensor a) -> Tensor");
        m.def(
            "two(int graph_id, Tensor[] params,"
            "    ScalarType[]? dtypes = None) -> ()");  /* m.def("three() -> ()"); */
    }
    TORCH_LIBRARY(other, m) { m.def("four() -> ()"); }
    '''
    assert parse_library_defs(src) == [
        "one(Tensor a) -> Tensor",
        "two(int graph_id, Tensor[] params, ScalarType[]? dtypes = None) -> ()"]


@pytest.mark.release_matrix
def test_same_ops_as_deepspeed(deepspeed_schemas, our_ops) -> None:
    assert len(deepspeed_schemas) == 14, sorted(deepspeed_schemas)
    assert set(our_ops) == set(deepspeed_schemas), (
        f"missing: {sorted(set(deepspeed_schemas) - set(our_ops))}, "
        f"extra: {sorted(set(our_ops) - set(deepspeed_schemas))}")


@pytest.mark.release_matrix
def test_schemas_equal_deepspeed_up_to_defaults(deepspeed_schemas) -> None:
    ds_z3native.native()
    for name, theirs in sorted(deepspeed_schemas.items()):
        ours = getattr(torch.ops.dc, name).default._schema
        assert ours.name == "dc::" + theirs.name
        # Ours may end with arguments theirs lacks, each with the default we mean to add
        # (DeepSpeed 0.19.0 - 0.19.1's end_backward has no release_reduce_buckets).
        assert len(ours.arguments) >= len(theirs.arguments), name
        for a in ours.arguments[len(theirs.arguments):]:
            assert a.has_default_value() and \
                ADDED_DEFAULTS.get((name, a.name), object()) == a.default_value, (name, a.name)
        for a, b in zip(ours.arguments, theirs.arguments):
            assert (a.name, str(a.type), a.kwarg_only) == (b.name, str(b.type), b.kwarg_only)
            assert _alias(a.alias_info) == _alias(b.alias_info), (name, a.name)
            if b.has_default_value():
                assert a.has_default_value() and a.default_value == b.default_value, (name, a.name)
            elif a.has_default_value():
                assert ADDED_DEFAULTS.get((name, a.name), object()) == a.default_value, (
                    f"{name}: default {a.name}={a.default_value!r} is not one we mean to add")
        assert [(str(r.type), _alias(r.alias_info)) for r in ours.returns] == \
            [(str(r.type), _alias(r.alias_info)) for r in theirs.returns], name


def test_end_backward_binds_both_deepspeed_arities() -> None:
    ds_z3native.native()
    schema = torch.ops.dc.end_backward.default._schema
    required = [a.name for a in schema.arguments if not a.has_default_value()]
    assert required == ["deps", "graph_id"]  # 0.19.0-0.19.1 pass two arguments
    assert schema.arguments[2].default_value is True


@pytest.mark.parametrize("key", ["CPU", "Meta"])
def test_every_op_has_kernel(key, deepspeed_schemas) -> None:
    ds_z3native.native()
    missing = [n for n in sorted(deepspeed_schemas)
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{n}", key)]
    assert not missing, f"no {key} kernel for {missing}"


def test_cuda_kernels_in_a_cuda_build(deepspeed_schemas) -> None:
    # Reads the dispatcher only: no CUDA call, so it runs on CPU machines too.
    has = {n: torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{n}", "CUDA")
           for n in deepspeed_schemas}
    if ds_z3native.build_info()["flavour"] == "cuda":
        assert all(has.values()), [n for n, v in has.items() if not v]
    else:
        assert not any(has.values()), "a CPU build registered CUDA kernels"


def test_end_backward_has_a_kernel_for_no_tensor_arguments() -> None:
    # With all deps None the dispatcher has no tensor to take a key from and dispatches on
    # Undefined. TORCH_LIBRARY_IMPL(dc, Undefined, ...) is a catch-all registration: the
    # dispatcher stores it as the CompositeImplicitAutograd kernel, from which the Undefined
    # entry of the dispatch table is computed (so the has_kernel query for the literal key
    # "Undefined" is False, for DeepSpeed's build too).
    ds_z3native.native()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dc::end_backward",
                                                          "CompositeImplicitAutograd")
    table = torch._C._dispatch_dump_table("dc::end_backward")
    assert re.search(r"^Undefined: registered at ", table, flags=re.M), table
    # Only end_backward needs it: the other ops always have a tensor argument.
    for name in ("allgather_param", "reduce_grad", "free_tensors"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(
            f"dc::{name}", "CompositeImplicitAutograd"), name
