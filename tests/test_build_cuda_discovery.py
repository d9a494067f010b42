"""The build's CUDA discovery (build_support/cuda_discovery.py) on fake machine layouts.

Each layout is built under a temporary root as the real thing lays out its files: a CUDA toolkit
(include/cuda_runtime_api.h, lib64/libcudart.so), an nvcc wrapper script in a bin directory
outside any toolkit, the nvidia-* wheels torch's CUDA wheel installs into site-packages (CUDA 12's
nvidia/cuda_runtime + nvidia/nccl, CUDA 13's combined nvidia/cu13), and nothing at all.

The header probe runs this machine's C++ compiler on fake CUDA headers that include what the real
ones do (cuda_runtime_api.h: crt/host_defines.h; cuda_fp16.h: nv/target) where the wheels lay
those out (nvidia-cuda-crt: nvidia/cu13/include/crt, nvidia-cuda-cccl: nvidia/cu13/include/cccl).
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "dsz_cuda_discovery_under_test", ROOT / "build_support" / "cuda_discovery.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cd = _load()


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _header(cudart: int) -> str:
    return f"#pragma once\n#define CUDART_VERSION {cudart}\n"


def _toolkit(root: Path, cudart: int = 13000, lib: str = "lib64") -> Path:
    _touch(root / "include" / "cuda_runtime_api.h", _header(cudart))
    _touch(root / "include" / "crt" / "host_defines.h")
    _touch(root / lib / "libcudart.so")
    _touch(root / lib / f"libcudart.so.{cudart // 1000}")
    nvcc = _touch(root / "bin" / "nvcc", "#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return root


def _wrapper_nvcc(bin_dir: Path, target: str) -> Path:
    """An executable script named nvcc that hands over to another nvcc (a common packaging)."""
    nvcc = _touch(bin_dir / "nvcc", f'#!/bin/sh\nexec {target} "$@"\n')
    nvcc.chmod(0o755)
    return nvcc


def _cu12_wheels(site: Path) -> Path:
    _touch(site / "nvidia" / "cuda_runtime" / "include" / "cuda_runtime_api.h", _header(12080))
    _touch(site / "nvidia" / "cuda_runtime" / "include" / "crt" / "host_defines.h")
    _touch(site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12")
    _touch(site / "nvidia" / "nccl" / "include" / "nccl.h")
    _touch(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    return site


def _cu13_wheels(site: Path, crt: bool = True, cccl: bool = True) -> Path:
    """CUDA 13's layout: the runtime in nvidia/cu13, only versioned libraries; the C runtime
    headers (crt/) come from the nvidia-cuda-crt wheel, into the same include directory, libcu++
    (nv/target) from nvidia-cuda-cccl, into include/cccl. The headers include what the real ones
    include on the way to a failure seen with torch 2.11+cu130's wheels."""
    inc = site / "nvidia" / "cu13" / "include"
    _touch(inc / "cuda_runtime_api.h", _header(13000) + '#include "crt/host_defines.h"\n')
    _touch(inc / "cuda_fp16.h", "#pragma once\n#include <nv/target>\n")
    if crt:
        _touch(inc / "crt" / "host_defines.h", "#pragma once\n")
    if cccl:
        _touch(inc / "cccl" / "nv" / "target", "#pragma once\n")
    _touch(site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    _touch(site / "nvidia" / "cu13" / "lib" / "libcudart_static.a")
    _touch(site / "nvidia" / "nccl" / "include" / "nccl.h", "#pragma once\n")
    _touch(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    return site


CXX = os.environ.get("CXX", "c++")
# What the fake layouts' headers stand for: the runtime, the half type that reaches libcu++, NCCL.
PROBED = ["cuda_runtime_api.h", "cuda_fp16.h", "nccl.h"]


def _probe(runtime: cd.CudaRuntime, nccl: cd.Nccl) -> cd.HeaderProbe:
    """The header probe with this machine's compiler over the found runtime's and NCCL's
    include dirs (setup.py adds torch's and its flags)."""
    return cd.probe_headers(CXX, PROBED, [*runtime.include_dirs, nccl.include_dir])


def _env(**kw: str) -> Dict[str, str]:
    return {"PATH": "/nonexistent-bin", **kw}


def test_a_real_looking_toolkit_is_used_with_its_headers_and_libcudart(tmp_path: Path) -> None:
    tk = _toolkit(tmp_path / "cuda-13.0")
    _touch(tk / "include" / "nccl.h")
    _touch(tk / "lib64" / "libnccl.so.2")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(CUDA_HOME=str(tk)), [], root=str(tmp_path))
    assert plan.flavour == "cuda" and not plan.warning, plan
    assert plan.runtime.kind == "toolkit" and plan.runtime.root == str(tk)
    assert plan.runtime.include_dir == str(tk / "include")
    assert plan.runtime.library_dir == str(tk / "lib64")
    assert plan.runtime.library == "libcudart.so" and plan.runtime.version == "13.0"
    assert plan.nccl == cd.Nccl(str(tk / "include"), str(tk / "lib64"), "libnccl.so.2")
    assert "CUDA flavour" in plan.message and str(tk) in plan.message


def test_the_default_toolkit_location_is_found_without_cuda_home(tmp_path: Path) -> None:
    tk = _toolkit(tmp_path / "usr" / "local" / "cuda", lib="lib")
    site = _cu13_wheels(tmp_path / "site")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(), [str(site)], root=str(tmp_path))
    assert plan.flavour == "cuda", plan
    assert (plan.runtime.kind, plan.runtime.root, plan.runtime.library_dir) == \
        ("toolkit", str(tk), str(tk / "lib"))
    assert plan.nccl.library_dir == str(site / "nvidia" / "nccl" / "lib")


