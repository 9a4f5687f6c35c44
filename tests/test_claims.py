"""What the README says and nothing else tested: progress=, RelayOptions(chain=), solo_bytes=, send timeout=,
DIST_INIT_METHOD, an explicit GLOO_SOCKET_IFNAME winning, timeouts being TimeoutError."""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from tests.helpers import CTX, make_group, run_ranks, share_port
from tests.weights_models import bit_equal, make_model, zeros_like_model

SHAPES = [(f"s{i}", (20, 32)) for i in range(8)] + [(f"m{i}", (80, 128)) for i in range(3)]


def _options(rank: int, ports: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with make_group(rank, 3, "127.0.0.1", ports) as g:
        model = make_model(SHAPES, seed=3)
        if rank == 0:
            seen: list[tuple[int, int]] = []
            relay = gb.RelayOptions(chain=[0, 2, 1], chunk_bytes=4096)
            with gb.WeightSender(g, transport="relay", transport_options=relay, bucket_bytes=1 << 16,
                                 solo_bytes=1 << 14) as snd:  # fmt: skip
                stats = snd.send(model, version=1, progress=lambda done, total: seen.append((done, total)))
            with gb.WeightSender(g, transport="relay", bucket_bytes=1 << 16, solo_bytes=1 << 30) as snd:
                packed = snd.send(model, version=2)
            out["progress"] = seen
            out["in_place"] = (stats.in_place_buckets, packed.in_place_buckets)
            out["buckets"] = (stats.buckets, packed.buckets)
            out["total"] = stats.bytes
            with pytest.raises(ValueError, match="chain"):
                gb.WeightSender(g, transport_options=gb.RelayOptions(chain=[1, 0, 2]))
            with pytest.raises(ValueError, match="chunk_bytes"):
                gb.RelayOptions(chunk_bytes=10)
            with pytest.raises(ValueError, match="clips every value past its range"):  # bf16 1000 -> 448
                gb.WeightSender(g, wire_dtype=torch.float8_e4m3fn)
            with pytest.raises(TypeError, match="transport options"):
                gb.WeightSender(g, transport_options={"chain": [0, 1, 2]})  # type: ignore[arg-type]
        else:
            rcv = gb.WeightReceiver(g, src=0)
            exact = []
            for _ in range(2):
                target = zeros_like_model(model)
                rcv.receive_into(target)
                exact.append(all(bit_equal(target[k], model[k]) for k in model))
            out["exact"] = all(exact)
    return out


@pytest.mark.timeout(60)
def test_progress_chain_and_solo_bytes() -> None:
    res = run_ranks(_options, 3, CTX.Queue(), timeout=50)
    progress = res[0]["progress"]
    assert progress and progress[-1] == (res[0]["total"], res[0]["total"])
    assert all(a[0] < b[0] for a, b in itertools.pairwise(progress)), progress
    # tensors of at least solo_bytes travel in buckets of their own (from their own storage); with a huge
    # solo_bytes every tensor is packed into shared 64 KiB buckets: another plan, the same bytes
    # (the packed plan's last bucket happens to be one whole tensor, which needs no packing either)
    assert res[0]["in_place"] == (3, 1) and res[0]["buckets"] == (4, 2), res[0]
    assert res[1]["exact"] and res[2]["exact"]  # the relay went 0 -> 2 -> 1


def _progress_with_gaps(rank: int, ports: Any, delta: Any) -> Any:
    """Tensors whose bytes do not end on the plan's alignment: the plan leaves gaps between its buckets."""
    half = torch.float16
    model = {"h": torch.ones(3, dtype=half), "f": torch.ones(5), "g": torch.ones(7, dtype=half)}
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        if rank == 1:
            rcv = gb.WeightReceiver(g)
            return [rcv.receive_into(zeros_like_model(model)) for _ in range(2)]
        with gb.WeightSender(g, bucket_bytes=1024, solo_bytes=4, delta=delta) as snd:
            seen: list[list[tuple[int, int]]] = []
            for v in (1, 2):
                seen.append([])
                model["f"] += 1
                stats = snd.send(model, version=v, progress=lambda *done: seen[-1].append(done))
            return seen, stats.bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delta", [False, "always"])
def test_progress_ends_at_the_sync_bytes_where_the_plan_has_gaps(delta: Any) -> None:
    res = run_ranks(_progress_with_gaps, 2, CTX.Queue(), delta, timeout=50)
    seen, total = res[0]
    for calls in seen:  # the full sync, then (with delta) a delta one
        assert calls[-1] == (total, total) and len(calls) == 3, calls
        assert all(a[0] < b[0] for a, b in itertools.pairwise(calls)), calls
    assert res[1] == [1, 2]


def _send_timeout(rank: int, ports: Any) -> str:
    g = make_group(rank, 2, "127.0.0.1", ports, timeout=timedelta(seconds=60))
    if rank == 1:
        try:  # never receives weights: the sender's own timeout must end its wait, and abort the sync
            g.recv_obj(0, tag="done")
            return "received"
        except gb.PeerDiedError as e:
            return f"PeerDiedError: {e}"
    t0 = time.monotonic()
    try:
        gb.WeightSender(g).send({"w": torch.zeros(4)}, version=1, timeout=timedelta(seconds=1.5))
        return "returned"
    except TimeoutError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"


@pytest.mark.timeout(40)
def test_send_timeout_bounds_the_whole_sync_and_is_a_timeout_error() -> None:
    res = run_ranks(_send_timeout, 2, CTX.Queue(), timeout=30)
    assert res[0].startswith("PeerTimeoutError") and "waited 1.5s" in res[0], res[0]
    assert 1.4 < float(res[0].split(" after ")[1].split("s:")[0]) < 4, res[0]
    assert res[1].startswith("PeerDiedError") and "rank 0 aborted" in res[1], res[1]


def _env_world(rank: int, ports: Any, ifname: str | None) -> dict[str, Any]:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DIST_INIT_METHOD", "GLOO_SOCKET_IFNAME"):
        os.environ.pop(k, None)
    if ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    lis, port = share_port(rank, 2, ports, "127.0.0.1")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2"})
    if rank == 0:
        g = gb.init_global_group(listener=lis)
    else:
        os.environ["DIST_INIT_METHOD"] = f"tcp://127.0.0.1:{port}"
        g = gb.init_global_group()
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    out = {"sum": t.item(), "world": g.world_size, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    gb.destroy_global_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ifname", [None, "lo"], ids=["unset", "explicit"])
def test_dist_init_method_and_gloo_ifname(ifname: str | None) -> None:
    res = run_ranks(_env_world, 2, CTX.Queue(), ifname, timeout=50)
    assert all(r["sum"] == 2.0 and r["world"] == 2 for r in res), res
    # unset: set to the interface toward the rendezvous host; explicit: left exactly as the user set it
    assert all(r["ifname"] == "lo" for r in res), res


def test_gloo_ifname_is_left_alone_when_the_user_opts_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """GROUPBRIDGE_SET_GLOO_IFNAME=0: the process environment is not touched (gloo chooses by host name);
    a value other than 0 or 1 is an error naming the variable."""
    from groupbridge.global_group import _bind_gloo_toward

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GROUPBRIDGE_SET_GLOO_IFNAME", "0")
    _bind_gloo_toward("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GROUPBRIDGE_SET_GLOO_IFNAME", "yes")
    with pytest.raises(ValueError, match="GROUPBRIDGE_SET_GLOO_IFNAME='yes' must be 0 or 1"):
        _bind_gloo_toward("127.0.0.1")
    monkeypatch.delenv("GROUPBRIDGE_SET_GLOO_IFNAME")
    try:
        _bind_gloo_toward("127.0.0.1")
        assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"  # the default: the interface toward the host
    finally:  # never left to the tests after this one (ranks spawned later inherit the environment)
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
