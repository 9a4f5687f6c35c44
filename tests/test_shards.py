"""Many sources: every trainer rank sends the boxes it holds, each receiver takes its own, one commit.

Real processes, a real gloo bridge; trainer ranks that shard with FSDP2 run a real torch.distributed world
of their own beside the bridge.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.testing import inject_faults
from tests.helpers import CTX, Ranks, make_group, run_ranks

SHAPES = {"w": (12, 16), "v": (8, 10), "b": (16,), "e": (6, 4)}
DTYPES = {"w": torch.float32, "v": torch.float32, "b": torch.float32, "e": torch.bfloat16}


def _full(name: str, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((name, version)) % (1 << 31))
    return torch.randn(SHAPES[name], generator=g).to(DTYPES[name])


def _chunk(t: torch.Tensor, parts: int, i: int, dim: int) -> gb.Shard | None:
    """Rank i's box of ``t`` split as torch.chunk splits it (uneven: the last pieces short)."""
    pieces = torch.chunk(t, parts, dim)
    if i >= len(pieces):
        return None
    offset = [0] * t.dim()
    offset[dim] = sum(p.shape[dim] for p in pieces[:i])
    return gb.Shard(pieces[i].clone(), tuple(t.shape), tuple(offset))


def _source(rank: int, sources: int, version: int) -> dict[str, Any]:
    """Rows of w, columns of v, a replica of b on every source, rows of e on the first two only."""
    out: dict[str, Any] = {"w": _chunk(_full("w", version), sources, rank, 0)}
    out["v"] = _chunk(_full("v", version), sources, rank, 1)
    out["b"] = _full("b", version)
    if rank < 2:
        out["e"] = _chunk(_full("e", version), 2, rank, 0)
    return {k: v for k, v in out.items() if v is not None}


def _tp_target() -> dict[str, Any]:
    """A tensor-parallel receiver: the right half of w's columns (rows of every source), the bottom half of
    v's rows (columns of every source), b and e whole."""
    return {
        "w": gb.Shard(torch.zeros(12, 8), (12, 16), (0, 8)),
        "v": gb.Shard(torch.zeros(4, 10), (8, 10), (4, 0)),
        "b": torch.zeros(16),
        "e": torch.zeros(6, 4, dtype=torch.bfloat16),
    }


def _exact(target: dict[str, Any], version: int) -> bool:
    for name, value in target.items():
        if isinstance(value, gb.Shard):
            want = _full(name, version)[value.box.slices([0] * value.tensor.dim())]
            if not torch.equal(value.tensor, want):
                return False
        elif not torch.equal(value, _full(name, version)):
            return False
    return True


def _many(rank: int, ports: Any, sources: int, mode: str, transport: str = "auto") -> Any:
    n = sources + 2
    with make_group(rank, n, "127.0.0.1", ports, token="t0ken" if mode == "atomic" else None) as g:
        if rank < sources:
            with gb.WeightSender(g, bucket_bytes=1024, transport=transport) as snd:
                stats = [snd.send(_source(rank, sources, v), version=v) for v in (1, 2, 3)]
                return [s.bytes for s in stats] if transport == "auto" else {s.transport for s in stats}
        rcv = gb.WeightReceiver(g)
        out = []
        for v in (1, 2, 3):
            if rank == sources + 1:
                target = _tp_target()
                out.append((rcv.receive_into(target, atomic=mode != "streaming"), _exact(target, v)))
            elif mode == "receive":
                got = dict(rcv.receive())
                out.append((rcv.version, _exact(got, v)))
            else:
                target = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in SHAPES}
                out.append((rcv.receive_into(target, atomic=mode == "atomic"), _exact(target, v)))
        return out


def _torn_unpack(rank: int, ports: Any) -> Any:
    """Two sources, one receiver writing straight into its target (``atomic=False``); in version 2 the
    receiver's first unpack writes the bucket's first piece, then fails."""
    import groupbridge.weights._bytes as wire_bytes

    with make_group(rank, 3, "127.0.0.1", ports, liveness_timeout=timedelta(seconds=2)) as g:
        if rank < 2:
            with gb.WeightSender(g, bucket_bytes=1024) as snd:
                for v in (1, 2):
                    try:
                        snd.send(_source(rank, 2, v), version=v)
                    except gb.GroupBridgeError as e:
                        return type(e).__name__
            return None
        rcv = gb.WeightReceiver(g)
        target = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in SHAPES}
        rcv.receive_into(target, atomic=False)
        real = wire_bytes.copy_out

        def halfway(parts: Any, at: Any) -> None:
            real(parts[:1], at._replace(views=at.views[:1]))
            raise RuntimeError("the copy failed midway")

        wire_bytes.copy_out = halfway  # type: ignore[assignment]
        try:
            rcv.receive_into(target, atomic=False)
        except gb.WeightSyncError as e:
            return type(e).__name__, getattr(e, "written", None), str(e), rcv.version
        return "finished"


@pytest.mark.timeout(60)
def test_a_streaming_receive_into_whose_copy_fails_midway_names_what_it_wrote() -> None:
    """A piece written before its copy failed leaves the target torn, and the error says which tensor: it
    counts as written from the moment its copy begins, not once it ended."""
    res = run_ranks(_torn_unpack, 3, CTX.Queue(), timeout=50)
    kind, written, text, version = res[2]
    assert kind == "TornUpdateError" and written and "TORN" in text and version == 1, res[2]
    assert res[0] and res[1], res  # the sources were told and failed too


def _relaid(rank: int, ports: Any) -> Any:
    """Every member keeps the last plan; a sync whose boxes changed is planned again: sources split w by
    rows, then by columns; receiver 3 wants w whole, then its right half, then whole again."""
    with make_group(rank, 4, "127.0.0.1", ports) as g:
        if rank < 2:
            with gb.WeightSender(g, bucket_bytes=1024) as snd:
                for v, dim in ((1, 0), (2, 1), (3, 1), (4, 0)):
                    snd.send({"w": _chunk(_full("w", v), 2, rank, dim)}, version=v)
            return "sent"
        rcv = gb.WeightReceiver(g)
        exact = []
        for v, half in ((1, False), (2, True), (3, False), (4, True)):
            target: dict[str, Any] = {"w": torch.zeros(SHAPES["w"])}
            if rank == 3 and half:
                target["w"] = gb.Shard(torch.zeros(12, 8), (12, 16), (0, 8))
            rcv.receive_into(target)
            exact.append(_exact(target, v))
        return exact


