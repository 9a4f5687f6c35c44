"""The commit and its version label in one engine-core call, and the engine core's admission of requests.

vLLM's ``finish_weight_update(weight_version)`` is two calls into the engine core: a ``collective_rpc`` that
has the workers load the update, then ``set_weight_version``. The engine core runs model steps between the
two, so the tokens sampled there carry the old version's label although the new weights made them:
``CompletionOutput.weight_versions`` (the spans of output tokens per version) puts a request's boundary
late. :data:`COMMIT` is one engine-core utility that does both, between the same two model steps: the spans
are then exact (with synchronous scheduling; see ``docs/vllm.md`` for what asynchronous scheduling does to
the boundary). It is added to the engine core in each engine-core process when the plugin loads there, and
the two clients route to it: :func:`commit_offline` for an offline ``LLM`` (the trainer's
:class:`~groupbridge.vllm.OfflineClient`) and ``AsyncLLM.finish_weight_update`` for ``vllm serve``, wrapped
for engines whose weight-transfer backend is ``groupbridge`` only (others keep vLLM's behaviour). Its first
call on an engine core (:data:`ATTACH`, the last call of a trainer's join) attaches that engine alone: the
admission of its requests and its workers' adapter loader are set on its own objects (:func:`_attach`).

Private reads: ``EngineCore`` (``model_executor``, ``scheduler.requests``, ``_weight_version``,
``add_request``, ``_send_error_outputs_to_client``), ``AsyncLLM.finish_weight_update``, a worker's
``model_runner.lora_manager``.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterable
from typing import Any

from ...engine import Commit, update_fields
from .. import _lora
from .._plugin import BACKEND
from ._gate import private

COMMIT = "groupbridge_commit"
"""The engine-core utility: the workers' ``finish_weight_update``, then the label, in one call."""


def _commit(core: Any, weight_version: str) -> float:
    """On the engine core (its ``EngineCore``), between two model steps: every worker commits version
    ``weight_version`` (told first, so that a worker holding another version staged, a finish that arrived
    late, refuses and loads nothing), then the outputs of every later step carry ``weight_version``. A
    commit that fails raises before the label moves: the engine keeps reporting the version it served.

    Returns how long the engine core stopped for it (the seconds between its two model steps), also logged
    (:data:`PAUSED`): the pause the commit costs the engine, apart from the HTTP call and the wait for the
    model step under way that a caller's own clock adds."""
    t0 = time.perf_counter()
    _attach(core)
    if weight_version == ATTACH:
        return 0.0
    executor = core.model_executor
    lora = getattr(core.vllm_config, "lora_config", None) is not None
    if weight_version in (UNVERIFIED, UNVERIFIED_SERVED):
        return _withhold(core, weight_version == UNVERIFIED_SERVED, t0)
    if weight_version.isdigit() and len(weight_version) < 19:
        # what no adapter commit may drop: every unfinished request's, not the running batch's alone
        in_use = tuple(requested(core.scheduler.requests.values())) if lora else None
        told = update_fields(Commit(int(weight_version), in_use))
        executor.collective_rpc("update_weights", kwargs={"update_info": told})
    try:
        executor.collective_rpc("finish_weight_update")
    except BaseException:
        if any(h == TORN for h in _holding(executor)):  # never the label of a version it does not serve
            _label(core, TORN)
            _stop(core, TORN_REASON)
        raise
    _label(core, weight_version)
    _STOPPED.pop(core, None)  # every worker loaded every tensor of one version: it serves again
    if lora:  # what a request may name until the next commit: what every worker can load
        names = [set(n) for n in executor.collective_rpc(registered)]
        _ADMITS[core] = frozenset(set.intersection(*names)) if names else frozenset()
    paused = time.perf_counter() - t0
    _lora.logger.info("%s %s: %.2f ms", PAUSED, weight_version, paused * 1e3)
    return paused


def _withhold(core: Any, served: bool, t0: float) -> float:
    """The trainer's verdict on the version just committed: its probe failed and there is no earlier version
    to return to. The workers end the update that carried the verdict (loading nothing); the engine reports
    :data:`UNVERIFIED` and, unless the operator chose to serve it (``served``), stops serving (see
    :func:`_stop`) until an update commits."""
    core.model_executor.collective_rpc("finish_weight_update")
    _label(core, UNVERIFIED)
    if served:
        _STOPPED.pop(core, None)
        _lora.logger.warning(
            "groupbridge: the engine serves a version that failed its probe, labelled %r", UNVERIFIED
        )
    else:
        _stop(core, UNVERIFIED_REASON)
    return time.perf_counter() - t0


