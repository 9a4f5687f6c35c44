"""The trainer side of an engine: host the bridge, send every step, drive the engine's update calls beside it.

An engine is driven through an :class:`EngineControl` (vLLM's weight-sync client, an HTTP server's routes,
an RPC to a Ray actor): have the workers join a bridge, start an update (each worker's handshake and
receive), commit it (the workers load it and serve it). One :meth:`TrainerSession.send` is:

1. on a side thread, ``control.begin(version)``: each worker enters the handshake, where it dry-runs the
   manifest through its model's loader; it returns once the workers' receive calls returned (an atomic
   update's bytes then land on a thread of theirs while the engine serves);
2. here, :meth:`groupbridge.WeightSender.send`, which returns once every worker acknowledged the bytes
   (atomic: staged, the model untouched; streaming: loaded);
3. ``control.commit(version)``: the workers load what they staged, and the engine serves ``version``;
4. with ``verify`` (a :class:`Probe`): ``control.probe(tokens)`` on every replica; one that disagrees with
   the trainer's model makes ``control.rollback(previous)`` reload the version served before on every
   replica, and the send raise :class:`VerificationError`. A commit that failed is rolled back the same way
   (when the workers keep the previous version: ``rollback``).

A failure on either side ends both: a worker that refuses or fails makes the send raise (a refusal before
bytes move is the same ``ManifestMismatchError`` on every member and the bridge stays usable); a control
call that fails while the workers are away aborts the bridge, so nothing waits out its timeout. After an
abort the next send opens a new bridge (a new generation) and has the workers join it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from .._closing import Closing
from ..errors import GroupBridgeError, PeerDiedError, SyncRefusedError, VerificationError, WeightSyncError
from ..net import Address, Listener, listen
from ..stateless import StatelessGroup
from ..weights import DeltaMemory
from ..weights.sender import SyncStats, WeightSender
from ..weights.transports import TRANSPORTS
from ._calls import Call, abort_later, usable
from ._info import BridgeInfo, check_seconds
from ._probe import Probe

__all__ = ["EngineControl", "TrainerConfig", "TrainerSession"]

logger = logging.getLogger(__name__)


class EngineControl(Protocol):
    """How a trainer drives an engine's workers (each call returns once every worker returned).

    ``join(info)``: each worker joins the bridge (``info``: a :class:`BridgeInfo` as plain JSON, the worker's
    rank its own). ``begin(version)``: each worker starts an update and receives it (its handshake; then,
    atomic, its bytes land in the background). ``commit(version)``: each worker loads what it received and
    serves ``version``. ``leave()``: each worker leaves the bridge (before the trainer closes it).

    With ``TrainerConfig(verify=...)`` or ``rollback=True``, also: ``probe(tokens)`` -> one list of
    log-probabilities of ``tokens[1:]`` per replica, computed by its own request path; ``rollback(version)``:
    each worker loads ``version`` again (the one it served before its last update) and the engine serves it.
    """

    def join(self, info: dict[str, Any]) -> None: ...

    def begin(self, version: int) -> None: ...

    def commit(self, version: int) -> None: ...

    def leave(self) -> None: ...


@dataclass(kw_only=True)
class TrainerConfig:
    """How the trainer hosts the bridge to an engine's workers. Frozen once made (checked then, and a session
    reads it throughout): ``dataclasses.replace(config, field=value)`` makes a changed copy, checked again.

    Attributes:
        host: the address the trainer binds and the workers dial: IPv4, IPv6 or a host name (default
            loopback). The socket is bound before its port is told to anyone.
        port: 0 lets the kernel pick a free port.
        workers: how many worker processes join (data parallel x tensor parallel x pipeline parallel, summed
            over every engine the control drives).
        transport: ``"auto"`` (shared memory on one CPU host, CUDA IPC on one GPU host, broadcast or relay
            across hosts) or one by name.
        atomic: stage the whole update and load it only once every worker has every byte (a trainer dying
            midway leaves the engine serving the old weights; the bytes land while it serves); False streams
            buckets into the engine's loader (the engine serves nothing until the update ends).
        token: a shared secret: members prove it at join and every bucket carries a MAC.
        timeout_s: seconds that bound each whole update (and joining).
        liveness_s: seconds after which a silent peer counts as gone.
        timeout, liveness: the names ``timeout_s`` and ``liveness_s`` had before they said their unit;
            still taken (with a DeprecationWarning), never together with the new name.
        checksum: XXH3-64 checksum of every bucket, verified before the update is loaded (implied by a token).
        bucket_bytes: bucket size (None: the library's default).
        first_version: the version of the first send (then +1 each time). None (default): 1, or, with one
            sending rank whose engine already serves a numbered version (an earlier trainer's), the one
            after it, so that the version an engine reports never goes back. (With several sending ranks
            only rank 0 talks to the engine and every rank must send the same version: each starts at 1;
            pass one above the served version.)
        delta: send only what changed since the version every worker holds, where that pays (``True``) or
            always (``"always"``); see :class:`groupbridge.WeightSender`.
        sources: trainer ranks that send, ranks 0 .. sources-1. With 1, rank 0 sends whole tensors. With
            more, every one of them joins the bridge and sends what it holds (DTensor parameters as their
            local boxes, ``gb.Shard`` values as theirs); the workers assemble whole tensors from every rank
            (one commit for all). Rank 0 hosts the bridge and drives the engine; the others dial it at
            ``host``/``port``: bind rank 0's socket first (``lis = gb.listen(host, 0)``), pass it as
            ``listener=`` on rank 0 and ``lis.port`` to the others.
        listener: on rank 0, a socket bound beforehand (see ``sources``); the first bridge is served on it.
        name: the bridge's name (a worker of another job is refused at join).
        verify: a :class:`groupbridge.engine.Probe`: after every swap each replica scores its tokens; one that
            disagrees with the trainer's model rolls every replica back to the version served before, and
            the send raises ``gb.VerificationError``. Requests served between the swap and the rollback saw
            the unverified weights (``last_seconds["unverified"]``); a user who cannot accept that holds its
            own requests while ``send_weights`` runs.
        rollback: the workers keep the bytes of the version served before each update, so that a probe that
            disagrees, or a commit that failed on some engine, can have it served again: one more copy of
            the model's wire bytes in host memory per worker, and one host memcpy of them per update (on
            the landing thread, while the engine serves). None: on exactly when ``verify`` is set.
    """

    host: str = "127.0.0.1"
    port: int = 0
    workers: int = 1
    transport: str = "auto"
    atomic: bool = True
    token: str | None = None
    timeout_s: float = 300.0
    liveness_s: float = 10.0
    checksum: bool = True
    bucket_bytes: int | None = None
    first_version: int | None = None
    name: str = "engine"
    delta: bool | str = False
    sources: int = 1
    listener: Listener | None = None
    verify: Probe | None = None
    rollback: bool | None = None
    timeout: float | None = None
    liveness: float | None = None

    def __post_init__(self) -> None:
        for old in ("timeout", "liveness"):
            value = getattr(self, old)
            if value is None:
                continue
            new = f"{old}_s"
            if getattr(self, new) != _DEFAULTS[new]:
                raise ValueError(f"{old}= and {new}= are one setting: pass {new}= only")
            # the caller's line: past this method and __init__ (and a subclass's __post_init__ calling it)
            depth = 3 if type(self).__post_init__ is TrainerConfig.__post_init__ else 4
            warnings.warn(f"{old}= is deprecated: pass {new}= (seconds)", DeprecationWarning,
                          stacklevel=depth)  # fmt: skip
            object.__setattr__(self, new, value)
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be >= 1 (the number of worker processes)")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of auto, {', '.join(TRANSPORTS)}")
        check_seconds(timeout_s=self.timeout_s, liveness_s=self.liveness_s)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} is not a TCP port (0: the kernel picks one)")
        fv = self.first_version
        if fv is not None and (isinstance(fv, bool) or not isinstance(fv, int) or fv < 0):
            raise ValueError(f"first_version={fv!r} must be None or an int >= 0")
        if not isinstance(self.sources, int) or self.sources < 1:
            raise ValueError(f"sources={self.sources!r} must be >= 1 (the trainer ranks that send)")
        if self.delta not in (False, True, "always"):
            raise ValueError(f"delta={self.delta!r} must be False, True or 'always'")
        if self.verify is not None and not isinstance(self.verify, Probe):
            raise TypeError(f"verify must be a groupbridge.engine.Probe, got {type(self.verify).__name__}")
        if self.rollback not in (None, False, True):
            raise ValueError(f"rollback={self.rollback!r} must be None, False or True")
        if self.verify is not None and self.rollback is False:
            raise ValueError(
                "verify needs rollback (a replica that disagrees is rolled back): drop rollback=False"
            )
        object.__setattr__(self, "_frozen", True)

    # Frozen by hand, not by ``dataclass(frozen=True)``: the vLLM backend's TrainerInitInfo is this class and
    # vLLM's own (a plain dataclass), and Python refuses a frozen dataclass beside a plain one.
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to {name!r}: a {type(self).__name__} is frozen once made (its checks ran on "
                f"these values); make a changed copy: dataclasses.replace(config, {name}=...)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete {name!r}: a {type(self).__name__} is frozen")

    @property
    def keeps_previous(self) -> bool:
        """The workers keep the previous version's bytes (``rollback``, by default with ``verify``)."""
        return self.rollback if self.rollback is not None else self.verify is not None

    def check_rank(self, rank: int) -> None:
        if 0 < rank < self.sources and self.port == 0:
            raise ValueError(
                f"rank {rank} of {self.sources} sending trainer ranks dials rank 0's bridge: pass port= "
                "(rank 0's address.port)"
            )


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}