@pytest.mark.timeout(60)
def test_a_sync_whose_boxes_changed_is_planned_again() -> None:
    res = run_ranks(_relaid, 4, CTX.Queue(), timeout=50)
    assert res == ["sent", "sent", [True] * 4, [True] * 4], res


NORMS = 70
"""Small tensors split by rows between two sources: a pair's bucket holds more pieces than ``_bytes.rows``
needs to unpack them as rows."""


def _norm(i: int, version: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) * (i + 1) + version


def _retargeted(rank: int, ports: Any) -> Any:
    """Two sources, one receiver into one target dict whose tensors it swaps between syncs: the same dict
    and tensors, a Shard's tensor replaced, the Shard object replaced, a plain tensor replaced. A receive
    reuses what it derived from its last target only while that is the same: each sync lands in the
    tensors the target holds now, and a tensor let go is not written. Each source's ``NORMS`` row pieces
    land in the staging buffer by one indexed copy (counted)."""
    from groupbridge.weights import _bytes

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            with gb.WeightSender(g, bucket_bytes=1 << 16) as snd:
                for v in range(1, 6):
                    held = {
                        f"n{i}": gb.Shard(_norm(i, v)[rank : rank + 1], (2, 4), (rank, 0))
                        for i in range(NORMS)
                    }
                    held.update(w=_chunk(_full("w", v), 2, rank, 0), b=_full("b", v))
                    snd.send(held, version=v)
            return "sent"
        made = []
        rows = _bytes.rows

        def counted(view: torch.Tensor, parts: Any) -> Any:
            got = rows(view, parts)
            made.append(got is not None)
            return got

        _bytes.rows = counted
        rcv = gb.WeightReceiver(g)
        target: dict[str, Any] = {"w": gb.Shard(torch.zeros(12, 8), (12, 16), (0, 8)), "b": torch.zeros(16)}
        target.update({f"n{i}": torch.zeros(2, 4) for i in range(NORMS)})
        out, dropped = [], []
        for v in range(1, 6):
            if v == 3:
                dropped.append(target["w"].tensor)
                target["w"].tensor = torch.zeros(12, 8)
            elif v == 4:
                dropped.append(target["w"].tensor)
                target["w"] = gb.Shard(torch.zeros(12, 8), (12, 16), (0, 8))
            elif v == 5:
                dropped.append(target["n3"])
                target["n3"] = torch.zeros(2, 4)
            rcv.receive_into(target)
            norms = all(torch.equal(target[f"n{i}"], _norm(i, v)) for i in range(NORMS))
            out.append(norms and _exact({k: target[k] for k in ("w", "b")}, v))
        want = [_full("w", 2)[:, 8:], _full("w", 3)[:, 8:], _norm(3, 4)]
        return out, [torch.equal(d, w) for d, w in zip(dropped, want, strict=True)], made


@pytest.mark.timeout(60)
def test_a_receiver_that_swaps_its_targets_tensors_lands_each_sync_in_those_it_holds_now() -> None:
    res = run_ranks(_retargeted, 3, CTX.Queue(), timeout=50)
    out, dropped, made = res[2]
    assert res[:2] == ["sent", "sent"] and out == [True] * 5 and dropped == [True] * 3, res
    assert made == [True, True], made  # one per source's bucket, made at the first sync and kept


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sources", [2, 3])
@pytest.mark.parametrize("mode", ["atomic", "streaming", "receive"])
def test_sources_send_their_shards_receivers_take_whole_tensors_or_boxes(sources: int, mode: str) -> None:
    res = run_ranks(_many, sources + 2, CTX.Queue(), sources, mode, timeout=80)
    for r in res[sources:]:
        assert r == [(1, True), (2, True), (3, True)], res
    sent = [sum(r) for r in res[:sources]]
    assert max(sent) < 2.5 * min(sent), sent  # the replicated b and the shards spread over the sources


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("transport", "carried_by"), [("p2p", "p2p"), ("broadcast", "p2p"), ("shm", "shm")])
@pytest.mark.parametrize("mode", ["atomic", "streaming"])
def test_pairs_travel_over_the_transport_that_carries_them(
    transport: str, carried_by: str, mode: str
) -> None:
    """shm carries pairs (each receiver maps each source's ring); broadcast cannot (one source's fan-out):
    its pairs go over p2p."""
    res = run_ranks(_many, 5, CTX.Queue(), 3, mode, transport, timeout=80)
    for r in res[3:]:
        assert r == [(1, True), (2, True), (3, True)], res
    assert all(r == {carried_by} for r in res[:3]), res


