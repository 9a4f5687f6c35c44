"""``groupbridge demo`` on real parts: two trainer ranks update two vLLM engines as one fleet, every step.

The loop is the one RL post-training runs (one step off-policy): while the trainer learns from batch t, the
engines already generate batch t+1 with the weights of step t; then the trainer sends its new weights and
the engines serve them. The trainer is a world of two ranks (``init_global_group``: data parallel, the
gradients averaged over gloo); each rank sends only its own rows of every tensor (``sources=2``), and the
engines' workers assemble whole tensors. The two engines are offline ``vllm.LLM`` s behind one
``FleetClient``: one bridge, one commit on both or neither.

Every step shows what a user of such a loop needs to see: the version each engine reports, the versions
that made the batch the trainer learns from (vLLM's per-token ``weight_versions`` spans: one step off-policy,
as data), the sync time, the swap (the exchange of each engine's two copies of the model: the only part of
an atomic update that holds an engine; the bytes land, and load into the second copy, while it is free to
serve), and a check that each engine serves the trainer's model: its greedy
tokens equal ``transformers``' on trainer rank 0, and its log-probabilities of a probe are within 1e-3 of
theirs (one step's change moves them about 1e-2, so a version behind fails it). A failed check makes the
demo exit non-zero.

The task is a toy one so that learning shows in a few steps: the reward is the share of even token ids in
a completion, learnt by REINFORCE with each token rewarded on its own. The model is a small random Qwen2
built from a ``transformers`` config (no download).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _console

__all__ = ["RowSource", "VllmDemoConfig", "run_vllm_demo"]

PROMPT_LEN, NEW_TOKENS, BATCH = 4, 16, 8
CHECK_PROMPTS = [[1, 2, 3, 4], [7, 100, 5], [300, 11]]
CHECK_TOKENS = 8
WAIT_S = 300.0
"""The bound on every wait of the demo once it runs (a generation, a sync)."""
JOIN_S = 600.0
"""The bound on the trainer world's forming: rank 1 waits while both engines start."""
LIVENESS_S = 20.0
"""A sending rank silent this long is dead: the other's sync fails then, not at ``WAIT_S``."""
PROBE = [1, 17, 300, 5, 42, 7, 99, 2, 250, 11]
ATOL = 1e-3
"""fp32 on both sides: vLLM's and transformers' log-probabilities of the same weights agree to ~1e-5."""


@dataclass(kw_only=True)
class VllmDemoConfig:
    steps: int = 10
    host: str = "127.0.0.1"
    """Where trainer rank 0 hosts the bridge (IPv4, IPv6 or a name)."""
    json: bool = False
    lr: float = 1e-2


def reward(tokens: list[int]) -> float:
    """The toy task: the share of even token ids."""
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


