"""Control-plane latency: ``broadcast_obj`` of a small dict from rank 0 to two receivers, per operation.

Measured side by side, in interleaved rounds of one run, against the peer approach: vLLM's
``StatelessProcessGroup`` when vLLM is importable, else the same protocol written out on a raw TCPStore
(``set`` of a pickle by the source, blocking ``get`` by the receivers, keys never freed, no bound on a
frozen store: what vLLM's group does). Ours runs with keys freed, every wait bounded, writes acknowledged,
and (the ``sealed`` row) a token, so every value carries a MAC. A third anchor is the peer with its writes
acknowledged as ours are (the source's ``set`` followed by a ``check`` on the same connection, answered
once the set is applied): what that guarantee costs by itself, with none of our Python.

Two measures of each: *back to back* (``ops`` broadcasts in a row, time per receive: a stream's
throughput; vLLM's source never waits for the store, so it runs ahead and leaves the cores to its
receivers, while ours waits for each acknowledgement) and *one at a time* (the source stamps the object
and sends the next only 2 ms later, meant to find every receiver already waiting: the delay from the
source's call to a receiver holding the object, what one control message costs a caller).
"""

from __future__ import annotations

import itertools
import pickle
import statistics
import time
from datetime import timedelta
from typing import Any

from .._procs import publish_listener, run_roles

__all__ = ["run_control"]

PAYLOAD = {"step": 7, "lr": 1e-6, "names": ["a", "b", "c"], "ok": True}


SPACING_S = 0.002
"""One at a time: the source's pause before each broadcast (every receiver is waiting by then)."""


def _raw_broadcast(store: Any, rank: int, tag: str) -> Any:
    """vLLM's object protocol on a raw store: the source ``set``s a pickle under the next key, the receivers
    ``get`` it (waiting until it exists); keys are never freed."""
    keys = (f"peer/{tag}/{i}" for i in itertools.count())

    def bcast(obj: Any) -> Any:
        key = next(keys)
        if rank == 0:
            store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(store.get(key))

    return bcast


_ACK_KEY = "groupbridge-bench/ack"
"""The key the acknowledged peer's source checks: any key does, the answer comes after its set is applied."""


def _acked(bcast: Any, store: Any, rank: int) -> Any:
    """``bcast`` (the peer's) with the source's write acknowledged, as ours are."""

    def acked(obj: Any) -> Any:
        out = bcast(obj)
        if rank == 0:
            store.check([_ACK_KEY])
        return out

    return acked


def _spaced(bcast: Any, rank: int, ops: int) -> list[float]:
    """One at a time: each receiver's delay from the source's call to holding the object, in seconds."""
    delays = []
    for _ in range(ops):
        if rank == 0:
            time.sleep(SPACING_S)
            bcast({**PAYLOAD, "t": time.perf_counter()})
        else:
            got = bcast(None)
            delays.append(time.perf_counter() - got["t"])
    return delays


