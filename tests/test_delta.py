"""Delta sync: the bucket codec (one process) and whole syncs with real processes: bit-exactness for every
dtype and receive mode, receivers that do not hold the base, corruption, a sender killed midway."""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.errors import ProtocolError
from groupbridge.testing import inject_faults
from groupbridge.weights import _delta
from groupbridge.weights._delta import Code
from tests.helpers import CTX, Ranks, make_group, run_ranks
from tests.weights_models import bit_equal, every_dtype, zeros_like_model

BUCKET = 4096
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# ---------------------------------------------------------------- the codec (one process)


def _flip(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with the lowest bit of ``frac`` of its words flipped."""
    out = t.detach().contiguous().clone()
    words = out.reshape(-1).view(_WORDS[out.element_size()])
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(words.numel(), generator=g)[: max(1, int(words.numel() * frac))]
    words[idx] ^= 1
    return out


@pytest.mark.parametrize("impl", ["numpy", "torch"])
@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize(("frac", "code"), [(0.0, Code.SAME), (1e-5, Code.INDEX), (0.01, Code.GAPS),
                                            (0.2, Code.BITS), (0.999, Code.DENSE)])  # fmt: skip
def test_codec_round_trip(impl: str, w: int, frac: float, code: Code) -> None:
    n = 200_003 if code is not Code.INDEX else 1 << 20  # sparse enough that gaps overflow 16 bits
    base = torch.randint(-(2**62), 2**62, (n * w // 8 + 1,), dtype=torch.int64).view(torch.uint8)[: n * w]
    new = _flip(base.view(_WORDS[w]), frac, 1).view(torch.uint8) if frac else base.clone()
    sender_base, receiver_base = base.clone(), base.clone()
    if impl == "torch":  # the path taken for device tensors, run here on CPU
        enc = _delta._encode_torch(new.view(_WORDS[w]), sender_base.view(_WORDS[w]), w, n)
    else:
        enc = _delta.encode(new, sender_base, w)
    assert enc.code is code, enc.code
    assert torch.equal(sender_base, new)  # the sender's base is brought up to the new version
    payload = enc.payload if enc.payload is not None else (new if code is Code.DENSE else new[:0])
    assert payload.numel() == _delta.payload_nbytes(code, enc.count, n, w)
    if impl == "torch" and code not in (Code.SAME, Code.DENSE):
        pos = _delta._apply_torch(receiver_base.view(_WORDS[w]), payload, code, enc.count, n, w)
    else:
        pos = _delta.apply(receiver_base, payload, code, enc.count, w)
    assert torch.equal(receiver_base, new)
    assert enc.count == int((new.view(_WORDS[w]) != base.view(_WORDS[w])).sum())
    assert pos.numel() == (n if code is Code.DENSE else enc.count)  # dense: every word may have changed


def test_codec_sees_bit_changes_that_compare_equal() -> None:
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0  # == 0.0, but another bit pattern
    new.view(torch.int32)[1] = 0x7FC00001  # another NaN
    b = base.view(torch.uint8).clone()
    enc = _delta.encode(new.view(torch.uint8), b, 4)
    assert enc.count == 2 and bit_equal(b.view(torch.float32), new)


@pytest.mark.parametrize(
    ("code", "count", "mutate", "words"),
    [
        (Code.GAPS, 3, lambda p: p[:6].view(torch.int16).copy_(torch.tensor([1, 0, 1])), 100),  # repeated
        (
            Code.GAPS,
            3,
            lambda p: p[:6].view(torch.int16).copy_(torch.tensor([90, 9, 2])),
            100,
        ),  # 100: past end
        (Code.INDEX, 2, lambda p: p[:8].view(torch.int32).copy_(torch.tensor([5, -1])), 100),
        (Code.INDEX, 2, lambda p: p[:8].view(torch.int32).copy_(torch.tensor([7, 7])), 100),
        (Code.BITS, 2, lambda p: p[:1].fill_(7), 100),  # three bits set, two values
    ],
)
def test_codec_refuses_hostile_payloads(code: Code, count: int, mutate: Any, words: int) -> None:
    base = torch.zeros(words * 2, dtype=torch.uint8)
    payload = torch.zeros(_delta.payload_nbytes(code, count, words, 2), dtype=torch.uint8)
    mutate(payload)
    with pytest.raises(ProtocolError):
        _delta.apply(base, payload, code, count, 2)
    assert not base.any()  # nothing written
    with pytest.raises(ProtocolError, match="needs"):
        _delta.apply(base, payload[:-1], code, count, 2)  # a size that does not follow from the count
    with pytest.raises(ProtocolError, match="claims"):
        _delta.apply(base, payload, code, words + 1, 2)


# ---------------------------------------------------------------- whole syncs


def _versions() -> list[dict[str, torch.Tensor]]:
    """Versions 1-4 of the every-dtype model: 2 and 3 change a few bits of every tensor (a -0.0 for a 0.0 and
    another NaN among them), 4 changes nothing."""
    v1 = every_dtype(seed=1)
    for name, t in v1.items():
        if t.is_floating_point() and t.is_contiguous() and t.numel() >= 2 and name != "tied":
            t.view(-1)[0], t.view(-1)[1] = 0.0, float("nan")
    out = [v1]
    for seed in (2, 3):
        prev = out[-1]
        nxt: dict[str, torch.Tensor] = {}
        for name, t in prev.items():
            if name == "tied":
                nxt[name] = nxt["big"]
            elif t.numel() == 0:
                nxt[name] = t.clone()
            elif t.dtype == torch.bool:
                nxt[name] = t.clone() if seed == 2 else ~t
            else:
                nxt[name] = _flip(t, 0.02, seed)
        if seed == 2:
            for t in nxt.values():
                if t.is_floating_point() and t.numel() >= 2 and t.element_size() >= 2:
                    t.view(-1)[0] = -0.0
        out.append(nxt)
    out.append({k: v for k, v in out[-1].items()})
    return out


def _delta_every_dtype(rank: int, host: str, ports: Any, n: int, mode: str, flat: bool) -> Any:
    versions = _versions()
    with make_group(rank, n, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=BUCKET, delta="always")
            stats = []
            for v, sd in enumerate(versions, 1):
                st = snd.send(sd, version=v)
                stats.append((st.delta, st.bytes, st.wire_bytes, st.changed_fraction, st.base_bytes))
            return stats
        rcv = gb.WeightReceiver(g, src=0)
        target = zeros_like_model(versions[0])
        if flat:
            gb.flatten_(target)
        results = []
        for v, want in enumerate(versions, 1):
            if mode.startswith("receive"):  # only what changed, or (receive-every) every tensor, whole
                upd = rcv.receive(only_changed=mode == "receive")
                got = {name: t.clone() for name, t in upd}
                prev = versions[v - 2] if v > 1 else None
                changed = {k for k in want if prev is None or not bit_equal(prev[k], want[k])}
                results.append((set(got) == (changed if mode == "receive" else set(want)), upd.delta))
                target.update({k: t for k, t in got.items() if k != "tied"})
                target["tied"] = target["big"]
            else:
                assert rcv.receive_into(target, atomic=(mode == "atomic")) == v
            results.append(all(bit_equal(target[k], want[k].contiguous()) for k in want))
        return results, rcv.version


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("n", "mode", "flat"),
    [
        (3, "atomic", False),
        (2, "streaming", False),
        (2, "streaming", True),
        (3, "receive", False),
        (2, "receive-every", False),
    ],
)
def test_delta_bit_exact_every_dtype(n: int, mode: str, flat: bool) -> None:
    res = run_ranks(_delta_every_dtype, n, "127.0.0.1", CTX.Queue(), n, mode, flat, timeout=80)
    for r in range(1, n):
        results, version = res[r]
        assert all(x if isinstance(x, bool) else x[0] for x in results), results
        assert version == 4
        if mode.startswith("receive"):
            assert [x[1] for x in results if isinstance(x, tuple)] == [False, True, True, True]
    stats = res[0]
    assert [s[0] for s in stats] == [False, True, True, True], stats
    (_, size, wire, frac, base), *deltas = stats
    assert wire == size and frac == 1.0 and base == size  # the first sync is a full one
    for _, size2, wire2, frac2, _ in deltas[:2]:
        assert size2 == size and 0 < wire2 < size / 2 and 0 < frac2 < 0.2, stats
    assert deltas[2][2] == 0 and deltas[2][3] == 0.0  # nothing changed: nothing travels


def _layers(seed: int, step: int = 0, n: int = 64) -> dict[str, torch.Tensor]:
    """64 fp32 tensors of 64x64 (1 MiB); ``step`` flips 5% of the words of every tensor ``step`` times."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(n)}
    for s in range(1, step + 1):
        sd = {k: _flip(v, 0.05, s * 1000 + i) for i, (k, v) in enumerate(sd.items())}
    return sd


def _joiners(rank: int, host: str, ports: Any, transport: str) -> Any:
    """Rank 2 starts a new receiver before version 3 (it holds nothing): version 3 is a full sync for both
    receivers, version 4 a delta again."""
    with make_group(rank, 3, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport=transport, bucket_bytes=16 << 10, delta="always")
            return [snd.send(_layers(1, v), version=v).delta for v in (1, 2, 3, 4)]
        rcv = gb.WeightReceiver(g, src=0)
        target = _layers(0)
        ok = []
        for v in (1, 2, 3, 4):
            if rank == 2 and v == 3:
                rcv.close()
                rcv = gb.WeightReceiver(g, src=0)
            if rank == 2:
                got = dict((k, t.clone()) for k, t in rcv.receive())
                target.update(got)
                ok.append(len(got) == 64)  # every tensor changed (5% of each), each yielded whole
            else:
                rcv.receive_into(target)
            ok.append(all(bit_equal(target[k], t) for k, t in _layers(1, v).items()))
        return ok


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["broadcast", "shm", "relay"])
def test_new_receiver_gets_a_full_sync_and_the_others_too(transport: str) -> None:
    res = run_ranks(_joiners, 3, "127.0.0.1", CTX.Queue(), transport, timeout=80)
    assert res[0] == [False, True, False, True], res[0]
    assert all(res[1]) and all(res[2]), res


