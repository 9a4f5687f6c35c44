"""How a trainer hosts the bridge to an engine's workers: one frozen, checked configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..net import Listener
from ..weights._header import MAX_VERSION
from ..weights.transports import TRANSPORTS
from ._info import SWAPS, check_seconds
from ._probe import Probe

__all__ = ["TrainerConfig"]


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
        checksum: a checksum of every bucket, verified before the update is loaded (implied by a token):
            XXH3-64 for buckets in host memory, ``mix64`` (computed on the device) for a device's.
        bucket_bytes: bucket size (None: the library's default).
        first_version: the version of the first send (then +1 each time). None (default): 1, or, with one
            sending rank whose engine already serves a numbered version (an earlier trainer's), the one
            after it, so that the version an engine reports never goes back. (With several sending ranks
            only rank 0 talks to the engine and every rank must send the same version: each starts at 1;
            pass one above the served version.)
        reset_versions: the workers forget the versions they passed (``WorkerSession.reset_versions``) when
            this session's first bridge joins them, and its versions start at ``first_version`` or 1, not
            after the engine's. An operator's way out of a version no trainer can follow (a buggy counter sent
            ``2**62 - 1``), or a trainer that takes an engine over with lower versions on purpose. What it
            lifts: a second trainer whose versions are not newer than the engine's is refused otherwise.
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
            own requests while ``send_weights`` runs. A trainer's first version that disagrees has no
            earlier version to return to: every engine then reports ``"unverified"`` and serves no request
            (each fails with an error saying why) until an update lands and verifies.
        serve_unverified: with ``verify``, an operator's choice for that first version: the engines serve
            it on, its tokens labelled ``"unverified"`` (never with the version).
        swap: ``"shadow"`` (default): a worker whose engine can keep a second copy of its model (vLLM's)
            loads and processes each update into it while it serves, and the commit exchanges the copies:
            the engine stops for the exchange only, whatever the model's size (one more processed copy of
            the model in the worker's memory). ``"reload"``: the commit loads the update into the serving
            copy (the engine stops for the load; no second copy).
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
    swap: str = "shadow"
    listener: Listener | None = None
    verify: Probe | None = None
    rollback: bool | None = None
    serve_unverified: bool = False
    reset_versions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be >= 1 (the number of worker processes)")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of auto, {', '.join(TRANSPORTS)}")
        check_seconds(timeout_s=self.timeout_s, liveness_s=self.liveness_s)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} is not a TCP port (0: the kernel picks one)")
        fv = self.first_version
        if fv is not None and (isinstance(fv, bool) or not isinstance(fv, int) or not 0 <= fv <= MAX_VERSION):
            raise ValueError(f"first_version={fv!r} must be None or an int from 0 to 2**62 - 1")
        if not isinstance(self.sources, int) or self.sources < 1:
            raise ValueError(f"sources={self.sources!r} must be >= 1 (the trainer ranks that send)")
        if self.swap not in SWAPS:
            raise ValueError(f"swap={self.swap!r} must be one of {', '.join(SWAPS)}")
        if self.delta not in (False, True, "always"):
            raise ValueError(f"delta={self.delta!r} must be False, True or 'always'")
        if self.verify is not None and not isinstance(self.verify, Probe):
            raise TypeError(f"verify must be a groupbridge.engine.Probe, got {type(self.verify).__name__}")
        if not isinstance(self.reset_versions, bool):
            raise ValueError(f"reset_versions={self.reset_versions!r} must be a bool")
        if not isinstance(self.serve_unverified, bool):
            raise ValueError(f"serve_unverified={self.serve_unverified!r} must be a bool")
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

    def needs(self) -> tuple[str, ...]:
        """The engine capabilities (:class:`Capabilities`) this configuration asks of the engine."""
        if self.verify is not None:
            return ("probe", "rollback")
        return ("rollback",) if self.keeps_previous else ()

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
