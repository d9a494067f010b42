"""Where the CUDA runtime and NCCL are, for setup.py: found on the filesystem, never guessed.

ds_z3native's sources are C++ only (no .cu files), so the CUDA flavour needs the CUDA runtime's
headers and ``libcudart``, NCCL's ``nccl.h`` and ``libnccl``, and no nvcc. They come from

* a CUDA toolkit, used only when ``<root>/include/cuda_runtime_api.h`` and a ``libcudart.so*``
  are really there (a ``CUDA_HOME`` guessed from an ``nvcc`` wrapper script in some ``bin/``
  directory outside the toolkit has neither), and its CUDA major version is torch's;
* otherwise the nvidia-* wheels torch's CUDA wheel installs beside it (``nvidia/cuda_runtime``,
  ``nvidia/nccl``; CUDA 13's combined ``nvidia/cu13``).

Finding ``cuda_runtime_api.h`` does not mean the headers it pulls in are there: the runtime wheels
lack CUDA's C runtime headers (``crt/``: the ``nvidia-cuda-crt`` wheel for CUDA 13) and libcu++
(``nv/target``, ``cuda/std/``: the ``nvidia-cuda-cccl`` wheel), which torch's wheel does not
install; torch 2.11+cu130's wheels-only build failed on each in turn. So before the CUDA flavour
is chosen, :func:`probe_headers` compiles (``-fsyntax-only``) exactly the CUDA-side includes of
csrc/ (:func:`cuda_side_includes`) with the build's compiler and include path, and a failure
names the missing headers and the wheels that ship them (:func:`wheel_for_header`).

With no usable CUDA, the CPU flavour, with one line saying why and how to get CUDA. Every function
here other than :func:`probe_headers` is pure over the paths, text and environment it is given
(no torch, no globals), so the decision can be checked on fake layouts; setup.py imports this file
by path.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["CudaRuntime", "Nccl", "BuildPlan", "DiscoveryError", "cudart_version",
           "runtime_at", "toolkit_candidates", "find_toolkit", "find_wheel_runtime", "find_nccl",
           "plan_build", "CPU_REASONS", "HeaderProbe", "cuda_side_includes", "missing_header",
           "missing_in_dependencies", "first_error", "wheel_for_header", "probe_source",
           "probe_headers"]

# Why a build is CPU-only: the code goes into the extension's build info (no spaces: it travels
# as a compiler macro), the text into the build log and `ds-z3native doctor`.
CPU_REASONS = {
    "cpu-torch": "torch is a CPU build",
    "forced": "DS_Z3NATIVE_CUDA=0 was set",
    "no-cuda-runtime": "no CUDA runtime headers (toolkit or nvidia wheels) were found",
    "no-nccl": "no NCCL (nccl.h and libnccl.so*) was found",
    "cuda-headers-incomplete": "the CUDA headers found lack some that the sources include",
    "cuda-headers-unusable": "the CUDA headers found do not compile with the build's compiler",
}

_LIB_SUBDIRS = ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib"), os.path.join("lib", "x86_64-linux-gnu"),
                os.path.join("lib", "aarch64-linux-gnu"))


class DiscoveryError(RuntimeError):
    """DS_Z3NATIVE_CUDA asks for something this machine cannot give; the message says what."""


@dataclass(frozen=True)
class CudaRuntime:
    """A CUDA runtime to compile and link against: ``kind`` is ``toolkit`` or ``wheels``."""

    kind: str
    root: str
    include_dir: str
    library_dir: str
    library: str  # the file to link: libcudart.so, or libcudart.so.13 where only that exists
    version: Optional[str]  # "13.0", read from CUDART_VERSION in cuda_runtime_api.h
    # include_dir plus where libcu++ (CCCL) and the C runtime headers are, when elsewhere
    include_dirs: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Nccl:
    """NCCL's header and library directories, and the library file to link."""

    include_dir: str
    library_dir: str
    library: str


