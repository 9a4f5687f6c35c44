"""A real ``vllm serve`` (backend "groupbridge") that keeps serving while an update's bytes land, driven by
the engine layer over HTTP and by TRL's own asynchronous GRPO trainer.

One server for the module (start-up ~30 s). Tokens are checked against ``transformers`` with the same
weights (fp32, greedy), as in ``test_vllm``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from groupbridge.engine import TrainerConfig, TrainerSession
from groupbridge.vllm._control import HttpClient, VllmControl
from groupbridge.vllm._serve import Server, Streamer, longest_gap
from groupbridge.vllm._stop import segments
from groupbridge.vllm.models import make_model
from tests.engines import PROMPTS, TOKENS, perturb, reference

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Any, Path]]:
    path = tmp_path_factory.mktemp("qwen2-serve1")
    model = make_model(path, "qwen2", seed=3)
    before = segments()
    srv = Server(path, log=path / "serve.log", max_model_len=512)
    try:
        yield srv, model, path
    finally:
        srv.close()
    assert not segments() - before, "the server left shared memory behind"


def slow(model: Any, seconds: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, one every ``seconds``: a trainer whose source is slow (a gather, a link),
    so that the transfer lasts long enough to see whether serving goes on meanwhile."""
    for name, p in model.named_parameters():
        time.sleep(seconds)
        yield name, p.detach()


@pytest.mark.parametrize(
    "atomic", [pytest.param(True, id="atomic"), pytest.param(False, id="streaming", marks=pytest.mark.slow)]
)
def test_a_client_keeps_getting_tokens_while_an_atomic_update_lands(
    server: tuple[Server, Any, Path], atomic: bool
) -> None:
    """Atomic: the bytes land on a worker thread, the engine goes on generating, and only the commit (vLLM's
    load) stops it. Streaming (layers are loaded as they arrive): the engine generates nothing until the
    update ends; measured the same way, which shows that the measure sees a stall when there is one."""
    srv, model, _ = server
    perturb(model, 1 if atomic else 2)
    specs = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    # liveness 10 s (the default): a server, its client and the trainer share 2 cores, and this machine was
    # seen frozen for 4.5 s once (the bridge then broke by design); this test is about serving, not liveness
    config = TrainerConfig(timeout_s=60, liveness_s=10, atomic=atomic, name="serve", bucket_bytes=256 << 10)
    session = TrainerSession(config, VllmControl(HttpClient(srv.base, timeout=60)))
    streamer = Streamer(srv, [5, 6, 7], tokens=400)
    try:
        deadline = time.monotonic() + 60
        while len(streamer.times) < 20:  # it is generating
            assert time.monotonic() < deadline and not streamer.errors, streamer.errors
            time.sleep(0.05)
        session.connect()
        t0 = time.monotonic()
        session.send(slow(model, 0.1), specs=specs)
        transfer = session.last_seconds["transfer"]
        times = streamer.stop()
    finally:
        streamer.stop()
        session.close()
    assert not streamer.errors, streamer.errors
    assert transfer > 2.0, session.last_seconds  # 27 tensors, one every 0.1 s
    gap = longest_gap(times, t0, t0 + transfer)
    during = sum(t0 < t < t0 + transfer for t in times)
    if atomic:
        assert gap < 0.5 * transfer and during > 10, (gap, during, session.last_seconds)
    else:
        assert gap > 0.8 * transfer, (gap, during, session.last_seconds)
    assert srv.weight_version() == str(session.version)
    assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(model)


