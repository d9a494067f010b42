"""What the GPU and the host were doing while a benchmark's timed steps ran.

On one H200, steady DeepCompile step times of the 1 B LoRA setup moved between processes
(dc 156.3 ms on 2026-11-30, 98.0 ms on 2026-12-01, the same code compiled anew; dc and dc-warm
of 2026-12-01, identical compiled graphs, 98.0 vs 129.0 ms) and within one run (dc-warm of
2026-12-01: 97.0 to 161.3 ms). :class:`GpuConditions` records what could explain such a move
next to the step times: the GPU's SM and memory clocks, power, temperature, utilisation and
clock-event (throttle) reasons, sampled by ``nvidia-smi`` in its own process (every 250 ms by
default, so the training process does no extra work), the processes using the GPU when sampling
starts and when it stops, and the host's 1-minute load average then. Without a GPU or without
``nvidia-smi`` the summary says why, with the load average only. Sampling never fails a
benchmark: an error is reported in the summary. On one H200 (driver 580) a bf16
matmul loop drew 614 W and ran at 1725-1740 MHz instead of 1980 with reason 0x4 (software
power cap) in 15 of 17 samples: the kind of move these figures make visible.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["GpuConditions", "smi_targets", "FIELDS"]

log = logging.getLogger("bench.conditions")

# nvidia-smi --query-gpu fields and the summary key of each; the clock-event reasons field is
# called clocks_throttle_reasons.active by drivers before 535.
FIELDS = (("clocks.sm", "sm_clock_mhz"), ("clocks.mem", "mem_clock_mhz"),
          ("power.draw", "power_w"), ("temperature.gpu", "temperature_c"),
          ("utilization.gpu", "utilization_pct"))
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def smi_targets(device_index: int) -> List[str]:
    """The ``nvidia-smi -i`` arguments that may name torch's CUDA device ``device_index``, best
    first: its UUID (an index would name another GPU under CUDA_VISIBLE_DEVICES), then its entry
    in CUDA_VISIBLE_DEVICES, then the index itself."""
    targets = []
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        if uuid:
            targets.append(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception as e:  # noqa: BLE001 - an older torch: the other candidates
        log.debug("no UUID for cuda:%d (%s)", device_index, e)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if device_index < len(visible) and visible[device_index].strip():
        targets.append(visible[device_index].strip())
    targets.append(str(device_index))
    return list(dict.fromkeys(targets))


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _csv_rows(text: str) -> List[List[str]]:
    """nvidia-smi's ``--format=csv,noheader`` output as rows of stripped cells."""
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def _stats(values: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"min": min(known), "median": statistics.median(known), "max": max(known)}


