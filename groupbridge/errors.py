"""The library's exception hierarchy.

Caller mistakes are ``ValueError`` / ``TypeError``. Everything that goes wrong because of a peer, the network
or the clock is a :class:`GroupBridgeError`; timeouts are also :class:`TimeoutError` so generic handlers work.

:class:`GroupBridgeError` is not a ``RuntimeError``: torch reports its store and backend failures as
``RuntimeError`` (``DistError`` and kin), and the library translates them where they enter. Were ours a
``RuntimeError`` too, every ``except RuntimeError`` meant for torch would also catch the library's own
errors, correct only by the order of its clauses.
"""

from __future__ import annotations

__all__ = [
    "CopyTimeoutError",
    "GroupBridgeError",
    "GroupClosedError",
    "GroupMismatchError",
    "JoinTimeoutError",
    "ManifestMismatchError",
    "PeerDiedError",
    "PeerTimeoutError",
    "ProtocolError",
    "StoreUnreachableError",
    "SyncRefusedError",
    "TornUpdateError",
    "TransportRefusedError",
    "TransportUnavailableError",
    "VLLMCompatError",
    "WeightSyncError",
]


class GroupBridgeError(Exception):
    """Root of every error groupbridge raises about peers, timeouts and protocols."""


class GroupClosedError(GroupBridgeError):
    """An operation was attempted on a group after ``close()`` (or after it broke)."""


class GroupMismatchError(GroupBridgeError):
    """A member does not belong: other name, generation, world size, token, or a duplicate rank."""


class JoinTimeoutError(GroupBridgeError, TimeoutError):
    """Not every rank joined the group within the timeout."""


class PeerTimeoutError(GroupBridgeError, TimeoutError):
    """A peer did not answer within the timeout of an operation."""


class CopyTimeoutError(GroupBridgeError, TimeoutError):
    """A bulk copy on a thread the library owns did not finish within the operation's deadline."""


class PeerDiedError(GroupBridgeError):
    """A peer stopped sending its liveness signal, or its store connection dropped. ``rank``: the peer, when
    the liveness watcher named one. ``aborted``: that peer is alive and aborted the group (the message says
    why, often another peer's death it saw first)."""

    def __init__(self, message: str, rank: int | None = None, *, aborted: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.aborted = aborted


class StoreUnreachableError(GroupBridgeError):
    """The group's store (hosted by rank 0) could not be reached."""


class ProtocolError(GroupBridgeError):
    """A peer sent something that does not follow the wire protocol."""


class WeightSyncError(GroupBridgeError):
    """A weight sync failed; the receiver's held version is unchanged."""


class SyncRefusedError(WeightSyncError):
    """A weight sync that every member ended the same way and knows it: refused before any byte moved (a
    receiver's verdict), or finished with some receiver refusing the bytes it got. The group stays usable:
    nobody aborts it, and the next sync may follow at once.

    ``newest``: when some receiver refused the version as not newer than one it holds, the newest version
    a receiver holds (a later sync must be newer than it); else None."""

    def __init__(self, *args: object, newest: int | None = None) -> None:
        super().__init__(*args)
        self.newest = newest


class ManifestMismatchError(SyncRefusedError):
    """The sender's manifest does not match what a receiver expects; nothing was sent."""


class TornUpdateError(WeightSyncError):
    """A streaming (non-atomic) update failed midway: the target holds a mix of two versions."""

    def __init__(self, message: str, written: list[str]) -> None:
        super().__init__(message)
        self.written = written


class VerificationError(WeightSyncError):
    """An update arrived whole and was installed, but the engine's output disagreed with the trainer's model
    (a :class:`groupbridge.engine.Probe`): every replica was rolled back to ``served`` (None: the rollback
    was not possible, and the message says what each replica serves)."""

    def __init__(
        self, message: str, *, version: int, replica: int, difference: float, served: int | None
    ) -> None:
        super().__init__(message)
        self.version = version
        self.replica = replica
        self.difference = difference
        self.served = served


class TransportUnavailableError(GroupBridgeError):
    """An explicitly requested transport cannot work between these members."""


class TransportRefusedError(TransportUnavailableError, SyncRefusedError):
    """A receiver could not attach to the sync's transport (map the source's shared memory): every member
    learnt it in the handshake, before any byte moved, and the group stays usable."""


class VLLMCompatError(GroupBridgeError):
    """The installed vLLM is not one groupbridge's vLLM backend was read and tested against, or a private
    vLLM name it reads is gone: raised where the backend starts, or where the name is read, naming both."""
