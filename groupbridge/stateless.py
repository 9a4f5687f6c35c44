"""StatelessGroup: a group between independent jobs that never touches torch.distributed's global state.

Rank 0 serves a TCPStore on a socket it bound itself; the others connect, prove they belong (name,
generation, world size, optional shared token), and wait until every rank has joined. Objects travel through
the group's control channel (:mod:`.control`) in a safe encoding, sealed when the group has a token, and
nothing of them stays in the store once every receiver has read them; tensors travel over a gloo
ProcessGroup (CPU) or the device's own backend (created on first use), both built outside the global state.
Every wait is bounded, and each member publishes a status record so that survivors learn of a dead, frozen
or failed peer within the liveness timeout, whatever the operation timeout.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _torch_private, codec
from ._fmt import ranks, seconds
from ._join import host_join, member_join
from ._liveness import Watcher, decode_status, encode_status, status_key
from ._seal import Sealer
from ._torch_private import PrefixStore, TCPStore
from .control import ControlChannel, Deadline
from .errors import (
    GroupBridgeError,
    GroupClosedError,
    PeerDiedError,
    PeerTimeoutError,
    ProtocolError,
    StoreUnreachableError,
)
from .net import Address, Listener, is_loopback, listen, source_address_for
from .store import StoreClient, host_store, namespace, open_client

logger = logging.getLogger(__name__)

__all__ = ["Deadline", "StatelessGroup", "Work"]

WATERMARK_EVERY = 16
INLINE_MAX = 64 << 10
"""A broadcast object larger than this is stored once and read by every receiver, not queued to each."""
_INLINE = b"v"
_AT_KEY = b"k"


class Work:
    """A tensor operation in flight; :meth:`wait` is bounded and watches the peers' liveness."""

    def __init__(self, group: StatelessGroup, work: Any, what: str, peers: list[int], p2p: bool) -> None:
        self._group = group
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
        self._group._wait_work(self._work, self._what, self._peers, timeout, self._p2p)
        self._done = True


