"""``groupbridge demo`` on real parts: two trainer ranks update two vLLM engines as one fleet, every step.

The loop is the one RL post-training runs (one step off-policy): while the trainer learns from batch t, the
engines already generate batch t+1 with the weights of step t; then the trainer sends its new weights and
the engines serve them. The trainer is a world of two ranks (``init_global_group``: data parallel, the
gradients averaged over gloo); each rank sends only its own rows of every tensor (``sources=2``), and the
engines' workers assemble whole tensors. The two engines are offline ``vllm.LLM`` s behind one
``FleetClient``: one bridge, one commit on both or neither.

Every step shows what a user of such a loop needs to see: the version each engine reports, the sync time,
the serving stall (the swap, the only part of an atomic update during which an engine does not generate:
the bytes land while it serves), and a check that each engine's greedy tokens are the trainer's model's
(``transformers``' greedy generation on trainer rank 0). A failed check makes the demo exit non-zero.

The task is a toy one so that learning shows in a few steps: the reward is the share of even token ids in
a completion, learnt by REINFORCE. The model is a small random Qwen2 built from a ``transformers`` config
(no download).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _console

__all__ = ["VllmDemoConfig", "run_vllm_demo"]

PROMPT_LEN, NEW_TOKENS, BATCH = 4, 16, 8
CHECK_PROMPTS = [[1, 2, 3, 4], [7, 100, 5], [300, 11]]
CHECK_TOKENS = 8
WAIT_S = 300.0
"""The bound on every wait of the demo (a rank's start, a generation, a sync)."""


@dataclass(kw_only=True)
class VllmDemoConfig:
    steps: int = 10
    host: str = "127.0.0.1"
    """Where trainer rank 0 hosts the bridge (IPv4, IPv6 or a name)."""
    json: bool = False
    lr: float = 2e-3


def reward(tokens: list[int]) -> float:
    """The toy task: the share of even token ids."""
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


class _Rows:
    """A vLLM ``WeightSource`` that yields this rank's rows of every tensor as ``gb.Shard`` values.

    The demo's ranks hold whole replicas (data parallel); a rank of a sharded trainer (FSDP2, DTensor)
    yields what it holds the same way, and no rank ever gathers the model."""

    def __init__(self, model: Any, rank: int, ranks: int) -> None:
        self.model, self.rank, self.ranks = model, rank, ranks

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        from .weights.shard import Shard

        for name, p in self.model.named_parameters():
            pieces = torch.chunk(p.detach(), self.ranks, 0)
            if self.rank < len(pieces):
                start = sum(len(q) for q in pieces[: self.rank])
                yield name, Shard(pieces[self.rank], tuple(p.shape), (start,) + (0,) * (p.dim() - 1))


def _train_step(model: Any, opt: Any, batch: list[tuple[list[int], list[int]]], world: int) -> float:
    """REINFORCE on this rank's half of the batch; gradients averaged over the trainer world."""
    rewards = torch.tensor([reward(c) for _, c in batch])
    advantage = rewards - rewards.mean()
    ids = torch.tensor([p + c for p, c in batch])
    logits = model(ids).logits[:, PROMPT_LEN - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
    loss = -(advantage[:, None] * logp).mean()
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean.item()) / world


def _second_rank(path: str, world_port: int, host: str, steps: int, lr: float) -> None:
    """Trainer rank 1, a process of its own: no engine at hand, it only sends its rows."""
    import transformers
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from .global_group import destroy_global_group, init_global_group
    from .vllm import TrainerInitInfo

    torch.set_num_threads(1)
    init_global_group(rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{world_port}",
                      timeout=timedelta(seconds=WAIT_S))  # fmt: skip
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)  # the bridge's port (bound by rank 0) and the fleet's workers
        port, workers = box[0]
        info = TrainerInitInfo(rank=1, sources=2, host=host, port=port, workers=workers, timeout_s=WAIT_S,
                               liveness_s=20)  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=_Rows(model, 1, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        try:
            for step in range(1, steps + 1):
                box = [None]
                dist.broadcast_object_list(box, src=0)  # the batch rank 0 generated (None: rank 0 stopped)
                if box[0] is None:
                    raise RuntimeError(f"trainer rank 0 stopped before step {step}")
                _train_step(model, opt, box[0][1::2], 2)  # the odd half; rank 0 learns from the even one
                engine.send_weights()  # this rank's rows of the new version
        finally:
            engine.shutdown()
    finally:
        destroy_global_group()


def _generate(llm: Any, prompts: list[list[int]], seed: int) -> list[list[int]]:
    import vllm

    sp = vllm.SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy(llm: Any) -> list[list[int]]:
    import vllm

    sp = vllm.SamplingParams(max_tokens=CHECK_TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in CHECK_PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _reference(model: Any) -> list[list[int]]:
    """``transformers``' greedy tokens of the trainer's model: what every engine must serve."""
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=CHECK_TOKENS, min_new_tokens=CHECK_TOKENS,
                           do_sample=False)[0, len(p):].tolist()
            for p in CHECK_PROMPTS
        ]  # fmt: skip


def _engine(path: str) -> Any:
    import vllm

    return vllm.LLM(
        path, dtype="float32", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=BATCH,
        enforce_eager=True, kv_cache_memory_bytes=1 << 30, weight_transfer_config={"backend": "groupbridge"},
    )  # fmt: skip


def _print(cfg: VllmDemoConfig, text: str) -> None:
    if not cfg.json:
        _console.echo(text)


