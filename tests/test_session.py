"""The session's pure rules, in-process: the header off the wire, the verdicts, what every member decides."""

from __future__ import annotations

import pytest
import torch

import groupbridge as gb
from groupbridge.weights._header import Header, Verdict
from groupbridge.weights._rx_checks import Fits, Targets, refusal
from groupbridge.weights._session import conclude
from groupbridge.weights.manifest import Manifest

pytestmark = pytest.mark.timeout(30)


def _header(**over: object) -> Header:
    fields: dict[str, object] = dict(
        version=7, digest="ab" * 8, bucket_bytes=1 << 20, solo_bytes=1 << 17, transport="broadcast",
        verify="xxh3", total_bytes=123, sync_id="0123abcd", transport_options={"in_flight": 2}, offer={},
        keeps_base=True, base=6,
    )  # fmt: skip
    fields.update(over)
    return Header(**fields)  # type: ignore[arg-type]


def test_header_round_trips_and_refuses_what_is_malformed() -> None:
    h = _header()
    assert Header.from_wire(h.to_wire()) == h
    for key, bad in [("sync_id", "../../x"), ("verify", "crc32"), ("bucket_bytes", 0), ("base", "6"),
                     ("keeps_base", 1), ("offer", {str(i): i for i in range(100)})]:  # fmt: skip
        wire = h.to_wire()
        wire[key] = bad
        with pytest.raises(gb.ProtocolError):
            Header.from_wire(wire)


def test_verdict_off_the_wire_is_checked() -> None:
    v = Verdict("holds version 9", "stale")
    assert Verdict.from_wire(v.to_wire(), 1) == v
    for bad in [None, {"problem": 3, "kind": "stale", "in_place": False, "base": False},
                {"problem": None, "kind": "mine", "in_place": False, "base": False},
                {"problem": None, "kind": "other", "in_place": 1, "base": False}]:  # fmt: skip
        with pytest.raises(gb.ProtocolError, match="rank 2"):
            Verdict.from_wire(bad, 2)


def test_one_problem_anywhere_refuses_the_sync_as_its_kind_says() -> None:
    ok = Verdict(in_place=True, base=True)
    cases = [
        ([ok, Verdict("holds 9", "stale"), ok], gb.SyncRefusedError),
        ([ok, Verdict("holds 9", "stale"), Verdict("no 'w'", "manifest")], gb.ManifestMismatchError),
        ([ok, Verdict("cannot map", "transport"), ok], gb.TransportRefusedError),
    ]
    for verdicts, kind in cases:
        with pytest.raises(kind) as info:
            conclude(_header(), 0, verdicts)
        assert type(info.value) is kind  # the most specific one, every member alike
        assert isinstance(info.value, gb.SyncRefusedError)  # agreed by all: the group stays usable
        assert "version 7" in str(info.value)


def test_a_repeat_sync_compares_the_manifest_again_only_when_what_is_expected_changed() -> None:
    """A receiver keeps the last manifest found to fit: the same manifest and expectations again are not
    compared, but a target whose tensors changed shape is a new expectation, and a misfit is refused."""
    manifest = Manifest.build([("w", torch.zeros(4, 2)), ("b", torch.zeros(2))])
    target = {"w": torch.zeros(4, 2), "b": torch.zeros(2)}
    fits = Fits()

    def check(targets: Targets) -> Verdict | None:
        expected = targets.expected
        return refusal(
            None,
            _header(),
            manifest,
            rename=str,
            expected=expected,
            accept=None,
            allow_stale=False,
            rank=3,
            fits=fits,
        )

    first = Targets.of(target, False, None)
    assert check(first) is None and fits.held(manifest, first.expected)
    again = Targets.of(dict(target), False, first)
    assert again is first and check(again) is None  # the same tensors: the same expectations, kept
    target["b"] = torch.zeros(3)
    grown = Targets.of(target, False, again)
    assert grown is not first and not fits.held(manifest, grown.expected)
    verdict = check(grown)
    assert verdict is not None and verdict.kind == "manifest" and "rank 3" in (verdict.problem or "")
    target["b"] = torch.zeros(2)
    target["w"].resize_(8)  # the same tensor object, resized in place
    assert Targets.of(target, False, grown).expected["w"] == ((8,), "float32")


