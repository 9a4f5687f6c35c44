"""Failure paths with real processes: frozen and dead peers, one deadline per sync, abort on every exit path,
writes into a dead store, nothing leaked (threads, descriptors), the caller's threads left alone."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from tests.helpers import CTX, Ranks, make_group, run_ranks

LIVE = timedelta(seconds=2)
BOUND = 2.0 + 6.0  # liveness timeout plus a few seconds: what every failure below must stay within


def _took(value: str) -> float:
    return float(value.split(" after ")[1].split("s:")[0])


def _outcome(t0: float, e: BaseException) -> str:
    return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"


# ---------------------------------------------------------------- frozen store host, frozen peer


def _frozen(rank: int, ports: Any, pids: Any, victim: int) -> str:
    g = make_group(rank, 3, "127.0.0.1", ports, liveness_timeout=LIVE, timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    try:
        g.broadcast(torch.ones(1 << 16), src=0)
        g.barrier()
        pids.put((rank, os.getpid()))  # after a first round: every member is in the loop when one is frozen
        while True:
            g.broadcast(torch.ones(1 << 16), src=0)
            g.barrier()
    except gb.GroupBridgeError as e:
        return _outcome(t0, e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 2], ids=["store-host", "member"])
def test_a_frozen_member_is_as_bounded_as_a_dead_one(victim: int) -> None:
    """SIGSTOP (a hung process, a partition) is found within the liveness timeout, and the frozen member
    itself, once resumed, blames the truth: it did not run, the others gave up on it."""
    pids = CTX.Queue()
    ranks = Ranks(_frozen, 3, (CTX.Queue(), pids, victim))
    got = dict(pids.get(timeout=30) for _ in range(3))
    os.kill(got[victim], signal.SIGSTOP)
    try:
        survivors = [r for r in range(3) if r != victim]
        res = ranks.results(30, expect=survivors)
    finally:
        with contextlib.suppress(ProcessLookupError):  # reaped already
            os.kill(got[victim], signal.SIGCONT)
    for r in survivors:
        status, value = res[r]
        assert status and _took(value) < BOUND + 1, value
        # rank 0 hosts the store: its silence is seen either way first
        assert f"rank {victim} stopped its heartbeat" in value or "did not answer" in value, value


def _resumed(rank: int, ports: Any, pids: Any) -> str:
    g = make_group(rank, 3, "127.0.0.1", ports, liveness_timeout=LIVE, timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    try:
        g.broadcast(torch.ones(1 << 10), src=0)
        g.barrier()
        pids.put((rank, os.getpid()))  # after a first round: every member is in the loop when one is frozen
        for _ in range(100000):
            g.broadcast(torch.ones(1 << 10), src=0)
            g.barrier()
        return "finished"
    except gb.GroupBridgeError as e:
        return _outcome(t0, e)
    finally:
        g.close(timeout=timedelta(seconds=1))


@pytest.mark.timeout(60)
def test_a_resumed_member_does_not_blame_a_healthy_peer() -> None:
    pids = CTX.Queue()
    ranks = Ranks(_resumed, 3, (CTX.Queue(), pids))
    got = dict(pids.get(timeout=30) for _ in range(3))
    os.kill(got[2], signal.SIGSTOP)
    time.sleep(LIVE.total_seconds() + 3)  # the scenario: frozen for longer than the liveness timeout
    os.kill(got[2], signal.SIGCONT)
    res = ranks.results(40)
    status, value = res[2]
    assert status and "Error" in value, value
    # rank 2 learns that the others gave up on *it*; it never says a healthy rank stopped beating
    assert "rank 0 stopped" not in value and "rank 1 stopped" not in value, value
    # it hears that the others gave up on it, that it did not run, or (rank 0 having aborted and left)
    # that the store is gone
    assert any(s in value for s in ("rank 2 stopped its heartbeat", "did not run", "did not answer")), value


# ---------------------------------------------------------------- writes into a dead store


def _wait_gone(pid: int, seconds: float) -> None:
    """Until process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between open and read
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still runs after {seconds:g} s")


