"""The build's CUDA discovery (build_support/cuda_discovery.py) on fake machine layouts.

Each layout is built under a temporary root as the real thing lays out its files: a CUDA toolkit
(include/cuda_runtime_api.h, lib64/libcudart.so), an nvcc wrapper script in a bin directory
outside any toolkit, the nvidia-* wheels torch's CUDA wheel installs into site-packages (CUDA 12's
nvidia/cuda_runtime + nvidia/nccl, CUDA 13's combined nvidia/cu13), and nothing at all.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

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


def _cu13_wheels(site: Path, crt: bool = True) -> Path:
    """CUDA 13's layout: the runtime in nvidia/cu13, only versioned libraries; the C runtime
    headers (crt/) come from the nvidia-cuda-crt wheel, into the same directory."""
    _touch(site / "nvidia" / "cu13" / "include" / "cuda_runtime_api.h", _header(13000))
    if crt:
        _touch(site / "nvidia" / "cu13" / "include" / "crt" / "host_defines.h")
    _touch(site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    _touch(site / "nvidia" / "cu13" / "lib" / "libcudart_static.a")
    _touch(site / "nvidia" / "nccl" / "include" / "nccl.h")
    _touch(site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    return site


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
    assert ("pip install 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' nvidia-nccl-cu13"
            in plan.message)
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


def test_cuda13_wheels_without_the_c_runtime_headers_build_cpu_and_say_which_wheel(
        tmp_path: Path) -> None:
    # torch 2.11+cu130's wheels as installed on a GPU machine: nvidia/cu13 has cuda_runtime_api.h
    # but not crt/host_defines.h, which it includes (the CUDA build failed there).
    site = _cu13_wheels(tmp_path / "site", crt=False)
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path))
    assert plan.flavour == "cpu" and plan.warning and plan.cpu_reason == "no-cuda-runtime"
    assert "no include/crt/host_defines.h" in plan.message
    assert "'nvidia-cuda-crt==13.0.*'" in plan.message
    _touch(site / "nvidia" / "cu13" / "include" / "crt" / "host_defines.h")
    plan = cd.plan_build("2.11.0+cu130", "13.0", _env(), [str(site)], root=str(tmp_path))
    assert plan.flavour == "cuda" and plan.runtime.kind == "wheels"
