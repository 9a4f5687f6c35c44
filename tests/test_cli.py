"""The CLI end to end: doctor, the demo (scaled down) and the quick benchmark, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "groupbridge.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


@pytest.mark.timeout(60)
def test_doctor_json() -> None:
    proc = _run("doctor", "--json", timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    facts = json.loads(proc.stdout)
    assert facts["backends"]["gloo"] is True
    assert facts["split_backend"].startswith("cpu:gloo")
    assert facts["ipv4_loopback"]["store"] is True


@pytest.mark.timeout(120)
def test_demo_end_to_end() -> None:
    """With --delta: the first sync is a full one, the next two deltas (the rest is the plain demo)."""
    proc = _run("demo", "--steps", "3", "--size", "tiny", "--json", "--delta", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verified"] is True
    rows = result["rows"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["verified"] and r["bytes"] > 0 and r["transport"] for r in rows)
    assert set(result["samples"]) == {"1", "2", "3"}
    assert [r["delta"] for r in rows] == [False, True, True]
    assert rows[0]["wire_bytes"] == rows[0]["bytes"]
    for r in rows[1:]:  # Adam moves almost every fp32 value: most buckets still travel dense
        assert r["wire_bytes"] <= r["bytes"] and 0 < r["changed_fraction"] <= 1


@pytest.mark.timeout(120)
def test_bench_delta_quick() -> None:
    proc = _run("bench", "--delta", "--quick", "--json", "--transport", "broadcast", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    assert {r["mode"] for r in records} == {"full", "delta", "delta_always"}
    always = next(r for r in records if r["mode"] == "delta_always")
    assert always["deltas"] == always["steps"] and 0 < always["changed_fraction"] < 0.5, always
    assert always["wire_fraction"] < 0.5 and always["ratio_vs_full"] > 0


@pytest.mark.timeout(120)
def test_bench_quick_json_has_every_field() -> None:
    proc = _run("bench", "--quick", "--json", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    modes = {r["mode"] for r in records}
    assert {"ours", "ours_flat", "flat", "per_tensor", "memcpy"} <= modes
    fields = ["shape", "transport", "receivers", "bytes", "seconds", "gbps", "gbps_min", "gbps_max"]
    fields += ["ratio_vs_flat", "ratio_vs_per_tensor", "ratio_vs_memcpy", "rss_sender_mb", "rss_receiver_mb"]
    for r in records:
        for field in fields:
            assert field in r, (field, r)
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["gbps"] > 0