def _write_after_host_died(rank: int, ports: Any, store_host: str) -> str:
    g = make_group(rank, 2, "127.0.0.1", ports, liveness_timeout=LIVE, store_host=store_host)
    if rank == 0:
        served = g._store_process
        g.send_obj([os.getpid(), served.proc.pid if served is not None else None], 1)
        g.recv_obj(1)
        ports.get(timeout=30)  # rank 1's send_obj returned (its acknowledgement needs the store alive)
        if served is not None and os.fork() == 0:  # a forked process keeps a copy of the store's pipe open
            parent = os.getppid()
            while os.getppid() == parent:  # it ends with rank 0 too (nothing left behind)
                time.sleep(0.02)
            os._exit(0)
        os._exit(3)  # killed: no close, and the store's pipe stays open in the fork: it sees its parent go
    host, store = g.recv_obj(0)
    g.send_obj("ready", 0)
    ports.put("sent")
    _wait_gone(host, 10)  # rank 0 and its store are gone (its sockets closed with it)
    if store is not None:
        _wait_gone(store, 5)  # a store in its own process ends within a beat of its parent
    t0 = time.monotonic()
    try:
        g.broadcast_obj({"step": 1}, src=1)
        return "returned normally"
    except gb.GroupBridgeError as e:
        return _outcome(t0, e)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("store_host", ["thread", "process"])
def test_a_write_into_a_dead_store_fails(store_host: str) -> None:
    res = Ranks(_write_after_host_died, 2, (CTX.Queue(), store_host)).results(30, expect=[1])
    status, value = res[1]
    assert status and value.startswith(("StoreUnreachableError", "PeerDiedError")), value


def _woken_then_closed(rank: int, queues: Any) -> Any:
    ports, done = queues
    g = make_group(rank, 2, "127.0.0.1", ports, liveness_timeout=LIVE)
    if rank == 0:
        g.recv_obj(1)  # rank 1 waits on rank 0 now (or soon): it learns of the abort from its watcher
        g.abort("rank 0 gives up")
        done.get(timeout=30)  # rank 1 raised and closed
        statuses = g._health.peer_statuses(g._server)
        t0 = time.monotonic()
        g.close()
        return statuses[1]["state"] if statuses[1] else None, time.monotonic() - t0
    g.send_obj("waiting", 0)
    try:
        g.recv_obj(0)
        return "returned normally"
    except gb.PeerDiedError as e:
        outcome = str(e)
    finally:
        g.close()  # its connection was spent waking the wait above: the close is written on the watcher's
        done.put("closed")
    return outcome


@pytest.mark.timeout(40)
def test_a_member_woken_by_its_watcher_still_publishes_its_close() -> None:
    """The watcher ends a wait on a failed peer by shutting the caller's connection down; the member's close
    is then written on the watcher's connection, so rank 0, the store host, reads it and closes at once
    instead of waiting out its grace for a record that never comes."""
    res = run_ranks(_woken_then_closed, 2, (CTX.Queue(), CTX.Queue()), timeout=30)
    assert "rank 0 gives up" in res[1], res[1]
    state, took = res[0]
    assert state == "closed", res[0]  # before, rank 1's record said "live": rank 0 waited out its grace
    assert took < 10, res[0]  # bounded (the grace is 1.3 s here); how long is not what this checks


# ---------------------------------------------------------------- abort on every exit path of a sync


def _sync_failure(rank: int, ports: Any, how: str) -> str:
    g = make_group(rank, 3, "127.0.0.1", ports, liveness_timeout=LIVE, timeout=timedelta(seconds=60))
    model = {f"w{i}": torch.full((4096,), float(i)) for i in range(16)}
    t0 = time.monotonic()
    try:
        if rank == 0:
            snd = gb.WeightSender(g, bucket_bytes=16384, transport="broadcast")
            snd.send(model, version=1)  # a first sync that works: later ones use the lazy path

            def gather() -> Any:  # an FSDP-style generator that fails midway
                for i, (k, v) in enumerate(model.items()):
                    if how == "generator" and i == 9:
                        raise ValueError("gather of w9 failed")
                    yield k, v

            snd.send(gather(), version=2)
            return "sent"
        rcv = gb.WeightReceiver(g, src=0)
        rcv.receive_into({k: torch.zeros_like(v) for k, v in model.items()})
        if how == "consumer" and rank == 1:
            for n, (_name, _t) in enumerate(rcv.receive()):
                if n == 3:
                    break  # stop consuming early: the sync cannot finish, everyone must hear it
            return "stopped early"
        if how == "dropped" and rank == 1:
            upd = rcv.receive()
            del upd  # never read: the handle still owns its step of the protocol
            return "stopped early"
        if how == "closed" and rank == 1:
            rcv.receive().close()
            return "stopped early"
        target = {k: torch.zeros_like(v) for k, v in model.items()}
        rcv.receive_into(target)
        return "received"
    except (gb.GroupBridgeError, ValueError) as e:
        return _outcome(t0, e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["generator", "consumer", "dropped", "closed"])