def _load_1m() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class GpuConditions:
    """Samples one GPU with ``nvidia-smi`` between :meth:`start` and :meth:`stop`;
    :meth:`prepare` (called by :meth:`start` if not yet) finds the device and the fields this
    driver knows, a few blocking queries best made before anything is timed. ``device_index``
    None: no GPU, only the host's load is recorded; ``target``: the ``nvidia-smi -i`` argument,
    instead of finding torch's device."""

    def __init__(self, device_index: Optional[int], interval_ms: int = 250,
                 smi: str = "nvidia-smi", target: Optional[str] = None) -> None:
        self.device_index = device_index
        self.interval_ms = interval_ms
        self.smi = smi
        self.target = target
        self._prepared = False
        self._proc: Optional[subprocess.Popen] = None
        self._out: Optional[Any] = None
        self._fields: List[str] = []
        self._why: Optional[str] = None
        self._load_before: Optional[float] = None
        self._processes_before: Optional[List[Dict[str, Any]]] = None
        self._exe = smi
        self._target = target or ""

    def _argv(self, *args: str) -> List[str]:
        """An nvidia-smi command line for this GPU: ``args``, CSV without header or units."""
        return [self._exe, *args, "--format=csv,noheader,nounits", "-i", self._target]

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self._argv(*args), capture_output=True, text=True, timeout=30)

    def prepare(self) -> None:
        """Find the GPU and the fields to sample (or why there is nothing to sample)."""
        if self._prepared:
            return
        self._prepared = True
        if self.device_index is None:
            self._why = "not on a GPU"
            return
        exe = shutil.which(self.smi)
        if exe is None:
            self._why = f"{self.smi} not found"
            return
        self._exe = exe
        base = [f for f, _ in FIELDS]
        try:
            tried = {}
            for target in ([self.target] if self.target else smi_targets(self.device_index)):
                self._target = target
                r = self._run(f"--query-gpu={','.join(base)}")
                if r.returncode == 0:
                    break
                tried[target] = (r.stderr or r.stdout).strip()[:200]
            else:
                self._why = f"{self.smi} cannot query the GPU: {tried}"
                return
            # The first reasons field this driver knows, if any.
            reasons = next((f for f in REASONS
                            if self._run(f"--query-gpu={','.join([*base, f])}").returncode == 0),
                           None)
            self._fields = base + ([reasons] if reasons else [])
        except (OSError, subprocess.SubprocessError) as e:
            self._why = f"{self.smi} failed: {e}"

    def start(self) -> None:
        """Start sampling (returns at once; the samples are taken by nvidia-smi)."""
        self.prepare()
        self._load_before = _load_1m()
        if not self._fields:
            return
        self._processes_before = self._processes()
        try:
            # Into a file, not a pipe: nobody reads while the steps run, and a full pipe would
            # stop the sampling after some minutes.
            self._out = tempfile.TemporaryFile("w+")
            self._proc = subprocess.Popen(
                self._argv(f"--query-gpu={','.join(self._fields)}", "-lms", str(self.interval_ms)),
                stdout=self._out, stderr=subprocess.STDOUT, text=True)
        except (OSError, subprocess.SubprocessError) as e:
            self._why = f"{self.smi} failed: {e}"
            self._close()

    def _close(self) -> str:
        """End the sampler process (if any) and return what it wrote."""
        out = ""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._out is not None:
            self._out.seek(0)
            out = self._out.read()
            self._out.close()
            self._out = None
        return out

    def stop(self) -> Dict[str, Any]:
        """Stop sampling; the summary: per field min/median/max over the samples, the
        clock-event reason masks seen (mask -> samples, 0x0 left out; 0x4 is the software power
        cap), the GPU's compute processes when sampling started and when it stopped (pid, MiB,
        whether it is this one; pids as the container sees them), and the load average then.
        Never raises: a failure is the summary's ``why``."""
        summary: Dict[str, Any] = {"load_avg_1m": [self._load_before, _load_1m()]}
        try:
            if self._proc is None:
                summary.update(available=False, why=self._why or "not started")
                return summary
            out = self._close()
            summary.update(self._summarise(out))
            if summary["available"]:
                summary["gpu_processes"] = {"at_start": self._processes_before,
                                            "at_stop": self._processes()}
        except Exception as e:  # noqa: BLE001 - the benchmark's numbers matter more
            self._close()
            summary.update(available=False, why=f"summarising the samples failed: {e!r}")
        return summary

    def _summarise(self, out: str) -> Dict[str, Any]:
        rows = [r for r in _csv_rows(out) if len(r) == len(self._fields)]
        summary: Dict[str, Any] = {"available": bool(rows), "samples": len(rows),
                                   "interval_ms": self.interval_ms, "device": self._target}
        if not rows:
            summary["why"] = f"no samples ({out.strip()[:200] or 'nvidia-smi printed nothing'})"
            return summary
        for i, (_, key) in enumerate(FIELDS):
            summary[key] = _stats([_number(r[i]) for r in rows])
        if len(self._fields) > len(FIELDS):
            masks: Dict[str, int] = {}
            for r in rows:
                mask = r[len(FIELDS)]
                if re.fullmatch(r"0x0+", mask):
                    continue  # no reason: full clocks
                if re.fullmatch(r"0x[0-9a-fA-F]+|\[N/A\]", mask):  # not a cut-off line
                    masks[mask] = masks.get(mask, 0) + 1
            summary["clock_event_reasons"] = masks
        return summary

    def _processes(self) -> Optional[List[Dict[str, Any]]]:
        try:
            r = self._run("--query-compute-apps=pid,used_memory")
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0:
            return None
        return [{"pid": int(row[0]) if row[0].isdigit() else row[0], "used_mib": _number(row[1]),
                 "this_process": row[0] == str(os.getpid())}
                for row in _csv_rows(r.stdout) if len(row) == 2]
