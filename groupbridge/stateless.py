"""StatelessGroup: a group between independent jobs that never touches torch.distributed's global state.

Rank 0 serves a TCPStore on a socket it bound itself; the others connect, prove they belong (name,
generation, world size, optional shared token), and wait until every rank has joined. Objects travel through
the group's control channel (:mod:`.control`) in a safe encoding, sealed when the group has a token, and
nothing of them stays in the store once every receiver has read them; tensors travel over a gloo
ProcessGroup (CPU) or the device's own backend (created on first use), both built outside the global state.
Every wait is bounded, and each member publishes a status record so that survivors learn of a dead, frozen
or failed peer within the liveness timeout, whatever the operation timeout.

This module is the facade; each job lives in a part of its own under :mod:`groupbridge._group`: health
(liveness and status), objects, tensors, and the background threads of gloo work.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch

from ._group.health import Health
from ._group.objects import Objects
from ._group.state import GroupLog, GroupState
from ._group.tensors import Tensors, Work
from ._join import JoinSpec, host_join, member_join
from ._store_process import StoreProcess
from ._torch_private import TCPStore
from .control import ControlChannel, Deadline
from .errors import GroupBridgeError
from .net import Address, Listener, is_loopback, listen
from .store import StoreClient, host_store, namespace, open_client

logger = logging.getLogger(__name__)

__all__ = ["Deadline", "StatelessGroup", "Work"]


class StatelessGroup:
    """A group of ``world_size`` processes from independent jobs; see :meth:`create`.

    A group is single-threaded: use it from one thread at a time (its operations number their messages and
    share one store connection). The exception is :meth:`abort`, which any thread may call, also while
    another is blocked in an operation: a user's watchdog or signal handler, or a library thread (the vLLM
    trainer's timer when the engine's side of an update fails), must be able to break a group whose thread
    is stuck. The liveness watcher's thread does not call it: it shuts the blocked call's connection down,
    and that call aborts the group on its own thread.

    Object keys are collected lazily: point-to-point objects and small broadcasts travel in queues,
    consumed as read; a collective's keys are deleted by rank 0's liveness watcher at its first beat after
    every rank posted a watermark past that collective, which each rank does every ``WATERMARK_EVERY``
    collectives and at every barrier (see :mod:`groupbridge._group.objects`).

    Attributes:
        rank, world_size, name, generation, timeout, liveness_timeout, allow_pickle: as given to
            :meth:`create`.
        address: where rank 0 serves the store (on rank 0, with the port it really bound).
    """

    host_ids: list[str]
    """Each member's host identity (see :func:`groupbridge.net.host_identity`), in rank order."""
    pids: list[int]
    """Each member's process id, as it declared at join (sealed with a token)."""
    memory: dict[str, Any]
    """What protocols built on the group remember between their collectives, by protocol (the weight sync
    keeps the layouts members posted, see ``weights._posts``): every member reads every value of a
    collective, so what was posted once is known to every member of the group, whichever handle asks."""
    control: ControlChannel
    """The group's control channel, public for protocols built on the group (the weight-sync transports are
    such): group-scoped keys (``put``/``get``/``add``/``check``/``delete``) and queues (``push``/``pop``),
    sealed with the token, acknowledged, every wait bounded by a :class:`Deadline` (``group.deadline()``)
    and named by the ranks waited for."""
    _server: TCPStore | None
    _watch_client: StoreClient | None
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
        give_up: Callable[[], str | None] | None = None,
        published: bool = False,
        store_host: str = "thread",
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
            give_up: rank 0 only: called (every few milliseconds) while it waits for the members; a reason
                it returns (or an exception it raises) ends the join with that reason within a second, and
                the members that came raise it too, as ``GroupMismatchError`` (whoever launched the members
                often learns first that one of them cannot come).
            published: a member only: rank 0 published this address after it bound it (an engine worker told
                by its trainer), so a store that refuses connections is gone: the join raises
                :class:`StoreUnreachableError` within ``liveness_timeout`` instead of retrying until
                ``timeout`` (the default retries: a member started before its host may dial early).
            store_host: rank 0 only (ignored on members, so every rank may pass the same arguments): where
                rank 0 serves the store. ``"thread"`` (default): on a thread of its own process.
                ``"process"``: in a child process that lives no longer than rank 0 (about 1.5 s more at the
                join), so that the store's work, which grows with the group, is not charged to rank 0's
                process: for groups of dozens of members and more (see ``groupbridge._store_process``).

        Raises:
            ValueError, TypeError: bad arguments.
            JoinTimeoutError: not every rank joined within ``timeout`` (the message names the missing ranks).
            GroupBridgeError: ``give_up`` gave a reason (the message has it).
            GroupMismatchError: a member of another name, generation, world size or token; a duplicate rank;
                on a member, rank 0's ``give_up`` reason.
            StoreUnreachableError: a joiner could not reach the store, or a peer vanished while joining.
        """
        _check_arguments(rank, world_size, generation, timeout, liveness_timeout, name, token, listener)
        if store_host not in ("thread", "process"):
            raise ValueError(f"store_host={store_host!r} must be 'thread' or 'process'")
        if give_up is not None and not callable(give_up):
            raise TypeError(
                f"give_up must be a callable returning a reason or None, got {type(give_up).__name__}"
            )
        if give_up is not None and rank != 0:
            raise ValueError("give_up= is for rank 0 (the host waits for the members)")
        if published and rank == 0:
            raise ValueError("published= is for a member (rank 0 binds the address it publishes)")
        address = _store_address(address_or_host, port, rank, listener)

        self = object.__new__(cls)
        state = GroupState(
            rank=rank, world_size=world_size, name=name, generation=generation, timeout=timeout,
            liveness_timeout=liveness_timeout, namespace=namespace(name, generation), address=address,
            log=GroupLog(logger, name, rank),
        )  # fmt: skip
        self._init(state, allow_pickle, token)
        try:
            self._join(listener, give_up, published, store_host)
        except BaseException:
            self._teardown()
            raise
        self.log.info("joined: rank %d of %d at %s", rank, world_size, self.address)
        return self

    def _init(self, state: GroupState, allow_pickle: bool, token: str | None) -> None:
        """Every attribute, before the join (so that teardown works whatever the join reached)."""
        s = self._state = state
        self.rank, self.world_size, self.name, self.generation = s.rank, s.world_size, s.name, s.generation
        self.timeout, self.liveness_timeout, self.address = s.timeout, s.liveness_timeout, s.address
        self.allow_pickle = allow_pickle
        self.host_ids = []
        self.pids = []
        self.memory = {}
        self._token = token
        self._aborted = False
        self._health = Health(s)
        self._tensors = Tensors(s, self._health, self.abort)
        self._server = None
        self._store_process: StoreProcess | None = None
        self._watch_client = None
        self._owned_listener = None

    def _join(
        self,
        listener: Listener | None,
        give_up: Callable[[], str | None] | None,
        published: bool = False,
        store_host: str = "thread",
    ) -> None:
        s = self._state
        address = s.address
        if self.rank == 0:
            if listener is None:
                listener = self._owned_listener = listen(address)
            address = listener.address
            if store_host == "process":
                self._store_process = StoreProcess.start(listener, self.timeout)
                # rank 0's reads while it lingers, each bounded (the store's process may be frozen)
                self._server = open_client(address, self.timeout, s.io_timeout()).get()
            else:
                self._server = host_store(listener, self.timeout)
            if self._token is None and not is_loopback(address.host):
                self.log.warning(
                    "group without a token listens on %s: anyone who reaches that port can read and write "
                    "its control messages; pass token= or bind to a private network", address,
                )  # fmt: skip
        self.address = s.address = address
        refused_for = self.liveness_timeout if published else None
        s.client = open_client(address, self.timeout, s.io_timeout(), refused_for=refused_for)
        s.pg_client = open_client(address, self.timeout, s.io_timeout())
        t0 = time.monotonic()
        spec = JoinSpec(
            rank=self.rank, world_size=self.world_size, name=self.name, generation=self.generation,
            timeout=self.timeout, token=self._token, namespace=s.namespace, where=s.where(), log=s.log,
            give_up=give_up,
        )  # fmt: skip
        joined = host_join(spec, s.client) if self.rank == 0 else member_join(spec, s.client)
        self._sealer = joined.sealer
        self.log.debug("joined in %.2fs", time.monotonic() - t0)
        self.host_ids = [str(m["host_id"]) for m in joined.members]
        self.pids = [int(m["pid"]) for m in joined.members]
        h = self._health
        self.control = ControlChannel(
            s.client, s.namespace, self._sealer, s.rank, s.where, h.failure, h.set_awaited
        )
        self._objects = Objects(s, self.control, self._sealer, self.allow_pickle)
        self._objects.start()
        self._watch_client = open_client(address, self.timeout, self.liveness_timeout)
        collect = self._objects.collect if s.rank == 0 else None  # rank 0 collects the collectives' keys
        h.watch(self._watch_client, self._sealer, collect, self.control.sweep)
        self._tensors.connect()

    # ------------------------------------------------------------------ state and health

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """The group's logger: every message starts with ``[<name> r<rank>] ``."""
        return self._state.log

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def sealed(self) -> bool:
        """Whether control messages carry a MAC (the group has a token)."""
        return self._sealer.enabled

    def depending_on(self, ranks: Iterable[int]) -> contextlib.AbstractContextManager[None]:
        """Within the block, every wait also ends (naming who) when one of ``ranks`` fails, not only when a
        peer it waits on does: a weight sync commits on all its members or none, so it runs inside one."""
        return self._health.depending_on(r for r in ranks if r != self.rank)

    def errored(self) -> BaseException | None:
        """What went wrong on a thread this group owns (its liveness watcher), if anything; the next call on
        the group raises it too. None while every such thread is healthy."""
        return self._health.errored()

    def check_open(self) -> None:
        """Raise :class:`GroupClosedError` if this group was closed or broke (a peer failed, an abort)."""
        self._state.check_open()

    def deadline(self, timeout: timedelta | Deadline | None = None) -> Deadline:
        """A :class:`Deadline` from ``timeout`` (default: the group's); a Deadline passes through."""
        return self._state.deadline(timeout)

    def abort(self, reason: str) -> None:
        """Break the group and tell every peer why, so that nobody waits out a timeout.

        Peers blocked on this member raise within about ``liveness_timeout``, naming this rank and
        ``reason``. Idempotent; the group must then be made again. Any thread may call it (see the class
        docstring).
        """
        first = not self._aborted
        self._aborted = True
        if self._state.broken is None:
            self._state.broken = reason
        self._health.publish("aborted", reason[:2000], now=first)
        # Closing our sockets fails peers blocked on us at once instead of at their gloo timeout.
        self._tensors.release(abort=True)
        if first and self.rank == 0:
            self._health.linger(self._server)  # peers read why before the store may go with this process

    # ------------------------------------------------------------------ objects

    def send_obj(self, obj: Any, dst: int | Sequence[int], *, tag: str = "") -> None:
        """Send ``obj`` to ``dst`` (a rank, or several: one store round trip for all); returns once the store
        holds it (until each ``dst`` reads it).

        ``tag`` names a separate channel: messages of one tag arrive in order, independently of other tags
        (a weight sync's acknowledgements travel on their own tag, so they never mix with the caller's).
        """
        self._objects.send_obj(obj, dst, tag)

    def recv_obj(self, src: int, timeout: timedelta | Deadline | None = None, *, tag: str = "") -> Any:
        """Receive the next object ``src`` sent to this rank on ``tag``."""
        return self._objects.recv_obj(src, timeout, tag)

    def broadcast_obj(self, obj: Any, src: int = 0, timeout: timedelta | Deadline | None = None) -> Any:
        """Every rank returns ``src``'s ``obj``; ``src`` returns once the store holds it."""
        return self._objects.broadcast_obj(obj, src, timeout)

    def all_gather_obj(
        self, obj: Any, timeout: timedelta | Deadline | None = None, *, by_field: bool = False
    ) -> list[Any]:
        """Every rank returns the list of every rank's ``obj``, in rank order. Above ``DIRECT_MAX`` members
        it goes through rank 0 (linear in members at the store). Objects posted alike may come back as one
        object: treat the list as read-only. ``by_field``: ``obj`` is a dict, and each of its values is
        sent and decoded once however many members post it (a layout that every member posts beside its own
        small fields)."""
        return self._objects.all_gather_obj(obj, timeout, by_field)

    def gather_obj(
        self,
        obj: Any,
        srcs: Sequence[int],
        dsts: Sequence[int],
        timeout: timedelta | Deadline | None = None,
    ) -> dict[int, Any] | None:
        """A collective (every rank calls it) from some ranks to some others: each rank in ``srcs`` posts
        ``obj`` and returns once the store holds it (without waiting for any reader); each rank in ``dsts``
        returns ``{src: obj}`` for every source once all are there (bounded by ``timeout``, naming the
        sources it still waits for); every other rank returns None at once. One store request per source and
        per reader, however many pairs."""
        return self._objects.gather_obj(obj, srcs, dsts, timeout)

    def barrier(self, timeout: timedelta | Deadline | None = None) -> None:
        """Return once every rank has entered; a timeout names the ranks that did not."""
        self._objects.barrier(timeout)

    # ------------------------------------------------------------------ tensors

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Broadcast ``tensor`` in place from ``src`` (CPU: gloo; device tensors: NCCL, HCCL or XCCL)."""
        return self._tensors.broadcast(tensor, src, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Work | None:
        """All-reduce ``tensor`` in place (``op``: sum, product, min, max, avg where the backend has it)."""
        return self._tensors.all_reduce(tensor, op, async_op)

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to ``dst``, which must post a matching :meth:`recv`."""
        return self._tensors.send(tensor, dst, async_op)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` from ``src``."""
        return self._tensors.recv(tensor, src, async_op)

    # ------------------------------------------------------------------ teardown

    def _teardown(self) -> None:
        self._health.stop()
        self._tensors.release(abort=self._state.broken is not None)
        self._tensors.stop()
        with self._state.teardown_lock:
            for client in (self._state.client, self._state.pg_client, self._watch_client):
                if client is not None:
                    client.close()
        self._server = None  # the last reference: the store stops serving and closes its port
        if self._store_process is not None:  # served by a child: it exits, and the port closes with it
            self._store_process.stop()
            self._store_process = None
        if self._owned_listener is not None:
            self._owned_listener.close()

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Release the process groups, the watcher, the store connections and (rank 0) the store.

        Idempotent. Rank 0 waits up to ``timeout`` for the others to close first, so that members still
        finishing their last operation do not lose the store under them.
        """
        s = self._state
        if s.closed:
            return
        s.closed = True
        watching = self._health.watcher is not None
        if watching and s.client is not None and not s.client.interrupted:
            try:
                self.control.sweep(s.client, budget=1.0)  # keys discarded since the watcher's last beat
            except (RuntimeError, GroupBridgeError):  # closing must not fail because the store is gone
                self.log.debug("close: could not delete the discarded keys", exc_info=True)
        # a broken group says why in its last record too: a peer that reads it only now still learns who
        # failed (an abort's record, written a moment before, may never have been read)
        self._health.publish("closed", s.broken[:2000] if s.broken else None)
        if self.rank == 0:
            self._health.linger(self._server, timeout)  # the others close first: the store goes with us
        self._teardown()
        self.log.info("closed")

    def __enter__(self) -> StatelessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._state
        state = "closed" if s.closed else ("broken" if s.broken else "open")
        return (
            f"StatelessGroup({self.name!r}, rank={self.rank}, world_size={self.world_size}, "
            f"{self.address}, {state})"
        )


def _store_address(
    address_or_host: str | Address | None, port: int | None, rank: int, listener: Listener | None
) -> Address:
    """Where rank 0 serves the store, from :meth:`StatelessGroup.create`'s arguments."""
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
