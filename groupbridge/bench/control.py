"""Control-plane latency: ``broadcast_obj`` of a small dict from rank 0 to two receivers, per operation.

Measured side by side, in interleaved rounds of one run, against the peer approach: vLLM's
``StatelessProcessGroup`` when vLLM is importable, else the same protocol written out on a raw TCPStore
(``set`` of a pickle by the source, blocking ``get`` by the receivers, keys never freed, no bound on a
frozen store: what vLLM's group does). Ours runs with keys freed, every wait bounded, writes acknowledged,
and (the ``sealed`` row) a token, so every value carries a MAC.
"""

from __future__ import annotations

import pickle
import statistics
import time
from datetime import timedelta
from typing import Any

from .._procs import publish_listener, run_roles

__all__ = ["run_control"]

PAYLOAD = {"step": 7, "lr": 1e-6, "names": ["a", "b", "c"], "ok": True}


def _peer_loop(store: Any, rank: int, tag: str, ops: int) -> None:
    for i in range(ops):
        key = f"peer/{tag}/{i}"
        if rank == 0:
            store.set(key, pickle.dumps(PAYLOAD))
        else:
            pickle.loads(store.get(key))


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
    out: dict[str, list[float]] = {"ours": [], "ours_sealed": [], "peer": [], "peer_name": [peer_name]}  # type: ignore[list-item]
    obj = PAYLOAD if rank == 0 else None
    for rnd in range(rounds):
        for label in ("ours", "peer", "ours_sealed"):
            plain.barrier()
            t0 = time.perf_counter()
            if label == "peer":
                _run_peer(peer, rank, f"{rnd}", ops)
            else:
                group = plain if label == "ours" else sealed
                for _ in range(ops):
                    group.broadcast_obj(obj, src=0)
            out[label].append((time.perf_counter() - t0) / ops * 1e6)
    plain.barrier()
    sealed.close()
    plain.close()
    return out


def _run_peer(peer: Any, rank: int, tag: str, ops: int) -> None:
    kind, obj = peer
    if kind == "vllm":
        for _ in range(ops):
            obj.broadcast_obj(PAYLOAD if rank == 0 else None, src=0)
    else:
        _peer_loop(obj, rank, tag, ops)


def run_control(ops: int = 400, rounds: int = 5, receivers: int = 2) -> list[dict[str, Any]]:
    """Per-operation microseconds on each receiver (median of rounds) and the ratio to the peer's."""
    n = receivers + 1
    import multiprocessing as mp

    ports = mp.get_context("spawn").Queue()
    results = run_roles(_role, n, (n, ports, ops, rounds), timeout=300)
    peer_name = results[0]["peer_name"][0]
    records = []
    for label in ("peer", "ours", "ours_sealed"):
        per_rank = [statistics.median(r[label]) for r in results[1:]]
        ratios = [
            statistics.median(a / b for a, b in zip(r[label], r["peer"], strict=True)) for r in results[1:]
        ]
        records.append({
            "mode": peer_name if label == "peer" else label,
            "us_per_receive": round(statistics.median(per_rank), 1),
            "us_range": [round(min(per_rank), 1), round(max(per_rank), 1)],
            "vs_peer": round(statistics.median(ratios), 2),
            "keys_freed": label != "peer",
        })  # fmt: skip
    return records
