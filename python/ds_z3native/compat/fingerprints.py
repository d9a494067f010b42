"""What each patch wraps, and whether it is still the code ds_z3native was tested against.

Every :class:`~ds_z3native.compat.Patch` names its *targets* (``Patch.wraps``): the functions,
methods and attributes it wraps, replaces or temporarily swaps, written ``"module:qualname"``
(for example ``"deepspeed.compile.init_z3:init_z3"`` or
``"deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition"``,
a private name as the source spells it). A target's *fingerprint* is read from its source file,
never from bytecode (so it is the same under every Python):

* a function or method: its signature as written (``(self, loss, retain_graph=False)``) and
  SHA-256 of its source text, decorators included;
* a module or class attribute (a constant, a list, an attribute ``self.<name>`` that the class's
  methods assign): ``"attribute"`` and SHA-256 of the statements that assign it;
* a target the release does not have: ``missing`` (patches guard such targets with ``hasattr``;
  the absence is what was tested).

The table also records each target file's SHA-256 and the lines of its function targets: where
the running file's digest is the recorded one, its targets are known without parsing it (a read
and a hash per file at ``install()``).

:data:`TABLE_PATH` (``fingerprints.json`` beside this module) records the fingerprint of every
target per tested release of its package. ``python -m ds_z3native.compat.fingerprints --write``
records the importable DeepSpeed's (and torch's and transformers') into it; run it once per
supported DeepSpeed release with that release first on ``PYTHONPATH``
(``scripts/record_fingerprints.sh`` does all of them), and again whenever a patch's targets
change. ``--check`` compares instead and exits 1 on a difference.

:func:`check_targets` compares the running code with the table. Beyond the source, a target whose
module is already imported must still be the object defined there: a function replaced at run
time (by another library, or by a test) is reported, even when its file is unchanged. Wrappers
that DeepSpeed's own decorators, torch or ds_z3native put around a function are seen through.

DeepSpeed targets are strict: ``install()`` refuses a patch whose DeepSpeed target does not match
the running release's record (:class:`~ds_z3native.installer.UnverifiedPatchTarget`), unless
``DS_Z3NATIVE_UNVERIFIED_PATCHES`` names the patch (or is ``all``). For a release without a
record (a newer DeepSpeed), a target matches where its code equals a tested release's. Targets in
other packages (torch, transformers) vary with the versions users run: one that matches no
record is *unverified*, a warning and a doctor line, never a refusal.
"""

from __future__ import annotations

import argparse
import ast
import enum
import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from packaging.version import InvalidVersion, Version

__all__ = ["TABLE_PATH", "STRICT_PACKAGES", "UNVERIFIED_ENV", "Fingerprint", "FileRecord",
           "Status", "TargetCheck", "split_target", "target_package", "source_fingerprint",
           "file_digest", "live_replacement", "package_version", "load_table", "load_files",
           "check_targets",
           "check_patches", "allowed_unverified", "record", "main"]

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("fingerprints.json")
# Packages whose targets install() verifies strictly (refuses on a difference).
STRICT_PACKAGES = ("deepspeed",)
# Patches to apply although a strict target does not match: comma-separated names, or "all".
UNVERIFIED_ENV = "DS_Z3NATIVE_UNVERIFIED_PATCHES"
_FORMAT = 1
_DISPLAY = {"deepspeed": "DeepSpeed"}


@dataclass(frozen=True)
class Fingerprint:
    """A target's signature (``"attribute"`` for a non-function) and source hash; both None when
    the target does not exist in that code."""

    signature: Optional[str]
    source_sha256: Optional[str]

    @property
    def missing(self) -> bool:
        """Whether the target does not exist."""
        return self.signature is None and self.source_sha256 is None

    def describe(self) -> str:
        """One line: ``missing``, or the signature and the first 12 digits of the hash."""
        if self.missing:
            return "missing"
        return f"{self.signature} sha256 {str(self.source_sha256)[:12]}"

    def to_json(self) -> Dict[str, Any]:
        return {"missing": True} if self.missing else asdict(self)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Fingerprint":
        if data.get("missing"):
            return MISSING
        return cls(str(data["signature"]), str(data["source_sha256"]))


MISSING = Fingerprint(None, None)


