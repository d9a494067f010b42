"""``bench/conditions.py``: the GPU's conditions over the timed steps sampled by ``nvidia-smi`` (a
stand-in here, also one of a driver before 535), and why a run has none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package


FAKE_SMI = '''
# A stand-in for nvidia-smi: one GPU, "GPU-fake"; FAKE_SMI_LEGACY=1 plays a driver before 535.
import os, sys, time
args = sys.argv[1:]
target = args[args.index("-i") + 1]
if target != "GPU-fake":
    sys.exit("No devices were found")
if "--query-compute-apps=pid,used_memory" in args:
    print("4242, 1024")
    sys.exit(0)
fields = next(a for a in args if a.startswith("--query-gpu=")).split("=", 1)[1].split(",")
if os.environ.get("FAKE_SMI_LEGACY") and "clocks_event_reasons.active" in fields:
    sys.exit("Field \\"clocks_event_reasons.active\\" is not a valid field to query.")
rows = ["1980, 2619, 350.5, 45, 97, 0x0000000000000000",
        "1500, 2619, 700.0, 80, 100, 0x0000000000000004",
        "1980, 2619, [N/A], 46, 98, 0x0000000000000000",
        "1980, 2619, 351.0, 46, 98, 0x"]  # a line cut off mid-mask
loop = "-lms" in args
i = 0
while True:
    print(", ".join(rows[i % len(rows)].split(", ")[:len(fields)]), flush=True)
    i += 1
    if not loop:
        break
    time.sleep(0.02)
'''


def _fake_smi(tmp_path: Path) -> Path:
    """An executable ``nvidia-smi`` running FAKE_SMI with this interpreter."""
    script = tmp_path / "fake_smi.py"
    script.write_text(FAKE_SMI)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    smi.chmod(0o755)
    return smi


@pytest.mark.parametrize("legacy", [False, True])
def test_gpu_conditions_are_sampled_by_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  legacy: bool) -> None:
    import time

    from bench.conditions import GpuConditions

    smi = _fake_smi(tmp_path)
    if legacy:
        monkeypatch.setenv("FAKE_SMI_LEGACY", "1")
    sampler = GpuConditions(0, interval_ms=20, smi=str(smi), target="GPU-fake")
    sampler.prepare()  # the blocking queries, before anything would be timed
    sampler.start()
    time.sleep(3.0)  # the stand-in prints every 20 ms once its interpreter is up
    s = sampler.stop()
    assert s["available"] and s["samples"] >= 3 and s["device"] == "GPU-fake", s
    assert s["sm_clock_mhz"]["min"] == 1500 and s["sm_clock_mhz"]["max"] == 1980
    assert s["power_w"]["max"] == 700.0  # "[N/A]" samples skipped
    assert s["temperature_c"]["max"] == 80
    # Only the throttled samples' mask, counted (not 0x0, not a cut-off mask); the same under
    # the field's pre-535 name.
    (mask, count), = s["clock_event_reasons"].items()
    assert mask == "0x0000000000000004" and 1 <= count < s["samples"]
    neighbour = [{"pid": 4242, "used_mib": 1024.0, "this_process": False}]
    assert s["gpu_processes"] == {"at_start": neighbour, "at_stop": neighbour}
    assert len(s["load_avg_1m"]) == 2


def test_gpu_conditions_say_why_there_are_none(tmp_path: Path) -> None:
    from bench.conditions import GpuConditions

    smi = _fake_smi(tmp_path)
    for sampler, why in ((GpuConditions(None), "not on a GPU"),
                         (GpuConditions(0, smi=str(smi), target="GPU-fake"), "not started"),
                         (GpuConditions(0, smi=str(tmp_path / "absent")), "not found"),
                         (GpuConditions(0, smi=str(smi), target="GPU-other"), "No devices were found")):
        if why != "not started":
            sampler.start()
        s = sampler.stop()
        assert s["available"] is False and why in s["why"], s
