"""A group's tensor operations: gloo for CPU tensors, the device's own backend (NCCL, HCCL, XCCL) for device
tensors, both built outside torch.distributed's global state; every wait bounded and watching the peers.

The gloo group is connected when the group is made; a device group on the first operation on a tensor of
that device type. Both are released (aborted, if the group broke) when the group closes or aborts.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from .. import _torch_private
from .._fmt import ranks, seconds
from .._torch_private import Backend, PrefixStore
from ..control import Deadline
from ..errors import (
    GroupBridgeError,
    GroupClosedError,
    PeerDiedError,
    PeerTimeoutError,
    StoreUnreachableError,
)
from ..net import source_address_for
from .health import Health
from .state import GroupState
from .threads import background

__all__ = ["Tensors", "Work"]


class _Collectives(Protocol):
    """The calls made on a process group; every backend has them, torch's stubs of ``Backend`` do not."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


class Work:
    """A tensor operation in flight; :meth:`wait` is bounded and watches the peers' liveness."""

    def __init__(self, tensors: Tensors, work: dist.Work, what: str, peers: list[int], p2p: bool) -> None:
        self._tensors = tensors
        self._work = work
        self._what = what
        self._peers = peers
        self._p2p = p2p
        self._done = False

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())

    def wait(self, timeout: timedelta | Deadline | None = None) -> None:
        """Wait for the operation; ``timeout`` (default: the group's) or a shared :class:`Deadline`."""
        if self._done:
            return
        self._tensors.wait_work(self._work, self._what, self._peers, timeout, self._p2p)
        self._done = True


