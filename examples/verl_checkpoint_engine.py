"""groupbridge as verl's checkpoint engine, and the calls verl's manager makes on it.

In a verl job, two config keys select it (no fork of verl)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=groupbridge
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=groupbridge.verl
    # optional, per backend:
    # ...checkpoint_engine.engine_kwargs.groupbridge.{host,sources,token,transport,delta}

This script makes verl's calls itself, in verl's order, with one actor process and one rollout process
(verl's manager needs a Ray cluster of its workers and a rollout server): ``prepare`` on both,
``build_topology`` here, ``init_process_group`` on both, ``send_weights`` beside ``receive_weights``,
``finalize``; three updates, each a bridge of its own, with ``delta="always"``: the actor keeps its base
across them, so from the second update on only what changed travels (each step here moves 2 % of the
values; the actor's line prints the bytes and the bytes on the wire).

    python examples/verl_checkpoint_engine.py
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import torch

WEIGHTS = {"embed.weight": (512, 64), "layers.0.mlp.weight": (256, 64), "lm_head.weight": (512, 64)}
STEPS = (1, 2, 3)


def weights(step: int) -> Any:
    """The policy at ``step``: each step moves 2 % of every tensor's values (what an optimizer step with a
    small learning rate does to bf16 weights, roughly)."""
    for i, (name, shape) in enumerate(WEIGHTS.items()):
        t = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) / 1000 + i
        for k in range(1, step + 1):
            t.view(-1)[k % 50 :: 50] += k
        yield name, t


def worker(role: str, meta: Any, topology: Any, done: Any) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("groupbridge.verl")  # what verl does with custom_backend_module
    kw = {"is_master": True} if role == "actor" else {}  # verl's actor rank 0 is the master
    # delta="always": diff every update (True: only where that beats sending; not over shared memory)
    engine = CheckpointEngineRegistry.new(
        "groupbridge", bucket_size=1 << 20, timeout=60, delta="always", **kw
    )

    async def receive(step: int) -> str:
        got = {n: t.clone() async for n, t in engine.receive_weights(global_steps=step)}
        ok = all(torch.equal(got[n], t) for n, t in weights(step))
        return f"rollout: step {step}: {len(got)} tensors, {'equal' if ok else 'DIFFERENT'} to the actor's"

    for step in STEPS:
        meta.put((role, engine.prepare()))
        engine.init_process_group(**topology.get(timeout=60))
        if role == "actor":
            m = asyncio.run(engine.send_weights(weights(step), global_steps=step))
            kind = "delta" if m["groupbridge/delta"] else "full"
            done.put(
                f"actor: step {step}: {m['groupbridge/bytes'] / 1e3:.0f} kB, "
                f"{m['groupbridge/wire_bytes'] / 1e3:.1f} kB on the wire ({kind}, "
                f"{m['groupbridge/changed_fraction']:.1%} changed) in {m['groupbridge/seconds']:.3f} s"
            )
        else:
            done.put(asyncio.run(receive(step)))
        engine.finalize()


def main() -> None:
    from groupbridge.verl import GroupBridgeCheckpointEngine

    ctx = mp.get_context("spawn")
    meta, done = ctx.Queue(), ctx.Queue()
    topo = {"actor": ctx.Queue(), "rollout": ctx.Queue()}
    procs = [ctx.Process(target=worker, args=(r, meta, topo[r], done)) for r in ("actor", "rollout")]
    for p in procs:
        p.start()
    try:
        for _ in STEPS:  # verl's manager, each update
            got = dict(meta.get(timeout=120) for _ in range(2))
            actor, rollout = GroupBridgeCheckpointEngine.build_topology(1, 1, [got["actor"], got["rollout"]])
            topo["actor"].put({k: v[0] for k, v in actor.items()})
            topo["rollout"].put({k: v[0] for k, v in rollout.items()})
            for _ in range(2):
                print(done.get(timeout=120))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


if __name__ == "__main__":
    main()
