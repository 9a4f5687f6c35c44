"""The receive appliers, in-process: buckets packed here are fed as a transport would deliver them.

Each rule of a receive mode (where bytes land, what is yielded, what commit does, what a failure midway
leaves) is checked in milliseconds, without processes; multi-process tests check the modes end to end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import groupbridge as gb
from groupbridge.weights import _bytes, _delta
from groupbridge.weights._appliers import Applier, Ring, Scratch, Staged, Streaming, counts
from groupbridge.weights._copier import Copier
from groupbridge.weights._intake import _kept
from groupbridge.weights.manifest import Manifest
from groupbridge.weights.plan import Plan

pytestmark = pytest.mark.timeout(30)

BUCKET = 4096


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3000, generator=g),  # 12000 bytes: spans buckets
        "w": torch.randn(64, 8, generator=g).to(torch.bfloat16),
        "b": torch.randn(8, generator=g),
        "empty": torch.empty(0),
        "small": torch.arange(5, dtype=torch.int32) + seed,
    }


@pytest.fixture
def copier() -> Copier:
    c = Copier("test")
    yield c
    c.close()


def _setup(model: dict[str, torch.Tensor]) -> tuple[Manifest, Plan, list[torch.Tensor]]:
    manifest = Manifest.build(list(model.items()))
    plan = Plan.build(manifest, BUCKET, BUCKET)
    return manifest, plan, list(model.values())


def _packed(plan: Plan, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for k in range(len(plan.buckets)):
        start, end = plan.bucket_range(k)
        view = torch.empty(end - start, dtype=torch.uint8)
        _bytes.pack(view, plan.buckets[k], tensors)
        out.append(view)
    return out


def _deliver(applier: Applier, plan: Plan, buckets: list[torch.Tensor], upto: int | None = None) -> list:
    """What the receiver's stream does with each bucket of a full sync: land it, then hand it over."""
    pairs = []
    for k, data in enumerate(buckets[:upto]):
        landed = applier.land(k)
        landed.view.copy_(data)
        pairs += applier.landed(plan.buckets[k], landed.view, landed.in_place)
    return pairs


def _names(manifest: Manifest):  # type: ignore[no-untyped-def]
    return lambda i: manifest.entries[i].name


def _ring() -> Ring:
    return Ring(_bytes.BufferCache(), torch.device("cpu"))


def _staged(manifest: Manifest, plan: Plan, buffer: torch.Tensor, copier: Copier, **kwargs: Any) -> Staged:
    slots, parts = _kept(buffer, plan, manifest), counts(plan.buckets)
    return Staged(copier, _names(manifest), parts, slots, buffer=buffer, plan=plan, ring=_ring(), **kwargs)


def _streaming(manifest: Manifest, plan: Plan, dest: list[torch.Tensor], copier: Copier) -> Streaming:
    own = {i: (d, None) for i, d in enumerate(dest)}
    return Streaming(copier, _names(manifest), counts(plan.buckets), own, flat=dest, plan=plan, ring=_ring())


def test_staged_commits_only_at_the_end_and_a_failure_leaves_the_target_untouched(copier: Copier) -> None:
    new, old = _model(1), _model(2)
    manifest, plan, tensors = _setup(new)
    target = {k: v.clone() for k, v in old.items()}
    dest = list(target.values())
    buffer = torch.empty(plan.total_bytes, dtype=torch.uint8)
    applier = _staged(manifest, plan, buffer, copier, dest=[(i, d, f"t{i}") for i, d in enumerate(dest)])
    assert _deliver(applier, plan, _packed(plan, tensors)) == []  # atomic: nothing yielded
    assert all(torch.equal(target[k], old[k]) for k in old)  # every byte landed, none in the target yet
    err = applier.failed(RuntimeError("link cut"), version=3, held=2)
    assert isinstance(err, gb.WeightSyncError) and not isinstance(err, gb.TornUpdateError)
    assert "untouched" in str(err) and "still 2" in str(err)
    applier.commit()
    assert all(torch.equal(target[k], new[k]) for k in new)