def test_a_wrapper_nvcc_outside_the_toolkit_does_not_fool_it(tmp_path: Path) -> None:
    """nvcc on PATH is a script in <prefix>/bin that runs the real one; torch would take
    <prefix> as CUDA_HOME. Its include/ has no cuda_runtime_api.h, so it is passed over (and
    said so), and the real toolkit at the default location is used."""
    tk = _toolkit(tmp_path / "usr" / "local" / "cuda")
    prefix = tmp_path / "opt" / "tools"
    _wrapper_nvcc(prefix / "bin", str(tk / "bin" / "nvcc"))
    (prefix / "include").mkdir()  # a bin/include pair, as /usr/local has
    site = _cu13_wheels(tmp_path / "site")
    env = _env(PATH=str(prefix / "bin"))
    assert cd.toolkit_candidates(env, str(tmp_path))[0] == str(prefix)
    plan = cd.plan_build("2.14.1+cu130", "13.0", env, [str(site)], root=str(tmp_path))
    assert plan.flavour == "cuda", plan
    assert plan.runtime.root == str(tk)
    assert f"{prefix}: no include/cuda_runtime_api.h" in plan.checked


def test_a_wrapper_nvcc_and_no_toolkit_builds_from_the_wheels(tmp_path: Path) -> None:
    prefix = tmp_path / "opt" / "tools"
    _wrapper_nvcc(prefix / "bin", "/somewhere/else/nvcc")
    site = _cu13_wheels(tmp_path / "site")
    plan = cd.plan_build("2.15.0+cu132", "13.2", _env(PATH=str(prefix / "bin")), [str(site)],
                         root=str(tmp_path))
    assert plan.flavour == "cuda", plan
    assert plan.runtime.kind == "wheels"
    assert plan.runtime.include_dir == str(site / "nvidia" / "cu13" / "include")
    assert plan.runtime.library == "libcudart.so.13"  # not the static archive beside it


def test_cuda_home_naming_a_directory_without_headers_falls_back_to_the_wheels(
        tmp_path: Path) -> None:
    """CUDA_HOME set by hand is the only toolkit considered (the default location is not
    tried behind the user's back); without headers there, the wheels are used."""
    _toolkit(tmp_path / "usr" / "local" / "cuda")
    site = _cu13_wheels(tmp_path / "site")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(CUDA_HOME="/nonexistent"), [str(site)],
                         root=str(tmp_path))
    assert plan.flavour == "cuda" and plan.runtime.kind == "wheels", plan
    assert plan.checked == ["/nonexistent: no include/cuda_runtime_api.h"]


