"""StatelessGroup: a group between independent jobs that never touches torch.distributed's global state.

Rank 0 serves a TCPStore on a socket it bound itself; the others connect, prove they belong (name,
generation, world size, optional shared token), and wait until every rank has joined. Objects travel through
the store in a safe encoding and are deleted as soon as every receiver has read them; tensors travel over a
gloo ProcessGroup (CPU) or the device's own backend (created on first use), both built outside the global
state. Every wait is bounded, and each member publishes a heartbeat so that survivors learn of a dead peer
long before the group timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _torch_private, codec
from ._fmt import ranks, seconds
from ._join import host_join, member_join
from ._liveness import Heartbeat
from ._torch_private import PrefixStore, Store
from .errors import (
    GroupBridgeError,
    GroupClosedError,
    PeerDiedError,
    PeerTimeoutError,
    StoreUnreachableError,
)
from .net import Address, Listener, listen, source_address_for
from .store import connect_store, host_store, namespace

logger = logging.getLogger(__name__)

__all__ = ["StatelessGroup", "Work"]

T = TypeVar("T")


def _wait_into(work: Any, outcome: list[BaseException | None], finished: threading.Event) -> None:
    try:
        work.wait()
        outcome.append(None)
    except BaseException as e:  # handed to the waiting thread, which raises it
        outcome.append(e)
    finally:
        finished.set()


class Work:
    """A tensor operation in flight; :meth:`wait` is bounded and watches the peers' liveness."""

    def __init__(self, group: StatelessGroup, work: Any, what: str, peers: list[int]) -> None:
        self._group = group
        self._work = work
        self._what = what
        self._peers = peers
        self._done = False

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> None:
        if self._done:
            return
        self._group._wait_work(self._work, self._what, self._peers, timeout)
        self._done = True


