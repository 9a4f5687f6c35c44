"""Transports: shm and relay on one host, broadcast and relay across simulated hosts, auto, failures."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.bench import netns
from groupbridge.testing import inject_faults
from tests.helpers import CTX, Ranks, make_group, run_ranks
from tests.weights_models import bit_equal, every_dtype, make_model, zeros_like_model


def _slots_held() -> int:
    """Shared-memory slots this process still maps or holds open. Slots are memfd files (no name in
    /dev/shm, so nothing there can leak); what could leak is a mapping or a descriptor a closed sender or
    receiver kept, and that is what this counts."""
    gc.collect()  # views of a slot that nothing references any more are unmapped with their storage
    with open("/proc/self/maps") as f:
        held = sum("groupbridge-slot" in line for line in f)
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held += "groupbridge-slot" in os.readlink(f"/proc/self/fd/{fd}")
    return held


def _sync(rank: int, host: str, ports: Any, n: int, transport: str, mode: str, ns: list[str] | None) -> Any:
    if ns is not None:
        netns.enter(ns[rank])
    with make_group(rank, n, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(
                g,
                bucket_bytes=4096,
                transport=transport,
                checksum=True,
                transport_options=gb.RelayOptions(chunk_bytes=1024),
            )
            kinds = [snd.send(every_dtype(seed=v), version=v).transport for v in (1, 2)]
            snd.close()
            return kinds, _slots_held()
        rcv = gb.WeightReceiver(g, src=0)
        target = zeros_like_model(every_dtype())
        ok = []
        for v in (1, 2):
            want = every_dtype(seed=v)
            if mode == "receive":
                got = {k: t.clone() for k, t in rcv.receive()}
            else:
                rcv.receive_into(target, atomic=(mode == "atomic"))
                got = target
            ok.append(all(bit_equal(got[k], want[k].contiguous()) for k in want))
        rcv.close()
        del got
        return ok, _slots_held()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["atomic", "streaming", "receive"])
@pytest.mark.parametrize(("transport", "n"), [("shm", 2), ("shm", 3), ("relay", 4), ("auto", 3)])
def test_one_host_bit_exact(transport: str, n: int, mode: str) -> None:
    res = run_ranks(_sync, n, "127.0.0.1", CTX.Queue(), n, transport, mode, None, timeout=80)
    assert res[0][0] == [("shm" if transport == "auto" else transport)] * 2
    assert all(r[0] == [True, True] for r in res[1:]), res
    assert [r[1] for r in res] == [0] * n, res  # no slot mapped or open after close, on any member


def _unavailable(rank: int, host: str, ports: Any) -> str:
    with make_group(rank, 2, host, ports) as g:
        try:
            if rank == 0:
                gb.WeightSender(g, transport="cuda_ipc").send({"w": torch.ones(4)}, version=1)
            else:
                gb.WeightReceiver(g, src=0).receive_into({"w": torch.zeros(4)})
            return "no error"
        except gb.TransportUnavailableError as e:
            return str(e)


@pytest.mark.timeout(60)
def test_explicit_transport_that_cannot_work_is_an_error_everywhere() -> None:
    res = run_ranks(_unavailable, 2, "127.0.0.1", CTX.Queue(), timeout=50)
    assert all("cuda_ipc" in r and "CUDA tensors" in r for r in res), res


def _killed(rank: int, host: str, ports: Any, victim: int) -> Any:
    g = make_group(rank, 3, host, ports, liveness_timeout=timedelta(seconds=2))
    shapes = [(f"w{i}", (128, 128)) for i in range(64)]  # 2 MiB over 64 kB buckets
    t0 = time.monotonic()
    end: Any = None  # the sender or receiver, closed before the slots this process holds are counted
    try:
        if rank == 0:
            with inject_faults() as faults:
                faults.post = lambda k, view: os._exit(3) if (victim == 0 and k == 10) else time.sleep(0.01)
                end = gb.WeightSender(g, bucket_bytes=64 << 10, transport="shm")
                end.send(make_model(shapes, seed=1), version=1)
            return "finished"
        end = gb.WeightReceiver(g, src=0)
        if rank == victim:
            for i, _ in enumerate(end.receive()):
                if i == 8:
                    os._exit(3)
        end.receive_into(make_model(shapes, seed=0))
        return "finished"
    except gb.GroupBridgeError as e:
        failed = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    finally:
        g.close()
    end.close()  # out of the except block: the error's frames no longer hold views of the slots
    return failed, _slots_held()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 2], ids=["sender", "receiver"])
def test_shm_killed_member_leaves_nothing_behind(victim: int) -> None:
    survivors = [r for r in range(3) if r != victim]
    res = Ranks(_killed, 3, ("127.0.0.1", CTX.Queue(), victim)).results(45, expect=survivors)
    for r in survivors:
        status, (value, held) = res[r]
        assert status and "Error after" in value, value
        assert float(value.split(" after ")[1].rstrip("s")) < 20
        assert held == 0, (r, held)  # nothing of the failed sync's slots mapped or open after close


# ---------------------------------------------------------------- simulated hosts

NETNS = netns.unavailable_reason()


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(NETNS is not None, reason=f"simulated hosts unavailable: {NETNS}")
@pytest.mark.parametrize("transport", ["broadcast", "relay"])
def test_across_simulated_ipv6_hosts(transport: str) -> None:
    with netns.SimulatedHosts(4, rate="1gbit") as sim:
        host = sim.hosts[0].address
        names = [h.namespace for h in sim.hosts]
        res = run_ranks(_sync, 4, host, CTX.Queue(), 4, transport, "streaming", names, timeout=100)
    assert res[0] == ([transport] * 2, 0)
    assert all(r == ([True, True], 0) for r in res[1:]), res
    assert not any(n in os.popen("ip netns list").read() for n in names)


def _relay_broken(rank: int, host: str, ports: Any, ns: list[str]) -> str:
    netns.enter(ns[rank])
    g = make_group(rank, 4, host, ports, liveness_timeout=timedelta(seconds=2))
    shapes = [(f"w{i}", (256, 256)) for i in range(32)]  # 4 MiB
    t0 = time.monotonic()
    try:
        if rank == 0:
            gb.WeightSender(
                g,
                bucket_bytes=256 << 10,
                transport="relay",
                transport_options=gb.RelayOptions(chunk_bytes=64 << 10),
            ).send(make_model(shapes, seed=1), version=1)
            return "finished"
        rcv = gb.WeightReceiver(g, src=0)
        if rank == 2:  # the middle of the chain 0 -> 1 -> 2 -> 3
            for i, _ in enumerate(rcv.receive()):
                if i == 4:
                    os._exit(3)
        rcv.receive_into(make_model(shapes, seed=0))
        return "finished"
    except gb.GroupBridgeError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    finally:
        g.close()


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(NETNS is not None, reason=f"simulated hosts unavailable: {NETNS}")
def test_broken_relay_link_fails_every_member_within_bound() -> None:
    with netns.SimulatedHosts(4, rate="200mbit") as sim:
        names = [h.namespace for h in sim.hosts]
        res = Ranks(_relay_broken, 4, (sim.hosts[0].address, CTX.Queue(), names)).results(
            90, expect=[0, 1, 3]
        )
    for r in (0, 1, 3):
        status, value = res[r]
        assert status and "Error after" in value, (r, value)
        assert float(value.split(" after ")[1].rstrip("s")) < 25, (r, value)


@pytest.mark.netns
@pytest.mark.timeout(150)
@pytest.mark.skipif(NETNS is not None, reason=f"simulated hosts unavailable: {NETNS}")
def test_torchrun_two_nodes_over_ipv6_without_gloo_ifname(tmp_path: Any) -> None:
    """Two torchrun "nodes" in two namespaces over IPv6, nothing set but the launcher's flags."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "_torchrun_world.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    with netns.SimulatedHosts(2, rate=None) as sim:
        master = sim.hosts[0].address
        procs = []
        try:
            for i, h in enumerate(sim.hosts):
                # the port is free by construction: nothing else runs inside these fresh namespaces
                cmd = ["ip", "netns", "exec", h.namespace, sys.executable, "-m", "torch.distributed.run",
                       "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                       "--master-addr", master, "--master-port", "29500", script, str(tmp_path)]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                    )
                )
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    import json

    for r in range(2):
        seen = json.loads((Path(tmp_path) / f"rank{r}.json").read_text())
        assert seen["group"][0] == r and seen["group"][2] == 2 and seen["sum"] == 3.0


