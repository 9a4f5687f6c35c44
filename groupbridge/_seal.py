"""Sealing control messages: a MAC keyed from the group's token, bound to the group and to the message's key.

TCPStore has no authentication: whoever reaches the port reads and writes every key. With a token, every
value a member acts on is written as ``MAC || payload`` under a key derived from the token, the group's
name and generation, and the nonce rank 0 drew for this instance of the group; the MAC covers the store key
(which carries the sequence number and the writer's rank) and the payload. The join's records are sealed
with HMAC-SHA256 (:class:`Sealer`), everything after the join with keyed BLAKE2b (:class:`SessionSealer`,
see there why), so a member of another version still reads the group's description and is refused on its
protocol number. A process without the token can therefore delete or overwrite keys (deny service) but
cannot make a member accept a value: a replay from another key, another group or an earlier instance
fails the check. Without a token values travel bare and the group trusts whoever reaches the port.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import blake3

from .errors import ProtocolError

__all__ = ["MAC_BYTES", "ForgedMessageError", "Sealer", "SessionSealer"]

MAC_BYTES = 32


class ForgedMessageError(ProtocolError):
    """A value in the store does not carry this group's MAC (written by a process without the token)."""


class Sealer:
    """Seals and opens values for one group instance; a no-op without a token."""

    def __init__(self, token: str | None, context: str) -> None:
        self.enabled = token is not None
        self._key = (
            hmac.new(token.encode(), f"groupbridge-seal/1/{context}".encode(), hashlib.sha256).digest()
            if token is not None
            else b""
        )
        # the bulk digests' key, apart from every other key derived from the token by its label
        self._bulk = hmac.new(self._key, b"groupbridge-data/blake3/1", hashlib.sha256).digest()

    def mac(self, key: str, payload: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, key.encode(), hashlib.sha256)
        h.update(b"\0")
        h.update(payload)
        return h.digest()

    def seal(self, key: str, payload: bytes) -> bytes:
        if not self.enabled:
            return payload
        return self.mac(key, payload) + payload

    def open(self, key: str, raw: bytes) -> bytes:
        """The payload of ``raw`` read from ``key``; :class:`ForgedMessageError` if the MAC is wrong."""
        if not self.enabled:
            return raw
        body = raw[MAC_BYTES:]  # the one copy, returned
        if len(raw) < MAC_BYTES or not hmac.compare_digest(raw[:MAC_BYTES], self.mac(key, body)):
            raise ForgedMessageError(f"the value of key {key!r} is not sealed with this group's token")
        return body

    def digest(self) -> Any:
        """A fresh keyed hash for bulk data: keyed BLAKE3, a MAC by construction (a PRF under its key, as
        HMAC-SHA256 is), measured in docs/results.md beside XXH3 and HMAC-SHA256. One thread: BLAKE3's pool
        of threads does not survive a fork (a forked child's hash would wait forever for it), and a sync's
        buckets are hashed on the library's own threads beside the copies anyway."""
        return blake3.blake3(key=self._bulk)


class SessionSealer(Sealer):
    """Seals a joined group's control messages with keyed BLAKE2b (a MAC by construction: the key goes
    into the hash's own state, no HMAC wrapping needed).

    Control messages are small and each is sealed and opened once, usually by a process that has just
    woken from a wait, its caches cold: there HMAC-SHA256 through OpenSSL costs about 20 us a message and
    keyed BLAKE2b, CPython's own code, started from a copy of the keyed state, about 7 (the two are equal,
    2 us, when warm). Bulk data keeps :meth:`Sealer.digest` (keyed BLAKE3, fast on large inputs).
    """

    def __init__(self, token: str | None, context: str) -> None:
        super().__init__(token, context)
        # a key of its own, not the one that keys the bulk digests
        own = hmac.new(self._key, b"groupbridge-control/blake2b/1", hashlib.sha256).digest()
        self._keyed = hashlib.blake2b(key=own, digest_size=MAC_BYTES)

    def mac(self, key: str, payload: bytes | memoryview) -> bytes:
        h = self._keyed.copy()
        h.update(key.encode() + b"\0")
        h.update(payload)
        return h.digest()
