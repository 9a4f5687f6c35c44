"""A ``VLLMWeightSyncClient`` for an offline ``vllm.LLM`` in the trainer's own process.

vLLM ships HTTP and Ray clients; an offline ``LLM`` takes requests shaped as ``{"init_info": ...}`` and
``{"update_info": ...}``, so a trainer that holds one needs this small adapter.

vLLM's offline client to its engine core is not thread-safe (one message encoder, one socket): two calls at
once can garble both messages, the engine core's input thread then dies on what it cannot decode, and every
later call waits for ever. The trainer makes its calls on threads of its own (the engine's join and update
run beside the send), so this adapter makes them one at a time per engine, and a call that finds the engine
still busy with an earlier one past a bound raises, naming it, instead of racing it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import WeightSyncError
from ._compat import own_request

BUSY_S = 600.0
"""How long a call waits for the engine's earlier call to return before raising (the trainer's own calls
are bounded by its ``timeout_s``, 300 s unless set: one that outlives it is still running in the engine)."""

PROBE_S = 120.0
"""How long a probe's request on the engine may take before the probe fails, naming why (while users'
requests are in flight, their stepping thread runs it: see docs/vllm.md)."""

_BUSY: weakref.WeakKeyDictionary[Any, tuple[threading.Lock, list[str]]] = weakref.WeakKeyDictionary()
_BUSY_LOCK = threading.Lock()

_COMMITTED: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
"""Per offline ``vllm.LLM`` of this process: adapter name -> the full name (``policy@v3``) a trainer here last
committed, kept beside the engine rather than written into vLLM's object (gone with it)."""


def committed_adapter(llm: Any, name: str) -> str | None:
    """The full name of adapter ``name`` a trainer of this process last committed to ``llm``, if any."""
    return _COMMITTED.get(llm, {}).get(name)


@contextlib.contextmanager
def one_at_a_time(llm: Any, what: str, busy_s: float = BUSY_S) -> Iterator[None]:
    """Hold ``llm``'s client for one call (``what``), shared by every :class:`OfflineClient` of it; raises
    :class:`WeightSyncError` naming the call still running after ``busy_s`` seconds."""
    with _BUSY_LOCK:
        lock, running = _BUSY.setdefault(llm, (threading.Lock(), []))
    t0 = time.monotonic()
    if not lock.acquire(timeout=busy_s):
        raise WeightSyncError(
            f"the offline vLLM engine's {running[0] if running else 'earlier call'} has not returned after "
            f"{time.monotonic() - t0:.0f} s, so its {what} was not made (vLLM's client takes one call at a "
            "time): the engine may be stuck; stop it and start a new one"
        )
    running.append(what)
    try:
        yield
    finally:
        running.clear()
        lock.release()


def engine_calls(llm: Any, busy_s: float = BUSY_S) -> contextlib.AbstractContextManager[None]:
    """Hold offline engine ``llm``'s client for calls of yours that send to its engine core
    (``llm.llm_engine.add_request``, ``abort_request``), made on a thread beside an update: the trainer's
    calls into the engine wait for the block, and the block for them (vLLM's client takes one call at a
    time). ``step()`` only reads outputs (unless a request ends on a stop string: then it sends an abort)
    and takes no lock. Raises :class:`WeightSyncError` naming the trainer's call still running after
    ``busy_s`` seconds."""
    return one_at_a_time(llm, "a call of the caller's", busy_s)


class OfflineClient:
    """Drives an offline ``vllm.LLM`` through vLLM's weight-sync client protocol, one call at a time (see
    the module's docstring; a request generating meanwhile is added on the trainer's thread and stepped on
    another, see docs/vllm.md)."""

    def __init__(self, llm: Any, probe_s: float = PROBE_S) -> None:
        self.llm = llm
        self.probe_s = probe_s
        """How long a probe's request may take (see :data:`PROBE_S`)."""
        self.paused: float | None = None
        """How long the engine stopped serving for the last labelled commit (seconds, the engine core's
        own clock: the workers' commit and the label, between two model steps)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        with one_at_a_time(self.llm, "join"):
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        with one_at_a_time(self.llm, "start of an update"):
            self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        with one_at_a_time(self.llm, "update"):
            self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The commit; with a version, labelled in the same engine-core call (see :mod:`._compat`), so that
        every token's version in ``CompletionOutput.weight_versions`` is exact."""
        with one_at_a_time(self.llm, "commit"):
            if weight_version is None:
                self.llm.finish_weight_update()
                return
            from ._compat import ATTACH, commit_offline

            paused = commit_offline(self.llm, weight_version)
            if weight_version != ATTACH:  # the join's attach commits nothing
                self.paused = paused

    def shutdown_weight_transfer_engine(self) -> None:
        with one_at_a_time(self.llm, "leave"):
            self.llm.shutdown_weight_transfer_engine()

    def vocab_size(self) -> int:
        """The engine's vocabulary: a probe token at or past it would end the engine in its embedding (an
        engine started with ``skip_tokenizer_init=True`` checks no prompt token)."""
        engine = self.llm.llm_engine
        config = getattr(engine, "model_config", None) or engine.vllm_config.model_config
        return int(config.get_vocab_size())

    def lora_enabled(self) -> bool:
        """Whether the engine was started to serve LoRA adapters (``enable_lora=True``)."""
        return self.llm.llm_engine.vllm_config.lora_config is not None

    def reported_version(self) -> str | None:
        """The weight version the engine reports, as it reports it (a number, ``torn``, None)."""
        with one_at_a_time(self.llm, "version query"):
            label = self.llm.get_weight_version()
        return str(label) if label is not None else None

    def adapter_committed(self, name: str, version: int) -> None:
        """Adapter ``name`` is served at ``version`` on every worker: what
        :func:`groupbridge.vllm.adapter_request` hands out from now on."""
        from ._lora import adapter_name

        _COMMITTED.setdefault(self.llm, {})[name] = adapter_name(name, version)

    def prompt_logprobs(self, tokens: list[int], adapter: str | None = None) -> list[float]:
        """The engine's log-probabilities of ``tokens[1:]``, from a request of the probe's own that no user's
        request sees (:func:`._compat.own_request`), with the adapter served as ``adapter`` (``policy@v3``)
        when given."""
        import vllm

        from ._lora import SCHEME, adapter_id

        lora = None
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(adapter, adapter_id(adapter), lora_path=SCHEME + adapter)
        from vllm.sampling_params import RequestOutputKind

        # one output, the final one (with every prompt token's log-probability)
        params = vllm.SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        with one_at_a_time(self.llm, "probe"):  # a request of its own, never a user's (see _compat._probe)
            out = own_request(self.llm, list(tokens), params, lora, self.probe_s)
        return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i > 0]
