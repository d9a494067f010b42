"""The operators of ``ds_z3native._C``, read from the op list the package ships, ``dc_ops.def``.

``dc_ops.def`` is the one source of the op list: DeepSpeed's ``dc`` ops (``DC_OP(name, "schema",
meta_kernel)`` lines, :data:`DC_OPS`) and ds_z3native's own ``ds_z3native`` ops (``DSZ_OP(name,
"schema", kernel, meta_kernel)`` lines, :data:`OWN_OPS`). The C++ sources include it (an X-macro
list) to define the schemas in ``TORCH_LIBRARY(dc)`` and ``TORCH_LIBRARY(ds_z3native)``, to
register the kernels and to declare the Meta kernels; this module reads the same file, so the
Python side (the contract declared before ``_C`` is loaded, the position of each op's graph id)
cannot list other ops than ``_C`` registers.

The reader is strict: a line that is not a ``DC_OP`` line, a ``//`` comment or blank, or a schema
it cannot read, raises :class:`OpListError` naming the file, the line and the problem. Standard
library only: the list is read before torch or ``_C`` are imported.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["OP_LIST_NAME", "Argument", "DcOp", "OpListError", "parse_schema", "parse_op_list",
           "load_op_list", "graph_id_position", "ALL_OPS", "DC_OPS", "OWN_OPS",
           "DC_LIBRARY", "OWN_LIBRARY"]

log = logging.getLogger(__name__)

OP_LIST_NAME = "dc_ops.def"

DC_LIBRARY = "dc"  # DeepSpeed's ops: DC_OP(name, "schema", meta_kernel)
OWN_LIBRARY = "ds_z3native"  # ours: DSZ_OP(name, "schema", kernel, meta_kernel)
_LINE = re.compile(r'DC_OP\(\s*(?P<name>[^,"]*?)\s*,\s*"(?P<schema>[^"\\]*)"\s*,'
                   r'\s*(?P<meta>[^,"()]*?)\s*\)')
_OWN_LINE = re.compile(r'DSZ_OP\(\s*(?P<name>[^,"]*?)\s*,\s*"(?P<schema>[^"\\]*)"\s*,'
                       r'\s*(?P<kernel>[^,"()]*?)\s*,\s*(?P<meta>[^,"()]*?)\s*\)')
_ARGUMENT = re.compile(r"(?P<type>\S.*?)\s+(?P<name>\w+)(?:\s*=\s*(?P<default>\S.*))?")


class OpListError(ValueError):
    """A line of the op list (or a schema on it) that does not follow the list's format."""

    def __init__(self, source: str, line: Optional[int], problem: str, text: str = "") -> None:
        where = f"{source}:{line}" if line is not None else source
        message = f"{where}: {problem}" + (f"\n    {text}" if text else "")
        super().__init__(message)
        self.source = source
        self.line = line
        self.problem = problem


@dataclass(frozen=True)
class Argument:
    """One argument of a schema: its type and name as written, and its default (or None)."""

    type: str
    name: str
    default: Optional[str] = None


@dataclass(frozen=True)
class DcOp:
    """One line of the op list: the op's name, its schema text, its Meta kernel's C++ name, the
    schema's arguments (read from the text), its library (``dc``, or ``ds_z3native`` for a
    ``DSZ_OP`` line) and, for ours, its kernel's C++ name."""

    name: str
    schema: str
    meta: str
    arguments: Tuple[Argument, ...]
    line: int
    library: str = DC_LIBRARY
    kernel: Optional[str] = None

    @property
    def qualified_name(self) -> str:
        """``library::name``."""
        return f"{self.library}::{self.name}"

    @property
    def graph_id_arg(self) -> Optional[int]:
        """The position of the op's graph id among its arguments (:func:`graph_id_position`)."""
        return graph_id_position(self.arguments)


def graph_id_position(arguments: Sequence[Argument]) -> Optional[int]:
    """The position of the graph id among a dc op's ``arguments``, or None if it takes none.

    The graph id is the ``int`` argument named ``graph_id``. DeepSpeed's offload ops name both of
    their ints ``id`` (``Tensor a, int id, int id``): there, as in every other dc op, the graph id
    comes before the other id, so it is the first of the two.
    """
    ints = [(i, a.name) for i, a in enumerate(arguments) if a.type == "int"]
    named = [i for i, name in ints if name == "graph_id"]
    if named:
        return named[0]
    ids = [i for i, name in ints if name == "id"]
    return ids[0] if len(ids) == 2 else None


