"""A sync is a session: one handshake, one verdict, one commit, over one stream per source.

Every member of a sync takes the same steps, whatever moves the bytes:

1. **Handshake** (one all-gather): each source (a member that posts one) posts a :class:`Header`, each
   receiver the manifest digests it knows; a source broadcasts its manifest when some receiver lacks it.
2. **Verdicts** (one all-gather): each receiver checks manifest, version, transport, byte layout and delta
   base; one refusal and every member raises the same :class:`SyncRefusedError` subclass, no byte moved.
3. **Streams**: the bytes of each source travel by their stream's cut and transport (see :class:`Session`).
4. **Vote** (one all-gather, :func:`vote`): one failed part and all raise :class:`SyncRefusedError`, no
   version moved (atomic targets untouched, streaming ones torn); a member dead or frozen aborts the group.
5. **Commit**: atomic receivers apply what they staged, versions move, ``send`` returns once every receiver
   acknowledged; a receiver dead after the vote leaves the others committed and the sources raising, named.

A refusal (steps 2, 4) leaves the group usable. A member that dies is named by every member that raises (the
liveness watcher aborts the group); its replacement joins a new group. One source sending whole tensors is one
stream; many sources, or receivers that take boxes, one stream per (source, receiver) pair (:mod:`._sharded`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..control import Deadline
from ..errors import (
    ManifestMismatchError,
    ProtocolError,
    SyncRefusedError,
    TransportRefusedError,
    TransportUnavailableError,
    WeightSyncError,
)
from ..stateless import StatelessGroup
from . import _bytes
from ._header import Header, Verdict
from ._posts import Posts, header_fields, header_of
from ._shard_plan import ShardPlan
from ._sharded import conditional, holding, pair_deltas, plan_pairs
from ._sharded_delta import Bases
from ._streams import Stream
from ._topology import Fanout, Pairs, Topology
from .manifest import Manifest
from .plan import Plan, Plans
from .transports import TRANSPORTS


def laid_out_in_place(merged: Plan, tensors: list[torch.Tensor | None], *, receiving: bool) -> bool:
    """Whether ``tensors`` (in manifest order) lie in the byte layout of the ``merged`` plan
    (``Plans.merged``), so that every bucket of any cut is a view of their own storage (see
    :func:`._bytes.in_place_bucket`)."""
    return all(
        _bytes.in_place_bucket(merged, k, tensors, receiving=receiving) is not None
        for k in range(len(merged.buckets))
    )


Renamer = Callable[[str], str]


def make_renamer(rename: Callable[[str], str] | Mapping[str, str] | None) -> Renamer:
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda name: table.get(name, name)
    if callable(rename):
        return rename
    raise TypeError(f"rename= must be a callable or a mapping, got {type(rename).__name__}")


@dataclass(frozen=True, slots=True)
class Session:
    """The handshake's outcome, the same on every member: who sends what, and how it travels (``topology``:
    one fan-out stream of one source's whole tensors, or a stream per (source, receiver) pair)."""

    sources: tuple[int, ...]
    header: Header
    """The lowest source's header (version, sync id, bucket size, verification: the same for all)."""
    manifest: Manifest
    """The global tensors some receiver wants: names, global shapes, wire dtypes."""
    headers: Mapping[int, Header]
    """Every source's own header: its stream's sync id, transport and offer."""
    topology: Topology
    deltas: frozenset[tuple[int, int]] = frozenset()
    """The (source, receiver) pairs that travel as deltas (a fan-out stream's: all of them, or none)."""

    @property
    def src(self) -> int:
        return self.sources[0]

    @property
    def delta(self) -> bool:
        return bool(self.deltas)

    @property
    def fanout(self) -> Plan:
        """The bucket plan of a sync's one fan-out stream."""
        assert isinstance(self.topology, Fanout), "a sync of pairs has no fan-out stream"
        return self.topology.cut

    @property
    def pairs(self) -> ShardPlan:
        """The plan of a sync of pair streams."""
        assert isinstance(self.topology, Pairs), "a fan-out stream has no pairs"
        return self.topology.plan

    def feeding(self, me: int) -> list[int]:
        """The members whose streams reach receiver ``me``: sources, and receivers that forward to it."""
        return self.topology.feeding(me)

    def streams(
        self,
        me: int,
        sending: bool,
        bases: Bases | None,
        device: torch.device,
        base: torch.Tensor | None = None,
    ) -> list[Stream]:
        """This member's streams of the sync, as their source or receiver (see the topology's)."""
        return self.topology.streams(me, sending, bases, device, self.manifest, self.deltas, base)