def test_staged_commit_of_a_delta_copies_only_the_changed_tensors(copier: Copier) -> None:
    model = _model(1)
    manifest, plan, tensors = _setup(model)
    buffer = torch.empty(plan.total_bytes, dtype=torch.uint8)
    for k, data in enumerate(_packed(plan, tensors)):
        s, e = plan.bucket_range(k)
        buffer[s:e].copy_(data)  # the version held
    changed = dict(model)
    changed["b"] = model["b"] + 1
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    applier = _staged(
        manifest,
        plan,
        buffer,
        copier,
        dest=[(i, d, n) for i, (n, d) in enumerate(target.items())],
        only_changed=True,
    )
    new = _packed(plan, list(changed.values()))
    for k in range(len(plan.buckets)):  # as the delta stream applies a bucket: to the held bytes
        held = applier.held(k)
        enc = _delta.encode(new[k], held.clone(), 4)
        if enc.count == 0:
            continue
        payload = enc.payload if enc.payload is not None else new[k]
        pos = _delta.apply(held, payload, enc.code, enc.count, 4)
        applier.write_back(k, held)
        segs = plan.buckets[k]
        hit = _delta.spans_hit(pos, [(s.bucket_offset, s.nbytes) for s in segs], 4)
        applier.landed(segs, held, True, {s.index for s, h in zip(segs, hit, strict=True) if h})
    applier.commit()
    assert torch.equal(target["b"], changed["b"])
    assert not target["big"].any() and not target["w"].any()  # unchanged: not copied again


def test_streaming_names_what_a_failure_midway_left_torn(copier: Copier) -> None:
    new, old = _model(1), _model(2)
    manifest, plan, tensors = _setup(new)
    target = {k: v.clone() for k, v in old.items()}
    applier = _streaming(manifest, plan, list(target.values()), copier)
    _deliver(applier, plan, _packed(plan, tensors), upto=2)
    assert applier.written == ["big"]  # the first two buckets hold part of "big" only
    err = applier.failed(RuntimeError("link cut"), version=3, held=2)
    assert isinstance(err, gb.TornUpdateError) and err.written == ["big"]
    assert "TORN" in str(err) and "big" in str(err) and "still 2" in str(err)
    assert not torch.equal(target["big"], old["big"]) and torch.equal(target["b"], old["b"])


def test_streaming_lands_in_place_in_a_flattened_target(copier: Copier) -> None:
    new = _model(1)
    manifest, plan, tensors = _setup(new)
    target = {k: torch.zeros_like(v) for k, v in new.items()}
    gb.flatten_(target)
    applier = _streaming(manifest, plan, list(target.values()), copier)
    assert all(applier.land(k).in_place for k in range(len(plan.buckets)))
    _deliver(applier, plan, _packed(plan, tensors))
    applier.commit()
    assert all(torch.equal(target[k], new[k]) for k in new)


def test_streaming_into_a_flattened_target_is_torn_once_a_bucket_is_landing_there(copier: Copier) -> None:
    """The transport writes a bucket landing in place before the applier counts it: a failure then says
    the target is torn, naming the bucket's tensors, never that it is untouched."""
    new = _model(1)
    manifest, plan, _ = _setup(new)
    target = {k: torch.zeros_like(v) for k, v in new.items()}
    gb.flatten_(target)
    applier = _streaming(manifest, plan, list(target.values()), copier)
    assert applier.land(0).in_place  # the transport is told to write into "big" itself
    err = applier.failed(RuntimeError("link cut"), version=3, held=2)
    assert isinstance(err, gb.TornUpdateError) and err.written == ["big"], err