def test_wheels_only_cuda12_layout(tmp_path: Path) -> None:
    site = _cu12_wheels(tmp_path / "site")
    plan = cd.plan_build("2.8.0+cu128", "12.8", _env(), [str(tmp_path / "empty"), str(site)],
                         root=str(tmp_path))
    assert plan.flavour == "cuda", plan
    rt = plan.runtime
    assert (rt.kind, rt.root, rt.library, rt.version) == \
        ("wheels", str(site / "nvidia" / "cuda_runtime"), "libcudart.so.12", "12.8")
    assert plan.nccl == cd.Nccl(str(site / "nvidia" / "nccl" / "include"),
                                str(site / "nvidia" / "nccl" / "lib"), "libnccl.so.2")


def test_a_toolkit_of_another_cuda_major_is_passed_over_for_matching_wheels(
        tmp_path: Path) -> None:
    """A CUDA 13 toolkit with a cu12 torch would link a second libcudart into the process."""
    tk = _toolkit(tmp_path / "usr" / "local" / "cuda", cudart=13000)
    site = _cu12_wheels(tmp_path / "site")
    plan = cd.plan_build("2.8.0+cu128", "12.8", _env(), [str(site)], root=str(tmp_path))
    assert plan.flavour == "cuda" and plan.runtime.kind == "wheels", plan
    assert f"{tk}: CUDA 13.0, but torch is built with CUDA 12.8" in plan.checked


def test_neither_toolkit_nor_wheels_builds_cpu_with_one_line_saying_why_and_how(
        tmp_path: Path) -> None:
    prefix = tmp_path / "opt" / "tools"
    _wrapper_nvcc(prefix / "bin", "/somewhere/else/nvcc")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(PATH=str(prefix / "bin")),
                         [str(tmp_path / "site")], root=str(tmp_path))
    assert plan.flavour == "cpu" and plan.warning and plan.cpu_reason == "no-cuda-runtime"
    assert plan.cpu_reason in cd.CPU_REASONS
    assert "\n" not in plan.message
    assert "torch 2.14.1+cu130 has CUDA 13.0" in plan.message
    assert f"{prefix}: no include/cuda_runtime_api.h" in plan.message
    assert "refused at init()" in plan.message
    assert ("pip install 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' "
            "'nvidia-cuda-cccl==13.0.*' nvidia-nccl-cu13" in plan.message)
    assert "CUDA_HOME" in plan.message


def test_runtime_without_nccl_builds_cpu_and_nccl_home_is_honoured(tmp_path: Path) -> None:
    tk = _toolkit(tmp_path / "usr" / "local" / "cuda")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(), [], root=str(tmp_path))
    assert (plan.flavour, plan.cpu_reason, plan.warning) == ("cpu", "no-nccl", True), plan
    assert "NCCL_HOME" in plan.message and "\n" not in plan.message
    nccl_home = tmp_path / "nccl"
    _touch(nccl_home / "include" / "nccl.h")
    _touch(nccl_home / "lib" / "libnccl.so.2")
    _touch(nccl_home / "lib" / "libnccl.so.2.28.9")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(NCCL_HOME=str(nccl_home)), [],
                         root=str(tmp_path))
    assert plan.flavour == "cuda" and plan.runtime.root == str(tk)
    assert plan.nccl == cd.Nccl(str(nccl_home / "include"), str(nccl_home / "lib"),
                                "libnccl.so.2")


def test_a_cpu_torch_builds_cpu_without_a_warning(tmp_path: Path) -> None:
    _toolkit(tmp_path / "usr" / "local" / "cuda")
    plan = cd.plan_build("2.13.0+cpu", None, _env(), [], root=str(tmp_path))
    assert (plan.flavour, plan.cpu_reason, plan.warning) == ("cpu", "cpu-torch", False)
    assert "torch 2.13.0+cpu is a CPU build" in plan.message


