"""Hostile peers: a raw TCPStore client without the token, on the store port, trying each attack it can.

With a token, nothing it writes is acted on: it can at most deny service (a wait that times out with a clear
error). Without a token the group trusts whoever reaches the port, but malformed values still get the
documented error, never a raw JSON, key or decoding error.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

import groupbridge as gb
from groupbridge import codec
from tests.helpers import CTX, Ranks, make_group, run_ranks, share_port

TOKEN = "s3cret"
NS = "groupbridge/bridge/0"


class Attacker:
    """A raw store client in its own thread, running ``attack(store)`` until stopped; counts its writes."""

    def __init__(self, port: int, attack: Any) -> None:
        self.store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)
        self.attack = attack
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.writes += self.attack(self.store)
            except RuntimeError:  # the store went away with the group: the attack is over
                return
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.writes


_written: set[str] = set()


def _forge(store: Any, key: str, value: bytes) -> int:
    """Write each forged key once: a forgery written first must be ignored and the real value, written
    after it, accepted. (Overwriting real values again and again only denies service: TCPStore keeps
    no versions, so no protocol on it can prevent that.)"""
    if key in _written:
        return 0
    _written.add(key)
    store.set(key, value)
    return 1


def _sync_ids(store: Any) -> list[str]:
    """What an eavesdropper learns: the sync ids in the headers broadcast so far. Queued messages cannot be
    read in place, so it pops each one, reads it and pushes it back (the receiver gets it late, intact)."""
    ids = []
    for r in (1, 2):
        queue = f"{NS}/bc/0/{r}"
        if not store.check([queue]):
            continue
        try:
            raw = bytes(store.queue_pop(queue, block=False))
        except RuntimeError:
            continue
        store.queue_push(queue, raw)
        for body in (raw, raw[32:]):  # unsealed, sealed
            try:
                value = codec.decode(body[9:])  # after the message number and the kind
            except gb.ProtocolError:
                continue
            if isinstance(value, dict) and isinstance(value.get("options"), dict):
                ids.append(str(value["options"].get("sync_id")))
    return ids


_LEAKED: list[str] = []
"""Sync ids handed to the attacker as if they had leaked (popping a header off a queue races the receiver,
which usually takes it first): the MAC must hold against an attacker who knows everything but the token."""


class _LeakingSecrets:
    @staticmethod
    def token_hex(n: int) -> str:
        import secrets

        value = secrets.token_hex(n)
        _LEAKED.append(value)
        return value


def _forge_signals(store: Any) -> int:
    """B11: write every bucket's ready signal first, pointing at slot data the sender has not written."""
    n = 0
    for sid in _sync_ids(store) + _LEAKED[-2:]:
        for k in range(16):
            n += _forge(
                store, f"{NS}/wx/{sid}/0/ready/{k}", json.dumps({"slot": k % 2, "nbytes": 16384}).encode()
            )
    return n


def _forge_aborts(store: Any) -> int:
    n = 0
    record = {"n": 1 << 40, "state": "aborted", "reason": "forged by an attacker"}
    for r in range(3):
        _written.discard(f"{NS}/st/{r}")  # once every 0.2 s: between real beats, never hiding them
        n += _forge(store, f"{NS}/st/{r}", json.dumps(record).encode())
    time.sleep(0.2)
    return n


def _forge_objects(store: Any) -> int:
    n = 0
    for seq in range(0, 20):
        if f"obj{seq}" not in _written:
            _written.add(f"obj{seq}")
            store.queue_push(
                f"{NS}/p2p//0/1", struct.pack("<Q", seq) + codec.encode({"step": 666, "forged": True})
            )
            n += 1
    return n


ATTACKS = {"signals": _forge_signals, "aborts": _forge_aborts, "objects": _forge_objects}


def _attacked(rank: int, ports: Any, which: str, token: str | None) -> Any:
    lis, port = share_port(rank, 3, ports, "127.0.0.1")
    g = gb.StatelessGroup.create(
        "127.0.0.1", port, rank=rank, world_size=3, listener=lis, token=token,
        # a forged signal that overwrote a real one denies service: the wait ends at this bound (every
        # honest wait here takes well under a second)
        timeout=timedelta(seconds=10), liveness_timeout=timedelta(seconds=3),
    )  # fmt: skip
    if rank == 0:
        import groupbridge.weights.sender as sender_module

        sender_module.secrets = _LeakingSecrets  # type: ignore[assignment]
    attacker = Attacker(port, ATTACKS[which]) if rank == 0 else None
    out: dict[str, Any] = {}
    try:
        model = {f"w{i}": torch.full((4096,), 1.0) for i in range(8)}
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=16384, transport="shm") as snd:
                for v in range(1, 6):
                    snd.send({k: t * v for k, t in model.items()}, version=v)
                    g.send_obj({"step": v}, 1)
            out["sent"] = True
        else:
            with gb.WeightReceiver(g, src=0) as rcv:
                target = {k: torch.zeros_like(t) for k, t in model.items()}
                got = out.setdefault("exact", [])  # kept when a denial of service ends the run early
                for v in range(1, 6):
                    rcv.receive_into(target)
                    got.append(all(bool((t == float(v)).all()) for t in target.values()))
                    if rank == 1:
                        out.setdefault("objects", []).append(g.recv_obj(0))
        g.barrier()
    except gb.GroupBridgeError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if attacker is not None:
            out["attacker_writes"] = attacker.stop()
        g.close()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("which", sorted(ATTACKS))
