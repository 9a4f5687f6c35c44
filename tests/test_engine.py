"""The engine layer on its own: a TrainerSession here, a WorkerSession in a worker process over a plain torch
model, driven through an EngineControl whose calls travel as messages to that process (an engine's RPC).

What vLLM's tests cannot show without a GPU-sized model: the worker's engine keeps running while an atomic
update lands (the "engine loop" ticks during the transfer), a commit that fails leaves versions the next
send can follow, a manifest the loader refuses is refused on both sides with the model untouched, and the
loader is handed views of one buffer the worker keeps across updates and bridges (nothing staged per name,
cloned or re-assembled).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from groupbridge.engine import Capabilities, EngineControl, Fleet, Probe, TrainerConfig, TrainerSession
from groupbridge.errors import (
    JoinTimeoutError,
    ManifestMismatchError,
    PeerDiedError,
    PeerTimeoutError,
    VerificationError,
    WeightSyncError,
)
from tests.helpers import CTX, Ranks, refused_after_takeover

pytestmark = pytest.mark.timeout(90)

SHAPES = {f"layer{i}.weight": (64, 64) for i in range(8)}


def _engine(rank: int, calls: Any, replies: Any, shadow: bool = False) -> dict[str, Any]:
    """The worker: a model, a loop that 'serves' (ticks) between RPCs, a WorkerSession driven by calls.
    ``shadow``: its loader keeps a second copy, each update prepared into it in 0.5 s (a slow processing)
    and committed by exchanging the copies."""
    from groupbridge.engine import BridgeInfo, WorkerSession
    from groupbridge.weights.manifest import Manifest

    del rank
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    # per load, the memory of each tensor handed to the loader, held: a buffer made anew could not take the
    # address of one freed before it
    storages: list[list[Any]] = []

    check_s = 0.0

    class Loader:
        def check(self, manifest: Manifest) -> str | None:
            time.sleep(check_s)
            unknown = [e.name for e in manifest.entries if e.name not in model]
            return f"this model has no {unknown[0]}" if unknown else None

        def load(self, weights: Any) -> None:
            storages.append([])
            for name, t in weights:
                storages[-1].append(t.untyped_storage())
                model[name].copy_(t)

        def finish(self) -> None: ...

    class Shadowed(Loader):
        def __init__(self) -> None:
            self.spare = {n: torch.zeros(s) for n, s in SHAPES.items()}
            self.swapped: list[float] = []
            self.broken = False
            self.failing = False
            self.hang: threading.Event | None = None

        def swapping(self) -> bool:
            return True

        def prepare(self, weights: Any) -> None:
            for i, (name, t) in enumerate(weights):
                if self.failing and i == 2:
                    self.failing = False
                    raise RuntimeError("the shadow's processing failed")
                if self.hang is not None and i == 2:  # a loader call that does not return until released
                    hang, self.hang = self.hang, None
                    hang.wait(60)
                self.spare[name].copy_(t + (0.5 if self.broken and i == 2 else 0.0))
            self.broken = False
            time.sleep(0.5)

        def swap(self) -> None:
            nonlocal model
            model, self.spare = self.spare, model
            self.swapped.append(time.monotonic())

    loader_of = Shadowed() if shadow else Loader()
    session = WorkerSession(loader_of, swaps=loader_of if shadow else None)  # type: ignore[arg-type]
    ticks: list[float] = []
    fail_commit = False
    slow_commit = 0.0
    loader = session.loader
    honest_load = Loader.load
    while True:
        try:
            call, arg = calls.get(timeout=0.01)
        except queue.Empty:
            ticks.append(time.monotonic())  # the engine's loop: one step of serving
            continue
        result: Any = None
        try:
            if call == "join":
                session.join(BridgeInfo(**arg), arg.get("sources", 1) + arg.get("rank_offset", 0))
            elif call == "begin":  # (version, the bridge the trainer sends on)
                session.begin()
                session.receive(arg[0], bridge=arg[1])
            elif call == "begin_only":  # an engine's RPC that begins an update, alone
                session.begin()
            elif call == "commit":
                if fail_commit:
                    fail_commit = False
                    raise RuntimeError("the engine's load failed")
                time.sleep(slow_commit)
                slow_commit = 0.0
                session.commit()
            elif call == "slow_next_commit":  # an engine whose next commit takes ``arg`` seconds to return
                slow_commit = arg
            elif call == "fail_next_commit":
                fail_commit = True
            elif call in ("break_next_load", "tear_next_load"):
                # a loader bug on the next load only: one tensor written wrong (every byte arrived
                # verified), or a load that fails midway (the model holds two versions)
                def bad(self: Any, weights: Any, tear: bool = call == "tear_next_load") -> None:
                    type(self).load = honest_load
                    for i, (name, t) in enumerate(weights):
                        if tear and i == 3:
                            raise RuntimeError("the loader failed midway")
                        model[name].copy_(t + (0.5 if i == 2 else 0.0))

                type(loader).load = bad
            elif call == "tear_loads":  # each of the next ``arg`` loads fails midway

                def tearing(self: Any, weights: Any, left: list[int] = [arg]) -> None:  # noqa: B006
                    left[0] -= 1
                    if not left[0]:
                        type(self).load = honest_load
                    for i, (name, t) in enumerate(weights):
                        if i == 3:
                            raise RuntimeError("the loader failed midway")
                        model[name].copy_(t)

                type(loader).load = tearing
            elif call == "rollback":
                session.begin()
                session.stage_rollback(arg)
                session.commit()
            elif call == "slow_checks":  # a dry run that takes this long
                check_s = arg
            elif call == "break_next_prepare":  # a processing bug: one tensor of the shadow written wrong
                loader_of.broken = True  # type: ignore[attr-defined]
            elif call == "fail_next_prepare":  # the shadow's processing raises midway
                loader_of.failing = True  # type: ignore[attr-defined]
            elif call == "hang_next_prepare":
                released = threading.Event()
                loader_of.hang = released  # type: ignore[attr-defined]
            elif call == "release_prepare":
                released.set()
            elif call == "ticks":
                result = list(ticks)
            elif call == "probe":  # what the engine serves, read through the installed weights
                result = [float(model[n].mean()) for n in SHAPES]
            elif call == "leave":
                session.close()
            elif call == "stop":
                session.close()
                replies.put(("ok", None))
                return {"ticks": ticks, "sum": float(sum(t.sum() for t in model.values())),
                        "version": session.version, "timings": session.timings,
                        "swapped": getattr(loader_of, "swapped", []),
                        "storages": [[m.data_ptr() for m in load] for load in storages]}  # fmt: skip
            replies.put(("ok", result if result is not None else dict(session.timings)))
        except Exception as e:
            replies.put(("error", f"{type(e).__name__}: {e}"))


class Control(EngineControl):
    """The engine's RPC: a call is a message to the worker process, answered within a bound."""

    capabilities = Capabilities(probe=True, rollback=True)

    def __init__(self, calls: Any, replies: Any) -> None:
        self.calls, self.replies = calls, replies
        self.lock = threading.Lock()
        self.log: list[tuple[str, float, float]] = []
        self.bridge: str | None = None

    def rpc(self, call: str, arg: Any = None) -> Any:
        with self.lock:
            t0 = time.monotonic()
            self.calls.put((call, arg))
            status, value = self.replies.get(timeout=60)
            self.log.append((call, t0, time.monotonic()))
        if status != "ok":
            raise RuntimeError(value)
        return value

    def join(self, info: dict[str, Any]) -> None:
        self.rpc("join", info)
        self.bridge = info["bridge_id"]

    def begin(self, version: int) -> None:
        self.rpc("begin", (version, self.bridge))

    def commit(self, version: int) -> None:
        self.rpc("commit", version)

    def leave(self) -> None:
        self.rpc("leave")

    def probe(self, tokens: list[int]) -> list[list[float]]:
        return [self.rpc("probe", tokens)]

    def rollback(self, version: int) -> None:
        self.rpc("rollback", version)