def test_ds_z3native_cuda_overrides(tmp_path: Path) -> None:
    site = _cu13_wheels(tmp_path / "site")
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(DS_Z3NATIVE_CUDA="0"), [str(site)],
                         root=str(tmp_path))
    assert (plan.flavour, plan.cpu_reason, plan.warning) == ("cpu", "forced", True)
    assert "DS_Z3NATIVE_CUDA=0" in plan.message
    plan = cd.plan_build("2.14.1+cu130", "13.0", _env(DS_Z3NATIVE_CUDA="1"), [str(site)],
                         root=str(tmp_path))
    assert plan.flavour == "cuda"
    with pytest.raises(cd.DiscoveryError, match="no CUDA runtime headers were found"):
        cd.plan_build("2.14.1+cu130", "13.0", _env(DS_Z3NATIVE_CUDA="1"), [],
                      root=str(tmp_path))
    with pytest.raises(cd.DiscoveryError, match=r"torch 2\.13\.0\+cpu is a CPU build"):
        cd.plan_build("2.13.0+cpu", None, _env(DS_Z3NATIVE_CUDA="1"), [str(site)],
                      root=str(tmp_path))
    with pytest.raises(cd.DiscoveryError, match="must be 0 or 1, got 'yes'"):
        cd.plan_build("2.13.0+cpu", None, _env(DS_Z3NATIVE_CUDA="yes"), [], root=str(tmp_path))


def test_setup_py_builds_what_the_plan_says_for_this_torch() -> None:
    """setup.py's extension for this machine's torch: the plan's flavour, its build-info macros,
    and, for CUDA, the runtime's and NCCL's directories with torch's CUDA libraries, as C++
    (no nvcc). Run in a fresh interpreter; nothing is compiled."""
    code = (
        "import json, sys, setuptools\n"
        "captured = {}\n"
        "setuptools.setup = lambda **kw: captured.update(kw)\n"
        "sys.argv = ['setup.py', '--name']\n"
        "ns = {'__file__': 'setup.py', '__name__': '__main__'}\n"
        "exec(compile(open('setup.py').read(), 'setup.py', 'exec'), ns)\n"
        "ext = captured['ext_modules'][0]\n"
        "plan = ns['PLAN']\n"
        "print(json.dumps({'flavour': plan.flavour, 'reason': plan.cpu_reason,\n"
        "  'macros': dict(ext.define_macros), 'libraries': ext.libraries,\n"
        "  'include_dirs': ext.include_dirs, 'sources': ext.sources,\n"
        "  'runtime_inc': plan.runtime.include_dir if plan.runtime else None,\n"
        "  'language': ext.language}))\n")
    import json

    import torch

    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["language"] == "c++"
    assert not [s for s in got["sources"] if s.endswith(".cu")]
    if got["flavour"] == "cuda":
        assert "DSZ_WITH_CUDA" in got["macros"]
        assert got["macros"]["DSZ_CUDA_SOURCE"] in ('"toolkit"', '"wheels"')
        assert {"c10_cuda", "torch_cuda"} <= set(got["libraries"])
        assert got["runtime_inc"] in got["include_dirs"]
    else:
        assert "DSZ_WITH_CUDA" not in got["macros"]
        assert got["macros"]["DSZ_CPU_REASON"] == f'"{got["reason"]}"'
        if torch.version.cuda is None:
            assert got["reason"] == "cpu-torch"


def test_the_probed_headers_are_the_cuda_side_includes_of_the_sources(tmp_path: Path) -> None:
    src = tmp_path / "csrc"
    _touch(src / "b.cpp", "#include <torch/extension.h>\n#include <nccl.h>\n"
                          '#include "comm/x.h"\n  #  include <cuda_runtime_api.h>\n')
    _touch(src / "a" / "z.h", "#include <c10/cuda/CUDAStream.h>\n#include <vector>\n"
                              "#include <ATen/cuda/CUDAContext.h>\n#include <nccl.h>\n")
    _touch(src / "a" / "notes.txt", "#include <cuda.h>\n")
    assert cd.cuda_side_includes(str(src)) == [
        "c10/cuda/CUDAStream.h", "ATen/cuda/CUDAContext.h", "nccl.h", "cuda_runtime_api.h"]
    # This checkout's csrc/: what the CUDA flavour's sources include.
    real = cd.cuda_side_includes(str(ROOT / "csrc"))
    assert {"cuda_runtime_api.h", "nccl.h", "c10/cuda/CUDAStream.h",
            "c10/cuda/CUDAGuard.h"} <= set(real), real
    assert not [h for h in real if not h.startswith(("cuda", "nccl", "c10/cuda/", "ATen/cuda/"))]


