"""Launched by the real torchrun CLI in tests: names no backend, writes what it saw."""

import json
import os
import sys

import torch
import torch.distributed as dist

import groupbridge as gb

g = gb.init_global_group()
t = torch.tensor([float(g.rank + 1)])
dist.all_reduce(t)
objs: list[object] = [{"from": g.rank, "payload": [1, 2, 3]} if g.rank == 0 else None]
dist.broadcast_object_list(objs, src=0)
again = gb.init_global_group()
with open(os.path.join(sys.argv[1], f"rank{g.rank}.json"), "w") as f:
    json.dump(
        {
            "group": [g.rank, g.local_rank, g.world_size, g.backend, g.device],
            "sum": t.item(),
            "obj": objs[0],
            "idempotent": again == g,
        },
        f,
    )
gb.destroy_global_group()
gb.destroy_global_group()