def _corrupted(rank: int, host: str, ports: Any, how: str) -> Any:
    """``wire``: one payload is corrupted on its way. ``target``: rank 2's target no longer holds version 1
    (rank 1's does): rank 2 misses version 2, so version 3 is a full sync for both."""
    with make_group(rank, 2 if how == "wire" else 3, host, ports) as g:
        if rank == 0:
            with inject_faults() as faults:
                snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10, delta="always")
                snd.send(_layers(1, 1), version=1)
                if how == "wire":  # the fourth payload posted is changed after its digest was taken
                    posted = itertools.count()
                    faults.post = lambda _, view: view[8:16].add_(1) if next(posted) == 3 else None
                try:
                    snd.send(_layers(1, 2), version=2)
                    first = "no error"
                except gb.WeightSyncError as e:
                    first = str(e)
                faults.post = None
                return (
                    first,
                    snd.send(_layers(1, 3), version=3).delta,
                    snd.send(_layers(1, 4), version=4).delta,
                )
        rcv = gb.WeightReceiver(g, src=0)
        target = _layers(0)
        rcv.receive_into(target, atomic=how == "wire")
        before = {k: t.clone() for k, t in target.items()}
        if how == "target" and rank == 2:  # the target no longer holds version 1: the delta cannot apply
            target["w7"][3, 3] += 1
        try:
            rcv.receive_into(target, atomic=how == "wire")
            first: Any = "no error"
        except gb.TornUpdateError as e:
            first = ("torn", str(e))
        except gb.WeightSyncError as e:
            first = ("failed", str(e), all(torch.equal(before[k], t) for k, t in target.items()))
        held = rcv.version
        for _ in (3, 4):
            rcv.receive_into(target, atomic=how == "wire")
        return first, held, all(bit_equal(target[k], t) for k, t in _layers(1, 4).items())