def _role(rank: int, n: int, ports: Any, ops: int, rounds: int) -> dict[str, list[float]]:
    import groupbridge as gb

    from .._torch_private import TCPStore

    def new_group(name: str, token: str | None) -> Any:
        lis, port = publish_listener(rank, n, ports, "127.0.0.1")
        return gb.StatelessGroup.create(
            "127.0.0.1", port, rank=rank, world_size=n, listener=lis, name=name, token=token
        )

    plain = new_group("plain", None)
    sealed = new_group("sealed", "bench")
    port = plain.address.port
    peer_name = "vllm StatelessProcessGroup"
    try:
        from vllm.distributed.utils import StatelessProcessGroup

        probe, vport = publish_listener(rank, n, ports, "127.0.0.1")
        if probe is not None:  # vLLM binds the port itself: pick one (its own port race, not ours)
            probe.close()
        peer: Any = ("vllm", StatelessProcessGroup.create("127.0.0.1", vport, rank, n))
    except Exception:  # vLLM absent: the same protocol on a raw store
        peer_name = "raw TCPStore (vLLM's protocol)"
        peer = (
            "raw",
            TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False),
        )
    out: dict[str, list[Any]] = {label: [] for label in LABELS}
    out["peer_name"] = [peer_name]
    obj = PAYLOAD if rank == 0 else None
    spaced_ops = max(ops // 4, 20)
    for rnd in range(rounds):
        for label in ORDER:
            plain.barrier()
            t0 = time.perf_counter()
            if label.startswith("peer"):
                _run_peer(peer, rank, f"{label}{rnd}", ops, spaced=False, acked=label == "peer_acked")
            else:
                group = plain if label == "ours" else sealed
                for _ in range(ops):
                    group.broadcast_obj(obj, src=0)
            out[label].append((time.perf_counter() - t0) / ops * 1e6)
        for label in ORDER:
            plain.barrier()
            if label.startswith("peer"):
                delays = _run_peer(
                    peer, rank, f"s{label}{rnd}", spaced_ops, spaced=True, acked=label == "peer_acked"
                )
            else:
                group = plain if label == "ours" else sealed
                delays = _spaced(lambda o, g=group: g.broadcast_obj(o, src=0), rank, spaced_ops)
            out[f"{label}_1"].append([d * 1e6 for d in delays])
    plain.barrier()
    sealed.close()
    plain.close()
    return out


ROWS = ("peer", "peer_acked", "ours", "ours_sealed")
"""The modes, in the table's order."""
ORDER = ("ours", "peer", "peer_acked", "ours_sealed")
"""The modes, in each round's order."""
LABELS = ROWS + tuple(f"{label}_1" for label in ROWS)


def _run_peer(peer: Any, rank: int, tag: str, ops: int, spaced: bool, acked: bool) -> list[float]:
    kind, obj = peer
    bcast = (lambda o: obj.broadcast_obj(o, src=0)) if kind == "vllm" else _raw_broadcast(obj, rank, tag)
    if acked:
        bcast = _acked(bcast, obj.store if kind == "vllm" else obj, rank)
    if spaced:
        return _spaced(bcast, rank, ops)
    for _ in range(ops):
        bcast(PAYLOAD if rank == 0 else None)
    return []


def _per_round(figures: list[Any], suffix: str) -> list[float]:
    """A receiver's figure per round: back to back (no suffix) the round's time per receive, one at a time
    the round's median delay."""
    return [statistics.median(d) for d in figures] if suffix else list(figures)


def _mode(label: str, peer_name: str) -> str:
    return {"peer": peer_name, "peer_acked": f"{peer_name}, writes acknowledged"}.get(label, label)


def run_control(ops: int = 400, rounds: int = 5, receivers: int = 2) -> list[dict[str, Any]]:
    """Per mode, ``us_per_receive`` is the median over receivers of each receiver's median over rounds of:
    back to back, the microseconds per receive of the round (``worst_us``: the slowest round); one at a time,
    the round's median delay (``worst_us``: the longest single delay). ``us_range``: the receivers' lowest
    and highest. ``vs_peer``: the median over receivers of the median over rounds of the ratio to the
    peer's."""
    n = receivers + 1
    import multiprocessing as mp

    ports = mp.get_context("spawn").Queue()
    results = run_roles(_role, n, (n, ports, ops, rounds), timeout=300)
    peer_name = results[0]["peer_name"][0]
    receivers_out = results[1:]

    def record(label: str, measure: str) -> dict[str, Any]:
        """One row of the table: ``label``'s figures on every receiver, beside the peer's."""
        suffix = "" if measure == "back to back" else "_1"  # one at a time: a list of delays per round
        rounds_of = [_per_round(r[label + suffix], suffix) for r in receivers_out]
        peer_of = [_per_round(r["peer" + suffix], suffix) for r in receivers_out]
        per_rank = [statistics.median(m) for m in rounds_of]
        ratios = [
            statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
            for mine, theirs in zip(rounds_of, peer_of, strict=True)
        ]
        worst = max(max(d) if suffix else d for r in receivers_out for d in r[label + suffix])
        return {
            "mode": _mode(label, peer_name),
            "measure": measure,
            "us_per_receive": round(statistics.median(per_rank), 1),
            "us_range": [round(min(per_rank), 1), round(max(per_rank), 1)],
            "worst_us": round(worst, 1),
            "vs_peer": round(statistics.median(ratios), 2),
            "keys_freed": not label.startswith("peer"),
        }

    return [record(label, measure) for measure in ("back to back", "one at a time") for label in ROWS]