def test_any_failure_mid_sync_reaches_every_member_quickly(how: str) -> None:
    res = run_ranks(_sync_failure, 3, CTX.Queue(), how, timeout=50)
    failed = [v for v in res if "Error after" in v]
    if how == "generator":
        assert res[0].startswith("WeightSyncError") and "gather of w9 failed" in res[0], res[0]
        for v in res[1:]:
            assert "rank 0 aborted" in v and "gather of w9 failed" in v and _took(v) < BOUND, v
    else:
        why = "consumer stopped" if how == "consumer" else "dropped before it was read"
        assert res[1] == "stopped early", res
        for v in (res[0], res[2]):
            assert "rank 1 aborted" in v and why in v and _took(v) < BOUND, v
    assert len(failed) == (3 if how == "generator" else 2)


def _many_sources_stopped(rank: int, ports: Any, how: str) -> str:
    """Ranks 0 and 1 each hold half of every tensor; rank 2 takes them whole and stops early."""
    g = make_group(rank, 3, "127.0.0.1", ports, liveness_timeout=LIVE, timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    try:
        if rank < 2:
            full = {f"w{i}": torch.full((64, 16), float(i)) for i in range(8)}
            boxes = {k: gb.Shard(v[32 * rank : 32 * rank + 32].clone(), (64, 16), (32 * rank, 0))
                     for k, v in full.items()}  # fmt: skip
            gb.WeightSender(g, bucket_bytes=4096).send(boxes, version=1)
            return "sent"
        rcv = gb.WeightReceiver(g)
        if how == "break":
            for _ in rcv.receive():
                break
        else:
            upd = rcv.receive()
            del upd
        return "stopped early"
    except gb.GroupBridgeError as e:
        return _outcome(t0, e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["break", "dropped"])
def test_a_many_source_update_stopped_early_reaches_the_sources_quickly(how: str) -> None:
    res = run_ranks(_many_sources_stopped, 3, CTX.Queue(), how, timeout=50)
    assert res[2] == "stopped early", res
    for v in res[:2]:
        assert "rank 2 aborted" in v and _took(v) < BOUND, v


def _receive_timeout(rank: int, ports: Any) -> str:
    g = make_group(rank, 2, "127.0.0.1", ports, timeout=timedelta(seconds=60))
    if rank == 0:
        g.recv_obj(1, tag="done")  # never sends: the receiver's own timeout must end its wait
        return "ok"
    t0 = time.monotonic()
    try:
        gb.WeightReceiver(g, src=0).receive(timeout=timedelta(seconds=1.5))
        return "returned"
    except TimeoutError as e:  # the library's timeouts are also TimeoutError
        took = time.monotonic() - t0
        g.send_obj("done", 0, tag="done")
        return f"{type(e).__name__} after {took:.1f}s: {e}"


@pytest.mark.timeout(40)
def test_receive_timeout_bounds_the_whole_update() -> None:
    res = run_ranks(_receive_timeout, 2, CTX.Queue(), timeout=30)
    assert res[1].startswith("PeerTimeoutError") and 1.4 < _took(res[1]) < 4, res[1]
    assert "waited 1.5s" in res[1] and "rank(s) 0" in res[1], res[1]


# ---------------------------------------------------------------- closed groups, released resources


def _closed_and_released(rank: int, ports: Any) -> dict[str, Any]:
    torch.set_num_threads(2)
    out: dict[str, Any] = {}
    base_threads = base_fds = 0
    for round_ in range(3):
        g = make_group(rank, 2, "127.0.0.1", ports)
        model = {f"w{i}": torch.full((1 << 14,), float(i + round_)) for i in range(8)}
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=1 << 16, transport="shm") as snd:
                for v in range(1, 4):
                    snd.send(model, version=v)
            if round_ == 0:
                port = g.address.port
        else:
            with gb.WeightReceiver(g, src=0) as rcv:
                for _v in range(1, 3):
                    rcv.receive_into({k: torch.zeros_like(t) for k, t in model.items()})
                threads_seen = [torch.get_num_threads() for _ in rcv.receive()]
                out["threads_while_consuming"] = sorted(set(threads_seen))
        g.close()
        for call in ("barrier", "broadcast", "send_obj"):
            try:
                if call == "barrier":
                    g.barrier()
                elif call == "broadcast":
                    g.broadcast(torch.zeros(2))
                else:
                    g.send_obj(1, 1 - rank)
            except gb.GroupClosedError:
                out["closed_errors"] = out.get("closed_errors", 0) + 1
        if rank == 0 and round_ == 0:
            with socket.socket() as s:  # the store stopped serving with close(), not at garbage collection
                out["port_after_close"] = s.connect_ex(("127.0.0.1", port))
        if round_ == 0:  # measured after a first round: the test's own queue threads and pipes exist by now
            gc.collect()
            base_threads = threading.active_count()
            base_fds = len(os.listdir("/proc/self/fd"))
    gc.collect()
    deadline = time.monotonic() + 5  # a closed group's threads are told to stop; let them finish, bounded
    while threading.active_count() > base_threads and time.monotonic() < deadline:
        time.sleep(0.01)
    out["threads_left"] = threading.active_count() - base_threads
    out["thread_names"] = sorted(t.name for t in threading.enumerate())
    out["fds_left"] = len(os.listdir("/proc/self/fd")) - base_fds
    out["num_threads"] = torch.get_num_threads()
    return out