class StatelessGroup:
    """A group of ``world_size`` processes from independent jobs; see :meth:`create`."""

    rank: int
    world_size: int
    name: str
    generation: int
    timeout: timedelta
    liveness_timeout: timedelta
    allow_pickle: bool
    address: Address
    host_ids: list[str]
    """Each member's host identity (host name plus boot id), in rank order."""
    _token: str | None
    _nonce: str
    _ns: str
    _closed: bool
    _broken: str | None
    _gloo: Any
    _device_groups: dict[str, Any]
    _coll_seq: int
    _send_seq: dict[tuple[int, str], int]
    _recv_seq: dict[tuple[int, str], int]
    _heartbeat: Heartbeat | None
    _raw_store: Store | None
    _store: Store
    _owned_listener: Listener | None

    def __init__(self) -> None:  # use create()
        raise TypeError("use StatelessGroup.create(...)")

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(
        cls,
        address_or_host: str | Address | None,
        port: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        listener: Listener | None = None,
        name: str = "bridge",
        generation: int = 0,
        timeout: timedelta = timedelta(seconds=300),
        token: str | None = None,
        allow_pickle: bool = False,
        liveness_timeout: timedelta = timedelta(seconds=10),
        use_libuv: bool = True,
    ) -> StatelessGroup:
        """Join (rank > 0) or host (rank 0) a group; returns once all ``world_size`` ranks have joined.

        Args:
            address_or_host: where rank 0 serves the store: ``"host:port"``, ``"[v6]:port"``, an
                :class:`Address`, or a bare host with ``port``. Rank 0 may pass ``None`` with a ``listener``.
            port: the store's port, when ``address_or_host`` has none.
            rank, world_size: this member's rank and the group's size (rank 0 hosts the store).
            listener: on rank 0, a socket from :func:`groupbridge.listen`; the store takes it over. Without
                one, rank 0 binds ``address_or_host`` itself.
            name, generation: the group's identity; members of another name or generation are refused, and
                every key lives under that namespace.
            timeout: bound on the join and the default bound on every later operation.
            token: a shared secret; members prove they hold it (HMAC over a fresh nonce, never sent).
            allow_pickle: let objects outside the safe set travel pickled. Every member must agree.
            liveness_timeout: a peer whose heartbeat does not advance for this long is declared dead.
            use_libuv: the TCPStore implementation (torch's default: libuv).

        Raises:
            ValueError, TypeError: bad arguments.
            JoinTimeoutError: not every rank joined within ``timeout`` (the message names the missing ranks).
            GroupMismatchError: a member of another name, generation, world size or token; a duplicate rank.
            StoreUnreachableError: a joiner could not reach the store.
        """
        for label, value in (("rank", rank), ("world_size", world_size), ("generation", generation)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {type(value).__name__}")
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
        if not isinstance(timeout, timedelta) or not isinstance(liveness_timeout, timedelta):
            raise TypeError("timeout and liveness_timeout must be datetime.timedelta")
        if not name or "/" in name:
            raise ValueError(f"name={name!r} must be non-empty and contain no '/'")
        if token is not None and not isinstance(token, str):
            raise TypeError("token must be a str")
        if listener is not None and rank != 0:
            raise ValueError(f"listener= is for rank 0, which hosts the store; this is rank {rank}")

        if listener is not None:
            address = listener.address
        elif address_or_host is None:
            raise ValueError("address_or_host is required (or, on rank 0, a listener)")
        else:
            address = (
                address_or_host if isinstance(address_or_host, Address) else Address.parse(address_or_host)
            )
            if port is not None:
                address = address.with_port(port)
            if address.port is None:
                raise ValueError(f"address {address} has no port; pass port= or host:port")
            if rank != 0 and address.port == 0:
                raise ValueError(f"rank {rank} cannot connect to port 0; pass the port rank 0 listens on")

        self = object.__new__(cls)
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.generation = generation
        self.timeout = timeout
        self.liveness_timeout = liveness_timeout
        self.allow_pickle = allow_pickle
        self._token = token
        self._ns = namespace(name, generation)
        self._closed = False
        self._broken = None
        self._gloo = None
        self._device_groups = {}
        self._coll_seq = 0
        self._send_seq = {}
        self._recv_seq = {}
        self._heartbeat = None
        self._raw_store = None
        self._owned_listener = None
        self.host_ids = []

        try:
            if rank == 0:
                if listener is None:
                    listener = self._owned_listener = listen(address)
                    address = listener.address
                self.address = address
                self._raw_store = host_store(listener, timeout, use_libuv=use_libuv)
                host_join(self, self._raw_store)
            else:
                self.address = address
                self._raw_store = connect_store(address, timeout, use_libuv=use_libuv)
                member_join(self, self._raw_store)
            self._store = PrefixStore(self._ns, self._raw_store)
            self._start_heartbeat(use_libuv)
            bind = self._bind_host()
            try:
                self._gloo = _torch_private.new_gloo_group(
                    PrefixStore("gloo", self._store), rank, world_size, timeout, bind
                )
            except RuntimeError as e:
                raise StoreUnreachableError(
                    f"rank {rank}: connecting the gloo group of {self._where()} failed (a peer or the store "
                    f"host is gone?): {e}"
                ) from e
        except BaseException:
            self._teardown()
            raise
        logger.info("[%s] rank %d of %d joined at %s", name, rank, world_size, self.address)
        return self

    def _where(self) -> str:
        return f"group '{self.name}' (generation {self.generation}) at {self.address}"

    def _bind_host(self) -> str:
        if self.rank == 0:
            host = self.address.host
            return "" if host in ("0.0.0.0", "::") else host
        return source_address_for(self.address)

    # ------------------------------------------------------------------ liveness

    def _start_heartbeat(self, use_libuv: bool) -> None:
        store = PrefixStore(self._ns, connect_store(self.address, self.timeout, use_libuv=use_libuv))
        self._heartbeat = Heartbeat(store, self.rank, self.world_size, self.liveness_timeout, self.name)
        self._heartbeat.start()

    def _check_peers(self, peers: Iterable[int]) -> None:
        """Raise if a peer aborted or stopped beating, or the store host is gone (the watcher's findings)."""
        hb = self._heartbeat
        if hb is None:
            return
        if hb.error is not None:
            raise StoreUnreachableError(
                f"rank {self.rank}: the store of {self._where()} (hosted by rank 0) stopped answering: "
                f"{hb.error}"
            )
        if hb.abort is not None:
            info = json.loads(hb.abort)
            self._broken = f"rank {info['rank']} aborted: {info['reason']}"
            raise PeerDiedError(f"{self._where()}: {self._broken}")
        stale = hb.stale(peers)
        if stale is not None:
            peer, silent = stale
            try:
                why = "closed the group" if self._store.check([f"closed/{peer}"]) else "stopped its heartbeat"
            except RuntimeError:
                why = "stopped its heartbeat"
            self._broken = f"rank {peer} {why} ({silent:.1f}s without a sign of life)"
            raise PeerDiedError(f"{self._where()}: {self._broken}")

    def _poll(
        self, ready: Callable[[], bool], deadline: float, what: str, peers: list[int], *, live: bool = True
    ) -> None:
        delay = 0.0002
        try:
            while not ready():
                if live:
                    self._check_peers(peers)
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(
                        f"rank {self.rank} of {self._where()} waited {seconds(self.timeout)} for {what} "
                        f"from rank(s) {ranks(peers)}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.001)
        except (GroupBridgeError, ValueError, TypeError):
            raise
        except RuntimeError as e:  # DistError and friends: the store connection broke
            raise StoreUnreachableError(
                f"rank {self.rank}: the store of {self._where()} (hosted by rank 0) stopped answering "
                f"while waiting for {what}: {e}"
            ) from e

    def _store_call(self, fn: Callable[[], T], what: str) -> T:
        try:
            return fn()
        except RuntimeError as e:
            if isinstance(e, GroupBridgeError):
                raise
            raise StoreUnreachableError(
                f"rank {self.rank}: the store of {self._where()} (hosted by rank 0) failed during {what}: {e}"
            ) from e

    def _put(self, key: str, data: bytes, what: str) -> None:
        # Store.set is typed for str but takes bytes unchanged.
        self._store_call(lambda: self._store.set(key, data), what)  # type: ignore[arg-type]

    def _deadline(self, timeout: timedelta | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()

    def _check_open(self) -> None:
        if self._closed:
            raise GroupClosedError(f"{self._where()} is closed (rank {self.rank})")
        if self._broken is not None:
            raise GroupClosedError(f"{self._where()} is broken and must be made again: {self._broken}")

    # ------------------------------------------------------------------ objects

    def _encode(self, obj: Any) -> bytes:
        return codec.encode(obj, allow_pickle=self.allow_pickle)

    def _decode(self, data: bytes) -> Any:
        return codec.decode(data, allow_pickle=self.allow_pickle)

    def _peer(self, peer: int, label: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"{label}={peer!r} is not a rank of this group (0..{self.world_size - 1})")
        if peer == self.rank:
            raise ValueError(f"{label}={peer} is this rank itself")

    def send_obj(self, obj: Any, dst: int, *, tag: str = "") -> None:
        """Send ``obj`` to ``dst`` (returns at once; the store holds it until ``dst`` reads it).

        ``tag`` names a separate channel: messages of one tag arrive in order, independently of other tags
        (a weight sync's acknowledgements travel on their own tag, so they never mix with the caller's).
        """
        self._check_open()
        self._peer(dst, "dst")
        if "/" in tag:
            raise ValueError(f"tag={tag!r} must not contain '/'")
        data = self._encode(obj)
        seq = self._send_seq.get((dst, tag), 0)
        self._put(f"p2p/{tag}/{self.rank}/{dst}/{seq}", data, "send_obj")
        self._send_seq[(dst, tag)] = seq + 1

    def recv_obj(self, src: int, timeout: timedelta | None = None, *, tag: str = "") -> Any:
        """Receive the next object ``src`` sent to this rank on ``tag``."""
        self._check_open()
        self._peer(src, "src")
        seq = self._recv_seq.get((src, tag), 0)
        key = f"p2p/{tag}/{src}/{self.rank}/{seq}"
        self._poll(lambda: self._store.check([key]), self._deadline(timeout), f"object #{seq}", [src])
        data = self._store_call(lambda: self._store.get(key), "recv_obj")
        self._store_call(lambda: self._store.delete_key(key), "recv_obj")
        self._recv_seq[(src, tag)] = seq + 1
        return self._decode(data)

    def _next_seq(self) -> int:
        self._coll_seq += 1
        return self._coll_seq

    def broadcast_obj(self, obj: Any, src: int = 0, timeout: timedelta | None = None) -> Any:
        """Every rank returns ``src``'s ``obj``; the key is deleted by the last reader."""
        self._check_open()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of this group (0..{self.world_size - 1})")
        key = f"bc/{self._next_seq()}"
        if self.rank == src:
            data = self._encode(obj)
            if self.world_size > 1:
                self._put(key, data, "broadcast_obj")
            return obj
        self._poll(lambda: self._store.check([key]), self._deadline(timeout), "a broadcast object", [src])
        data = self._store_call(lambda: self._store.get(key), "broadcast_obj")
        if self._store_call(lambda: self._store.add(f"{key}/n", 1), "broadcast_obj") == self.world_size - 1:
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/n")
        return self._decode(data)

    def all_gather_obj(self, obj: Any, timeout: timedelta | None = None) -> list[Any]:
        """Every rank returns the list of every rank's ``obj``, in rank order."""
        self._check_open()
        data = self._encode(obj)
        base = f"ag/{self._next_seq()}"
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._put(keys[self.rank], data, "all_gather_obj")
        others = [r for r in range(self.world_size) if r != self.rank]
        self._poll(lambda: self._store.check(keys), self._deadline(timeout), "all_gather_obj", others)
        out = [
            obj if r == self.rank else self._decode(self._store.get(keys[r])) for r in range(self.world_size)
        ]
        if self._store_call(lambda: self._store.add(f"{base}/n", 1), "all_gather_obj") == self.world_size:
            for k in [*keys, f"{base}/n"]:
                self._store.delete_key(k)
        return out

    def barrier(self, timeout: timedelta | None = None) -> None:
        """Return once every rank has entered; a timeout names the ranks that did not."""
        self._check_open()
        base = f"bar/{self._next_seq()}"
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._store_call(lambda: self._store.set(keys[self.rank], "1"), "barrier")
        deadline = self._deadline(timeout)
        try:
            others = [r for r in range(self.world_size) if r != self.rank]
            self._poll(lambda: self._store.check(keys), deadline, "the barrier", others)
        except PeerTimeoutError:
            missing = [r for r in range(self.world_size) if not self._store.check([keys[r]])]
            raise PeerTimeoutError(
                f"rank {self.rank} of {self._where()} waited {seconds(timeout or self.timeout)} "
                f"at a barrier; rank(s) {ranks(missing)} did not arrive"
            ) from None
        if self._store_call(lambda: self._store.add(f"{base}/n", 1), "barrier") == self.world_size:
            for k in [*keys, f"{base}/n"]:
                self._store.delete_key(k)

    # ------------------------------------------------------------------ tensors

    def _backend_for(self, tensor: torch.Tensor) -> Any:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous (call .contiguous() and copy the result back)")
        kind = tensor.device.type
        if kind == "cpu":
            assert self._gloo is not None
            return self._gloo
        group = self._device_groups.get(kind)
        if group is None:
            from .devices import BACKEND_FOR_DEVICE, backend_available

            backend = BACKEND_FOR_DEVICE.get(kind)
            if backend is None or not backend_available(backend):
                raise ValueError(f"no process-group backend for {kind} tensors in this torch build")
            group = _torch_private.new_device_group(
                kind, PrefixStore(f"dev/{kind}", self._store), self.rank, self.world_size, self.timeout
            )
            self._device_groups[kind] = group
        return group

    def _wait_work(self, work: Any, what: str, peers: list[int], timeout: timedelta | None) -> None:
        deadline = self._deadline(timeout)
        try:
            if self._p2p_work(what):
                # gloo's send/recv work reports completion only from inside wait(), so wait in a helper
                # thread (wait releases the GIL) while this thread watches the clock and the peers.
                outcome: list[BaseException | None] = []
                finished = threading.Event()
                waiter = threading.Thread(target=_wait_into, args=(work, outcome, finished), daemon=True)
                waiter.start()
                self._wait_event(finished, deadline, what, peers, timeout)
                if outcome[0] is not None:
                    raise outcome[0]
            else:
                # Woken by the work's own completion callback: sleeping polls would add up to their
                # interval to every bucket of a weight sync.
                done = threading.Event()
                work.get_future().add_done_callback(lambda _: done.set())
                self._wait_event(done, deadline, what, peers, timeout)
                work.wait()
        except GroupBridgeError as e:
            self._abort(str(e))
            raise
        except RuntimeError as e:
            self._abort(f"{what} failed: {e}")
            raise PeerDiedError(f"rank {self.rank} of {self._where()}: {what} failed: {e}") from e

    def _wait_event(
        self, event: threading.Event, deadline: float, what: str, peers: list[int], timeout: timedelta | None
    ) -> None:
        while not event.wait(0.2):
            self._check_peers(peers)
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"rank {self.rank} of {self._where()} waited {seconds(timeout or self.timeout)} "
                    f"for {what} from rank(s) {ranks(peers)}"
                )

    @staticmethod
    def _p2p_work(what: str) -> bool:
        return what.startswith(("send ", "recv "))

    def _abort(self, reason: str) -> None:
        """Mark the group broken and tell the others, so that nobody waits out the full timeout."""
        if self._broken is None:
            self._broken = reason
        try:
            if not self._store.check(["abort"]):
                self._store.set("abort", json.dumps({"rank": self.rank, "reason": reason}))
        except Exception:  # the store host may be the one that died
            logger.debug("could not publish abort", exc_info=True)
        # Closing our sockets fails peers blocked on us at once instead of at their gloo timeout.
        self._release_process_groups(abort=True)

    def _start(self, what: str, peers: list[int], start: Callable[[], Any], async_op: bool) -> Work | None:
        self._check_open()
        handle = Work(self, start(), what, peers)
        if async_op:
            return handle
        handle.wait()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Broadcast ``tensor`` in place from ``src`` (CPU: gloo; device tensors: NCCL, HCCL or XCCL)."""
        pg = self._backend_for(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        peers = [r for r in range(self.world_size) if r != self.rank] if self.rank == src else [src]
        return self._start(
            f"broadcast from rank {src}", peers, lambda: pg.broadcast([tensor], opts), async_op
        )

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Work | None:
        """All-reduce ``tensor`` in place (``op``: sum, product, min, max, avg where the backend has it)."""
        pg = self._backend_for(tensor)
        ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}  # fmt: skip
        if op not in ops:
            raise ValueError(f"op={op!r} is not one of {', '.join(ops)}")
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops[op]  # type: ignore[assignment]
        others = [r for r in range(self.world_size) if r != self.rank]
        return self._start("all_reduce", others, lambda: pg.allreduce([tensor], opts), async_op)

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to ``dst``, which must post a matching :meth:`recv`."""
        self._peer(dst, "dst")
        pg = self._backend_for(tensor)
        return self._start(f"send to rank {dst}", [dst], lambda: pg.send([tensor], dst, 0), async_op)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` from ``src``."""
        self._peer(src, "src")
        pg = self._backend_for(tensor)
        return self._start(f"recv from rank {src}", [src], lambda: pg.recv([tensor], src, 0), async_op)

    # ------------------------------------------------------------------ teardown

    @property
    def closed(self) -> bool:
        return self._closed

    def _release_process_groups(self, abort: bool = False) -> None:
        groups = [g for g in (self._gloo, *self._device_groups.values()) if g is not None]
        self._gloo = None
        self._device_groups.clear()
        if abort:
            for g in groups:
                try:
                    _torch_private.abort_backend(g)
                except RuntimeError:  # already failed; dropping it is all that is left
                    logger.debug("abort of a process group failed", exc_info=True)

    def _teardown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None  # drops its store connection
        self._release_process_groups()
        self._raw_store = None
        if self._owned_listener is not None:
            self._owned_listener.close()

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Release the process groups, the heartbeat, the store connection and (rank 0) the store.

        Idempotent. Rank 0 waits up to ``timeout`` for the others to close first, so that members still
        finishing their last operation do not lose the store under them.
        """
        if self._closed:
            return
        self._closed = True
        try:
            store = self._store
            store.set(f"closed/{self.rank}", "1")
            if self.rank == 0 and self._broken is None:
                others = [f"closed/{r}" for r in range(1, self.world_size)]
                deadline = time.monotonic() + timeout.total_seconds()
                while others and not store.check(others) and time.monotonic() < deadline:
                    time.sleep(0.01)
        except Exception:  # closing must not fail because a peer or the store is gone
            logger.debug("close: could not coordinate with peers", exc_info=True)
        self._teardown()
        logger.info("[%s] rank %d closed", self.name, self.rank)

    def __enter__(self) -> StatelessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return (
            f"StatelessGroup({self.name!r}, rank={self.rank}, world_size={self.world_size}, "
            f"{self.address}, {state})"
        )