@dataclass
class BuildPlan:
    """The flavour setup.py builds and what it compiles against.

    ``cpu_reason`` is a key of :data:`CPU_REASONS` for a CPU build; ``message`` is the one line
    the build prints; ``warning`` is set when torch has CUDA but the build will not;
    ``checked`` lists the candidates looked at and why each was passed over."""

    flavour: str
    runtime: Optional[CudaRuntime] = None
    nccl: Optional[Nccl] = None
    cpu_reason: str = ""
    message: str = ""
    warning: bool = False
    checked: List[str] = field(default_factory=list)


def _major(version: Optional[str]) -> Optional[str]:
    return version.split(".")[0] if version else None


def cudart_version(include_dir: str) -> Optional[str]:
    """``"major.minor"`` from ``#define CUDART_VERSION`` in ``include_dir``'s
    cuda_runtime_api.h, or None if the header does not say."""
    try:
        with open(os.path.join(include_dir, "cuda_runtime_api.h"), errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)", text, re.M)
    if not m:
        return None
    code = int(m.group(1))
    return f"{code // 1000}.{(code % 1000) // 10}"


def _shared_library(library_dir: str, stem: str) -> Optional[str]:
    """The file name of ``stem``.so in ``library_dir``: unversioned if present, else the
    shortest versioned name (libcudart.so.13 before libcudart.so.13.0.96)."""
    found = [os.path.basename(p) for p in glob.glob(os.path.join(library_dir, f"{stem}.so*"))]
    if not found:
        return None
    return min(found, key=lambda name: (len(name), name))


def runtime_at(root: str, kind: str) -> Tuple[Optional[CudaRuntime], str]:
    """The CUDA runtime under ``root`` (its ``include/cuda_runtime_api.h`` and a
    ``libcudart.so*`` in one of its library directories), or None and why not."""
    include_dir = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(include_dir, "cuda_runtime_api.h")):
        return None, f"{root}: no include/cuda_runtime_api.h"
    for sub in _LIB_SUBDIRS:
        library_dir = os.path.join(root, sub)
        library = _shared_library(library_dir, "libcudart")
        if library:
            return CudaRuntime(kind, root, include_dir, library_dir, library,
                               cudart_version(include_dir), _include_dirs(root, kind)), ""
    return None, f"{root}: cuda_runtime_api.h but no libcudart.so* under lib64/ or lib/"


def _include_dirs(root: str, kind: str) -> Tuple[str, ...]:
    """The runtime's include dir and those beside it that its headers need: CUDA 13 keeps
    libcu++ (CCCL) in include/cccl (toolkit and nvidia-cuda-cccl wheel alike), which nvcc adds
    by itself but a C++ compiler does not; CUDA 12's wheels put CCCL and the C runtime headers
    in their own directories (nvidia/cuda_cccl, nvidia/cuda_nvcc)."""
    include_dir = os.path.join(root, "include")
    dirs = [include_dir, os.path.join(include_dir, "cccl")]
    if kind == "wheels":
        nvidia = os.path.dirname(root)
        dirs += [os.path.join(nvidia, "cuda_cccl", "include"),
                 os.path.join(nvidia, "cuda_nvcc", "include")]
    return tuple(d for d in dirs if d == include_dir or os.path.isdir(d))


def _which(name: str, path: str) -> Optional[str]:
    for d in filter(None, path.split(os.pathsep)):
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def toolkit_candidates(environ: Mapping[str, str], root: str = "/") -> List[str]:
    """CUDA toolkit roots to check, in order. ``CUDA_HOME`` (or ``CUDA_PATH``), when set, is the
    only one: the user named it. Otherwise the toolkit around ``nvcc`` on PATH (followed through
    symlinks, then as found) and ``<root>/usr/local/cuda``."""
    named = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if named:
        return [named]
    out: List[str] = []
    nvcc = _which("nvcc", environ.get("PATH", ""))
    if nvcc:
        out += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                os.path.dirname(os.path.dirname(nvcc))]
    out.append(os.path.join(root, "usr", "local", "cuda"))
    return list(dict.fromkeys(out))