class TrainerSession(Closing):
    """One trainer rank's side of the bridge to an engine (see the module docstring).

    Rank 0 hosts the bridge and drives ``control``; ranks 1 .. ``sources``-1 join it and send their shards
    (their ``control`` is not used). Other ranks have no session.
    """

    def __init__(
        self,
        config: TrainerConfig,
        control: EngineControl | None,
        *,
        rank: int = 0,
        memory: DeltaMemory | None = None,
    ) -> None:
        config.check_rank(rank)
        if rank >= config.sources:
            raise ValueError(f"rank {rank} does not send (sources={config.sources}): it needs no session")
        if rank == 0 and control is None:
            raise ValueError("rank 0 drives the engine: pass its control")
        if rank == 0 and config.keeps_previous:
            needed = ("probe", "rollback") if config.verify is not None else ("rollback",)
            missing = [m for m in needed if not callable(getattr(control, m, None))]
            if missing:
                raise TypeError(
                    f"verify/rollback need an engine control with {' and '.join(missing)}(): "
                    f"{type(control).__name__} has none"
                )
        self.config = config
        self.control = control
        self.rank = rank
        self.memory = memory if memory is not None else DeltaMemory()
        """With ``config.delta``: the bases this rank sends deltas against, kept across its bridges (pass
        one to a session of each update, as verl's engine does, for deltas across sessions)."""
        self.group: StatelessGroup | None = None
        self.sender: WeightSender | None = None
        self.generation = 0
        self.version: int | None = None
        """The last version the engine confirmed serving (rank 0), or this rank sent (the others)."""
        self.sent: int | None = None
        """The last version every worker acknowledged: they hold it, committed or not, and refuse it again
        (a commit that failed leaves ``version`` behind ``sent``; the next default version follows both)."""
        self.last_stats: SyncStats | None = None
        self.engine_served: int | None = None
        """The version the engine reported serving when this trainer first joined it (one sending rank)."""
        # a config's listener serves one session's first bridge: one handed over already binds anew
        self._listener = (
            config.listener if config.listener is not None and not config.listener.closed else None
        )
        """The socket the first bridge is served on (the config's); later bridges bind anew."""
        self._sending = threading.Lock()
        self.last_seconds: dict[str, float] = {}
        """Wall time of the last send (rank 0), split: ``transfer`` (to every worker's acknowledgement),
        ``commit`` (the engine's load of a staged update), ``total``."""

    @property
    def address(self) -> Address | None:
        """The bridge's address (rank 0, once connected): what the other sending ranks dial."""
        return self.group.address if self.group is not None else None

    # ------------------------------------------------------------------ bridge

    def connect(self) -> None:
        """Rank 0: host a new bridge (the next generation) and have every worker join it. Other sending
        ranks: join rank 0's first bridge."""
        c = self.config
        self.close()
        self.generation += 1
        world = c.workers + c.sources
        timeout, liveness = timedelta(seconds=c.timeout_s), timedelta(seconds=c.liveness_s)
        if self.rank > 0:
            self.group = StatelessGroup.create(
                c.host, c.port, rank=self.rank, world_size=world, name=c.name, generation=self.generation,
                timeout=timeout, liveness_timeout=liveness, token=c.token,
            )  # fmt: skip
            self.sender = WeightSender(
                self.group,
                checksum=c.checksum,
                bucket_bytes=c.bucket_bytes,
                delta=c.delta,
                memory=self.memory,
            )
            return
        assert self.control is not None
        given, self._listener = self._listener, None  # served once: a later bridge binds a new socket
        lis = given if given is not None else listen(c.host, c.port)
        # built (and checked) here, sent as plain JSON: the worker parses the same dataclass
        info = BridgeInfo(
            host=lis.address.host, port=lis.port, world_size=world, sources=c.sources, name=c.name,
            generation=self.generation, token=c.token, atomic=c.atomic, timeout_s=c.timeout_s,
            liveness_s=c.liveness_s, rollback=c.keeps_previous,
        )  # fmt: skip
        control = self.control
        call = Call("join", lambda: control.join(dataclasses.asdict(info)))

        def engine_failed() -> str | None:  # a dead engine ends the join now, not at its timeout
            return None if call.error is None else f"the engine's join failed: {call.error}"

        try:
            self.group = StatelessGroup.create(
                None, rank=0, world_size=world, listener=lis, name=c.name, generation=self.generation,
                timeout=timeout, liveness_timeout=liveness, token=c.token, give_up=engine_failed,
            )  # fmt: skip
        except BaseException as e:
            lis.close()
            call.join(c.liveness_s)
            if call.error is not None:
                raise WeightSyncError(f"the engine's join failed: {call.error}") from e
            raise
        try:
            call.join(c.timeout_s)
            call.result()
        except BaseException:
            self.group.close()
            self.group = None
            raise
        served = getattr(control, "served", None)
        unnumbered = self.version is None and self.sent is None and self.engine_served is None
        if unnumbered and c.sources == 1 and c.first_version is None and callable(served):
            try:
                self.engine_served = served()
            except Exception as e:  # only the default version depends on it
                logger.warning("groupbridge: could not read the version the engine serves (%s); the first "
                               "update is version %d", e, self.next_version(None))  # fmt: skip
        self.sender = WeightSender(
            self.group, transport=c.transport, checksum=c.checksum, bucket_bytes=c.bucket_bytes,
            delta=c.delta, memory=self.memory,
        )  # fmt: skip

    def close(self) -> None:
        """Close the bridge; the workers are told to leave it first (rank 0), so that none is left holding
        a group whose host is gone."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.group is None:
            return
        group, self.group = self.group, None
        drives = self.control is not None and self.rank == 0 and usable(group)
        leave = Call("leave", self.control.leave) if drives and self.control else None
        group.close()  # the host waits (bounded) for the members to close theirs
        if leave is not None:
            leave.join(self.config.liveness_s)
            if leave.error is not None or leave.running:
                logger.warning("groupbridge: the engine's leave: %s", leave.error or "no answer")

    # ------------------------------------------------------------------ one step

    def next_version(self, version: int | None) -> int:
        if version is not None:
            return version
        held = [v for v in (self.version, self.sent) if v is not None]
        if held:
            return max(held) + 1
        if self.config.first_version is not None:
            return self.config.first_version
        return self.engine_served + 1 if self.engine_served is not None else 1

    def send(
        self,
        named: Iterable[tuple[str, Any]] | Mapping[str, Any],
        *,
        version: int | None = None,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> int:
        """Send ``named`` as the next version (or ``version``); on rank 0, make the engine serve it.
        Returns the version. ``specs`` (name -> (shape, dtype)) lets the manifest be checked before the
        source is pulled (a lazy source, e.g. one that gathers, is then consumed while bytes move).

        Raises RuntimeError at once when another thread's send is running on this session (the engine's
        update calls of two sends would interleave)."""
        if not self._sending.acquire(blocking=False):
            raise RuntimeError("a send is already running on this trainer: one update at a time")
        try:
            return self._send(named, version, specs)
        finally:
            self._sending.release()

    def _send(
        self,
        named: Iterable[tuple[str, Any]] | Mapping[str, Any],
        version: int | None,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None,
    ) -> int:
        if self.rank > 0:
            return self._send_shards(named, version)
        c = self.config
        if version is not None and self.version is not None and version <= self.version:
            raise ValueError(
                f"version {version} is not newer than the version the engine serves ({self.version})"
            )
        if self.group is None or not usable(self.group):
            if c.sources > 1 and self.generation > 0:
                raise WeightSyncError(
                    f"the bridge of {c.sources} sending ranks broke: a new one needs every rank, so make new "
                    "sessions on every rank (rank 0 alone would wait for ranks that never come)"
                )
            self.connect()
        v = self.next_version(version)  # after the connect: a first one reads the version the engine serves
        assert self.sender is not None and self.group is not None and self.control is not None
        control, group = self.control, self.group
        t0 = time.perf_counter()
        call = Call("begin", lambda: control.begin(v), on_error=lambda e: abort_later(group, e, c.liveness_s))
        try:
            stats = self.sender.send(named, v, specs=specs, timeout=timedelta(seconds=c.timeout_s))
        except GroupBridgeError as e:
            call.join(c.liveness_s + 5)
            who = self._who(e)
            if who is not None and call.error is None:
                if isinstance(e, PeerDiedError):  # the type users catch stays the same
                    raise PeerDiedError(f"{e} ({who[1]})", rank=who[0]) from e
                raise WeightSyncError(f"{e} ({who[1]})") from e
            if isinstance(e, SyncRefusedError) or call.error is None:
                raise
            raise WeightSyncError(f"the engine failed the update of version {v}: {call.error}") from e
        finally:
            call.cancel_abort()
        self.sent = v
        call.join(c.timeout_s)
        call.result()
        t1 = time.perf_counter()
        self.last_stats = stats
        try:
            control.commit(v)
        except Exception as e:
            raise WeightSyncError(
                f"the engine's commit of version {v} failed: {type(e).__name__}: {e}; {self._roll_back(v)[0]}"
            ) from e
        t2 = time.perf_counter()
        self.last_seconds = {"transfer": t1 - t0, "commit": t2 - t1}
        if c.verify is not None:
            self._verify(c.verify, v)
        self.version = v
        self.last_seconds["total"] = time.perf_counter() - t0
        return v

    def _who(self, error: BaseException) -> tuple[int, str] | None:
        """The dead bridge member an error names, and the engine it belongs to in words
        (``control.describe_rank``), or None."""
        describe = getattr(self.control, "describe_rank", None)
        seen: BaseException | None = error
        rank: int | None = None
        while seen is not None and rank is None:
            if isinstance(seen, PeerDiedError) and seen.rank is not None:
                if not seen.aborted:
                    rank = seen.rank
                else:  # a live member aborted, having seen another stop first: that one, as its reason says
                    stopped = re.search(r"rank (\d+) stopped its heartbeat", str(seen))
                    rank = int(stopped.group(1)) if stopped else None
            seen = seen.__cause__ or seen.__context__
        if not callable(describe) or rank is None or rank < self.config.sources:
            return None
        described = describe(rank - self.config.sources)
        return (rank, f"bridge rank {rank} is {described}") if described else None

    def _verify(self, probe: Probe, v: int) -> None:
        """Every replica scores the probe; one that disagrees rolls every replica back and raises."""
        assert self.control is not None
        t0 = time.perf_counter()
        # the trainer's reference is computed while the replicas score theirs (each is a forward pass)
        pool = ThreadPoolExecutor(1, thread_name_prefix="groupbridge-reference")
        try:
            expected = pool.submit(probe.expected, v)
            served = self.control.probe(list(probe.tokens))  # type: ignore[attr-defined]
            worst = probe.worst(expected.result(timeout=self.config.timeout_s), served)
        except Exception as e:
            back, served = self._roll_back(v)
            raise VerificationError(
                f"the probe of version {v} failed: {type(e).__name__}: {e}; {back}",
                version=v, replica=-1, difference=float("nan"), served=served,
            ) from e  # fmt: skip
        finally:
            pool.shutdown(wait=False)
        self.last_seconds["verify"] = time.perf_counter() - t0
        if worst is None:
            self.last_seconds["unverified"] = self.last_seconds["verify"]
            return
        k, diff = worst
        back, served_now = self._roll_back(v)
        self.last_seconds["unverified"] = time.perf_counter() - t0
        raise VerificationError(
            f"replica {k} serves version {v} with log-probabilities {diff:.4g} away from the trainer's "
            f"(atol {probe.atol:g}; {len(served)} replica(s) probed): {back}",
            version=v, replica=k, difference=diff, served=served_now,
        )  # fmt: skip

    def _roll_back(self, v: int) -> tuple[str, int | None]:
        """After a failed commit or probe of ``v``: every replica serves ``self.version`` again, where the
        workers keep it. Returns what the engines serve now, in words, and the version every replica
        serves (None when that is not known: no rollback, or one that failed)."""
        if not self.config.keeps_previous:
            return (
                "rollback is off (TrainerConfig(rollback=True) turns it on): an engine whose commit returned "
                f"serves {v}, the others what they served before"
            ), None
        if self.version is None:
            return (
                f"no earlier version of this trainer to roll back to (its first update): the replicas serve "
                f"{v} where it was committed; send a corrected version"
            ), None
        try:
            self.control.rollback(self.version)  # type: ignore[union-attr]
        except Exception as e:
            logger.error("groupbridge: the rollback to version %d failed: %s", self.version, e)
            return (
                f"the rollback to version {self.version} failed too ({type(e).__name__}: {str(e)[:500]}): "
                f"replicas may serve {v} or {self.version}; send a full update"
            ), None
        logger.warning("groupbridge: version %d was rolled back; every replica serves %d", v, self.version)
        return f"every replica was rolled back to version {self.version} and serves it", self.version

    def _send_shards(self, named: Iterable[tuple[str, Any]] | Mapping[str, Any], version: int | None) -> int:
        """A sending rank other than 0: its part of the sync rank 0 drives (the versions advance alike)."""
        if self.group is None:
            self.connect()
        if self.sender is None or self.group is None or not usable(self.group):
            raise WeightSyncError(
                f"trainer rank {self.rank}: the bridge broke; with several sending ranks, make new sessions "
                "on every rank"
            )
        v = self.next_version(version)
        self.last_stats = self.sender.send(named, v, timeout=timedelta(seconds=self.config.timeout_s))
        self.version = v
        return v
