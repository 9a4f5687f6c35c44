"""The worker side's update protocol (``groupbridge.engine``): each kind read off the wire and back, mixed or
malformed requests refused before anything acts, and each kind handed to its worker method."""

from __future__ import annotations

from typing import Any

import pytest

from groupbridge.engine import (
    Abandon,
    Commit,
    Receive,
    Rollback,
    Update,
    Withhold,
    handle,
    parse_update,
    update_fields,
)

ADAPTER = {"name": "a", "config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, "max_live": 2}
KINDS: list[Update] = [
    Receive(7),
    Receive(7, adapter=ADAPTER, bridge="b1"),
    Commit(7),
    Commit(7, in_use=("a@v3",)),
    Rollback(6),
    Rollback(6, adapter=ADAPTER),
    Withhold(7),
    Abandon(),
]


@pytest.mark.parametrize("update", KINDS, ids=repr)
def test_every_kind_reads_back_as_itself(update: Update) -> None:
    assert parse_update(update_fields(update)) == update


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"version": 1, "commit": True, "rollback": True}, "one kind; this one says rollback and commit"),
        ({"version": 1, "abandon": True, "withhold": True}, "abandon and withhold"),
        ({"version": True}, "version must be an int"),
        ({"version": "1"}, "version must be an int"),
        ({"version": 1 << 62}, "out of range"),
        ({"version": 1, "commit": 1}, "commit must be a bool"),
        ({"version": 1, "adapter": ["a"]}, "adapter must be a mapping"),
        ({"version": 1, "bridge": "x" * 65}, "bridge must be a bridge id"),
        ({"version": 1, "commit": True, "in_use": "a"}, "in_use must be a list"),
        ({"version": 1, "commit": True, "in_use": [1]}, "in_use must be a list"),
    ],
)
def test_a_mixed_or_malformed_update_is_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_update(fields)


class Recorder:
    """A worker that records which of its methods each update reached."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def begin_update(self) -> None:
        self.calls.append(("begin_update", None))

    def receive(self, update: Receive) -> None:
        self.calls.append(("receive", update))

    def expect_commit(self, update: Commit) -> None:
        self.calls.append(("expect_commit", update))

    def rollback(self, update: Rollback) -> None:
        self.calls.append(("rollback", update))

    def withhold(self, update: Withhold) -> None:
        self.calls.append(("withhold", update))

    def abandon(self, update: Abandon) -> None:
        self.calls.append(("abandon", update))

    def finish_update(self) -> None:
        self.calls.append(("finish_update", None))


def test_each_kind_reaches_its_own_method() -> None:
    worker = Recorder()
    for update in KINDS:
        handle(worker, update)
    names = [name for name, _ in worker.calls]
    assert names == ["receive"] * 2 + ["expect_commit"] * 2 + ["rollback"] * 2 + ["withhold", "abandon"]
    assert [u for _, u in worker.calls] == KINDS
    with pytest.raises(TypeError, match="not an update"):
        handle(worker, {"version": 1})  # type: ignore[arg-type]


def test_the_vllm_worker_implements_the_protocol() -> None:
    """vLLM's worker engine has every method of the protocol, and its wire class reads each kind."""
    pytest.importorskip("vllm")
    from groupbridge.engine import UpdateWorker
    from groupbridge.vllm._worker import UpdateInfo, WorkerEngine

    for name in [n for n in vars(UpdateWorker) if not n.startswith("_")]:
        assert callable(getattr(WorkerEngine, name, None)), name
    for update in KINDS:
        assert UpdateInfo(**update_fields(update)).update == update
    with pytest.raises(ValueError, match="one kind"):
        UpdateInfo(version=1, commit=True, withhold=True)
