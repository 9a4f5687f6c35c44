"""Joining a StatelessGroup: who may join, how members prove it, and how a failed join is told to all.

Rank 0 draws a fresh nonce and writes the group's description (protocol, name, generation, world size,
whether a token is needed, the nonce); every other rank checks it, claims its rank (a second claim is
refused), publishes its first status record and its member record (with a fresh nonce of its own), and
waits for rank 0's verdict, the member list, which must carry that nonce. With a token, join records are
sealed under a key derived from the token and rank 0's nonce (see :mod:`._seal`), so the token never
travels and a record written by anyone else is refused; everything after the join is sealed under a session
key derived from the token and every member's nonce. A recording of an earlier instance of the group (its
description, member list, messages) is therefore worthless: a joiner refuses a member list without its own
fresh nonce, and no earlier message opens under the new session key. Any refusal is published so that both
sides raise with the same reason. Everything read is parsed as hostile: a malformed record is a
:class:`ProtocolError` naming the key, never a raw JSON or key error.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._fmt import ranks
from ._liveness import status_key, write_status
from ._seal import ForgedMessageError, Sealer, SessionSealer
from .control import Deadline
from .errors import (
    GroupBridgeError,
    GroupMismatchError,
    JoinTimeoutError,
    ProtocolError,
    StoreUnreachableError,
)
from .net import host_identity
from .store import ROOT_PREFIX, StoreClient

__all__ = ["PROTOCOL", "JoinSpec", "Joined", "host_join", "member_join"]

PROTOCOL = 9
"""2 -> 3: a receiver's wants may be conditional (``wants_if``), which a member of protocol 2 would take as
unconditional and plan otherwise. 3 -> 4: a queue's reader waits on the queue itself, and a member of
protocol 3 would wait on a bell that nobody rings any more; control messages are sealed with keyed
BLAKE2b. 4 -> 5: a sync's header says how big a bucket of a source's many-source stream may be
(``bucket_cap``) and whether its pairs may be deltas (``pair_deltas``): a member of protocol 4 would plan
other buckets and refuse the header. 5 -> 6: a rank's claim is a counter and a sealed record (see
:func:`_claim`); a member of protocol 5 writes no record, and a later claim would not see it. 6 -> 7: a
fan-out stream's bucket digests go to each receiver on their own tag, as a pair's do (``_digests.Digests``);
a member of protocol 6 would wait for them in a broadcast; a header says whether receivers may forward its
source's pairs (``forward``), which a member of protocol 6 would refuse. 7 -> 8: the handshake's posts
carry a layout by digest once every member holds it, gathered field by field (``weights._posts``), and
a source's verdict says how many receivers it sends to; a member of protocol 7 would read neither. 8 -> 9: a
sealed group's bucket digests are keyed BLAKE3 (``verify="blake3"``), where a member of protocol 8 computes
HMAC-SHA256 and would refuse every bucket."""
# The description and refusals live outside the group's namespace: a member of another name or generation
# must find them to be told why it is refused.
_META = f"{ROOT_PREFIX}/meta"
_REJECT = f"{ROOT_PREFIX}/reject"
_REJECTS = f"{ROOT_PREFIX}/rejects"
_MAX_RECORD = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinSpec:
    """What a join needs to know of the member that joins (made by the group, which the join never sees)."""

    rank: int
    world_size: int
    name: str
    generation: int
    timeout: timedelta
    """Bound on the whole join."""
    token: str | None
    """The shared secret, or None for a group without one."""
    namespace: str
    """The group's namespace in the store (name and generation)."""
    where: str
    """The group described for messages: name, generation, store address."""
    log: logging.LoggerAdapter[logging.Logger]
    """The group's rank-prefixed log."""
    give_up: Callable[[], str | None] | None = None
    """Rank 0: asked while it waits for the members; a reason it returns ends the join (see ``create``)."""