class _Waiter:
    """The group's own thread that calls ``wait()`` on gloo send/recv work (which reports completion only
    from inside ``wait``), so that the caller's thread can watch the clock and the peers meanwhile. One per
    group, started on first use and joined on close."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[dist.Work, list[BaseException | None], threading.Event] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"groupbridge-wait-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, outcome, finished = job
            try:
                work.wait()
                outcome.append(None)
            except BaseException as e:  # handed to the waiting thread, which raises it
                outcome.append(e)
            finally:
                finished.set()

    def submit(self, work: dist.Work) -> tuple[list[BaseException | None], threading.Event]:
        outcome: list[BaseException | None] = []
        finished = threading.Event()
        self._jobs.put((work, outcome, finished))
        return outcome, finished

    def stop(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


class Tensors:
    """One member's tensor operations (see the module docstring).

    Args:
        state: the group's shared state.
        health: the group's health, consulted by every wait.
        abort: the group's abort, called when an operation fails (peers then raise at once).
    """

    def __init__(self, state: GroupState, health: Health, abort: Callable[[str], None]) -> None:
        self._state = state
        self._health = health
        self._abort = abort
        self._gloo: Backend | None = None
        self._device_groups: dict[str, Backend] = {}
        self._waiter: _Waiter | None = None

    # ------------------------------------------------------------------ process groups

    def connect(self) -> None:
        """Connect the gloo group (every member has joined); raises :class:`StoreUnreachableError` if a peer
        or the store host vanished meanwhile."""
        # Every member has joined, so connecting the mesh takes well under a second; a peer that vanished
        # meanwhile must not hold the others for the whole operation timeout. Connect under a short bound,
        # then give the group the operation timeout.
        # gloo takes the bound for each step of its connect but not for the whole (a peer that vanished
        # mid-connect was measured holding a rank for 20 s against a 5 s bound), so the connect runs on a
        # thread of its own and this rank stops waiting at the bound; the abandoned connect ends on its own.
        s = self._state
        t0 = time.monotonic()
        bound = min(s.timeout, max(2 * s.liveness_timeout, timedelta(seconds=5)))
        assert s.pg_client is not None
        store = PrefixStore(f"{s.namespace}/gloo", s.pg_client.get())
        done: list[Backend | BaseException] = []
        bind_host = self._bind_host()

        def connect() -> None:
            try:
                done.append(_torch_private.new_gloo_group(store, s.rank, s.world_size, bound, bind_host))
            except BaseException as e:  # handed to the waiting thread
                done.append(e)

        thread = background(connect, f"groupbridge-gloo-{s.name}-{s.rank}")
        thread.join(bound.total_seconds() + 1.0)
        pg = done[0] if done else None
        if pg is None or isinstance(pg, BaseException):
            failed = self._health.failure()
            why = failed if failed is not None else "a peer or the store host is gone?"
            detail = f": {pg}" if pg is not None else ""
            raise StoreUnreachableError(
                f"rank {s.rank}: connecting the gloo group of {s.where()} failed within "
                f"{seconds(bound)} ({why}){detail}"
            ) from pg
        _torch_private.set_backend_timeout(pg, s.timeout)
        self._gloo = pg
        s.log.debug("gloo connected in %.2fs", time.monotonic() - t0)

    def _bind_host(self) -> str:
        s = self._state
        if s.rank == 0:
            host = s.address.host
            return "" if host in ("0.0.0.0", "::") else host
        return source_address_for(s.address)

    def _backend_for(self, tensor: torch.Tensor) -> _Collectives:
        s = self._state
        s.check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous (call .contiguous() and copy the result back)")
        kind = tensor.device.type
        if kind == "cpu":
            if self._gloo is None:
                raise GroupClosedError(f"{s.where()} has no process group left (rank {s.rank})")
            return cast(_Collectives, self._gloo)
        group = self._device_groups.get(kind)
        if group is None:
            from ..devices import BACKEND_FOR_DEVICE, backend_available

            backend = BACKEND_FOR_DEVICE.get(kind)
            if backend is None or not backend_available(backend):
                raise ValueError(f"no process-group backend for {kind} tensors in this torch build")
            assert s.pg_client is not None
            store = s.pg_client.get()
            store.set_timeout(s.timeout)  # its first collective waits there for rank 0's id
            group = _torch_private.new_device_group(
                kind,
                PrefixStore(f"{s.namespace}/dev/{kind}", store),
                s.rank,
                s.world_size,
                s.timeout,
            )
            self._device_groups[kind] = group
        return cast(_Collectives, group)

    def release(self, abort: bool = False) -> None:
        """Drop the process groups; with ``abort``, abort them first (peers blocked on us fail at once)."""
        groups = [g for g in (self._gloo, *self._device_groups.values()) if g is not None]
        self._gloo = None
        self._device_groups.clear()
        if not abort or not groups:
            return
        # Aborting (and destroying) a gloo group whose peer was cut off mid-operation blocked for 5-6 s
        # (measured: chaos link cuts), so it happens on a thread of its own; the caller waits a moment, not
        # the whole teardown. The peers learn of the abort from the status record, published before.
        released = threading.Event()
        log = self._state.log

        def release() -> None:
            try:
                for g in groups:
                    try:
                        _torch_private.abort_backend(g)
                    except Exception:  # already failed, or a backend without abort: dropping it is all left
                        log.debug("abort of a process group failed", exc_info=True)
                groups.clear()  # the last references: destroyed here, not on the caller's thread
            finally:
                released.set()

        background(release, f"groupbridge-abort-{self._state.name}-{self._state.rank}")
        released.wait(0.5)

    def stop(self) -> None:
        """Stop the waiter thread (teardown, after :meth:`release`)."""
        if self._waiter is not None:
            self._waiter.stop(timeout=5)
            self._waiter = None

    # ------------------------------------------------------------------ waits

    def wait_work(
        self, work: dist.Work, what: str, peers: list[int], timeout: timedelta | Deadline | None, p2p: bool
    ) -> None:
        s = self._state
        deadline = s.deadline(timeout)
        try:
            if p2p:
                # gloo's send/recv work reports completion only from inside wait(): the group's waiter
                # thread calls it while this thread watches the clock and the peers.
                if self._waiter is None:
                    self._waiter = _Waiter(f"{s.name}-{s.rank}")
                outcome, finished = self._waiter.submit(work)
                self._wait_event(finished, deadline, what, peers)
                if outcome[0] is not None:
                    raise outcome[0]
            else:
                # Woken by the work's own completion callback: sleeping polls would add up to their
                # interval to every bucket of a weight sync.
                done = threading.Event()
                work.get_future().add_done_callback(lambda _: done.set())
                self._wait_event(done, deadline, what, peers)
                work.wait()
        except GroupBridgeError as e:
            self._abort(str(e))
            raise
        except RuntimeError as e:
            health = self._health
            failed = health.failure(peers) or health.peer_aborted()
            if failed is None and health.watcher is not None:
                # A peer that aborted closes its sockets right after publishing why; give the watcher a
                # couple of beats to read it, so the error names who gave up and why.
                failed = Deadline(health.grace(0.2)).poll(lambda: health.failure(peers), 0.02)
            self._abort(str(failed) if failed is not None else f"{what} failed: {e}")
            if failed is not None:
                raise failed from e
            raise PeerDiedError(f"rank {s.rank} of {s.where()}: {what} failed: {e}") from e

    def _wait_event(self, event: threading.Event, deadline: Deadline, what: str, peers: list[int]) -> None:
        while not event.wait(0.05):
            self._health.check_peers(peers)
            if deadline.expired():
                raise PeerTimeoutError(
                    f"rank {self._state.rank} of {self._state.where()} waited {deadline} for {what}: rank(s) "
                    f"{ranks(peers)} did not take part in time"
                )

    # ------------------------------------------------------------------ operations

    def _start(
        self, what: str, peers: list[int], start: Callable[[], dist.Work], async_op: bool, p2p: bool
    ) -> Work | None:
        s = self._state
        s.check_open()
        try:
            handle = Work(self, start(), what, peers, p2p)
        except RuntimeError as e:  # e.g. "Too many open files" from gloo: the group cannot go on
            self._abort(f"{what} could not start: {e}")
            raise PeerDiedError(f"rank {s.rank} of {s.where()}: {what} could not start: {e}") from e
        if async_op:
            return handle
        handle.wait()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        s = self._state
        pg = self._backend_for(tensor)
        s.check_rank(src, "src")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        peers = s.others() if s.rank == src else [src]
        what = (
            f"the broadcast from rank {src}" if s.rank != src else f"its broadcast to rank(s) {ranks(peers)}"
        )
        return self._start(what, peers, lambda: pg.broadcast([tensor], opts), async_op, False)

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool) -> Work | None:
        pg = self._backend_for(tensor)
        ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}  # fmt: skip
        if op not in ops:
            raise ValueError(f"op={op!r} is not one of {', '.join(ops)}")
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops[op]  # type: ignore[assignment]
        others = self._state.others()
        return self._start("all_reduce", others, lambda: pg.allreduce([tensor], opts), async_op, False)

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool) -> Work | None:
        self._state.check_peer(dst, "dst")
        pg = self._backend_for(tensor)
        return self._start(f"send to rank {dst}", [dst], lambda: pg.send([tensor], dst, 0), async_op, True)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        self._state.check_peer(src, "src")
        pg = self._backend_for(tensor)
        return self._start(f"recv from rank {src}", [src], lambda: pg.recv([tensor], src, 0), async_op, True)
