"""The plan of a sync of pair streams (several sources, or boxes held or wanted), for the one session
(:mod:`._session`: handshake, verdicts, vote, commit): what each source holds and each receiver wants, read
from the handshake's posts, and each member's share of the :class:`._shard_plan.ShardPlan` (a problem every
member sees refuses the sync before any byte moves; one only a receiver sees, through its verdict). A
member's streams of a sync, pairs or the fan-out, are :mod:`._streams`'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import codec
from ..errors import ManifestMismatchError, ProtocolError
from ._header import Header, Verdict
from ._posts import header_of
from ._rules import Family, compress, family_of, place_of
from ._shard_plan import Held, ShardPlan, plan_shards
from ._sharded_delta import Bases, pair_key
from .manifest import Entry, Manifest
from .plan import Plans
from .shard import Box
from .transports import pair_transport

Slot = tuple[torch.Tensor, Box]
"""Where a tensor's box lives on this member: (the tensor holding it, the box of the global tensor)."""


def boxes_of(
    shards: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]], manifest: Manifest
) -> dict[str, Any]:
    """A source's post of the boxes it holds: ``torch.chunk`` pieces as a rule and its place in it, others
    as their global shape and offset, and the tensors it holds none of (see :mod:`._rules`); nothing where it
    holds whole tensors."""
    boxes, rule, at, none = compress(shards, manifest)
    fields = (("boxes", boxes), ("rule", rule), ("at", at), ("none", none))
    return {k: v for k, v in fields if v is not None}


def _held(
    manifest: Manifest, boxes: Any, src: int, ruled: frozenset[str] = frozenset(), none: Any = None
) -> list[Held]:
    """What a source lists: its boxes, whole tensors where it names none (those of its rule, and those it
    holds nothing of, aside)."""
    if boxes is None:
        boxes = {}
    if not isinstance(boxes, dict):
        raise ProtocolError(f"rank {src}'s boxes are malformed")
    skip = ruled | _none(manifest, none, src, boxes, ruled)
    out = []
    for e in manifest.entries:
        if e.name in skip:
            continue
        box = boxes.get(e.name)
        if box is None:
            out.append(Held(e.name, e.wire_dtype, e.shape, Box((0,) * len(e.shape), e.shape)))
            continue
        g, o = _ints(box, 0, src), _ints(box, 1, src)
        if len(g) != len(e.shape) or len(o) != len(e.shape):
            raise ProtocolError(f"rank {src}'s box of {e.name} has the wrong number of dimensions")
        out.append(Held(e.name, e.wire_dtype, g, Box(o, e.shape)))
    return out


def _none(
    manifest: Manifest, none: Any, src: int, boxes: dict[str, Any], ruled: frozenset[str]
) -> frozenset[str]:
    """The tensors a source says it holds nothing of (checked as hostile: each in its manifest with no
    element there, and neither in its boxes nor in its rule)."""
    if none is None:
        return frozenset()
    if not isinstance(none, list) or not all(isinstance(n, str) for n in none):
        raise ProtocolError(f"rank {src}'s list of tensors it holds none of is malformed")
    names = frozenset(none)
    shapes = {e.name: e.shape for e in manifest.entries}
    for name in names:
        if name not in shapes or all(shapes[name]) or name in boxes or name in ruled:  # all: no 0 dim
            raise ProtocolError(
                f"rank {src} says it holds none of {name!r}, which its manifest does not list empty or "
                "its boxes list as held"
            )
    return names


def _ints(box: Any, i: int, src: int) -> tuple[int, ...]:
    v = box[i] if isinstance(box, list) and len(box) == 2 else None
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x < 1 << 62 for x in v) or len(v) > 16:
        raise ProtocolError(f"rank {src} sent a malformed box")
    return tuple(v)


def sources_key(posts: list[Any], sources: list[int], headers: Mapping[int, Header]) -> str:
    """What the sources hold in this sync (each one's manifest and boxes), as one key: a receiver that
    learned which boxes it reads (a tensor-parallel engine worker, from its loader's dry run) posts them on
    the condition that this key is unchanged, since they were learned from these manifests."""
    held = [(s, headers[s].digest, posts[s].get("g")) for s in sources]
    return hashlib.sha256(json.dumps(held).encode()).hexdigest()[:32]


