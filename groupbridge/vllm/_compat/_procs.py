"""An offline engine's engine-core processes, read from vLLM's client (to stop them, see ``vllm/_stop.py``).

Private reads: ``LLMEngine.engine_core`` (the client, whose ``shutdown`` takes a timeout),
``MPClient.resources`` (its ``engine_manager``: ``BackgroundResources``), ``CoreEngineProcManager.processes``.
"""

from __future__ import annotations

from typing import Any

from ._gate import private


def engine_client(llm: Any) -> Any:
    """Offline engine ``llm``'s engine-core client (vLLM's ``EngineCoreClient``)."""
    return private(llm.llm_engine, "engine_core")


def engine_pids(llm: Any) -> list[int]:
    """The process ids of offline engine ``llm``'s engine cores: none when its engine core runs in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or is not a process of its own (a Ray actor)."""
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.engine.utils import CoreEngineProcManager

    client = engine_client(llm)
    if not isinstance(client, MPClient):
        return []
    manager = private(private(client, "resources"), "engine_manager")
    if not isinstance(manager, CoreEngineProcManager):
        return []
    return [p.pid for p in private(manager, "processes") if p.pid is not None]
