"""bench/trace_breakdown.py: a step's device busy share, launches by kind and host time in dc ops
and compiled graphs, from a torch.profiler Chrome trace (synthetic traces with known answers),
and from the trace ``bench/lora_llama.py --trace`` writes of a toy run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from helpers.bench_cli import bench_env as _env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench.trace_breakdown import breakdown, kernel_kind, union_length  # noqa: E402


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args: Any) -> Dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}


def _launch(ts: float, corr: int, tid: int = 1) -> List[Dict[str, Any]]:
    """A launch call on the host and the kernel it started (same correlation id)."""
    return [_x("cudaLaunchKernel", "cuda_runtime", ts, 5.0, tid, correlation=corr)]


def test_union_length_counts_overlaps_once() -> None:
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_length([(0, 100), (10, 20), (30, 40)]) == 100
    assert union_length([(5, 6), (0, 1)]) == 2


@pytest.mark.parametrize("name,cat,kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", "nccl"),
    ("triton_poi_fused_add_mul_0", "kernel", "triton"),
    ("triton_red_fused__to_copy_mean_pow_1", "kernel", "triton"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "kernel", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "kernel", "attention"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "memcpy"),
    ("Memset (Device)", "gpu_memset", "memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "kernel",
     "other"),
])
def test_kernel_kinds(name: str, cat: str, kind: str) -> None:
    assert kernel_kind(name, cat) == kind


def test_breakdown_of_two_steps() -> None:
    events: List[Dict[str, Any]] = []
    for step in range(2):
        t0 = step * 1000.0
        # Host: a compiled graph (300 us) holding two dc ops (40 + 60 us, one with a nested
        # dispatcher-level event of the same op), a dc op outside any graph (50 us) and launches.
        events.append(_x("## Call CompiledFxGraph abc ##", "user_annotation", t0, 300.0))
        events.append(_x("dc::allgather_param", "cpu_op", t0 + 10, 40.0))
        events.append(_x("dc::allgather_param", "cpu_op", t0 + 15, 20.0))  # nested: not again
        events.append(_x("dc::release_param", "cpu_op", t0 + 100, 60.0))
        events.append(_x("dc::reduce_grad", "cpu_op", t0 + 500, 50.0, tid=2))
        # ds_z3native's grouped gather of the params kept gathered (30 us) counts as a dc op.
        events.append(_x("ds_z3native::gather_persistent", "cpu_op", t0 + 200, 30.0))
        events += _launch(t0 + 20, corr=10 * step + 1)
        events += _launch(t0 + 30, corr=10 * step + 2)
        events += _launch(t0 + 40, corr=10 * step + 3)
        events.append(_x("cudaMemcpyAsync", "cuda_runtime", t0 + 60, 5.0, correlation=10 * step + 4))
        # Device: an all-gather (100 us), a triton kernel overlapping it by 50 us (100 us), a gemm
        # (200 us) and a copy (50 us): 100 + 50 + 200 + 50 = 400 us busy.
        events.append(_x("ncclDevKernel_AllGather_RING_LL", "kernel", t0 + 100, 100.0, tid=7,
                         correlation=10 * step + 1))
        events.append(_x("triton_poi_fused_0", "kernel", t0 + 150, 100.0, tid=8,
                         correlation=10 * step + 2))
        events.append(_x("sm90_xmma_gemm_bf16", "kernel", t0 + 300, 200.0, tid=8,
                         correlation=10 * step + 3))
        events.append(_x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", t0 + 600, 50.0, tid=8,
                         correlation=10 * step + 4))
    events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "x"}})
    split = breakdown({"traceEvents": events}, steps=2, step_ms=[1.0, 1.0])
    assert split["wall_ms"] == 1.0
    # Two streams, (100-200) and (150-250) + (300-500) + (600-650): the device is busy 400 us
    # of the step's 1000 (the overlap once).
    assert split["device_busy_ms"] == pytest.approx(0.4)
    assert split["device_busy_share"] == pytest.approx(0.4)
    assert split["launches"] == {"nccl": 1.0, "triton": 1.0, "gemm": 1.0, "attention": 0.0,
                                 "memcpy": 1.0, "memset": 0.0, "other": 0.0, "total": 4.0}
    assert split["host_ms"]["dc_ops"] == pytest.approx(0.18)  # 40 + 60 + 30 + 50, nested once
    assert split["host_ms"]["compiled_graphs"] == pytest.approx(0.3)
    assert split["host_ms"]["graph_wrapper"] == pytest.approx(0.17)  # 300 - 40 - 60 - 30
    assert split["host_ms"]["launch_calls"] == pytest.approx(0.02)
    assert split["dc_calls"] == {"allgather_param": 2.0, "gather_persistent": 1.0,
                                 "reduce_grad": 1.0, "release_param": 1.0}


def test_a_cpu_trace_has_no_device_share() -> None:
    events = [_x("aten::mm", "cpu_op", 0, 100.0)]
    split = breakdown({"traceEvents": events}, steps=1, step_ms=[0.5])
    assert split["device_busy_ms"] is None and split["device_busy_share"] is None
    assert split["launches"]["total"] == 0 and split["dc_calls"] == {}
    assert split["device_idle"] is None


def test_device_idle_is_split_by_the_hosts_phase() -> None:
    """Two marked steps of 1000 us: the device's gaps inside each step are charged to the phase
    the host is in (forward 0-300, backward 300-700, optimizer step 700-950, the rest other),
    and to the compiled graph and dc op spans they fall in; gaps outside the steps are not
    counted."""
    events: List[Dict[str, Any]] = []
    for step in range(2):
        t0 = 2000.0 * step  # 1000 us between the steps: not a step, not counted
        events += [_x("phase:step", "user_annotation", t0, 1000.0),
                   _x("phase:forward", "user_annotation", t0, 300.0),
                   _x("phase:backward", "user_annotation", t0 + 300, 400.0),
                   _x("phase:optimizer_step", "user_annotation", t0 + 700, 250.0),
                   _x("## Call CompiledFxGraph f ##", "user_annotation", t0, 250.0),
                   _x("ds_z3native::reduce_grads", "cpu_op", t0 + 500, 50.0),  # device busy
                   _x("dc::end_backward", "cpu_op", t0 + 620, 40.0)]  # device idle
        # Busy 100-250, 400-600 (two streams overlapping), 800-900.
        events += [_x("triton_poi_fused_0", "kernel", t0 + 100, 150.0, tid=7),
                   _x("sm90_xmma_gemm_bf16", "kernel", t0 + 400, 150.0, tid=7),
                   _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", t0 + 450, 150.0, tid=8),
                   _x("Memset (Device)", "gpu_memset", t0 + 800, 100.0, tid=7)]
    events.append(_x("triton_poi_fused_1", "kernel", 1200.0, 500.0, tid=7))  # between steps
    idle = breakdown({"traceEvents": events}, steps=2, step_ms=[1.0, 1.0])["device_idle"]
    # Gaps per step: 0-100, 250-300 (forward 150), 300-400, 600-700 (backward 200), 700-800,
    # 900-950 (optimizer step 150), 950-1000 (other 50).
    assert idle["ms"] == pytest.approx(0.55)
    assert idle["by_phase"] == pytest.approx({"forward": 0.15, "backward": 0.2,
                                              "optimizer_step": 0.15, "other": 0.05})
    assert idle["in_compiled_graphs"] == pytest.approx(0.1)  # 0-100 of the graph's 0-250
    assert idle["in_dc_ops"] == pytest.approx(0.04)  # end_backward's 620-660


def test_device_idle_needs_marked_steps() -> None:
    split = breakdown({"traceEvents": [_x("triton_poi_fused_0", "kernel", 0, 10.0)]},
                      steps=1, step_ms=[1.0])
    assert split["device_busy_ms"] == pytest.approx(0.01) and split["device_idle"] is None


def test_breakdown_refuses_mismatched_steps() -> None:
    with pytest.raises(ValueError, match="2 steps but 1 step times"):
        breakdown({"traceEvents": []}, steps=2, step_ms=[1.0])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        breakdown({"traceEvents": []}, steps=0, step_ms=[])


def test_report_shows_where_a_profiled_step_goes() -> None:
    from bench import report

    split = breakdown({"traceEvents": [
        _x("dc::allgather_param", "cpu_op", 0, 2000.0),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5.0, correlation=1),
        _x("ncclDevKernel_AllGather", "kernel", 100, 5000.0, tid=7, correlation=1)]},
        steps=1, step_ms=[10.0])
    setup = {"size": "1b", "world_size": 1, "seq": 1024, "micro_batch": 4, "device": "H200",
             "checkpointing": "non-reentrant", "deepcompile": True}
    run = {"variant": "dc-ckpt", "versions": {"deepspeed": "0.19.8"}, "setup": setup,
           "step_ms": {"median": 9.0, "min": 9.0, "max": 9.0}, "peak_gib": 4.0,
           "trace": {"steps": 1, "breakdown": split}}
    plain = {**run, "variant": "upstream", "trace": None,
             "setup": {**setup, "deepcompile": False}}
    lines = report._lora({"bench": "lora_llama", "baseline": "upstream",
                          "runs": {"dc-ckpt@0.19.8": run, "upstream@0.19.8": plain}})
    at = lines.index(next(ln for ln in lines if ln.startswith("**Where a step goes**")))
    rows = [ln for ln in lines[at:] if ln.startswith("| dc-ckpt")]
    assert len(rows) == 1 and not any(ln.startswith("| upstream") for ln in lines[at:])
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells == ["dc-ckpt", "0.19.8", "-", "9.0", "10.0", "5.0", "50%", "1 (nccl 1)", "2.0",
                     "0.0", "1", "-"]  # no phase marks: no idle split


def test_report_shows_profiled_runs_kept_beside_the_table() -> None:
    """A profiled run the file keeps in ``replaced`` (the step-time table shows another run of
    its variant) still gets its breakdown row, named by its run label; unprofiled ones do not."""
    from bench import report

    split = breakdown({"traceEvents": [_x("dc::release_param", "cpu_op", 0, 1000.0)]},
                      steps=1, step_ms=[4.0])
    setup = {"size": "1b", "world_size": 1, "checkpointing": "none", "deepcompile": True}
    shown = {"variant": "dc", "versions": {"deepspeed": "0.19.8"}, "setup": setup, "run": "a",
             "step_ms": {"median": 5.0, "min": 5.0, "max": 5.0}, "peak_gib": 4.0}
    profiled = {**shown, "run": "b", "step_ms": {"median": 3.5, "min": 3.0, "max": 4.0},
                "trace": {"steps": 1, "breakdown": split}}
    lines = report._lora({"bench": "lora_llama", "baseline": "upstream",
                          "runs": {"dc@0.19.8": shown},
                          "replaced": [profiled, {**shown, "run": "c"}]})
    at = lines.index(next(ln for ln in lines if ln.startswith("**Where a step goes**")))
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[at:]
            if ln.startswith("| dc")]
    assert [r[:5] for r in rows] == [["dc", "0.19.8", "b", "3.5", "4.0"]]
    assert rows[0][8] == "1.0"  # host ms in dc ops


def test_report_shows_where_the_device_waits() -> None:
    from bench import report

    events = [_x("phase:step", "user_annotation", 0, 1000.0),
              _x("phase:forward", "user_annotation", 0, 400.0),
              _x("phase:backward", "user_annotation", 400, 500.0),
              _x("triton_poi_fused_0", "kernel", 100, 300.0, tid=7),
              _x("triton_poi_fused_1", "kernel", 500, 300.0, tid=7)]
    split = breakdown({"traceEvents": events}, steps=1, step_ms=[1.0])
    setup = {"size": "1b", "world_size": 1, "checkpointing": "none", "deepcompile": True}
    run = {"variant": "dc", "versions": {"deepspeed": "0.19.8"}, "setup": setup, "run": "a",
           "step_ms": {"median": 1.0, "min": 1.0, "max": 1.0}, "peak_gib": 4.0,
           "trace": {"steps": 1, "breakdown": split}}
    lines = report._lora({"bench": "lora_llama", "baseline": "upstream", "runs": {"dc@0.19.8": run}})
    at = lines.index(next(ln for ln in lines if ln.startswith("**Where a step goes**")))
    assert "host in forward / backward / optimizer step / other" in lines[at + 2]
    row = next(ln for ln in lines[at:] if ln.startswith("| dc"))
    # Idle 0-100 (forward), 400-500 (backward), 800-1000 (backward 100, other 100).
    assert row.strip("|").split("|")[-1].strip() == "0.4 (0.1 / 0.2 / 0.0 / 0.1)"


def test_lora_trace_profiles_two_more_steps(tmp_path: Path) -> None:
    # --trace: two more steps after the timed ones under torch.profiler, a Chrome trace and the
    # op table per rank; the record's steps stay the run's own (1 warm-up + 2 timed).
    trace_dir, out = tmp_path / "trace", tmp_path / "ours.json"
    r = subprocess.run([sys.executable, "bench/lora_llama.py", "--size", "toy", "--variant", "ours",
                        "--warmup", "1", "--steps", "2", "--no-track-gathered",
                        "--trace", str(trace_dir), "--output", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "error" not in record, record.get("error")
    assert len(record["losses"]) == 3 and record["step_ms"]["n"] == 2
    assert record["trace"]["steps"] == 2 and record["trace"]["ops"] > 0
    events = json.loads((trace_dir / "ours-rank0.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names), sorted(names)[:40]
    top = (trace_dir / "ours-rank0-top.txt").read_text()
    assert "Self CPU" in top and "aten::" in top
    # The per-step breakdown: no device on a CPU, no dc op in an eager run, the profiled steps'
    # own wall time.
    split = record["trace"]["breakdown"]
    assert split["steps"] == 2 and split["wall_ms"] > 0
    assert split["device_busy_share"] is None and split["launches"]["total"] == 0
    assert split["dc_calls"] == {} and split["host_ms"]["dc_ops"] == 0
    # Each profiled step and its three phases are marked for the device-idle split (None here:
    # no device).
    marks = [e["name"] for e in events if e.get("name", "").startswith("phase:")]
    assert sorted(set(marks)) == ["phase:backward", "phase:forward", "phase:optimizer_step",
                                  "phase:step"], marks
    assert all(marks.count(m) == 2 for m in set(marks)), marks
    assert split["device_idle"] is None