def _fsdp(rank: int, ports: Any) -> Any:
    """Trainer ranks 0 and 1 shard a model with FSDP2 in their own gloo world; receivers 2 (whole) and 3
    (tensor-parallel halves of the first layer)."""
    import torch.distributed as dist

    with make_group(rank, 4, "127.0.0.1", ports) as g:
        store = (
            dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
        )
        port = g.broadcast_obj(store.port if store is not None else None, src=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if rank < 2:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            client = store or dist.TCPStore("127.0.0.1", port, 2, is_master=False)
            dist.init_process_group("gloo", store=client, rank=rank, world_size=2)
            try:
                fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
                snd = gb.WeightSender(g)
                for v in (1, 2):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.to_local().add_(1.0)  # every rank steps its own shard
                    snd.send(model, version=v)
                return "sent"
            finally:
                dist.destroy_process_group()
        rcv = gb.WeightReceiver(g)
        results = []
        want = full
        for _ in (1, 2):
            want = {k: t + 1.0 for k, t in want.items()}  # as the trainers step: bit for bit
            if rank == 2:
                target = {k: torch.zeros_like(t) for k, t in full.items()}
                rcv.receive_into(target)
                results.append(all(torch.equal(target[k], want[k]) for k in want))
            else:
                target = {"0.weight": gb.Shard(torch.zeros(5, 4), (5, 7), (0, 3)), "0.bias": torch.zeros(5),
                          "1.weight": torch.zeros(3, 5), "1.bias": torch.zeros(3)}  # fmt: skip
                rcv.receive_into(target, atomic=False)
                ok = torch.equal(target["0.weight"].tensor, want["0.weight"][:, 3:])
                results.append(ok and torch.equal(target["1.weight"], want["1.weight"]))
        return results


@pytest.mark.timeout(90)
def test_fsdp2_trainer_ranks_send_their_shards_without_gathering() -> None:
    res = run_ranks(_fsdp, 4, CTX.Queue(), timeout=80)
    assert res == ["sent", "sent", [True, True], [True, True]], res


def _refused(rank: int, ports: Any) -> Any:
    with make_group(rank, 4, "127.0.0.1", ports) as g:
        out = []
        for v, hole in ((1, True), (2, False)):
            try:
                if rank < 2:
                    model = {"w": _chunk(_full("w", v), 3 if hole else 2, rank, 0)}  # rows 8..11 held by none
                    gb.WeightSender(g).send(model, version=v)
                    out.append("sent")
                else:
                    target = {"w": torch.zeros(12, 16)}
                    gb.WeightReceiver(g).receive_into(target)
                    out.append(bool(torch.equal(target["w"], _full("w", v))))
            except gb.ManifestMismatchError as e:
                out.append(str(e))
        return out


@pytest.mark.timeout(60)
def test_a_box_nobody_holds_refuses_the_sync_on_every_member_and_the_group_goes_on() -> None:
    res = run_ranks(_refused, 4, CTX.Queue(), timeout=50)
    for r in res:
        assert (
            "w: the box at [8, 0] of shape [4, 16] is wanted by rank" in r[0] and "no sender holds it" in r[0]
        ), res
    assert [r[1] for r in res] == ["sent", "sent", True, True], res


def _big(rank: int, version: int) -> dict[str, Any]:
    """Rows of 32 tensors of 64 x 64 (16 kB each) on each of two sources: 32 buckets of 8 kB per pair."""
    torch.manual_seed(version)
    return {f"w{i}": _chunk(torch.randn(64, 64), 2, rank, 0) for i in range(32)}


@contextlib.contextmanager
def _stacks_if_late(seconds: float) -> Iterator[list[str]]:
    """Every thread's stack, written if the block still runs after ``seconds`` (past the bound the test
    asserts), is in the yielded list once the block ends: a survivor that waits out the operation timeout
    instead says where it waited (the test prints it with its failure)."""
    stacks: list[str] = []
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback_later(seconds, exit=False, file=f)
        try:
            yield stacks
        finally:
            faulthandler.cancel_dump_traceback_later()
            f.seek(0)
            stacks.append(f.read()[-6000:])


def _killed(rank: int, ports: Any, victim: int) -> Any:
    g = make_group(rank, 4, "127.0.0.1", ports, liveness_timeout=timedelta(seconds=2))
    try:
        if rank < 2:
            with inject_faults() as faults:
                snd = gb.WeightSender(g, bucket_bytes=8192)
                snd.send(_big(rank, 1), version=1)
                if rank == victim:
                    faults.post = lambda k, buf: os._exit(3) if k == 10 else None
                t0 = time.monotonic()
                try:
                    with _stacks_if_late(8) as stacks:
                        snd.send(_big(rank, 2), version=2)
                    return "sent"
                except gb.GroupBridgeError as e:
                    return "failed", str(e), time.monotonic() - t0, stacks
        with inject_faults() as faults:
            rcv = gb.WeightReceiver(g)
            target = {f"w{i}": torch.zeros(64, 64) for i in range(32)}
            rcv.receive_into(target)
            before = {k: v.clone() for k, v in target.items()}
            if rank == victim:  # midway through the second sync (64 buckets per receiver)
                landed = itertools.count()
                faults.land = lambda k, view: os._exit(3) if next(landed) == 20 else None
            t0 = time.monotonic()
            try:
                with _stacks_if_late(8) as stacks:
                    rcv.receive_into(target)
                return "received"
            except gb.GroupBridgeError as e:
                same = all(torch.equal(before[k], target[k]) for k in target)
                return "failed", str(e), time.monotonic() - t0, stacks, same, rcv.version
    finally:
        g.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [1, 3], ids=["source", "receiver"])
def test_a_member_killed_mid_sync_commits_nowhere_and_is_named(victim: int) -> None:
    survivors = [r for r in range(4) if r != victim]
    res = Ranks(_killed, 4, (CTX.Queue(), victim)).results(50, expect=survivors)
    for r in survivors:
        ok, out = res[r]
        assert ok, out
        assert out[0] == "failed" and f"rank {victim}" in out[1], res
        # the liveness timeout and a few seconds, not the operation timeout
        assert out[2] < 2 + 6, f"rank {r} raised after {out[2]:.1f}s; its threads then:\n{out[3][0]}"
        if r >= 2:
            assert out[4] is True and out[5] == 1, res  # atomic targets untouched, version 1 still held


def _replicas(rank: int, ports: Any) -> Any:
    """Receivers 2 and 3 want the same (whole) tensors: from each source their pairs have one cut and share
    one base. At version 3 rank 3 is new (its pair travels whole) while rank 2's is a delta of that cut."""
    with make_group(rank, 4, "127.0.0.1", ports) as g:
        if rank < 2:
            snd = gb.WeightSender(g, delta="always", bucket_bytes=8192)
            out = []
            for v in (1, 2, 3, 4):
                full = _evolving(v)
                st = snd.send({"w": _chunk(full["w"], 2, rank, 0), "b": full["b"]}, version=v)
                out.append((st.delta, st.wire_bytes, st.bytes, st.base_bytes))
            return out
        rcv = gb.WeightReceiver(g)
        exact = []
        target = {k: torch.zeros_like(t) for k, t in _evolving(1).items() if k in ("w", "b")}
        for v in (1, 2, 3, 4):
            if rank == 3 and v == 3:
                rcv.close()
                rcv = gb.WeightReceiver(g)
            rcv.receive_into(target, atomic=v % 2 == 0)
            exact.append(all(torch.equal(target[k], _evolving(v)[k]) for k in target))
        return exact


@pytest.mark.timeout(60)
def test_pairs_of_one_cut_share_one_base() -> None:
    res = run_ranks(_replicas, 4, CTX.Queue(), timeout=50)
    assert res[2] == [True] * 4 and res[3] == [True] * 4, res
    for src in res[:2]:
        (_, w1, b1, k1), (d2, w2, b2, _), (d3, w3, _, _), (d4, w4, _, k4) = src
        assert w1 == b1 and k1 == b1 // 2 == k4, src  # one base for both receivers' pairs: half the bytes
        assert d2 and w2 < b2 / 4 and d4 and w4 < b2 / 4, src
        assert d3 and b1 // 2 < w3 < b1 // 2 + w2, src  # rank 3's pair whole, rank 2's a delta


