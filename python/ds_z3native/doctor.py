"""``ds-z3native doctor``: is this environment covered, and if not, what to do.

One verdict per check (PASS / WARN / FAIL), each WARN and FAIL with the step that fixes it:

* versions: Python, torch, CUDA and NCCL (as torch sees them), DeepSpeed;
* the native extension ``ds_z3native._C``: it loads, its build flavour, the torch it was built
  against (must be the running one);
* ``install()``: would it succeed here (DeepSpeed version gate, DeepSpeed's dc contract read from
  its sources, nobody else owns ``torch.ops.dc``), which patches it applies to this DeepSpeed,
  and, for each target those patches wrap, whether its fingerprint is the one recorded for the
  running release (the table printed under ``patch fingerprints``). Nothing is installed into
  this process;
* zero-code activation: the ``.pth`` start-up file is present and current, ``DS_Z3NATIVE`` is
  set or not, and a fresh interpreter with ``DS_Z3NATIVE=1`` really installs ds_z3native at
  ``import deepspeed``;
* the demo's extra packages (transformers, peft, tqdm);
* the self-test: 2 gloo ranks drive the dc op (gather, reduce, a frozen-param refusal).

The exit code is 1 if any check FAILs, 0 otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

__all__ = ["Status", "DoctorCheck", "DoctorReport", "run_doctor", "format_check",
           "format_report", "LABELS", "LABEL_WIDTH"]

log = logging.getLogger(__name__)


class Status:
    """Verdicts of a check."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass
class DoctorCheck:
    """One verdict line: what was checked, what was found, and what to do if it is not PASS."""

    name: str
    status: str
    detail: str
    fix: str = ""
    data: Dict[str, Any] = field(default_factory=dict)
    table: List[List[str]] = field(default_factory=list)  # rows printed under the verdict


@dataclass
class DoctorReport:
    """Every check, in order, and the facts gathered on the way."""

    checks: List[DoctorCheck] = field(default_factory=list)
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No check failed."""
        return all(c.status != Status.FAIL for c in self.checks)

    def counts(self) -> Dict[str, int]:
        """How many checks gave each verdict."""
        return {s: sum(c.status == s for c in self.checks)
                for s in (Status.PASS, Status.WARN, Status.FAIL)}

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of the report."""
        return {"ok": self.ok, "counts": self.counts(), "versions": self.versions,
                "seconds": round(self.seconds, 2), "checks": [asdict(c) for c in self.checks]}


# Why a build has no CUDA: the codes setup.py records in the build info
# (build_support/cuda_discovery.py's CPU_REASONS).
_CPU_REASONS = {
    "cpu-torch": "the torch it was built against had no CUDA",
    "forced": "it was built with DS_Z3NATIVE_CUDA=0",
    "no-cuda-runtime": "no CUDA runtime headers (toolkit or nvidia wheels) were found at build time",
    "no-nccl": "no NCCL (nccl.h and libnccl.so*) was found at build time",
    "cuda-headers-incomplete": "the CUDA headers found at build time lacked some the sources "
                               "include (the build log names them and the wheels that ship them)",
    "cuda-headers-unusable": "the CUDA headers found at build time did not compile with the "
                             "build's compiler (the build log has the error)",
}

_REINSTALL = ("reinstall against the torch you run: `pip install --no-build-isolation -e .` in the "
              "ds_z3native checkout")
_DS_RANGE = "'deepspeed>=0.19.0,<0.20'"

# Run by a fresh interpreter with DS_Z3NATIVE=1: does `import deepspeed` install ds_z3native?
_ACTIVATION_PROBE = """
import json, sys
out = {}
try:
    import ds_z3native_autoload
    out["hook_armed"] = ds_z3native_autoload.is_active()
    import deepspeed
    import ds_z3native
    out["installed"] = ds_z3native.installed()
    out["deepspeed"] = deepspeed.__version__
except BaseException as e:
    out["error"] = f"{type(e).__name__}: {e}"
sys.stdout.flush()
print("\\nDSZ_PROBE " + json.dumps(out))
"""