def test_with_a_token_forgeries_are_never_acted_on(which: str) -> None:
    res = run_ranks(_attacked, 3, CTX.Queue(), which, TOKEN, timeout=80)
    assert res[0]["attacker_writes"] > 0
    for r in res:
        # Never acted on: no forged abort, object or bytes. A forgery that overwrote a real value after it
        # was written can only deny service (the wait then times out with a clear error).
        assert "forged by an attacker" not in str(r), r
        assert all(r.get("exact", [])), r  # every version a receiver accepted is the sender's, bit for bit
        if "error" in r:
            assert which == "signals" and "waited" in r["error"], r
            continue
        if "exact" in r:
            assert r["exact"] == [True] * 5, r
        if "objects" in r:
            assert r["objects"] == [{"step": v} for v in range(1, 6)], r


def _malformed(rank: int, ports: Any) -> list[str]:
    lis, port = share_port(rank, 2, ports, "127.0.0.1")
    g = gb.StatelessGroup.create("127.0.0.1", port, rank=rank, world_size=2, listener=lis)
    errors = []
    if rank == 1:
        raw = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)
        for blob in (b"\xff\xfe not ours", b"GB2\xc1", b"GB2\xdb\xff\xff\xff\xff"):  # 0xc1: never used
            raw.queue_push(f"{NS}/p2p//0/1", struct.pack("<Q", len(errors)) + blob)
            try:
                g.recv_obj(0, timeout=timedelta(seconds=5))
                errors.append("accepted")
            except gb.ProtocolError as e:
                errors.append(f"ProtocolError: {e}")
        raw.set(f"{NS}/st/0", b"{not json")  # a malformed status is no news, never a crash
    g.barrier()
    g.close()
    return errors


@pytest.mark.timeout(60)
def test_without_a_token_malformed_values_get_the_documented_error() -> None:
    res = run_ranks(_malformed, 2, CTX.Queue(), timeout=50)
    assert len(res[1]) == 3 and all(e.startswith("ProtocolError: rank 1") for e in res[1]), res[1]


def _sabotaged_join(rank: int, ports: Any, what: str) -> str:
    lis, port = share_port(rank, 2, ports, "127.0.0.1")
    if rank == 1:
        raw = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)
        if what == "meta":
            raw.set("groupbridge/meta", b"\x00garbage")
        elif what == "reject":
            raw.set("groupbridge/reject", b"{]")
            raw.add("groupbridge/rejects", 1)
        else:  # a well-formed refusal with a reason of the attacker's choosing, without the token's MAC
            raw.set("groupbridge/reject", json.dumps({"rank": 1, "reason": "go away", "mac": "00"}))
            raw.add("groupbridge/rejects", 1)
    token = TOKEN if what == "forged-refusal" else None
    try:
        gb.StatelessGroup.create(
            "127.0.0.1",
            port,
            rank=rank,
            world_size=2,
            listener=lis,
            timeout=timedelta(seconds=4),
            token=token,
        ).close()
        return "joined"
    except gb.GroupBridgeError as e:
        return type(e).__name__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["meta", "reject", "forged-refusal"])
def test_join_sabotage_gives_library_errors(what: str) -> None:
    res = run_ranks(_sabotaged_join, 2, CTX.Queue(), what, timeout=50)
    if what == "forged-refusal":  # G8: with a token, a refusal needs the token's MAC to be acted on
        assert res == ["joined", "joined"], res
        return
    # a sabotaged join may fail (denial of service) but only with the library's own errors
    assert all(r in ("joined", "GroupMismatchError", "JoinTimeoutError") for r in res), res


def _instance_a(rank: int, ports: Any, to_test: Any, go: Any) -> str:
    """Instance A of a sealed group: rank 0 queues one object for rank 1, which never reads it."""
    with make_group(rank, 2, "127.0.0.1", ports, token=TOKEN) as g:
        if rank == 0:
            g.send_obj("from instance A", 1)
            to_test.put(g.address.port)
            go.get(timeout=30)  # the attacker has recorded what it wanted
        g.barrier()
    return "done"