Judge = Callable[[Session], Verdict]
"""A receiver's check of a sync, given the session as planned before the verdicts: its verdict."""


def sources_of(group: StatelessGroup, posts: list[Any], expected: int | None) -> list[int]:
    """The members that send this sync; a refusal by one of them raises here, on every member."""
    sources = [r for r, p in enumerate(posts) if isinstance(p, dict) and ("h" in p or "error" in p)]
    where = f"rank {group.rank} of group '{group.name}'"
    if not sources:
        raise WeightSyncError(
            f"{where}: no member sends this sync (every member takes part in every sync, as a sender or a "
            "receiver)"
        )
    for source in sources:
        post = posts[source]
        if "error" in post:
            kind = TransportUnavailableError if post.get("kind") == "transport" else WeightSyncError
            raise kind(f"rank {source} refused to send: {str(post['error'])[:4000]}")
    if expected is not None and sources != [expected]:
        raise WeightSyncError(
            f"{where}: rank(s) {', '.join(map(str, sources))} send this sync, but this "
            f"receiver takes from rank {expected} only (WeightReceiver(src=...))"
        )
    return sources


def is_sharded(posts: list[Any], sources: list[int]) -> bool:
    """The sync needs the many-source plan: several sources, boxes held, or boxes wanted."""
    return len(sources) > 1 or any(
        isinstance(p, dict) and ("boxes" in p or "rule" in p or "none" in p or "wants" in p) for p in posts
    )


def open_session(
    group: StatelessGroup,
    deadline: Deadline,
    memory: Posts,
    *,
    header: Header | None = None,
    boxes: dict[str, Any] | None = None,
    manifest: Manifest | None = None,
    in_place: bool = False,
    wants: dict[str, Any] | None = None,
    wants_if: str | None = None,
    seen: Callable[[str, bool], None] | None = None,
    src: int | None = None,
    judge: Judge | None = None,
    bases: Bases | None = None,
    plans: Plans | None = None,
    pays: Callable[[str], bool] | None = None,
) -> Session:
    """Steps 1 and 2 above, on every member. A source passes ``header``, ``boxes`` (of global tensors held),
    ``manifest`` and ``in_place`` (its tensors lie in the merged plan's layout); a receiver ``wants`` (unless
    every tensor whole; on condition ``wants_if``, see :func:`._sharded.conditional`), the ``src`` it expects
    and its ``judge``. ``seen(key, used)`` learns, before any check, the sources' key and whether the
    conditional wants hold. ``memory`` keeps the posts' layouts and the manifests (see :mod:`._posts`),
    ``plans`` the last pair plans, ``bases`` pair bases (of which a source offers those ``pays`` says travel
    as deltas).

    Raises:
        ManifestMismatchError: some receiver expects other tensors (the message lists every receiver's), or
            the sources announce different versions or do not fit together.
        TransportRefusedError: some receiver cannot attach to the transport.
        SyncRefusedError: some receiver refused the version.
    """
    me = group.rank
    dynamic: dict[str, Any] = {}
    sticky: dict[str, Any] = {}
    if header is not None:
        assert manifest is not None, "a source posts its manifest"
        dynamic["h"], sticky["hs"] = header_fields(header.to_wire())
        sticky["manifest"] = manifest.to_wire()
        sticky.update(boxes or {})
    elif wants is not None:
        sticky["wants"] = wants
        if wants_if is not None:
            sticky["wants_if"] = wants_if
    post = memory.post(dynamic, sticky)
    try:
        session = _settle(
            group,
            deadline,
            memory,
            post,
            me,
            header=header,
            manifest=manifest,
            in_place=in_place,
            wants=wants,
            seen=seen,
            src=src,
            judge=judge,
            bases=bases,
            plans=plans,
            pays=pays,
        )
    except BaseException:  # some member may not have read this post: the next one carries the layout
        memory.forget()
        raise
    memory.posted(post)  # every member posted its verdict, so every member read this post
    return session