def _stop(core: Any, reason: str) -> None:
    """The engine's model holds no one verified version: it admits no request (:func:`_admit`) until a commit
    loads one, and each request in flight ends now, as an error, with no token sampled from that model."""
    _STOPPED[core] = reason
    _lora.logger.error("groupbridge: the engine serves no request until the next update lands: %s", reason)
    send = _ender(core)
    if send is None:  # the engine core in the caller's process: no request runs during this call
        return
    from vllm.v1.request import RequestStatus

    ended: dict[int, list[str]] = {}
    for request in core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR):
        ended.setdefault(request.client_index, []).append(request.request_id)
    for client, ids in ended.items():
        send(ids, client)


def _label(core: Any, version: str) -> None:
    """Set the version the engine core's outputs carry from its next step (vLLM's own field: written only
    where it is, so a renamed one fails by name instead of creating an attribute nobody reads)."""
    private(core, "_weight_version")
    core._weight_version = version


def _ender(core: Any) -> Any:
    """The engine core's call that ends requests with an error, sent to their client: None for an engine core
    in the caller's process (``EngineCore``, not ``EngineCoreProc``), whose caller raises instead."""
    from vllm.v1.engine.core import EngineCoreProc

    return private(core, "_send_error_outputs_to_client") if isinstance(core, EngineCoreProc) else None