@pytest.mark.timeout(60)
def test_corrupted_delta_detected_before_it_is_applied() -> None:
    res = run_ranks(_corrupted, 2, "127.0.0.1", CTX.Queue(), "wire", timeout=50)
    first, *later = res[0]
    assert "not committed on any receiver" in first and "arrived corrupted" in first, first
    assert later == [False, True]  # after a failed sync the next one is full, then deltas again
    (kind, msg, untouched), held, exact = res[1]
    assert kind == "failed" and untouched and held == 1 and exact, res[1]
    assert "bucket 3" not in msg or "corrupted" in msg


@pytest.mark.timeout(60)
def test_a_receiver_whose_copy_differs_fails_the_sync_on_every_receiver() -> None:
    """One commit: rank 2's delta does not check out, so rank 1 (whose bytes were fine) does not take the
    version either; both streamed into their targets before the vote, so both say TORN and hold 1."""
    res = run_ranks(_corrupted, 3, "127.0.0.1", CTX.Queue(), "target", timeout=50)
    first, *later = res[0]
    assert "not committed on any receiver" in first and "rank 2:" in first and "rank 1:" not in first, first
    assert "differs from the sender's" in first
    assert later == [False, True]  # both on version 1 with torn targets: a full sync for both, then deltas
    for rank in (1, 2):
        (kind, msg), held, exact = res[rank]
        assert kind == "torn" and "TORN" in msg and "differs from the sender's" in msg, (rank, msg)
        assert held == 1 and exact, res[rank]


