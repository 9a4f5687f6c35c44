"""A vLLM engine as a trainer session's :class:`EngineControl`, through vLLM's weight-sync client protocol
(an offline ``LLM``, Ray actors, or a server's HTTP routes), without importing vLLM itself: a trainer that
talks to ``vllm serve`` on another host (TRL's, verl's) need not have vLLM installed."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["HttpClient", "SyncClient", "VllmControl"]


class SyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the calls a trainer makes on the engine's workers."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class VllmControl:
    """vLLM's weight-sync client as the session's engine control. ``before_commit`` runs just before the
    commit, vLLM's load of the staged update: where a server is paused (TRL's ``pause()``) so that serving
    stops for the swap, not for the transfer."""

    def __init__(self, client: SyncClient, before_commit: Callable[[], None] | None = None) -> None:
        self.client = client
        self.before_commit = before_commit

    def join(self, info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(info)

    def begin(self, version: int) -> None:
        start_update(self.client)
        self.client.update_weights({"version": version})

    def commit(self, version: int) -> None:
        if self.before_commit is not None:
            self.before_commit()
        self.client.finish_weight_update(weight_version=str(version))

    def leave(self) -> None:
        leave = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if callable(leave):
            leave()


def start_update(client: SyncClient) -> None:
    """``start_weight_update``, recovering an engine that a trainer left mid-update (it died, or its update
    failed, between vLLM's ``start_weight_update`` and ``finish_weight_update``: vLLM then refuses every new
    start, and has no abort). The workers are asked to abandon that update (``update_weights`` with
    ``abandon``: they drop what it staged, load nothing, and raise, which is what makes vLLM leave its update
    state); then the start is tried again. A start that fails again raises the first failure."""
    try:
        client.start_weight_update()
        return
    except Exception as e:
        first = e
    try:
        client.update_weights({"version": 0, "abandon": True})
    except Exception as e:  # expected: the workers end the update by raising
        abandoned = str(e)
    else:
        abandoned = "no error"
    try:
        client.start_weight_update()
    except Exception:
        raise first from None  # not a leftover update: the start failed for its own reason
    logger.warning(
        "groupbridge: vLLM was left mid-update by an earlier trainer (%s); abandoned that update, nothing "
        "loaded (%s), and started this one", first, abandoned[:300],
    )  # fmt: skip


class HttpClient:
    """A vLLM server's weight-sync and pause routes over HTTP (``vllm serve`` with
    ``VLLM_SERVER_DEV_MODE=1``), with the standard library only. Every request is bounded by ``timeout``."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def post(self, route: str, body: dict[str, Any] | None = None, **query: str) -> Any:
        url = f"{self.base_url}/{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            url, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise RuntimeError(f"POST {url}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RuntimeError(f"POST {url} (bounded by {self.timeout:g} s): {e}") from None
        return json.loads(raw) if raw else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.post("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def pause(self, mode: str = "keep") -> None:
        self.post("pause", mode=mode)

    def resume(self) -> None:
        self.post("resume")
