"""The checksum computed where a bucket is (``weights._device_digest``), run here on CPU tensors: the same
torch operations a device runs, checked against its definition in plain Python."""

from __future__ import annotations

import os
import random

import pytest
import torch

import groupbridge as gb
from groupbridge.weights import _device_digest
from groupbridge.weights._device_digest import checksum64, reference_checksum64
from groupbridge.weights.sender import verify_kind


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 4099])
def test_the_tensor_checksum_is_its_definition_at_every_length_and_alignment(n: int) -> None:
    data = os.urandom(n)
    assert checksum64(_tensor(data)) == reference_checksum64(data)
    for shift in (1, 3, 7):  # a view that starts between words (a bucket inside a larger buffer)
        assert checksum64(_tensor(bytes(shift) + data)[shift:]) == reference_checksum64(data)


def test_the_checksum_does_not_depend_on_how_the_sum_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    whole = checksum64(_tensor(data))
    for words in (1, 3, 64):
        monkeypatch.setattr(_device_digest, "CHUNK_WORDS", words)
        assert checksum64(_tensor(data)) == whole


def test_a_flipped_bit_a_moved_word_or_a_trailing_zero_changes_the_checksum() -> None:
    rng = random.Random(0)
    data = bytearray(os.urandom(4096))
    base = checksum64(_tensor(bytes(data)))
    seen = {base}
    for flip in rng.sample(range(len(data) * 8), 200):  # 200 distinct bits
        i, bit = divmod(flip, 8)
        data[i] ^= 1 << bit
        seen.add(checksum64(_tensor(bytes(data))))
        data[i] ^= 1 << bit
    assert len(seen) == 201  # every flip gave its own value
    swapped = data[8:16] + data[:8] + data[16:]
    assert checksum64(_tensor(bytes(swapped))) != base
    assert checksum64(_tensor(bytes(data) + b"\0")) != base  # the length is mixed in
    assert checksum64(_tensor(bytes(8))) != checksum64(_tensor(bytes(16)))


def test_a_bucket_of_another_kind_is_refused_before_anything_is_hashed() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        checksum64(torch.zeros(4, dtype=torch.float32))


def test_a_checksum_is_computed_where_the_source_bytes_are() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert verify_kind(False, True, cpu) == "xxh3"
    assert verify_kind(False, True, cuda) == "mix64"  # never a copy of the model to the host to check it
    assert verify_kind(False, "xxh3", cuda) == "xxh3"
    assert verify_kind(True, False, cuda) == "blake3"  # a token: the group's MAC, whatever checksum says
    assert verify_kind(False, False, cuda) == ""
    with (
        gb.StatelessGroup.create("127.0.0.1", 0) as g,
        pytest.raises(ValueError, match="checksum='sha1' must be"),
    ):
        gb.WeightSender(g, checksum="sha1")