_STOPPED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""Per engine core, why it serves no request (see :func:`_stop`); absent while it serves one version."""

PAUSED = "groupbridge: the engine paused for the commit of version"
"""How the engine core's log states each commit's pause (``<PAUSED> <version>: <ms> ms``)."""


TORN = "torn"
"""The version an engine reports while a worker's model holds a mix of versions (a load into it failed
midway): until a commit succeeds, which loads every tensor. It serves no request meanwhile."""

TORN_REASON = (
    "its model holds a torn mix of two versions (a load failed midway); the next update loads every tensor "
    "and mends it"
)

UNVERIFIED = "unverified"
"""The version an engine reports while its model holds a version whose probe failed with no earlier version
to return to (a trainer's first update): it serves no request until an update commits, unless the operator
chose to serve it so labelled (``TrainerConfig(serve_unverified=True)``, see :data:`UNVERIFIED_SERVED`)."""

UNVERIFIED_SERVED = "unverified+served"
"""The finish label that asks for :data:`UNVERIFIED` with requests still served (the engine reports
:data:`UNVERIFIED` either way; this label is never reported)."""

UNVERIFIED_REASON = (
    "its model holds a version whose probe failed, with no earlier version to return to; the next update "
    "that verifies mends it"
)


def _holds(worker: Any) -> str:
    """On a worker (``collective_rpc``): what its model holds, the version or :data:`TORN`."""
    engine = getattr(worker, "weight_transfer_engine", None)
    session = getattr(engine, "session", None)
    if session is None:
        return "unknown"
    return TORN if session.torn else str(session.version)


def _holding(executor: Any) -> list[str]:
    """What each worker's model holds, asked after a commit failed (``unknown`` where it cannot say)."""
    try:
        return [str(h) for h in executor.collective_rpc(_holds, timeout=30)]
    except Exception as e:
        _lora.logger.warning("groupbridge: could not ask the workers what they hold: %s", e)
        return ["unknown"]


_ADMITS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
"""Per engine core (of this process: one), the adapter versions every worker can load after its last
commit; kept here, not written into vLLM's object."""


def _admit(core: Any, request: Any) -> str | None:
    """Why ``request`` must not reach a model step, or None: the engine serves no request (its model holds no
    one verified version, see :func:`_stop`), a prompt token outside the model's vocabulary
    where vLLM checks none (an engine without a tokenizer: its embedding would fail), or an adapter version
    of the registry that no longer is (or never was) loadable (its load would fail). Either fails inside
    the step, where an error ends the engine; refused here, one request fails."""
    stopped = _STOPPED.get(core)
    if stopped is not None:
        return f"this engine serves no request until an update lands: {stopped}"
    model_config = core.vllm_config.model_config
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens and getattr(model_config, "skip_tokenizer_init", False):
        vocab = int(model_config.get_vocab_size())
        bad = next((t for t in (min(tokens), max(tokens)) if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt token {bad} lies outside the model's vocabulary of {vocab}"
    lora = getattr(request, "lora_request", None)
    path = str(getattr(lora, "lora_path", "") or "")
    if lora is None or not path.startswith(_lora.SCHEME):
        return None
    if lora.lora_name in _ADMITS.get(core, frozenset()):
        return None
    return (
        f"adapter {lora.lora_name!r} is not served by this engine: it was never received, or is older than "
        "the newest max_live_adapters and no request used it at the last commit"
    )


def commit_offline(llm: Any, weight_version: str) -> float:
    """An offline ``LLM``'s commit of its staged update, labelled ``weight_version``: one engine-core call.
    Returns the engine's pause for it (see :func:`_commit`)."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # the engine core in its own process (vLLM's default)
        return float(client.call_utility(COMMIT, weight_version))
    return _commit(client.engine_core, weight_version)  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def _ours(engine: Any) -> bool:
    config = getattr(getattr(engine, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def install() -> None:
    """Add :data:`COMMIT` to the engine core and route a ``vllm serve``'s labelled finish through it (in this
    process; idempotent: the plugin loads more than once per process).

    These are the only two class-level changes, and neither changes what a plain engine does: ``COMMIT`` is
    a name of its own (vLLM's plugin guide has a general plugin install engine-side methods so), and the
    server's finish keeps vLLM's behaviour for every engine whose backend is not ``groupbridge``. What does
    change an engine's behaviour (the admission of its requests, its workers' adapter loader) is set on
    that engine's own objects when a trainer attaches to it (:data:`ATTACH`)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, COMMIT):
        setattr(EngineCore, COMMIT, _commit)
    original = AsyncLLM.finish_weight_update
    if getattr(original, "_groupbridge", False):
        return

    @functools.wraps(original)
    async def finish_weight_update(self: Any, weight_version: str | None = None) -> None:
        if weight_version is None or not _ours(self):
            await original(self, weight_version)
        else:
            await self.engine_core.call_utility_async(COMMIT, weight_version)

    finish_weight_update._groupbridge = True  # type: ignore[attr-defined]
    AsyncLLM.finish_weight_update = finish_weight_update


ATTACH = "groupbridge:attach"
"""The :data:`COMMIT` label that commits nothing: it attaches the engine core to groupbridge (see
:func:`_attach`); sent by a trainer's client when it joins the engine to a bridge."""

_ATTACHED: weakref.WeakSet[Any] = weakref.WeakSet()


def _attach(core: Any) -> None:
    """Set groupbridge's admission on this engine core alone (its ``add_request``, an attribute of the
    instance: the class and every other engine keep vLLM's), and have each of its workers load the adapters
    it received over the bridge from memory (:func:`._adapters.serve_adapters`). Refuses an engine whose
    weight-transfer backend is not ``groupbridge``. Idempotent."""
    if core in _ATTACHED:
        return
    if not _ours(core):
        raise ValueError(
            "this vLLM engine's weight_transfer_config does not name backend "
            f"{BACKEND!r}: groupbridge changes nothing of it"
        )
    if getattr(core.vllm_config, "lora_config", None) is not None:  # first: a failed attach changes nothing
        core.model_executor.collective_rpc(_serve_adapters)
    add = private(core, "add_request")  # bound: the engine core's own class's (a DP engine's included)

    @functools.wraps(add)
    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        problem = _admit(core, request)
        if problem is None:
            return add(request, *args, **kwargs)
        _lora.logger.warning("groupbridge: request %s refused: %s", request.request_id, problem)
        send = _ender(core)
        if send is None:  # the engine core in the caller's process: the caller's add raises
            raise ValueError(problem)
        send([request.request_id], request.client_index)  # that request alone ends, as an error
        return None

    core.add_request = add_request
    _ATTACHED.add(core)


def _serve_adapters(worker: Any) -> None:
    """On a worker (``collective_rpc``): its LoRA loader serves the adapters its weight-transfer engine
    received over the bridge."""
    from ._adapters import serve_adapters

    engine = worker.weight_transfer_engine
    serve_adapters(private(worker.model_runner, "lora_manager"), engine.adapters)


def requested(requests: Iterable[Any]) -> list[str]:
    """The bridge's adapter versions that these requests (the engine core's unfinished ones) name."""
    names = set()
    for request in requests:
        lora = getattr(request, "lora_request", None)
        if lora is not None and str(getattr(lora, "lora_path", "") or "").startswith(_lora.SCHEME):
            names.add(str(lora.lora_name))
    return sorted(names)


def registered(worker: Any) -> list[str]:
    """The adapter versions this worker can load (run on each worker by the engine core's
    ``collective_rpc``, which passes the worker)."""
    adapters = getattr(getattr(worker, "weight_transfer_engine", None), "adapters", None)
    return adapters.names() if isinstance(adapters, _lora.Adapters) else []