def run_vllm_demo(cfg: VllmDemoConfig) -> dict[str, Any]:
    """Run the demo; return one row per step and whether every engine served every version it was sent."""
    if cfg.steps < 1:
        raise ValueError(f"steps={cfg.steps} must be >= 1")
    from .global_group import destroy_global_group, init_global_group
    from .net import listen
    from .vllm import shutdown
    from .vllm.models import make_model

    t_start = time.monotonic()
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo's table, not vLLM's start-up log
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="groupbridge-demo-") as path:
        model = make_model(path, "qwen2")
        world = listen("127.0.0.1", 0)
        ctx = mp.get_context("spawn")
        second = ctx.Process(
            target=_second_rank, args=(path, world.port, cfg.host, cfg.steps, cfg.lr), name="trainer-rank-1"
        )
        second.start()  # it imports torch and transformers while the engines start
        engines: list[Any] = []
        try:
            _print(cfg, "[demo] starting two vLLM engines (offline LLM, the CPU build) ...")
            for _ in range(2):
                engines.append(_engine(path))
            init_global_group(rank=0, world_size=2, listener=world, timeout=timedelta(seconds=WAIT_S))
            try:
                rows = _lead(cfg, model, engines, t_start)
            finally:
                destroy_global_group()
        finally:
            second.join(WAIT_S if rows else 10)
            if second.is_alive():
                second.kill()
                second.join(10)
            with ThreadPoolExecutor(2, thread_name_prefix="demo-stop") as stopping:  # both at once
                list(stopping.map(shutdown, engines))
    ok = bool(rows) and all(r["served_ok"] for r in rows) and second.exitcode == 0
    if second.exitcode != 0:
        _print(cfg, f"[demo] trainer rank 1 exited with code {second.exitcode}")
    return {"rows": rows, "verified": ok, "seconds": round(time.monotonic() - t_start, 1)}


def _lead(cfg: VllmDemoConfig, model: Any, engines: list[Any], t_start: float) -> list[dict[str, Any]]:
    """Trainer rank 0: generates on both engines, learns, sends its rows, checks what the engines serve."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from .net import listen
    from .vllm import FleetClient, OfflineClient, TrainerInitInfo

    fleet = FleetClient([OfflineClient(e) for e in engines])
    lis = listen(cfg.host, 0)
    dist.broadcast_object_list([(lis.port, fleet.total_workers)], src=0)
    info = TrainerInitInfo(rank=0, sources=2, listener=lis, workers=fleet.total_workers, timeout_s=WAIT_S,
                           liveness_s=20)  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=_Rows(model, 0, 2))
    rows: list[dict[str, Any]] = []
    pool = ThreadPoolExecutor(2, thread_name_prefix="demo-generate")
    _print(cfg, f"trainer world: 2 ranks, each sending its rows | fleet: 2 vLLM engines "
                f"({fleet.total_workers} workers) | bridge on {cfg.host} | {cfg.steps} steps, one step "
                "off-policy")  # fmt: skip
    _print(cfg, f"{'step':>4} {'versions':>9} {'reward':>6} {'loss':>8} {'sync s':>7} {'stall s':>7} "
                f"{'served = trainer':>16}")  # fmt: skip

    def batch(step: int) -> list[tuple[list[int], list[int]]]:
        g = torch.Generator().manual_seed(step)
        prompts = [torch.randint(0, 512, (PROMPT_LEN,), generator=g).tolist() for _ in range(BATCH)]
        halves = [prompts[i::2] for i in range(2)]  # each engine generates half, both at once
        outs = [pool.submit(_generate, engines[i], halves[i], step * 2 + i) for i in range(2)]
        done = [f.result(timeout=WAIT_S) for f in outs]
        return [(p, c) for h, d in zip(halves, done, strict=True) for p, c in zip(h, d, strict=True)]

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    try:
        current = batch(0)
        for step in range(1, cfg.steps + 1):
            nxt = pool.submit(batch, step)  # batch t+1 with weights t, while learning from batch t
            dist.broadcast_object_list([current], src=0)
            loss = _train_step(model, opt, current[0::2], 2)
            nxt_batch = nxt.result(timeout=WAIT_S)
            t0 = time.perf_counter()
            engine.send_weights()
            sync = time.perf_counter() - t0
            versions = [e.get_weight_version() for e in engines]
            want = _reference(model)
            served_ok = all(v == str(engine.version) for v in versions) and all(
                _greedy(e) == want for e in engines
            )
            row = {
                "step": step, "versions": versions, "reward": round(sum(reward(c) for _, c in current)
                / len(current), 3), "loss": round(loss, 4), "sync_seconds": round(sync, 3),
                "stall_seconds": round(engine.session.last_seconds["commit"], 3), "served_ok": served_ok,
            }  # fmt: skip
            rows.append(row)
            mark = "yes" if served_ok else "NO"
            _print(cfg, f"{step:>4} {'/'.join(versions):>9} {row['reward']:6.3f} {row['loss']:8.4f} "
                        f"{sync:7.3f} {row['stall_seconds']:7.3f} {mark:>16}")  # fmt: skip
            current = nxt_batch
    except BaseException:
        with contextlib.suppress(Exception):  # rank 1 waits for a batch: tell it rank 0 stopped
            dist.broadcast_object_list([None], src=0)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
    ok = "yes" if all(r["served_ok"] for r in rows) else "NO"
    sync = sum(r["sync_seconds"] for r in rows) / len(rows)
    stall = max(r["stall_seconds"] for r in rows)
    _print(cfg, f"{len(rows)} updates, both engines serving every version: {ok}; mean sync {sync:.3f} s, "
                f"worst stall {stall:.3f} s; {time.monotonic() - t_start:.0f} s in all")  # fmt: skip
    return rows