class Status(str, enum.Enum):
    """How a target compares with the table."""

    MATCHES = "matches"  # equals the record of the running release
    MATCHES_RECORDED = "matches-recorded"  # an unrecorded release: equals a tested release's
    CHANGED = "changed"  # the release is recorded, the code differs
    UNKNOWN = "unknown"  # no record of the running release (and not the newest one's code)
    REPLACED = "replaced"  # the live object is not the one its source defines
    NOT_INSTALLED = "not-installed"  # its package is absent: the patch never reaches it

    @property
    def ok(self) -> bool:
        return self in (Status.MATCHES, Status.MATCHES_RECORDED, Status.NOT_INSTALLED)


@dataclass(frozen=True)
class TargetCheck:
    """One target of one patch, compared with the table."""

    patch: str
    target: str
    package: str
    version: str  # the running version of the target's package
    status: Status
    found: str  # the running code's fingerprint, or what replaced the object
    recorded: str  # the record compared with ("" when there is none)

    @property
    def strict(self) -> bool:
        """Whether a mismatch refuses the patch (DeepSpeed) or only warns (others)."""
        return self.package in STRICT_PACKAGES

    @property
    def display_package(self) -> str:
        """The package's name as its project writes it (``DeepSpeed``)."""
        return _DISPLAY.get(self.package, self.package)

    @property
    def verdict(self) -> str:
        """``matches``, ``matches <version>`` for an unrecorded release whose code is a tested
        release's, ``REFUSED`` (strict) or ``unverified``: the column doctor prints."""
        if self.status is Status.MATCHES:
            return "matches"
        if self.status is Status.MATCHES_RECORDED:
            return f"matches {self.recorded}"
        if self.status is Status.NOT_INSTALLED:
            return "not installed"
        return "REFUSED" if self.strict else "unverified"

    def explain(self) -> str:
        """Why the target is not verified (empty when it is)."""
        what = {Status.CHANGED: f"its code differs from the one recorded for {self.package} "
                                f"{self.version} (recorded {self.recorded}; running {self.found})",
                Status.UNKNOWN: f"no fingerprint is recorded for {self.package} {self.version}"
                                + (f" and it differs from {self.recorded}" if self.recorded
                                   else "") + f" (running {self.found})",
                Status.REPLACED: f"the running object is not {self.display_package} "
                                 f"{self.version}'s own: {self.found}"}
        return what.get(self.status, "")


# ---- reading targets from source ----------------------------------------------------------------

def split_target(target: str) -> Tuple[str, str]:
    """``"module:qualname"`` -> (module, qualname); ValueError for another form."""
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"patch target {target!r} is not 'module:qualname'")
    return module, qualname


def target_package(target: str) -> str:
    """The top-level package of a target (``deepspeed``, ``torch``, ``transformers``...)."""
    return split_target(target)[0].split(".", 1)[0]