def _evolving(version: int) -> dict[str, torch.Tensor]:
    """The global model at ``version``: random at 1, then 2% of each tensor's elements changed per version."""
    g = torch.Generator().manual_seed(11)
    model = {"w": torch.randn(64, 256, generator=g), "e": torch.randn(32, 128, generator=g)}
    model["e"] = model["e"].to(torch.bfloat16)
    model["b"] = torch.randn(256, generator=g)
    for _ in range(2, version + 1):
        for t in model.values():
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]
            flat[idx] += 1
    return model


def _deltas(rank: int, ports: Any) -> Any:
    with make_group(rank, 4, "127.0.0.1", ports) as g:
        if rank < 2:
            snd = gb.WeightSender(g, delta="always", bucket_bytes=8192)
            out = []
            for v in (1, 2, 3, 4):
                full = _evolving(v)
                mine = {
                    "w": _chunk(full["w"], 2, rank, 0),
                    "e": _chunk(full["e"], 2, rank, 0),
                    "b": full["b"],
                }
                st = snd.send(mine, version=v)
                out.append((st.delta, st.wire_bytes, st.bytes))
            return out
        rcv = gb.WeightReceiver(g)
        exact = []
        target = {k: torch.zeros_like(t) for k, t in _evolving(1).items()}
        target3: dict[str, Any] = {}
        for v in (1, 2, 3, 4):
            if rank == 3 and v == 3:
                rcv.close()
                rcv = gb.WeightReceiver(g)  # a receiver new to the group: its pairs travel whole
            want = _evolving(v)
            if rank == 2:
                rcv.receive_into(target)
                exact.append(all(torch.equal(target[k], want[k]) for k in want))
            else:
                box = {"w": gb.Shard(torch.zeros(64, 128), (64, 256), (0, 128)),
                       "e": gb.Shard(torch.zeros(16, 128, dtype=torch.bfloat16), (32, 128), (16, 0)),
                       "b": torch.zeros(256)}  # fmt: skip
                if v in (1, 3):  # the new receiver brings new tensors too
                    target3 = box
                rcv.receive_into(target3, atomic=False)
                exact.append(
                    torch.equal(target3["w"].tensor, want["w"][:, 128:])
                    and torch.equal(target3["e"].tensor, want["e"][16:])
                    and torch.equal(target3["b"], want["b"])
                )
        return exact


@pytest.mark.timeout(60)
def test_deltas_per_pair_with_many_sources_and_a_new_receiver_made_whole() -> None:
    res = run_ranks(_deltas, 4, CTX.Queue(), timeout=50)
    assert res[2] == [True] * 4 and res[3] == [True] * 4, res
    for src in res[:2]:
        (d1, w1, b1), (d2, w2, b2), (d3, w3, _), (d4, w4, _) = src
        assert not d1 and w1 == b1, src  # nothing held yet: whole
        assert d2 and w2 < b2 / 4, src  # 2% changed: a small part travels
        assert d3 and w3 > 2 * w2, src  # the new receiver's pairs travel whole, the others as deltas
        assert d4 and w4 < b2 / 4, src


def _lazy_shards(rank: int, ports: Any, first: str) -> Any:
    """Three sources, each holding a third of the rows of 48 tensors; two receivers (one whole, one taking
    the right half of the columns). Versions 2 and 3 come from a generator of ``gb.Shard`` that makes each
    box as it is pulled (as an FSDP conversion does): the source never holds all of its boxes at once."""
    import weakref

    names = [f"layer{i}.w" for i in range(48)]  # 48 x 3 kB boxes per source; 4 kB buckets
    alive = [0, 0]  # (now, peak)

    def full(name: str, version: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((name, version)) % (1 << 31))
        return torch.randn(24, 96, generator=g)

    def boxes(version: int) -> Any:
        for name in names:
            local = full(name, version)[8 * rank : 8 * rank + 8].clone()
            alive[0] += 1
            alive[1] = max(alive[1], alive[0])
            weakref.finalize(local, lambda: alive.__setitem__(0, alive[0] - 1))
            yield name, gb.Shard(local, (24, 96), (8 * rank, 0))
            del local

    with make_group(rank, 5, "127.0.0.1", ports) as g:
        if rank < 3:
            with gb.WeightSender(g, bucket_bytes=4096) as snd:
                if first == "specs":
                    specs = {n: ((8, 96), torch.float32, (24, 96), (8 * rank, 0)) for n in names}
                    snd.send(boxes(1), version=1, specs=specs)
                else:
                    snd.send(dict(boxes(1)), version=1)
                alive[1] = alive[0]
                for v in (2, 3):
                    snd.send(boxes(v), version=v)
            return alive[1]
        if rank == 3:
            target: dict[str, Any] = {n: torch.zeros(24, 96) for n in names}
        else:
            target = {n: gb.Shard(torch.zeros(24, 48), (24, 96), (0, 48)) for n in names}
        rcv = gb.WeightReceiver(g)
        exact = []
        for v in (1, 2, 3):
            rcv.receive_into(target, atomic=v != 2)
            got = {n: t.tensor if isinstance(t, gb.Shard) else t for n, t in target.items()}
            want = {n: full(n, v)[:, 48:] if rank == 4 else full(n, v) for n in names}
            exact.append(all(torch.equal(got[n], want[n]) for n in names) and rcv.version == v)
        return exact


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["mapping", "specs"])
def test_a_lazy_generator_of_shards_from_three_sources(first: str) -> None:
    res = run_ranks(_lazy_shards, 5, CTX.Queue(), first, timeout=50)
    assert res[3] == [True, True, True] and res[4] == [True, True, True], res
    for peak in res[:3]:  # a bucket holds one box and a third; two receivers' buckets in flight
        assert peak <= 8, res[:3]


def _changed_box(rank: int, ports: Any) -> Any:
    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            snd = gb.WeightSender(g, bucket_bytes=4096)
            whole = torch.ones(8, 4)
            snd.send({"w": gb.Shard(whole[4 * rank : 4 * rank + 4], (8, 4), (4 * rank, 0))}, version=1)
            moved = gb.Shard(whole[:4], (8, 4), (0, 0))  # rank 1 now says it holds rows 0-3
            try:
                snd.send(iter([("w", moved)]), version=2)
                return "sent"
            except (ValueError, gb.WeightSyncError) as e:
                return f"{type(e).__name__}: {e}"
        rcv = gb.WeightReceiver(g)
        target = {"w": torch.zeros(8, 4)}
        rcv.receive_into(target)
        try:
            rcv.receive_into(target)
            return "received"
        except gb.WeightSyncError as e:
            return f"{type(e).__name__}: {e}", rcv.version, bool((target["w"] == 1).all())