class Joined:
    """What a member learns by joining: the session's sealer and every member's record."""

    def __init__(self, spec: JoinSpec, nonce: str, members: list[dict[str, Any]]) -> None:
        nonces = ",".join(str(m["nonce"]) for m in members)
        self.sealer: Sealer = SessionSealer(spec.token, f"{_context(spec, nonce)}/session/{nonces}")
        self.members = members


def _context(spec: JoinSpec, nonce: str) -> str:
    return f"{spec.name}/{spec.generation}/{nonce}"


def _parse(raw: bytes, key: str, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    if len(raw) > _MAX_RECORD:
        raise ProtocolError(f"record {key!r} is {len(raw)} bytes, more than {_MAX_RECORD}")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"record {key!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"record {key!r} is not an object")
    for name, kind in fields.items():
        if not isinstance(d.get(name), kind) or isinstance(d.get(name), bool) != (kind is bool):
            raise ProtocolError(f"record {key!r}: field {name!r} is missing or not a {kind}")
    return d


def _seal_meta(sealer: Sealer, key: str, meta: dict[str, Any]) -> bytes:
    """The description is read before a member knows whether it is sealed, so its MAC sits beside it."""
    body = json.dumps(meta)
    mac = sealer.mac(key, body.encode()).hex() if sealer.enabled else ""
    return json.dumps({"body": body, "mac": mac}).encode()


def _meta(spec: JoinSpec) -> dict[str, Any]:
    return {
        "protocol": PROTOCOL,
        "name": spec.name,
        "generation": spec.generation,
        "world_size": spec.world_size,
        "token": spec.token is not None,
    }


def _member_record(spec: JoinSpec) -> dict[str, Any]:
    return {
        "rank": spec.rank,
        "pid": os.getpid(),
        "hostname": os.uname().nodename,
        "host_id": host_identity(),
        "nonce": secrets.token_hex(16),
    }


def _set(store: Any, key: str, data: bytes) -> None:
    store.set(key, data)  # Store.set is typed for str but takes bytes unchanged


def _call(spec: JoinSpec, what: str, fn: Any) -> Any:
    try:
        return fn()
    except RuntimeError as e:
        raise StoreUnreachableError(
            f"rank {spec.rank}: the store of {spec.where} failed while {what}: {e}"
        ) from e


def _wait(client: StoreClient, keys: list[str], deadline: Deadline) -> bool:
    """Whether all ``keys`` exist before ``deadline`` (a few short server-side waits, no busy polling)."""
    store = client.get()
    return deadline.poll(lambda: True if store.check(keys) else None, 0.02) is not None


def host_join(spec: JoinSpec, client: StoreClient) -> Joined:
    """Rank 0: describe the group, wait for every rank, verify their records, announce the members."""
    store = client.get()
    ns = spec.namespace
    nonce = secrets.token_hex(16)
    sealer = Sealer(spec.token, _context(spec, nonce))
    meta_key = _META
    meta = dict(_meta(spec), nonce=nonce)
    me = _member_record(spec)
    st = f"{ns}/{status_key(0)}"

    def describe() -> None:
        write_status(store, st, sealer, 0, "live")
        _set(store, meta_key, _seal_meta(sealer, meta_key, meta))
        store.add(f"{ns}/claim/0", 1)

    _call(spec, "describing the group", describe)
    member_keys = [f"{ns}/member/{r}" for r in range(1, spec.world_size)]
    deadline = Deadline(spec.timeout)
    unverified: list[str] = []

    def everyone_joined() -> bool | None:
        if spec.give_up is not None and (why := _asked(spec.give_up)) is not None:
            msg = f"rank 0 gave up waiting for the members: {why}"
            _fail_join(spec, store, sealer, msg)
            raise GroupBridgeError(f"{spec.where}: {msg}")
        if _call(spec, "waiting for members", lambda: store.add(_REJECTS, 0)):
            verified, reason = _read_reject(spec, store)
            if verified:
                _fail_join(spec, store, sealer, reason)
                raise GroupMismatchError(f"{spec.where}: {reason}")
            if reason not in unverified:
                unverified.append(reason)
                spec.log.warning(
                    "%s: a refusal to join not sealed with the group's token (a member with another token "
                    "or none, or someone without the token); not acted on: %s", spec.where, reason,
                )  # fmt: skip
        if not member_keys or _call(spec, "waiting for members", lambda: store.check(member_keys)):
            return True
        return None

    if deadline.poll(everyone_joined, 0.005) is None:
        joined = [0] + [r for r in range(1, spec.world_size) if store.check([member_keys[r - 1]])]
        missing = sorted(set(range(spec.world_size)) - set(joined))
        msg = (
            f"rank(s) {ranks(missing)} of {spec.world_size} did not join {spec.where} within "
            f"{deadline} (joined: {ranks(joined)})"
        )
        if unverified:
            msg += f"; an unverified refusal (not sealed with this group's token) said: {unverified[-1]}"
        _fail_join(spec, store, sealer, msg)
        raise JoinTimeoutError(msg)
    members = [me]
    for r, key in enumerate(member_keys, start=1):
        raw = bytes(_call(spec, "reading member records", lambda key=key: store.get(key)))
        try:
            member = _parse(
                sealer.open(key, raw), key, {"rank": int, "pid": int, "host_id": str, "nonce": str}
            )
            if member["rank"] != r:
                raise ProtocolError(f"record {key!r} names rank {member['rank']}")
        except (ForgedMessageError, ProtocolError) as e:
            msg = f"rank {r}'s join record was refused: {e} (a member with another token, or a forgery)"
            _fail_join(spec, store, sealer, msg)
            raise GroupMismatchError(f"{spec.where}: {msg}") from None
        members.append(member)
    ready = f"{ns}/ready"

    def announce() -> None:
        _set(store, ready, sealer.seal(ready, json.dumps({"members": members}).encode()))
        store.check([ready])

    _call(spec, "announcing the members", announce)
    return Joined(spec, nonce, members)


def _refusal_sealer(spec: JoinSpec) -> Sealer:
    """Seals a refusal. Keyed from the token alone: a member of another name or generation, which refuses
    because of that, holds the token too (or it would be refused for the token); a process without the
    token cannot fail a sealed join with a reason of its choosing."""
    return Sealer(spec.token, "join-refusal")


def _read_reject(spec: JoinSpec, store: Any) -> tuple[bool, str]:
    """A member's refusal, and whether it is to be acted on: with a token, only when sealed with it (a
    member with another token or none is refused too, but cannot prove it: its words only explain a join
    that then times out)."""
    key = _REJECT
    try:
        d = _parse(bytes(store.get(key)), key, {"rank": int, "reason": str, "mac": str})
    except (ProtocolError, RuntimeError) as e:
        return spec.token is None, f"a member's refusal could not be read ({e})"
    text = f"refused rank {d['rank']}: {d['reason'][:2000]}"
    sealer = _refusal_sealer(spec)
    verified = not sealer.enabled or hmac.compare_digest(
        sealer.mac(key, f"{d['rank']}/{d['reason']}".encode()).hex(), d["mac"]
    )
    return verified, text


_VERDICT_READ_S = 1.0
"""How long rank 0 waits for the other ranks to read a failed join's verdict before its store goes away with
its error (a rank that never came, or died, never reads it)."""


def _asked(give_up: Callable[[], str | None]) -> str | None:
    """``give_up``'s reason; one that raises gives up too, with what it raised as the reason."""
    try:
        why = give_up()
    except Exception as e:
        return f"give_up raised {type(e).__name__}: {e}"
    return None if why is None else str(why)


def _fail_join(spec: JoinSpec, store: Any, sealer: Sealer, reason: str) -> None:
    """Publish why the join failed, and wait (bounded) until every other rank has read it: each counts its
    read (``failed-read``), so that the ranks raise this reason, not a store that went away. A rank that
    never comes costs the whole bound (a second): one that comes within it still reads the reason."""
    key, read = f"{spec.namespace}/failed", f"{spec.namespace}/failed-read"
    others = spec.world_size - 1
    try:
        _set(store, key, sealer.seal(key, reason.encode()))
        Deadline(timedelta(seconds=_VERDICT_READ_S)).poll(
            lambda: True if store.add(read, 0) >= others else None, 0.005
        )
    except RuntimeError:  # the verdict is best effort; the caller raises the real error
        spec.log.debug("could not publish join failure", exc_info=True)


def _reject(spec: JoinSpec, store: Any, reason: str) -> GroupMismatchError:
    sealer = _refusal_sealer(spec)
    mac = sealer.mac(_REJECT, f"{spec.rank}/{reason}".encode()).hex() if sealer.enabled else ""
    try:
        _set(store, _REJECT, json.dumps({"rank": spec.rank, "reason": reason, "mac": mac}).encode())
        store.add(_REJECTS, 1)
    except RuntimeError:
        spec.log.debug("could not publish the refusal", exc_info=True)
    return GroupMismatchError(f"rank {spec.rank} refused to join {spec.where}: {reason}")


def member_join(spec: JoinSpec, client: StoreClient) -> Joined:
    """Ranks > 0: check the group's description, claim a rank, publish the record, wait for the verdict."""
    store = client.get()
    ns = spec.namespace
    deadline = Deadline(spec.timeout)
    meta_key = _META
    if not _call(spec, "waiting for the group description", lambda: _wait(client, [meta_key], deadline)):
        raise JoinTimeoutError(
            f"rank {spec.rank} waited {deadline} at {spec.where} for rank 0 to describe the group"
        )
    raw = bytes(_call(spec, "reading the group description", lambda: store.get(meta_key)))
    try:
        outer = _parse(raw, meta_key, {"body": str, "mac": str})
        meta = _parse(outer["body"].encode(), meta_key, {"nonce": str, "token": bool})
    except ProtocolError as e:
        raise _reject(spec, store, f"the group description is malformed: {e}") from None
    mine = _meta(spec)
    for field in ("protocol", "name", "generation", "world_size"):
        if meta.get(field) != mine[field]:
            raise _reject(
                spec,
                store,
                f"{field} differs: the group has {meta.get(field)!r}, this member {mine[field]!r}",
            )
    if meta["token"] != mine["token"]:
        which = (
            "requires a token this member lacks" if meta["token"] else "has no token but this member has one"
        )
        raise _reject(spec, store, f"the group {which}")
    sealer = Sealer(spec.token, _context(spec, meta["nonce"]))
    if sealer.enabled and not hmac.compare_digest(
        sealer.mac(meta_key, outer["body"].encode()).hex(), outer["mac"]
    ):
        raise _reject(spec, store, "the token differs from rank 0's")
    mine_record = _member_record(spec)
    _claim(spec, store, sealer, mine_record["nonce"])
    st = f"{ns}/{status_key(spec.rank)}"
    member_key = f"{ns}/member/{spec.rank}"
    record = json.dumps(mine_record).encode()

    def publish() -> None:
        write_status(store, st, sealer, 0, "live")
        _set(store, member_key, sealer.seal(member_key, record))

    _call(spec, "publishing this member", publish)
    replays: list[bool] = []
    verdict = lambda: _verdict(spec, store, sealer, meta["nonce"], mine_record["nonce"], replays)  # noqa: E731
    joined = deadline.poll(verdict, 0.005)
    if joined is None:
        raise JoinTimeoutError(
            f"rank {spec.rank} of {spec.world_size} waited {deadline} at {spec.where} for every "
            "rank to join; rank 0 did not confirm"
        )
    return joined


_CLAIM_RECORD_S = 1.0
"""How long a member waits for the record of an earlier claim of its rank (written right after the claim)."""


def _claim(spec: JoinSpec, store: Any, sealer: Sealer, nonce: str) -> None:
    """Claim this member's rank: the n-th claim bumps a counter, then writes its record (sealed, with the
    member's nonce). A later claim than the first is refused only when an earlier one has a record sealed
    with the group's token, i.e. another member holds the rank: a process without the token that bumps the
    counter (it cannot seal a record) cannot refuse the rank's member, which then claims it anyway, saying
    so in the log."""
    key = f"{spec.namespace}/claim/{spec.rank}"
    n = _call(spec, "claiming a rank", lambda: store.add(key, 1))
    _call(
        spec, "claiming a rank", lambda: _set(store, f"{key}/{n}", sealer.seal(f"{key}/{n}", nonce.encode()))
    )
    if n <= 1:
        return
    bound = Deadline(timedelta(seconds=_CLAIM_RECORD_S))

    def written(earlier: str) -> bool:
        return bool(bound.poll(lambda: True if store.check([earlier]) else None, 0.01))

    for k in range(1, n):
        earlier = f"{key}/{k}"
        if not written(earlier):
            continue  # a count with no record: no member's claim
        try:
            sealer.open(
                earlier, bytes(_call(spec, "claiming a rank", lambda earlier=earlier: store.get(earlier)))
            )
        except ForgedMessageError:
            continue
        raise _reject(spec, store, f"rank {spec.rank} is already taken by another member")
    spec.log.warning(
        "%s: rank %d's claim was counted %d time(s) before this member's with no record sealed with the "
        "group's token (a process without the token wrote to the store); claiming it", spec.where,
        spec.rank, n - 1,
    )  # fmt: skip


def _verdict(
    spec: JoinSpec, store: Any, sealer: Sealer, nonce: str, mine: str, replays: list[bool]
) -> Joined | None:
    """Rank 0's verdict on this join, once it is there: the member list, or a refusal (raised). A member
    list without this member's fresh nonce ``mine`` is a replay of an earlier instance: ignored."""
    ready, failed = f"{spec.namespace}/ready", f"{spec.namespace}/failed"
    if _call(spec, "waiting for the join", lambda: store.check([failed])):
        raw = bytes(_call(spec, "reading the join verdict", lambda: store.get(failed)))
        try:
            reason = sealer.open(failed, raw).decode("utf-8", "replace")[:4000]
        except ForgedMessageError:
            reason = "(unsealed verdict, ignored)"
        if not reason.startswith("(unsealed"):
            with contextlib.suppress(RuntimeError):  # rank 0 waits for this (bounded) before it goes
                store.add(f"{spec.namespace}/failed-read", 1)
            raise GroupMismatchError(f"{spec.where}: join failed: {reason}")
    if not _call(spec, "waiting for the join", lambda: store.check([ready])):
        return None
    raw = bytes(_call(spec, "reading the member list", lambda: store.get(ready)))
    try:
        members = _parse(sealer.open(ready, raw), ready, {"members": list})["members"]
    except ForgedMessageError:
        return None  # someone without the token wrote it first; rank 0's own overwrites it
    if len(members) != spec.world_size or not all(
        isinstance(m, dict)
        and isinstance(m.get("host_id"), str)
        and isinstance(m.get("pid"), int)
        and isinstance(m.get("nonce"), str)
        for m in members
    ):
        raise ProtocolError(f"record {ready!r} does not describe {spec.world_size} members")
    if not hmac.compare_digest(str(members[spec.rank]["nonce"]), mine):
        if not replays:
            spec.log.warning(
                "%s: the member list in the store is not this join's (a replay of an earlier instance of "
                "the group?); ignoring it and waiting for rank 0's", spec.where,
            )  # fmt: skip
            replays.append(True)
        return None
    return Joined(spec, nonce, members)