def _settle(
    group: StatelessGroup,
    deadline: Deadline,
    memory: Posts,
    post: dict[str, Any],
    me: int,
    *,
    header: Header | None,
    manifest: Manifest | None,
    in_place: bool,
    wants: dict[str, Any] | None,
    seen: Callable[[str, bool], None] | None,
    src: int | None,
    judge: Judge | None,
    bases: Bases | None,
    plans: Plans | None,
    pays: Callable[[str], bool] | None,
) -> Session:
    """The rest of :func:`open_session` once this member's post is made: the gather, the plan, the
    verdicts."""
    posts = memory.read(group.all_gather_obj(post, timeout=deadline, by_field=True), me)
    sources = sources_of(group, posts, src)
    posts, key = conditional(posts, sources, keyed=seen is not None)
    if seen is not None and key is not None:  # a receiver learning its boxes: the key, before its check
        seen(key, wants is not None and isinstance(posts[me], dict) and "wants" in posts[me])
    headers = {s: Header.from_wire(header_of(posts[s])) for s in sources}
    manifests = {
        s: _manifest(memory, posts[s], headers[s], s, manifest if s == me else None) for s in sources
    }
    for m in manifests.values():
        memory.remember(m)
    lead = headers[sources[0]]
    versions = {s: h.version for s, h in headers.items()}
    if len(set(versions.values())) > 1:
        raise ManifestMismatchError(
            "the senders announce different versions: "
            + ", ".join(f"rank {s}: {v}" for s, v in sorted(versions.items()))
        )
    whole = manifests[sources[0]]
    plans = plans or Plans()
    topology: Topology
    problems: tuple[str, ...] = ()
    if is_sharded(posts, sources):
        plan, whole, keys = plan_pairs(posts, sources, headers, manifests, me, plans)
        topology, problems = Pairs(plan, keys), plan.problems
    else:
        topology = Fanout(sources[0], plans.whole(whole, lead.bucket_bytes, lead.solo_bytes))
    draft = Session(tuple(sources), lead, whole, headers, topology)
    if problems:  # only this member can see them: its verdict tells everyone
        problem = "the senders' and receivers' tensors do not fit together:\n" + "\n".join(problems)
        verdict = Verdict(problem, "manifest")
    else:
        verdict = judge(draft) if judge is not None else Verdict(in_place=in_place)
    mine: Mapping[tuple[int, int], str] = topology.keys if isinstance(topology, Pairs) else {}
    verdict = replace(verdict, held=holding(bases, mine, me, pays), fan=topology.fan(me))
    gathered = group.all_gather_obj(verdict.to_wire(), timeout=deadline)
    verdicts = [Verdict.from_wire(v, r) for r, v in enumerate(gathered)]
    merged, delta = conclude(lead, sources[0], verdicts)
    if isinstance(topology, Pairs):
        fans = {s: verdicts[s].fan for s in sources}
        return replace(
            draft, topology=replace(topology, fans=fans), deltas=pair_deltas(topology.plan, headers, verdicts)
        )
    receivers = [r for r in range(group.world_size) if r != sources[0]]
    if merged:
        draft = replace(draft, topology=Fanout(sources[0], plans.merged(whole)))
    return replace(draft, deltas=frozenset((sources[0], r) for r in receivers if delta))


def _manifest(memory: Posts, post: Any, header: Header, src: int, mine: Manifest | None) -> Manifest:
    """Source ``src``'s manifest (``mine`` on itself): decoded before (by its digest), or from its post,
    checked against the digest its header names."""
    known = mine or memory.known.get(header.digest)
    if known is not None:
        return known
    manifest = Manifest.from_wire(post.get("manifest"))
    if manifest.digest != header.digest:
        raise ProtocolError(f"rank {src}'s manifest does not match its header's digest")
    memory.remember(manifest)  # sources posting one manifest: decoded once
    return manifest