def test_missing_headers_are_read_from_compiler_output() -> None:
    # The line the wheels-only CUDA build printed with nvidia-cuda-crt installed.
    gcc = ("In file included from /x/nvidia/cu13/include/cuda_fp16.h:4492:\n"
           "/x/nvidia/cu13/include/cuda_fp16.h:4492:10: fatal error: nv/target: No such file or "
           "directory\n 4492 | #include <nv/target>\ncompilation terminated.\n")
    assert cd.missing_header(gcc) == "nv/target"
    assert cd.missing_header("a.h:3:10: fatal error: 'crt/host_config.h' file not found\n") == \
        "crt/host_config.h"
    assert cd.missing_header("a.h:1:2: error: #error unsupported GNU version!\n") is None
    assert cd.first_error("In file included from x.cpp:1:\na.h:1:2: error: #error unsupported "
                          "GNU version!\n") == "a.h:1:2: error: #error unsupported GNU version!"
    rule = ("cuda_probe.o: /tmp/p/cuda_probe.cpp /usr/include/stdc-predef.h \\\n"
            " /s/nvidia/cu13/include/cuda_runtime_api.h crt/host_defines.h \\\n"
            " /s/nvidia/cu13/include/cuda_fp16.h nv/target /opt/with\\ space/nccl.h\n")
    assert cd.missing_in_dependencies(rule) == ["crt/host_defines.h", "nv/target"]


def test_each_missing_header_maps_to_the_wheel_that_ships_it_pinned_to_torchs_cuda() -> None:
    assert cd.wheel_for_header("crt/host_config.h", "13.0") == "nvidia-cuda-crt==13.0.*"
    assert cd.wheel_for_header("nv/target", "13.0") == "nvidia-cuda-cccl==13.0.*"
    assert cd.wheel_for_header("cuda/std/cstdint", "13.2") == "nvidia-cuda-cccl==13.2.*"
    assert cd.wheel_for_header("cub/cub.cuh", "13.0") == "nvidia-cuda-cccl==13.0.*"
    assert cd.wheel_for_header("thrust/device_vector.h", "13.0") == "nvidia-cuda-cccl==13.0.*"
    assert cd.wheel_for_header("nv/target", "12.8") == "nvidia-cuda-cccl-cu12==12.8.*"
    assert cd.wheel_for_header("crt/host_defines.h", "12.8") == "nvidia-cuda-nvcc-cu12==12.8.*"
    assert cd.wheel_for_header("cusparse.h", "13.0") is None  # a CUDA toolkit has it


def test_the_probe_compiles_complete_headers_and_names_the_first_missing_one(
        tmp_path: Path) -> None:
    inc = tmp_path / "include"
    _touch(inc / "cuda_runtime_api.h", '#pragma once\n#include "crt/host_defines.h"\n')
    _touch(tmp_path / "nccl" / "nccl.h", "#pragma once\n")
    dirs = [str(inc), str(tmp_path / "nccl")]
    probe = cd.probe_headers(CXX, ["cuda_runtime_api.h", "nccl.h"], dirs, ["-std=c++17"])
    assert not probe.ok and probe.missing == "crt/host_defines.h" and not probe.also_missing
    assert probe.command[0] == CXX.split()[0] and "-fsyntax-only" in probe.command
    assert f"-I{inc}" in probe.command and "-std=c++17" in probe.command
    _touch(inc / "crt" / "host_defines.h", "#pragma once\n")
    assert cd.probe_headers(CXX, ["cuda_runtime_api.h", "nccl.h"], dirs).ok
    # A header the sources include and nobody ships is as missing as one a header includes.
    probe = cd.probe_headers(CXX, ["cuda_runtime_api.h", "cudnn.h"], dirs)
    assert (probe.ok, probe.missing) == (False, "cudnn.h")
    # Headers that are there but refuse this compiler: not a missing header, the error line.
    _touch(inc / "crt" / "host_config.h", "#error -- unsupported GNU version!\n")
    _touch(inc / "crt" / "host_defines.h", '#pragma once\n#include "crt/host_config.h"\n')
    probe = cd.probe_headers(CXX, ["cuda_runtime_api.h"], dirs)
    assert not probe.ok and probe.missing is None and "unsupported GNU version" in probe.error