def _joins_instance_b(rank: int, port: int) -> str:
    """Rank 1 of instance B (same name, generation and token), joining the store the attacker answers on."""
    try:
        with gb.StatelessGroup.create(
            "127.0.0.1", port, rank=1, world_size=2, token=TOKEN, timeout=timedelta(seconds=4)
        ) as g:
            return f"joined, received {g.recv_obj(0, timeout=timedelta(seconds=4))!r}"
    except gb.GroupBridgeError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.timeout(90)
def test_an_earlier_instance_recorded_and_replayed_is_refused() -> None:
    """G1: a process without the token records instance A (its description, member list, rank 0's status,
    a queued object), then answers a joiner of instance B with all of it and plays rank 0's gloo side
    (gloo does not authenticate). The joiner's fresh nonce is in no recorded member list, and nothing
    recorded opens under B's session key: the join times out, nothing of A's is received."""
    from torch.distributed import PrefixStore

    from groupbridge import _torch_private

    to_test, go = CTX.Queue(), CTX.Queue()
    a = Ranks(_instance_a, 2, (CTX.Queue(), to_test, go))
    try:
        spy = TCPStore("127.0.0.1", to_test.get(timeout=30), None, False, timedelta(seconds=10))
        queue = f"{NS}/p2p//0/1"
        recorded = {k: bytes(spy.get(k)) for k in ("groupbridge/meta", f"{NS}/ready", f"{NS}/st/0")}
        message = bytes(spy.queue_pop(queue, block=False))
        go.put(True)
        assert [ok for ok, _ in a.results(40).values()] == [True, True]
    finally:
        a.reap()
    fake = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    for key, value in recorded.items():
        fake.set(key, value)
    fake.add(f"{NS}/claim/0", 1)
    fake.queue_push(queue, message)
    played: list[Any] = []

    def play_rank_0() -> None:  # gloo's side of rank 0, for a joiner that gets that far
        try:
            played.append(
                _torch_private.new_gloo_group(
                    PrefixStore(f"{NS}/gloo", fake), 0, 2, timedelta(seconds=8), "127.0.0.1"
                )
            )
        except RuntimeError as e:  # nobody came (the join was refused): the expected end
            played.append(e)

    gloo = threading.Thread(target=play_rank_0, daemon=True)
    gloo.start()
    [outcome] = run_ranks(_joins_instance_b, 1, fake.port, timeout=40)
    assert "from instance A" not in outcome, outcome
    assert outcome.startswith("JoinTimeoutError"), outcome


def _replayed_beats(rank: int, ports: Any, dying: Any) -> Any:
    """Rank 1 dies; a process without the token, which recorded rank 1's status records while it lived,
    keeps writing them back (each an older beat than rank 1's last)."""
    import random

    g = make_group(rank, 2, "127.0.0.1", ports, token=TOKEN, liveness_timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(1.5)
        dying.put(True)
        dying.close()
        dying.join_thread()  # the message is in the pipe before this process vanishes
        os._exit(0)  # killed: no goodbye
    recorded: list[bytes] = []

    def record_then_replay(store: Any) -> int:
        if dying.empty():
            raw = bytes(store.get(f"{NS}/st/1"))
            if raw not in recorded:
                recorded.append(raw)  # rank 1's beats while it lives
            return 0
        store.set(f"{NS}/st/1", random.choice(recorded[:-1] or recorded))  # a record that keeps "changing"
        return 1

    attacker = Attacker(g.address.port, record_then_replay)
    t0 = time.monotonic()
    try:
        g.recv_obj(1, timeout=timedelta(seconds=20))
        return "received", 0.0, 0
    except gb.GroupBridgeError as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0, attacker.stop()
    finally:
        attacker.stop()
        g.close()


@pytest.mark.timeout(60)
def test_replayed_heartbeats_are_not_life() -> None:
    """G3: a dead peer's own recorded beats, cycled by a process without the token, kept it "alive" until
    the whole timeout; only a newer beat counts, and the error says what was seen."""
    r = Ranks(_replayed_beats, 2, (CTX.Queue(), CTX.Queue()))
    try:
        outcome, waited, writes = r.results(50, expect=[0])[0][1]
    finally:
        r.reap()
    assert writes > 0
    assert outcome.startswith("PeerDiedError") and "went back from beat" in outcome, outcome
    assert waited < 8, (waited, outcome)  # liveness (1 s) after the death, not the 20 s timeout


def _same_user_writer(rank: int, ports: Any, pids: Any, stop: Any) -> Any:
    """Ranks 0 and 1: a sealed group syncing over shm. Rank 2: a process of the same user, no member, that
    writes forged bytes into the sender's slots through /proc/<sender>/fd/<n> as fast as it can."""
    if rank == 2:
        sender = pids.get(timeout=30)  # sent once the sender's slots exist (after its first sync)
        written = refused = 0
        forged = b"\xff" * 4096
        while stop.empty():
            for name in os.listdir(f"/proc/{sender}/fd"):
                try:
                    if "groupbridge-slot" not in os.readlink(f"/proc/{sender}/fd/{name}"):
                        continue
                    fd = os.open(f"/proc/{sender}/fd/{name}", os.O_RDWR)
                except OSError:
                    continue
                try:
                    for offset in range(0, 1 << 18, 1 << 14):
                        os.pwrite(fd, forged, offset)
                        written += 1
                except OSError:
                    refused += 1
                finally:
                    os.close(fd)
        return written, refused
    with make_group(rank, 2, "127.0.0.1", ports, token=TOKEN) as g:
        model = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(8)}  # 2 MiB, buckets of 256 KiB
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=1 << 18, transport="shm") as snd:
                for v in range(1, 11):
                    snd.send({k: t + v for k, t in model.items()}, version=v)
                    if v == 1:
                        pids.put(os.getpid())
                    time.sleep(0.05)
            g.barrier()
            stop.put(True)
            return "sent"
        exact = []
        with gb.WeightReceiver(g, src=0) as rcv:
            target = {k: torch.zeros_like(t) for k, t in model.items()}
            for v in range(1, 11):
                try:
                    rcv.receive_into(target)
                    exact.append(all(bool((t == model[k] + v).all()) for k, t in target.items()))
                except gb.WeightSyncError:
                    exact.append("refused")  # bytes changed after they were digested: refused, not applied
        g.barrier()
        return exact