@pytest.mark.timeout(90)
def test_closed_group_errors_and_nothing_leaks() -> None:
    res = run_ranks(_closed_and_released, 2, CTX.Queue(), timeout=80)
    for r in res:
        assert r["closed_errors"] == 9, r
        assert r["threads_left"] == 0, r
        assert r["fds_left"] <= 0, r
        assert r["num_threads"] == 2, r  # the caller's intra-op setting is never changed
    assert res[1]["threads_while_consuming"] == [2], res[1]
    assert res[0]["port_after_close"] != 0, res[0]


# ---------------------------------------------------------------- chaos, CI-sized


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_chaos_short_run() -> None:
    """A seeded run of the chaos loop (``groupbridge chaos`` runs it for minutes): every fault detected
    within the bound, no torn receiver, nothing left in /dev/shm."""
    from groupbridge.chaos import run_chaos

    report = run_chaos(0, receivers=2, seed=7, min_episodes=3)  # none, kill, stop over broadcast
    problems = [(e.fault, e.unbounded, e.torn) for e in report.episodes if e.unbounded or e.torn]
    assert report.ok and not problems, (problems, report.leaked_shm)
    assert {e.fault for e in report.episodes} == {"none", "kill", "stop"}


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.netns
@pytest.mark.timeout(240)
def test_chaos_on_simulated_hosts() -> None:
    """Link cuts past the liveness timeout and lossy links, each member on a host of its own: every cut
    detected within the bound, no false alarm under loss, no torn receiver."""
    from groupbridge.bench import netns
    from groupbridge.chaos import run_chaos

    if (why := netns.unavailable_reason()) is not None:
        pytest.skip(why)
    report = run_chaos(0, receivers=2, seed=7, min_episodes=2, only_network=True)  # cut, loss: broadcast
    problems = [(e.fault, e.unbounded, e.torn, e.errors) for e in report.episodes if not _clean(e)]
    assert report.ok and not problems, problems
    assert [e.fault for e in report.episodes] == ["cut", "loss"]
    assert report.episodes[1].dropped and report.episodes[1].dropped > 0.001  # the links did drop packets


def _clean(e: Any) -> bool:
    return not (e.unbounded or e.torn or e.errors)