def _shared_source(rank: int, host: str, ports: Any, n: int) -> Any:
    with make_group(rank, n, host, ports) as g:
        if rank == 0:
            snd = gb.WeightSender(g, bucket_bytes=4096, transport="shm", checksum=True)
            out = []
            for v in (1, 2):
                sd = every_dtype(seed=v)
                gb.flatten_(sd).share_memory_()  # the trainer's tensors already live in shared memory
                snd.send(sd, version=v)
                out.append(snd._transports["shm"].external)  # type: ignore[attr-defined]
            return out
        rcv = gb.WeightReceiver(g, src=0)
        target = zeros_like_model(every_dtype())
        ok = []
        for v in (1, 2):
            want = every_dtype(seed=v)
            rcv.receive_into(target, atomic=(v == 1))
            ok.append(all(bit_equal(target[k], want[k].contiguous()) for k in want))
        return ok


@pytest.mark.timeout(60)
def test_shm_reads_a_shared_memory_sender_in_place() -> None:
    res = run_ranks(_shared_source, 3, "127.0.0.1", CTX.Queue(), 3, timeout=50)
    assert all(x > 0 for x in res[0]), res[0]  # buckets read straight from the sender's memory
    assert res[1] == [True, True] and res[2] == [True, True]


def _own_mount_namespace(rank: int, ports: Any) -> Any:
    """Rank 1 gets its own mount namespace with an empty 1 MiB /dev/shm: a container beside the sender."""
    if rank == 1:
        import ctypes
        import subprocess

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
            return f"unshare failed: errno {ctypes.get_errno()}"
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"], check=True)
        assert os.listdir("/dev/shm") == []
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        model = every_dtype(seed=5)
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=1 << 20, transport="auto") as snd:
                return snd.send(model, version=1).transport
        target = zeros_like_model(model)
        gb.WeightReceiver(g, src=0).receive_into(target)
        return all(bit_equal(target[k], model[k].contiguous()) for k in model)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a mount namespace")
