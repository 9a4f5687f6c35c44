"""One side of `make bench-check`: three ranks running the check's cases with whatever groupbridge is on
PYTHONPATH (the working tree or the base revision's), on the driver's command.

Only the public API is used, so that the same cases run on both revisions. Rank 0 reads commands on stdin
(one JSON object a line: ``{"case": name, "iters": n}`` or ``{"quit": true}``), tells ranks 1 and 2 through
the bridge, times every iteration and answers on stdout (one JSON object a line). torch's thread settings
are left as a user's would be: a regression that only shows with the default intra-op pool must show here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from datetime import timedelta
from typing import Any

import torch

import groupbridge as gb

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)
CASE_TIMEOUT = timedelta(seconds=15)
"""A case that takes longer has hung (a base revision with a bug that deadlocks): reported, not waited for."""
MIB = 1 << 20

# name -> (members, transport, delta, tensors, tensor_bytes, bucket_bytes)
CASES: dict[str, tuple[int, str, Any, int, int, int]] = {
    "objects": (3, "", False, 0, 0, 0),
    "broadcast-1": (2, "broadcast", False, 32, 2 * MIB, 16 * MIB),
    "broadcast-2": (3, "broadcast", False, 32, 2 * MIB, 16 * MIB),
    "shm-2": (3, "shm", False, 48, 2 * MIB, 8 * MIB),
    "relay-2": (3, "relay", False, 32, 2 * MIB, 16 * MIB),
    "delta-shm-2": (3, "shm", "always", 48, 2 * MIB, 8 * MIB),
    "small-shm-2": (3, "shm", False, 4, 64 << 10, 8 * MIB),
    "small-broadcast-2": (3, "broadcast", False, 4, 64 << 10, 16 * MIB),
}
OBJECT_OPS = 50


def _model(tensors: int, tensor_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    numel = tensor_bytes // 2
    return {
        f"layers.{i}.weight": torch.randn(numel, generator=g).to(torch.bfloat16).view(64, numel // 64)
        for i in range(tensors)
    }


def _step(model: dict[str, torch.Tensor], version: int) -> None:
    """A small update, as a training step makes for a delta: one row in sixty-four of every tensor."""
    for t in model.values():
        t[version % 64].add_(1.0)


class Side:
    """This rank's control group and, per case, a group of its own with its sender or receiver (made on
    first use, kept: rounds are warm). A case that fails is reported and dropped, its group closed: a base
    revision with a bug that hangs must not stop the comparison of the other cases."""

    def __init__(self, rank: int, port: int, listener: Any = None) -> None:
        self.rank = rank
        self.ctl = gb.StatelessGroup.create(
            HOST, port, rank=rank, world_size=3, listener=listener, name="check", timeout=TIMEOUT
        )
        self.groups: dict[str, Any] = {}
        self.ends: dict[str, Any] = {}
        self.models: dict[str, dict[str, torch.Tensor]] = {}
        self.versions: dict[str, int] = {}

    def _group(self, case: str, members: int) -> Any:
        if case not in self.groups:
            lis = gb.listen(HOST, 0) if self.rank == 0 else None
            port = self.ctl.broadcast_obj(
                lis.address.port if lis is not None else None, src=0, timeout=TIMEOUT
            )
            self.groups[case] = (
                gb.StatelessGroup.create(
                    HOST, port, rank=self.rank, world_size=members, listener=lis, name=case, timeout=TIMEOUT
                )
                if self.rank < members
                else None
            )
        return self.groups[case]

    def run(self, case: str, iters: int) -> list[float]:
        members = CASES[case][0] if case in CASES else 3
        g = self._group(case, members)
        if g is None:
            return []
        if case == "objects":
            return self._objects(g, iters)
        _, transport, delta, tensors, tensor_bytes, bucket_bytes = CASES[case]
        if case not in self.ends:
            self.models[case] = _model(tensors, tensor_bytes, seed=self.rank)
            self.versions[case] = 0
            extra = {"delta": delta} if delta else {}  # a base older than delta sync has no such argument
            self.ends[case] = (
                gb.WeightSender(g, bucket_bytes=bucket_bytes, transport=transport, **extra)
                if self.rank == 0
                else gb.WeightReceiver(g, src=0)
            )
        model, end = self.models[case], self.ends[case]
        times = []
        for _ in range(iters):
            self.versions[case] += 1
            v = self.versions[case]
            if self.rank == 0:
                if delta:
                    _step(model, v)
                t0 = time.perf_counter()
                end.send(model, version=v, timeout=CASE_TIMEOUT)
                times.append(time.perf_counter() - t0)
            else:
                end.receive_into(model, atomic=False, timeout=CASE_TIMEOUT)
        return times

    def _objects(self, g: Any, iters: int) -> list[float]:
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            for j in range(OBJECT_OPS):
                g.broadcast_obj({"step": i, "op": j} if self.rank == 0 else None, src=0, timeout=CASE_TIMEOUT)
                g.all_gather_obj(self.rank, timeout=CASE_TIMEOUT)
            times.append((time.perf_counter() - t0) / OBJECT_OPS)
        return times

    def serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Run one command on this rank; every rank then meets at the control group's barrier."""
        case = cmd["case"]
        try:
            reply: dict[str, Any] = {"case": case, "times": self.run(case, cmd["iters"])}
        except Exception as e:
            reply = {"case": case, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            self.drop(case)
        self.ctl.barrier(timeout=TIMEOUT)
        return reply

    def drop(self, case: str) -> None:
        end, g = self.ends.pop(case, None), self.groups.pop(case, None)
        for thing in (end, g):
            try:
                if thing is not None:
                    thing.close()
            except Exception:  # a broken case's group may fail to close cleanly; it is abandoned anyway
                pass

    def close(self) -> None:
        for case in list(self.groups):
            self.drop(case)
        self.ctl.close()


def _peer(rank: int, port: int) -> None:
    side = Side(rank, port)
    while True:
        cmd = side.ctl.broadcast_obj(None, src=0, timeout=timedelta(hours=1))
        if cmd.get("quit"):
            break
        side.serve(cmd)
    side.close()


def main() -> None:
    lis = gb.listen(HOST, 0)
    ctx = mp.get_context("spawn")
    peers = [ctx.Process(target=_peer, args=(r, lis.address.port), daemon=True) for r in (1, 2)]
    for p in peers:
        p.start()
    side = Side(0, lis.address.port, lis)
    print(json.dumps({"ready": True, "groupbridge": gb.__file__}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            side.ctl.broadcast_obj(cmd, src=0, timeout=TIMEOUT)
            if cmd.get("quit"):
                break
            print(json.dumps(side.serve(cmd)), flush=True)
    finally:
        side.close()
        for p in peers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
