"""A vLLM engine as a trainer session's :class:`EngineControl`, through vLLM's weight-sync client protocol
(an offline ``LLM``, Ray actors, or a server's HTTP routes), without importing vLLM itself: a trainer that
talks to ``vllm serve`` on another host (TRL's, verl's) need not have vLLM installed."""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..engine import Abandon, Capabilities, EngineControl, Rollback, Withhold, update_fields

logger = logging.getLogger(__name__)

__all__ = [
    "HttpClient",
    "SyncClient",
    "VllmControl",
    "as_version",
    "out_of_vocabulary",
    "prompt_logprobs",
    "reported_version",
    "served_version",
]


class SyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the calls a trainer makes on the engine's workers."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class VllmControl(EngineControl):
    """One vLLM engine's weight-sync client as the session's engine control. ``before_commit`` runs just
    before the commit, vLLM's load of the staged update: where a server is paused (TRL's ``pause()``) so that
    serving stops for the swap, not for the transfer.

    Its capabilities follow the client: a probe needs a client that scores (an offline engine's, or a
    server's address); versions, one that reports them; adapters, an offline engine started with LoRA or a
    server (whose workers refuse an adapter they cannot serve in the first update's handshake, before any
    byte moves). Every vLLM engine of this backend can roll back."""

    def __init__(
        self,
        client: SyncClient,
        update_info: Callable[[], dict[str, Any]] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.before_commit = before_commit
        self.update_info = update_info
        """What each update tells the workers beside its version (an adapter's name and config)."""
        self._committed: int | None = None
        self._bridge: str | None = None
        """The bridge the workers last joined (``BridgeInfo.bridge_id``), named by each update."""
        self.capabilities = Capabilities(
            probe=_scores(client),
            rollback=True,
            adapters=_serves_adapters(client),
            versions=callable(getattr(client, "reported_version", None)) or _server(client) is not None,
            withhold=True,
        )

    def join(self, info: dict[str, Any]) -> None:
        """The engine's workers join the bridge; then the engine is attached to groupbridge (its requests'
        admission, its workers' adapter loader: see ``_compat._core``) through the labelled commit's route,
        by the clients known to route a labelled finish there (:func:`_attaches`)."""
        self.client.init_weight_transfer_engine(info)
        self._bridge = info.get("bridge_id") or None
        if _attaches(self.client):
            from ._compat import ATTACH

            try:
                self.client.finish_weight_update(weight_version=ATTACH)
            except Exception as e:  # its first commit attaches it; until then vLLM's admission holds
                logger.warning(
                    "groupbridge: the engine behind %s was not attached at the join (%s: %s): it admits "
                    "requests as vLLM does until its first commit",
                    type(self.client).__name__,
                    type(e).__name__,
                    str(e)[:300],
                )

    def served(self) -> int | None:
        """The version the engine reports serving (a fleet: the highest of its engines'), when it is a
        number; None for the weights it was started with, or an engine that cannot say."""
        return served_version(self.client)

    def begin(self, version: int) -> None:
        start_update(self.client)
        extra = self.update_info() if self.update_info is not None else {}
        if self._bridge is not None:
            extra = {**extra, "bridge": self._bridge}
        self.client.update_weights({**extra, "version": version})

    def commit(self, version: int) -> None:
        if self.before_commit is not None:
            self.before_commit()
        self.client.finish_weight_update(weight_version=str(version))
        self._committed = version
        adapter = self._adapter()
        if adapter is not None:
            announce_adapter(self.client, adapter["name"], version, adapter["max_live"])

    def _adapter(self) -> dict[str, Any] | None:
        return (self.update_info() if self.update_info is not None else {}).get("adapter")

    def leave(self) -> None:
        """Each worker leaves the bridge. vLLM refuses that while an update is open (a send that failed
        after vLLM's start leaves it so, having no abort): that update is abandoned first, as
        :func:`start_update` does, then the leave is tried again."""
        leave = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if not callable(leave):
            return
        try:
            leave()
            return
        except Exception as e:
            first = e
        with contextlib.suppress(Exception):  # expected: the workers end the update by raising
            self.client.update_weights(update_fields(Abandon()))
        try:
            leave()
        except Exception:
            raise first from None  # not an open update: the leave failed for its own reason

    def holding(self) -> list[str]:
        """The version vLLM reports, in words: a number, its initial weights, or torn (a worker's load
        failed midway, see ``groupbridge.vllm._compat.TORN``)."""
        try:
            label = reported_version(self.client)
        except Exception as e:
            return [f"cannot say what it serves ({type(e).__name__}: {str(e)[:200]})"]
        if label is None or label == "":
            return ["its initial weights"]
        if as_version(label) is not None:
            return [f"version {as_version(label)}"]
        if label == "torn":
            return ["a torn mix of two versions (a load into its model failed midway; it serves no request)"]
        if label == "unverified":
            return ["a version that failed its probe, with no earlier version to return to (unverified)"]
        return [f"a version labelled {label[:60]!r}"]

    def withhold(self, version: int, serve: bool) -> None:
        """An update of its own, as a rollback is: the workers load nothing, and the finish's label makes the
        engine core report ``unverified`` and (unless ``serve``) stop serving until an update commits (see
        ``groupbridge.vllm._compat.UNVERIFIED``)."""
        start_update(self.client)
        self.client.update_weights(update_fields(Withhold(version)))
        self.client.finish_weight_update(weight_version="unverified+served" if serve else "unverified")

    def stopped(self) -> list[str]:
        try:
            label = reported_version(self.client)
        except Exception:
            return []
        return self.holding() if label in ("torn", "unverified") else []

    def describe(self) -> str:
        server = _server(self.client)
        return f"the vLLM engine behind {type(self.client).__name__}" + (f" at {server}" if server else "")

    def describe_rank(self, worker: int) -> str | None:
        server = _server(self.client)
        return f"vLLM worker {worker}" + (f" of the server at {server}" if server else "")

    def probe(self, tokens: list[int]) -> list[list[float]]:
        """The engine's log-probabilities of ``tokens[1:]``, through the adapter just committed when the
        updates are an adapter's."""
        adapter = self._adapter()
        model = f"{adapter['name']}@v{self._committed}" if adapter is not None else None
        return [prompt_logprobs(self.client, tokens, model)]

    def rollback(self, version: int) -> None:
        """Every worker loads ``version`` again (the one it served before its last update); vLLM then
        reports it served. An update of its own, so that vLLM's version is set only by a finish that
        loaded: the workers stage the rollback in ``update_weights`` and load it in the finish.

        An adapter's rollback moves no weight: version ``version`` of the adapter is still served under its
        own name; the workers withdraw the newer one, and ``version`` is announced as the newest again."""
        adapter = self._adapter()
        start_update(self.client)
        self.client.update_weights(update_fields(Rollback(version, adapter)))
        self.client.finish_weight_update(weight_version=str(version))
        if adapter is not None:
            announce_adapter(self.client, adapter["name"], version, adapter["max_live"], rolled_back=True)
        self._committed = version


_ROUTING = {
    ("groupbridge.vllm._client", "OfflineClient"),
    ("groupbridge.vllm._control", "HttpClient"),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient"),
}
"""The clients whose ``finish_weight_update(weight_version=...)`` reaches the engine core's labelled commit
(an offline engine's through ``commit_offline``; a ``vllm serve``'s through its finish route), told by module
and name so that this module imports no vLLM. Another client's finish may run vLLM's own (the workers'
finish, then the label), which an attach must never reach."""


def _attaches(client: Any) -> bool:
    return (type(client).__module__, type(client).__qualname__) in _ROUTING


def _server(client: Any) -> str | None:
    """The address of the ``vllm serve`` server a client talks to (vLLM's HTTP client's, ours), or None."""
    url = getattr(client, "base_url", None)
    return url.rstrip("/") if isinstance(url, str) and url else None


def _scores(client: Any) -> bool:
    return callable(getattr(client, "prompt_logprobs", None)) or _server(client) is not None


def _serves_adapters(client: Any) -> bool:
    lora = getattr(client, "lora_enabled", None)  # an offline engine can say; a server's workers say later
    if not callable(lora):
        return _server(client) is not None
    try:
        return bool(lora())
    except Exception as e:  # an engine that cannot say is not trusted with adapters
        logger.warning("groupbridge: %s cannot say whether it serves adapters: %s", type(client).__name__, e)
        return False


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
        client.update_weights(update_fields(Abandon()))
    except Exception as e:  # expected: the workers end the update by raising
        abandoned = str(e)
    else:
        abandoned = "no error"
    try:
        client.start_weight_update()
    except Exception:
        raise first from None  # not a leftover update: the start failed for its own reason
    logger.warning(
        "groupbridge: vLLM was left mid-update (by an update of this trainer or another that failed or "
        "was refused after vLLM's start: %s); abandoned that update, nothing loaded (%s), and started this "
        "one", first, abandoned[:300],
    )  # fmt: skip


def out_of_vocabulary(clients: Sequence[Any], tokens: Sequence[int]) -> str | None:
    """Why a probe of ``tokens`` cannot be scored by one of ``clients`` (a token outside an engine's
    vocabulary, where its client can say it: an offline engine's; the engine would die scoring it), or
    None: asked when the trainer starts, so that ``verify`` is refused before any update is committed."""
    for k, each in enumerate(clients):
        vocab = getattr(each, "vocab_size", None)
        size = vocab() if callable(vocab) else None
        if isinstance(size, int) and tokens and max(tokens) >= size:
            return (
                f"the probe's token {max(tokens)} lies outside engine {k}'s vocabulary of {size} tokens (it "
                "would end the engine when scored): probe with token ids below it"
            )
    return None


def prompt_logprobs(
    client: Any, tokens: list[int], model: str | None = None, timeout: float = 120.0
) -> list[float]:
    """One engine's log-probabilities of ``tokens[1:]`` (``model``: an adapter's served name, else the
    base): the client's own ``prompt_logprobs`` (an offline ``LLM``'s
    :class:`groupbridge.vllm.OfflineClient`), else the server at its ``base_url`` (vLLM's HTTP client,
    :class:`HttpClient`) through ``/v1/completions`` with ``prompt_logprobs``: the request path users'
    requests take."""
    own = getattr(client, "prompt_logprobs", None)
    if callable(own):
        return [float(x) for x in own(tokens, model)]
    base = getattr(client, "base_url", None)
    if not isinstance(base, str):
        raise TypeError(
            f"{type(client).__name__} cannot score a probe: give it prompt_logprobs(tokens) or a base_url "
            "(a vllm serve server)"
        )
    http = HttpClient(base, timeout=timeout)
    model = model or http.get("v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    scored = http.post("v1/completions", body)["choices"][0]["prompt_logprobs"]
    return [float(scored[i][str(t)]["logprob"]) for i, t in enumerate(tokens) if i > 0]


def announce_adapter(client: Any, name: str, version: int, max_live: int, rolled_back: bool = False) -> None:
    """Adapter ``name`` is served at ``version`` by every worker: tell whoever picks adapters by name. An
    offline engine's client records it (``adapter_committed``); a server (a client with ``base_url``) lists
    ``<name>@v<version>`` in ``/v1/models`` through vLLM's ``/v1/load_lora_adapter`` (which loads it once,
    from the workers' memory: the path is ``groupbridge:<name>@v<version>``), and stops listing the
    versions older than the newest ``max_live`` (requests already running on them go on). ``rolled_back``:
    ``version`` is served again after a rollback: the versions newer than it are no longer listed."""
    noted = getattr(client, "adapter_committed", None)
    if callable(noted):
        noted(name, version)
        return
    base = getattr(client, "base_url", None)
    if not isinstance(base, str):
        return
    http = HttpClient(base, timeout=float(getattr(client, "timeout", 300.0)))
    full = f"{name}@v{version}"
    listed = {str(card["id"]) for card in http.get("v1/models")["data"]}
    if full not in listed:  # a rollback's version is listed still: loading it again is refused
        http.post("v1/load_lora_adapter", {"lora_name": full, "lora_path": f"groupbridge:{full}"})
    versions: dict[int, str] = {}
    for served in listed:
        stem, _, number = served.rpartition("@v")
        if stem == name and number.isdigit():
            versions[int(number)] = served
    # the newest max_live committed versions stay listed (a rolled-back one is unlisted at its rollback, so
    # the versions listed are the committed ones: counted, not subtracted, since versions have gaps)
    kept = sorted(n for n in {*versions, version} if n <= version)[-max_live:]
    for n, served in sorted(versions.items()):
        if n not in kept:
            http.post("v1/unload_lora_adapter", {"lora_name": served})


def served_version(client: Any) -> int | None:
    """What :meth:`VllmControl.served` says: the version the engine reports (:func:`reported_version`),
    when it is a number."""
    return as_version(reported_version(client))


def reported_version(client: Any) -> str | None:
    """The weight version vLLM reports, as it reports it: the client's own ``reported_version`` (an offline
    engine's), else the server's ``/weight_info`` at its ``base_url``; None where it cannot say."""
    own = getattr(client, "reported_version", None)
    if callable(own):
        got = own()
        return str(got) if got is not None else None
    base = getattr(client, "base_url", None)
    if not isinstance(base, str):
        logger.warning("groupbridge: %s cannot say which version its engine serves: a new trainer's first "
                       "update is 1 unless first_version is given", type(client).__name__)  # fmt: skip
        return None
    version = HttpClient(base, timeout=float(getattr(client, "timeout", 300.0))).get("weight_info")
    label = version.get("weight_version") if isinstance(version, dict) else None
    return str(label) if label is not None else None


def as_version(reported: Any) -> int | None:
    """An engine's reported ``weight_version`` as a version number (None: not one, e.g. vLLM's initial)."""
    text = str(reported) if reported is not None else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


class HttpClient:
    """A vLLM server's weight-sync and pause routes over HTTP (``vllm serve`` with
    ``VLLM_SERVER_DEV_MODE=1``), with the standard library only. Every request is bounded by ``timeout``."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def post(self, route: str, body: dict[str, Any] | None = None, **query: str) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        return self._request("POST", route, data, query)

    def get(self, route: str) -> Any:
        return self._request("GET", route, None, {})

    def _request(self, method: str, route: str, data: bytes | None, query: dict[str, str]) -> Any:
        url = f"{self.base_url}/{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        req = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise RuntimeError(f"{method} {url}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RuntimeError(f"{method} {url} (bounded by {self.timeout:g} s): {e}") from e
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:  # some routes answer plain text ("Success: ...")
            return raw.decode(errors="replace")

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