def test_scratch_yields_every_tensor_once_assembling_those_that_span_buckets(copier: Copier) -> None:
    new = _model(1)
    manifest, plan, tensors = _setup(new)

    def spec(i: int) -> tuple[torch.dtype, tuple[int, ...], None]:
        return tensors[i].dtype, tuple(tensors[i].shape), None

    parts = counts(plan.buckets)
    applier = Scratch(copier, _names(manifest), parts, spec, torch.device("cpu"), views=True, plan=plan,
                      ring=_ring())  # fmt: skip
    got = {}
    for k, data in enumerate(_packed(plan, tensors)):
        landed = applier.land(k)
        landed.view.copy_(data)
        for i, t in applier.landed(plan.buckets[k], landed.view, False):
            got[manifest.entries[i].name] = t.clone()  # a view of the ring: valid until the next bucket
    assert sorted(got) == sorted(k for k, v in new.items() if v.numel())
    assert all(torch.equal(got[k], new[k]) for k in got)


def test_staged_receive_yields_views_of_the_kept_copy_as_buckets_complete(copier: Copier) -> None:
    new = _model(1)
    manifest, plan, tensors = _setup(new)
    buffer = torch.empty(plan.total_bytes, dtype=torch.uint8)
    applier = _staged(manifest, plan, buffer, copier)
    pairs = _deliver(applier, plan, _packed(plan, tensors))
    names = [manifest.entries[i].name for i, _ in pairs]
    assert names == [k for k, v in new.items() if v.numel()]  # in order, each once, when its last byte landed
    for i, t in pairs:
        assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(t, new[manifest.entries[i].name])


def test_a_refusal_after_tensors_were_yielded_says_so_and_not_that_the_target_is_torn() -> None:
    """``receive()`` has no target: what it handed on is held by its consumer, never 'the target'."""
    from groupbridge.weights._appliers import refused

    err = refused(3, 2, RuntimeError("digests differ"), ["a"], 2, yielded=True)
    assert isinstance(err, gb.TornUpdateError) and err.written == ["a"], err
    text = str(err)
    assert "TORN" not in text and "1 of 2 tensors were yielded" in text and "still 2" in text, text
    assert "whatever consumed them holds part of it" in text, text


def _pieces(
    storage: torch.Tensor, n: int, size: int, gap: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[_bytes.Part]]:
    """``n`` pieces of ``size`` bytes in one bucket (``gap`` bytes of padding after each), landing in views of
    ``storage`` in reverse order: the bucket's bytes, and the parts."""
    g = torch.Generator().manual_seed(n + size + gap)
    bucket = torch.randint(0, 256, (n * (size + gap) + 8,), dtype=torch.uint8, generator=g)
    parts = [
        (i * (size + gap), size, storage[(n - 1 - i) * size : (n - i) * size].view(dtype), dtype)
        for i in range(n)
    ]
    return bucket, parts


@pytest.mark.parametrize("gap", [0, 16], ids=["end-to-end", "padded"])
def test_many_small_pieces_of_one_storage_unpack_as_rows_bit_exact(gap: int) -> None:
    """A bucket of many small pieces landing in one kept buffer is unpacked by one indexed copy, and what it
    writes is what one copy per piece writes, the bytes between them untouched."""
    n, size = 300, 32
    storage = torch.full((n * size + 64,), 7, dtype=torch.uint8)
    bucket, parts = _pieces(storage, n, size, gap)
    rows = _bytes.rows(bucket, parts)
    assert rows is not None and (rows.pick is None) == (gap == 0)
    expected = storage.clone()
    for offset, nbytes, t, _ in parts:  # one copy a piece, into the clone at the same places
        start = t.data_ptr() - storage.data_ptr()
        expected[start : start + nbytes] = bucket[offset : offset + nbytes]
    _bytes.copy_out(parts, _bytes.layout(bucket, parts), rows)
    assert torch.equal(storage, expected)
    assert storage[n * size :].eq(7).all()