def _matching(found: Optional[CudaRuntime], torch_cuda: str, checked: List[str]
              ) -> Optional[CudaRuntime]:
    """``found`` if its CUDA major version is torch's (two runtimes in one process do not mix)."""
    if found is None:
        return None
    if found.version and _major(found.version) != _major(torch_cuda):
        checked.append(f"{found.root}: CUDA {found.version}, but torch is built with CUDA "
                       f"{torch_cuda}")
        return None
    return found


def find_toolkit(environ: Mapping[str, str], torch_cuda: str, root: str = "/"
                 ) -> Tuple[Optional[CudaRuntime], List[str]]:
    """The first verified toolkit of :func:`toolkit_candidates` with torch's CUDA major
    version, and why each candidate before it was passed over."""
    return _first_runtime(toolkit_candidates(environ, root), "toolkit", torch_cuda)


def _first_runtime(candidates: Iterable[str], kind: str, torch_cuda: str
                   ) -> Tuple[Optional[CudaRuntime], List[str]]:
    """The first of ``candidates`` holding a CUDA runtime of torch's major version, and why each
    one before it was passed over."""
    checked: List[str] = []
    for candidate in candidates:
        found, why = runtime_at(candidate, kind)
        if found is None:
            checked.append(why)
            continue
        found = _matching(found, torch_cuda, checked)
        if found is not None:
            return found, checked
    return None, checked


def _wheel_roots(site_dirs: Iterable[str], torch_cuda: str) -> List[str]:
    """nvidia/cu<major> (CUDA 13's combined layout) and nvidia/cuda_runtime under each site dir."""
    out: List[str] = []
    for d in site_dirs:
        out += [os.path.join(d, "nvidia", f"cu{_major(torch_cuda)}"),
                os.path.join(d, "nvidia", "cuda_runtime")]
    return list(dict.fromkeys(out))


def find_wheel_runtime(site_dirs: Sequence[str], torch_cuda: str
                       ) -> Tuple[Optional[CudaRuntime], List[str]]:
    """The CUDA runtime of the nvidia-* wheels in ``site_dirs`` with torch's CUDA major version,
    and why the others were passed over (directories that do not exist are not reported)."""
    present = [d for d in _wheel_roots(site_dirs, torch_cuda) if os.path.isdir(d)]
    return _first_runtime(present, "wheels", torch_cuda)


def find_nccl(environ: Mapping[str, str], site_dirs: Sequence[str],
              runtime: Optional[CudaRuntime], torch_cuda: str = "", root: str = "/"
              ) -> Optional[Nccl]:
    """NCCL's header and library: ``NCCL_HOME``, the nvidia-nccl wheel (nvidia/nccl, or the
    combined nvidia/cu<major>), the CUDA runtime's root, then ``<root>/usr`` and
    ``<root>/usr/local``."""
    roots = [environ.get("NCCL_HOME")]
    for d in site_dirs:
        roots.append(os.path.join(d, "nvidia", "nccl"))
        if torch_cuda:
            roots.append(os.path.join(d, "nvidia", f"cu{_major(torch_cuda)}"))
    roots += [runtime.root if runtime else None, os.path.join(root, "usr"),
              os.path.join(root, "usr", "local")]
    for r in dict.fromkeys(filter(None, roots)):
        include_dir = os.path.join(r, "include")
        if not os.path.isfile(os.path.join(include_dir, "nccl.h")):
            continue
        for sub in _LIB_SUBDIRS:
            library_dir = os.path.join(r, sub)
            library = _shared_library(library_dir, "libnccl")
            if library:
                return Nccl(include_dir, library_dir, library)
    return None


@dataclass(frozen=True)
class HeaderProbe:
    """What compiling the CUDA-side includes said: ``ok``, else the first header the compiler
    could not find (``missing``), the others the sources also reach and are missing
    (``also_missing``, from a dependency scan), or, for another failure, its first error line."""

    ok: bool
    missing: Optional[str] = None
    also_missing: Tuple[str, ...] = ()
    error: str = ""
    command: Tuple[str, ...] = ()


_INCLUDE = re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.M)
# The CUDA side of csrc/: CUDA's own headers (libcu++, CUB, Thrust too), NCCL, and torch's CUDA
# headers (which include CUDA's).
_CUDA_SIDE = re.compile(r"^(cuda.+|nv/.+|cub/.+|thrust/.+|nccl\.h|c10/cuda/.+|ATen/cuda/.+)$")


