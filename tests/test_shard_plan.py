"""The many-source plan and ``gb.Shard``, in-process: who sends which box to whom, and every refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.weights._shard_plan import Held, ShardPlan, plan_shards
from groupbridge.weights.shard import Box

pytestmark = pytest.mark.timeout(30)


def _held(name: str, shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...],
          dtype: str = "float32") -> Held:  # fmt: skip
    return Held(name, dtype, shape, Box(offset, size))


def _rows(name: str, shape: tuple[int, int], parts: int, i: int) -> Held:
    step = shape[0] // parts
    return _held(name, shape, (step * i, 0), (step, shape[1]))


def _covered(plan: ShardPlan, dst: int, name: str) -> torch.Tensor:
    """How many times each element of ``name`` arrives at ``dst`` (from any source)."""
    count = torch.zeros(plan.global_shapes[name], dtype=torch.int32)
    for (_, d), cut in plan.pairs.items():
        if d != dst:
            continue
        for b in cut.buckets:
            for p in b:
                if p.name == name:
                    count[p.box.slices([0] * count.dim())] += 1
    return count


def test_row_shards_to_whole_and_column_receivers_every_element_exactly_once() -> None:
    shape = (12, 8)
    held = {s: [_rows("w", shape, 3, s), _held("b", (8,), (0,), (8,))] for s in range(3)}  # b: a replica
    wanted = {
        3: [_held("w", shape, (0, 0), shape), _held("b", (8,), (0,), (8,))],
        4: [_held("w", shape, (0, 4), (12, 4))],  # a tensor-parallel column half, spanning every source
    }
    plan = plan_shards(held, wanted, bucket_bytes=1 << 20)
    assert bool((_covered(plan, 3, "w") == 1).all()) and bool((_covered(plan, 3, "b") == 1).all())
    cols = _covered(plan, 4, "w")
    assert bool((cols[:, 4:] == 1).all()) and not cols[:, :4].any()
    assert {s for s, d in plan.pairs if d == 4} == {0, 1, 2}  # each source sends the rows it holds
    assert plan.order == ("w", "b")


def test_replicated_tensors_are_spread_over_their_holders() -> None:
    held = {s: [_held(f"t{i}", (64, 64), (0, 0), (64, 64)) for i in range(8)] for s in range(4)}
    wanted = {4: [_held(f"t{i}", (64, 64), (0, 0), (64, 64)) for i in range(8)]}
    plan = plan_shards(held, wanted, bucket_bytes=1 << 20)
    assert max(plan.sent.values()) <= 1.01 * min(plan.sent.values())
    assert sum(plan.sent.values()) == 8 * 64 * 64 * 4  # each byte once


def test_uneven_shards_and_buckets_cut_by_rows() -> None:
    shape = (10, 1000)
    held = {0: [_held("w", shape, (0, 0), (7, 1000))], 1: [_held("w", shape, (7, 0), (3, 1000))]}
    wanted = {2: [_held("w", shape, (0, 0), shape)]}
    plan = plan_shards(held, wanted, bucket_bytes=8192)  # two rows of 4000 bytes per bucket
    assert bool((_covered(plan, 2, "w") == 1).all())
    for cut in plan.pairs.values():
        for (start, end), b in zip(cut.bounds, cut.buckets, strict=True):
            assert end - start <= 8192 and all(p.offset % 16 == 0 for p in b)
    assert plan.sent == {0: 7 * 4000, 1: 3 * 4000}


@pytest.mark.parametrize(
    ("held", "wanted", "words"),
    [
        ({0: [_held("w", (4, 4), (0, 0), (2, 4))]}, {1: [_held("w", (4, 4), (0, 0), (4, 4))]},
         ["w", "[2, 0]", "no sender holds"]),
        ({0: [_held("w", (4, 4), (0, 0), (4, 4))], 1: [_held("w", (4, 8), (0, 0), (4, 8))]},
         {2: [_held("w", (4, 4), (0, 0), (4, 4))]}, ["w", "rank 1 holds", "[4, 8]"]),
        ({0: [_held("w", (4, 4), (0, 0), (4, 4))], 1: [_held("w", (4, 4), (0, 0), (4, 4), "bfloat16")]},
         {2: [_held("w", (4, 4), (0, 0), (4, 4))]}, ["w", "bfloat16"]),
        ({0: [_held("w", (4, 4), (3, 0), (2, 4))]}, {1: [_held("w", (4, 4), (0, 0), (4, 4))]},
         ["w", "outside"]),
        ({0: [_held("w", (4, 4), (0, 0), (4, 4))]}, {1: [_held("v", (4, 4), (0, 0), (4, 4))]},
         ["v", "no sender holds"]),
        ({0: [_held("w", (4, 4), (0, 0), (4, 4))]}, {1: [_held("w", (4, 4), (0, 0), (4, 4), "float16")]},
         ["w", "rank 1 expects float16"]),
    ],
    ids=["uncovered", "global-shapes-differ", "dtypes-differ", "outside", "unknown-name", "receiver-dtype"],
)  # fmt: skip
def test_every_refusal_names_the_tensor_and_the_box(held: dict, wanted: dict, words: list[str]) -> None:
    with pytest.raises(gb.ManifestMismatchError) as info:
        plan_shards(held, wanted, bucket_bytes=1 << 20)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_shard_checks_its_box_at_once() -> None:
    t = torch.zeros(2, 3)
    s = gb.Shard(t, (4, 3), (2, 0))
    assert s.box == Box((2, 0), (2, 3)) and not s.whole
    with pytest.raises(ValueError, match="outside"):
        gb.Shard(t, (4, 3), (3, 0))
    with pytest.raises(ValueError, match="2-d tensor"):
        gb.Shard(t, (4, 3, 1), (0, 0, 0))
    with pytest.raises(TypeError):
        gb.Shard(t, (4.0, 3), (0, 0))  # type: ignore[arg-type]


def test_a_source_s_buckets_stay_within_what_its_transport_reserved() -> None:
    """A pair can carry more bytes than its source reserved per box (pieces aligned to 16 bytes, a box that
    others partly hold cut into several pieces): each source's cap, announced before the plan is known,
    bounds its buckets, and one row (which cannot be cut) never exceeds it when the cap is at least a row."""
    shape = (48, 64)
    v, b = _held("v", (8, 64), (0, 0), (8, 64)), _held("b", (5,), (0,), (5,))
    held = {s: [_rows("w", shape, 3, s), *([v] if s < 2 else []), b] for s in range(3)}
    wanted = {
        3: [
            _held("w", shape, (0, 0), shape),
            _held("b", (5,), (0,), (5,)),
            _held("v", (8, 64), (0, 0), (8, 64)),
        ]
    }
    caps = {s: sum(-(-h.box.numel * 4 // 16) * 16 for h in held[s]) for s in held}  # as a sender reserves
    plan = plan_shards(held, wanted, bucket_bytes=1 << 20, caps=caps)
    for (src, _), cut in plan.pairs.items():
        assert cut.bucket_bytes <= caps[src], (src, cut.bounds)
    for name in ("w", "b", "v"):
        assert bool((_covered(plan, 3, name) == 1).all()), name


def _random_layout(seed: int) -> tuple[dict[int, list[Held]], dict[int, list[Held]]]:
    """Sources holding row slices, column slices, overlapping slices and replicas of three tensors, and
    receivers (some posting one shared layout, as replicas do) wanting whole tensors and tensor-parallel
    blocks."""
    g = torch.Generator().manual_seed(seed)

    def cuts(n: int, parts: int) -> list[int]:
        inner = sorted(torch.randperm(n - 1, generator=g)[: parts - 1].add(1).tolist())
        return [0, *inner, n]

    shapes = {"a": (12, 10), "b": (9,), "c": (6, 8)}
    sources = int(torch.randint(2, 5, (1,), generator=g))
    held: dict[int, list[Held]] = {s: [] for s in range(sources)}
    for name, shape in shapes.items():
        dim = int(torch.randint(0, len(shape), (1,), generator=g))
        edges = cuts(shape[dim], min(sources, shape[dim]))
        for s in range(sources):
            i = s % (len(edges) - 1)
            lo, hi = edges[i], edges[i + 1]
            if s == sources - 1 and shape[dim] > 2:  # an overlap with its neighbour
                lo = max(0, lo - 1)
            offset = tuple(lo if d == dim else 0 for d in range(len(shape)))
            size = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
            held[s].append(_held(name, shape, offset, size))
    shared: list[Held] = []
    wanted: dict[int, list[Held]] = {}
    for r in range(sources, sources + 4):
        if r >= sources + 2 and shared:
            wanted[r] = shared  # one layout, two receivers
            continue
        mine = []
        for name, shape in shapes.items():
            dim = int(torch.randint(0, len(shape), (1,), generator=g))
            edges = cuts(shape[dim], 2)
            i = r % 2
            offset = tuple(edges[i] if d == dim else 0 for d in range(len(shape)))
            size = tuple(edges[i + 1] - edges[i] if d == dim else n for d, n in enumerate(shape))
            mine.append(_held(name, shape, offset, size))
        wanted[r] = mine
        if not shared:
            shared = mine
    return held, wanted


@pytest.mark.parametrize("seed", range(40))
def test_each_member_s_share_agrees_with_its_peers_and_covers_every_wanted_element_once(seed: int) -> None:
    held, wanted = _random_layout(seed)
    shares = {
        m: plan_shards(held, wanted, bucket_bytes=96, forward=frozenset(held), me=m) for m in (*held, *wanted)
    }
    merged = plan_shards(held, wanted, bucket_bytes=96, forward=frozenset(held))
    for (src, dst), cut in merged.pairs.items():
        assert shares[src].pairs[(src, dst)] == cut == shares[dst].pairs[(src, dst)]
        assert shares[src].feeder(src, dst) == shares[dst].feeder(src, dst)
    for dst, wants in wanted.items():
        assert {p for p in shares[dst].pairs if p[1] == dst} == {p for p in merged.pairs if p[1] == dst}
        for w in wants:
            count = _covered(merged, dst, w.name)[w.box.slices([0] * len(w.global_shape))]
            assert bool((count == 1).all()), (dst, w.name)
    for s in held:  # each replicated region is named alike by its holders
        for name, region, holders in shares[s].replicated:
            for other in holders:
                assert any(n == name and b == region for n, b, _ in shares[other].replicated)


@pytest.mark.parametrize("size", [1, 5, 7, 64, 100, 576, 7168])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 48, 256])
def test_a_torch_chunk_piece_is_found_as_a_rule_and_rebuilt_exactly(size: int, parts: int) -> None:
    from groupbridge.weights._rules import _piece, chunk_range

    start = 0
    for piece in torch.arange(size).chunk(parts):
        found = _piece(size, start, len(piece))
        assert found is not None, (size, parts, start, len(piece))
        assert chunk_range(size, *found) == (start, len(piece))
        start += len(piece)


def _fsdp_rules(sources: int, receivers: int) -> tuple[Any, Any, Any]:
    """Sources holding torch.chunk pieces (rows of ``w``, rows then columns of the expert-like ``e``, ``b``
    whole on every source), as explicit lists and as rule families; receivers take tensor-parallel
    blocks."""
    from groupbridge.weights import _rules
    from groupbridge.weights.manifest import Entry, Manifest

    shapes = {"w": (50, 6), "e": (4, 9, 6), "b": (7,)}
    held, families = {}, {}
    for s in range(sources):
        shards = {}
        for name, g in shapes.items():
            offset, size = [0] * len(g), list(g)
            if name == "w":
                offset[0], size[0] = _rules.chunk_range(g[0], sources, s)
            if name == "e":
                offset[0], size[0] = _rules.chunk_range(g[0], 2, s % 2)
                offset[1], size[1] = _rules.chunk_range(g[1], -(-sources // 2), s // 2)
            shards[name] = (g, tuple(offset), tuple(size))
        manifest = Manifest(
            tuple(Entry(n, sz, "float32", "float32", None) for n, (_, _, sz) in shards.items())
        )
        held[s] = [_held(n, g, o, sz) for n, (g, o, sz) in shards.items()]
        boxes, rule, at, _ = _rules.compress({n: (g, o) for n, (g, o, _) in shards.items()}, manifest)
        fam = families.setdefault(repr(rule), _rules.family_of(manifest, rule, s))
        fam.at[s] = _rules.place_of(at, fam, s)
        explicit = [h for h in held[s] if boxes and h.name in boxes]
        families[("explicit", s)] = explicit
    wanted = {}
    for r in range(sources, sources + receivers):
        k = (r - sources) % 2
        wanted[r] = [
            _held("w", shapes["w"], (0, 3 * k), (50, 3)),
            _held("e", shapes["e"], (2 * k, 0, 0), (2, 9, 6)),
            _held("b", shapes["b"], (0,), (7,)),
        ]
    fams = [f for k, f in families.items() if not isinstance(k, tuple)]
    listed = {s: families[("explicit", s)] for s in range(sources)}
    return held, (listed, fams), wanted


@pytest.mark.parametrize(("sources", "receivers"), [(2, 2), (5, 3), (8, 4)])
def test_sources_posting_a_rule_are_planned_as_their_boxes_would_be(sources: int, receivers: int) -> None:
    held, (listed, families), wanted = _fsdp_rules(sources, receivers)
    for m in range(sources + receivers):
        boxes = plan_shards(held, wanted, bucket_bytes=256, forward=frozenset(held), me=m)
        ruled = plan_shards(
            listed, wanted, bucket_bytes=256, forward=frozenset(held), me=m, families=families
        )
        assert boxes.pairs == ruled.pairs and boxes.upstream == ruled.upstream, m
        assert sorted(boxes.replicated, key=repr) == sorted(ruled.replicated, key=repr), m


def test_a_hostile_rule_costs_its_places_not_its_indices_and_a_malformed_one_is_a_protocol_error() -> None:
    """A rule that claims 2^30 pieces per dimension of a tensor of 2^40 rows, with one place posted, is
    read in the places posted (not 2^60 indices); a rule naming a list is refused as malformed."""
    from groupbridge.weights import _rules
    from groupbridge.weights.manifest import Entry, Manifest

    manifest = Manifest((Entry("w", (1024, 1024), "float32", "float32", None),))
    family = _rules.family_of(manifest, {f"{1 << 30},{1 << 30}": [["w", [1 << 40, 1 << 40]]]}, 0)
    family.at[0] = _rules.place_of({f"{1 << 30},{1 << 30}": [5, 7]}, family, 0)
    found = family.overlapping("w", Box((0, 0), (1 << 40, 1 << 40)))
    assert [(b.offset, ranks) for b, ranks, _ in found] == [((5 << 10, 7 << 10), (0,))]
    with pytest.raises(gb.ProtocolError, match="malformed"):
        _rules.family_of(manifest, {"4": [[["w"], [8]]]}, 3)


def test_a_source_past_a_tensor_s_last_piece_posts_it_as_none_and_is_planned_as_its_empty_box() -> None:
    """At 8 FSDP ranks a norm of 3 values leaves ranks 3-7 with nothing of it: they name it in one list
    (not a box each), share one list of what they hold, and the plan is the one their empty boxes give;
    a source saying it holds none of a tensor its manifest lists with elements is refused."""
    from groupbridge.weights import _rules, _sharded
    from groupbridge.weights._header import Header
    from groupbridge.weights.manifest import Entry, Manifest

    shapes, sources = {"w": (50, 6), "n": (3,)}, 8
    posts, headers, manifests, held = [], {}, {}, {}
    for s in range(sources):
        shards = {
            n: (g, (_rules.chunk_range(g[0], sources, s)[0], *[0] * (len(g) - 1))) for n, g in shapes.items()
        }
        size = {n: (_rules.chunk_range(g[0], sources, s)[1], *g[1:]) for n, g in shapes.items()}
        manifests[s] = Manifest(tuple(Entry(n, size[n], "float32", "float32", None) for n in shapes))
        headers[s] = Header(
            1, manifests[s].digest, 256, 256, "p2p", "", 0, f"{s:012x}", {}, {}, bucket_cap=256
        )
        posts.append(_sharded.boxes_of(shards, manifests[s]))
        held[s] = [_held(n, g, shards[n][1], size[n]) for n, g in shapes.items()]
    assert [p.get("none") for p in posts] == [None] * 3 + [["n"]] * 5
    assert not any("boxes" in p for p in posts)
    wanted = {
        r: [_held("w", shapes["w"], (0, 3 * (r % 2)), (50, 3)), _held("n", (3,), (0,), (3,))]
        for r in range(sources, sources + 2)
    }
    listed, families = _sharded._sources(posts, list(range(sources)), headers, manifests)
    assert all(listed[s] is listed[3] for s in range(3, 7))  # rank 7 holds a shorter last piece of w
    for m in range(sources + 2):
        boxes = plan_shards(held, wanted, bucket_bytes=256, forward=frozenset(held), me=m)
        ruled = plan_shards(
            listed, wanted, bucket_bytes=256, forward=frozenset(held), me=m, families=families
        )
        assert boxes.pairs == ruled.pairs and boxes.upstream == ruled.upstream, m
    for none, words in ((["w"], "holds none of 'w'"), ("n", "malformed"), (["n", "x"], "holds none of 'x'")):
        bad = [*posts[:7], {**posts[7], "none": none}]
        with pytest.raises(gb.ProtocolError, match=words):
            _sharded._sources(bad, list(range(sources)), headers, manifests)
    # sources 3-7 alone (a source rank too few): nobody holds n, which is refused, not dropped from the plan
    late = list(range(3, sources))
    held_late, fams = _sharded._sources(posts, late, headers, manifests)
    with pytest.raises(gb.ManifestMismatchError, match=r"no sender holds 'n'"):
        _sharded._none_held_by_nobody(posts, late, _sharded._union(held_late, fams))
    _sharded._none_held_by_nobody(posts, list(range(sources)), _sharded._union(listed, families))
