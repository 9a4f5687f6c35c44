"""Weight sync with real processes: bit-exactness, manifests, versions, atomicity, faults, flatten_."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.testing import inject_faults
from groupbridge.weights.manifest import Manifest, compare, expected_specs, mismatch_message
from groupbridge.weights.plan import Plan
from tests.helpers import CTX, Ranks, host_params, make_group, run_ranks, share_port
from tests.weights_models import (
    bit_equal,
    dense_shapes,
    every_dtype,
    make_model,
    moe_shapes,
    zeros_like_model,
)

BUCKET = 4096

# ---------------------------------------------------------------- plan and manifest (one process)


def test_plan_is_aligned_and_covers_every_byte() -> None:
    sd = every_dtype()
    m = Manifest.build(list(sd.items()))
    plan = Plan.build(m, BUCKET)
    assert plan == Plan.build(Manifest.from_wire(m.to_wire()), BUCKET)  # both sides compute the same
    covered = 0
    for i, e in enumerate(m.entries):
        assert plan.offsets[i] % e.element_size == 0
        if e.alias_of:
            assert plan.offsets[i] == plan.offsets[[x.name for x in m.entries].index(e.alias_of)]
    for k, segs in enumerate(plan.buckets):
        start, end = plan.bucket_range(k)
        assert all(s.bucket_offset >= 0 and s.bucket_offset + s.nbytes <= end - start for s in segs)
        covered += sum(s.nbytes for s in segs)
    assert covered == m.nbytes
    big = next(i for i, e in enumerate(m.entries) if e.name == "big")
    assert sum(1 for segs in plan.buckets for s in segs if s.index == big) >= 3  # 12 kB over 4 kB buckets
    assert m.entries[-1].alias_of == "big"


def test_only_names_viewing_the_same_bytes_alike_are_tied() -> None:
    """Tensors at one address are tied only when shape, strides and dtype match too; an empty tensor, a
    prefix view or a transposed view at that address is a tensor of its own, and every tie names the first."""
    w = torch.arange(12.0).reshape(3, 4)
    m = Manifest.build(
        [("empty", w[:0]), ("w", w), ("row", w[0]), ("t", w.t()), ("tied", w), ("again", w.view(3, 4))]
    )
    assert {e.name: e.alias_of for e in m.entries} == {
        "empty": None,
        "w": None,
        "row": None,
        "t": None,
        "tied": "w",
        "again": "w",
    }


def test_a_source_described_again_keeps_its_manifest_only_while_it_describes_the_tensors() -> None:
    """A repeat send's new tensors of the same names, shapes and dtypes keep the last manifest (object and
    digest); a changed shape, dtype or name, or a tie between two names, is described anew."""
    from groupbridge.weights._described import Described

    class Quiet:
        log = logging.getLogger("test")

    described = Described(Quiet(), lambda name: name, None)  # type: ignore[arg-type]

    def tensors(**change: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {"a": torch.ones(3, 2), "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0))}
        out.update(change)
        return out

    def send(named: dict[str, Any]) -> Manifest:
        _, manifest, shards = described.describe(named, None)
        described.remember(manifest, shards)
        return manifest

    first = send(tensors())
    assert send(tensors()) is first
    shape = send(tensors(a=torch.ones(2, 3)))
    assert shape is not first and shape.entries[0].shape == (2, 3)
    dtype = send(tensors(a=torch.ones(2, 3, dtype=torch.float64)))
    assert dtype.entries[0].dtype == "float64"
    assert send({"c": torch.ones(2, 3, dtype=torch.float64), "b": tensors()["b"]}).entries[0].name == "c"
    a = torch.ones(2, 3, dtype=torch.float64)
    untied = send({"c": a, "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": a.clone()})
    assert [e.alias_of for e in untied.entries] == [None, None, None]
    assert send({"c": a.clone(), "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": a.clone()}) is untied
    tied = send({"c": a, "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": a})
    assert [e.alias_of for e in tied.entries] == [None, None, "c"]
    assert send({"c": a, "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": a}) is tied
    assert send({"c": a, "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": a.clone()}) is not tied
    with pytest.raises(TypeError, match="not a tensor"):
        send({"c": a, "b": gb.Shard(torch.ones(2, 2), (4, 2), (2, 0)), "d": 3})


def test_mismatch_message_lists_first_twenty_with_counts() -> None:
    sent = Manifest.build([(f"w{i}", torch.zeros(2)) for i in range(30)] + [("s", torch.zeros(3, 2))])
    expected = {f"x{i}": ((2,), "float32") for i in range(25)}
    expected["s"] = ((2, 3), "bfloat16")
    problems = compare(sent, expected)
    assert len(problems["missing"]) == 25 and len(problems["unexpected"]) == 30
    msg = mismatch_message(problems, "rank 1")
    assert (
        "25 missing" in msg
        and "... and 5 more" in msg
        and "30 unexpected" in msg
        and "... and 10 more" in msg
    )
    assert "s: sender [3, 2], receiver [2, 3]" in msg and "arrives as float32, receiver holds bfloat16" in msg


def test_expected_specs_forms() -> None:
    lin = torch.nn.Linear(3, 2)
    assert expected_specs(lin) == {"weight": ((2, 3), "float32"), "bias": ((2,), "float32")}
    assert expected_specs({"a": ((4,), torch.bfloat16)}) == {"a": ((4,), "bfloat16")}


def test_flatten_keeps_identity_values_and_ties() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    buf = gb.flatten_(model)
    assert list(model.parameters()) == params and isinstance(model[0].weight, torch.nn.Parameter)
    assert model[1].weight is model[0].weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


# ---------------------------------------------------------------- real processes


def _sync_every_dtype(rank: int, host: str, ports: Any, n: int, flat: str, mode: str) -> Any:
    g = make_group(rank, n, host, ports)
    try:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=BUCKET, checksum=True)
            out = []
            for v in (1, 2):
                sd = every_dtype(seed=v)
                if flat in ("sender", "both"):
                    gb.flatten_(sd)
                st = snd.send(sd, version=v)
                out.append((st.buckets, st.in_place_buckets))
            return out
        rcv = gb.WeightReceiver(g, src=0)
        results = []
        target = zeros_like_model(every_dtype())
        if flat in ("receiver", "both"):
            gb.flatten_(target)
        for v in (1, 2):
            want = every_dtype(seed=v)
            if mode == "receive":
                upd = rcv.receive()
                got = {name: t.clone() for name, t in upd}
                assert upd.version == v
            else:
                assert rcv.receive_into(target, atomic=(mode == "atomic")) == v
                got = target
            results.append(
                all(bit_equal(got[k], want[k].contiguous()) for k in want) and set(got) == set(want)
            )
        results.append(rcv.version)
        assert target["tied"] is target["big"]
        return results
    finally:
        g.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("n", "flat", "mode"),
    [
        (2, "neither", "atomic"),
        (3, "neither", "streaming"),
        (3, "sender", "atomic"),
        (2, "receiver", "streaming"),
        (3, "both", "streaming"),
        (2, "both", "atomic"),
        (3, "neither", "receive"),
    ],
)
def test_every_dtype_bit_exact(n: int, flat: str, mode: str) -> None:
    res = run_ranks(_sync_every_dtype, n, "127.0.0.1", CTX.Queue(), n, flat, mode, timeout=80)
    for r in range(1, n):
        assert res[r] == [True, True, 2], res
    if flat in ("sender", "both"):
        assert all(b == inplace for b, inplace in res[0]), res[0]  # every bucket sent in place
    if flat == "both" and mode == "streaming":
        assert all(b == 1 for b, _ in res[0]), res[0]  # every side in place: one merged operation


def _sync_shape(rank: int, host: str, ports: Any, n: int, shape: str) -> bool:
    shapes = (
        dense_shapes(scale=16, layers=4) if shape == "dense" else moe_shapes(scale=16, layers=2, experts=8)
    )
    with make_group(rank, n, host, ports) as g:
        if rank == 0:
            gb.WeightSender(g, transport="broadcast", bucket_bytes=64 << 10).send(
                make_model(shapes, seed=1), version=3
            )
            return True
        target = make_model(shapes, seed=2)
        gb.WeightReceiver(g, src=0).receive_into(target)
        want = make_model(shapes, seed=1)
        return all(bit_equal(target[k], want[k]) for k in want)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shape", ["dense", "moe"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("host", host_params())
def test_model_shapes_scaled_down(shape: str, n: int, host: str) -> None:
    assert all(run_ranks(_sync_shape, n, host, CTX.Queue(), n, shape, timeout=80))


def _mismatch(rank: int, host: str, ports: Any) -> Any:
    with make_group(rank, 3, host, ports) as g:
        sd = {f"w{i}": torch.full((2,), float(i)) for i in range(25)} | {"s": torch.zeros(3, 2)}
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast")
            try:
                snd.send(sd, version=1)
                return "sent"
            except gb.ManifestMismatchError as e:
                first = str(e)
            snd.send(sd, version=2)  # the group is still usable
            return first
        target = {k: v.clone() for k, v in sd.items()}
        if rank == 1:
            expected: dict[str, Any] = {f"x{i}": ((2,), torch.float32) for i in range(22)} | {
                "s": ((2, 3), torch.float32)
            }
        else:
            expected = {k: (tuple(v.shape), torch.bfloat16) for k, v in sd.items()}
        rcv = gb.WeightReceiver(g, src=0, expected=expected)
        before = {k: v.clone() for k, v in target.items()}
        try:
            rcv.receive_into(target)
            return "received"
        except gb.ManifestMismatchError as e:
            msg = str(e)
        untouched = all(torch.equal(before[k], target[k]) for k in target)
        rcv.expected = None
        version = rcv.receive_into(target)
        return msg, untouched, version


@pytest.mark.timeout(60)
def test_manifest_mismatch_everyone_raises_before_bytes_move() -> None:
    res = run_ranks(_mismatch, 3, "127.0.0.1", CTX.Queue(), timeout=50)
    assert (
        "rank 1:" in res[0] and "rank 2:" in res[0] and "22 missing" in res[0] and "... and 2 more" in res[0]
    )
    assert "shape mismatches" in res[0] and "dtype mismatches" in res[0] and "arrives as float32" in res[0]
    for r in (1, 2):
        msg, untouched, version = res[r]
        assert msg == res[0] and untouched and version == 2


def _versions(rank: int, host: str, ports: Any) -> Any:
    with make_group(rank, 2, host, ports) as g:
        sd = {"w": torch.arange(4.0)}
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast")
            snd.send(sd, version=5)
            try:
                snd.send(sd, version=5)
            except gb.WeightSyncError as e:
                stale = str(e)
            snd.send(sd, version=5)  # the receiver allows it this time
            return stale
        rcv = gb.WeightReceiver(g, src=0)
        t = {"w": torch.zeros(4)}
        rcv.receive_into(t)
        try:
            rcv.receive_into(t)
        except gb.WeightSyncError as e:
            stale = str(e)
        rcv.receive_into(t, allow_stale=True)
        return stale, rcv.version


@pytest.mark.timeout(60)
def test_versions_must_be_newer_unless_allowed() -> None:
    res = run_ranks(_versions, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert "holds version 5; version 5 is not newer" in res[0]
    assert "not newer" in res[1][0] and res[1][1] == 5


def _wire_and_rename(rank: int, host: str, ports: Any) -> bool:
    master = {
        "layer.w": torch.randn(64, 8, generator=torch.Generator().manual_seed(3)),
        "step": torch.tensor(7),
    }
    with make_group(rank, 2, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(
                g, transport="broadcast", wire_dtype=torch.bfloat16, rename={"layer.w": "engine.w"}
            )
            snd.send(master, version=1)
            return True
        engine = {"w": torch.zeros(64, 8, dtype=torch.bfloat16), "step": torch.tensor(0)}
        gb.WeightReceiver(g, src=0, rename=lambda n: n.removeprefix("engine.")).receive_into(engine)
        return bit_equal(engine["w"], master["layer.w"].to(torch.bfloat16)) and int(engine["step"]) == 7


@pytest.mark.timeout(60)
def test_wire_dtype_and_rename() -> None:
    assert all(run_ranks(_wire_and_rename, 2, "127.0.0.1", CTX.Queue(), timeout=50))


def _lazy(rank: int, host: str, ports: Any) -> Any:
    shapes = [(f"p{i}", (256,)) for i in range(64)]  # 1 kB each; 4 kB buckets
    alive: list[int] = [0, 0]  # (now, peak)

    def gathered(seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes:
            t = torch.full(shape, float(seed))
            alive[0] += 1
            alive[1] = max(alive[1], alive[0])
            weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
            yield name, t
            del t

    with make_group(rank, 2, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=BUCKET)
            snd.send(gathered(1), version=1, specs={n: (s, torch.float32) for n, s in shapes})
            snd.send(gathered(2), version=2)  # the manifest of the previous send
            return alive[1]
        target = {n: torch.zeros(s) for n, s in shapes}
        rcv = gb.WeightReceiver(g, src=0)
        rcv.receive_into(target)
        rcv.receive_into(target, atomic=False)
        return all(bool((t == 2.0).all()) for t in target.values())


@pytest.mark.timeout(60)
def test_lazy_generator_never_holds_the_model() -> None:
    peak, ok = run_ranks(_lazy, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert ok
    assert peak <= 12, peak  # about two buckets' worth (4 per bucket), never the 64 tensors


# ---------------------------------------------------------------- faults


def _corrupt(rank: int, host: str, ports: Any, checksum: bool | str = True) -> Any:
    with make_group(rank, 2, host, ports) as g:
        sd = every_dtype(seed=1)
        if rank == 0:
            with inject_faults() as faults:
                faults.post = lambda k, view: view[:16].zero_() if k == 1 else None
                snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=BUCKET, checksum=checksum)
                try:
                    snd.send(sd, version=1)
                except gb.WeightSyncError as e:
                    return str(e)
            return "no error"
        target = zeros_like_model(sd)
        rcv = gb.WeightReceiver(g, src=0)
        try:
            rcv.receive_into(target)
        except gb.WeightSyncError as e:
            return str(e), all(bool((t == 0).all()) for t in target.values()), rcv.version
        return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksum", [True, "mix64"])
def test_corrupted_bucket_detected(checksum: bool | str) -> None:
    """XXH3 (host tensors' checksum) and mix64 (the one computed on a device, run here on the CPU) alike."""
    res = run_ranks(_corrupt, 2, "127.0.0.1", CTX.Queue(), checksum, timeout=50)
    msg, untouched, version = res[1]
    kind = "xxh3" if checksum is True else checksum
    assert f"{kind} mismatch in bucket(s) 1" in msg and "corrupted, short" in msg
    assert untouched and version is None
    assert "not committed on any receiver" in res[0] and "rank 1" in res[0]


def _killed(rank: int, host: str, ports: Any, victim: int, atomic: bool) -> Any:
    g = make_group(rank, 3, host, ports, liveness_timeout=timedelta(seconds=2))
    sd = make_model([(f"w{i}", (64, 64)) for i in range(64)], seed=1)  # 512 kB over 16 kB buckets
    t0 = time.monotonic()
    try:
        if rank == 0:
            # with digests, receivers accept nothing before the sender's last word: a dead member anywhere
            # leaves every target untouched (atomic) whatever arrived
            with inject_faults() as faults:
                snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10, checksum=True)
                snd.send(sd, version=1)
                if victim == 0:
                    faults.post = lambda k, view: os._exit(3) if k == 10 else time.sleep(0.05)
                snd.send(make_model([(f"w{i}", (64, 64)) for i in range(64)], seed=2), version=2)
            return "finished"
        target = make_model([(f"w{i}", (64, 64)) for i in range(64)], seed=0)
        rcv = gb.WeightReceiver(g, src=0)
        rcv.receive_into(target)
        before = {k: v.clone() for k, v in target.items()}
        if rank == victim:
            upd = rcv.receive()
            for i, _ in enumerate(upd):
                if i == 5:
                    os._exit(3)
        try:
            rcv.receive_into(target, atomic=atomic)
            return "finished"
        except gb.TornUpdateError as e:
            changed = sorted(k for k in target if not torch.equal(before[k], target[k]))
            return "torn", str(e), set(changed) <= set(e.written), rcv.version, time.monotonic() - t0
        except gb.WeightSyncError as e:
            same = all(torch.equal(before[k], target[k]) for k in target)
            return "failed", str(e), same, rcv.version, time.monotonic() - t0
    except gb.GroupBridgeError as e:
        return "sender failed", str(e), time.monotonic() - t0
    finally:
        g.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_sender_killed_mid_sync(atomic: bool) -> None:
    res = Ranks(_killed, 3, ("127.0.0.1", CTX.Queue(), 0, atomic)).results(45, expect=[1, 2])
    for r in (1, 2):
        status, value = res[r]
        assert status, value
        if atomic:
            kind, msg, untouched, version, took = value
            assert kind == "failed" and untouched and "untouched" in msg and "still 1" in msg
        else:
            kind, msg, within_written, version, took = value
            assert kind == "torn" and "TORN" in msg and within_written
        assert version == 1 and took < 20


