"""A world with no backend named anywhere: run under torchrun, each rank prints its GlobalGroup.

.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/torchrun_hello.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import groupbridge as gb


def main() -> None:
    g = gb.init_global_group()
    t = torch.tensor([float(g.rank + 1)])
    dist.all_reduce(t)
    objs: list[object] = [f"hello from rank {g.rank}" if g.rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    print(f"{g}  all_reduce(rank+1)={t.item():g}  broadcast_object_list -> {objs[0]!r}", flush=True)
    gb.destroy_global_group()


if __name__ == "__main__":
    main()