def test_cuda13_wheels_without_crt_and_cccl_build_cpu_and_name_both_wheels(
        tmp_path: Path) -> None:
    """torch 2.11+cu130's wheels as installed: cuda_runtime_api.h includes crt/host_defines.h
    (nvidia-cuda-crt) and cuda_fp16.h nv/target (nvidia-cuda-cccl), neither of which torch's wheel
    installs. One line names the runtime, both headers and both wheels, pinned to 13.0."""
    site = _cu13_wheels(tmp_path / "site", crt=False, cccl=False)
    runtime_root = site / "nvidia" / "cu13"
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(CUDA_HOME="/nonexistent"), [str(site)],
                         root=str(tmp_path), probe=_probe)
    assert (plan.flavour, plan.cpu_reason, plan.warning) == \
        ("cpu", "cuda-headers-incomplete", True), plan
    assert plan.cpu_reason in cd.CPU_REASONS and "\n" not in plan.message
    assert (f"the CUDA headers of the wheels at {runtime_root} lack crt/host_defines.h (the "
            "nvidia-cuda-crt wheel); also missing: nv/target (the nvidia-cuda-cccl wheel)"
            in plan.message)
    assert "pip install 'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*'" in plan.message
    assert "refused at init()" in plan.message
    with pytest.raises(cd.DiscoveryError, match=r"DS_Z3NATIVE_CUDA=1, but .* lack "
                                                r"crt/host_defines\.h .*nvidia-cuda-crt==13\.0"):
        cd.plan_build("2.11.0+cu130", "13.0", _env(DS_Z3NATIVE_CUDA="1"), [str(site)],
                      root=str(tmp_path), probe=_probe)

    # After `pip install 'nvidia-cuda-crt==13.0.*'`: what the next build failed on.
    _touch(runtime_root / "include" / "crt" / "host_defines.h", "#pragma once\n")
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path),
                         probe=_probe)
    assert (plan.flavour, plan.cpu_reason) == ("cpu", "cuda-headers-incomplete"), plan
    assert "lack nv/target (the nvidia-cuda-cccl wheel)" in plan.message
    assert "also missing" not in plan.message
    assert "`pip install 'nvidia-cuda-cccl==13.0.*'`" in plan.message

    # After `pip install 'nvidia-cuda-cccl==13.0.*'`: libcu++ in include/cccl, on the include path.
    _touch(runtime_root / "include" / "cccl" / "nv" / "target", "#pragma once\n")
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path),
                         probe=_probe)
    assert plan.flavour == "cuda" and plan.runtime.kind == "wheels", plan
    assert plan.runtime.include_dirs == (str(runtime_root / "include"),
                                         str(runtime_root / "include" / "cccl"))


def test_a_cuda13_toolkits_libcuxx_directory_is_on_the_include_path(tmp_path: Path) -> None:
    """CUDA 13 toolkits keep libcu++ in include/cccl, which nvcc adds by itself and a C++
    compiler does not: without it there, cuda_fp16.h's nv/target is not found."""
    tk = _toolkit(tmp_path / "cuda-13.0")
    _touch(tk / "include" / "cuda_runtime_api.h", _header(13000))
    _touch(tk / "include" / "cuda_fp16.h", "#pragma once\n#include <nv/target>\n")
    _touch(tk / "include" / "nccl.h", "#pragma once\n")
    _touch(tk / "lib64" / "libnccl.so.2")
    env = _env(CUDA_HOME=str(tk))
    plan = cd.plan_build("2.11.0+cu130", "13.0", env, [], root=str(tmp_path), probe=_probe)
    assert (plan.flavour, plan.cpu_reason) == ("cpu", "cuda-headers-incomplete"), plan
    assert (f"the CUDA headers of the toolkit at {tk} lack nv/target (the nvidia-cuda-cccl wheel)"
            in plan.message) and "torch's wheel" not in plan.message
    _touch(tk / "include" / "cccl" / "nv" / "target", "#pragma once\n")
    plan = cd.plan_build("2.11.0+cu130", "13.0", env, [], root=str(tmp_path), probe=_probe)
    assert plan.flavour == "cuda" and plan.runtime.kind == "toolkit", plan
    assert plan.runtime.include_dirs == (str(tk / "include"), str(tk / "include" / "cccl"))