class RowSource:
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
    """REINFORCE on this rank's half of the batch, each token rewarded on its own (even: 1) against the
    batch's mean; gradients averaged over the trainer world."""
    rewards = torch.tensor([[float(t % 2 == 0) for t in c] for _, c in batch])
    advantage = rewards - rewards.mean()
    ids = torch.tensor([p + c for p, c in batch])
    logits = model(ids).logits[:, PROMPT_LEN - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
    loss = -(advantage * logp).mean()
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
                      timeout=timedelta(seconds=JOIN_S))  # fmt: skip
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)  # the bridge's port (bound by rank 0) and the fleet's workers
        port, workers = box[0]
        info = TrainerInitInfo(rank=1, sources=2, host=host, port=port, workers=workers, timeout_s=WAIT_S,
                               liveness_s=LIVENESS_S)  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=RowSource(model, 1, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        try:
            for _ in range(steps):
                box = [None]
                dist.broadcast_object_list(box, src=0)  # the batch rank 0 generated
                _train_step(model, opt, box[0][1::2], 2)  # the odd half; rank 0 learns from the even one
                engine.send_weights()  # this rank's rows of the new version
        finally:
            engine.shutdown()
    finally:
        destroy_global_group()


def _generate(llm: Any, prompts: list[list[int]], seed: int) -> tuple[list[list[int]], set[str]]:
    """The completions, and the weight versions that sampled their tokens (vLLM's ``weight_versions``
    spans, exact across an update: see docs/vllm.md)."""
    import vllm

    sp = vllm.SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    made_by = {s.version for o in outs for s in o.outputs[0].weight_versions or ()}
    return [list(o.outputs[0].token_ids) for o in outs], made_by


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
    """Run the demo; return one row per step and whether every engine served every version it was sent.

    A demo, not a library call: it sets this process's torch threads to 1 and, unless set, vLLM's log level
    to errors, and sends what is written to this process's standard error (and so its children's: the
    engines', trainer rank 1's) to a log file for the run: the table is what it shows. A run that fails
    shows the end of that log."""
    if cfg.steps < 1:
        raise ValueError(f"steps={cfg.steps} must be >= 1")
    fd, log = tempfile.mkstemp(prefix="groupbridge-demo-", suffix=".log")
    _print(cfg, f"[demo] vLLM's, torch's and the engines' own messages: {log}")
    ok = False
    try:
        with _stderr_to(fd):
            result = _run(cfg)
        ok = bool(result["verified"])
        return result
    finally:
        os.close(fd)
        if not ok:
            with open(log, errors="replace") as f:
                tail = f.read()[-4000:]
            print(f"[demo] the end of {log}:\n{tail}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stderr_to(fd: int) -> Iterator[None]:
    """File descriptor 2 (Python's ``sys.stderr``, C++ warnings, child processes started meanwhile) goes to
    ``fd`` inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _run(cfg: VllmDemoConfig) -> dict[str, Any]:
    from .global_group import destroy_global_group, init_global_group
    from .net import listen
    from .vllm import shutdown
    from .vllm.models import make_model

    t_start = time.monotonic()
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
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
            if not second.is_alive():
                raise RuntimeError(
                    f"trainer rank 1 exited ({second.exitcode}) before the trainer world formed"
                )
            init_global_group(rank=0, world_size=2, listener=world, timeout=timedelta(seconds=JOIN_S))
            try:
                rows = _lead(cfg, model, engines, t_start)
            finally:
                destroy_global_group()  # a rank 1 still in a collective with rank 0 sees it gone
        finally:
            try:  # rank 1 ends on its own after a run; after a failure it is given a moment, then killed
                second.join(WAIT_S if rows else 10)
            finally:
                if second.is_alive():
                    second.kill()
                    second.join(10)
                with ThreadPoolExecutor(2, thread_name_prefix="demo-stop") as stopping:  # both at once
                    list(stopping.map(shutdown, engines))
    if second.exitcode != 0:
        _print(cfg, f"[demo] trainer rank 1 exited with code {second.exitcode}")
    ok = bool(rows) and all(r["served_ok"] for r in rows) and second.exitcode == 0
    return {"rows": rows, "verified": ok, "seconds": round(time.monotonic() - t_start, 1)}


def _within(future: Any, what: str) -> Any:
    try:
        return future.result(timeout=WAIT_S)
    except FutureTimeout:
        raise TimeoutError(f"{what}: no result within {WAIT_S:g} s") from None


def _served(engine: Any, tokens: list[list[int]], logprobs: list[float]) -> tuple[bool, float]:
    """Does ``engine`` serve the trainer's weights? Its greedy tokens must equal ``tokens`` (``transformers``'
    on the trainer's model) and its log-probabilities of :data:`PROBE` be within :data:`ATOL` of
    ``logprobs`` (the demo shows how far the previous version's are: one step moves every weight, so the
    log-probabilities tell versions apart where greedy tokens may not). Returns the verdict and the largest
    difference."""
    from .vllm import OfflineClient

    served = OfflineClient(engine).prompt_logprobs(PROBE)
    worst = max(abs(a - b) for a, b in zip(served, logprobs, strict=True))
    return _greedy(engine) == tokens and worst <= ATOL, worst


def _lead(cfg: VllmDemoConfig, model: Any, engines: list[Any], t_start: float) -> list[dict[str, Any]]:
    """Trainer rank 0: generates on both engines, learns, sends its rows, checks what the engines serve."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from .engine import causal_logprobs
    from .net import listen
    from .vllm import FleetClient, OfflineClient, TrainerInitInfo

    fleet = FleetClient([OfflineClient(e) for e in engines])
    lis = listen(cfg.host, 0)
    dist.broadcast_object_list([(lis.port, fleet.total_workers)], src=0)
    info = TrainerInitInfo(rank=0, sources=2, listener=lis, workers=fleet.total_workers, timeout_s=WAIT_S,
                           liveness_s=LIVENESS_S)  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=RowSource(model, 0, 2))
    rows: list[dict[str, Any]] = []
    ahead = ThreadPoolExecutor(1, thread_name_prefix="demo-next-batch")
    each = ThreadPoolExecutor(2, thread_name_prefix="demo-generate")  # one per engine: both at once
    _print(cfg, f"trainer world: 2 ranks, each sending its rows | fleet: 2 vLLM engines "
                f"({fleet.total_workers} workers) | bridge on {cfg.host} | {cfg.steps} steps, one step "
                "off-policy")  # fmt: skip
    _print(cfg, f"{'step':>4} {'versions':>9} {'batch v':>7} {'reward':>6} {'loss':>8} {'sync s':>7} "
                f"{'swap s':>7} {'logprob diff':>12} {'(v-1: diff)':>11} "
                f"{'served = trainer':>16}")  # fmt: skip

    def batch(step: int) -> tuple[list[tuple[list[int], list[int]]], str]:
        """Batch ``step`` from both engines, and the versions that made it."""
        g = torch.Generator().manual_seed(step)
        prompts = [torch.randint(0, 512, (PROMPT_LEN,), generator=g).tolist() for _ in range(BATCH)]
        halves = [prompts[i::2] for i in range(2)]  # each engine generates half
        outs = [each.submit(_generate, engines[i], halves[i], step * 2 + i) for i in range(2)]
        done = [_within(f, f"engine {i} generating batch {step}") for i, f in enumerate(outs)]
        made_by = "+".join(sorted({v for _, vs in done for v in vs}, key=lambda v: (len(v), v)))
        pairs = [(p, c) for h, (d, _) in zip(halves, done, strict=True) for p, c in zip(h, d, strict=True)]
        return pairs, made_by.replace("default", "0")  # vLLM labels the weights it started with "default"

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    previous = causal_logprobs(model, PROBE)
    try:
        current, made_by = batch(0)
        for step in range(1, cfg.steps + 1):
            nxt = ahead.submit(batch, step)  # batch t+1 with weights t, while learning from batch t
            dist.broadcast_object_list([current], src=0)
            loss = _train_step(model, opt, current[0::2], 2)
            nxt_batch, nxt_made_by = _within(nxt, f"the engines generating batch {step}")
            t0 = time.perf_counter()
            engine.send_weights()  # a failure here or above: the bridge closes below, rank 1's sync fails
            sync = time.perf_counter() - t0
            versions = [e.get_weight_version() for e in engines]
            tokens, logprobs = _reference(model), causal_logprobs(model, PROBE)  # what both must serve
            checks = [_served(e, tokens, logprobs) for e in engines]
            # how far the check's bound is from the previous version: what an engine a version behind shows
            behind = max(abs(a - b) for a, b in zip(logprobs, previous, strict=True))
            previous = logprobs
            served_ok = all(v == str(engine.version) for v in versions) and all(ok for ok, _ in checks)
            row = {
                "step": step, "versions": versions, "batch_made_by": made_by,
                "reward": round(sum(reward(c) for _, c in current)
                / len(current), 3), "loss": round(loss, 4), "sync_seconds": round(sync, 3),
                "swap_seconds": round(engine.session.last_seconds["commit"], 3),
                "logprob_diff": max(d for _, d in checks), "previous_version_diff": behind,
                "served_ok": served_ok,
            }  # fmt: skip
            rows.append(row)
            mark = "yes" if served_ok else "NO"
            _print(cfg, f"{step:>4} {'/'.join(versions):>9} {made_by:>7} {row['reward']:6.3f} "
                        f"{row['loss']:8.4f} {sync:7.3f} {row['swap_seconds']:7.3f} "
                        f"{row['logprob_diff']:12.1e} {behind:11.1e} {mark:>16}")  # fmt: skip
            current, made_by = nxt_batch, nxt_made_by
    finally:
        ahead.shutdown(wait=False, cancel_futures=True)
        each.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
    ok = "yes" if all(r["served_ok"] for r in rows) else "NO"
    sync = sum(r["sync_seconds"] for r in rows) / len(rows)
    swap = max(r["swap_seconds"] for r in rows)
    _print(cfg, f"{len(rows)} updates, both engines serving every version: {ok}; mean sync {sync:.3f} s, "
                f"longest swap {swap:.3f} s; {time.monotonic() - t_start:.0f} s in all")  # fmt: skip
    return rows