@pytest.mark.timeout(60)
def test_receiver_killed_mid_sync() -> None:
    res = Ranks(_killed, 3, ("127.0.0.1", CTX.Queue(), 2, True)).results(45, expect=[0, 1])
    status, value = res[0]
    assert status and value[0] == "sender failed" and value[2] < 20, value
    status, value = res[1]
    assert status and value[0] == "failed", value
    assert value[2] and value[3] == 1 and value[4] < 20, value  # untouched, still version 1, promptly


def _one_refuses(rank: int, host: str, ports: Any) -> Any:
    """Rank 2's bytes of version 2 fail their digests (its transport changes one bucket as it lands): one
    commit, so rank 1, whose bytes were fine, does not take version 2 either."""
    shapes = [(f"w{i}", (64, 64)) for i in range(16)]
    with make_group(rank, 3, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10, checksum=True)
            snd.send(make_model(shapes, seed=1), version=1)
            try:
                snd.send(make_model(shapes, seed=2), version=2)
                second = "sent"
            except gb.SyncRefusedError as e:
                second = str(e)
            snd.send(make_model(shapes, seed=3), version=3)  # the group goes on
            return second
        target = make_model(shapes, seed=0)
        with inject_faults() as faults:
            rcv = gb.WeightReceiver(g, src=0)
            rcv.receive_into(target)
            before = {k: v.clone() for k, v in target.items()}
            if rank == 2:
                faults.land = lambda k, view: view[:8].add_(1) if k == 2 else None
            try:
                rcv.receive_into(target)
                second = "received"
            except gb.SyncRefusedError as e:
                same = all(torch.equal(before[k], target[k]) for k in target)
                second = (str(e), same, rcv.version)
            faults.land = None
            rcv.receive_into(target)
        return (
            second,
            rcv.version,
            all(torch.equal(target[k], t) for k, t in make_model(shapes, seed=3).items()),
        )


