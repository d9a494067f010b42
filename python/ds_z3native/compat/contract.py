"""Does an installed DeepSpeed still expect the native op that ds_z3native provides?

DeepSpeed's side of the contract is read from its installed sources, never assumed:

* the ``dc`` operator schemas: the ``m.def("...")`` strings of ``TORCH_LIBRARY(dc, m)`` in
  ``deepspeed/ops/csrc/compile/init.cpp``;
* the module functions: the ``m.def("name", ...)`` entries of its ``PYBIND11_MODULE`` block in the
  same file, and every call its Python (``deepspeed/compile/`` and ``deepspeed/runtime/engine.py``)
  makes on the handle ``get_deepcompile_handle()`` returns, with the number of arguments passed;
* the ``dc`` ops DeepSpeed defines itself from Python (``torch.library.Library("dc", "FRAGMENT")``),
  which ours must not define.

Our side is :data:`NATIVE_SCHEMAS` and :data:`NATIVE_FUNCTIONS`, a declaration of what
``ds_z3native._C`` registers: the schemas are read from the op list ``dc_ops.def`` that ``_C``'s
schemas are compiled from (:mod:`ds_z3native.dc_ops`), the functions are declared here. Neither
is read from the loaded module, so that the check can run *before* ``_C`` is loaded: once loaded,
``torch.ops.dc`` belongs to us for the life of the process. :func:`native_interface` reads the
same from a loaded module; a test keeps the two equal.

:func:`contract_mismatches` compares the two sides and returns one line per difference (empty
list: compatible). The version gate uses it for DeepSpeed releases newer than the tested range,
and ``ds-z3native doctor`` can print it for any installed DeepSpeed.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ..dc_ops import DC_OPS

__all__ = [
    "NATIVE_SCHEMAS", "NATIVE_FUNCTIONS", "Arity", "CallSite", "DeepSpeedInterface",
    "NativeInterface", "declared_interface", "native_interface", "deepspeed_root",
    "read_deepspeed_interface", "contract_mismatches", "schema_compatible",
]

log = logging.getLogger(__name__)

# What ds_z3native._C registers with TORCH_LIBRARY(dc): the schemas of the op list, the file
# csrc/ops/schema.cpp defines them from.
NATIVE_SCHEMAS: Tuple[str, ...] = tuple(op.schema for op in DC_OPS)


@dataclass(frozen=True)
class Arity:
    """Positional arguments a function accepts: at least ``required``, at most ``total``."""

    required: int
    total: int
    names: Tuple[str, ...] = ()

    def accepts(self, n_positional: int, keywords: Iterable[str] = ()) -> bool:
        """Whether a call with ``n_positional`` positional arguments and ``keywords`` binds."""
        keywords = tuple(keywords)
        if n_positional > self.total:
            return False
        bound = set(self.names[:n_positional])
        for k in keywords:
            if k not in self.names or k in bound:
                return False
            bound.add(k)
        return all(name in bound for name in self.names[:self.required])


# The functions of ds_z3native._C (csrc/bindings.cpp): DeepSpeed's, then ours.
NATIVE_FUNCTIONS: Dict[str, Arity] = {
    "init": Arity(3, 3, ("process_group", "config", "initial_reduce_bucket_size")),
    "cleanup": Arity(0, 0),
    "reset": Arity(0, 0),
    "register_z3_param": Arity(5, 6, ("ds_id", "ds_shape", "ds_tensor", "grad_buffer",
                                      "persistent", "expected_grad_dtype")),
    "register_graph_z3": Arity(2, 2, ("graph_id", "ds_ids")),
    "register_param": Arity(5, 5, ("ds_id", "ds_shape", "param", "grad_buffer", "offset")),
    "update_param_grad_buffer": Arity(3, 3, ("ds_id", "grad_buffer", "offset")),
    "register_graph_z1": Arity(2, 2, ("graph_id", "ds_ids")),
    "register_graph_z2": Arity(2, 2, ("graph_id", "ds_ids")),
    "set_persistent": Arity(1, 1, ("ds_id",)),
    "start_forward": Arity(0, 0),
    "end_forward": Arity(0, 0),
    "start_backward": Arity(1, 1, ("update",)),
    "enable_profiling": Arity(1, 1, ("enable",)),
    "is_profiling": Arity(0, 0),
    "invalidate_gathered_param": Arity(1, 1, ("ds_id",)),
    "clear_all_gathered_params": Arity(0, 0),
    "set_param_frozen": Arity(2, 2, ("ds_id", "frozen")),
    "is_param_frozen": Arity(1, 1, ("ds_id",)),
    "current_graph_task_id": Arity(0, 0),
    "build_info": Arity(0, 0),
    "is_initialized": Arity(0, 0),
    "runtime_info": Arity(0, 0),
    "comm_stats": Arity(0, 0),
    "reset_comm_stats": Arity(0, 0),
    "param_state": Arity(1, 1, ("ds_id",)),
    "set_persistence_budget": Arity(1, 1, ("bytes",)),
    "set_default_persistence_budget": Arity(1, 1, ("bytes",)),
    "persistence_info": Arity(0, 0),
    "alias_graph": Arity(2, 2, ("alias_id", "graph_id")),
    "graph_aliases": Arity(0, 0),
}


@dataclass(frozen=True)
class NativeInterface:
    """The ``dc`` schemas (op name -> schema text) and module functions a native op provides."""

    schemas: Mapping[str, str]
    functions: Mapping[str, Arity]


@dataclass(frozen=True)
class CallSite:
    """One call DeepSpeed's Python makes on the dc handle."""

    function: str
    n_positional: int
    keywords: Tuple[str, ...]
    where: str  # "path:line"