def test_pieces_that_rows_would_not_serve_exactly_or_cheaply_are_unpacked_one_by_one() -> None:
    """Too few pieces, several storages, a cast, and rows much narrower than the pieces: no rows."""
    storage = torch.zeros(4096, dtype=torch.uint8)
    bucket, parts = _pieces(storage, 100, 32, 0)
    assert _bytes.rows(bucket, parts[: _bytes.MIN_ROW_PIECES - 1]) is None
    other = [(o, n, t.clone(), d) if i == 5 else (o, n, t, d) for i, (o, n, t, d) in enumerate(parts)]
    assert _bytes.rows(bucket, other) is None
    cast = [(o, n, t, torch.bfloat16) if i == 5 else (o, n, t, d) for i, (o, n, t, d) in enumerate(parts)]
    assert _bytes.rows(bucket, cast) is None
    big = torch.zeros(100 * 1026, dtype=torch.uint8)  # 1026-byte pieces 1028 apart: rows of 2 bytes
    bucket, parts = _pieces(big, 100, 1026, 2, torch.float16)
    assert _bytes.rows(bucket, parts) is None


def test_pieces_end_to_end_of_one_shape_pack_as_one_concatenation_bit_exact() -> None:
    """Runs of pieces end to end in the bucket, of one dtype and one shape past their first dimension, are
    packed by one concatenation each; a cast, an unaligned piece, another shape, a gap, a scalar or a large
    piece ends a run, and the bucket holds exactly what one copy per piece writes, its holes zeroed."""
    g = torch.Generator().manual_seed(3)
    parts: list[Any] = []
    at = 0

    def add(t: torch.Tensor, dtype: torch.dtype | None = None, gap: int = 0) -> None:
        nonlocal at
        dtype = dtype or t.dtype
        at += gap
        nbytes = t.numel() * dtype.itemsize
        parts.append((at, nbytes, t, dtype))
        at += nbytes

    for _ in range(6):
        add(torch.randn(2, 8, generator=g))
    add(torch.randn(2, 8, generator=g), torch.bfloat16)  # a cast: ends the first run
    for _ in range(5):
        add(torch.randn(3, 8, generator=g)[:, :4])  # strided boxes, another shape: a run of their own
    add(torch.randn(4, 4, generator=g), gap=8)  # a gap: not the run's next piece
    add(torch.randn(()), gap=0)  # a scalar
    add(torch.arange(3, dtype=torch.uint8))  # bytes that leave the next piece unaligned
    for _ in range(5):
        add(torch.randn(5, generator=g))
    add(torch.arange(3, dtype=torch.uint8))
    for _ in range(5):
        add(torch.randn(5, generator=g), gap=1)  # every one aligned again, none end to end
    for _ in range(3):
        add(torch.randn(4, 4, generator=g), gap=3)
    add(torch.randn(_bytes.MAX_RUN_PIECE // 16 + 1, 4, generator=g))  # past the size a run takes
    for _ in range(4):
        add(torch.randn(2, 4, generator=g))
    bucket = torch.full((at + 16,), 9, dtype=torch.uint8)
    assert _bytes.layout(bucket, parts).runs == ()  # an unpack's layout: no runs made
    layout = _bytes.layout(bucket, parts, runs=True)
    big = len(parts) - 5
    assert [(first, end) for first, end, _ in layout.runs] == [(0, 6), (7, 12), (big + 1, big + 5)]
    _bytes.copy_in(parts, layout._replace(runs=(), single=None))  # the one-copy-a-piece pack
    expected = bucket.clone()
    bucket.fill_(9)
    _bytes.copy_in(parts, layout)
    assert torch.equal(bucket, expected) and bucket[at:].eq(0).all()
    for offset, nbytes, t, dtype in parts:  # and each piece reads back as itself
        if offset % dtype.itemsize == 0:
            got = bucket[offset : offset + nbytes].view(dtype).view(t.shape)
            assert torch.equal(got, t.to(dtype))