class _NoRollouts:
    """TRL's rollout-worker protocol, producing nothing: training stops at its first health check."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] = queue.Queue()

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, version: int) -> None: ...

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("no rollouts on this machine")


def _train_until_first_sync(
    policy: Path, vocab_size: int, tmp_path: Path, transfer: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> Any:
    """TRL's own ``AsyncGRPOTrainer`` on ``policy`` with ``weight_transfer=transfer``, trained until its first
    health check fails (after the sync at train begin: the training step itself needs CUDA); its
    peak-FLOPs probe asks CUDA for its device name, so it is stubbed. ``kw``: more trainer arguments
    (``peft_config``). Returns the trainer."""
    import trl.experimental.async_grpo.async_grpo_trainer as grpo
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<pad>": len(vocab), "<eos>": len(vocab) + 1, "<unk>": len(vocab) + 2})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    monkeypatch.setattr(grpo, "get_peak_flops_per_device", lambda *a, **k: None)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), bf16=False, use_cpu=True, max_steps=1, token_budget=0,
        per_device_train_batch_size=2, num_generations=2, report_to=[], gradient_checkpointing=False,
        save_strategy="no",
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=str(policy), reward_funcs=None, args=args, train_dataset=[{"prompt": "w1 w2"}] * 4,
        processing_class=tokenizer, rollout_worker=_NoRollouts(), weight_transfer=transfer, **kw,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="no rollouts"):
        trainer.train()
    return trainer


@pytest.mark.slow  # TRL's trainer on the module's server (about 8 s; its PEFT case is slow too)
def test_trl_async_grpo_trainer_sends_through_groupbridge(
    server: tuple[Server, Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's own ``AsyncGRPOTrainer`` (trl 1.16) with ``weight_transfer=gb.trl.WeightTransfer(url)``: at train
    begin it calls ``init_weight_transfer``, ``pause``, ``send_weights`` (its own iterator of the policy's
    parameters), ``resume``; at train end ``destroy``. The server then serves the trainer's weights and is
    not left paused. What cannot run here: TRL's training step itself (its packed attention needs a
    FlashAttention-3 kernel, CUDA only), so the rollout worker reports no rollouts and training stops after
    the first sync."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    import groupbridge as gb
    import groupbridge.trl

    srv, model, _ = server
    policy = tmp_path / "policy"
    perturb(model, 3)
    model.save_pretrained(policy)  # what TRL trains: the server's architecture, other weights
    calls: list[str] = []

    class Recorded(gb.trl.WeightTransfer):
        def init_weight_transfer(self) -> None:
            calls.append("init")
            super().init_weight_transfer()

        def pause(self) -> None:
            calls.append("pause")
            super().pause()

        def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
            calls.append("send")
            super().send_weights(iterator)

        def resume(self) -> None:
            calls.append("resume")
            super().resume()

        def destroy(self) -> None:
            calls.append("destroy")
            super().destroy()

    transfer = Recorded(srv.base, timeout_s=60, liveness_s=10, http_timeout=60)
    before = srv.weight_version()  # an earlier test's trainer may have left a version: this one follows it
    _train_until_first_sync(policy, model.config.vocab_size, tmp_path, transfer, monkeypatch)
    assert calls == ["init", "pause", "send", "resume", "destroy"], calls
    assert transfer.session is None and transfer.version is None  # destroyed
    assert srv.weight_version() == str(int(before) + 1 if before.isdigit() else 1), before
    assert srv.client.get("is_paused")["is_paused"] is False
    trained = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(trained)


@pytest.mark.slow  # TRL with PEFT: another trainer set-up (about 30 s)
def test_trl_with_a_peft_model_sends_the_merged_weights_through_groupbridge(
    server: tuple[Server, Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL 1.16 turns its adapter-only sync off when a weight transfer is passed: it merges the adapter into
    the base weights, sends them under the base names through ``send_weights``, and unmerges. Through
    groupbridge the server then serves base + adapter (a LoRA with B non-zero, so the merge changes the
    tokens), and the trainer's model is left unmerged."""
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    import groupbridge.trl

    srv, model, _ = server
    policy = tmp_path / "policy"
    perturb(model, 5)
    model.save_pretrained(policy)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    transfer = groupbridge.trl.WeightTransfer(srv.base, timeout_s=60, liveness_s=10, http_timeout=60)
    trainer = _train_until_first_sync(
        policy, model.config.vocab_size, tmp_path, transfer, monkeypatch, peft_config=lora
    )
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    assert any("lora_B" in n for n, _ in peft_model.named_parameters())  # unmerged, still an adapter
    # the reference: a fresh base (TRL patched the trained model's forward) with the trained adapter merged
    peft_model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    merged = PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload()
    assert reference(merged) != reference(base)  # the adapter changes what is served
    # the sync at train begin landed: only it can have put base + adapter on the server (a new trainer counts
    # its versions anew, so the version number alone does not show it)
    assert transfer.session is None and transfer.version is None  # and TRL destroyed the transfer
    assert [srv.complete(p, TOKENS) for p in PROMPTS] == reference(merged)


@pytest.mark.slow  # a server of its own, stopped by force (about 30 s)
def test_a_server_killed_at_the_end_of_its_grace_leaves_no_shared_memory(tmp_path: Path) -> None:
    """A server that has not stopped within its grace is killed with its workers; the shared memory they held
    is removed once they have exited (before: removed while the killed workers still held it, so every
    segment stayed in /dev/shm)."""
    make_model(tmp_path / "m", "qwen2", "tiny")
    before = segments()
    srv = Server(tmp_path / "m", log=tmp_path / "serve.log", stop_s=0.0)
    held = segments() - before
    srv.close()
    assert held, "the server held no shared memory: nothing to check"
    assert not segments() - before, f"left in /dev/shm: {sorted(segments() - before)}"
    assert held <= set(srv.removed), (held, srv.removed)
