"""Joining a StatelessGroup: who may join, how members prove it, and how a failed join is told to all.

Rank 0 writes the group's description (protocol, name, generation, world size, whether a token is needed,
a fresh nonce and its own proof) to the store; every other rank checks it, claims its rank (a second claim
is refused), and proves it holds the token with an HMAC over the nonce, so the token itself never travels.
Any refusal is published so that both sides raise with the same reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._fmt import ranks, seconds
from ._torch_private import Store
from .errors import GroupMismatchError, JoinTimeoutError, PeerTimeoutError
from .net import host_identity
from .store import ROOT_PREFIX

if TYPE_CHECKING:
    from .stateless import StatelessGroup

logger = logging.getLogger(__name__)

__all__ = ["PROTOCOL", "host_join", "member_join"]

PROTOCOL = 1
_META = f"{ROOT_PREFIX}/meta"
_REJECTS = f"{ROOT_PREFIX}/rejects"


def _proof(token: str | None, nonce: str, who: str) -> str:
    if token is None:
        return ""
    return hmac.new(token.encode(), f"{nonce}/{who}".encode(), hashlib.sha256).hexdigest()


def _meta(group: StatelessGroup) -> dict[str, Any]:
    return {
        "protocol": PROTOCOL,
        "name": group.name,
        "generation": group.generation,
        "world_size": group.world_size,
        "token": group._token is not None,
    }


def host_join(group: StatelessGroup, store: Store) -> None:
    """Rank 0: describe the group, wait for every rank, verify their proofs, announce the members."""
    nonce = secrets.token_hex(16)
    group._nonce = nonce
    meta = dict(_meta(group), nonce=nonce, proof=_proof(group._token, nonce, "host"))
    store.set(_META, json.dumps(meta))
    store.add(f"{group._ns}/claim/0", 1)
    member_keys = [f"{group._ns}/member/{r}" for r in range(1, group.world_size)]
    deadline = time.monotonic() + group.timeout.total_seconds()
    delay = 0.001
    while True:
        rejects = store.add(_REJECTS, 0)
        if rejects:
            store.wait([f"{ROOT_PREFIX}/reject/1"], timedelta(seconds=5))
            reason = json.loads(store.get(f"{ROOT_PREFIX}/reject/1"))
            _fail_join(group, store, reason["reason"])
            raise GroupMismatchError(f"{group._where()}: refused rank {reason['rank']}: {reason['reason']}")
        if not member_keys or store.check(member_keys):
            break
        if time.monotonic() >= deadline:
            joined = [0] + [r for r in range(1, group.world_size) if store.check([member_keys[r - 1]])]
            missing = sorted(set(range(group.world_size)) - set(joined))
            msg = (
                f"rank(s) {ranks(missing)} of {group.world_size} did not join {group._where()} within "
                f"{seconds(group.timeout)} (joined: {ranks(joined)})"
            )
            _fail_join(group, store, msg)
            raise JoinTimeoutError(msg)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    host_ids = [host_identity()]
    for r, key in enumerate(member_keys, start=1):
        member = json.loads(store.get(key))
        if member["proof"] != _proof(group._token, nonce, str(r)):
            msg = f"rank {r} (pid {member['pid']} on {member['hostname']}) does not hold this group's token"
            _fail_join(group, store, msg)
            raise GroupMismatchError(f"{group._where()}: {msg}")
        host_ids.append(member["host_id"])
    group.host_ids = host_ids
    store.set(f"{group._ns}/ready", json.dumps({"host_ids": host_ids}))


def _fail_join(group: StatelessGroup, store: Store, reason: str) -> None:
    try:
        store.set(f"{group._ns}/failed", reason)
        # Let joiners read the verdict before the store goes away with this process's error.
        time.sleep(0.2)
    except Exception:  # the verdict is best effort; the caller raises the real error
        logger.debug("could not publish join failure", exc_info=True)


def _reject(group: StatelessGroup, store: Store, reason: str) -> GroupMismatchError:
    n = store.add(_REJECTS, 1)
    store.set(f"{ROOT_PREFIX}/reject/{n}", json.dumps({"rank": group.rank, "reason": reason}))
    return GroupMismatchError(f"rank {group.rank} refused to join {group._where()}: {reason}")


def member_join(group: StatelessGroup, store: Store) -> None:
    """Ranks > 0: check the group's description, claim a rank, prove the token, wait for the verdict."""
    deadline = time.monotonic() + group.timeout.total_seconds()
    group._poll(lambda: store.check([_META]), deadline, "the group description from rank 0", [0], live=False)
    meta = json.loads(store.get(_META))
    mine = _meta(group)
    for field in ("protocol", "name", "generation", "world_size"):
        if meta.get(field) != mine[field]:
            raise _reject(
                group,
                store,
                f"{field} differs: the group has {meta.get(field)!r}, this member {mine[field]!r}",
            )
    if meta["token"] != mine["token"]:
        which = (
            "requires a token this member lacks" if meta["token"] else "has no token but this member has one"
        )
        raise _reject(group, store, f"the group {which}")
    if meta["proof"] != _proof(group._token, meta["nonce"], "host"):
        raise _reject(group, store, "the token differs from rank 0's")
    if store.add(f"{group._ns}/claim/{group.rank}", 1) > 1:
        raise _reject(group, store, f"rank {group.rank} is already taken by another member")
    member = {
        "pid": os.getpid(),
        "hostname": os.uname().nodename,
        "host_id": host_identity(),
        "proof": _proof(group._token, meta["nonce"], str(group.rank)),
    }
    store.set(f"{group._ns}/member/{group.rank}", json.dumps(member))
    ready, failed = f"{group._ns}/ready", f"{group._ns}/failed"
    try:
        group._poll(
            lambda: store.check([ready]) or store.check([failed]), deadline, "the join", [0], live=False
        )
    except PeerTimeoutError as e:
        raise JoinTimeoutError(
            f"rank {group.rank} of {group.world_size} waited {seconds(group.timeout)} at {group._where()} "
            "for every rank to join; rank 0 did not confirm"
        ) from e
    if store.check([failed]):
        raise GroupMismatchError(f"{group._where()}: join failed: {store.get(failed).decode()}")
    group.host_ids = json.loads(store.get(ready))["host_ids"]
