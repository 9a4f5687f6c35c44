"""The CLI end to end: doctor, the demo (scaled down) and the quick benchmark, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from groupbridge.bench import plots

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


@pytest.mark.slow  # 18 s; make test stays under its bound
@pytest.mark.timeout(120)
def test_demo_end_to_end() -> None:
    """With --delta: the first sync is a full one, the next two deltas (the rest is the plain demo)."""
    proc = _run(
        "demo", "--engine", "builtin", "--steps", "3", "--size", "tiny", "--json", "--delta", timeout=110
    )
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


@pytest.mark.slow  # 14 s; make test stays under its bound
@pytest.mark.timeout(120)
def test_bench_delta_quick(tmp_path: Path) -> None:
    proc = _run("bench", "--delta", "--quick", "--json", "--transport", "broadcast", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    assert {r["mode"] for r in records} == {"full", "delta", "delta_always"}
    always = next(r for r in records if r["mode"] == "delta_always")
    assert always["deltas"] == always["steps"] and 0 < always["changed_fraction"] < 0.5, always
    assert always["wire_fraction"] < 0.5 and always["ratio_vs_full"] > 0
    _drawn(lambda path: plots.delta(records, path), tmp_path / "delta.png")


@pytest.mark.timeout(120)
def test_bench_quick_json_has_every_field(tmp_path: Path) -> None:
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
    _drawn(lambda path: plots.throughput(records, path), tmp_path / "throughput.png")


def _drawn(draw: Callable[[Path], None], path: Path) -> None:
    """``bench --plot``'s figure from these records is a PNG (the figures' own run is in the slow suite)."""
    pytest.importorskip("matplotlib")  # the plot extra (make setup installs it)
    draw(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.slow  # about 10 s: three processes import vLLM
@pytest.mark.timeout(180)
def test_bench_control_measures_back_to_back_and_one_at_a_time() -> None:
    proc = _run("bench", "--control", "--rounds", "1", "--json", timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    peer = rows[0]["mode"]
    assert peer in ("vllm StatelessProcessGroup", "raw TCPStore (vLLM's protocol)"), rows
    acked = f"{peer}, writes acknowledged"
    assert [(r["mode"], r["measure"]) for r in rows] == [
        (m, measure)
        for measure in ("back to back", "one at a time")
        for m in (peer, acked, "ours", "ours_sealed")
    ], rows
    one = [r for r in rows if r["measure"] == "one at a time"]
    # a delay from the source's stamp to a receiver holding the object: a store round trip at least, and far
    # below the 2 ms between broadcasts unless they queued (a clock read on the wrong side gave -2000 us)
    assert all(10 < r["us_per_receive"] < 2000 for r in one), one
    assert all(0.05 < r["vs_peer"] < 50 for r in rows), rows
    assert [r["keys_freed"] for r in rows] == [False, False, True, True] * 2, rows


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_bench_plot_measures_and_draws_every_figure(tmp_path: Path) -> None:
    proc = _run("bench", "--plot", str(tmp_path), "--quick", timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads((tmp_path / "bench.json").read_text())
    assert done["left_out"] == {}, done["left_out"]  # root here: the simulated hosts run too
    assert set(done["figures"]) == {"throughput", "delta", "sources", "replicas", "stall", "scale"}
    for name in ("throughput", "buckets", "delta", "sources", "replicas", "stall", "scale", "scale_bytes"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000, name
    assert {r["mode"] for r in done["figures"]["throughput"]} >= {"ours", "flat", "per_tensor", "memcpy"}
    assert [r["sources"] for r in done["figures"]["sources"]] == [1, 2]
    replicas = done["figures"]["replicas"]
    assert [(r["sources"], r["replicas"]) for r in replicas] == [(4, 1), (4, 4)], replicas
    assert all(r["exact"] and r["forwarded_s"] >= r["lower_bound_s"] for r in replicas), replicas
    assert {r["mode"] for r in done["figures"]["stall"]} == {
        "groupbridge/atomic",
        "groupbridge/atomic,swap=reload",
        "groupbridge/streaming",
        "safetensors+reload",
        "engine-free (same host)",
    }


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--plot", "/nonexistent", "--delta"], "run it without --delta"),
        (["--plot", "/nonexistent", "--shape", "moe"], "run it without --shape"),
        (["--plot", "figure.png"], "takes a directory"),
        (["--plot", "/nonexistent", "--figures", "speed"], "no figure named speed"),
    ],
)
def test_bench_plot_refuses_what_it_would_ignore(args: list[str], why: str) -> None:
    """Nothing measured, nothing written: --plot draws its own set, into a directory."""
    from groupbridge import cli

    with pytest.raises(SystemExit, match=why):
        cli.main(["bench", *args])
    assert not Path("/nonexistent").exists() and not Path("figure.png").exists()


@pytest.mark.timeout(90)
def test_the_bridge_example_runs() -> None:
    """README's "Your own workers" points at this example: a trainer sends three versions to two workers."""
    root = Path(__file__).parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "bridge_trainer_workers.py"), "--workers", "2"],
        capture_output=True, text=True, env=ENV, timeout=80,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    held = re.findall(r"step (\d): worker (\d) holds version (\d), equal to the trainer", proc.stdout)
    assert sorted(held) == [(s, w, s) for s in "123" for w in "12"], proc.stdout


@pytest.mark.slow  # about 10 s: a model's inventory and 32 members' posts
@pytest.mark.timeout(120)
def test_bench_scale_plans_each_member_s_share_of_a_real_model_and_a_repeat_costs_a_digest(
    tmp_path: Path,
) -> None:
    """``bench --scale``'s measurement, small: Llama-3-70B's 723 tensors (meta device), 16 FSDP ranks into 2
    replicas of TP 8: every sampled member plans its pairs; the repeat sync fetches a few hundred bytes a
    member (the layouts travel as digests) and replans nothing."""
    pytest.importorskip("transformers")
    from groupbridge.bench.scale import ScaleConfig, run_scale

    r = run_scale(ScaleConfig(model="llama-3-70b", sources=16, replicas=2))
    assert r["tensors"] == 723 and r["members"] == 32, r
    assert r["first"]["pairs"] > 0 and r["first"]["fetched_bytes"] > 100_000, r
    assert r["repeat"]["fetched_bytes"] < 128 * r["members"], r  # a digest and a few fields a member
    assert r["repeat"]["cpu_s"] < r["first"]["cpu_s"], r
    _drawn(lambda path: plots.scale([r], path), tmp_path / "scale.png")
