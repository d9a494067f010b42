"""Build of ds_z3native: the native extension ds_z3native._C plus the Python package.

The flavour is chosen here, once, at install time (never at run time), by
build_support/cuda_discovery.py:
  * CUDA (NCCL collectives, CUDA streams) when torch was built with CUDA and the CUDA runtime's
    headers and NCCL are found: a CUDA toolkit whose include/cuda_runtime_api.h is really there,
    else the nvidia-* wheels torch's CUDA wheel installed (the sources are C++ only: no nvcc),
    and the CUDA-side includes of csrc/ compile with them (a probe run with the build's compiler
    and flags: the wheels torch installs lack some headers those include),
  * CPU (c10d/gloo collectives, host streams) otherwise, with one line saying why.
DS_Z3NATIVE_CUDA=0|1 overrides the choice; NCCL_HOME names NCCL; DEBUG=1 builds with -O0 -g.
Build against the torch you run with:  pip install --no-build-isolation -v -e .
"""

import glob
import os
import re
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:  # pragma: no cover - a build-time message
    sys.exit(f"ds_z3native builds against the torch of the interpreter running the build "
             f"({sys.executable}), which cannot import it ({e}): install torch there first, then "
             "run `python -m pip install --no-build-isolation -e .` with that interpreter")

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
# The package root is an include dir too: csrc/ops includes the dc op list the package ships
# (#include "ds_z3native/dc_ops.def"), the one source of the ops for C++ and Python.
PACKAGE_ROOT = os.path.join(HERE, "python")


def package_version():
    """__version__ of python/ds_z3native/_version.py, the one place it is written, read as text:
    the build does not import the package it builds."""
    path = os.path.join(PACKAGE_ROOT, "ds_z3native", "_version.py")
    with open(path) as f:
        m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    if not m:
        sys.exit(f"no __version__ = \"...\" line in {path}")
    return m.group(1)


