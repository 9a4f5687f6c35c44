"""vLLM plugin entry point: registers backend ``"groupbridge"`` with both weight-transfer factories.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (the API server, the engine
core, every worker), possibly more than once per process, so registering must be idempotent and cheap: it
records module paths only and imports the engines when a factory first builds one. It also installs the
one-call commit (:mod:`._compat`): an engine-core utility and the server's route to it.
"""

from __future__ import annotations

import contextlib

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
    from ._compat import install

    install()