@pytest.mark.timeout(60)
def test_a_lazy_source_whose_box_moved_is_refused() -> None:
    res = run_ranks(_changed_box, 3, CTX.Queue(), timeout=50)
    assert res[1].startswith("ValueError") and "announced as a box at [4, 0]" in res[1], res
    msg, version, kept = res[2]
    assert "rank 1" in msg and version == 1 and kept, res[2]


def _disagree(rank: int, ports: Any) -> Any:
    """Both sources hold b whole (replicas); at version 2 source 1's copy differs in one element: every
    member refuses the sync, naming b and both holders; the receivers' targets stay on version 1; the next
    sync, whose copies agree, lands."""
    with make_group(rank, 4, "127.0.0.1", ports) as g:
        if rank < 2:
            snd = gb.WeightSender(g, bucket_bytes=1024)
            out = []
            for v in (1, 2, 3):
                mine = _source(rank, 2, v)
                if v == 2 and rank == 1:
                    mine["b"] = mine["b"].clone()
                    mine["b"][5] += 1
                try:
                    snd.send(mine, version=v)
                    out.append("sent")
                except gb.SyncRefusedError as e:
                    out.append(str(e))
            return out
        rcv = gb.WeightReceiver(g)
        target = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in SHAPES}
        out = []
        for v in (1, 2, 3):
            try:
                rcv.receive_into(target)
                out.append((rcv.version, _exact(target, v)))
            except gb.SyncRefusedError as e:
                out.append((str(e), rcv.version, _exact(target, 1)))
        return out


@pytest.mark.timeout(60)
def test_replicas_that_disagree_are_refused_on_every_member() -> None:
    res = run_ranks(_disagree, 4, CTX.Queue(), timeout=50)
    for r in (0, 1):
        first, second, third = res[r]
        assert first == "sent" and third == "sent", res[r]
        assert "copies of b at [0] of shape [16] differ" in second and "rank(s) 0" in second, second
        assert "rank(s) 1" in second and "not committed on any receiver" in second, second
    for r in (2, 3):
        first, (msg, held, untouched), third = res[r]
        assert first == (1, True) and third == (3, True), res[r]
        assert "copies of b" in msg and held == 1 and untouched, res[r]


def _reading(rank: int, ports: Any, transport: str = "auto") -> Any:
    """One source, two receivers that read halves of w's rows (as two tensor-parallel workers' loaders do)
    and b whole: the first sync of a manifest brings every tensor whole, later ones only the halves; a new
    manifest is whole again; a receiver whose reads grew beyond what it asked for refuses that sync, and
    the next one brings it what it reads."""
    with make_group(rank, 3, "127.0.0.1", ports) as g:
        syncs = [(v, ("w", "b") if v < 4 else ("w", "b", "e")) for v in (1, 2, 3, 4, 5, 6)]
        if rank == 0:
            out = []
            with gb.WeightSender(g, bucket_bytes=1024, transport=transport) as snd:
                for v, names in syncs:
                    try:
                        out.append(dict(snd.send({n: _full(n, v) for n in names}, version=v).by_receiver))
                    except gb.GroupBridgeError as e:
                        out.append(type(e).__name__)
            return out
        rcv = gb.WeightReceiver(g)
        half = gb.Box((0, 0) if rank == 1 else (6, 0), (6, 16))
        grown = {"w": False}

        def reads(manifest: Any) -> dict[str, gb.Box]:
            return {} if grown["w"] else {"w": half}

        out = []
        for v, names in syncs:
            grown["w"] = rank == 1 and v >= 5  # rank 1's loader reads all of w from version 5 on
            try:
                got = dict(rcv.receive(keep=True, reads=reads))
            except gb.GroupBridgeError as e:
                out.append(type(e).__name__)
                continue
            box = half.slices((0, 0)) if not grown["w"] else (slice(None), slice(None))
            exact = sorted(got) == sorted(names) and torch.equal(got["w"][box], _full("w", v)[box])
            out.append(exact and all(torch.equal(got[n], _full(n, v)) for n in names if n != "w"))
        return out


@pytest.mark.timeout(60)
def test_a_receiver_that_reads_boxes_takes_only_them_once_it_learned_them() -> None:
    sent, first, second = run_ranks(_reading, 3, CTX.Queue(), timeout=50)
    whole = {n: _full(n, 1).numel() * 4 for n in ("w", "b")}
    full, halves = sum(whole.values()), whole["w"] // 2 + whole["b"]
    with_e = full + _full("e", 4).numel() * 2
    assert sent[:4] == [{1: full, 2: full}, {1: halves, 2: halves}, {1: halves, 2: halves},
                        {1: with_e, 2: with_e}], sent  # fmt: skip
    # version 5: rank 1 reads w whole, beyond the half it asked for: refused everywhere; 6 brings it w whole
    assert sent[4] == "ManifestMismatchError" and first[4] == second[4] == "ManifestMismatchError", sent
    assert sent[5] == {1: with_e, 2: with_e - whole["w"] // 2}, sent
    assert first[:4] + first[5:] == second[:4] + second[5:] == [True] * 5, (first, second)


@pytest.mark.timeout(60)
def test_boxes_a_receiver_reads_do_not_move_a_broadcast_onto_pairs() -> None:
    """One source broadcasting: per-receiver streams would cost more than the bytes the boxes save, so the
    receivers' boxes are not used and every sync brings every tensor whole (the same on every member)."""
    sent, first, second = run_ranks(_reading, 3, CTX.Queue(), "broadcast", timeout=50)
    full = sum(_full(n, 1).numel() * 4 for n in ("w", "b"))
    with_e = full + _full("e", 4).numel() * 2
    assert sent == [{1: full, 2: full}] * 3 + [{1: with_e, 2: with_e}] * 3, sent
    assert first == second == [True] * 6, (first, second)


def _streamed(rank: int, ports: Any, got_a: Any) -> Any:
    """Sources 0 and 1 hold row halves of ``a`` then ``z`` (a bucket each); receiver 2 iterates
    ``receive()``. Version 1: source 1's generator holds ``z`` back until the receiver has been handed ``a``,
    which it can only be if tensors are yielded as they land. Version 2 moves only ``z``, as a delta:
    ``receive()`` yields ``z`` alone, and ``only_changed=False`` would have yielded both."""

    def full(name: str, version: int) -> torch.Tensor:
        t = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) + (100 if name == "z" else 0)
        return t + (version if name == "z" else 0)

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            waited = []

            def held(version: int) -> Any:
                for name in ("a", "z"):
                    if name == "z" and rank == 1 and version == 1:
                        waited.append(got_a.wait(20))
                    yield name, gb.Shard(full(name, version)[16 * rank : 16 * rank + 16].clone(), (32, 16),
                                         (16 * rank, 0))  # fmt: skip

            specs = {n: ((16, 16), torch.float32, (32, 16), (16 * rank, 0)) for n in ("a", "z")}
            with gb.WeightSender(g, bucket_bytes=1024, delta="always") as snd:
                deltas = [snd.send(held(v), version=v, specs=specs).delta for v in (1, 2)]
            return waited, deltas
        rcv = gb.WeightReceiver(g)
        out = []
        for v in (1, 2):
            names, exact = [], True
            for name, t in rcv.receive():
                names.append(name)
                exact = exact and torch.equal(t, full(name, v))
                if name == "a":
                    got_a.set()
            out.append((names, exact))
        return out