def conclude(header: Header, source: int, verdicts: list[Verdict]) -> tuple[bool, bool]:
    """Every member's same conclusion from the gathered verdicts (a pure function): (merged plan, delta).

    Raises:
        ManifestMismatchError: some receiver expects other tensors (takes precedence: nothing could move).
        TransportRefusedError: some receiver cannot attach to the transport.
        SyncRefusedError: some receiver refused for another reason (a stale version).
    """
    problems = [(r, v) for r, v in enumerate(verdicts) if v.problem is not None]
    if problems:
        text = "\n".join(f"rank {r}: {(v.problem or '')[:4000]}" for r, v in problems)
        kinds = {v.kind for _, v in problems}
        what = f"weight sync of version {header.version} refused before any bytes moved:\n{text}"
        if "manifest" in kinds:
            raise ManifestMismatchError(what)
        if "transport" in kinds:
            raise TransportRefusedError(what)
        holds = [v.holds for _, v in problems if v.kind == "stale" and v.holds is not None]
        raise SyncRefusedError(what, newest=max(holds) if holds else None)
    spec = TRANSPORTS.get(header.transport)
    merged = spec is not None and spec.cut_anywhere and all(v.in_place for v in verdicts)
    delta = header.base is not None and all(v.base for r, v in enumerate(verdicts) if r != source)
    return merged, delta


def refuse(group: StatelessGroup, reason: str, deadline: Deadline, kind: str = "input") -> None:
    """The source cannot make this sync: its handshake post says why, so every member raises, not waits."""
    group.all_gather_obj({"error": reason, "kind": kind}, timeout=deadline, by_field=True)


def committed(
    group: StatelessGroup,
    session: Session,
    deadline: Deadline,
    replicas: Mapping[str, str] | None = None,
    voted: Callable[[int], None] | None = None,
) -> list[int]:
    """A source's end of a sync it sent its part of: its :func:`vote` (``voted`` is told the version once it
    passed), then every receiver's acknowledgement; returns the receivers. Raises :class:`SyncRefusedError`
    when some receiver refused (the group is fine)."""
    version = session.header.version
    vote(group, version, None, deadline, replicas)
    if voted is not None:
        voted(version)
    receivers = [r for r in range(group.world_size) if r not in session.sources]
    acks = acknowledge(group, session.sources, None, deadline) or {}
    failures = []
    for r in receivers:
        ack = acks.get(r)
        if not isinstance(ack, dict) or ack.get("ok") is not True:
            error = ack.get("error") if isinstance(ack, dict) else repr(ack)[:200]
            failures.append(f"rank {r}: {error}")
    if failures:
        raise SyncRefusedError(f"version {version} was not applied everywhere:\n" + "\n".join(failures))
    return receivers


def acknowledge(
    group: StatelessGroup, sources: Sequence[int], ack: Any, deadline: Deadline | None = None
) -> dict[int, Any] | None:
    """Step 5's acknowledgements, one collective: every receiver posts its ``ack`` (returning once the store
    holds it, without waiting for the other receivers), every source of ``sources`` reads them all."""
    receivers = [r for r in range(group.world_size) if r not in sources]
    return group.gather_obj(ack, receivers, sources, deadline)


def vote(
    group: StatelessGroup, version: int, problem: str | None, deadline: Deadline,
    replicas: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    """Step 4: raise :class:`SyncRefusedError` on every member unless all succeeded (``problem``: why this
    member's part failed, or None). A source of a many-source sync adds ``replicas``, the digest of each
    replicated cell it holds (see ``ShardPlan.replicated``): holders' digests that differ fail the sync."""
    ballot: Any = problem if replicas is None else {"problem": problem, "replicas": dict(replicas)}
    votes = group.all_gather_obj(ballot, timeout=deadline)
    failed: list[tuple[int, str]] = []
    held: dict[str, dict[str, list[int]]] = {}
    for r, v in enumerate(votes):
        if isinstance(v, dict):
            cells = v.get("replicas")
            if (
                not isinstance(cells, dict)
                or len(cells) > 1 << 20
                or not all(isinstance(k, str) and isinstance(d, str) for k, d in cells.items())
            ):
                failed.append((r, "its vote is malformed"))
                continue
            for cell, digest in cells.items():
                held.setdefault(cell, {}).setdefault(digest, []).append(r)
            v = v.get("problem")
        if v is not None:
            failed.append((r, str(v)))
    for cell, digests in sorted(held.items()):
        if len(digests) > 1:
            who = "; ".join(f"rank(s) {', '.join(map(str, rs))} hold one copy" for rs in digests.values())
            failed.append((min(min(rs) for rs in digests.values()),
                           f"the sources' copies of {cell} differ ({who}): replicas that disagree are "
                           "refused, not mixed"))  # fmt: skip
    if failed:
        text = "\n".join(f"rank {r}: {v[:2000]}" for r, v in failed)
        raise SyncRefusedError(f"version {version} was not committed on any receiver:\n{text}")