@contextlib.contextmanager
def rig(shadow: bool = False, **config: Any) -> Iterator[tuple[TrainerSession, Control, dict[str, Any]]]:
    """A trainer session driving one worker process; the dict is filled, once the block ends, with what
    the worker reports at its stop (its model's sum, version, timings, the storages its loads got)."""
    calls, replies = CTX.Queue(), CTX.Queue()
    worker = Ranks(_engine, 1, (calls, replies, shadow))
    control = Control(calls, replies)
    config = {"timeout_s": 30, "liveness_s": 10, "bucket_bytes": 32 << 10, **config}
    session = TrainerSession(TrainerConfig(**config), control)
    out: dict[str, Any] = {}
    try:
        # the worker serving before the first send: its start (a process, torch's import) is not what a
        # test's timeout_s bounds, and a busy host takes seconds over it
        control.rpc("ticks")
        yield session, control, out
    finally:
        session.close()
        control.rpc("stop")
        ((ok, res),) = worker.results(30).values()
        assert ok, res
        out.update(res)


SPECS = {n: (s, torch.float32) for n, s in SHAPES.items()}
WHOLE = sum(64 * 64 for _ in SHAPES)


def slow(value: float, seconds: float) -> Any:
    for name, shape in SHAPES.items():
        time.sleep(seconds)
        yield name, torch.full(shape, value)


def paused(value: float, pulling: threading.Event, go: threading.Event) -> Any:
    """A source that stops after its first tensor (``pulling`` set) until ``go``: a send held midway."""
    for i, (name, shape) in enumerate(SHAPES.items()):
        if i == 1:
            pulling.set()
            go.wait(20)
        yield name, torch.full(shape, value)


def test_an_atomic_update_lands_while_the_engine_serves() -> None:
    """The engine's RPC (the handshake) returns long before the bytes have landed, and the engine's loop
    runs while they land."""
    with rig(bucket_bytes=32 << 10) as (session, control, out):
        session.connect()
        t0 = time.monotonic()
        assert session.send(slow(1.0, 0.15), specs=SPECS) == 1
        t1 = t0 + session.last_seconds["transfer"]
        begin = next(c for c in control.log if c[0] == "begin")
        assert begin[2] - begin[1] < 0.5 * (t1 - t0), (begin, t0, t1)
    assert out["version"] == 1 and out["sum"] == 1.0 * WHOLE
    ticks = [t for t in out["ticks"] if t0 + 0.3 < t < t1 - 0.3]  # inside the transfer
    assert len(ticks) > 10, "the engine's loop did not run while the update landed"