def test_merged_plan_only_when_everyone_is_laid_out_and_the_transport_cuts_anywhere() -> None:
    flat, plain = Verdict(in_place=True), Verdict(in_place=False)
    assert conclude(_header(base=None), 0, [flat, flat, flat]) == (True, False)
    assert conclude(_header(base=None), 0, [flat, plain, flat]) == (False, False)
    assert conclude(_header(base=None, transport="relay"), 0, [flat, flat]) == (False, False)


def test_delta_only_when_every_receiver_holds_the_base() -> None:
    held, new = Verdict(base=True), Verdict(base=False)
    assert conclude(_header(), 0, [new, held, held]) == (False, True)  # the source's own verdict is not asked
    assert conclude(_header(), 0, [new, held, new]) == (False, False)  # one new receiver: full for all
    assert conclude(_header(base=None), 0, [new, held, held]) == (False, False)  # no base offered


@pytest.mark.parametrize(("sources", "receivers"), [(2, 2), (4, 4), (2, 4), (4, 8), (3, 2)])
def test_every_turn_of_a_walk_of_pairs_keeps_every_link_busy(sources: int, receivers: int) -> None:
    """In every turn of a round each source sends to another receiver (as many receivers busy as there can
    be), every pair has one turn, and the turns are what every member computes alike from the session."""
    from groupbridge.weights._shard_plan import ShardPlan
    from groupbridge.weights.plan import Plan

    rx = range(sources, sources + receivers)
    pairs = {(s, r): Plan.of_sizes([16], [()]) for s in range(sources) for r in rx}
    plan = ShardPlan(
        ("w",),
        {"w": "float32"},
        {"w": (4,)},
        pairs,
        dict.fromkeys(range(sources), 0),
        receivers=tuple(rx),
        sources=tuple(range(sources)),
    )
    turns = {pair: plan.turn(*pair) for pair in pairs}
    assert set(turns) == set(pairs)
    for turn in range(receivers):
        taking = [r for (s, r), t in turns.items() if t == turn]
        assert len(taking) == sources and len(set(taking)) == min(sources, receivers)
    for r in rx:  # each receiver's sources spread over the turns as evenly as they can be
        per_turn = [sum(1 for (s, d), t in turns.items() if d == r and t == u) for u in range(receivers)]
        assert max(per_turn) <= -(-sources // receivers)


class _GroupMemory:
    def __init__(self) -> None:
        self.memory: dict[str, object] = {}


def test_a_layout_travels_once_and_an_unknown_digest_is_refused_by_name() -> None:
    """The handshake's posts (``weights._posts``), in-process: a member posts its layout the first time and
    when it changes, its digest otherwise; a reader fills an unchanged layout from what the group kept, a
    handle made later on the same group reads it too, and a digest nobody posted is refused, not guessed."""
    from groupbridge.weights._posts import Posts

    group_a, group_b = _GroupMemory(), _GroupMemory()
    a, b = Posts(group_a), Posts(group_b)  # type: ignore[arg-type]
    first = [a.post({"h": 1}, {"wants": {"w": 1}}), b.post({}, {})]
    assert "wants" in first[0] and first[0]["new"] and first[1]["new"]
    for memory, me in ((a, 0), (b, 1)):
        got = memory.read(first, me)
        assert got[0]["wants"] == {"w": 1} and got[0]["h"] == 1 and "new" not in got[0]
    a.posted(first[0])
    b.posted(first[1])
    again = [a.post({"h": 2}, {"wants": {"w": 1}}), b.post({}, {})]
    assert "wants" not in again[0] and "new" not in again[0] and again[0]["g"] == first[0]["g"]
    later = Posts(group_b)  # type: ignore[arg-type]  # a new handle on rank 1's group reads what it kept
    later.post({}, {})
    assert later.read(again, 1)[0] == {"h": 2, "g": first[0]["g"], "wants": {"w": 1}}
    changed = [a.post({"h": 3}, {"wants": {"w": 2}}), again[1]]
    assert changed[0]["new"] and b.read(changed, 1)[0]["wants"] == {"w": 2}
    forged = [{"g": "0" * 32}, again[1]]
    with pytest.raises(
        gb.ProtocolError, match=r"rank 0 posted its layout by digest 0{32}, which this member"
    ):
        b.read(forged, 1)