@pytest.mark.timeout(60)
def test_many_sources_receive_yields_each_tensor_as_it_lands_and_only_what_changed() -> None:
    res = run_ranks(_streamed, 3, CTX.Queue(), CTX.Event(), timeout=50)
    assert res[1][0] == [True], res  # source 1 went on because the receiver already had ``a``
    assert [d for _, d in res[:2]] == [[False, True]] * 2, res
    assert res[2] == [(["a", "z"], True), (["z"], True)], res


def _owned(rank: int, ports: Any) -> Any:
    """Sources 0 and 1 hold row halves of four tensors (a bucket each); receiver 2 iterates ``receive()``
    (no ``keep``) twice, holding on to the first version's ``t0`` only."""
    import weakref

    names = [f"t{i}" for i in range(4)]

    def full(name: str, version: int) -> torch.Tensor:
        return torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) * version + int(name[1:])

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            seen: list[tuple[int, int]] = []
            with gb.WeightSender(g, bucket_bytes=2048) as snd:
                for v in (1, 2):
                    rows = slice(16 * rank, 16 * rank + 16)
                    held = {n: gb.Shard(full(n, v)[rows].clone(), (32, 16), (16 * rank, 0)) for n in names}
                    stats = snd.send(held, version=v, progress=lambda done, total: seen.append((done, total)))
            return seen, stats.bytes
        rcv = gb.WeightReceiver(g)
        kept, freed, exact = None, [], True
        for v in (1, 2):
            refs: list[Any] = []
            for name, t in rcv.receive():
                exact = exact and torch.equal(t, full(name, v))
                freed.append(all(r() is None for r in refs))  # every tensor yielded before was let go
                if kept is None:
                    kept = t
                else:
                    refs.append(weakref.ref(t))
                del t
        return freed, exact, kept is not None and torch.equal(kept, full("t0", 1))


@pytest.mark.timeout(60)
def test_many_sources_receive_gives_each_tensor_to_the_consumer_and_lets_it_go() -> None:
    """Without ``keep``, a tensor yielded is the consumer's: one it dropped is freed at once (the receiver
    does not hold the model until the update ends), one it keeps is not touched by the next version."""
    res = run_ranks(_owned, 3, CTX.Queue(), timeout=50)
    freed, exact, kept = res[2]
    assert exact and kept and freed == [True] * 8, res[2]
    for seen, total in res[:2]:  # each source's progress, bucket by bucket (2 KiB), to its own 4 KiB
        assert total == 4096 and seen == [(2048, 4096), (4096, 4096)] * 2, seen


def _policy(rank: int, ports: Any, delta: Any) -> Any:
    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            with gb.WeightSender(g, delta=delta, bucket_bytes=8192) as snd:
                return [snd.send(_source(rank, 2, v), version=v).delta for v in (1, 2, 3)]
        rcv = gb.WeightReceiver(g)
        target = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in SHAPES}
        return [rcv.receive_into(target) == v and _exact(target, v) for v in (1, 2, 3)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("delta", "deltas"), [(True, [False, False]), ("always", [False, True, True])])
def test_pairs_follow_the_senders_delta_policy(delta: Any, deltas: list[bool]) -> None:
    """``delta=True`` times two full syncs before its policy may choose a delta (a pair holding a base no
    longer diffs by itself); ``"always"`` diffs from the second sync on."""
    res = run_ranks(_policy, 3, CTX.Queue(), delta, timeout=50)
    assert res[2] == [True] * 3, res
    for sent in res[:2]:
        assert sent[: len(deltas)] == deltas, res


FWD_SHAPE = (512, 1024)  # 2 MiB of float32: each source's rows, 1 MiB, are one forwarded bucket per tensor


def _forwarded_version(i: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * v + i)
    t = torch.randn(FWD_SHAPE, generator=g)
    if v > 1:  # a delta has something to leave out: every third value as it was in version 1
        t.view(-1)[::3] = _forwarded_version(i, 1).view(-1)[::3]
    return t


def _forwarding(rank: int, ports: Any, forward: bool) -> Any:
    """Two sources, four receivers wanting every tensor whole, over p2p with checksums and deltas: each
    source's rows go to one receiver, which passes them on along a chain (see ShardPlan.upstream)."""
    with make_group(rank, 6, "127.0.0.1", ports) as g:
        if rank < 2:
            snd = gb.WeightSender(g, transport="p2p", checksum=True, delta="always", forward=forward)
            out = []
            for v in (1, 2, 3):
                held = {f"w{i}": _chunk(_forwarded_version(i, v), 2, rank, 0) for i in range(4)}
                st = snd.send(held, version=v)
                out.append((st.delta, st.wire_bytes, st.bytes, sorted(st.by_receiver)))
            return out
        rcv = gb.WeightReceiver(g)
        target = {f"w{i}": torch.zeros(FWD_SHAPE) for i in range(4)}
        exact = []
        for v in (1, 2, 3):
            rcv.receive_into(target, atomic=v != 2)
            exact.append(all(torch.equal(target[f"w{i}"], _forwarded_version(i, v)) for i in range(4)))
        return exact


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forward", [True, False], ids=["forwarded", "direct"])
def test_more_replicas_than_sources_take_the_rows_once_and_forward_them_along_a_chain(forward: bool) -> None:
    res = run_ranks(_forwarding, 6, CTX.Queue(), forward, timeout=80)
    for r in range(2, 6):
        assert res[r] == [True] * 3, res
    shard = 4 * FWD_SHAPE[0] // 2 * FWD_SHAPE[1] * 4
    for sent in res[:2]:
        full, *deltas = sent
        # the first sync: the source's rows left it once (forward=False: once per receiver); all took them
        assert full == (False, shard if forward else 4 * shard, 4 * shard, [2, 3, 4, 5]), sent
        assert all(d[0] and 0 < d[1] < (1 if forward else 4) * shard for d in deltas), sent  # deltas too


