"""The inference side of an engine: join the trainer's bridge, receive each update, stage it, commit it.

An engine (vLLM, SGLang, a custom server) supplies a :class:`Loader`: how to dry-run a manifest through its
model, how to load (name, tensor) pairs, how to leave the model serving afterwards. Everything else is here,
once: the bridge and its generations, the handshake that refuses what the model cannot load before any byte
moves, the kept buffer the bytes land in (reused across updates and bridges, handed to the loader as views:
nothing staged per name, cloned or re-assembled), the background landing of an atomic update, the commit,
and what a failure midway means.

An update, as the engine's RPCs drive it::

    session.begin()                  # a new update: whatever an earlier one left uncommitted is dropped
    session.receive(version)         # the handshake; the bytes land (atomic: on a thread, the engine
                                     #   serving on, with a shadow the handshake too; streaming: loaded here)
    session.commit()                 # atomic: wait for the bytes, then the loader's load (the only stop)
    session.begin(); session.stage_rollback(version); session.commit()   # that version is served again

(a rollback: ``BridgeInfo.rollback``, the worker keeps the bytes of the version it served before the update,
see :mod:`._rollback`). With a loader that keeps a shadow (:class:`Swaps`, ``BridgeInfo.swap="shadow"``) the
update is loaded into the shadow as it lands, before the sender is acknowledged; the commit exchanges copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta

import torch

from .._closing import Closing
from ..errors import WeightSyncError
from ..stateless import StatelessGroup
from ..weights import DeltaMemory
from ..weights._bytes import BufferCache
from ..weights.receiver import WeightReceiver, WeightUpdate
from ._info import BridgeInfo
from ._landing import Landing, keep_then
from ._loader import Loader, ReadsBoxes, Swaps
from ._model import ServedModel

__all__ = ["WorkerSession"]

Pairs = Iterator[tuple[str, torch.Tensor]]


class WorkerSession(Closing):
    """One inference worker's side of the bridge (see the module docstring).

    Args:
        loader: the engine's model, as a :class:`Loader`.
        device: where bytes land (the model's device).
        background: an atomic update's bytes land on a thread, so the engine serves until ``commit``;
            False lands them inside ``receive`` (the engine's RPC), as a streaming update always does.
        log: where the session's lines go (an engine's own logger keeps its format).
        swaps: the loader again, where it keeps a shadow (:class:`Swaps`), used when the trainer's bridge
            asks for swaps (``BridgeInfo.swap``).
        reads: the loader again, where it says which box of each tensor its model reads (:class:`ReadsBoxes`:
            a tensor-parallel worker's), so that later updates bring only those.
    """

    def __init__(
        self,
        loader: Loader,
        *,
        device: str | torch.device = "cpu",
        background: bool = True,
        log: logging.Logger | None = None,
        swaps: Swaps | None = None,
        reads: ReadsBoxes | None = None,
    ) -> None:
        self.loader = loader
        self.swaps = swaps
        self.reads = reads
        self.device = torch.device(device)
        self.background = background
        self.log = log if log is not None else logging.getLogger(__name__)
        self.group: StatelessGroup | None = None
        self.receiver: WeightReceiver | None = None
        self.info: BridgeInfo | None = None
        self.timings: dict[str, float] = {}
        """Seconds of the last update: ``handshake`` (with ``check``, the loader's dry run), ``receive``
        (in the engine's RPC: streamed into the model, or landed when not in the background), ``landing``
        (background), ``wait`` (commit waiting for the landing), ``load`` (the staged update into the
        model, its ``finish`` among it: what the loader does after the pairs, e.g. repacking kernels)."""
        self._buffers = BufferCache()
        """The receive buffers (the kept copy of the weights among them), kept across bridge generations."""
        self._memory = DeltaMemory(buffers=self._buffers)
        """What a delta is applied to, kept across bridges too (verl makes one per update)."""
        self._landing: Landing | None = None
        self.stuck: Landing | None = None
        """An atomic update's landing that did not stop when halted: every later update, join and rollback
        is refused at once, naming it, until it ends, and its receiver is dropped unclosed (see
        :meth:`_drop`)."""
        self._received: int | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._streamed: list[tuple[str, torch.Tensor]] | None = None
        self.model = ServedModel(loader, swaps, self.log, self.timings)
        """What the model serves: its version, its shadow, the bytes kept for a rollback."""
        self._rollback_to: int | None = None
        self._prepared: int | None = None
        """The version received into the shadow, to be swapped in at the commit."""
        self.newest: dict[str, int] = {}
        """Per line of versions (the base weights: ``""``; an adapter: its name), the newest version whose
        sync passed its vote here, from any trainer on any bridge: a later sync of that line must be newer
        (refused in its handshake otherwise, on every member), so that no number names two sets of weights
        even when a second trainer takes this engine over while the first lives on."""
        self._line = ""

    @property
    def version(self) -> int | None:
        """The version the model holds (None: the weights it was started with)."""
        return self.model.version

    @version.setter
    def version(self, version: int | None) -> None:
        self.model.version = version

    # ------------------------------------------------------------------ bridge

    def join(self, info: BridgeInfo, rank: int) -> None:
        """Join the bridge ``info`` describes as ``rank``; a bridge joined before is left first. Refused at
        once while a landing is stuck (see :attr:`stuck`)."""
        self.close()
        self._refuse_if_stuck()
        if rank >= info.world_size:
            raise ValueError(
                f"this worker is bridge rank {rank} but the trainer expects world_size={info.world_size} "
                "(its sending ranks + the workers): tell the trainer how many workers join"
            )
        self.group = StatelessGroup.create(
            info.host, info.port, rank=rank, world_size=info.world_size, name=info.name,
            generation=info.generation, timeout=timedelta(seconds=info.timeout_s),
            liveness_timeout=timedelta(seconds=info.liveness_s), token=info.token, published=True,
        )  # fmt: skip
        # no src: the handshake finds the senders (rank 0, or every trainer rank sending its shards)
        self.receiver = WeightReceiver(
            self.group, device=self.device, buffers=self._buffers, memory=self._memory
        )
        self.info = info
        self.log.info("groupbridge: worker joined %s as rank %d of %d", info.host, rank, info.world_size)
        if info.reset_versions:
            self.reset_versions(why=f"the trainer of bridge {info.bridge_id or info.name!r} asked to")

    def _noted(self) -> None:
        """The receiver's version (its last sync that passed the vote) into :attr:`newest`."""
        held = self.receiver.version if self.receiver is not None else None
        if held is not None:
            self.newest[self._line] = max(self.newest.get(self._line, held), held)

    def passed(self, line: str = "") -> int | None:
        """The newest version of ``line`` whose sync passed its vote here (None: none yet): an update of that
        line must be newer (see :attr:`newest`)."""
        self._noted()
        return self.newest.get(line)

    def reset_versions(self, line: str | None = None, why: str = "asked to") -> dict[str, int]:
        """Forget the newest version passed here per line (every line when ``line`` is None): the next update
        of that line is taken whatever its version. The way out of a version no trainer can pass (a buggy
        counter sent ``2**62 - 1``), and what a driver that owns its workers does when it goes back on
        purpose (verl repeats a step to validate, and a resumed trainer starts from an older one). The
        model, and the version it serves, are unchanged. Returns the versions forgotten, by line."""
        self._noted()  # the last sync that passed counts first
        forgotten = {
            k: self.newest.pop(k) for k in (list(self.newest) if line is None else [line]) if k in self.newest
        }
        if self.receiver is not None:
            self.receiver.version = None  # noted above: the next receive takes newest's
        if forgotten:
            self.log.warning(
                "groupbridge: the versions this worker passed were forgotten (%s): %s",
                why,
                ", ".join(f"{k or 'weights'} {v}" for k, v in forgotten.items()),
            )
        return forgotten

    def close(self) -> None:
        """Leave the bridge. A landing in flight is aborted (its group is), and waited for, bounded."""
        self._noted()
        try:
            self._drop("the worker left the bridge during an update", refuse=False)
        except WeightSyncError as e:  # its receiver is not closed under it: dropped, never reused
            self.log.error("groupbridge: %s", e)
            self.receiver = None
        if self.stuck is not None and self.stuck.running:  # nor later, while that landing runs on
            self.receiver = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ one update

    def begin(self) -> None:
        """A new update: what an earlier one received and did not commit is dropped, at once; a landing of
        it still running ends on its own, waited for (bounded) by the next call that needs the bridge."""
        self._forget()

    def _forget(self) -> None:
        """Forget what was received and not committed (a landing still running is :meth:`_drop`'s)."""
        self._received = None
        self._staged = None
        self._streamed = None
        self._rollback_to = None
        self._prepared = None

    def receive(self, version: int | None = None, *, line: str = "", bridge: str | None = None) -> None:
        """The handshake (the loader's dry run of the manifest); then the bytes: an atomic update's land on
        a thread (with ``background`` or a shadow; with a shadow and ``version``, the handshake too: the
        engine's RPC returns at once) or here, a streaming update's are loaded here as they arrive.
        ``line``: which line of versions the update belongs to (see :attr:`newest`). ``bridge``: the
        bridge the update's trainer sends on (its ``BridgeInfo.bridge_id``): another than this worker's
        is refused at once (another trainer took the engine over since; the first one's next connect
        joins it again)."""
        if self.receiver is None or self.info is None:
            raise RuntimeError("the worker has not joined a bridge: call join() first")
        if bridge is not None and bridge != self.info.bridge_id:
            held = self.version if self.version is not None else "its initial weights"
            raise WeightSyncError(
                f"update {version} was begun for bridge {bridge[:32]!r}, but this worker is on another "
                f"trainer's bridge since ({self.info.bridge_id!r}; it serves {held}): nothing received"
            )
        self._drop("a new update began before the last one landed", settle=True)
        self._noted()
        self._line = line
        self.receiver.version = self.newest.get(line)  # the handshake refuses a version not newer
        # Every update lands in the receiver's kept copy of the weights and yields whole tensors as views of
        # it, valid until the next update. A delta update still yields every tensor (a loader may need whole
        # layers); only the changes travel.
        reads, swaps = (
            self.reads,
            self.swaps if self.swaps is not None and self.info.swap == "shadow" else None,
        )
        # a serving copy left torn by a load into it (swap="reload") is mended by a load into it first: a
        # torn copy exchanged into the shadow and loaded there once still served a wrong token (vLLM 0.32)
        shadow = swaps is not None and swaps.swapping() and self.model.clean
        landed: list[tuple[str, torch.Tensor]] = []  # an atomic update: into the shadow before the ack
        ready = (lambda: self.model.prepare(iter(landed), None)) if shadow and self.info.atomic else None
        receiver, timeout = self.receiver, timedelta(seconds=self.info.timeout_s)
        # with a shadow, the copy that served keeps the previous version: no bytes kept aside
        keep = self.model.kept.before_landing if self.info.rollback and not shadow else None

        def handshake() -> WeightUpdate:
            t0, check = time.perf_counter(), list[float]()
            update = receiver.receive(
                timeout=timeout, accept=lambda m: self.model.check(m, check), only_changed=False, keep=True,
                reads=reads.reads if reads is not None else None, ready=ready,
            )  # fmt: skip
            if version is not None and update.version != version:
                self.log.warning("groupbridge: the engine says version %d, the bridge %d", version,
                                 update.version)  # fmt: skip
            self.timings.clear()
            self.timings.update(handshake=time.perf_counter() - t0, check=sum(check))
            if keep is None:
                self.model.kept.clear()
            if shadow:
                self.model.shadow_holds = None  # overwritten from now on
            return update

        if self.info.atomic and shadow and version is not None:
            # the handshake too on the landing's thread (its dry run on the shadow, see Swaps): the engine
            # serves on meanwhile (a refusal reaches the trainer over the bridge, and this worker at commit)
            self._landing = Landing(handshake, self.log, version=version, before=keep, into=landed)
            self._prepared = self._received = version
            return
        update = handshake()
        t1, into = time.perf_counter(), self.model.prepare if shadow else self.model.load
        if not self.info.atomic and update.kept:
            streamed = Landing(update, self.log, stream=True, before=keep)
            streamed.feed(lambda pairs: into(pairs, update.version), self.group, timeout=self.info.timeout_s,
                          liveness=self.info.liveness_s)  # fmt: skip
            self.timings["landing"] = streamed.seconds
            self._streamed = streamed.staged
        elif not self.info.atomic:
            into(iter(update), update.version)
        elif self.background or shadow:
            self._landing = Landing(update, self.log, before=keep, into=landed)
        else:
            self._staged = list(keep_then(update, keep))
        if shadow:
            self._prepared = update.version
        self._received = update.version
        self.timings["receive"] = time.perf_counter() - t1

    @property
    def torn(self) -> bool:
        """The serving model holds a mix of versions: a load into it failed midway (a commit or a rollback
        that loads, not a swap). The next update loads every tensor (a delta's too), which mends it."""
        return not self.model.clean and self._landing is None

    @property
    def staged(self) -> int | None:
        """The version the next :meth:`commit` would serve: received, or a rollback staged (None: none)."""
        return self._rollback_to if self._rollback_to is not None else self._received

    def commit(self) -> int:
        """Make the received update the model's: wait for its bytes (bounded), load them (atomic), and
        return its version.

        Raises:
            WeightSyncError: nothing to commit, and why: no update received since ``begin`` (or a new bridge
                dropped it), its bytes did not land (the sync failed or was refused on some member: the
                sender was told then), or they did not land in time. The model and ``version`` stay as
                they were; an engine that reports a version only after a commit returns (vLLM) keeps
                reporting the one it serves.
        """
        if self._rollback_to is not None:
            return self._roll_back()
        if self._received is None:
            held = self.version if self.version is not None else "the initial weights"
            raise WeightSyncError(
                f"nothing to commit: no update was received since the last one began (a trainer that "
                f"joined since drops what an earlier one sent); the model still holds {held}"
            )
        version, landing, staged, streamed = self._received, self._landing, self._staged, self._streamed
        prepared, self._prepared = self._prepared, None
        self._received, self._landing, self._staged, self._streamed = None, None, None, None
        if landing is not None:
            t0 = time.perf_counter()
            assert self.info is not None
            if not landing.wait(self.info.timeout_s):
                self._landing = landing
                self._drop(f"version {version} did not land within {self.info.timeout_s:g} s")
                raise WeightSyncError(
                    f"version {version} did not land within {self.info.timeout_s:g} s: nothing loaded"
                )
            self.timings["wait"] = time.perf_counter() - t0
            self.timings["landing"] = landing.seconds
            if landing.version is not None and landing.version != version:  # the bridge's number stands
                prepared = landing.version if prepared == version else prepared
                version = landing.version
            if landing.error is not None:
                raise WeightSyncError(
                    f"version {version} did not land ({type(landing.error).__name__}: {landing.error}): "
                    "nothing loaded"
                ) from landing.error
            staged = landing.staged
        if prepared == version:
            return self.model.swap(version, "swap")
        if staged is not None:
            t0 = time.perf_counter()
            self.model.load(iter(staged), version)
            self.timings["load"] = time.perf_counter() - t0
        self.version = version
        if self.info is not None and self.info.rollback:
            self.model.kept.committed(version, staged if staged is not None else streamed)
        self.log.info("groupbridge: version %d committed: %s", version,
                      ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items()))  # fmt: skip
        return version

    def stage_rollback(self, version: int) -> None:
        """The next ``commit`` serves ``version`` again, the version this worker served before its last
        update: the shadow swapped back in where it holds it, else loaded from the rollback copy (see
        :mod:`._rollback`); nothing where the model serves it still (a swap that did not happen here).
        Raises WeightSyncError, and stages nothing, when this worker does not keep that version."""
        self._drop("a rollback began before the last update landed", settle=True)
        self.model.check_rollback(version)
        self._rollback_to = version

    def _roll_back(self) -> int:
        version, self._rollback_to = self._rollback_to, None
        assert version is not None
        return self.model.roll_back(version)

    def abandon(self) -> None:
        """Drop an update received and not committed (a trainer recovering an engine another left
        mid-update): the model and ``version`` stay as they are."""
        self._drop("the trainer abandoned the update", settle=True, refuse=False)

    # ------------------------------------------------------------------ helpers

    def _drop(self, why: str, *, settle: bool = False, refuse: bool = True) -> None:
        """Forget what was received and not committed; a landing still running is halted (see
        :meth:`Landing.halt`; ``settle``: a new update begins). A landing that does not stop is kept as
        :attr:`stuck`; while it runs, ``refuse`` raises at once (see :meth:`_refuse_if_stuck`)."""
        self._forget()
        landing, self._landing = self._landing, None
        if landing is not None:
            liveness = self.info.liveness_s if self.info is not None else 10.0
            try:
                landing.halt(self.group, liveness, why, settle=settle)
            except WeightSyncError:
                self.stuck = landing
                raise
        if refuse:
            self._refuse_if_stuck()

    def _refuse_if_stuck(self) -> None:
        """Raise WeightSyncError at once while a landing that did not stop still runs (its thread is in a
        loader call that does not return, and would write what the next update lands in); forget it once it
        ended."""
        stuck = self.stuck
        if stuck is None:
            return
        if not stuck.running:
            self.log.warning(
                "groupbridge: the stuck landing of version %s ended; updates are taken again", stuck.version
            )
            self.stuck = None
            return
        raise WeightSyncError(
            f"this worker's landing of version {stuck.version} is stuck (for {stuck.stuck_for():.0f} s: its "
            "thread is in a loader call that does not return, and its bridge was aborted): this worker "
            "takes no update until it ends; restart the engine's workers if it does not"
        )