@pytest.mark.timeout(60)
def test_a_receiver_whose_bytes_fail_their_digests_leaves_every_receiver_on_the_old_version() -> None:
    res = run_ranks(_one_refuses, 3, "127.0.0.1", CTX.Queue(), timeout=50)
    assert "not committed on any receiver" in res[0] and "rank 2: xxh3 mismatch" in res[0], res[0]
    assert "rank 1:" not in res[0], res[0]
    for rank in (1, 2):
        (msg, untouched, held), version, exact = res[rank]
        assert "untouched" in msg and "still 1" in msg and untouched and held == 1, res[rank]
        assert version == 3 and exact, res[rank]  # the next sync lands on both


def _dies_before_the_vote(rank: int, host: str, ports: Any) -> Any:
    """Rank 2 lands every byte of version 2, then dies before it votes (killed where the vote is taken)."""
    import groupbridge.weights._receive as receive

    g = make_group(rank, 3, host, ports, liveness_timeout=timedelta(seconds=2))
    shapes = [(f"w{i}", (64, 64)) for i in range(16)]
    try:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10)
            snd.send(make_model(shapes, seed=1), version=1)
            t0 = time.monotonic()
            try:
                snd.send(make_model(shapes, seed=2), version=2)
                return "finished"
            except gb.GroupBridgeError as e:
                return "failed", str(e), time.monotonic() - t0
        target = make_model(shapes, seed=0)
        rcv = gb.WeightReceiver(g, src=0)
        rcv.receive_into(target)
        before = {k: v.clone() for k, v in target.items()}
        if rank == 2:
            receive.vote = lambda *args, **kwargs: os._exit(3)  # type: ignore[assignment]
        t0 = time.monotonic()
        try:
            rcv.receive_into(target)
            return "finished"
        except gb.WeightSyncError as e:
            same = all(torch.equal(before[k], target[k]) for k in target)
            return "failed", str(e), time.monotonic() - t0, same, rcv.version
    finally:
        g.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_dies_before_the_vote_leaves_every_receiver_on_the_old_version() -> None:
    """One commit with one sender: rank 1 landed every byte and would apply it, but rank 2 never voted;
    rank 1 keeps version 1, its target untouched, and says who died within the liveness bound."""
    res = Ranks(_dies_before_the_vote, 3, ("127.0.0.1", CTX.Queue())).results(45, expect=[0, 1])
    status, value = res[1]
    assert status and value[0] == "failed", value
    _, msg, took, untouched, version = value
    assert "rank 2" in msg and "untouched" in msg and untouched and version == 1, value
    assert took < 2 + 5, value
    status, value = res[0]
    assert status and value[0] == "failed" and "rank 2" in value[1] and value[2] < 2 + 5, value