def test_headers_that_do_not_compile_build_cpu_and_say_the_error(tmp_path: Path) -> None:
    site = _cu13_wheels(tmp_path / "site")
    _touch(site / "nvidia" / "cu13" / "include" / "crt" / "host_defines.h",
           "#error -- unsupported GNU version! gcc versions later than 15 are not supported!\n")
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path),
                         probe=_probe)
    assert (plan.flavour, plan.cpu_reason, plan.warning) == \
        ("cpu", "cuda-headers-unusable", True), plan
    assert f"do not compile with {CXX.split()[0]}: " in plan.message
    assert "unsupported GNU version" in plan.message and "\n" not in plan.message


def test_the_probe_runs_only_when_a_cuda_build_is_on_the_table(tmp_path: Path) -> None:
    site = _cu13_wheels(tmp_path / "site")
    calls = []

    def probe(runtime: cd.CudaRuntime, nccl: cd.Nccl) -> cd.HeaderProbe:
        calls.append(runtime.root)
        return _probe(runtime, nccl)

    cd.plan_build("2.13.0+cpu", None, _env(), [str(site)], root=str(tmp_path), probe=probe)
    cd.plan_build("2.11.0+cu130", "13.0", _env(DS_Z3NATIVE_CUDA="0"), [str(site)],
                  root=str(tmp_path), probe=probe)
    cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(tmp_path / "empty")], root=str(tmp_path),
                  probe=probe)
    assert calls == []
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path),
                         probe=probe)
    assert plan.flavour == "cuda" and calls == [str(site / "nvidia" / "cu13")]


def test_setup_py_probes_with_the_builds_compiler_std_and_torch_include_path(
        tmp_path: Path) -> None:
    """setup.py's probe on a CUDA 13 wheel layout lacking crt/ (the runtime given by hand: this
    torch may have no CUDA): its command is the build's compiler with torch's -std and include
    dirs and no guessed CUDA_HOME, over the sources' own includes, and it names the wheel."""
    site = _cu13_wheels(tmp_path / "site", crt=False)
    code = (
        "import json, sys, setuptools\n"
        "setuptools.setup = lambda **kw: None\n"
        "sys.argv = ['setup.py', '--name']\n"
        "ns = {'__file__': 'setup.py', '__name__': '__main__'}\n"
        "exec(compile(open('setup.py').read(), 'setup.py', 'exec'), ns)\n"
        "cd = ns['_load_cuda_discovery']()\n"
        f"rt, _ = cd.runtime_at({str(site / 'nvidia' / 'cu13')!r}, 'wheels')\n"
        f"nccl = cd.find_nccl({{}}, [{str(site)!r}], rt, '13.0', '/nonexistent')\n"
        "probe = ns['probe_cuda_headers'](cd, rt, nccl)\n"
        "import torch.utils.cpp_extension as ce\n"
        "print(json.dumps({'probe': [probe.ok, probe.missing, list(probe.command)],\n"
        "  'torch_inc': ce.include_paths(), 'headers': cd.cuda_side_includes('csrc')}))\n")
    env = {**os.environ, "CUDA_HOME": "/nonexistent"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    ok, missing, command = got["probe"]
    assert (ok, missing) == (False, "crt/host_defines.h"), command
    assert command[0] == CXX.split()[0] and "-fsyntax-only" in command
    assert [f for f in command if f.startswith("-std=c++")], command
    assert "-DDSZ_WITH_CUDA" in command
    assert {f"-I{d}" for d in got["torch_inc"]} <= set(command)
    assert f"-I{site / 'nvidia' / 'cu13' / 'include'}" in command
    assert not [f for f in command if "nonexistent" in f]
    assert Path(command[-1]).name == "cuda_probe.cpp" and "cuda_runtime_api.h" in got["headers"]


def test_the_doctor_knows_every_reason_the_build_can_record() -> None:
    from ds_z3native import doctor

    assert set(doctor._CPU_REASONS) == set(cd.CPU_REASONS)