def _module_file(module: str) -> Optional[Path]:
    """The source file of ``module``, without importing it (or any of its packages): the loaded
    module's file when it is imported, else found from the top-level package's location."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        path = getattr(loaded, "__file__", None)
        return Path(path) if path else None
    top, *parts = module.split(".")
    loaded_top = sys.modules.get(top)
    if loaded_top is not None:
        locations = list(getattr(loaded_top, "__path__", []) or [])
    else:
        spec = importlib.util.find_spec(top)
        if spec is None:
            return None
        if not spec.submodule_search_locations:
            return Path(spec.origin) if spec.origin and not parts else None
        locations = list(spec.submodule_search_locations)
    for location in locations:
        base = Path(location).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if parts and candidate.is_file():
                return candidate
        if not parts and (base / "__init__.py").is_file():
            return base / "__init__.py"
    return None


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> Tuple[ast.Module, Tuple[str, ...]]:
    text = Path(path).read_text(encoding="utf-8").replace("\r\n", "\n")
    return ast.parse(text, filename=path), tuple(text.split("\n"))


def _parsed(path: Path) -> Tuple[ast.Module, Tuple[str, ...]]:
    stat = path.stat()
    return _parse(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    text = Path(path).read_text(encoding="utf-8").replace("\r\n", "\n")
    return _sha256(text)


def file_digest(module: str) -> Optional[str]:
    """SHA-256 of ``module``'s source file (as :func:`source_fingerprint` reads it), or None.
    Where it equals the digest recorded for a release, every target in that file has the
    recorded fingerprint, and the file is not parsed."""
    path = _module_file(module)
    if path is None or path.suffix != ".py":
        return None
    stat = path.stat()
    return _file_digest(str(path), stat.st_mtime_ns, stat.st_size)


def _definition(target: str) -> Tuple[Fingerprint, Optional[Tuple[int, int]]]:
    """(fingerprint, (first line, last line) of the definition when it is a function) of
    ``target`` as its source file defines it."""
    module, qualname = split_target(target)
    path = _module_file(module)
    if path is None or path.suffix != ".py":
        return MISSING, None
    tree, lines = _parsed(path)
    node, assigned = _locate(tree, qualname)
    if node is not None:
        fp = Fingerprint(_signature(node), _sha256(_text(lines, node)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return fp, (start, int(node.end_lineno or node.lineno))
        return fp, None
    if assigned:
        return Fingerprint("attribute", _sha256("\n".join(_text(lines, n) for n in assigned))), None
    return MISSING, None


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a scope, including those under if/try/with (not inside defs)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.AsyncWith)):
            for field in ("body", "orelse", "finalbody"):
                yield from _statements(getattr(node, field, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                yield from _statements(handler.body)


def _assigns_name(node: ast.stmt, name: str) -> bool:
    """Whether ``node`` binds ``name`` in its scope: an assignment, or an import
    (``import a.b as name``, ``from a import b as name``, ``import name.sub``)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    targets: List[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names = [t for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    return any(t.id == name for t in names)


def _self_assignments(cls: ast.ClassDef, name: str) -> List[ast.stmt]:
    """Statements in ``cls``'s methods that assign ``self.<name>``."""
    found = []
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr == name
                        and isinstance(target.value, ast.Name) and target.value.id == "self"):
                    found.append(node)
    return found


def _locate(tree: ast.Module, qualname: str) -> Tuple[Optional[ast.AST], List[ast.stmt]]:
    """(definition node, attribute assignments) of ``qualname`` in a module's tree; the last
    definition of a name in its scope wins, as at run time."""
    *outer, last = qualname.split(".")
    scope: Sequence[ast.stmt] = tree.body
    cls: Optional[ast.ClassDef] = None
    for part in outer:
        classes = [n for n in _statements(scope) if isinstance(n, ast.ClassDef) and n.name == part]
        if not classes:
            return None, []
        cls = classes[-1]
        scope = cls.body
    defs = [n for n in _statements(scope) if isinstance(n, _DEFS) and n.name == last]
    if defs:
        return defs[-1], []
    assigned = [n for n in _statements(scope) if _assigns_name(n, last)]
    if cls is not None:
        assigned += _self_assignments(cls, last)
    return None, assigned


def _text(lines: Sequence[str], node: ast.AST) -> str:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.end_lineno])


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        return "class(" + ", ".join(ast.unparse(b) for b in node.bases) + ")"
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({ast.unparse(node.args)}){returns}"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_fingerprint(target: str) -> Fingerprint:
    """The fingerprint of ``target`` as its package's source file defines it (nothing is
    imported); :data:`MISSING` where the module or the name is not there."""
    return _definition(target)[0]


# ---- the live object ---------------------------------------------------------------------------

def _mangled(owner: Any, part: str) -> str:
    if part.startswith("__") and not part.endswith("__") and isinstance(owner, type):
        return f"_{owner.__name__.lstrip('_')}{part}"
    return part


_ABSENT = object()


def _live_object(target: str) -> Any:
    """The object ``target`` names in the imported module, ``_ABSENT`` if it has no such
    attribute, None if its module is not imported. A class member is read from the class's own
    ``__dict__`` (what a patch replaces), an inherited one counts as absent."""
    module_name, qualname = split_target(target)
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        return None
    for part in qualname.split("."):
        name = _mangled(obj, part)
        if isinstance(obj, type):
            obj = obj.__dict__.get(name, _ABSENT)
        else:
            obj = getattr(obj, name, _ABSENT)
        if obj is _ABSENT:
            return _ABSENT
    return obj


def _package_dirs(package: str) -> Tuple[str, ...]:
    """Directories whose wrappers are seen through: the target's own package (its decorators:
    DeepSpeed's nvtx ranges and compiler.disable), torch's (torch.compiler.disable) and
    ds_z3native's own patches."""
    dirs = [str(Path(__file__).resolve().parents[1])]
    for name in dict.fromkeys((package, "torch")):
        module = sys.modules.get(name)
        for location in getattr(module, "__path__", []) or []:
            dirs.append(str(Path(location).resolve()))
    return tuple(dirs)