def conditional(posts: list[Any], sources: list[int], *, keyed: bool = False) -> tuple[list[Any], str | None]:
    """The posts with each receiver's conditional wants (``wants_if``) dropped where they do not hold, alike
    on every member (a pure function of the gathered posts), and the sources' key (computed when some post
    is conditional, or ``keyed``). They hold when the sources hold what the receiver learned its boxes from
    (the key is the same) and this sync's pairs travel as well as whole tensors would: it has several
    sources or boxes already, or its transport carries pairs itself (``shm``). Otherwise (one source
    broadcasting, relaying, or over CUDA IPC) boxes would move the sync to per-receiver streams that cost
    more than the bytes they save."""
    if not keyed and not any(isinstance(p, dict) and "wants_if" in p for p in posts):
        return posts, None
    headers = {s: Header.from_wire(header_of(posts[s])) for s in sources}
    key = sources_key(posts, sources, headers)
    carried = all(_carrier(h) == h.transport for h in headers.values())
    sharded = len(sources) > 1 or any(
        isinstance(p, dict)
        and ("boxes" in p or "rule" in p or "none" in p or ("wants" in p and "wants_if" not in p))
        for p in posts
    )
    out = []
    for p in posts:
        if isinstance(p, dict) and "wants_if" in p and (p["wants_if"] != key or not (sharded or carried)):
            p = {k: v for k, v in p.items() if k not in ("wants", "wants_if")}  # every tensor, whole
        out.append(p)
    return out, key


def _wanted(post: Any, every: list[Held], dst: int) -> list[Held]:
    wants = post.get("wants") if isinstance(post, dict) else None
    if wants is None:  # every tensor, whole
        return [Held(h.name, h.dtype, h.global_shape, Box((0,) * len(h.global_shape), h.global_shape))
                for h in every]  # fmt: skip
    if not isinstance(wants, dict) or len(wants) > 1 << 20:
        raise ProtocolError(f"rank {dst}'s wants are malformed")
    out = []
    for name, w in wants.items():
        if not (isinstance(w, list) and len(w) == 4 and isinstance(w[0], str)):
            raise ProtocolError(f"rank {dst}'s want of {name!r} is malformed")
        shape, offset, size = _ints(w[1:3], 0, dst), _ints(w[1:3], 1, dst), _ints(w[2:4], 1, dst)
        if not len(shape) == len(offset) == len(size):
            raise ProtocolError(f"rank {dst}'s want of {name!r}: its offset and shapes differ in length")
        out.append(Held(str(name), w[0], shape, Box(offset, size)))
    return out


def plan_pairs(
    posts: list[Any], sources: list[int], headers: Mapping[int, Header], manifests: Mapping[int, Manifest],
    me: int, plans: Plans | None,
) -> Planned:  # fmt: skip
    """Step 2's plan of a sync of pair streams (see :mod:`._shard_plan`), the global manifest it assembles
    and this member's pairs' cut keys; ``plans`` keeps the last plan for the next sync."""

    def planned() -> Planned:
        held, families = _sources(posts, sources, headers, manifests)
        every = _union(held, families)
        _none_held_by_nobody(posts, sources, every)
        # receivers that post one layout (its digest is the same on every member) share one list, planned
        # once (see plan_shards)
        layouts: dict[Any, list[Held]] = {}
        wanted = {}
        for r, p in enumerate(posts):
            if r not in sources:
                key = (p.get("g"), "wants" in p) if isinstance(p, dict) else r
                if key not in layouts:
                    layouts[key] = _wanted(p, every, r)
                wanted[r] = layouts[key]
        caps = {s: headers[s].bucket_cap for s in sources}
        forward = frozenset(s for s in sources if _forwards(headers[s]))
        order = dict.fromkeys(
            e.name for m in {manifests[s].digest: manifests[s] for s in sources}.values() for e in m.entries
        )
        plan = plan_shards(
            held, wanted, headers[sources[0]].bucket_bytes, caps, forward, me, families, list(order)
        )
        whole = Manifest(tuple(Entry(n, plan.global_shapes[n], plan.dtypes[n], plan.dtypes[n], None)
                               for n in plan.order))  # fmt: skip
        keys: dict[int, str] = {}  # receivers of one group share one cut: its key is worked out once
        return (
            plan,
            whole,
            {
                pair: keys.get(id(cut)) or keys.setdefault(id(cut), pair_key(cut))
                for pair, cut in plan.pairs.items()
                if me in pair
            },
        )

    return plans.get(_layout_key(posts, sources, me), planned) if plans else planned()


def holding(
    bases: Bases | None,
    keys: Mapping[tuple[int, int], str],
    me: int,
    pays: Callable[[str], bool] | None = None,
) -> tuple[tuple[int, int], ...]:
    """(peer, version) of every pair base this member holds for its pairs' cuts; a source leaves out those
    its policy would send whole this sync (``pays``: see ``Policy.pays``), so that they travel whole."""
    if bases is None:
        return ()
    held = ((dst if src == me else src, key) for (src, dst), key in keys.items() if pays is None or pays(key))
    return tuple((peer, v) for peer, key in held if (v := bases.held(peer, key)) is not None)