def test_a_failed_commit_keeps_the_version_and_the_next_send_follows_it() -> None:
    """A commit that fails: the workers hold version 2 uncommitted, the session still says version 1, and
    the next send is version 3 and lands."""
    with rig() as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("fail_next_commit")
        with pytest.raises(WeightSyncError, match="commit of version 2 failed"):
            session.send(slow(2.0, 0), specs=SPECS)
        assert session.version == 1 and session.sent == 2
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
    assert out["version"] == 3 and out["sum"] == 3.0 * WHOLE


def test_a_manifest_the_loader_refuses_is_refused_on_both_sides_and_the_bridge_stays_usable() -> None:
    with rig() as (session, _, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        with pytest.raises(ManifestMismatchError, match="no extra"):
            session.send({"extra": torch.ones(2)})
        assert session.send(slow(2.0, 0), specs=SPECS) == 2
    assert out["version"] == 2 and out["sum"] == 2.0 * WHOLE


def test_every_load_is_views_of_one_buffer_the_worker_keeps_across_updates_and_bridges() -> None:
    """No copies the update does not need: every tensor the loader got, in every committed update (and
    after a new bridge, the next generation), is a view of the one buffer the worker keeps."""
    with rig() as (session, _, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        assert session.send(slow(2.0, 0), specs=SPECS) == 2
        session.connect()  # a new bridge: the worker joins it and keeps its receive buffers
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
    assert out["version"] == 3 and out["sum"] == 3.0 * WHOLE
    loads = out["storages"]
    assert len(loads) == 3 and all(len(ptrs) == len(SHAPES) for ptrs in loads), loads
    assert len({p for ptrs in loads for p in ptrs}) == 1, loads


def test_a_commit_with_nothing_received_raises_and_keeps_the_version() -> None:
    """What an engine's finish after a trainer that never sent (or a new trainer's join, which drops what
    an earlier one staged) reaches: an error, never a version reported that nothing loaded."""
    from groupbridge.engine import WorkerSession

    class Loader:
        def check(self, manifest: Any) -> None:
            return None

        def load(self, weights: Any) -> None:
            raise AssertionError("nothing may be loaded")

        def finish(self) -> None: ...

    session = WorkerSession(Loader())
    session.version = 4
    with pytest.raises(WeightSyncError, match=r"nothing to commit.*still holds 4"):
        session.commit()
    session.abandon()  # nothing to abandon: a no-op
    assert session.version == 4


def _failing(value: float, after: int) -> Any:
    for i, (name, shape) in enumerate(SHAPES.items()):
        if i == after:
            raise RuntimeError("the trainer's source failed midway")
        yield name, torch.full(shape, value)


def test_a_landing_that_failed_commits_nothing_and_the_next_update_lands() -> None:
    """The trainer's sync fails midway (its source raises): the worker's landing fails with it, a commit
    then raises 'did not land' and leaves version 1 loaded; the next send (a new bridge) lands."""
    calls, replies = CTX.Queue(), CTX.Queue()
    worker = Ranks(_engine, 1, (calls, replies))
    control = Control(calls, replies)
    specs = {n: (s, torch.float32) for n, s in SHAPES.items()}
    session = TrainerSession(TrainerConfig(timeout_s=30, liveness_s=2, bucket_bytes=32 << 10), control)
    try:
        assert session.send(slow(1.0, 0), specs=specs) == 1
        with pytest.raises(WeightSyncError, match="source failed midway"):
            session.send(_failing(2.0, 4), specs=specs)
        with pytest.raises(RuntimeError, match=r"version 2 did not land.*nothing loaded"):
            control.commit(2)  # what an engine's finish after the failed send reaches
        assert session.version == 1
        assert session.send(slow(3.0, 0), specs=specs) == 2  # version 2 again: nobody holds it
    finally:
        session.close()
        control.rpc("stop")
    ((ok, out),) = worker.results(30).values()
    assert ok, out
    assert out["version"] == 2 and out["sum"] == 3.0 * sum(64 * 64 for _ in SHAPES)


def test_a_second_send_while_one_runs_is_refused_at_once() -> None:
    with rig() as (session, _, out):
        session.connect()
        pulling, go = threading.Event(), threading.Event()
        first: list[int] = []
        t = threading.Thread(target=lambda: first.append(session.send(paused(1.0, pulling, go), specs=SPECS)))
        t.start()
        assert pulling.wait(20)
        with pytest.raises(RuntimeError, match="already running"):
            session.send(slow(2.0, 0), specs=SPECS)
        go.set()
        t.join(30)
        assert first == [1]
        assert session.send(slow(3.0, 0), specs=SPECS) == 2
    assert out["version"] == 2 and out["sum"] == 3.0 * WHOLE


def _means(value: float) -> list[float]:
    """What the probe of a model whose every tensor holds ``value`` reads."""
    return [value] * len(SHAPES)


def test_beginning_an_update_never_waits_for_a_landing() -> None:
    """The engine's RPC that begins an update returns at once while an earlier update still lands (it used
    to wait up to the liveness bound, 10 s here, then abort the bridge): that update is dropped (its commit
    finds nothing to load, the model keeps its version), and the next update lands after it."""
    with rig() as (session, control, out):
        session.connect()
        pulling, go = threading.Event(), threading.Event()
        first: list[BaseException] = []

        def send() -> None:  # held midway: the worker's landing waits for the rest
            try:
                session.send(paused(1.0, pulling, go), specs=SPECS)
            except WeightSyncError as e:
                first.append(e)

        t = threading.Thread(target=send)
        t.start()
        assert pulling.wait(20)
        t0 = time.monotonic()
        control.rpc("begin_only")
        took = time.monotonic() - t0
        go.set()
        t.join(30)
        assert took < 2.0, took
        assert len(first) == 1 and "nothing to commit" in str(first[0]), first
        assert session.send(slow(2.0, 0), specs=SPECS) == 2
    assert out["version"] == 2 and out["sum"] == 2.0 * WHOLE


def test_a_probe_that_disagrees_rolls_back_and_the_next_update_lands() -> None:
    """A loader bug after a verified transfer (one tensor written wrong): the probe sees it, the worker loads
    version 2 again from its rollback copy, the send raises naming the replica; version 4 then lands."""
    values = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    probe = Probe(list(range(len(SHAPES) + 1)), lambda v: _means(values[v]), atol=1e-3)
    with rig(verify=probe) as (session, control, out):
        for v in (1, 2):
            assert session.send(slow(values[v], 0), specs=SPECS) == v
        assert control.probe([])[0] == _means(2.0)
        control.rpc("break_next_load")
        with pytest.raises(
            VerificationError, match=r"replica 0 serves version 3.*rolled back to version 2"
        ) as e:
            session.send(slow(3.0, 0), specs=SPECS)
        assert (e.value.replica, e.value.served, e.value.version) == (0, 2, 3)
        assert e.value.difference == pytest.approx(0.5)  # the tensor the loader wrote wrong
        assert control.probe([])[0] == _means(2.0)  # version 2's bytes, every tensor
        assert session.version == 2 and session.sent == 3
        assert session.last_seconds["unverified"] >= session.last_seconds["verify"] > 0
        assert session.send(slow(4.0, 0), specs=SPECS) == 4
        calls = [c for c, _, _ in control.log]  # the probe's scoring path warmed before the first update
        assert calls.index("probe") < calls.index("begin") and session.warm_seconds is not None
    assert out["version"] == 4 and out["sum"] == 4.0 * WHOLE


def test_a_probe_the_engine_cannot_score_is_found_before_any_update() -> None:
    """The probe is scored once when the first bridge is up: an engine that fails it refuses the trainer's
    first send before anything is sent or committed (it used to be found after the first commit)."""
    probe = Probe(list(range(len(SHAPES) + 1)), lambda v: _means(1.0), atol=1e-3)
    with rig(verify=probe) as (session, control, out):
        control.probe = lambda tokens: (_ for _ in ()).throw(RuntimeError("cannot score"))  # type: ignore[method-assign]
        with pytest.raises(
            WeightSyncError, match=r"could not score the probe before any update.*cannot score"
        ):
            session.send(slow(1.0, 0), specs=SPECS)
        assert session.group is None and "begin" not in [c for c, _, _ in control.log]
    assert out["version"] is None


def test_a_torn_commit_is_rolled_back_to_the_whole_previous_version() -> None:
    """Rollback without a probe: a load that fails midway leaves the model holding two versions; the trainer
    has the worker load version 1 again, and says so."""
    with rig(rollback=True) as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("tear_next_load")
        with pytest.raises(WeightSyncError, match=r"commit of version 2 failed.*rolled back to version 1"):
            session.send(slow(2.0, 0), specs=SPECS)
        assert control.probe([])[0] == _means(1.0)
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
    assert out["version"] == 3 and out["sum"] == 3.0 * WHOLE


def test_a_load_that_fails_over_a_torn_model_names_every_version_it_mixes() -> None:
    """The commit of version 2 fails midway, then the rollback to 1 does too: the model holds parts of 1
    and 2, and the text says so (it used to say "1 and 1", the version last held whole and the one loaded)."""
    with rig(rollback=True) as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("tear_loads", 2)
        mixed = r"(?s)rollback to version 1 failed too.*mix of two versions \(1 and 2\)"
        with pytest.raises(WeightSyncError, match=mixed):
            session.send(slow(2.0, 0), specs=SPECS)
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
    assert out["sum"] == 3.0 * WHOLE


def test_without_rollback_a_failed_probe_cannot_happen_and_a_torn_commit_says_so() -> None:
    with pytest.raises(ValueError, match="verify needs rollback"):
        TrainerConfig(verify=Probe([1, 2], lambda v: [0.0]), rollback=False)
    with rig() as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("tear_next_load")
        with pytest.raises(WeightSyncError, match=r"rollback is off"):
            session.send(slow(2.0, 0), specs=SPECS)
        with pytest.raises(RuntimeError, match=r"cannot roll back to version 1: .* none"):
            control.rollback(1)
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
    assert out["sum"] == 3.0 * WHOLE


def test_the_first_update_cannot_be_rolled_back_and_the_error_says_what_is_served() -> None:
    probe = Probe([0, 1, 2, 3, 4, 5, 6, 7, 8], lambda v: _means(9.0), atol=1e-3)
    with rig(verify=probe) as (session, _, out):
        with pytest.raises(VerificationError, match="no earlier version of this trainer") as e:
            session.send(slow(1.0, 0), specs=SPECS)
        assert e.value.served is None and session.version is None
    assert out["version"] == 1


def test_a_dead_member_is_named_even_when_another_member_aborted_first() -> None:
    """A worker that saw another stop aborts the bridge; when its abort reaches the trainer first, the error
    still names the member that stopped, not the one that aborted."""

    class Described(_Hangs):
        def describe_rank(self, worker: int) -> str:
            return f"engine {worker}'s worker 0"

    from groupbridge.engine._recovery import dead_member

    control = Described()
    died = PeerDiedError("rank 0 of group 'g': rank 2 stopped its heartbeat: last heard 2.0s ago", rank=2)
    aborted = PeerDiedError(
        "rank 0 of group 'g': rank 1 aborted: rank 1 gave up receiving version 3: PeerDiedError: rank 1 of "
        "group 'g': rank 2 stopped its heartbeat: last heard 2.0s ago", rank=1, aborted=True,
    )  # fmt: skip
    assert dead_member(WeightSyncError("sending failed"), control, 1) is None
    for error in (died, aborted):
        wrapped = WeightSyncError("sending version 3 failed")
        wrapped.__cause__ = error
        assert dead_member(wrapped, control, 1) == (2, "bridge rank 2 is engine 1's worker 0"), error
    unexplained = PeerDiedError("rank 0 of group 'g': rank 1 aborted: the user stopped", rank=1, aborted=True)
    assert dead_member(unexplained, control, 1) is None


def test_an_engine_whose_join_fails_ends_the_trainers_wait_at_once() -> None:
    """An engine that cannot join (its worker died: vLLM's `vllm serve` answers the join with an error)
    ends the trainer's wait for the workers at once, not at the join's timeout (30 s here); the next
    connect, with the engine able to join, lands an update."""
    with rig(timeout_s=30) as (session, control, out):

        def cannot_join(info: dict[str, Any]) -> None:
            raise RuntimeError("EngineDeadError: worker proc died unexpectedly (exit code: -4)")

        control.join = cannot_join  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"the engine's join failed: .*exit code: -4"):
            session.connect()
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
        del control.join  # the engine's own join again
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
    assert out["version"] == 1 and out["sum"] == 1.0 * WHOLE


class _Hangs(EngineControl):
    """An engine whose every call hangs (its RPC never answers), and that declares nothing."""

    def __init__(self) -> None:
        self.called: list[str] = []
        self.release = threading.Event()

    def join(self, info: dict[str, Any]) -> None:
        self.called.append("join")
        self.release.wait(30)

    def begin(self, version: int) -> None:
        self.called.append("begin")

    def commit(self, version: int) -> None:
        self.called.append("commit")

    def leave(self) -> None:
        self.called.append("leave")


def test_a_second_trainer_on_the_engine_never_lets_the_first_reuse_a_version() -> None:
    """Trainer 2 takes the engine over while trainer 1 lives on (a failover) and sends 3 and 4. Trainer 1's
    next version (its default: 3) is refused, naming the version the engine holds (it used to land as a
    second "3"), within the liveness bound; then 5 lands. The engine's versions only grow, whichever
    trainer sends."""
    with rig() as (first, control, out):
        assert first.send(slow(1.0, 0), specs=SPECS) == 1
        assert first.send(slow(2.0, 0), specs=SPECS) == 2
        # its own control of the same engine (a second trainer process would make its own)
        other = Control(control.calls, control.replies)
        second = TrainerSession(TrainerConfig(timeout_s=30, liveness_s=10, bucket_bytes=32 << 10), other)
        try:
            assert second.send(slow(3.0, 0), specs=SPECS, version=3) == 3
            assert second.send(slow(4.0, 0), specs=SPECS) == 4
            t0 = time.monotonic()
            e = refused_after_takeover(lambda: first.send(slow(9.0, 0), specs=SPECS))
            assert re.search(
                r"(?s)holds version 4; version 3 is not newer.*next default version is 5", str(e)
            )
            assert e.newest == 4 and time.monotonic() - t0 < 10  # well within the liveness bound
            assert control.probe([])[0] == _means(4.0)  # trainer 2's version 4, whole
            assert first.send(slow(5.0, 0), specs=SPECS) == 5
            e = refused_after_takeover(lambda: second.send(slow(6.0, 0), specs=SPECS))
            assert "holds version 5; version 5 is not newer" in str(e)  # its default was 5 too
            assert "holds version 5, as new as this trainer's 5" in str(e)  # not "newer than"
            assert second.send(slow(6.0, 0), specs=SPECS) == 6
        finally:
            second.close()
    assert out["version"] == 6 and out["sum"] == 6.0 * WHOLE


def test_a_fleet_of_two_engines_commits_as_one_and_probes_each() -> None:
    """Two engines (a worker process each, each behind its own control) behind one engine-neutral Fleet:
    one bridge, engine 1's worker after engine 0's, every version on both, one probe list per replica."""
    queues = [(CTX.Queue(), CTX.Queue()) for _ in range(2)]
    workers = [Ranks(_engine, 1, q) for q in queues]
    controls = [Control(*q) for q in queues]
    fleet = Fleet(controls, timeout_s=30)
    assert fleet.capabilities == Capabilities(probe=True, rollback=True)
    probe = Probe(list(range(len(SHAPES) + 1)), lambda v: _means(float(v)), atol=1e-3)
    config = TrainerConfig(workers=2, timeout_s=30, liveness_s=10, bucket_bytes=32 << 10, verify=probe)
    try:
        with TrainerSession(config, fleet) as session:
            for v in (1, 2):
                assert session.send(slow(float(v), 0), specs=SPECS) == v
            assert fleet.probe([]) == [_means(2.0), _means(2.0)]
            assert fleet.describe_rank(1) == "engine 1's worker 0 (engine 1 of 2 in the fleet)"
    finally:
        for c in controls:
            c.rpc("stop")
        results = [w.results(30) for w in workers]
    for each in results:
        ((ok, res),) = each.values()
        assert ok, res
        assert res["version"] == 2 and res["sum"] == 2.0 * WHOLE


def test_a_fleet_call_is_bounded_by_one_timeout_and_names_every_engine_that_hung() -> None:
    """Two engines that never answer: the fleet's call raises after its one timeout_s (not one per engine),
    naming both."""
    engines = [_Hangs(), _Hangs()]
    fleet = Fleet(engines, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"join failed on 2 of 2 engines.*\n.*engine 0: did not return "
                       r"within 1 s\nengine 1: did not return within 1 s"):  # fmt: skip
        fleet.join({"sources": 1, "world_size": 3})
    took = time.monotonic() - t0
    # what each engine serves, asked while its join still runs: one line per engine, within the bound
    t0 = time.monotonic()
    lines = fleet.holding()
    assert [x.split(" (")[0] for x in lines] == [f"engine {k}: cannot say what it serves" for k in range(2)]
    assert time.monotonic() - t0 < 1.6
    for e in engines:
        e.release.set()
    assert 1.0 <= took < 1.6, took
    assert fleet.holding() == [f"engine {k}: _Hangs cannot say what it serves (it declares no versions "
                               "capability)" for k in range(2)]  # fmt: skip


def test_what_an_engine_cannot_do_is_refused_before_anything_joins() -> None:
    """verify needs probe and rollback; a fleet has what every engine declares: a session is refused at
    once, naming the engine and what it lacks, and no engine is called. A control that is no EngineControl
    is refused too."""
    plain = _Hangs()
    probe = Probe([1, 2], lambda v: [0.0])
    with pytest.raises(TypeError, match=r"_Hangs declares no probe capability; _Hangs declares no rollback"):
        TrainerSession(TrainerConfig(verify=probe), plain)
    with pytest.raises(
        TypeError, match=r"^(?!.*engine 0).*engine 1 \(_Hangs declares no rollback capability\)"
    ):
        TrainerSession(TrainerConfig(rollback=True, workers=2), Fleet([Control(None, None), plain]))
    assert plain.called == []

    class Duck:  # the four calls, but no declaration of what else it can do
        def join(self, info: Any) -> None: ...
        def begin(self, version: int) -> None: ...
        def commit(self, version: int) -> None: ...
        def leave(self) -> None: ...

    with pytest.raises(TypeError, match=r"control must be a groupbridge\.engine\.EngineControl"):
        TrainerSession(TrainerConfig(), Duck())  # type: ignore[arg-type]


def test_a_worker_with_a_shadow_prepares_before_the_ack_and_commits_by_a_swap() -> None:
    """A loader that keeps a shadow: each update is loaded and processed into it (0.5 s here) while the
    engine serves, before the trainer's send returns; the commit is the swap alone; a probe that disagrees
    rolls back by swapping again (no bytes kept aside); the next update lands; with swap="reload" the same
    loader is loaded in the commit instead."""
    values = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    probe = Probe(list(range(len(SHAPES) + 1)), lambda v: _means(values[v]), atol=1e-3)
    with rig(shadow=True, verify=probe) as (session, control, out):
        for v in (1, 2):
            t0 = time.monotonic()
            assert session.send(slow(values[v], 0), specs=SPECS) == v
            assert session.last_seconds["transfer"] >= 0.5  # the send waited for the shadow's processing
            assert session.last_seconds["commit"] < 0.3, session.last_seconds
            prepared = control.rpc("probe")  # the model serves v
            assert prepared == _means(values[v])
        ticks_during = [t for t in control.rpc("ticks") if t0 < t < t0 + session.last_seconds["transfer"]]
        assert len(ticks_during) > 10, "the engine did not serve while the update was prepared"
        control.rpc("break_next_prepare")
        with pytest.raises(VerificationError, match=r"rolled back to version 2") as e:
            session.send(slow(values[3], 0), specs=SPECS)
        assert e.value.served == 2 and control.probe([])[0] == _means(2.0)
        assert session.send(slow(values[4], 0), specs=SPECS) == 4
    assert out["version"] == 4 and out["sum"] == 4.0 * WHOLE
    assert len(out["swapped"]) == 5  # versions 1, 2, 3, the rollback, 4
    with rig(shadow=True, swap="reload") as (session, control, out):
        assert session.send(slow(5.0, 0), specs=SPECS) == 1
    assert out["sum"] == 5.0 * WHOLE and out["swapped"] == []


def test_a_shadow_load_that_fails_leaves_its_version_used_and_the_next_default_send_lands() -> None:
    """The shadow's processing fails after the bytes arrived: the send raises naming it, the engine serves
    version 1 still, and the next default send lands at once (the failed number is not sent again to be
    refused as not newer)."""
    with rig(shadow=True) as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("fail_next_prepare")
        with pytest.raises(WeightSyncError, match="the shadow's processing failed") as e:
            session.send(slow(2.0, 0), specs=SPECS)
        assert "not newer" not in str(e.value), e.value
        assert control.probe([])[0] == _means(1.0)
        v = session.send(slow(3.0, 0), specs=SPECS)
        assert v in (2, 3), v
    assert out["version"] == v and out["sum"] == 3.0 * WHOLE


def test_a_commit_that_outlives_its_bound_fails_the_send_in_time_and_the_next_send_waits_for_it() -> None:
    """One engine, no fleet: a commit that takes 4.5 s with timeout_s=3 fails the send at its bound (naming
    it), not when the engine returns; the next send waits for that commit first, then lands after it (the
    engine served version 2 meanwhile)."""
    with rig(timeout_s=3, liveness_s=1) as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("slow_next_commit", 4.5)
        with pytest.raises(WeightSyncError, match=r"commit of version 2 did not return within timeout_s=3"):
            session.send(slow(2.0, 0), specs=SPECS)
        assert [c for c, _, _ in control.log].count("commit") == 1  # raised while the engine's runs on
        assert session.send(slow(3.0, 0), specs=SPECS) == 3
        assert session.version == 3
    assert out["version"] == 3 and out["sum"] == 3.0 * WHOLE


@pytest.mark.slow  # about 16 s: a halt's bounds run out once
def test_a_landing_that_cannot_be_stopped_is_named_and_later_updates_are_refused_at_once() -> None:
    """The shadow's processing hangs in a loader call past its sync: the send fails at its bound; the next
    one finds the landing does not stop when its bridge is aborted (within the liveness bound) and says the
    worker's own landing is stuck and what to do; the ones after are refused at once, naming it, and not
    as "the trainer abandoned the update"; once the call returns, the next update lands."""
    with rig(shadow=True, timeout_s=4, liveness_s=1) as (session, control, out):
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        control.rpc("hang_next_prepare")
        with pytest.raises(PeerTimeoutError, match="passed its vote"):  # its acknowledgement never came
            session.send(slow(2.0, 0), specs=SPECS)
        texts, took = [], []
        for value in (3.0, 4.0, 5.0):
            t0 = time.monotonic()
            # the first may find the worker still halting its landing (liveness_s + 5 s) past timeout_s
            with pytest.raises(WeightSyncError if value > 3 else (WeightSyncError, JoinTimeoutError)) as e:
                session.send(slow(value, 0), specs=SPECS)
            texts.append(str(e.value))
            took.append(time.monotonic() - t0)
        assert all(
            "landing of version 2 is stuck" in t and "restart the engine's workers" in t for t in texts[-2:]
        ), texts
        assert not any("abandoned" in t for t in texts), texts
        assert took[-1] < 3, took  # refused at once, not after another halt
        assert control.probe([])[0] == _means(1.0)
        control.rpc("release_prepare")
        time.sleep(1)
        v = session.send(slow(6.0, 0), specs=SPECS)
    assert out["version"] == v and out["sum"] == 6.0 * WHOLE


def test_with_a_shadow_the_engine_serves_through_the_handshake_too() -> None:
    """Through a shadow, an atomic update's handshake runs on the landing thread (its dry run on the
    shadow): the engine's call that begins the update returns at once, however long the dry run takes, and
    the engine serves meanwhile. A manifest the dry run refuses is refused on both sides all the same: the
    trainer raises, the engine commits nothing and serves its version; the next update lands."""
    with rig(shadow=True) as (session, control, out):
        control.rpc("slow_checks", 1.0)
        assert session.send(slow(1.0, 0), specs=SPECS) == 1
        (_, t0, t1), *_ = [e for e in control.log if e[0] == "begin"]
        assert t1 - t0 < 0.5, control.log
        ticks = [t for t in control.rpc("ticks") if t0 < t < t0 + 1.0]
        assert len(ticks) > 10, "the engine did not serve through the handshake"
        with pytest.raises(ManifestMismatchError, match="this model has no extra"):
            session.send([(n, torch.full(s, 2.0)) for n, s in SHAPES.items()] + [("extra", torch.ones(2))])
        assert control.probe([])[0] == _means(1.0)
        control.rpc("slow_checks", 0.0)
        assert session.send(slow(3.0, 0), specs=SPECS) == 2
    assert out["version"] == 2 and out["sum"] == 3.0 * WHOLE


class _Slow(EngineControl):
    """An engine whose calls take ``delay[call]`` seconds, recording when each ran."""

    def __init__(self, **delay: float) -> None:
        self.delay = delay
        self.log: list[tuple[str, float, float]] = []

    def _call(self, what: str) -> None:
        t0 = time.monotonic()
        time.sleep(self.delay.get(what, 0.0))
        self.log.append((what, t0, time.monotonic()))

    def join(self, info: dict[str, Any]) -> None:
        self._call("join")

    def begin(self, version: int) -> None:
        self._call("begin")

    def commit(self, version: int) -> None:
        self._call("commit")

    def leave(self) -> None:
        self._call("leave")


def test_a_fleet_orders_an_engines_calls_after_one_that_outlived_its_bound() -> None:
    """An engine's join outlives the fleet's bound (a slow proxy): the join raises, naming it; the next call
    reaches that engine only once the late join returned, so a late call never lands after a later one.
    A late call that outlives the next call's bound too keeps that call from the engine, and says so."""
    info = {"sources": 1, "world_size": 3}
    engines = [_Slow(), _Slow(join=1.6)]
    fleet = Fleet(engines, timeout_s=1)
    with pytest.raises(WeightSyncError, match=r"engine 1: did not return within 1 s"):
        fleet.join(info)
    fleet.begin(5)  # at once: engine 1's begin waits for its late join (0.6 s more)
    (join, begin) = engines[1].log
    assert join[0] == "join" and begin[0] == "begin" and begin[1] >= join[2], engines[1].log
    engines[1].delay["join"] = 2.5
    with pytest.raises(WeightSyncError, match=r"engine 1"):
        fleet.join(info)
    with pytest.raises(WeightSyncError, match=r"engine 1: .*(join .*still running.*not sent|did not return)"):
        fleet.commit(5)
    time.sleep(2.0)  # the late join lands
    assert [c[0] for c in engines[1].log] == ["join", "begin", "join"], engines[1].log  # no commit reached it
    fleet.commit(6)  # the engine is in order again
    assert [c[0] for c in engines[1].log][-1] == "commit"


@pytest.mark.timeout(60)
def test_the_engine_layer_and_the_http_client_import_nothing_of_vllm() -> None:
    """A trainer that talks to ``vllm serve`` on another host (TRL's) runs where vLLM is not installed: the
    engine layer, the vLLM package and its HTTP client import none of vLLM until a name of the package is
    taken."""
    import subprocess
    import sys

    code = (
        "import sys, groupbridge.engine, groupbridge.trl, groupbridge.vllm, groupbridge.vllm._control\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout[-2000:], out.stderr[-2000:])


def test_the_http_client_keeps_the_cause_of_each_error() -> None:
    """An error status and a refused connection raise RuntimeError naming the request, with its cause
    chained (it used to be dropped), so that a caller can tell the two apart."""
    import http.server
    import socket
    import urllib.error

    from groupbridge.vllm._control import HttpClient

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")

        def log_message(self, *args: Any) -> None: ...

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    serving = threading.Thread(target=srv.serve_forever, daemon=True)
    serving.start()
    try:
        with pytest.raises(RuntimeError, match="HTTP 503: busy") as e:
            HttpClient(f"http://127.0.0.1:{srv.server_port}", timeout=5).post("update_weights", {})
        assert isinstance(e.value.__cause__, urllib.error.HTTPError)
    finally:
        srv.shutdown()
        srv.server_close()
    with socket.socket() as bound:  # bound, never listening: a connection to it is refused
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(RuntimeError, match="bounded by 5 s") as e:
            HttpClient(f"http://127.0.0.1:{bound.getsockname()[1]}", timeout=5).get("weight_info")
    assert isinstance(e.value.__cause__, urllib.error.URLError)


def test_no_version_past_the_largest_reaches_the_engine() -> None:
    """A send of version 2**62 is refused before the engine hears of it; the largest version is sent; then
    the next default version would be out of range: refused at once, saying what clears it. A second
    trainer cannot follow either; one connected with reset_versions=True starts again from 1 and lands."""
    with rig() as (session, control, out):
        with pytest.raises(ValueError, match="out of range"):
            session.send(slow(1.0, 0), specs=SPECS, version=1 << 62)
        assert session.send(slow(2.0, 0), specs=SPECS, version=(1 << 62) - 1) == (1 << 62) - 1
        with pytest.raises(ValueError, match=r"reset_versions=True"):
            session.send(slow(3.0, 0), specs=SPECS)
        config = TrainerConfig(timeout_s=30, liveness_s=10, bucket_bytes=32 << 10)
        second = TrainerSession(config, Control(control.calls, control.replies))
        try:
            e = refused_after_takeover(lambda: second.send(slow(4.0, 0), specs=SPECS, version=7))
            assert "reset_versions=True" in str(e) and e.newest == (1 << 62) - 1, e
        finally:
            second.close()
        third = TrainerSession(
            dataclasses.replace(config, reset_versions=True), Control(control.calls, control.replies)
        )
        try:
            assert third.send(slow(5.0, 0), specs=SPECS) == 1
            assert third.send(slow(6.0, 0), specs=SPECS) == 2
        finally:
            third.close()
    assert out["version"] == 2 and out["sum"] == 6.0 * WHOLE
    with pytest.raises(ValueError, match="reset_versions"):
        TrainerConfig(reset_versions="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="first_version"):
        TrainerConfig(first_version=1 << 62)