@pytest.mark.timeout(90)
def test_a_same_user_process_cannot_write_the_senders_slots() -> None:
    """G2: slots were memfds without seals: a process of the same user could open them read-write and
    change a bucket between the pack and the digest, which the sender then certified. Sealed against
    writes once mapped, every write is refused and every sync is the sender's. (The attacker starts once the
    slots exist: a writable mapping made in the moment between a slot's creation and its seal would keep
    working; docs/security.md says so.)"""
    res = run_ranks(_same_user_writer, 3, CTX.Queue(), CTX.Queue(), CTX.Queue(), timeout=80)
    written, refused = res[2]
    assert written == 0 and refused > 0, res[2]
    assert res[1] == [True] * 10, res[1]


def _squatted_queue(rank: int, ports: Any) -> Any:
    """A process without the token writes a key of the name of rank 1's queue from rank 0, so that every
    wait on that queue ends at once; rank 0 sends 0.5 s later."""
    g = make_group(rank, 2, "127.0.0.1", ports, token=TOKEN)
    if rank == 0:
        squatter = TCPStore("127.0.0.1", g.address.port, None, False, timedelta(seconds=10))
        squatter.set(f"{NS}/p2p//0/1", "squatted")
        g.barrier()
        time.sleep(0.5)
        g.send_obj("through", 1)
        g.barrier()
        g.close()
        return None
    g.barrier()
    waits = g.control.waits
    got = g.recv_obj(0)
    waits = g.control.waits - waits
    g.barrier()
    g.close()
    return got, waits


@pytest.mark.timeout(60)
def test_a_key_squatting_a_queues_name_does_not_make_its_reader_spin() -> None:
    """Torch's wait on a queue returns at once while a key of the queue's name exists: the reader sees it
    and polls every few milliseconds (about 100 times in 0.5 s) instead of spinning, and still gets its
    message."""
    got, waits = run_ranks(_squatted_queue, 2, CTX.Queue(), timeout=50)[1]
    assert got == "through"
    assert 10 < waits < 200, f"the reader waited {waits} times in 0.5 s"


def test_a_sealed_groups_bucket_digest_is_keyed_by_its_token() -> None:
    """A bucket's digest in a sealed group is a MAC: whoever lacks the token cannot compute it for bytes of
    their own, and any changed byte changes it (keyed BLAKE3, see _seal.Sealer.digest)."""
    from groupbridge._seal import Sealer

    data = os.urandom(1 << 20)

    def mac(token: str, payload: bytes, context: str = "g/0/nonce") -> bytes:
        h = Sealer(token, context).digest()
        h.update(payload)
        return bytes(h.digest())

    tampered = bytearray(data)
    tampered[len(data) // 2] ^= 1
    assert mac("t", data) == mac("t", data)  # both sides of a sync compute the same
    assert mac("t", data) != mac("u", data)  # another token: another key
    assert mac("t", data) != mac("t", data, "g/1/nonce")  # another instance of the group: another key
    assert mac("t", data) != mac("t", bytes(tampered))
    assert len(mac("t", data)) == 32