def _function(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return obj


def _defined_at(obj: Any) -> Optional[Tuple[str, int, str]]:
    code = getattr(_function(obj), "__code__", None)
    if code is None:
        return None
    return code.co_filename, code.co_firstlineno, getattr(code, "co_qualname",
                                                          _function(obj).__qualname__)


def _candidates(obj: Any, trusted: Tuple[str, ...], depth: int = 0) -> Iterator[Any]:
    """``obj`` and the functions it wraps, through wrappers defined in ``trusted`` directories
    (``__wrapped__`` or a closure cell holding the wrapped function)."""
    yield obj
    if depth >= 6:
        return
    fn = _function(obj)
    where = _defined_at(fn)
    inner = getattr(fn, "__wrapped__", None)
    wrapper_is_trusted = where is not None and os.path.realpath(where[0]).startswith(trusted)
    if inner is not None and (wrapper_is_trusted or where is None):
        yield from _candidates(inner, trusted, depth + 1)
    if wrapper_is_trusted:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and getattr(value, "__code__", None) is not None:
                yield from _candidates(value, trusted, depth + 1)


def live_replacement(target: str, known: Optional[Tuple[Fingerprint, Optional[Tuple[int, int]]]]
                     = None) -> Optional[str]:
    """Where the target's module is imported: None if the live object is the one its source
    defines (or a decoration of it), else a description of what is there instead. None as well
    for a module not imported yet and for attributes that are not functions (only their source
    is compared). ``known``: the target's (fingerprint, function lines) when already known
    (from a recorded file digest), so that the file is not parsed."""
    module_name, qualname = split_target(target)
    live = _live_object(target)
    if live is None:
        return None
    expected, lines = _definition(target) if known is None else known
    if expected.signature == "attribute":  # a value or an instance attribute: source only
        return None
    if live is _ABSENT:
        return None if expected.missing else "absent from the imported module"
    if _defined_at(live) is None and not hasattr(_function(live), "__wrapped__"):
        return None  # a value, not a function: its source is what is compared
    path = _module_file(module_name)
    if path is None or lines is None:
        return None
    start, end = lines
    name = qualname.rsplit(".", 1)[-1]
    own_file = os.path.realpath(str(path))
    trusted = _package_dirs(module_name.split(".", 1)[0])
    for candidate in _candidates(live, trusted):
        where = _defined_at(candidate)
        if (where is not None and os.path.realpath(where[0]) == own_file
                and start <= where[1] <= end and where[2].rsplit(".", 1)[-1] == name):
            return None
    where = _defined_at(live)
    if where is None:
        return f"replaced by {live!r}"
    return f"replaced by {where[2]} defined at {where[0]}:{where[1]}"


# ---- versions and the table ---------------------------------------------------------------------

def package_version(package: str) -> Optional[str]:
    """The release (``X.Y.Z``, no local part) of the importable ``package``, or None. DeepSpeed's
    is read the way ``install()`` reads it; others from their module's ``__version__`` when
    imported, else from the installed metadata."""
    raw: Optional[str] = None
    module = sys.modules.get(package)
    if module is not None:
        raw = getattr(module, "__version__", None)
    if raw is None and package == "deepspeed":
        from . import deepspeed_version

        try:
            return str(Version(deepspeed_version().base_version))
        except ImportError:
            return None
    if raw is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            raw = version(package)
        except PackageNotFoundError:
            return None
    try:
        return str(Version(Version(str(raw).split("+")[0]).base_version))
    except InvalidVersion:
        return str(raw)


def load_table(path: Optional[Path] = None) -> Dict[str, Dict[str, Dict[str, Fingerprint]]]:
    """package -> version -> target -> fingerprint, from ``path`` (default :data:`TABLE_PATH`;
    empty if there is none)."""
    path = TABLE_PATH if path is None else path
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if raw.get("format") != _FORMAT:
        raise ValueError(f"{path}: fingerprint table format {raw.get('format')!r}, expected "
                         f"{_FORMAT}")
    return {package: {version: {target: Fingerprint.from_json(fp)
                                for target, fp in targets.items()}
                      for version, targets in versions.items()}
            for package, versions in raw["packages"].items()}


@dataclass(frozen=True)
class FileRecord:
    """A recorded source file: its digest, and the lines of each function target in it."""

    sha256: str
    functions: Dict[str, Tuple[int, int]]


def load_files(path: Optional[Path] = None) -> Dict[str, Dict[str, Dict[str, FileRecord]]]:
    """package -> version -> module -> :class:`FileRecord`, from ``path`` (default
    :data:`TABLE_PATH`; empty if there is none)."""
    path = TABLE_PATH if path is None else path
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {package: {version: {module: FileRecord(str(rec["sha256"]),
                                                   {q: (int(a), int(b)) for q, (a, b)
                                                    in rec.get("functions", {}).items()})
                                for module, rec in modules.items()}
                      for version, modules in versions.items()}
            for package, versions in raw.get("files", {}).items()}


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def _recorded_code(target: str, recorded: Dict[str, Fingerprint], files: Dict[str, FileRecord]
                   ) -> Optional[Tuple[Fingerprint, Optional[Tuple[int, int]]]]:
    """``target``'s (fingerprint, function lines) from a release's record, when the running
    file's digest is the one recorded for it (then its code is that record's, unparsed)."""
    module, qualname = split_target(target)
    record = files.get(module)
    if record is not None and target in recorded and file_digest(module) == record.sha256:
        return recorded[target], record.functions.get(qualname)
    return None


def check_targets(patch: str, targets: Iterable[str],
                  table: Optional[Dict[str, Dict[str, Dict[str, Fingerprint]]]] = None,
                  versions: Optional[Dict[str, Optional[str]]] = None,
                  files: Optional[Dict[str, Dict[str, Dict[str, FileRecord]]]] = None
                  ) -> List[TargetCheck]:
    """Compare each of ``patch``'s ``targets`` with ``table`` (default: :func:`load_table`) for
    the running version of its package (``versions`` overrides, by package). A version without
    a record matches where the code equals the record of a tested release (the newest such).
    ``files`` (default: :func:`load_files` with the default table, else none) lets a file whose
    digest is recorded skip parsing."""
    if table is None:
        table = load_table()
        files = load_files() if files is None else files
    files = files or {}
    versions = dict(versions or {})
    checks = []
    for target in targets:
        package = target_package(target)
        if package not in versions:
            versions[package] = package_version(package)
        if versions[package] is None:
            # A package that is not installed (transformers for a user without it): nothing of
            # it is imported, so the patch's edit of it never happens.
            checks.append(TargetCheck(patch, target, package, "not installed",
                                      Status.NOT_INSTALLED, "", ""))
            continue
        version = str(versions[package])
        recorded_by_version = table.get(package, {})
        if version in recorded_by_version:
            candidates = [version]
        else:
            candidates = sorted((v for v in recorded_by_version if _is_version(v)), key=Version,
                                reverse=True)
        known = None
        for candidate in candidates:
            known = _recorded_code(target, recorded_by_version[candidate],
                                   files.get(package, {}).get(candidate, {}))
            if known is not None:
                break
        known = _definition(target) if known is None else known
        found = known[0]
        replaced = live_replacement(target, known)
        if replaced is not None:
            checks.append(TargetCheck(patch, target, package, version, Status.REPLACED, replaced,
                                      ""))
            continue
        record = recorded_by_version.get(version, {}).get(target)
        if record is not None:
            status = Status.MATCHES if record == found else Status.CHANGED
            checks.append(TargetCheck(patch, target, package, version, status, found.describe(),
                                      record.describe()))
            continue
        same = next((v for v in candidates if recorded_by_version[v].get(target) == found), None)
        if same is not None:
            checks.append(TargetCheck(patch, target, package, version, Status.MATCHES_RECORDED,
                                      found.describe(), same))
            continue
        newest = candidates[0] if candidates else None
        newest_record = recorded_by_version.get(newest or "", {}).get(target)
        checks.append(TargetCheck(
            patch, target, package, version, Status.UNKNOWN, found.describe(),
            f"{package} {newest}: {newest_record.describe()}" if newest_record is not None
            else ""))
    return checks


def check_patches(patches: Iterable[Any],
                  table: Optional[Dict[str, Dict[str, Dict[str, Fingerprint]]]] = None,
                  versions: Optional[Dict[str, Optional[str]]] = None) -> List[TargetCheck]:
    """:func:`check_targets` of every patch (objects with ``name`` and ``wraps``); ``versions``
    overrides the running version of a package (``{"deepspeed": "0.19.8"}``)."""
    files = load_files() if table is None else {}
    table = load_table() if table is None else table
    versions = dict(versions or {})
    checks: List[TargetCheck] = []
    for patch in patches:
        for check in check_targets(patch.name, patch.wraps, table, versions, files):
            versions.setdefault(check.package, check.version)
            checks.append(check)
    return checks


def allowed_unverified(value: Optional[str] = None) -> Tuple[bool, frozenset]:
    """(every patch allowed, names allowed) by ``DS_Z3NATIVE_UNVERIFIED_PATCHES`` (or
    ``value``): ``all`` or ``1`` allows every patch, a comma-separated list those patches."""
    raw = os.environ.get(UNVERIFIED_ENV, "") if value is None else value
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return bool(names & {"all", "1"}), names


# ---- recording --------------------------------------------------------------------------------

def _all_targets() -> Dict[str, List[str]]:
    from .registry import all_patches

    by_package: Dict[str, List[str]] = {}
    for patch in all_patches():
        for target in patch.wraps:
            by_package.setdefault(target_package(target), [])
            if target not in by_package[target_package(target)]:
                by_package[target_package(target)].append(target)
    return by_package


Recorded = Dict[str, Tuple[str, Dict[str, Fingerprint], Dict[str, FileRecord]]]


def record(packages: Optional[Sequence[str]] = None) -> Recorded:
    """package -> (running version, target -> fingerprint, module -> file record) for every
    target of every patch in ``packages`` (default: all). Nothing is imported but the packages'
    top level; a target whose module is imported and holds a replaced object raises (record
    pristine code only)."""
    out: Recorded = {}
    for package, targets in sorted(_all_targets().items()):
        if packages is not None and package not in packages:
            continue
        version = package_version(package)
        if version is None:
            log.warning("%s is not installed: its targets are not recorded", package)
            continue
        prints: Dict[str, Fingerprint] = {}
        files: Dict[str, FileRecord] = {}
        for target in sorted(targets):
            known = _definition(target)
            replaced = live_replacement(target, known)
            if replaced is not None:
                raise RuntimeError(f"{target} is {replaced}: record fingerprints from an "
                                   "unpatched interpreter")
            prints[target] = known[0]
            module, qualname = split_target(target)
            digest = file_digest(module)
            if digest is None:
                continue
            entry = files.setdefault(module, FileRecord(digest, {}))
            if known[1] is not None:
                entry.functions[qualname] = known[1]
        out[package] = (version, prints, files)
    return out


def _write(recorded: Recorded, path: Path) -> None:
    raw: Dict[str, Any] = {"format": _FORMAT, "packages": {}, "files": {}}
    if path.is_file():
        raw = json.loads(path.read_text())
        raw.setdefault("files", {})
    for package, (version, prints, files) in recorded.items():
        raw["packages"].setdefault(package, {})[version] = {
            target: fp.to_json() for target, fp in sorted(prints.items())}
        raw["files"].setdefault(package, {})[version] = {
            module: {"sha256": rec.sha256,
                     "functions": {q: list(lines) for q, lines in sorted(rec.functions.items())}}
            for module, rec in sorted(files.items())}
    for section in ("packages", "files"):
        for package, versions in raw[section].items():
            raw[section][package] = dict(sorted(versions.items(), key=lambda kv: Version(kv[0])))
        raw[section] = dict(sorted(raw[section].items()))
    path.write_text(json.dumps(raw, indent=1) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ds_z3native.compat.fingerprints [--write | --check] [--package P ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m ds_z3native.compat.fingerprints",
        description="Fingerprints of the code ds_z3native's patches wrap, for the importable "
                    "DeepSpeed (and torch, transformers).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true",
                      help=f"record them in {TABLE_PATH.name} (under the running versions)")
    mode.add_argument("--check", action="store_true",
                      help="compare them with the table; exit 1 on a difference")
    parser.add_argument("--package", action="append", default=None,
                        help="only this package's targets (repeatable; default: all)")
    parser.add_argument("--table", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    recorded = record(args.package)
    args.table = TABLE_PATH if args.table is None else args.table
    if args.write:
        _write(recorded, args.table)
        for package, (version, prints, _) in recorded.items():
            sys.stdout.write(f"recorded {len(prints)} targets of {package} {version} in "
                             f"{args.table}\n")
        return 0
    table = load_table(args.table)
    differences = 0
    for package, (version, prints, _) in recorded.items():
        known = table.get(package, {}).get(version, {})
        for target, fp in prints.items():
            state = ("matches" if known.get(target) == fp
                     else "NOT RECORDED" if target not in known else "CHANGED")
            differences += state != "matches"
            sys.stdout.write(f"{package} {version}  {target}  {fp.describe()}  {state}\n")
    return 1 if args.check and differences else 0


if __name__ == "__main__":
    sys.exit(main())
