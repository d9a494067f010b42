"""``bench/native_micro.py`` (``python -m bench native_micro``): the smoke run on the CPU writes a
complete result and counts each param category's collectives; the counted first step is never
timed, the params are deterministic, and NCCL's COLL log is read as NCCL writes it.

Timings are not asserted (CPU smoke numbers mean nothing); structure and counts are.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from helpers.bench_cli import VERSION_KEYS, bench_env as _env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the checkout, not an installed package

from bench.native_micro import MicroConfig, make_params  # noqa: E402


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run([sys.executable, "-m", "bench", "native_micro", "--smoke", "--output-dir",
                        str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "native_micro: done" in r.stderr  # progress goes through logging
    return json.loads((out / "native_micro.json").read_text())


def test_native_micro_smoke_writes_the_result_format(micro: Dict[str, Any]) -> None:
    assert micro["bench"] == "native_micro" and micro["mode"] == "smoke" and micro["schema"] == 1
    assert VERSION_KEYS <= set(micro["versions"])
    setup = micro["setup"]
    assert setup["params"] == 500 and setup["frozen"] == 450 and setup["trainable"] == 50
    assert setup["ranks"] == 2 and setup["graphs"] == 1
    ours = micro["runs"]["ours"]
    assert ours["status"] == "ok", ours.get("error")
    for key in ("step_ms", "forward_gather_ms", "backward_gather_reduce_ms"):
        stats = ours[key]
        assert stats["min"] <= stats["median"] <= stats["max"] and stats["n"] == setup["steps"]
    assert ours["peak_gib"] > 0 and ours["peak_kind"]
    # The op calls' own host cost, for a kept (persistent) param and a gathered one.
    assert set(ours["per_call_us"]) == {"kept", "gathered"}
    assert all(us > 0 for us in ours["per_call_us"].values())
    assert micro["baseline"] in micro["runs"]
    assert ours["ratio"]["step_ms"] > 0
    ds = micro["runs"]["deepspeed"]
    if ds["status"] != "ok":  # CPU: DeepSpeed's op needs CUDA; the reason is recorded
        assert ds["status"] == "not_available" and ds["reason"]
        assert ds["ratio"] is None


def test_native_micro_counts_collectives(micro: Dict[str, Any]) -> None:
    setup = micro["setup"]
    col = micro["runs"]["ours"]["collectives"]
    assert col["source"] == "comm_stats()" and col["timed_steps_identical"] is True
    first, later = col["first_step"], col["later_step"]
    count = setup["count"]
    # Every trainable param is reduced once per step: one reduce-scatter each.
    assert first["reduce_scatter_calls"] == later["reduce_scatter_calls"] == setup["trainable"]
    assert later["bucket_flushes"] >= 1
    # Persistent frozen params: gathered at the first step only.
    per_first, per_later = col["per_category"]["first_step"], col["per_category"]["later_step"]
    assert per_first["persistent_frozen"]["allgather_calls"] == count["persistent_frozen"]
    assert per_later["persistent_frozen"]["allgather_calls"] == 0
    pf = col["persistent_frozen_allgather_bytes"]
    assert pf["first_step"] > 0 and pf["later_step"] == 0
    # Non-persistent params: gathered in forward and again in backward, every step.
    for cat in ("frozen", "trainable"):
        assert per_later[cat]["allgather_calls"] == 2 * count[cat]
    assert first["allgather_calls"] - later["allgather_calls"] == count["persistent_frozen"]


def test_the_counted_first_step_is_never_timed() -> None:
    with pytest.raises(ValueError, match="warmup >= 1"):
        MicroConfig(warmup=0)


def test_the_nccl_log_count_runs_on_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU run counts DeepSpeed's collectives in a separate untimed run (NCCL's COLL log):
    that run must start from the benchmark's own config. On gloo NCCL logs nothing, so the
    count reports zero steps found, not a failed run (on a CUDA machine a ValueError from a
    config without warm-up stopped the whole benchmark after both timed runs)."""
    from bench.native_micro import _count_with_nccl_log

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # Few params on one rank: each gather is preceded by a 31 MB marker all-reduce.
    cfg = dataclasses.replace(MicroConfig.for_mode(smoke=True), n_params=20, ranks=1)
    counted = _count_with_nccl_log("ours", cfg, timeout=300)
    assert counted == {"source": "NCCL COLL log", "error": "found 0 step(s) in NCCL's log"}


def test_params_are_deterministic_and_mixed() -> None:
    cfg = MicroConfig.for_mode(smoke=True)
    a, b = make_params(cfg), make_params(cfg)
    assert a == b and len(a) == 500
    assert sum(p.frozen for p in a) == 450
    assert len({p.shape for p in a}) >= 5


def test_native_micro_reads_nccls_coll_log_format() -> None:
    # Lines in the format NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL writes (host:pid:tid [rank] NCCL
    # INFO <Op>: opCount <hex> ... count <n> datatype <ncclDataType_t> ... [nranks=<n>] stream ...),
    # with the marker all-reduces native_micro issues between categories and at each step's end.
    from bench.native_micro import CATEGORIES, MARKER_BASE, parse_nccl_coll_log

    def line(op: str, op_count: int, count: int, dtype: int) -> str:
        return (f"node0:4242:4242 [0] NCCL INFO {op}: opCount {op_count:x} sendbuff "
                f"0x7f5dd32b2100 recvbuff 0x7f5dd32b4100 count {count} datatype {dtype} op 0 root 0 "
                f"comm 0x55bef0201370 [nranks=2] stream 0x55bef0208bd0")

    def marker(code: int) -> str:
        return line("AllReduce", 0, MARKER_BASE + code, 7)

    end_of_step = len(CATEGORIES) + 2
    log = "\n".join([
        "node0:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
        "node0:4242:4242 [0] NCCL INFO comm 0x55bef0201370 rank 0 nranks 2 - Init COMPLETE",
        marker(CATEGORIES.index("frozen")),
        line("AllGather", 1, 1024, 9), line("AllGather", 2, 512, 9),     # bf16: 2 bytes
        marker(CATEGORIES.index("persistent_frozen")),
        line("AllGather", 3, 256, 7),                                      # fp32: 4 bytes
        marker(CATEGORIES.index("trainable")),
        line("AllGather", 4, 100, 7), line("ReduceScatter", 5, 100, 7),
        line("AllReduce", 6, 8, 7),
        marker(end_of_step),
        marker(CATEGORIES.index("trainable")),
        line("AllGather", 7, 100, 7), line("ReduceScatter", 8, 100, 7),
        marker(end_of_step),
    ])
    first, later = parse_nccl_coll_log(log)
    assert first["allgather_calls"] == 4
    assert first["allgather_bytes"] == 2 * (1024 * 2 + 512 * 2 + 256 * 4 + 100 * 4)  # received
    assert first["reduce_scatter_calls"] == 1 and first["reduce_scatter_bytes"] == 2 * 400
    assert first["allreduce_calls"] == 1 and first["allreduce_bytes"] == 32  # markers not counted
    assert first["per_category"]["frozen"] == {"allgather_calls": 2, "allgather_bytes": 6144}
    assert first["per_category"]["persistent_frozen"]["allgather_bytes"] == 2048
    assert later["allgather_calls"] == 1 and "persistent_frozen" not in later["per_category"]