# DeepSpeed's auto-detection logs this at import on every machine without a GPU; the doctor
# reports the accelerator DeepSpeed chose in its own verdict line instead.
_DS_ACCELERATOR_NOTICE = "Setting accelerator to CPU"


class _DropRecords(logging.Filter):
    """Drops log records whose message contains ``text``, counting them."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.dropped = text, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text in record.getMessage():
            self.dropped += 1
            return False
        return True


def _quiet_import_deepspeed() -> Any:
    """``import deepspeed`` with its start-up logging sent to stderr (it logs to stdout) and its
    accelerator notice dropped (it would land between the verdict lines)."""
    ds_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates at import
    drop = _DropRecords(_DS_ACCELERATOR_NOTICE)
    ds_logger.addFilter(drop)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
    finally:
        ds_logger.removeFilter(drop)
    return deepspeed


def _deepspeed_accelerator() -> Optional[str]:
    """The accelerator DeepSpeed chose in this process (``cpu``, ``cuda``, ...), or None."""
    try:
        from deepspeed.accelerator import get_accelerator

        return str(get_accelerator().device_name())
    except Exception as e:  # noqa: BLE001 - only reported
        log.debug("deepspeed.accelerator.get_accelerator(): %s", e)
        return None


def _start_activation_probe() -> Optional[subprocess.Popen]:
    if importlib.util.find_spec("deepspeed") is None:
        return None
    env = dict(os.environ, DS_Z3NATIVE="1")
    return subprocess.Popen([sys.executable, "-c", _ACTIVATION_PROBE], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish_activation_probe(proc: Optional[subprocess.Popen]) -> Dict[str, Any]:
    if proc is None:
        return {"error": "deepspeed is not installed"}
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "the probe interpreter did not finish in 180 s"}
    for line in reversed(out.splitlines()):
        if line.startswith("DSZ_PROBE "):
            return json.loads(line[len("DSZ_PROBE "):])
    return {"error": f"the probe interpreter exited with {proc.returncode}: {out.strip()[-400:]}"}


# ---- the checks -------------------------------------------------------------------------------

def _check_python() -> DoctorCheck:
    ok = sys.version_info >= (3, 9)
    return DoctorCheck("python", Status.PASS if ok else Status.FAIL,
                       f"{platform.python_version()} ({sys.executable})",
                       "" if ok else "ds_z3native needs Python 3.9 or newer")


def _check_torch(versions: Dict[str, Optional[str]]) -> List[DoctorCheck]:
    import torch

    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    checks = [DoctorCheck("torch", Status.PASS, torch.__version__,
                          data={"version": torch.__version__})]
    if not torch.version.cuda:
        checks.append(DoctorCheck("cuda", Status.PASS,
                                  "CPU build of torch: ds_z3native runs over gloo on CPU"))
        versions["nccl"] = None
        return checks
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    nccl = None
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 - reported below
        log.debug("torch.cuda.nccl.version(): %s", e)
    versions["nccl"] = nccl
    if available:
        checks.append(DoctorCheck("cuda", Status.PASS,
                                  f"CUDA {torch.version.cuda}, {count} GPU(s): {', '.join(names)}",
                                  data={"gpus": count, "names": names}))
    else:
        checks.append(DoctorCheck("cuda", Status.WARN,
                                  f"torch has CUDA {torch.version.cuda} but sees no GPU",
                                  "check the driver and CUDA_VISIBLE_DEVICES (nvidia-smi); on a "
                                  "CPU-only machine this is expected and the CPU path is used"))
    checks.append(DoctorCheck("nccl", Status.PASS if nccl else Status.WARN,
                              f"NCCL {nccl}" if nccl else "torch reports no NCCL",
                              "" if nccl else "multi-GPU runs need a torch built with NCCL"))
    return checks


def _check_native(versions: Dict[str, Optional[str]]) -> DoctorCheck:
    import torch

    try:
        from . import build_info

        info = build_info()
    except Exception as e:  # noqa: BLE001 - the verdict
        return DoctorCheck("native extension", Status.FAIL,
                           f"ds_z3native._C does not load: {type(e).__name__}: {e}",
                           f"{_REINSTALL}; a DcNamespaceTaken error means another library loaded "
                           "its dc op first")
    versions["ds_z3native_build"] = info.get("flavour")
    detail = (f"{info['flavour']} flavour, built against torch {info['torch_version']}"
              + (f", CUDA {info.get('cuda_version')}, NCCL {info.get('nccl_version')}"
                 if info["flavour"] == "cuda" else ""))
    if not info["torch_matches_build"]:
        return DoctorCheck("native extension", Status.FAIL,
                           f"{detail}, but torch {torch.__version__} is running", _REINSTALL,
                           data=info)
    if info["flavour"] != "cuda" and torch.version.cuda:
        reason = _CPU_REASONS.get(info.get("cpu_reason") or "", "the build recorded no reason")
        gpus = "this machine has GPUs and " if torch.cuda.is_available() else ""
        return DoctorCheck("native extension", Status.WARN,
                           f"{detail}, without CUDA: {reason}; {gpus}torch has CUDA "
                           f"{torch.version.cuda}, but NCCL process groups are refused at init()",
                           "reinstall with `DS_Z3NATIVE_CUDA=1 pip install --no-build-isolation "
                           "-v -e .`: it finds the CUDA runtime and NCCL in a CUDA toolkit or in "
                           "the nvidia-* wheels torch's CUDA wheel installs, or says which is "
                           "missing", data=info)
    return DoctorCheck("native extension", Status.PASS, detail, data=info)


def _check_deepspeed(versions: Dict[str, Optional[str]], dc_owner: Optional[str]
                     ) -> List[DoctorCheck]:
    """The DeepSpeed version, the gate, the contract and the patches: would install() work?
    ``dc_owner``: who had registered ``torch.ops.dc`` before ds_z3native._C was loaded."""
    from .compat import deepspeed_version
    from .compat.contract import contract_mismatches
    from .compat.gate import Verdict, check_deepspeed_version
    from .compat.registry import patches_for
    from .installer import installed

    if importlib.util.find_spec("deepspeed") is None:
        versions["deepspeed"] = None
        return [DoctorCheck("deepspeed", Status.FAIL, "not installed",
                            f"pip install {_DS_RANGE}")]
    try:
        deepspeed = _quiet_import_deepspeed()
    except Exception as e:  # noqa: BLE001 - e.g. DS_Z3NATIVE set and install() failed
        versions["deepspeed"] = None
        return [DoctorCheck("deepspeed", Status.FAIL,
                            f"`import deepspeed` fails: {type(e).__name__}: {str(e)[:400]}",
                            "fix the cause named above; if it comes from DS_Z3NATIVE, unset it "
                            "to run DeepSpeed without ds_z3native")]
    versions["deepspeed"] = deepspeed.__version__
    version = deepspeed_version()
    where = os.path.dirname(deepspeed.__file__)
    accelerator = _deepspeed_accelerator()
    checks = [DoctorCheck("deepspeed", Status.PASS,
                          f"{deepspeed.__version__} ({where}), accelerator {accelerator or '?'}",
                          data={"version": deepspeed.__version__, "path": where,
                                "accelerator": accelerator})]

    gate = check_deepspeed_version(version)
    mismatches = contract_mismatches()
    owner = dc_owner
    status, fix = Status.PASS, ""
    if not gate.allowed:
        status, fix = Status.FAIL, gate.message
    elif mismatches:
        status, fix = Status.FAIL, ("ds_z3native does not match this DeepSpeed's dc op: use a "
                                    f"DeepSpeed in the supported range ({_DS_RANGE})")
    elif owner is not None:
        status, fix = Status.FAIL, (f"torch.ops.dc is already registered by {owner} in this "
                                    "process; install ds_z3native before anything loads "
                                    "DeepSpeed's dc op")
    elif gate.verdict is Verdict.NEWER_COMPATIBLE:
        status, fix = Status.WARN, ("untested DeepSpeed release (its contract matches): prefer "
                                    f"{_DS_RANGE}, report problems with this version")
    detail = gate.message if status is not Status.FAIL or not mismatches else (
        f"{len(mismatches)} contract difference(s): " + "; ".join(mismatches[:5]))
    if installed():
        detail += " (already installed in this process)"
    fingerprints = _check_fingerprints(version) if gate.allowed else None
    if status is not Status.FAIL and fingerprints is not None \
            and fingerprints.status == Status.FAIL:
        status, fix = Status.FAIL, fingerprints.fix
        detail += "; patch targets differ from the tested code (see patch fingerprints)"
    checks.append(DoctorCheck("install() would succeed", status, detail, fix,
                              data={"verdict": gate.verdict.value, "mismatches": mismatches,
                                    "dc_owner": owner}))
    try:
        patches = patches_for(version)
        checks.append(DoctorCheck(
            "patches for this DeepSpeed", Status.PASS,
            ", ".join(p.name for p in patches) or "none needed",
            data={"patches": [{"name": p.name, "summary": p.summary} for p in patches]}))
    except Exception as e:  # noqa: BLE001 - the verdict
        checks.append(DoctorCheck("patches for this DeepSpeed", Status.FAIL,
                                  f"the patch registry fails: {type(e).__name__}: {e}",
                                  _REINSTALL))
    if fingerprints is not None:
        checks.append(fingerprints)
    return checks


def _check_fingerprints(version: Any) -> DoctorCheck:
    """For every target of the patches ``install()`` would apply to DeepSpeed ``version``:
    whether its fingerprint is the one recorded for the running release (a table row each)."""
    from .compat.fingerprints import UNVERIFIED_ENV, allowed_unverified, check_patches
    from .compat.registry import patches_for

    name = "patch fingerprints"
    try:
        release = str(type(version)(version.base_version))
        checks = check_patches(patches_for(version), versions={"deepspeed": release})
    except Exception as e:  # noqa: BLE001 - the verdict
        return DoctorCheck(name, Status.FAIL, f"cannot read them: {type(e).__name__}: {e}",
                           _REINSTALL)
    allow_all, allowed = allowed_unverified()
    refused = [c for c in checks if not c.status.ok and c.strict
               and not allow_all and c.patch not in allowed]
    unverified = [c for c in checks if not c.status.ok and c not in refused]

    def verdict(c: Any) -> str:
        if c.status.ok:
            return c.verdict
        if c in refused:
            return f"REFUSED ({c.status.value})"
        allowed_by = f", allowed by {UNVERIFIED_ENV}" if c.strict else ""
        return f"unverified ({c.status.value}{allowed_by})"

    rows = [["patch", "target", f"fingerprint (DeepSpeed {release})"]] + [
        [c.patch, c.target, verdict(c)] for c in checks]
    data = {"targets": [{"patch": c.patch, "target": c.target, "package": c.package,
                         "version": c.version, "status": c.status.value, "verdict": c.verdict,
                         "found": c.found, "recorded": c.recorded} for c in checks]}
    n_patches = len({c.patch for c in checks})
    matched = len(checks) - len(refused) - len(unverified)
    detail = (f"{len(checks)} targets of {n_patches} patches: {matched} match the fingerprints "
              f"recorded for DeepSpeed {release}"
              + (f", {len(unverified)} unverified" if unverified else "")
              + (f", {len(refused)} differ (install() refuses them)" if refused else ""))
    if refused:
        names = ",".join(sorted({c.patch for c in refused}))
        return DoctorCheck(
            name, Status.FAIL, detail,
            "use an unmodified supported DeepSpeed release (pip install --force-reinstall "
            f"{_DS_RANGE}), or set {UNVERIFIED_ENV}={names} to patch anyway", data, rows)
    if unverified:
        packages = ", ".join(sorted({f"{c.package} {c.version}" for c in unverified}))
        return DoctorCheck(
            name, Status.WARN, detail + f" ({packages})",
            "these targets differ from the versions ds_z3native was tested with; the patches "
            "still apply: report problems with these versions", data, rows)
    return DoctorCheck(name, Status.PASS, detail, data=data, table=rows)


def _check_activation(probe: Dict[str, Any], armed_at_start: bool) -> DoctorCheck:
    """Zero-code activation: the start-up file, DS_Z3NATIVE, and ``probe``: what a fresh
    interpreter with DS_Z3NATIVE=1 did at ``import deepspeed``."""
    import ds_z3native_autoload as autoload

    name = "DS_Z3NATIVE activation"
    files = autoload.installed_pth_files()
    current = []
    for path in files:
        with open(path) as f:
            current.append(f.read() == autoload.PTH_LINE)
    raw = os.environ.get(autoload.ENV_VAR)
    data: Dict[str, Any] = {"pth": files, "pth_current": current, "env": raw, "probe": probe}
    write = ("reinstall ds_z3native (`pip install --no-build-isolation -e .`), or run "
             "`python -m ds_z3native_autoload --write <site-packages>`")
    try:
        wanted = autoload.requested()
    except ValueError as e:
        return DoctorCheck(name, Status.FAIL, str(e), f"set {autoload.ENV_VAR}=1 or unset it",
                           data)
    data["requested"] = wanted
    works = bool(probe.get("installed")) and not probe.get("error")
    env = (f"{autoload.ENV_VAR}={raw!r} is set: install() runs at `import deepspeed`" if wanted
           else f"{autoload.ENV_VAR} is {'unset' if raw is None else repr(raw)} (off)")
    if wanted and not armed_at_start and not _installed_now():
        return DoctorCheck(name, Status.FAIL,
                           f"{autoload.ENV_VAR}={raw!r} is set, but the start-up hook did not run "
                           "in this interpreter, so "
                           "DeepSpeed runs without ds_z3native" +
                           ("" if files else f" (no {autoload.PTH_NAME} in site-packages)"),
                           write + "; or call `ds_z3native.install()` in the script", data)
    if files and not all(current):
        return DoctorCheck(name, Status.WARN, f"{autoload.PTH_NAME} is stale: {files}; {env}",
                           write, data)
    if works:
        hint = "" if wanted else f"; set {autoload.ENV_VAR}=1 to use it"
        return DoctorCheck(name, Status.PASS,
                           f"with {autoload.ENV_VAR}=1 a fresh interpreter installs ds_z3native "
                           f"at `import deepspeed` (checked); {env}{hint}", data=data)
    why = probe.get("error") or "`import deepspeed` returned without installing ds_z3native"
    if not files:
        return DoctorCheck(name, Status.WARN,
                           f"not set up: no {autoload.PTH_NAME} in site-packages, so "
                           f"{autoload.ENV_VAR}=1 has no effect; {env}",
                           write + " (an explicit `ds_z3native.install()` works without it)", data)
    return DoctorCheck(name, Status.FAIL, f"a fresh interpreter with {autoload.ENV_VAR}=1: {why}",
                       "fix the cause named above (see the install() check)", data)


def _installed_now() -> bool:
    from .installer import installed

    return installed()


def _check_demo_extra() -> DoctorCheck:
    missing = [m for m in ("transformers", "peft", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        return DoctorCheck("demo packages", Status.WARN, f"missing: {', '.join(missing)}",
                           "`pip install --no-build-isolation -e \".[demo]\"` for `ds-z3native "
                           "demo` (ds_z3native itself does not need them)")
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for m in ("transformers", "peft", "tqdm"):
        try:
            found.append(f"{m} {version(m)}")
        except PackageNotFoundError:
            found.append(m)
    return DoctorCheck("demo packages", Status.PASS, ", ".join(found))


def _check_selftest(ranks: int) -> DoctorCheck:
    from .selftest import run_selftest

    start = time.monotonic()
    checks = run_selftest(world_size=ranks)
    took = time.monotonic() - start
    failed = [c for c in checks if not c.ok]
    data = {"checks": [asdict(c) for c in checks], "seconds": round(took, 2)}
    if failed:
        return DoctorCheck("self-test", Status.FAIL,
                           "; ".join(f"{c.name}: {c.detail or 'failed'}" for c in failed),
                           "run `ds-z3native selftest -v` and report the output with "
                           "`ds-z3native doctor --json`", data)
    return DoctorCheck("self-test", Status.PASS,
                       f"{len(checks)} checks on {ranks} gloo ranks through torch.ops.dc "
                       f"(gather, reduce, frozen-param refusal) in {took:.1f} s", data=data)


def run_doctor(selftest: bool = True, ranks: int = 2,
               on_check: Optional[Callable[[DoctorCheck], None]] = None) -> DoctorReport:
    """Run every check; ``on_check`` is called with each as it completes."""
    import ds_z3native_autoload as autoload

    from . import _native

    armed_at_start = autoload.is_active()  # before anything below imports deepspeed
    # Before _C is loaded (it registers torch.ops.dc itself): did another library get there first?
    dc_owner = _native.existing_dc_owner() if _native._module is None else None
    start = time.monotonic()
    report = DoctorReport()
    report.versions["python"] = platform.python_version()
    probe_proc = _start_activation_probe()

    def add(checks: Any) -> None:
        for c in checks if isinstance(checks, list) else [checks]:
            report.checks.append(c)
            if on_check is not None:
                on_check(c)

    add(_check_python())
    add(_check_torch(report.versions))
    add(_check_native(report.versions))
    add(_check_deepspeed(report.versions, dc_owner))
    add(_check_activation(_finish_activation_probe(probe_proc), armed_at_start))
    add(_check_demo_extra())
    if selftest:
        add(_check_selftest(ranks))
    report.seconds = time.monotonic() - start
    return report


# Every check's label, in report order: the text report's label column is as wide as the longest.
LABELS = ("python", "torch", "cuda", "nccl", "native extension", "deepspeed",
          "install() would succeed", "patches for this DeepSpeed", "patch fingerprints",
          "DS_Z3NATIVE activation",
          "demo packages", "self-test")
LABEL_WIDTH = max(len(label) for label in LABELS)


def format_check(check: DoctorCheck, width: int = LABEL_WIDTH, tables: bool = False) -> str:
    """One verdict line (label column ``width`` wide, then two spaces), plus the fix for WARN
    and FAIL and the check's table (if any) under the detail: for a WARN or FAIL, or for any
    verdict with ``tables``."""
    line = f"[{check.status}] {check.name.ljust(width)}  {check.detail}"
    indent = " " * (len(check.status) + 3 + width + 2)
    if check.status != Status.PASS and check.fix:
        line += f"\n{indent}-> {check.fix}"
    if check.table and (tables or check.status != Status.PASS):
        widths = [max(len(row[i]) for row in check.table) for i in range(len(check.table[0]) - 1)]
        for row in check.table:
            cells = [cell.ljust(w) for cell, w in zip(row, widths)] + row[len(widths):]
            line += f"\n{indent}" + "  ".join(cells)
    return line


def format_report(report: DoctorReport) -> str:
    """The closing verdict of a report (the check lines are printed as they complete)."""
    n = report.counts()
    verdict = "ready" if report.ok and not n[Status.WARN] else (
        "ready, with warnings" if report.ok else "NOT ready: fix the FAIL lines above")
    return (f"{n[Status.PASS]} PASS, {n[Status.WARN]} WARN, {n[Status.FAIL]} FAIL in "
            f"{report.seconds:.1f} s: {verdict}")