def cuda_side_includes(source_dir: str) -> List[str]:
    """The ``#include <...>`` headers of the C++ sources and headers under ``source_dir`` that
    need CUDA (``<cuda*>``, ``<nv/...>``, ``<cub/...>``, ``<thrust/...>``, ``<nccl.h>``,
    ``<c10/cuda/...>``, ``<ATen/cuda/...>``), each once,
    in the order the files (sorted by path) include them."""
    paths = sorted(os.path.join(dirpath, name) for dirpath, _, names in os.walk(source_dir)
                   for name in names if name.endswith((".cpp", ".cc", ".h", ".hpp", ".cuh")))
    found: List[str] = []
    for path in paths:
        with open(path, errors="replace") as f:
            found += [h for h in _INCLUDE.findall(f.read()) if _CUDA_SIDE.match(h)]
    return list(dict.fromkeys(found))


def missing_header(output: str) -> Optional[str]:
    """The first header a GCC or Clang run could not find, from its output (GCC: ``fatal error:
    nv/target: No such file or directory``; Clang: ``fatal error: 'nv/target' file not found``),
    or None."""
    m = re.search(r"fatal error: (?:'([^']+)' file not found|(\S+?): No such file or directory)",
                  output)
    return (m.group(1) or m.group(2)) if m else None


def missing_in_dependencies(rule: str) -> List[str]:
    """The headers a ``-M -MG`` dependency scan could not find: with absolute include dirs and an
    absolute source, every found file is an absolute path, and a missing one stays as it was
    written in ``#include``. ``rule`` is the make rule the scan printed."""
    body = rule.split(":", 1)[1] if ":" in rule else rule
    body = body.replace("\\\n", " ").replace("\\ ", "\0")
    return list(dict.fromkeys(t.replace("\0", " ") for t in body.split()
                              if t != "\\" and not os.path.isabs(t)))