def _left_as_it_was(rank: int, host: str, ports: Any) -> Any:
    """Version 2 changes ``w0`` only; rank 1's streaming target (its own base) had ``w5`` changed by hand."""
    with make_group(rank, 2, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10, delta="always")
            snd.send(_layers(1), version=1)
            v2 = _layers(1)
            v2["w0"] += 1
            try:
                return snd.send(v2, version=2).delta
            except gb.SyncRefusedError as e:
                return str(e)
        rcv, target = gb.WeightReceiver(g, src=0), _layers(0)
        rcv.receive_into(target, atomic=False)
        target["w5"][0, 0] += 1  # a bucket the delta leaves as it was
        try:
            rcv.receive_into(target, atomic=False)
            return "no error", rcv.version
        except gb.WeightSyncError as e:
            return str(e), rcv.version


@pytest.mark.timeout(60)
def test_a_receiver_whose_copy_differs_where_the_delta_changes_nothing_fails_the_sync() -> None:
    """Every bucket of a delta is checked against the source's digest of it, the ones it leaves as they
    were too: a streaming target changed between syncs is caught, not kept as a third model."""
    sender, (error, held) = run_ranks(_left_as_it_was, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert "not committed on any receiver" in sender and "differs from the sender's" in sender, sender
    assert "differs from the sender's" in error and held == 1, error


def _killed(rank: int, host: str, ports: Any, atomic: bool) -> Any:
    g = make_group(rank, 3, host, ports, liveness_timeout=timedelta(seconds=2))
    t0 = time.monotonic()
    try:
        if rank == 0:
            with inject_faults() as faults:
                snd = gb.WeightSender(g, transport="broadcast", bucket_bytes=16 << 10, delta="always")
                snd.send(_layers(1, 1), version=1)
                posted = itertools.count()
                faults.post = lambda _, view: os._exit(3) if next(posted) == 20 else time.sleep(0.02)
                snd.send(_layers(1, 2), version=2)
            return "finished"
        target = _layers(0)
        rcv = gb.WeightReceiver(g, src=0)
        rcv.receive_into(target, atomic=atomic)
        before = {k: v.clone() for k, v in target.items()}
        try:
            rcv.receive_into(target, atomic=atomic)
            return "finished"
        except gb.TornUpdateError as e:
            changed = sorted(k for k in target if not torch.equal(before[k], target[k]))
            return (
                "torn",
                str(e),
                bool(changed) and set(changed) <= set(e.written),
                rcv.version,
                time.monotonic() - t0,
            )
        except gb.WeightSyncError as e:
            same = all(torch.equal(before[k], target[k]) for k in target)
            return "failed", str(e), same, rcv.version, time.monotonic() - t0
    finally:
        g.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_sender_killed_mid_delta(atomic: bool) -> None:
    res = Ranks(_killed, 3, ("127.0.0.1", CTX.Queue(), atomic)).results(45, expect=[1, 2])
    for r in (1, 2):
        status, value = res[r]
        assert status, value
        kind, msg, check, version, took = value
        if atomic:
            assert kind == "failed" and check and "untouched" in msg and "still 1" in msg, value
        else:
            assert kind == "torn" and "TORN" in msg and check, value  # some tensors changed, all named
        assert version == 1 and took < 20, value


def test_policy_takes_deltas_where_the_link_is_slower_than_the_diff() -> None:
    from groupbridge.weights._delta_sync import Policy

    fast, slow = Policy(), Policy()
    for p, full_s in ((fast, 1.0), (slow, 10.0)):  # one GB: loopback, and an 800 Mbit link
        assert not p.wants_delta()  # a base needs a full sync first
        p.record_full(full_s * 3, 10**9)  # the first one is cold: not trusted
        assert not p.wants_delta()
        p.record_full(full_s, 10**9)
        p.record_sample(0.0125, 8 << 20, 0.03, 6 << 18)  # a diff at about 0.7 GB/s, 3% changed
    assert slow.wants_delta() and not fast.wants_delta()
    slow.record_delta(9.0, 10**9, 10**8, 0.03)  # deltas turned out slow (a loaded machine): learnt
    assert not slow.wants_delta()
    slow.record_delta(2.0, 10**9, 6 * 10**7, 0.03)
    assert slow.wants_delta()
    slow.record_delta(9.0, 10**9, 6 * 10**8, 0.3)  # most of the model changed: a full sync is cheaper
    assert not slow.wants_delta()
    assert Policy(always=True).wants_delta()


def test_policy_sends_whole_the_streams_whose_own_bytes_all_change() -> None:
    from groupbridge.weights._delta_sync import Policy

    p = Policy()
    for _ in range(2):
        p.record_full(10.0, 10**9)  # an 800 Mbit link
    p.record_sample(0.0125, 8 << 20, 0.03, 6 << 18)
    assert p.wants_delta() and p.pays("a") and p.pays("b")  # nothing known of either stream: as the source
    p.record_delta(2.0, 2 * 10**8, 101 * 10**6, 0.5)
    p.record_stream("a", 10**8, 10**8)  # every byte of a's cut changed: its delta is as big as a full copy
    p.record_stream("b", 10**6, 10**8)
    assert not p.pays("a") and p.pays("b")
    for _ in range(Policy.REFRESH - 1):
        p.record_full(10.0, 10**9)
    assert not p.pays("a")
    p.record_full(10.0, 10**9)  # a's share is REFRESH syncs old: a tries a delta again
    assert p.pays("a")
    assert Policy(always=True).pays("a")


def test_policy_refreshes_the_base_now_and_then_while_full_syncs_win() -> None:
    from groupbridge.weights._delta_sync import Policy

    p = Policy()
    kept = []
    for _ in range(2):  # warm-up: full syncs that keep the base
        p.wants_delta()
        kept.append(p.keep_base())
        p.record_full(1.0, 10**9)
    p.record_sample(1.0, 10**8, 0.03, 6 * 10**6)  # the diff is far slower than the link
    for _ in range(16):
        assert not p.wants_delta()
        kept.append(p.keep_base())
    assert kept[:2] == [True, True] and sum(kept[2:]) == 4, kept  # two in a row out of every eight


def _bridges(rank: int, host: str, ports: Any, keep: str) -> Any:
    """A bridge per version, as verl makes one per update: the sender and receiver of each are new, their
    bases kept in a DeltaMemory (``keep``: "both", or "sender" only: the receiver holds nothing, so each
    sync is full)."""
    from groupbridge.weights import DeltaMemory

    memory, target, out = DeltaMemory(), _layers(0), []
    for v in (1, 2, 3):
        with make_group(rank, 2, host, ports) as g:
            if rank == 0:
                with gb.WeightSender(g, bucket_bytes=16 << 10, delta="always", memory=memory) as snd:
                    out.append(snd.send(_layers(1, v), version=v).delta)
            else:
                mine = memory if keep == "both" else None
                with gb.WeightReceiver(g, src=0, memory=mine) as rcv:
                    rcv.receive_into(target)
                out.append(all(bit_equal(target[k], t) for k, t in _layers(1, v).items()))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep", ["both", "sender"])
def test_deltas_outlive_a_bridge_when_both_sides_keep_their_bases(keep: str) -> None:
    res = run_ranks(_bridges, 2, "127.0.0.1", CTX.Queue(), keep, timeout=80)
    assert res[0] == ([False, True, True] if keep == "both" else [False, False, False]), res
    assert res[1] == [True] * 3, res


def _policy_bridges(rank: int, host: str, ports: Any) -> Any:
    """``delta=True`` over a bridge per version: the policy's measurements outlive each sender."""
    from groupbridge.weights import DeltaMemory

    memory, target, seen = DeltaMemory(), _layers(0), []
    for v in (1, 2, 3):
        with make_group(rank, 2, host, ports) as g:
            if rank == 0:
                with gb.WeightSender(g, bucket_bytes=16 << 10, delta=True, memory=memory) as snd:
                    snd.send(_layers(1, v), version=v)
                seen.append(memory.policy.full_syncs)
            else:
                with gb.WeightReceiver(g, src=0, memory=memory) as rcv:
                    rcv.receive_into(target)
    return seen


@pytest.mark.timeout(90)
def test_the_delta_policy_outlives_a_bridge() -> None:
    """Its warm-up (two full syncs timed) is not started again on every new bridge."""
    seen = run_ranks(_policy_bridges, 2, "127.0.0.1", CTX.Queue(), timeout=80)[0]
    assert seen[:2] == [1, 2] and seen[2] >= 2, seen


def test_a_base_dropped_before_its_sync_ended_is_never_committed() -> None:
    """A receiver's fan-out base is dropped when the next receive starts (its bytes are rewritten): a sync
    left unfinished before (an update dropped unread) must not make a later commit fail or revive it."""
    from groupbridge.weights._sharded_delta import FANOUT, Bases

    bases = Bases()
    bases.adopt(FANOUT, "kept, manifest a")
    bases.drop(FANOUT)
    bases.commit(3)  # the next sync commits what it began: nothing
    assert bases.held(FANOUT, "kept, manifest a") is None
    bases.adopt(FANOUT, "kept, manifest b")
    bases.commit(4)
    assert bases.held(FANOUT, "kept, manifest b") == 4