def _chain_cut(rank: int, ports: Any) -> Any:
    """Receiver 3 forwards source 0's rows to receiver 4; it dies midway through the second sync."""
    g = make_group(rank, 6, "127.0.0.1", ports, liveness_timeout=timedelta(seconds=2))
    try:
        held = {f"w{i}": _chunk(_forwarded_version(i, 1), 2, rank, 0) for i in range(4)} if rank < 2 else {}
        if rank < 2:
            snd = gb.WeightSender(g, transport="p2p")
            snd.send(held, version=1)
            t0 = time.monotonic()
            try:
                snd.send(held, version=2)
                return "sent"
            except gb.GroupBridgeError as e:
                return "failed", str(e), time.monotonic() - t0, True, None
        with inject_faults() as faults:
            rcv = gb.WeightReceiver(g)
            target = {f"w{i}": torch.zeros(FWD_SHAPE) for i in range(4)}
            rcv.receive_into(target)
            before = {k: v.clone() for k, v in target.items()}
            if rank == 3:
                landed = itertools.count()
                faults.land = lambda k, view: os._exit(3) if next(landed) == 3 else None
            t0 = time.monotonic()
            try:
                rcv.receive_into(target)
                return "received"
            except gb.GroupBridgeError as e:
                same = all(torch.equal(before[k], target[k]) for k in target)
                return "failed", str(e), time.monotonic() - t0, same, rcv.version
    finally:
        g.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_dies_mid_chain_leaves_every_target_untouched_and_is_named() -> None:
    survivors = [r for r in range(6) if r != 3]
    res = Ranks(_chain_cut, 6, (CTX.Queue(),)).results(50, expect=survivors)
    for r in survivors:
        ok, out = res[r]
        assert ok, out
        assert out[0] == "failed" and "rank 3" in out[1], res
        assert out[2] < 2 + 6, f"rank {r} raised after {out[2]:.1f}s"  # the liveness bound, not the timeout
        if r >= 2:
            assert out[3] is True and out[4] == 1, res  # its target untouched, version 1 still held


def _forwarder_fails(rank: int, ports: Any) -> Any:
    """Receiver 3 forwards source 0's rows to receiver 4; its own landing fails midway through the second
    sync. What it was passing on (a transport's buffers, sends on the wire) is let go with the failure, not
    kept for as long as its error is."""
    import gc

    from groupbridge.weights.transports.p2p import P2PTx

    with make_group(rank, 6, "127.0.0.1", ports, liveness_timeout=timedelta(seconds=2)) as g:
        held = {f"w{i}": _chunk(_forwarded_version(i, 1), 2, rank, 0) for i in range(4)} if rank < 2 else {}
        if rank < 2:
            snd = gb.WeightSender(g, transport="p2p")
            snd.send(held, version=1)
            with contextlib.suppress(gb.GroupBridgeError):
                snd.send(held, version=2)
            return None
        with inject_faults() as faults:
            rcv = gb.WeightReceiver(g)
            target = {f"w{i}": torch.zeros(FWD_SHAPE) for i in range(4)}
            rcv.receive_into(target)
            if rank == 3:
                landed = itertools.count()

                def fail(k: int, view: torch.Tensor) -> None:
                    if next(landed) == 2:
                        raise RuntimeError("injected: this receiver's landing failed")

                faults.land = fail
            try:
                rcv.receive_into(target)
                return "received"
            except gb.GroupBridgeError as e:
                error = e  # held, as a caller holding the error would
                gc.collect()
                holding = [tx for tx in gc.get_objects() if isinstance(tx, P2PTx) and tx._buffers._buffers]
                return type(error).__name__, len(holding)


@pytest.mark.timeout(60)
def test_a_forwarder_whose_receive_fails_lets_go_of_what_it_was_passing_on() -> None:
    res = run_ranks(_forwarder_fails, 6, CTX.Queue(), timeout=50)
    assert res[3][0].endswith("Error") and res[3][1] == 0, res


def _corrupt_hop(rank: int, ports: Any, checksum: bool) -> Any:
    """Receiver 3 passes source 0's rows on to receiver 4 with one byte flipped: receiver 4 checks what it
    took against the source's own digests (taken for a chain's streams with or without ``checksum``), so the
    sync is refused on every member, the group usable."""
    with make_group(rank, 6, "127.0.0.1", ports) as g:
        held = {f"w{i}": _chunk(_forwarded_version(i, 1), 2, rank, 0) for i in range(4)} if rank < 2 else {}
        with inject_faults() as faults:
            if rank == 3:
                faults.post = lambda k, view: view[:1].bitwise_xor_(1) if k == 1 else None
            end: Any
            if rank < 2:
                snd = gb.WeightSender(g, transport="p2p", checksum=checksum)
                try:
                    snd.send(held, version=1)
                    end = "sent"
                except gb.SyncRefusedError as e:
                    end = str(e)
                # the group goes on: the next sync lands everywhere, each receiver having taken every source's
                # digests of the refused one off the wire (a leftover would be compared with this sync's)
                snd.send({f"w{i}": _chunk(_forwarded_version(i, 2), 2, rank, 0) for i in range(4)}, version=2)
                return end
            rcv = gb.WeightReceiver(g)
            target = {f"w{i}": torch.zeros(FWD_SHAPE) for i in range(4)}
            try:
                rcv.receive_into(target)
                end = "received"
            except gb.SyncRefusedError as e:
                end = (str(e), all(not t.any() for t in target.values()))
            faults.post = None
            rcv.receive_into(target)
            return end, all(torch.equal(target[f"w{i}"], _forwarded_version(i, 2)) for i in range(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "defaults"])
def test_a_forwarder_that_corrupts_the_rows_is_caught_by_the_next_hop(checksum: bool) -> None:
    res = run_ranks(_corrupt_hop, 6, CTX.Queue(), checksum, timeout=50)
    for r in range(2):
        assert "rank 4: " in res[r] and "xxh3 mismatch" in res[r] and "passed on by rank 3" in res[r], res
    for r in range(2, 6):
        (text, untouched), exact = res[r]
        assert "xxh3 mismatch" in text and untouched and exact, res


