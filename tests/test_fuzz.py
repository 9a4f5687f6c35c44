"""Every decoder of wire data, fed hostile bytes (hypothesis, seeded): the documented error or a value."""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import groupbridge as gb
from groupbridge import codec
from groupbridge._liveness import decode_status
from groupbridge.weights._header import VERIFY, Header
from groupbridge.weights.manifest import Manifest

FUZZ = settings(
    max_examples=int(os.environ.get("GROUPBRIDGE_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


def _safe(value: Any, budget: int, depth: int = 0) -> bool:
    """What a decoder may return for hostile bytes: plain values only (never an object of another type, so
    no code ran), nested no deeper than the codec allows, tensors no bigger than the message that held
    them."""
    if depth > codec.MAX_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, torch.Tensor):
        return value.nbytes <= budget
    if isinstance(value, (list, tuple)):
        return all(_safe(v, budget, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(type(k) is str and _safe(v, budget, depth + 1) for k, v in value.items())
    return False


@seed(1)
@FUZZ
@given(_values)
def test_codec_round_trips_safe_values(value: Any) -> None:
    assert codec.decode(codec.encode(value)) == value


@seed(2)
@FUZZ
@given(st.binary(max_size=200))
def test_codec_rejects_random_bytes_with_protocol_error(data: bytes) -> None:
    for blob in (data, b"GB2" + data):
        try:
            value = codec.decode(blob)
        except gb.ProtocolError:
            continue
        assert _safe(value, len(blob)), (blob, value)


@seed(3)
@FUZZ
@given(_values, st.data())
def test_codec_rejects_mutated_messages_with_protocol_error(value: Any, data: st.DataObject) -> None:
    blob = bytearray(codec.encode({"v": value, "t": torch.arange(6, dtype=torch.int16).reshape(2, 3)}))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.just(len(blob)), st.integers(0, len(blob))))  # whole, half the time
    try:
        decoded = codec.decode(bytes(blob[:cut]))
    except gb.ProtocolError:
        return
    assert _safe(decoded, cut), decoded


def test_codec_never_allocates_what_the_message_does_not_hold() -> None:
    import msgpack

    head = msgpack.packb(["float32", [1 << 20, 1 << 20]])
    tensor = msgpack.ExtType(2, struct.pack("<H", len(head)) + head)
    with pytest.raises(gb.ProtocolError, match="needs 4398046511104 bytes, got 0"):
        codec.decode(b"GB2" + msgpack.packb(tensor))
    with pytest.raises(gb.ProtocolError, match="malformed message"):  # a 4 GiB string in 5 bytes
        codec.decode(b"GB2\xdb\xff\xff\xff\xff")
    with pytest.raises(gb.ProtocolError, match="appears twice"):
        codec.decode(b"GB2\x82\xa1k\xc0\xa1k\xc0")
    with pytest.raises(gb.ProtocolError, match="not a str"):
        codec.decode(b"GB2\x81\x01\xc0")
    nested = b"\xc0"
    for _ in range(codec.MAX_DEPTH + 1):
        nested = msgpack.packb(msgpack.ExtType(1, b"\x91" + nested))
    with pytest.raises(gb.ProtocolError, match="deeper"):
        codec.decode(b"GB2" + nested)
    with pytest.raises(gb.ProtocolError, match="malformed message"):
        codec.decode(b"GB2" + b"\x91" * 100_000)


def test_codec_keeps_types_the_wire_cannot_tell_apart() -> None:
    value = {"t": (1, (2.5, "x")), "l": [b"raw", None], "big": -(1 << 200), "small": 1 << 63}
    assert codec.decode(codec.encode(value)) == value
    assert type(codec.decode(codec.encode(value))["t"][1]) is tuple
    with pytest.raises(TypeError, match="dict keys must be str"):
        codec.encode({1: "a"})
    with pytest.raises(gb.ProtocolError, match="pickle"):
        codec.decode(codec.encode({"s": {1, 2}}, allow_pickle=True))
    assert codec.decode(codec.encode({"s": {1, 2}}, allow_pickle=True), allow_pickle=True) == {"s": {1, 2}}


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.text(max_size=12)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)


@seed(4)
@FUZZ
@given(_json)
def test_header_decoder(value: Any) -> None:
    try:
        h = Header.from_wire(value)
    except gb.ProtocolError:
        return
    assert isinstance(h, Header) and type(h.version) is int and h.bucket_bytes >= 1, h


HEADER_FIELDS = [f.name for f in dataclasses.fields(Header)]


@seed(5)
@FUZZ
@given(st.dictionaries(st.sampled_from(HEADER_FIELDS), _json))
def test_header_decoder_with_the_right_field_names(value: Any) -> None:
    try:
        h = Header.from_wire(value)
    except gb.ProtocolError:
        return
    assert h.bucket_bytes >= 1 and h.verify in VERIFY


_entry = st.one_of(
    _json,
    st.tuples(
        st.text(max_size=6),
        st.lists(st.integers(-2, 1 << 24), max_size=4),
        st.sampled_from(["float32", "bfloat16", "int8", "nope"]),
        st.sampled_from(["float32", "bfloat16", "int8", "nope"]),
        st.one_of(st.none(), st.text(max_size=6)),
    ).map(list),
)


@seed(6)
@FUZZ
@given(st.one_of(_json, st.lists(_entry, max_size=6)))
def test_manifest_decoder(value: Any) -> None:
    try:
        m = Manifest.from_wire(value)
    except gb.ProtocolError:
        return
    names = [e.name for e in m.entries]
    assert len(set(names)) == len(names)
    assert all(e.alias_of is None or e.alias_of in names[: names.index(e.name)] for e in m.entries)


def test_manifest_decoder_refuses_the_known_attacks() -> None:
    with pytest.raises(gb.ProtocolError, match="twice"):
        Manifest.from_wire([["w", [2], "float32", "float32", None]] * 2)
    with pytest.raises(gb.ProtocolError, match="elements"):
        Manifest.from_wire([["w", [1 << 21, 1 << 20], "float32", "float32", None]])
    with pytest.raises(gb.ProtocolError, match="earlier tensor"):
        Manifest.from_wire(
            [["w", [2], "float32", "float32", "later"], ["later", [2], "float32", "float32", None]]
        )


@seed(7)
@FUZZ
@given(st.binary(max_size=120))
def test_status_decoder(data: bytes) -> None:
    status = decode_status(data)
    assert status is None or status["state"] in ("live", "aborted", "closed")


@seed(8)
@FUZZ
@given(st.text(max_size=40))
def test_address_parse_rejects_or_round_trips(text: str) -> None:
    try:
        a = gb.Address.parse(text)
    except ValueError:
        return
    assert a.host.isascii() and a.host.isprintable()
    assert gb.Address.parse(str(a)) == a


@seed(9)
@FUZZ
@given(
    st.from_regex(r"\A(\[[0-9a-f:]{2,20}\]|[a-z0-9.\-]{1,20})(:[0-9]{1,5})?\Z"),
)
def test_address_parse_on_address_like_text(text: str) -> None:
    try:
        a = gb.Address.parse(text)
    except ValueError:
        return
    assert gb.Address.parse(str(a)) == a


def test_address_known_attacks() -> None:
    for bad in ("127.0.0.1:٢٩٥٠٠", "0x7f000001", "127.1", "2130706433:80", "host\u00a0name", "١٢٧.0.0.1"):
        with pytest.raises(ValueError):
            gb.Address.parse(bad)
    with pytest.raises(ValueError):
        gb.Address("evilhost\n")  # the constructor never strips: no value that does not round-trip
    assert gb.Address.parse(" evilhost\n") == gb.Address("evilhost")  # parse strips surrounding space


_option_fields = st.sampled_from(["in_flight", "chain", "chunk_bytes", "window", "slots"])


@seed(10)
@FUZZ
@given(st.one_of(_json, st.dictionaries(_option_fields, _json)), st.integers(1, 9))
def test_transport_option_decoders(value: Any, world_size: int) -> None:
    from groupbridge.weights.transports import TRANSPORTS

    for spec in TRANSPORTS.values():
        try:
            options = spec.parse(value, world_size, 0)
        except gb.ProtocolError:
            continue
        assert isinstance(options, spec.options)
        assert spec.parse(options.to_wire(), world_size, 0) == options  # what was accepted round-trips


def test_transport_options_from_the_wire_are_checked() -> None:
    from groupbridge.weights.transports import TRANSPORTS

    relay = TRANSPORTS["relay"]
    wire = {"chain": [0, 2, 1], "chunk_bytes": 4096, "window": 4}
    assert relay.parse(wire, 3, 0).chain == (0, 2, 1)
    for bad in ({**wire, "chain": [0, 1, 1]}, {**wire, "chain": [1, 0, 2]}, {**wire, "chunk_bytes": 1},
                {**wire, "window": 1 << 20}, {**wire, "chain": [0, True, 2]}):  # fmt: skip
        with pytest.raises(gb.ProtocolError):
            relay.parse(bad, 3, 0)
    with pytest.raises(gb.ProtocolError):
        TRANSPORTS["shm"].parse({"slots": 1 << 30}, 3, 0)
    with pytest.raises(gb.ProtocolError):
        TRANSPORTS["broadcast"].parse({"in_flight": 0}, 3, 0)