def _load_cuda_discovery():
    """build_support/cuda_discovery.py, imported by path (it is not part of the package)."""
    import importlib.util

    path = os.path.join(HERE, "build_support", "cuda_discovery.py")
    spec = importlib.util.spec_from_file_location("_dsz_cuda_discovery", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def site_dirs():
    """Where pip put torch's nvidia-* wheels: beside torch first, then every sys.path entry."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))]
    dirs += [p for p in sys.path if p and os.path.isdir(p)]
    return list(dict.fromkeys(dirs))


# The extension's own C++ flags (the header probe compiles with them too).
CXX_FLAGS = (["-O0", "-g"] if os.environ.get("DEBUG") == "1" else ["-O2", "-DNDEBUG"]) + [
    "-Wall", "-Wno-unused-parameter"]


def cxx_std_flag():
    """The -std flag BuildExtension adds to C++ compiles that name none (c++17 in older torch,
    c++20 in newer); read from its source, since torch exposes it nowhere else."""
    import inspect

    try:
        source = inspect.getsource(cpp_extension.BuildExtension.build_extensions)
    except (OSError, TypeError):
        source = ""
    m = re.search(r"'(c\+\+\d\d)'", source)
    return f"-std={m.group(1) if m else 'c++17'}"


def cuda_include_dirs(runtime, nccl):
    """The extension's include dirs for the CUDA flavour: csrc/, the package root (the op list),
    the CUDA runtime's (with CCCL), NCCL's."""
    return list(dict.fromkeys([CSRC, PACKAGE_ROOT, *runtime.include_dirs, nccl.include_dir]))


def probe_cuda_headers(discovery, runtime, nccl):
    """Compile the CUDA-side includes of csrc/ as the build would (compiler, -std, macros,
    include path), with -fsyntax-only: a second or two instead of a build that fails minutes in
    on a header the CUDA runtime found lacks."""
    compiler = (cpp_extension.get_cxx_compiler() if hasattr(cpp_extension, "get_cxx_compiler")
                else os.environ.get("CXX", "c++"))
    flags = [cxx_std_flag(), "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DDSZ_WITH_CUDA",
             *CXX_FLAGS]
    # What CppExtension and build_ext add after ours: torch's include dirs (include_paths() with
    # no argument: include_paths("cuda"), include_paths(True) before torch 2.9, would add torch's
    # guessed CUDA_HOME, or fail where there is none) and Python's.
    include_dirs = [*cuda_include_dirs(runtime, nccl), *cpp_extension.include_paths(),
                    sysconfig.get_paths()["include"]]
    return discovery.probe_headers(compiler, discovery.cuda_side_includes(CSRC), include_dirs,
                                   flags)


def build_plan():
    discovery = _load_cuda_discovery()
    try:
        return discovery.plan_build(
            torch.__version__, torch.version.cuda, os.environ, site_dirs(),
            probe=lambda runtime, nccl: probe_cuda_headers(discovery, runtime, nccl))
    except discovery.DiscoveryError as e:
        sys.exit(str(e))


PLAN = build_plan()


def shared_libstdcxx_args():
    """Link the libstdc++ the interpreter (and torch) already loaded, as a shared library.

    Some toolchains (a `g++` wrapper with its own -B search path, seen on a CUDA machine) resolve
    -lstdc++ to a static archive. A static copy inside _C then formats numbers with its own
    locale facets on streams built by the shared copy, and crashes (seen: every error message
    with a number segfaulted). Naming the shared object first leaves nothing for the archive.
    """
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libstdc++.so" in line}
    except OSError:
        return []
    for path in sorted(paths):
        if os.path.exists(path):
            return [f"-L{os.path.dirname(path)}", f"-l:{os.path.basename(path)}"]
    return []


class BuildExt(cpp_extension.BuildExtension):
    """BuildExtension that says which flavour it builds and why (pip shows it with -v), and
    refuses an extension carrying its own (static) copy of libstdc++."""

    def build_extensions(self):
        if PLAN.warning:
            print(f"WARNING: {PLAN.message}", file=sys.stderr, flush=True)
        else:
            print(PLAN.message, file=sys.stderr, flush=True)
        print(f"ds_z3native: building ds_z3native._C ({PLAN.flavour.upper()} flavour, "
              f"{os.environ.get('MAX_JOBS')} jobs); this takes a few minutes (2 to 6 on 2 cores)",
              file=sys.stderr, flush=True)
        super().build_extensions()

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        try:
            out = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            self.warn("nm not available: cannot check the extension for a static libstdc++")
            return
        if "_ZNSt6locale7classicEv" in out:
            sys.exit(f"{path} contains a static copy of libstdc++ (std::locale::classic is defined "
                     "inside it): the compiler linked libstdc++.a. Point CXX at a compiler that links "
                     "the shared libstdc++ torch uses.")


def extension():
    cuda = PLAN.flavour == "cuda"
    sources = sorted(
        glob.glob(os.path.join("csrc", "core", "*.cpp"))
        + ["csrc/comm/c10d_collectives.cpp", "csrc/device/host_device.cpp", "csrc/runtime.cpp",
           "csrc/backends.cpp", "csrc/bindings.cpp", "csrc/ops/schema.cpp", "csrc/ops/kernels.cpp",
           "csrc/ops/register_cpu.cpp", "csrc/ops/register_meta.cpp",
           "csrc/ops/group_ops.cpp"])
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
    # Macro values travel unquoted through ninja's command lines: no spaces in them.
    macros = [
        ("DSZ_TORCH_VERSION", f'"{torch.__version__}"'),
        ("DSZ_ARCH_LIST", f'"{arch_list}"'),
        ("DSZ_CUDA_SOURCE", f'"{PLAN.runtime.kind if cuda else ""}"'),
        ("DSZ_CPU_REASON", f'"{PLAN.cpu_reason}"'),
    ]
    kwargs = dict(include_dirs=[CSRC, PACKAGE_ROOT], extra_compile_args={"cxx": list(CXX_FLAGS)},
                  extra_link_args=shared_libstdcxx_args())
    if not cuda:
        return cpp_extension.CppExtension("ds_z3native._C", sources, define_macros=macros, **kwargs)
    # CppExtension with the runtime and NCCL named explicitly: what CUDAExtension adds for C++
    # sources (CUDA include/lib dirs, cudart, c10_cuda, torch_cuda), but from the verified
    # toolkit or the wheels instead of torch's guessed CUDA_HOME, and without nvcc.
    runtime, nccl = PLAN.runtime, PLAN.nccl
    sources += ["csrc/comm/nccl_collectives.cpp", "csrc/device/cuda_device.cpp",
                "csrc/ops/register_cuda.cpp"]
    macros.append(("DSZ_WITH_CUDA", None))
    kwargs["include_dirs"] = cuda_include_dirs(runtime, nccl)
    libdirs = list(dict.fromkeys([runtime.library_dir, nccl.library_dir]))
    kwargs["extra_link_args"] += [f"-l:{runtime.library}", f"-l:{nccl.library}"]
    kwargs["extra_link_args"] += [f"-Wl,-rpath,{d}" for d in libdirs]
    return cpp_extension.CppExtension(
        "ds_z3native._C", sources, define_macros=macros, library_dirs=libdirs,
        libraries=["c10_cuda", "torch_cuda"], **kwargs)


def autoload_pth():
    """(file name, line) of the start-up hook, as python/ds_z3native_autoload.py defines them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_dsz_autoload", os.path.join(HERE, "python", "ds_z3native_autoload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PTH_NAME, module.PTH_LINE


class build_py_with_autoload(build_py):
    """build_py that also puts ds_z3native_autoload.pth at the top of site-packages, where the
    interpreter runs it at start-up (DS_Z3NATIVE=1 then hooks `import deepspeed`).

    A wheel gets it at its root (pip installs it into site-packages and records it, so uninstall
    removes it). An editable install (PEP 660) ignores build_lib, so there it is written to the
    root of the editable wheel, which setuptools' editable_wheel exposes as install.install_lib.
    """

    def run(self):
        super().run()
        name, line = autoload_pth()
        target = self._pth_dir()
        self.mkpath(target)
        with open(os.path.join(target, name), "w") as f:
            f.write(line)

    def _pth_dir(self):
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, autoload_pth()[0]))
        return outputs


