"""vLLM plugin entry point: registers backend ``"groupbridge"`` with both weight-transfer factories.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (the API server, the engine
core, every worker), possibly more than once per process, so registering must be idempotent and cheap: it
records module paths only and imports the engines when a factory first builds one. It also installs the
one-call commit (:mod:`._compat`): an engine-core utility and the server's route to it, on a vLLM the
backend was tested against only (:func:`._compat.check_version`); on another, the backend refuses to start
and says why, and nothing of vLLM is changed.
"""

from __future__ import annotations

import contextlib

from ..errors import GroupBridgeError

BACKEND = "groupbridge"


def register() -> None:
    """Register ``"groupbridge"`` with vLLM's worker and trainer factories (safe to call again)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, name in (
        (WeightTransferEngineFactory, "groupbridge.vllm._worker", "WorkerEngine"),
        (WeightTransferTrainerFactory, "groupbridge.vllm._trainer", "TrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered already: vLLM loads plugins more than once
            factory.register_engine(BACKEND, module, name)
    from ._compat import check_version, install

    try:
        check_version()
    except GroupBridgeError:  # an engine that names the backend is refused when it builds one, saying why
        return
    install()