def test_shm_across_mount_namespaces() -> None:
    """Slots are memfd files, in no file system: another /dev/shm (or a tiny one) does not matter."""
    res = run_ranks(_own_mount_namespace, 2, CTX.Queue(), timeout=50)
    assert res == ["shm", True], res


def _short_of_memory(rank: int, ports: Any, transport: str, short: str = "memory") -> Any:
    """The sender may not make files past 1 MiB (RLIMIT_FSIZE): shared slots of 4 MiB cannot be reserved,
    as on a host short of memory. Before memfd + posix_fallocate this was a SIGBUS at the first write.
    ``short="fds"``: the sender is at its descriptor limit instead (RLIMIT_NOFILE), which escaped as a raw
    OSError before."""
    import resource

    if rank == 0 and short == "memory":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        model = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB: one 4 MiB bucket
        try:
            if rank == 0:
                with gb.WeightSender(g, bucket_bytes=4 << 20, transport=transport) as snd:
                    if short == "fds":  # every descriptor below the limit taken: memfd_create gets EMFILE
                        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                        resource.setrlimit(
                            resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard)
                        )
                        filler = []
                        try:
                            while True:
                                filler.append(os.open(os.devnull, os.O_RDONLY))
                        except OSError:
                            pass
                        try:
                            return snd.send(model, version=1).transport
                        finally:
                            for fd in filler:
                                os.close(fd)
                    return snd.send(model, version=1).transport
            target = {"w": torch.zeros(1 << 20)}
            gb.WeightReceiver(g, src=0).receive_into(target)
            return bool(torch.equal(target["w"], model["w"]))
        except gb.TransportUnavailableError as e:
            return f"TransportUnavailableError: {e}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("short", ["memory", "fds"])
@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_shm_short_of_memory_falls_back_or_refuses(transport: str, short: str) -> None:
    res = run_ranks(_short_of_memory, 2, CTX.Queue(), transport, short, timeout=50)
    if transport == "auto":
        assert res == ["broadcast", True], res  # auto falls back (and logs why)
    else:
        why = "reserve" if short == "memory" else "could not make a shared-memory file"
        assert all(str(r).startswith("TransportUnavailableError") and why in str(r) for r in res), res


def _other_user(rank: int, ports: Any, transport: str) -> Any:
    """Rank 1 runs as another user (nobody): it could not open the sender's shared memory (EACCES)."""
    if rank == 1:
        import encodings.idna  # noqa: F401  # imported while the files under /root are still readable

        os.setgid(65534)
        os.setuid(65534)
    with make_group(rank, 2, "127.0.0.1", ports) as g:
        model = {"w": torch.arange(4096, dtype=torch.float32)}
        try:
            if rank == 0:
                with gb.WeightSender(g, transport=transport) as snd:
                    return [snd.send(model, version=v).transport for v in (1, 2)]
            target = {"w": torch.zeros(4096)}
            rcv = gb.WeightReceiver(g, src=0)
            return [rcv.receive_into(target) for _ in (1, 2)] + [bool(torch.equal(target["w"], model["w"]))]
        except gb.TransportUnavailableError as e:
            return f"TransportUnavailableError: {e}"


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a rank as another user")
@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_shm_to_another_user_falls_back_or_refuses(transport: str) -> None:
    res = run_ranks(_other_user, 2, CTX.Queue(), transport, timeout=50)
    if transport == "auto":
        assert res == [["broadcast", "broadcast"], [1, 2, True]], res  # every sync, not a failure each time
    else:
        assert all("as one user" in str(r) and "uid:65534" in str(r) for r in res), res