@dataclass
class DeepSpeedInterface:
    """What an installed DeepSpeed expects of its dc op, read from its sources."""

    root: Path
    schemas: Dict[str, str] = field(default_factory=dict)
    functions: Set[str] = field(default_factory=set)
    calls: List[CallSite] = field(default_factory=list)
    python_defined_ops: Dict[str, str] = field(default_factory=dict)  # op name -> "path:line"
    problems: List[str] = field(default_factory=list)  # sources that could not be read


def _op_name(schema: str) -> str:
    return schema.split("(", 1)[0].strip().split("::")[-1]


def declared_interface() -> NativeInterface:
    """Our interface as declared in this module (usable before ``_C`` is loaded)."""
    return NativeInterface({_op_name(s): s for s in NATIVE_SCHEMAS}, dict(NATIVE_FUNCTIONS))


def _split_top_level(text: str) -> List[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    tail = text[start:]
    if tail.strip():
        parts.append(tail)
    return [p.strip() for p in parts]


def _pybind_arity(fn: object) -> Optional[Arity]:
    """Arity from a pybind11 docstring's first line ``name(a: T, b: U = x) -> R``."""
    doc = getattr(fn, "__doc__", None) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    match = re.match(r"^\w+\((.*)\)\s*->", first)
    if match is None:
        return None
    params = _split_top_level(match.group(1))
    names = tuple(p.split(":", 1)[0].split("=", 1)[0].strip() for p in params)
    required = sum(1 for p in params if "=" not in p)
    return Arity(required, len(params), names)


def native_interface(module: ModuleType) -> NativeInterface:
    """Our interface read from a loaded native module (``ds_z3native._C``) and the dispatcher."""
    import torch

    schemas: Dict[str, str] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("dc::"):
            continue
        name = qualified[len("dc::"):]
        for schema in torch._C._jit_get_schemas_for_operator(qualified):
            schemas[name] = str(schema)
    functions: Dict[str, Arity] = {}
    for name in dir(module):
        if name.startswith("_"):
            continue
        arity = _pybind_arity(getattr(module, name))
        if arity is not None:
            functions[name] = arity
    return NativeInterface(schemas, functions)


def deepspeed_root() -> Optional[Path]:
    """The directory of the importable ``deepspeed`` package, found without importing it."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# ---- DeepSpeed's side -------------------------------------------------------------------------

_CPP_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _cpp_block(text: str, opener: str) -> Optional[str]:
    """The brace-delimited body following the first line that starts with ``opener``."""
    match = re.search(r"^\s*" + re.escape(opener) + r"[^{]*\{", text, re.MULTILINE)
    if match is None:
        return None
    depth, i = 1, match.end()
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[match.end():i - 1]


def _cpp_defs(block: str) -> List[str]:
    """The first argument of each ``m.def(...)`` in ``block``: adjacent literals concatenated."""
    out = []
    for match in re.finditer(r"\bm\.def\s*\(", block):
        i, pieces = match.end(), []
        while True:
            while i < len(block) and block[i].isspace():
                i += 1
            lit = _CPP_STRING.match(block, i)
            if lit is None:
                break
            pieces.append(lit.group(1))
            i = lit.end()
        if pieces:
            out.append("".join(pieces))
    return out


def _read_cpp(root: Path, iface: DeepSpeedInterface) -> None:
    init_cpp = root / "ops" / "csrc" / "compile" / "init.cpp"
    try:
        text = init_cpp.read_text()
    except OSError as e:
        iface.problems.append(f"cannot read {init_cpp}: {e}")
        return
    text = re.sub(r"//[^\n]*", "", text)
    lib = _cpp_block(text, "TORCH_LIBRARY(dc")
    if lib is None:
        iface.problems.append(f"{init_cpp}: no TORCH_LIBRARY(dc, ...) block")
    else:
        for schema in _cpp_defs(lib):
            iface.schemas[_op_name(schema)] = " ".join(schema.split())
    mod = _cpp_block(text, "PYBIND11_MODULE(")
    if mod is None:
        iface.problems.append(f"{init_cpp}: no PYBIND11_MODULE block")
    else:
        iface.functions.update(_cpp_defs(mod))


_HANDLE_SOURCES = ("get_deepcompile_handle", "_initialize_deepcompile_native")


def _terminal_name(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_handle_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _terminal_name(node.func) in _HANDLE_SOURCES


def _python_files(root: Path) -> List[Path]:
    files = sorted((root / "compile").rglob("*.py"))
    engine = root / "runtime" / "engine.py"
    if engine.exists():
        files.append(engine)
    return files


def _read_python(root: Path, iface: DeepSpeedInterface) -> None:
    trees: List[Tuple[str, List[ast.AST]]] = []  # (path, every node of the file)
    for path in _python_files(root):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except (OSError, SyntaxError) as e:
            iface.problems.append(f"cannot parse {path}: {e}")
            continue
        trees.append((str(path.relative_to(root.parent)), list(ast.walk(tree))))
    # Names the handle is kept under: targets of `x = get_deepcompile_handle()` (and of the engine
    # helper that returns it), and the parameters it is passed through (`def f(opt, _nz3)`).
    aliases: Set[str] = set()
    for _, nodes in trees:
        for node in nodes:
            if isinstance(node, ast.Assign) and _is_handle_call(node.value):
                aliases.update(filter(None, (_terminal_name(t) for t in node.targets)))
    for _, nodes in trees:
        for node in nodes:
            # `global nz3; nz3 = _nz3`: the parameter name is an alias too.
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                if any(_terminal_name(t) in aliases for t in node.targets):
                    aliases.add(node.value.id)
    for rel, nodes in trees:
        for node in nodes:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if not (_is_handle_call(owner) or _terminal_name(owner) in aliases):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                iface.problems.append(f"{rel}:{node.lineno}: call with *args/**kwargs on the dc handle")
                continue
            iface.calls.append(CallSite(node.func.attr, len(node.args),
                                        tuple(k.arg for k in node.keywords if k.arg),
                                        f"{rel}:{node.lineno}"))
        # Ops DeepSpeed defines itself: schema literals in a module that opens Library("dc", "FRAGMENT").
        strings = [n for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if {"dc", "FRAGMENT"} <= {n.value for n in strings}:
            for node in strings:
                m = re.match(r"^\s*(\w+)\s*\(.*\)\s*->", node.value, re.DOTALL)
                if m:
                    iface.python_defined_ops[m.group(1)] = f"{rel}:{node.lineno}"


def read_deepspeed_interface(root: Optional[Path] = None) -> DeepSpeedInterface:
    """Read what the DeepSpeed installed at ``root`` (default: the importable one) expects."""
    root = Path(root) if root is not None else deepspeed_root()
    if root is None:
        return DeepSpeedInterface(Path(os.devnull), problems=["deepspeed is not importable"])
    iface = DeepSpeedInterface(root)
    _read_cpp(root, iface)
    _read_python(root, iface)
    # Only calls of functions the module defines are calls on the module (a local also named
    # `dc` holding something else is not).
    if iface.functions:
        iface.calls = [c for c in iface.calls if c.function in iface.functions]
    return iface


# ---- comparison -------------------------------------------------------------------------------

def schema_compatible(theirs: str, ours: str) -> Optional[str]:
    """None if a caller of schema ``theirs`` can use ``ours``; otherwise why not.

    Names, types, alias annotations and returns must be equal; ours may give an argument a default
    that theirs lacks (both call forms then work), but must keep any default theirs has. Ours may
    also end with arguments theirs lacks if each has a default: a call made to theirs binds
    (DeepSpeed 0.19.0 - 0.19.1's ``end_backward(deps, graph_id)`` against ours with
    ``release_reduce_buckets=True``).
    """
    import torch

    try:
        t = torch._C.parse_schema("dc::" + theirs if "::" not in theirs else theirs)
        o = torch._C.parse_schema("dc::" + ours if "::" not in ours else ours)
    except RuntimeError as e:
        return f"unparsable schema: {e}"

    def alias(a: "torch.Argument") -> Tuple:
        info = a.alias_info
        return () if info is None else (tuple(sorted(info.before_set)), tuple(sorted(info.after_set)),
                                        info.is_write)

    if len(t.arguments) > len(o.arguments):
        return f"{len(t.arguments)} arguments, ours has {len(o.arguments)}"
    for extra in o.arguments[len(t.arguments):]:
        if not extra.has_default_value():
            return (f"{len(t.arguments)} arguments, ours has {len(o.arguments)} and "
                    f"'{extra.type} {extra.name}' has no default")
    for i, (ta, oa) in enumerate(zip(t.arguments, o.arguments)):
        if (ta.name, str(ta.type), ta.kwarg_only, alias(ta)) != (oa.name, str(oa.type), oa.kwarg_only, alias(oa)):
            return f"argument {i} is '{ta.type} {ta.name}', ours is '{oa.type} {oa.name}'"
        if ta.has_default_value() and (not oa.has_default_value() or ta.default_value != oa.default_value):
            return f"argument {ta.name} defaults to {ta.default_value!r}, ours does not"
    if [(str(r.type), alias(r)) for r in t.returns] != [(str(r.type), alias(r)) for r in o.returns]:
        return "different returns"
    return None


def contract_mismatches(deepspeed: Optional[DeepSpeedInterface] = None,
                        ours: Optional[NativeInterface] = None) -> List[str]:
    """Every way the installed DeepSpeed's dc contract differs from ours; empty if none.

    ``deepspeed`` defaults to :func:`read_deepspeed_interface` of the importable DeepSpeed,
    ``ours`` to :func:`declared_interface`.
    """
    ds = deepspeed if deepspeed is not None else read_deepspeed_interface()
    ours = ours if ours is not None else declared_interface()
    out = [f"unverifiable: {p}" for p in ds.problems]
    if not ds.schemas:
        out.append("no dc operator schemas found in DeepSpeed's sources")
    for name, schema in sorted(ds.schemas.items()):
        if name not in ours.schemas:
            out.append(f"op dc::{name} ({schema}) is not provided by ds_z3native")
            continue
        why = schema_compatible(schema, ours.schemas[name])
        if why is not None:
            out.append(f"op dc::{name}: DeepSpeed has '{schema}', ds_z3native has "
                       f"'{ours.schemas[name]}': {why}")
    for name, where in sorted(ds.python_defined_ops.items()):
        if name in ours.schemas:
            out.append(f"op dc::{name} is defined by DeepSpeed's Python ({where}) and by ds_z3native")
    for name in sorted(ds.functions):
        if name not in ours.functions:
            out.append(f"module function {name}() is not provided by ds_z3native")
    for call in ds.calls:
        arity = ours.functions.get(call.function)
        if arity is None:
            if call.function not in ds.functions:  # already reported above otherwise
                out.append(f"{call.where}: calls {call.function}() which ds_z3native lacks")
        elif not arity.accepts(call.n_positional, call.keywords):
            kw = f" and keywords {list(call.keywords)}" if call.keywords else ""
            out.append(f"{call.where}: calls {call.function}() with {call.n_positional} positional "
                       f"arguments{kw}; ds_z3native takes {arity.required}..{arity.total} "
                       f"({', '.join(arity.names)})")
    return out