def _split_arguments(text: str) -> List[str]:
    """``text`` split at the commas outside parentheses and brackets (ValueError if they do not
    balance)."""
    parts: List[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced '{ch}' in the arguments")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unbalanced parentheses in the arguments")
    parts.append(text[start:])
    return [p.strip() for p in parts] if text.strip() else []


def parse_schema(schema: str) -> Tuple[str, Tuple[Argument, ...]]:
    """The op name and arguments of a schema ``name(Type arg, Type arg = default) -> Returns``.

    Reads only what the op list needs (names, types as written, defaults); torch parses the
    schema fully when ``_C`` registers it. Raises ValueError saying what is wrong.
    """
    match = re.fullmatch(r"(\w+)\((.*)", schema)
    if match is None:
        raise ValueError("expected 'name(arguments) -> returns'")
    name, rest = match.groups()
    depth = 1
    for end, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    else:
        raise ValueError("the argument list is not closed")
    returns = rest[end + 1:]
    if not re.fullmatch(r" -> \S.*", returns):
        raise ValueError("expected ' -> returns' after the arguments")
    arguments = []
    for text in _split_arguments(rest[:end]):
        argument = _ARGUMENT.fullmatch(text)
        if argument is None or text == "*":
            raise ValueError(f"cannot read the argument {text!r} (expected 'Type name' or "
                             "'Type name = default')")
        arguments.append(Argument(argument["type"], argument["name"], argument["default"]))
    return name, tuple(arguments)


def parse_op_list(text: str, source: str) -> Tuple[DcOp, ...]:
    """The ops of an op list's ``text``; ``source`` (its path) names it in errors."""
    ops: List[DcOp] = []
    first_line: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("//"):
            continue
        if "/*" in line:
            raise OpListError(source, number, "block comments are not read: use // lines", raw)
        match = _LINE.fullmatch(line) or _OWN_LINE.fullmatch(line)
        if match is None:
            if line.startswith(("DC_OP(", "DSZ_OP(")) and "\\" in line:
                problem = "a backslash in the schema: write it as plain text"
            else:
                problem = ('not a DC_OP(name, "schema", meta_kernel) or DSZ_OP(name, "schema", '
                           'kernel, meta_kernel) line, a // comment or blank')
            raise OpListError(source, number, problem, raw)
        own = match.re is _OWN_LINE
        library = OWN_LIBRARY if own else DC_LIBRARY
        name, schema, meta = match["name"], match["schema"], match["meta"]
        kernel = match["kernel"] if own else None
        idents = [("op name", name), ("meta kernel", meta)] + ([("kernel", kernel)] if own else [])
        for what, ident in idents:
            if not ident.isidentifier():
                raise OpListError(source, number, f"the {what} {ident!r} is not an identifier",
                                  raw)
        try:
            defined, arguments = parse_schema(schema)
        except ValueError as e:
            raise OpListError(source, number, f"schema of {name}: {e}", raw) from None
        if defined != name:
            raise OpListError(source, number,
                              f"the schema defines {defined!r} but the line names {name!r}", raw)
        key = f"{library}::{name}"
        if key in first_line:
            shown = name if not own else key
            raise OpListError(source, number,
                              f"{shown} is listed again (first on line {first_line[key]})", raw)
        first_line[key] = number
        ops.append(DcOp(name, schema, meta, arguments, number, library, kernel))
    if not any(op.library == DC_LIBRARY for op in ops):
        raise OpListError(source, None, "lists no op (no DC_OP line)")
    return tuple(ops)


def load_op_list(path: Optional[Union[str, os.PathLike]] = None) -> Tuple[DcOp, ...]:
    """The ops of the op list at ``path`` (default: the one installed with this package)."""
    source = (Path(path) if path is not None
              else importlib.resources.files(__package__).joinpath(OP_LIST_NAME))
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        problem = ("no such file" if path is not None else "missing: the package was installed "
                   "without its package data (setup.py's package_data names the file)")
        raise OpListError(str(source), None, problem) from None
    ops = parse_op_list(text, str(source))
    log.debug("%d dc ops listed in %s", len(ops), source)
    return ops


ALL_OPS: Tuple[DcOp, ...] = load_op_list()
DC_OPS: Tuple[DcOp, ...] = tuple(op for op in ALL_OPS if op.library == DC_LIBRARY)
OWN_OPS: Tuple[DcOp, ...] = tuple(op for op in ALL_OPS if op.library == OWN_LIBRARY)