def _uneven(rank: int, ports: Any, n: int, syncs: int, delta: Any) -> Any:
    """Back-to-back shm syncs in an RL loop: each step the trainer sends, then takes one object from every
    worker; each step another worker falls behind at the end of the stream while the others report at once
    (a report pushed while the sender waits for the slow worker's last buckets)."""
    tensors, numel = 24, 1 << 19  # 24 MiB of bf16 in 1 MiB tensors, buckets of 3 MiB

    def model(v: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(v)
        return {f"w{i}": torch.randn(numel, generator=g).to(torch.bfloat16) for i in range(tensors)}

    with make_group(rank, n, "127.0.0.1", ports, timeout=timedelta(seconds=20)) as g:
        if rank == 0:
            with gb.WeightSender(g, bucket_bytes=3 << 20, transport="shm", delta=delta) as snd:
                for v in range(1, syncs + 1):
                    snd.send(model(v), version=v, timeout=timedelta(seconds=10))
                    assert [g.recv_obj(r) for r in range(1, n)] == [v] * (n - 1)
            # the slots' signal keys are deleted by the watcher, off the data path
            deadline = time.monotonic() + 10
            while g.control._discarded and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not g.control._discarded, f"{len(g.control._discarded)} keys not deleted"
            return syncs
        rcv = gb.WeightReceiver(g, src=0)
        target = zeros_like_model(model(0))
        for v in range(1, syncs + 1):
            want = model(v)
            if rank == 1 + v % (n - 1):  # this step's slow worker: stalls on its last tensors
                got = {}
                for i, (name, t) in enumerate(rcv.receive(timeout=timedelta(seconds=10))):
                    if i >= tensors - 4:
                        time.sleep(0.01)
                    got[name] = t.clone()
            else:
                rcv.receive_into(target, atomic=False, timeout=timedelta(seconds=10))
                got = target
            bad = [k for k in want if not bit_equal(got[k], want[k])]
            assert not bad, f"rank {rank}, version {v}: {len(bad)} tensors differ"
            g.send_obj(v, 0)
        return rcv.version


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delta", [False, "always"], ids=["full", "delta"])
def test_shm_back_to_back_to_uneven_receivers(delta: Any) -> None:
    """torch's store ends a client's wait early when a queue it once waited on gets a push (it keeps the
    client registered there); the slot of a bucket the slow worker had not read was then reused: a hang or a
    torn target within a few syncs, before the control channel stopped waiting on queues."""
    res = run_ranks(_uneven, 3, CTX.Queue(), 3, 16, delta, timeout=50)
    assert res == [16, 16, 16], res


def _slot_handles() -> tuple[int, int]:
    """This process's descriptors and mappings of shared-memory slots."""
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            fds += "groupbridge-slot" in os.readlink(f"/proc/self/fd/{name}")
    with open("/proc/self/maps") as f:
        maps = sum("groupbridge-slot" in line for line in f)
    return fds, maps


def _aborted_cycles(rank: int, ports: list[Any]) -> list[tuple[int, int]]:
    """Syncs over shm that the sender's source aborts midway, each on a group of its own, with the cycle
    collector off: what close() leaves behind is what reference counting alone cannot free."""
    import gc

    gc.disable()
    out = []
    n = 16
    specs = {f"w{i}": ((1 << 18,), torch.float32) for i in range(n)}
    for cycle, ports_of_cycle in enumerate(ports):
        g = make_group(rank, 2, "127.0.0.1", ports_of_cycle, generation=cycle)
        try:
            if rank == 0:
                snd = gb.WeightSender(g, bucket_bytes=1 << 20, transport="shm")

                def source() -> Any:
                    for i in range(n):
                        if i == 10:
                            raise RuntimeError("the trainer's source failed")
                        yield f"w{i}", torch.full((1 << 18,), float(i))

                with pytest.raises(gb.WeightSyncError):
                    snd.send(source(), version=1, specs=specs)
                snd.close()
            else:
                rcv = gb.WeightReceiver(g, src=0)
                with pytest.raises(gb.GroupBridgeError):
                    rcv.receive_into({name: torch.zeros(1 << 18) for name in specs})
                rcv.close()
        finally:
            g.close()
        out.append(_slot_handles())
    return out


@pytest.mark.timeout(90)
def test_close_after_aborted_shm_syncs_leaves_no_slot_behind() -> None:
    """G5: after aborted syncs, close() left the slots' descriptors and mappings to the cycle collector
    (a raised error held in a local of the frame it was raised from: a cycle through its traceback)."""
    res = run_ranks(_aborted_cycles, 2, [CTX.Queue() for _ in range(3)], timeout=80)
    assert res == [[(0, 0)] * 3, [(0, 0)] * 3], res
