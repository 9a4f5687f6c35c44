"""A probe's request on an offline engine that users generate on at the same time: added and read apart
from theirs.

``LLM.generate`` steps the engine until *every* request in it has finished, takes every finished output
(users' included) and sorts them by ``int(request_id)``: a probe made through it while users generate takes
their outputs and fails on their string ids. Here the probe's request gets an id of its own and a queue of
its own in vLLM's output processor (as ``AsyncLLM`` gives each request), so its outputs never come out of
``LLMEngine.step()`` and users' never reach the probe. It steps the engine itself only when no other
request was in flight as it began (the engine is then its own: users add requests on the trainer's thread,
which the probe holds), or once theirs have all finished and its own is still unfinished a second later (their
stepping loop ended before it came); otherwise the users' stepping thread runs it with theirs, and the probe
waits for its queue, bounded. Two threads stepping at once could leave one waiting for an output that never
comes: a loop of the user's that steps an engine with nothing in it, at the moment the probe steps alone, is
the one case that remains (docs/vllm.md).

Private reads: ``LLMEngine.input_processor``, ``output_processor`` (``add_request(queue=)``,
``get_num_unfinished_requests``), ``engine_core``, ``RequestOutputCollector``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ...errors import PeerTimeoutError
from ._gate import private

PREFIX = "groupbridge-probe-"
"""The start of every probe request's id (users' ids never need to avoid it: each probe's is unique)."""


def own_request(
    llm: Any,
    tokens: list[int],
    params: Any,
    lora: Any,
    bound_s: float,
    poll_s: float = 0.005,
    ended_s: float = 1.0,
) -> Any:
    """The finished ``RequestOutput`` of one request of ``tokens`` on offline engine ``llm``, added and read
    apart from every other request (see the module's docstring). Raises :class:`PeerTimeoutError` when it has
    not finished within ``bound_s`` seconds (its request is then aborted in the engine)."""
    from vllm.v1.engine.output_processor import RequestOutputCollector

    engine = llm.llm_engine
    inputs, outputs, core = (
        private(engine, n) for n in ("input_processor", "output_processor", "engine_core")
    )
    alone = outputs.get_num_unfinished_requests() == 0  # no user's request in flight: nobody else steps
    request_id = f"{PREFIX}{uuid.uuid4().hex}"
    request = inputs.process_inputs(
        request_id,
        {"prompt_token_ids": list(tokens)},
        params,
        supported_tasks=engine.get_supported_tasks(),
        lora_request=lora,
    )
    inputs.assign_request_id(request)
    collector = RequestOutputCollector(params.output_kind, request.request_id)
    outputs.add_request(request, None, None, 0, queue=collector)
    deadline = time.monotonic() + bound_s
    only_since: float | None = None  # when this request became the only one in flight (users' ended)
    try:
        core.add_request(request)  # an engine core that refuses it raises here: its state goes below
        while True:
            out = collector.get_nowait()
            if isinstance(out, Exception):
                raise out
            if out is not None and out.finished:  # FINAL_ONLY or not: the finished output ends it
                return out
            if time.monotonic() > deadline:
                why = (
                    "requests of yours were in flight as it began, and the thread that steps them did not "
                    "run it (see docs/vllm.md, generating beside an update)"
                    if only_since is None and not alone
                    else "the engine did not finish it"
                )
                raise PeerTimeoutError(
                    f"the probe's request on the offline engine did not finish within {bound_s:g} s: {why}"
                )
            if not alone and outputs.get_num_unfinished_requests() == 1:
                # the users' requests finished: their stepping loop (``while has_unfinished_requests()``)
                # runs this one too, within a step; unfinished ``ended_s`` later, that loop ended before
                # this request came, and nobody else steps
                only_since = time.monotonic() if only_since is None else only_since
                alone = time.monotonic() - only_since > ended_s
            if alone:
                engine.step()  # every output it makes is this request's, and goes to its queue
            else:  # users' requests too: their stepping thread runs this one with them
                time.sleep(poll_s)
    except BaseException:
        if outputs.has_request(request.request_id):
            engine.abort_request([request.request_id], internal=True)
        raise
