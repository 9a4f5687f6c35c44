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
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch

from .._closing import Closing
from ..errors import GroupBridgeError, PeerDiedError, PeerTimeoutError, SyncRefusedError, WeightSyncError
from ..net import Address, listen
from ..stateless import StatelessGroup
from ..weights import DeltaMemory
from ..weights._header import MAX_VERSION, check_version
from ..weights.sender import SyncStats, WeightSender
from ._calls import Call, abort_later, usable
from ._config import TrainerConfig
from ._control import EngineControl
from ._info import BridgeInfo
from ._probe import Probe
from ._recovery import dead_member, roll_back, verify

__all__ = ["TrainerSession"]

logger = logging.getLogger(__name__)


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
        if rank == 0:
            if not isinstance(control, EngineControl):
                raise TypeError(
                    f"control must be a groupbridge.engine.EngineControl (its subclass declares what the "
                    f"engine can do), got {type(control).__name__}"
                )
            control.check(config.needs())  # before anything joins: a verify no engine can honour is refused
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
        self.passed: int | None = None
        """The newest version a worker said it holds when it refused one of this trainer's as not newer
        (another trainer took the engine over meanwhile): the next default version follows it."""
        # a config's listener serves one session's first bridge: one handed over already binds anew
        self._listener = (
            config.listener if config.listener is not None and not config.listener.closed else None
        )
        """The socket the first bridge is served on (the config's); later bridges bind anew."""
        self._sending = threading.Lock()
        self._reset_pending = config.reset_versions
        """The workers are still to forget their versions (``TrainerConfig.reset_versions``): on the first
        bridge every worker joined, whichever connect that is."""
        self._late_commit: tuple[int, Call] | None = None
        """The version and call of a commit that outlived its bound (see :meth:`_settle_late_commit`)."""
        self.warm_seconds: float | None = None
        """How long the probe's first scoring took, on the first bridge (``verify``: see :meth:`_warm`)."""
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
            liveness_s=c.liveness_s, rollback=c.keeps_previous, swap=c.swap, bridge_id=secrets.token_hex(8),
            reset_versions=self._reset_pending,
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
        self._reset_pending = False  # the workers forgot their versions once: later bridges keep the ledger
        unnumbered = self.version is None and self.sent is None and self.engine_served is None
        if (
            unnumbered
            and not c.reset_versions
            and c.sources == 1
            and c.first_version is None
            and control.capabilities.versions
        ):
            try:
                self.engine_served = control.served()
            except Exception as e:  # only the default version depends on it
                logger.warning("groupbridge: could not read the version the engine serves (%s); the first "
                               "update is version %d", e, self.next_version(None))  # fmt: skip
        self.sender = WeightSender(
            self.group, transport=c.transport, checksum=c.checksum, bucket_bytes=c.bucket_bytes,
            delta=c.delta, memory=self.memory,
        )  # fmt: skip
        if c.verify is not None and self.warm_seconds is None:
            self._warm(c.verify)

    def _warm(self, probe: Probe) -> None:
        """Score the probe once on every replica before any update: an engine's first scoring request
        pays its warm-up (seconds on vLLM's CPU build), which would otherwise fall in the first verified
        update, while its replicas serve the unverified version; and an engine that cannot score these
        tokens is found now, before any version is committed."""
        assert self.control is not None
        t0 = time.perf_counter()
        try:
            self.control.probe(list(probe.tokens))
        except Exception as e:
            stopped = self.control.stopped()
            if stopped:  # it scores nothing until an update lands: this trainer's first one mends it
                logger.warning("groupbridge: the probe's scoring path is not warmed: %s", "; ".join(stopped))
                return
            self.close()
            raise WeightSyncError(
                f"the engines could not score the probe before any update ({type(e).__name__}: {e}): a "
                "verified update would commit and then fail its probe; nothing was sent"
            ) from e
        self.warm_seconds = time.perf_counter() - t0
        logger.info("groupbridge: the probe's scoring path warmed in %.3f s", self.warm_seconds)

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
        """``version``, or the one after every version this trainer sent or the engine holds; raises
        ValueError, before anything reaches the engine, when it is not one a sync carries."""
        if version is not None:
            return check_version(version)
        held = [v for v in (self.version, self.sent, self.passed) if v is not None]
        if held:
            return _next(max(held))
        if self.config.first_version is not None:
            return self.config.first_version
        return _next(self.engine_served) if self.engine_served is not None else 1

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
        self._settle_late_commit()
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
            if self.sender.voted == v:
                e = self._used_up(e, v)
            who = dead_member(e, control, c.sources)
            if who is not None and call.error is None:
                if isinstance(e, PeerDiedError):  # the type users catch stays the same
                    raise PeerDiedError(f"{e} ({who[1]})", rank=who[0]) from e
                raise WeightSyncError(f"{e} ({who[1]})") from e
            if isinstance(e, SyncRefusedError) and e.newest is not None:
                self._passed_by(e.newest)
                try:
                    after = f"the next default version is {self.next_version(None)}"
                except ValueError:  # the engine holds the largest version
                    after = "no version follows it"
                raise SyncRefusedError(
                    f"{e}\nthe engine holds version {e.newest}, "
                    f"{'as new as' if e.newest == v else 'newer than'} this trainer's {v} (another "
                    f"trainer's update, or one of this trainer's that passed its vote and did not land): "
                    f"nothing was sent; {after} (a trainer that must go back connects with "
                    "TrainerConfig(reset_versions=True))",
                    newest=e.newest,
                ) from e
            if isinstance(e, SyncRefusedError) or call.error is None:
                raise e
            raise WeightSyncError(f"the engine failed the update of version {v}: {call.error}") from e
        finally:
            call.cancel_abort()
        self.sent = v
        call.join(c.timeout_s)
        call.result()
        t1 = time.perf_counter()
        self.last_stats = stats
        commit = Call("commit", lambda: control.commit(v))
        commit.join(c.timeout_s)
        if commit.running:  # bounded like every wait: the engine may still land it, so it is waited for next
            self._late_commit = (v, commit)
            raise WeightSyncError(
                f"the engine's commit of version {v} did not return within timeout_s={c.timeout_s:g} s; the "
                f"call runs on in the engine, which serves {v} if it lands: the next send waits for it first"
            )
        if commit.error is not None:
            failed = commit.error
            raise WeightSyncError(
                f"the engine's commit of version {v} failed: {type(failed).__name__}: {failed}; "
                f"{roll_back(control, c, v, self.version)[0]}"
            ) from failed
        t2 = time.perf_counter()
        self.last_seconds = {"transfer": t1 - t0, "commit": t2 - t1}
        if c.verify is not None:
            verify(control, c, c.verify, v, self.version, self.last_seconds)
        self.version = v
        self.last_seconds["total"] = time.perf_counter() - t0
        return v

    def _settle_late_commit(self) -> None:
        """An earlier send's commit that outlived its bound is waited for (within ``timeout_s``) before the
        engine is called again (its calls land in the order they were made); once it returned, the engine
        serves its version if it succeeded. Raises WeightSyncError, sending nothing, if it still runs."""
        if self._late_commit is None:
            return
        v, call = self._late_commit
        call.join(self.config.timeout_s)
        if call.running:
            raise WeightSyncError(
                f"the engine's commit of version {v}, from an earlier send, still has not returned: nothing "
                "is sent before it does (the engine's calls land in order); if the engine hangs, restart it "
                "and make a new TrainerSession"
            )
        self._late_commit = None
        c, control = self.config, self.control
        assert control is not None
        if call.error is not None:
            what = roll_back(control, c, v, self.version)[0]
            logger.warning(
                "groupbridge: the engine's late commit of version %d failed (%s): %s", v, call.error, what
            )
            return
        logger.warning("groupbridge: the engine's late commit of version %d returned: it serves it", v)
        if c.verify is not None:  # as a commit in time would be: probed, rolled back if it disagrees
            verify(control, c, c.verify, v, self.version, {})
        self.version = v

    def _used_up(self, e: GroupBridgeError, v: int) -> GroupBridgeError:
        """The sync of ``v`` failed after its vote passed: the workers hold ``v`` in their ledgers (refusing
        it again), so the next default version is the one after it; the error, of the same kind, says so."""
        self._passed_by(v)
        try:
            after = f"the next default version is {self.next_version(None)}"
        except ValueError:  # v is the largest version
            after = "no version follows it"
        text = f"{e}\nversion {v} passed its vote before this failure: the workers count it as taken; {after}"
        out: GroupBridgeError
        if isinstance(e, PeerDiedError):
            out = PeerDiedError(text, e.rank, aborted=e.aborted)
        elif isinstance(e, (PeerTimeoutError, SyncRefusedError)):  # what callers catch stays the same
            out = type(e)(text)
        else:
            out = WeightSyncError(text)
        out.__cause__ = e
        return out

    def _passed_by(self, newest: int) -> None:
        """A worker refused this trainer's version as not newer than ``newest``, which it holds: the next
        default version follows it."""
        self.passed = newest if self.passed is None else max(self.passed, newest)

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
        try:
            self.last_stats = self.sender.send(named, v, timeout=timedelta(seconds=self.config.timeout_s))
        except (
            SyncRefusedError
        ) as e:  # every rank learns the engine's newest alike: their next versions agree
            if e.newest is not None:
                self._passed_by(e.newest)
            if self.sender.voted == v:  # refused after the vote (a receiver's acknowledgement)
                self._passed_by(v)
            raise
        except GroupBridgeError:
            if self.sender.voted == v:  # as rank 0 learns it (the vote is every rank's): their versions agree
                self._passed_by(v)
            raise
        self.version = v
        return v


def _next(held: int) -> int:
    """The version after ``held``, the newest this trainer or its engine holds."""
    if held >= MAX_VERSION:
        raise ValueError(
            f"the next version after {held} is out of range (versions lie within +-(2**62 - 1)): the engine "
            "holds the largest version a sync carries; connect with TrainerConfig(reset_versions=True) (its "
            "workers forget the versions they passed) and send from a lower one"
        )
    return held + 1