def first_error(output: str) -> str:
    """The first line of compiler ``output`` that reports an error (else its first line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror:", line):
            return line
    return lines[0] if lines else ""


def wheel_for_header(header: str, torch_cuda: str) -> Optional[str]:
    """The pip requirement, pinned to torch's CUDA version, of the nvidia-* wheel that ships
    ``header`` when torch's CUDA wheel does not install it, or None (a CUDA toolkit has it).

    CUDA's C runtime headers (``crt/``) are nvidia-cuda-crt for CUDA 13 (nvidia-cuda-nvcc-cu12
    before); libcu++, CUB and Thrust (``nv/``, ``cuda/``, ``cub/``, ``thrust/``) are
    nvidia-cuda-cccl (-cu12)."""
    major = _major(torch_cuda)
    if not major:
        return None
    if header.startswith("crt/"):
        name = "nvidia-cuda-crt" if int(major) >= 13 else f"nvidia-cuda-nvcc-cu{major}"
    elif header.startswith(("nv/", "cuda/", "cub/", "thrust/")):
        name = "nvidia-cuda-cccl" if int(major) >= 13 else f"nvidia-cuda-cccl-cu{major}"
    else:
        return None
    return f"{name}=={torch_cuda}.*"


def probe_source(headers: Sequence[str]) -> str:
    """A translation unit that includes ``headers`` and nothing else."""
    return "".join(f"#include <{h}>\n" for h in headers)


def probe_headers(compiler: str, headers: Sequence[str], include_dirs: Sequence[str],
                  flags: Sequence[str] = (), timeout: float = 120.0) -> HeaderProbe:
    """Compile (``-fsyntax-only``) a translation unit including ``headers`` with ``compiler``
    (a command line, as CXX holds it), ``include_dirs`` and ``flags``. On a missing header, a
    dependency scan (``-E -M -MG``, which goes on past missing headers) lists the others the
    sources reach, so one message can name every wheel to install."""
    includes = [f"-I{os.path.abspath(d)}" for d in include_dirs]
    env = {**os.environ, "LC_ALL": "C"}  # the messages parsed here, untranslated
    with tempfile.TemporaryDirectory(prefix="dsz_cuda_probe_") as tmp:
        source = os.path.join(tmp, "cuda_probe.cpp")
        with open(source, "w") as f:
            f.write(probe_source(headers))
        command = [*shlex.split(compiler), "-fsyntax-only", *flags, *includes, source]
        try:
            r = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                               env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            return HeaderProbe(False, error=f"{type(e).__name__}: {e}", command=tuple(command))
        output = r.stderr + r.stdout
        if r.returncode == 0:
            return HeaderProbe(True, command=tuple(command))
        missing = missing_header(output)
        if missing is None:
            return HeaderProbe(False, error=first_error(output), command=tuple(command))
        scan = [*shlex.split(compiler), "-E", "-M", "-MG", *flags, *includes, source]
        try:
            deps = subprocess.run(scan, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                                  env=env)
            others = missing_in_dependencies(deps.stdout) if deps.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            others = []
        return HeaderProbe(False, missing=missing,
                           also_missing=tuple(h for h in others if h != missing),
                           command=tuple(command))


def _probe_failure(probe: HeaderProbe, runtime: CudaRuntime, torch_cuda: str
                   ) -> Tuple[str, str, str]:
    """(cpu_reason, why, how to fix) for a failed header probe, each part of one line."""
    where = f"the CUDA headers of the {runtime.kind} at {runtime.root}"
    if probe.missing is None:
        compiler = probe.command[0] if probe.command else "the compiler"
        return ("cuda-headers-unusable",
                f"{where} do not compile with {compiler}: {probe.error}",
                "set CXX to a compiler this CUDA supports or CUDA_HOME to a CUDA toolkit")
    headers = [probe.missing, *probe.also_missing]
    wheels = {h: wheel_for_header(h, torch_cuda) for h in headers}

    def shipped(header: str) -> str:
        wheel = wheels[header]
        return (f"{header} (the {wheel.split('==')[0]} wheel)" if wheel
                else f"{header} (a CUDA toolkit has it)")

    why = f"{where} lack {shipped(probe.missing)}"
    if probe.also_missing:
        why += f"; also missing: {', '.join(shipped(h) for h in probe.also_missing)}"
    if runtime.kind == "wheels" and all(wheels.values()):
        why += "; torch's wheel does not install these"
    specs = list(dict.fromkeys(w for w in wheels.values() if w))
    if specs and all(wheels.values()):
        fix = f"for the CUDA flavour `pip install {' '.join(repr(w) for w in specs)}`"
    else:
        fix = ("for the CUDA flavour set CUDA_HOME to a CUDA toolkit with these headers"
               + (f" or `pip install {' '.join(repr(w) for w in specs)}`" if specs else ""))
    return "cuda-headers-incomplete", why, fix + ", then reinstall ds_z3native"


def _cuda_hint(torch_cuda: str) -> str:
    major = _major(torch_cuda)
    if major and int(major) >= 13:
        wheels = (f"'nvidia-cuda-runtime=={torch_cuda}.*' 'nvidia-cuda-crt=={torch_cuda}.*' "
                  f"'nvidia-cuda-cccl=={torch_cuda}.*' nvidia-nccl-cu{major}")
    else:
        wheels = f"nvidia-cuda-runtime-cu{major} nvidia-nccl-cu{major}"
    return (f"for the CUDA flavour `pip install {wheels}` (what torch's CUDA wheel from PyPI "
            "installs) or set CUDA_HOME to a CUDA toolkit with include/cuda_runtime_api.h, "
            "then reinstall ds_z3native")


def plan_build(torch_version: str, torch_cuda: Optional[str], environ: Mapping[str, str],
               site_dirs: Sequence[str], root: str = "/",
               probe: Optional[Callable[[CudaRuntime, Nccl], HeaderProbe]] = None) -> BuildPlan:
    """Which flavour to build for a torch ``torch_version`` built with CUDA ``torch_cuda``
    (None: a CPU torch), honouring ``DS_Z3NATIVE_CUDA=0|1`` in ``environ``.

    ``probe`` (setup.py: :func:`probe_headers` with the build's compiler and include path) is
    called with the runtime and NCCL found, only then; when it fails the build is CPU.

    Raises DiscoveryError for a DS_Z3NATIVE_CUDA value other than 0 or 1, and for
    DS_Z3NATIVE_CUDA=1 when the CUDA flavour cannot be built here."""
    flag = environ.get("DS_Z3NATIVE_CUDA")
    if flag is not None and flag not in ("0", "1"):
        raise DiscoveryError(f"DS_Z3NATIVE_CUDA must be 0 or 1, got {flag!r}")
    prefix = "ds_z3native: building the CPU flavour"
    if not torch_cuda:
        if flag == "1":
            raise DiscoveryError(f"DS_Z3NATIVE_CUDA=1, but torch {torch_version} is a CPU build "
                                 "(torch.version.cuda is None): install a CUDA build of torch")
        return BuildPlan("cpu", cpu_reason="cpu-torch",
                         message=f"{prefix} (gloo collectives): torch {torch_version} is a CPU "
                                 "build; install a CUDA build of torch for the CUDA flavour")
    if flag == "0":
        return BuildPlan("cpu", cpu_reason="forced", warning=True,
                         message=f"{prefix}, although torch {torch_version} has CUDA "
                                 f"{torch_cuda}: DS_Z3NATIVE_CUDA=0 was set; NCCL process groups "
                                 "will be refused at init()")
    runtime, checked = find_toolkit(environ, torch_cuda, root)
    if runtime is None:
        runtime, more = find_wheel_runtime(site_dirs, torch_cuda)
        checked += more
    seen = "; ".join(checked) or "no candidate"
    if runtime is None:
        why = (f"torch {torch_version} has CUDA {torch_cuda}, but no CUDA runtime headers were "
               f"found (checked: {seen})")
        if flag == "1":
            raise DiscoveryError(f"DS_Z3NATIVE_CUDA=1, but {why}; {_cuda_hint(torch_cuda)}")
        return BuildPlan("cpu", cpu_reason="no-cuda-runtime", warning=True, checked=checked,
                         message=f"{prefix}: {why}; NCCL process groups will be refused at "
                                 f"init(); {_cuda_hint(torch_cuda)}")
    nccl = find_nccl(environ, site_dirs, runtime, torch_cuda, root)
    if nccl is None:
        why = (f"torch {torch_version} has CUDA {torch_cuda} and the CUDA runtime is at "
               f"{runtime.root}, but no NCCL (nccl.h and libnccl.so*) was found in NCCL_HOME, "
               "the nvidia-nccl wheel, the CUDA root, /usr or /usr/local")
        if flag == "1":
            raise DiscoveryError(f"DS_Z3NATIVE_CUDA=1, but {why}; set NCCL_HOME")
        return BuildPlan("cpu", runtime=runtime, cpu_reason="no-nccl", warning=True,
                         checked=checked,
                         message=f"{prefix}: {why}; NCCL process groups will be refused at "
                                 f"init(); set NCCL_HOME or {_cuda_hint(torch_cuda)}")
    verdict = probe(runtime, nccl) if probe is not None else HeaderProbe(True)
    if not verdict.ok:
        reason, why, fix = _probe_failure(verdict, runtime, torch_cuda)
        why = f"torch {torch_version} has CUDA {torch_cuda}, but {why}"
        if flag == "1":
            raise DiscoveryError(f"DS_Z3NATIVE_CUDA=1, but {why}; {fix}")
        return BuildPlan("cpu", runtime=runtime, nccl=nccl, cpu_reason=reason, warning=True,
                         checked=checked,
                         message=f"{prefix}: {why}; NCCL process groups will be refused at "
                                 f"init(); {fix}")
    return BuildPlan("cuda", runtime=runtime, nccl=nccl, checked=checked,
                     message=f"ds_z3native: building the CUDA flavour against the CUDA "
                             f"{runtime.version or '?'} runtime of the {runtime.kind} at "
                             f"{runtime.root} and NCCL at {nccl.library_dir}")