os.environ.setdefault("MAX_JOBS", str(max(1, os.cpu_count() or 1)))

setup(
    name="ds_z3native",
    version=package_version(),
    description="DeepSpeed ZeRO-3 for models with frozen parameters: a hardened, prebuilt "
                "DeepCompile native op and version-gated fixes",
    license="Apache-2.0",
    license_files=["LICENSE"],
    package_dir={"": "python"},
    packages=find_packages("python"),
    py_modules=["ds_z3native_autoload"],
    # The dc op list (read by ds_z3native.dc_ops; the C++ sources include it) and the fingerprints
    # of the code the patches wrap, per DeepSpeed release (compat/fingerprints.py).
    package_data={"ds_z3native": ["dc_ops.def"], "ds_z3native.compat": ["fingerprints.json"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt, "build_py": build_py_with_autoload},
    python_requires=">=3.9",
    install_requires=["torch>=2.6", "packaging"],
    extras_require={
        # scipy: DeepCompile's prefetch pass interpolates its all-gather profile with it.
        # accelerate and trl: the trainer tests drive HF Trainer and TRL's SFTTrainer.
        # bitsandbytes: the QLoRA tests (its wheels: Linux x86_64, Python 3.10+).
        "test": ["pytest>=7", "pytest-xdist>=3", "expecttest", "deepspeed>=0.19.0,<0.20", "scipy>=1.7",
                 "accelerate>=1.0", "trl>=0.20",
                 "bitsandbytes>=0.50.2; platform_system == 'Linux' and platform_machine == 'x86_64'"
                 " and python_version >= '3.10'"],
        "demo": ["deepspeed>=0.19.0,<0.20", "transformers>=4.45", "peft>=0.12", "tqdm>=4.60",
                 "scipy>=1.7"],
        "bench": ["deepspeed>=0.19.0,<0.20", "transformers>=4.45", "peft>=0.12",
                  "matplotlib>=3.5", "scipy>=1.7"],
        # examples/sft_lora.py: HF Trainer and accelerate, TRL's SFTTrainer (--trainer trl) on a
        # datasets.Dataset, bitsandbytes for --qlora.
        "examples": ["deepspeed>=0.19.0,<0.20", "transformers>=4.45", "peft>=0.12", "scipy>=1.7",
                     "accelerate>=1.0", "trl>=0.20", "datasets>=3.0",
                     "bitsandbytes>=0.50.2; platform_system == 'Linux' and platform_machine == "
                     "'x86_64' and python_version >= '3.10'"],
    },
    entry_points={"console_scripts": ["ds-z3native=ds_z3native.cli:main"]},
    zip_safe=False,
)