def _cast(rank: int, ports: Any, atomic: bool, dtype: torch.dtype) -> Any:
    """Sources 0 and 1 send row halves of ``w`` (and each the whole ``b``) as bfloat16; receiver 2's
    targets are ``dtype``."""
    import zlib

    shapes = {"w": (12, 16), "b": (16,)}

    def full(name: str) -> torch.Tensor:
        return torch.randn(shapes[name], generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank < 2:
            with gb.WeightSender(g, bucket_bytes=1024, wire_dtype=torch.bfloat16) as snd:
                held = gb.Shard(full("w")[6 * rank : 6 * rank + 6].clone(), (12, 16), (6 * rank, 0))
                snd.send({"w": held, "b": full("b")}, version=1)
            return None
        rcv = gb.WeightReceiver(g, expected={k: (s, torch.bfloat16) for k, s in shapes.items()})
        target = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
        assert rcv.receive_into(target, atomic=atomic) == 1
        return all(torch.equal(target[k], full(k).to(torch.bfloat16).to(dtype)) for k in shapes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_many_sources_cast_into_targets_of_another_dtype(atomic: bool, dtype: torch.dtype) -> None:
    """The wire carries bfloat16; each target takes its values in its own dtype, streaming as atomic."""
    assert run_ranks(_cast, 3, CTX.Queue(), atomic, dtype, timeout=50)[2]


def _missing_target(rank: int, ports: Any) -> Any:
    """Two sources; the receiver's expected= names a tensor its receive_into target lacks."""
    with make_group(rank, 3, "127.0.0.1", ports) as g:
        try:
            if rank < 2:
                gb.WeightSender(g).send(_source(rank, 2, 1), version=1)
                return "sent"
            expected = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in ("w", "v", "b", "e")}
            target = {k: v for k, v in expected.items() if k != "e"}
            gb.WeightReceiver(g, expected=expected).receive_into(target)
            return "received"
        except gb.GroupBridgeError as e:
            return f"{type(e).__name__}: {e}"


@pytest.mark.timeout(60)
def test_a_many_source_receive_into_a_target_without_a_tensor_fails_every_member_quickly() -> None:
    t0 = time.monotonic()
    res = run_ranks(_missing_target, 3, CTX.Queue(), timeout=50)
    assert res[2].startswith("WeightSyncError: target has no tensor named e"), res
    for r in res[:2]:
        assert "rank 2 gave up receiving version 1" in r and "target has no tensor named e" in r, res
    assert time.monotonic() - t0 < 30, res


def _idle_source(rank: int, ports: Any) -> Any:
    """Sources 0 and 1 both hold the one-row ``v``; source 0 also holds ``w``. The plan takes ``v`` from the
    holder its name and the receiver pick, source 0 (``crc32("v")`` is even): source 1 sends no byte."""
    with make_group(rank, 3, "127.0.0.1", ports) as g:

        def model(v: int) -> dict[str, torch.Tensor]:
            return {"v": torch.full((1, 16), float(v)), "w": torch.arange(128.0).reshape(8, 16) * v}

        if rank < 2:
            with gb.WeightSender(g) as snd:
                held = model(1) if rank == 0 else {"v": model(1)["v"]}
                first = snd.send(held, version=1)
                second = snd.send(model(2) if rank == 0 else {"v": model(2)["v"]}, version=2)
                return first.bytes, second.bytes
        rcv = gb.WeightReceiver(g)
        target = {k: torch.zeros_like(t) for k, t in model(1).items()}
        exact = []
        for v in (1, 2):
            rcv.receive_into(target)
            exact.append(all(torch.equal(target[k], t) for k, t in model(v).items()))
        return exact


@pytest.mark.timeout(60)
def test_a_source_whose_tensors_all_come_from_another_holder_takes_part_and_sends_nothing() -> None:
    res = run_ranks(_idle_source, 3, CTX.Queue(), timeout=50)
    assert res[2] == [True, True], res
    assert res[1] == (0, 0) and res[0][0] > 0, res


def _per_stream(rank: int, ports: Any) -> Any:
    """One source, two receivers taking row halves of ``w``: each version rewrites every value of the top
    half and one of the bottom half. Once the sender's policy has seen a delta of each pair, the top half
    travels whole and the bottom half as a delta."""
    from groupbridge.weights import DeltaMemory

    def version(v: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(v)
        w = torch.zeros(64, 256)
        w[:32] = torch.randn(32, 256, generator=g)
        w[32:, 0] = v
        return w

    with make_group(rank, 3, "127.0.0.1", ports) as g:
        if rank == 0:
            memory = DeltaMemory()
            out = []
            with gb.WeightSender(g, delta=True, bucket_bytes=8192, memory=memory) as snd:
                for v in (1, 2, 3):
                    if v > 1:  # the link as a slow one measures (1 MB/s), the diff as this host does
                        p = snd._delta.policy  # type: ignore[union-attr]
                        p.full_spb, p.diff_spb, p.factor, p.full_syncs = 1e-6, 1e-9, 1.5, 2
                    st = snd.send({"w": version(v)}, version=v)
                    out.append((st.delta, st.changed_fraction, st.by_receiver))
            return out
        rows = slice(0, 32) if rank == 1 else slice(32, 64)
        offset = (0, 0) if rank == 1 else (32, 0)
        rcv = gb.WeightReceiver(g)
        target = torch.zeros(32, 256)
        exact = []
        for v in (1, 2, 3):
            rcv.receive_into({"w": gb.Shard(target, (64, 256), offset)})
            exact.append(torch.equal(target, version(v)[rows]))
        return exact


@pytest.mark.timeout(60)
def test_each_pair_of_a_source_takes_a_delta_only_where_its_own_bytes_pay_for_it() -> None:
    res = run_ranks(_per_stream, 3, CTX.Queue(), timeout=50)
    assert res[1] == res[2] == [True] * 3, res
    (d1, _, by), (d2, c2, _), (d3, c3, _) = res[0]
    assert by == {1: by[1], 2: by[1]} and not d1 and d2 and d3, res[0]
    assert c2 > 0.45, res[0]  # both halves diffed: every word of the top one changed, one in 256 of the other
    assert c3 < 0.01, res[0]  # only the bottom half diffed: the top one went whole