class _Waiter:
    """The group's own thread that calls ``wait()`` on gloo send/recv work (which reports completion only
    from inside ``wait``), so that the caller's thread can watch the clock and the peers meanwhile. One per
    group, started on first use and joined on close."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, list[BaseException | None], threading.Event] | None] = (
            queue.SimpleQueue()
        )
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

    def submit(self, work: Any) -> tuple[list[BaseException | None], threading.Event]:
        outcome: list[BaseException | None] = []
        finished = threading.Event()
        self._jobs.put((work, outcome, finished))
        return outcome, finished

    def stop(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


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
    """Each member's host identity (see :func:`groupbridge.net.host_identity`), in rank order."""
    pids: list[int]
    """Each member's process id, as it declared at join (sealed with a token)."""
    control: ControlChannel
    """The group's control channel, public for protocols built on the group (the weight-sync transports are
    such): group-scoped keys (``put``/``get``/``add``/``check``/``delete``) and queues (``push``/``pop``),
    sealed with the token, acknowledged, every wait bounded by a :class:`Deadline` (``group.deadline()``)
    and named by the ranks waited for."""
    _token: str | None
    _ns: str
    _closed: bool
    _broken: str | None
    _gloo: Any
    _device_groups: dict[str, Any]
    _coll_seq: int
    _send_seq: dict[tuple[int, str], int]
    _recv_seq: dict[tuple[int, str], int]
    _watcher: Watcher | None
    _server: TCPStore | None
    _client: StoreClient | None
    _watch_client: StoreClient | None
    _owned_listener: Listener | None
    _waiter: _Waiter | None
    _garbage: deque[tuple[int, list[str]]]
    _sealer: Sealer
    _teardown_lock: threading.Lock
    _aborted: bool

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
            token: a shared secret. Members prove they hold it at join, and every control message (objects,
                sync headers, signals, acknowledgements, aborts) is sealed with a MAC keyed from it, so a
                process that reaches the store port without the token can deny service but never make a
                member accept anything. Without a token the group trusts whoever reaches the port: bind to
                loopback or a private network (a warning is logged otherwise).
            allow_pickle: let objects outside the safe set travel pickled. Every member must agree.
            liveness_timeout: a peer (or the store host) silent for this long is declared dead; failures
                reach every member within about this long, whatever the operation timeout.

        Raises:
            ValueError, TypeError: bad arguments.
            JoinTimeoutError: not every rank joined within ``timeout`` (the message names the missing ranks).
            GroupMismatchError: a member of another name, generation, world size or token; a duplicate rank.
            StoreUnreachableError: a joiner could not reach the store, or a peer vanished while joining.
        """
        _check_arguments(rank, world_size, generation, timeout, liveness_timeout, name, token, listener)
        address = cls._address(address_or_host, port, rank, listener)

        self = object.__new__(cls)
        self._init(rank, world_size, name, generation, timeout, liveness_timeout, allow_pickle, token)
        try:
            self._join(address, listener)
        except BaseException:
            self._teardown()
            raise
        logger.info("[%s] rank %d of %d joined at %s", name, rank, world_size, self.address)
        return self

    def _init(
        self,
        rank: int,
        world_size: int,
        name: str,
        generation: int,
        timeout: timedelta,
        liveness_timeout: timedelta,
        allow_pickle: bool,
        token: str | None,
    ) -> None:
        """Every attribute, before the join (so that teardown works whatever the join reached)."""
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
        self._watcher = None
        self._server = None
        self._client = None
        self._watch_client = None
        self._owned_listener = None
        self._waiter = None
        self._aborted = False
        self._garbage = deque()
        self._teardown_lock = threading.Lock()
        self.host_ids = []
        self.pids = []

    @staticmethod
    def _address(
        address_or_host: str | Address | None, port: int | None, rank: int, listener: Listener | None
    ) -> Address:
        if listener is not None:
            return listener.address
        if address_or_host is None:
            raise ValueError("address_or_host is required (or, on rank 0, a listener)")
        address = address_or_host if isinstance(address_or_host, Address) else Address.parse(address_or_host)
        if port is not None:
            address = address.with_port(port)
        if address.port is None:
            raise ValueError(f"address {address} has no port; pass port= or host:port")
        if rank != 0 and address.port == 0:
            raise ValueError(f"rank {rank} cannot connect to port 0; pass the port rank 0 listens on")
        return address

    def _io_timeout(self) -> timedelta:
        return max(self.liveness_timeout, timedelta(seconds=1))

    def _join(self, address: Address, listener: Listener | None) -> None:
        if self.rank == 0:
            if listener is None:
                listener = self._owned_listener = listen(address)
            address = listener.address
            self._server = host_store(listener, self.timeout)
            if self._token is None and not is_loopback(address.host):
                logger.warning(
                    "[%s] group without a token listens on %s: anyone who reaches that port can read and "
                    "write its control messages; pass token= or bind to a private network",
                    self.name, address,
                )  # fmt: skip
        self.address = address
        self._client = open_client(address, self.timeout, self._io_timeout())
        t0 = time.monotonic()
        joined = host_join(self, self._client) if self.rank == 0 else member_join(self, self._client)
        self._sealer = joined.sealer
        logger.debug("[%s] rank %d: joined in %.2fs", self.name, self.rank, time.monotonic() - t0)
        self.host_ids = [str(m["host_id"]) for m in joined.members]
        self.pids = [int(m["pid"]) for m in joined.members]
        self.control = ControlChannel(
            self._client, self._ns, self._sealer, self.rank, self._where, self._failure, self._set_awaited
        )
        for r in range(self.world_size):
            if r == self.rank:
                self.control.put(f"wm/{r}", b"0", "joining")
        self._watch_client = open_client(address, self.timeout, self.liveness_timeout)
        self._watcher = Watcher(
            self._watch_client, self._ns, self._sealer, self.rank, self.world_size, self.liveness_timeout,
            self.name, self._wake, self._collect if self.rank == 0 else None, self.control.sweep,
        )  # fmt: skip
        self._watcher.start()
        t0 = time.monotonic()
        self._gloo = self._connect_gloo()
        logger.debug("[%s] rank %d: gloo connected in %.2fs", self.name, self.rank, time.monotonic() - t0)

    def _connect_gloo(self) -> Any:
        # Every member has joined, so connecting the mesh takes well under a second; a peer that vanished
        # meanwhile must not hold the others for the whole operation timeout. Connect under a short bound,
        # then give the group the operation timeout.
        # gloo takes the bound for each step of its connect but not for the whole (a peer that vanished
        # mid-connect was measured holding a rank for 20 s against a 5 s bound), so the connect runs on a
        # thread of its own and this rank stops waiting at the bound; the abandoned connect ends on its own.
        bound = min(self.timeout, max(2 * self.liveness_timeout, timedelta(seconds=5)))
        client = self._client
        assert client is not None
        store = PrefixStore(f"{self._ns}/gloo", client.get())
        done: list[Any] = []

        def connect() -> None:
            try:
                done.append(
                    _torch_private.new_gloo_group(store, self.rank, self.world_size, bound, self._bind_host())
                )
            except BaseException as e:  # handed to the waiting thread
                done.append(e)

        thread = _background(connect, f"groupbridge-gloo-{self.name}-{self.rank}")
        thread.join(bound.total_seconds() + 1.0)
        if not done or isinstance(done[0], BaseException):
            cause = done[0] if done else None
            failed = self._failure()
            why = failed if failed is not None else "a peer or the store host is gone?"
            detail = f": {cause}" if cause is not None else ""
            raise StoreUnreachableError(
                f"rank {self.rank}: connecting the gloo group of {self._where()} failed within "
                f"{seconds(bound)} ({why}){detail}"
            ) from cause
        pg = done[0]
        _torch_private.set_backend_timeout(pg, self.timeout)
        return pg

    def _where(self) -> str:
        return f"group '{self.name}' (generation {self.generation}) at {self.address}"

    def _bind_host(self) -> str:
        if self.rank == 0:
            host = self.address.host
            return "" if host in ("0.0.0.0", "::") else host
        return source_address_for(self.address)

    # ------------------------------------------------------------------ liveness

    def _set_awaited(self, peers: Iterable[int]) -> None:
        if self._watcher is not None:
            self._watcher.awaited = tuple(peers)

    def _wake(self) -> None:
        """Called by the watcher on a finding: wake the caller's wait (its connection is then spent)."""
        with self._teardown_lock:
            if self._client is not None:
                self._client.interrupt()

    def _failure(self, peers: Iterable[int] = ()) -> GroupBridgeError | None:
        """The error that describes why the group broke (a watcher's finding), or None while it is healthy."""
        w = self._watcher
        if w is None:
            return None
        finding = w.finding
        if finding is None:
            for peer in peers:
                finding = w.silent(peer) or w.gone(peer)
                if finding is not None:
                    break
        if finding is None:
            return None
        suspended = (
            f" (this process itself did not run for {w.stopped_for:.1f}s)" if w.stopped_for > w.limit else ""
        )
        if self._broken is None:
            self._broken = finding.text
        text = f"rank {self.rank} of {self._where()}: {finding.text}{suspended}"
        if finding.kind == "store":
            return StoreUnreachableError(text)
        if finding.kind == "crashed":
            err = GroupBridgeError(f"{text}; the group can no longer see its peers and must be made again")
            err.__cause__ = w.error
            return err
        return PeerDiedError(text)

    def errored(self) -> BaseException | None:
        """What went wrong on a thread this group owns (its liveness watcher), if anything; the next call on
        the group raises it too. None while every such thread is healthy."""
        w = self._watcher
        return w.error if w is not None else None

    def _peer_statuses(self, store: TCPStore | None = None) -> dict[int, dict[str, Any] | None]:
        """Every other member's status record, read now on the caller's connection (one round trip); a
        malformed or forged record reads as None. Raises RuntimeError when the store does not answer."""
        if store is None:
            if self._client is None or self._client.interrupted:
                raise StoreUnreachableError(f"rank {self.rank}: no usable store connection")
            store = self._client.get()
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"{self._ns}/{status_key(r)}" for r in others]
        store.set_timeout(self._io_timeout())
        out: dict[int, dict[str, Any] | None] = {}
        for r, key, raw in zip(others, keys, store.multi_get(keys), strict=True):
            try:
                out[r] = decode_status(self._sealer.open(key, bytes(raw)))
            except ProtocolError:
                out[r] = None
        return out

    def _peer_aborted(self) -> GroupBridgeError | None:
        """After a data-plane failure: a peer that published why it aborted (read now, not at the next
        beat), so the error names who gave up and why rather than "connection closed by peer"."""
        if self._watcher is None:
            return None
        try:
            statuses = self._peer_statuses()
        except (RuntimeError, GroupBridgeError):  # torch's store errors, or no usable connection left
            return None
        for peer, status in statuses.items():
            if status is not None and status["state"] == "aborted":
                if self._broken is None:
                    self._broken = f"rank {peer} aborted: {status['reason']}"
                return PeerDiedError(
                    f"rank {self.rank} of {self._where()}: rank {peer} aborted: {status['reason']}"
                )
        return None

    def _await_peers_done(self, deadline: Deadline, store: TCPStore | None = None) -> None:
        """Wait (bounded) until every other member has published that it aborted or closed."""

        def all_done() -> bool | None:
            statuses = self._peer_statuses(store)
            return True if all(st is not None and st["state"] != "live" for st in statuses.values()) else None

        try:
            deadline.poll(all_done, 0.01)
        except (RuntimeError, GroupBridgeError):  # the store or our connection is gone: nobody is left
            return

    def _check_peers(self, peers: Iterable[int]) -> None:
        """Raise if a peer aborted, went silent or closed, or the store host is gone (the watcher saw it)."""
        failed = self._failure(peers)
        if failed is not None:
            raise failed

    def check_open(self) -> None:
        """Raise :class:`GroupClosedError` if this group was closed or broke (a peer failed, an abort)."""
        if self._closed:
            raise GroupClosedError(f"{self._where()} is closed (rank {self.rank})")
        if self._broken is not None:
            raise GroupClosedError(f"{self._where()} is broken and must be made again: {self._broken}")

    def deadline(self, timeout: timedelta | Deadline | None = None) -> Deadline:
        """A :class:`Deadline` from ``timeout`` (default: the group's); a Deadline passes through."""
        if isinstance(timeout, Deadline):
            return timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        return Deadline(self.timeout if timeout is None else timeout)

    # ------------------------------------------------------------------ objects

    def _encode(self, obj: Any) -> bytes:
        return codec.encode(obj, allow_pickle=self.allow_pickle)

    def _decode(self, data: bytes, src: int) -> Any:
        try:
            return codec.decode(data, allow_pickle=self.allow_pickle)
        except ProtocolError as e:
            raise ProtocolError(f"rank {self.rank} of {self._where()}: object from rank {src}: {e}") from e

    def _peer(self, peer: int, label: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"{label}={peer!r} is not a rank of this group (0..{self.world_size - 1})")
        if peer == self.rank:
            raise ValueError(f"{label}={peer} is this rank itself")

    @staticmethod
    def _tag(tag: str) -> None:
        if not isinstance(tag, str) or "/" in tag:
            raise ValueError(f"tag={tag!r} must be a str without '/'")

    def send_obj(self, obj: Any, dst: int, *, tag: str = "") -> None:
        """Send ``obj`` to ``dst``; returns once the store holds it (until ``dst`` reads it).

        ``tag`` names a separate channel: messages of one tag arrive in order, independently of other tags
        (a weight sync's acknowledgements travel on their own tag, so they never mix with the caller's).
        """
        self.check_open()
        self._peer(dst, "dst")
        self._tag(tag)
        data = self._encode(obj)
        seq = self._send_seq.get((dst, tag), 0)
        channel = f"p2p/{tag}/{self.rank}/{dst}"
        self.control.push([channel], seq, data, "send_obj", binding=channel)
        self._send_seq[(dst, tag)] = seq + 1

    def recv_obj(self, src: int, timeout: timedelta | Deadline | None = None, *, tag: str = "") -> Any:
        """Receive the next object ``src`` sent to this rank on ``tag``."""
        self.check_open()
        self._peer(src, "src")
        self._tag(tag)
        seq = self._recv_seq.get((src, tag), 0)
        channel = f"p2p/{tag}/{src}/{self.rank}"
        data = self.control.pop(
            channel, seq, src, self.deadline(timeout), f"object #{seq} (tag {tag!r})", binding=channel
        )
        self._recv_seq[(src, tag)] = seq + 1
        return self._decode(data, src)

    def _next_seq(self) -> int:
        self._coll_seq += 1
        return self._coll_seq

    def _done_collective(self, seq: int, keys: list[str], *, flush: bool = False) -> None:
        """Keys of a finished collective are deleted by rank 0's watcher once every rank has passed it.

        Each rank posts how far it got every ``WATERMARK_EVERY`` collectives (and at every barrier), not
        after each: a store request per operation is a third of a small object's cost. At most that many
        collectives' keys wait for deletion.
        """
        if self.rank == 0 and keys:
            self._garbage.append((seq, keys))
        if flush or seq % WATERMARK_EVERY == 0:
            self.control.post(f"wm/{self.rank}", str(seq).encode(), "a collective")

    def _collect(self, client: StoreClient) -> None:
        """On rank 0's watcher thread: delete the keys of collectives every rank has finished."""
        if not self._garbage:
            return
        store = client.get()
        raws = store.multi_get([f"{self._ns}/wm/{r}" for r in range(self.world_size)])
        try:
            passed = min(
                int(bytes(self._sealer.open(f"{self._ns}/wm/{r}", bytes(v)))) for r, v in enumerate(raws)
            )
        except (ValueError, ProtocolError):  # a forged or torn watermark: collect later
            return
        while self._garbage and self._garbage[0][0] <= passed:
            for key in self._garbage[0][1]:
                store.delete_key(f"{self._ns}/{key}")
            self._garbage.popleft()  # only once deleted: an empty deque means the keys are gone

    def broadcast_obj(self, obj: Any, src: int = 0, timeout: timedelta | Deadline | None = None) -> Any:
        """Every rank returns ``src``'s ``obj``; ``src`` returns once the store holds it."""
        self.check_open()
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src={src!r} is not a rank of this group (0..{self.world_size - 1})")
        if self.world_size == 1:
            self._encode(obj)
            return obj
        data = self._encode(obj) if self.rank == src else b""  # a refused object consumes no sequence
        seq = self._next_seq()
        binding = f"bc/{src}"
        if self.rank == src:
            queues = [f"{binding}/{r}" for r in range(self.world_size) if r != src]
            keys = []
            if len(data) > INLINE_MAX and len(queues) > 1:  # one copy in the store, read by everyone
                keys = [f"bc/{seq}"]
                self.control.put(keys[0], data, "broadcast_obj")
                self.control.push(queues, seq, _AT_KEY, "broadcast_obj", binding=binding)
            else:
                self.control.push(queues, seq, _INLINE + data, "broadcast_obj", binding=binding)
            self._done_collective(seq, keys)
            return obj
        deadline = self.deadline(timeout)
        what = "a broadcast object"
        msg = self.control.pop(f"{binding}/{self.rank}", seq, src, deadline, what, binding=binding)
        keys = []
        if msg == _AT_KEY:
            keys = [f"bc/{seq}"]
            msg = _INLINE + self.control.get_one(keys[0], src, deadline, what)
        if not msg.startswith(_INLINE):
            raise ProtocolError(f"rank {self.rank} of {self._where()}: malformed broadcast from rank {src}")
        self._done_collective(seq, keys)
        return self._decode(msg[1:], src)

    def all_gather_obj(self, obj: Any, timeout: timedelta | Deadline | None = None) -> list[Any]:
        """Every rank returns the list of every rank's ``obj``, in rank order."""
        self.check_open()
        data = self._encode(obj)
        if self.world_size == 1:
            return [obj]
        seq = self._next_seq()
        keys = [f"ag/{seq}/{r}" for r in range(self.world_size)]
        self.control.post(keys[self.rank], data, "all_gather_obj")
        others = [r for r in range(self.world_size) if r != self.rank]
        got = self.control.get([keys[r] for r in others], others, self.deadline(timeout), "all_gather_obj")
        out = [obj] * self.world_size
        for r, value in zip(others, got, strict=True):
            out[r] = self._decode(value, r)
        self._done_collective(seq, keys)
        return out

    def barrier(self, timeout: timedelta | Deadline | None = None) -> None:
        """Return once every rank has entered; a timeout names the ranks that did not."""
        self.check_open()
        if self.world_size == 1:
            return
        seq = self._next_seq()
        keys = [f"bar/{seq}/{r}" for r in range(self.world_size)]
        self.control.post(keys[self.rank], b"1", "barrier")
        others = [r for r in range(self.world_size) if r != self.rank]
        self.control.get([keys[r] for r in others], others, self.deadline(timeout), "the barrier")
        self._done_collective(seq, keys, flush=True)

    # ------------------------------------------------------------------ tensors

    def _backend_for(self, tensor: torch.Tensor) -> Any:
        self.check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous (call .contiguous() and copy the result back)")
        kind = tensor.device.type
        if kind == "cpu":
            if self._gloo is None:
                raise GroupClosedError(f"{self._where()} has no process group left (rank {self.rank})")
            return self._gloo
        group = self._device_groups.get(kind)
        if group is None:
            from .devices import BACKEND_FOR_DEVICE, backend_available

            backend = BACKEND_FOR_DEVICE.get(kind)
            if backend is None or not backend_available(backend):
                raise ValueError(f"no process-group backend for {kind} tensors in this torch build")
            assert self._client is not None
            group = _torch_private.new_device_group(
                kind, PrefixStore(f"{self._ns}/dev/{kind}", self._client.get()), self.rank, self.world_size,
                self.timeout,
            )  # fmt: skip
            self._device_groups[kind] = group
        return group

    def _wait_work(
        self, work: Any, what: str, peers: list[int], timeout: timedelta | Deadline | None, p2p: bool
    ) -> None:
        deadline = self.deadline(timeout)
        try:
            if p2p:
                # gloo's send/recv work reports completion only from inside wait(): the group's waiter
                # thread calls it while this thread watches the clock and the peers.
                if self._waiter is None:
                    self._waiter = _Waiter(f"{self.name}-{self.rank}")
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
            self.abort(str(e))
            raise
        except RuntimeError as e:
            failed = self._failure(peers) or self._peer_aborted()
            if failed is None and self._watcher is not None:
                # A peer that aborted closes its sockets right after publishing why; give the watcher a
                # couple of beats to read it, so the error names who gave up and why.
                grace = Deadline(timedelta(seconds=min(2 * self._watcher.interval + 0.2, 2.0)))
                failed = grace.poll(lambda: self._failure(peers), 0.02)
            self.abort(str(failed) if failed is not None else f"{what} failed: {e}")
            if failed is not None:
                raise failed from e
            raise PeerDiedError(f"rank {self.rank} of {self._where()}: {what} failed: {e}") from e

    def _wait_event(self, event: threading.Event, deadline: Deadline, what: str, peers: list[int]) -> None:
        while not event.wait(0.05):
            self._check_peers(peers)
            if deadline.expired():
                raise PeerTimeoutError(
                    f"rank {self.rank} of {self._where()} waited {deadline} for {what} from rank(s) "
                    f"{ranks(peers)}"
                )

    def abort(self, reason: str) -> None:
        """Break the group and tell every peer why, so that nobody waits out a timeout.

        Peers blocked on this member raise within about ``liveness_timeout``, naming this rank and
        ``reason``. Idempotent; the group must then be made again.
        """
        first = not self._aborted
        self._aborted = True
        if self._broken is None:
            self._broken = reason
        if self._watcher is not None:
            self._watcher.publish("aborted", reason[:2000])
            if first and self._client is not None and not self._client.interrupted:
                key = f"{self._ns}/{status_key(self.rank)}"
                try:
                    record = self._sealer.seal(key, encode_status(1 << 60, "aborted", reason[:2000]))
                    store = self._client.get()
                    store.set(key, record)  # type: ignore[arg-type]
                    store.check([key])  # acknowledged before our sockets close: peers find the reason
                except (
                    RuntimeError,
                    GroupBridgeError,
                ):  # the store may be what failed; the next beat retries
                    logger.debug("could not publish abort", exc_info=True)
        # Closing our sockets fails peers blocked on us at once instead of at their gloo timeout.
        self._release_process_groups(abort=True)
        if first and self.rank == 0:
            self._linger()

    def _linger(self) -> None:
        """The store host, aborting: keep serving briefly so that peers read why before it may go away
        (a process that fails usually exits next), bounded by two of its beats."""
        w = self._watcher
        if w is not None and self.world_size > 1:
            # on the server's own connection: the caller's may already be shut down by the watcher
            wait = Deadline(timedelta(seconds=min(2 * w.interval + 0.5, 2.0)))
            self._await_peers_done(wait, self._server)

    def _start(
        self, what: str, peers: list[int], start: Callable[[], Any], async_op: bool, p2p: bool
    ) -> Work | None:
        self.check_open()
        try:
            handle = Work(self, start(), what, peers, p2p)
        except RuntimeError as e:  # e.g. "Too many open files" from gloo: the group cannot go on
            self.abort(f"{what} could not start: {e}")
            raise PeerDiedError(f"rank {self.rank} of {self._where()}: {what} could not start: {e}") from e
        if async_op:
            return handle
        handle.wait()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Broadcast ``tensor`` in place from ``src`` (CPU: gloo; device tensors: NCCL, HCCL or XCCL)."""
        pg = self._backend_for(tensor)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src={src!r} is not a rank of this group (0..{self.world_size - 1})")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        peers = [r for r in range(self.world_size) if r != self.rank] if self.rank == src else [src]
        return self._start(
            f"broadcast from rank {src}", peers, lambda: pg.broadcast([tensor], opts), async_op, False
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
        return self._start("all_reduce", others, lambda: pg.allreduce([tensor], opts), async_op, False)

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to ``dst``, which must post a matching :meth:`recv`."""
        self._peer(dst, "dst")
        pg = self._backend_for(tensor)
        return self._start(f"send to rank {dst}", [dst], lambda: pg.send([tensor], dst, 0), async_op, True)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` from ``src``."""
        self._peer(src, "src")
        pg = self._backend_for(tensor)
        return self._start(f"recv from rank {src}", [src], lambda: pg.recv([tensor], src, 0), async_op, True)

    # ------------------------------------------------------------------ teardown

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sealed(self) -> bool:
        """Whether control messages carry a MAC (the group has a token)."""
        return self._sealer.enabled

    def _release_process_groups(self, abort: bool = False) -> None:
        groups = [g for g in (self._gloo, *self._device_groups.values()) if g is not None]
        self._gloo = None
        self._device_groups.clear()
        if not abort or not groups:
            return
        # Aborting (and destroying) a gloo group whose peer was cut off mid-operation blocked for 5-6 s
        # (measured: chaos link cuts), so it happens on a thread of its own; the caller waits a moment, not
        # the whole teardown. The peers learn of the abort from the status record, published before.
        released = threading.Event()

        def release() -> None:
            for g in groups:
                try:
                    _torch_private.abort_backend(g)
                except RuntimeError:  # already failed; dropping it is all that is left
                    logger.debug("abort of a process group failed", exc_info=True)
            groups.clear()  # the last references: destroyed here, not on the caller's thread
            released.set()

        _background(release, f"groupbridge-abort-{self.name}-{self.rank}")
        released.wait(0.5)

    def _teardown(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._release_process_groups(abort=self._broken is not None)
        if self._waiter is not None:
            self._waiter.stop(timeout=5)
            self._waiter = None
        with self._teardown_lock:
            for client in (self._client, self._watch_client):
                if client is not None:
                    client.close()
        self._server = None  # the last reference: the store stops serving and closes its port
        if self._owned_listener is not None:
            self._owned_listener.close()

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Release the process groups, the watcher, the store connections and (rank 0) the store.

        Idempotent. Rank 0 waits up to ``timeout`` for the others to close first, so that members still
        finishing their last operation do not lose the store under them.
        """
        if self._closed:
            return
        self._closed = True
        w = self._watcher
        try:
            if w is not None and self._client is not None and not self._client.interrupted:
                self.control.sweep(self._client, budget=1.0)  # keys discarded since the watcher's last beat
                w.publish("closed")
                key = f"{self._ns}/{status_key(self.rank)}"
                self._client.get().set(key, self._sealer.seal(key, encode_status(1 << 59, "closed")))  # type: ignore[arg-type]
                self._client.get().check([key])
        except (RuntimeError, GroupBridgeError):  # closing must not fail because a peer or the store is gone
            logger.debug("close: could not publish that this member closed", exc_info=True)
        if self.rank == 0 and w is not None and self._server is not None:
            # The store goes with this process: wait until the others closed, so that none loses a
            # message it was about to read. On the server's own connection (the caller's may have been
            # shut down by the watcher); a broken group waits only a couple of beats.
            wait = timeout if self._broken is None else timedelta(seconds=min(2 * w.interval + 0.5, 2.0))
            self._await_peers_done(Deadline(wait), self._server)
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


_BACKGROUND: set[threading.Thread] = set()
_BACKGROUND_LOCK = threading.Lock()
EXIT_GRACE_S = 10.0
"""How long interpreter exit waits for gloo work left running in the background (see :func:`_background`)."""


def _background(fn: Callable[[], None], name: str) -> threading.Thread:
    """Run ``fn`` (gloo connect or teardown, which can block for seconds on a vanished peer) on a daemon
    thread the caller need not wait for. Interpreter exit waits for such threads (up to ``EXIT_GRACE_S``):
    a process exiting while gloo's C++ teardown runs aborts with "terminate called without an active
    exception" instead of exiting with its own status."""

    def run() -> None:
        try:
            fn()
        finally:
            with _BACKGROUND_LOCK:
                _BACKGROUND.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _BACKGROUND_LOCK:
        _BACKGROUND.add(thread)
    thread.start()
    return thread


@atexit.register
def _await_background() -> None:
    end = time.monotonic() + EXIT_GRACE_S
    with _BACKGROUND_LOCK:
        pending = list(_BACKGROUND)
    for thread in pending:
        thread.join(max(0.0, end - time.monotonic()))


def _check_arguments(
    rank: int,
    world_size: int,
    generation: int,
    timeout: timedelta,
    liveness_timeout: timedelta,
    name: str,
    token: str | None,
    listener: Listener | None,
) -> None:
    """:meth:`StatelessGroup.create`'s checks, all made before anything happens."""
    for label, value in (("rank", rank), ("world_size", world_size), ("generation", generation)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    if not isinstance(timeout, timedelta) or not isinstance(liveness_timeout, timedelta):
        raise TypeError("timeout and liveness_timeout must be datetime.timedelta")
    if timeout.total_seconds() <= 0 or liveness_timeout.total_seconds() <= 0:
        raise ValueError("timeout and liveness_timeout must be positive")
    if not isinstance(name, str) or not name or "/" in name or not name.isprintable():
        raise ValueError(f"name={name!r} must be non-empty, printable and contain no '/'")
    if token is not None and (not isinstance(token, str) or not token):
        raise TypeError("token must be a non-empty str")
    if listener is not None and rank != 0:
        raise ValueError(f"listener= is for rank 0, which hosts the store; this is rank {rank}")