# ---------------------------------------------------------------- several trainer ranks


def _trainer_and_worker(rank: int, host: str, ports: Any, gports: Any) -> Any:
    """Ranks 0, 1: a trainer world of 2; rank 2: a worker. Only trainer rank 0 is in the bridge."""
    import torch.distributed as dist

    shapes = [(f"layer{i}.w", (32, 16)) for i in range(12)]
    if rank < 2:
        lis, port = share_port(rank, 2, gports, host)
        if lis is not None:
            gb.init_global_group(rank=0, world_size=2, listener=lis, timeout=timedelta(seconds=30))
        else:
            gb.init_global_group(
                rank=1, world_size=2, init_method=f"tcp://{host}:{port}", timeout=timedelta(seconds=30)
            )

        def gathered() -> Iterator[tuple[str, torch.Tensor]]:
            # stands in for FSDP's per-parameter all-gather: a collective every trainer rank must join
            for i, (name, shape) in enumerate(shapes):
                shard = torch.full((shape[0] // 2, shape[1]), float(i * 10 + dist.get_rank()))
                full = [torch.empty_like(shard) for _ in range(2)]
                dist.all_gather(full, shard)
                yield name, torch.cat(full)

        if rank == 0:
            with make_group(0, 2, host, ports) as g:
                gb.WeightSender(g, transport="broadcast", bucket_bytes=BUCKET).send(gathered(), version=1)
        else:
            for _ in gathered():  # drive the same generator so the all_gathers stay matched; drop the tensors
                pass
        gb.destroy_global_group()
        return True
    with make_group(1, 2, host, ports) as g:
        target = {n: torch.zeros(s) for n, s in shapes}
        gb.WeightReceiver(g, src=0).receive_into(target)
        return all(
            bool((t[:16] == i * 10).all() and (t[16:] == i * 10 + 1).all())
            for i, t in enumerate(target.values())
        )


@pytest.mark.timeout(60)
def test_several_trainer_ranks_only_the_sender_in_the_bridge() -> None:
    assert all(run_ranks(_trainer_and_worker, 3, "127.0.0.1", CTX.Queue(), CTX.Queue(), timeout=50))


def _ack_lost(rank: int, ports: Any) -> str:
    """Rank 1's acknowledgement cannot be sent (its store connection fails at that moment)."""
    with make_group(rank, 2, "127.0.0.1", ports, timeout=timedelta(seconds=10)) as g:
        model = {"w": torch.arange(1024, dtype=torch.float32)}
        if rank == 0:
            try:
                gb.WeightSender(g).send(model, version=1, timeout=timedelta(seconds=5))
                return "sent"
            except gb.GroupBridgeError as e:
                return type(e).__name__

        def failing_ack(*args: Any, **kwargs: Any) -> None:  # the acknowledgements' collective
            raise gb.StoreUnreachableError("injected: the store did not answer")

        g.gather_obj = failing_ack  # type: ignore[method-assign]
        target = {"w": torch.zeros(1024)}
        try:
            gb.WeightReceiver(g, src=0).receive_into(target)
            return "returned normally"
        except gb.WeightSyncError as e:
            return str(e)


@pytest.mark.timeout(60)
def test_an_acknowledgement_that_cannot_be_sent_fails_the_receive() -> None:
    """It was logged at DEBUG and the receive returned as if the sync had succeeded, while the sender failed
    it for want of that acknowledgement."""
    res = run_ranks(_ack_lost, 2, CTX.Queue(), timeout=50)
    assert res[0] != "sent", res
    assert "holds version 1, but could not acknowledge it" in res[1] and "injected" in res[1], res


def _kept(rank: int, ports: Any, transport: str) -> Any:
    """``receive(keep=True)``: whole tensors as views of one buffer kept across syncs, all valid until the
    update ends (a loader may hold them), a tensor larger than a bucket included, never re-assembled; an empty
    tensor is one of its own (a view of the kept buffer would keep it alive in whoever holds the tensor)."""
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        shapes = [("big", (40000,)), ("w", (64, 64)), ("b", (64,)), ("z", (0, 4))]  # big: 160 kB
        if rank == 0:
            with gb.WeightSender(g, transport=transport, bucket_bytes=32 << 10) as snd:
                for v in (1, 2):
                    snd.send(make_model(shapes, seed=v), version=v)
            return None
        rcv = gb.WeightReceiver(g)
        out = []
        for v in (1, 2):
            upd = rcv.receive(keep=True)
            held = list(upd)  # no copies: every view must still hold its bytes at the end
            want = make_model(shapes, seed=v)
            storages = {t.untyped_storage().data_ptr() for _, t in held if t.numel()}
            fresh = [t.untyped_storage().nbytes() == 0 for _, t in held if not t.numel()]
            out.append((upd.kept, len(storages), all(torch.equal(t, want[n]) for n, t in held), fresh))
        return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_receive_keep_yields_views_of_one_kept_buffer(transport: str) -> None:
    res = run_ranks(_kept, 2, CTX.Queue(), transport, timeout=50)
    assert res[1] == [(True, 1, True, [True]), (True, 1, True, [True])], res


def _written(rank: int, ports: Any, transport: str) -> Any:
    """receive() without keep; the consumer writes into every tensor it is given (its own to use)."""
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        shapes = [("big", (40000,)), ("w", (64, 64)), ("b", (64,))]
        if rank == 0:
            with gb.WeightSender(g, transport=transport, bucket_bytes=32 << 10) as snd:
                snd.send(make_model(shapes, seed=1), version=1)
                return snd.send(make_model(shapes, seed=2), version=2).transport
        rcv = gb.WeightReceiver(g)
        out = []
        for v in (1, 2):
            want, ok = make_model(shapes, seed=v), []
            for name, t in rcv.receive():
                ok.append(torch.equal(t, want[name]))
                t.mul_(2)  # a view of a mapping of the sender's memory would be read-only: SIGSEGV
            out.append(all(ok))
        return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_receive_yields_tensors_of_the_receivers_own_memory(transport: str) -> None:
    """receive() never yields a view of the sender's shared slot (over shm a read-only mapping: a consumer
    that wrote into a yielded tensor was killed by SIGSEGV); both versions arrive whole."""
    res = run_ranks(_written, 2, CTX.Queue(), transport, timeout=50)
    assert res == [transport, [True, True]], res


def _two_sends(rank: int, host: str, ports: Any) -> Any:
    import threading

    shapes = [(f"w{i}", (16, 16)) for i in range(4)]
    with make_group(rank, 2, host, ports) as g:
        if rank == 1:
            rcv = gb.WeightReceiver(g, src=0)
            target = make_model(shapes, seed=0)
            rcv.receive_into(target)
            return rcv.version
        snd = gb.WeightSender(g)
        pulling, go = threading.Event(), threading.Event()

        def held() -> Iterator[tuple[str, torch.Tensor]]:
            for i, (name, t) in enumerate(make_model(shapes, seed=1).items()):
                if i == 1:
                    pulling.set()
                    go.wait(20)
                yield name, t

        specs = {n: (tuple(t.shape), t.dtype) for n, t in make_model(shapes, seed=1).items()}
        t = threading.Thread(target=snd.send, args=(held(), 1), kwargs={"specs": specs})
        t.start()
        assert pulling.wait(20)
        try:
            snd.send(make_model(shapes, seed=2), version=2)
            refused = "sent"
        except RuntimeError as e:
            refused = str(e)
        go.set()
        t.join(30)
        return refused


@pytest.mark.timeout(60)
def test_a_second_send_on_one_sender_is_refused_while_the_first_runs() -> None:
    res = run_ranks(_two_sends, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert "already running" in res[0] and "version 2 not sent" in res[0], res
    assert res[1] == 1, res


def _two_receives(rank: int, host: str, ports: Any) -> Any:
    shapes = [(f"w{i}", (16, 16)) for i in range(4)]
    with make_group(rank, 2, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g)
            for v in (1, 2, 3):
                snd.send(make_model(shapes, seed=v), version=v)
            return "sent"
        rcv = gb.WeightReceiver(g, src=0)
        refused = []
        update = rcv.receive()  # open until read to the end
        for call in (lambda: rcv.receive(), lambda: rcv.receive_into(make_model(shapes, seed=0))):
            try:
                call()
            except RuntimeError as e:
                refused.append(str(e))
        got = {n: t.clone() for n, t in update}  # views valid until the next bucket: copied
        target = make_model(shapes, seed=0)
        rcv.receive_into(target)  # the first one read to the end: the next begins
        with rcv.receive() as third:
            last = {n: t.clone() for n, t in third}
        return (
            refused,
            rcv.version,
            [torch.equal(got[n], make_model(shapes, seed=1)[n]) for n in got],
            [torch.equal(target[n], make_model(shapes, seed=2)[n]) for n in target],
            sorted(last) == sorted(target),
        )


@pytest.mark.timeout(60)
def test_a_second_receive_on_one_receiver_is_refused_while_the_first_runs() -> None:
    """A receive() whose update is not yet read, then a second receive() and a receive_into() on the same
    receiver: each refused at once (it would take the first's buckets); the first reads to the end, and
    later receives go on."""
    res = run_ranks(_two_receives, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    refused, version, first, second, third = res[1]
    assert len(refused) == 2 and all("a receive is already running" in r for r in refused), refused
    assert version == 3 and all(first) and all(second) and third, res


def _announced(rank: int, host: str, ports: Any, sources: int) -> Any:
    """A sender announces a 256 GiB tensor (a stride-0 view of 4 bytes): receive(), which allocates from the
    announced sizes, refuses it before anything is allocated, on every member; the group goes on."""
    huge = 1 << 36  # float32 elements: 256 GiB, more than any host this runs on
    with make_group(rank, sources + 1, host, ports) as g:
        if rank < sources:
            snd = gb.WeightSender(g, transport="broadcast" if sources == 1 else "auto")
            big: Any = torch.zeros(1).expand(huge)
            if sources > 1:  # each holds half of it, a stride-0 view too
                big = gb.Shard(torch.zeros(1).expand(huge // 2), (huge,), (huge // 2 * rank,))
            try:
                snd.send({"big": big, "w": torch.ones(4)}, version=1)
                first = "sent"
            except gb.SyncRefusedError as e:
                first = str(e)
            snd.send({"w": torch.full((4,), 2.0)}, version=2)
            try:  # 4 MiB: it fits this host, not the receiver's own cap
                snd.send({"w": torch.full((4,), 3.0), "x": torch.zeros(1 << 20)}, version=3)
                capped = "sent"
            except gb.SyncRefusedError as e:
                capped = str(e)
            return first, capped
        rcv = gb.WeightReceiver(g)
        try:
            dict(rcv.receive())
            first = "received"
        except gb.SyncRefusedError as e:
            first = str(e)
        got = dict(rcv.receive())
        try:
            dict(rcv.receive(accept=lambda m: f"{m.nbytes} bytes > 1 MiB" if m.nbytes > 1 << 20 else None))
            capped = "received"
        except gb.SyncRefusedError as e:
            capped = str(e)
        return first, rcv.version, bool((got["w"] == 2.0).all()), capped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sources", [1, 2])
def test_receive_refuses_announced_sizes_beyond_this_hosts_memory_or_its_own_cap(sources: int) -> None:
    res = run_ranks(_announced, sources + 1, "127.0.0.1", CTX.Queue(), sources, timeout=50)
    for r in range(sources):
        first, capped = res[r]
        assert "256.0 GiB" in first and "more than this host's memory" in first, res
        assert "4194320 bytes > 1 MiB" in capped, res  # a cap of the receiver's own, through accept=
    first, version, exact, capped = res[sources]
    assert "256.0 GiB" in first and "nothing is allocated" in first, first
    assert version == 2 and exact, res
    assert "4194320 bytes > 1 MiB" in capped, res


def _out_of_memory(rank: int, host: str, ports: Any, sources: int) -> Any:
    """The receiver cannot allocate its staging buffer (its address space is capped just before): it raises
    a WeightSyncError saying so, and every sender raises within the liveness bound, naming it."""
    import resource

    shapes = [(f"w{i}", (2048, 2048)) for i in range(8)]  # 128 MiB
    g = make_group(rank, sources + 1, host, ports, liveness_timeout=timedelta(seconds=2))
    try:
        if rank < sources:
            model = make_model(shapes, seed=1)
            mine: Any = model
            if sources > 1:
                mine = {n: gb.Shard(t[1024 * rank : 1024 * (rank + 1)].clone(), t.shape, (1024 * rank, 0))
                        for n, t in model.items()}  # fmt: skip
            t0 = time.monotonic()
            try:
                gb.WeightSender(g, transport="broadcast" if sources == 1 else "p2p").send(mine, version=1)
                return "sent"
            except gb.GroupBridgeError as e:
                return str(e), time.monotonic() - t0
        target = make_model(shapes, seed=0)
        rcv = gb.WeightReceiver(g)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.RLIM_INFINITY))
        try:
            rcv.receive_into(target, atomic=True)
            return "received"
        except gb.WeightSyncError as e:
            return type(e).__name__, str(e)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    finally:
        g.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sources", [1, 2])
def test_a_receiver_that_cannot_allocate_tells_every_sender(sources: int) -> None:
    res = run_ranks(_out_of_memory, sources + 1, "127.0.0.1", CTX.Queue(), sources, timeout=50)
    kind, msg = res[sources]
    assert kind == "WeightSyncError" and "could not allocate" in msg, res[sources]
    for r in range(sources):
        text, took = res[r]
        assert "rank" in text and str(sources) in text and took < 2 + 5, res[r]


def _out_of_range(rank: int, host: str, ports: Any) -> Any:
    shapes = [("w", (4, 4))]
    with make_group(rank, 2, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g)
            try:
                snd.send(make_model(shapes, seed=1), version=1 << 62)
                first = "sent"
            except ValueError as e:
                first = str(e)
            snd.send(make_model(shapes, seed=2), version=(1 << 62) - 1)  # the largest: it carries
            return first
        rcv = gb.WeightReceiver(g, src=0)
        target = make_model(shapes, seed=0)
        try:
            rcv.receive_into(target)
            first = "received"
        except gb.WeightSyncError as e:
            first = str(e)
        rcv.receive_into(target)
        return first, rcv.version


@pytest.mark.timeout(60)
def test_a_version_out_of_range_is_refused_before_it_moves_and_the_largest_carries() -> None:
    """A version past 2**62 - 1 (a buggy counter) is refused by the sender before any byte moves, the
    receiver told; the largest version travels, and a verdict can carry it back."""
    from groupbridge.weights._header import MAX_VERSION, Verdict

    res = run_ranks(_out_of_range, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert "out of range" in res[0], res
    assert "out of range" in res[1][0] and res[1][1] == MAX_VERSION, res
    wire = Verdict("a newer version is held", "stale", holds=MAX_VERSION).to_wire()
    assert Verdict.from_wire(wire, 1).holds == MAX_VERSION  # it used to be refused as malformed