def pair_deltas(
    plan: ShardPlan, headers: Mapping[int, Header], verdicts: Sequence[Verdict]
) -> frozenset[tuple[int, int]]:
    """This member's pairs that travel as deltas: the source's policy allows it and both ends hold the same
    base; a forwarded cut only when every receiver along it does (each passes on what it took)."""
    holds: dict[int, dict[int, int]] = {}

    def delta(s: int, r: int) -> bool:
        for m in (s, r):
            if m not in holds:
                holds[m] = dict(verdicts[m].held)
        return headers[s].pair_deltas and holds[s].get(r) is not None and holds[s].get(r) == holds[r].get(s)

    return frozenset(pair for pair in plan.pairs if all(delta(*p) for p in plan.chain(*pair)))


Planned = tuple[ShardPlan, Manifest, dict[tuple[int, int], str]]
"""A many-source plan, the global manifest it assembles, and this member's pairs' cut keys."""


def _layout_key(posts: list[Any], sources: list[int], me: int) -> bytes:
    """What a plan depends on: every member's layout (its digest: the static header with the bucket size,
    the manifest, the boxes held or wanted; see :mod:`._posts`), whose wants hold, and who asks."""
    layout = [me, sources, [(p.get("g"), "wants" in p) if isinstance(p, dict) else None for p in posts]]
    return hashlib.sha256(json.dumps(layout).encode()).digest()


def _forwards(header: Header) -> bool:
    """Whether this source's pairs may be forwarded by receivers: its sender allows it and they cross hosts
    point to point."""
    return header.forward and _carrier(header) == "p2p"


def _carrier(header: Header) -> str | None:
    """What carries this source's pairs (``pair_transport``); None for a transport this member does not
    know (the handshake refuses it later)."""
    try:
        return pair_transport(header.transport)
    except Exception:
        return None


def _sources(
    posts: list[Any], sources: list[int], headers: Mapping[int, Header], manifests: Mapping[int, Manifest]
) -> tuple[dict[int, list[Held]], list[Family]]:
    """What each source holds: the boxes it lists, and the families of those whose boxes are a rule (the
    sources that post one rule over one manifest; see :mod:`._rules`)."""
    lists: dict[Any, list[Held]] = {}
    families: dict[tuple[str, str | None], Family] = {}
    names: dict[int, frozenset[str]] = {}  # each family's tensors
    digests: dict[int, str] = {}  # a value posted alike is one object: digested once
    held = {}
    for s in sources:
        post, ruled = posts[s], frozenset[str]()
        rule = post.get("rule")
        if rule is not None:
            key = (headers[s].digest, _id_digest(rule, digests))
            if key not in families:
                families[key] = family_of(manifests[s], rule, s)
            family = families[key]
            family.at[s] = place_of(post.get("at"), family, s)
            ruled = names.get(id(family)) or names.setdefault(id(family), frozenset(family.tensors))
        # what a source lists depends on its manifest, boxes, rule and tensors held none of: the ranks that
        # post them alike (past a tensor's end, or holding no box outside their rule) share one list
        boxes, none = post.get("boxes"), post.get("none")
        layout = (headers[s].digest, *(_id_digest(v, digests) for v in (boxes, rule, none)))
        if layout not in lists:
            lists[layout] = _held(manifests[s], boxes, s, ruled, none)
        held[s] = lists[layout]
    return held, list(families.values())


def _none_held_by_nobody(posts: list[Any], sources: list[int], every: list[Held]) -> None:
    """Refuse a tensor every source says it holds none of (a list of names carries no global shape, so it
    would vanish from the plan instead of being refused as held by no sender)."""
    lists = {id(n): n for s in sources if isinstance(n := posts[s].get("none"), list)}  # checked in _held
    if not lists:
        return
    known = {h.name for h in every}
    nobody = sorted({name for names in lists.values() for name in names} - known)
    if nobody:
        raise ManifestMismatchError(
            f"no sender holds {', '.join(map(repr, nobody[:20]))}: every source says it holds none of "
            f"{'it' if len(nobody) == 1 else 'them'} (too few source ranks, or a layout that leaves it out)"
        )


def _id_digest(value: Any, digests: dict[int, str]) -> str | None:
    """``value``'s digest, worked out once per object (the gather decodes a value posted alike once)."""
    if value is None:
        return None
    return digests.get(id(value)) or digests.setdefault(id(value), _digest(value))


def _digest(value: Any) -> str:
    return hashlib.sha256(codec.encode(value)).hexdigest()


def _union(held: Mapping[int, list[Held]], families: list[Family]) -> list[Held]:
    """One of every tensor the sources hold, with its global shape and dtype."""
    seen: dict[str, Held] = {}
    ruled = {rank: f for f in families for rank in f.at}
    done: set[int] = set()  # each list and each family read once
    for s in sorted({*held, *ruled}):
        for layout in (held.get(s, ()), ruled.get(s)):
            if layout is None or id(layout) in done:
                continue
            done.add(id(layout))
            if isinstance(layout, Family):
                for name, (_, g, dtype) in layout.tensors.items():
                    seen.setdefault(name, Held(name, dtype, g, Box((0,) * len(g), g)))
            else:
                for h in layout:
                    seen.setdefault(h.name, h)
    return list(seen.values())
