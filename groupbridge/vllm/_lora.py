"""LoRA adapters received over the bridge and served by vLLM from memory: a fresh name per version.

An adapter update carries only the adapter's tensors (as PEFT names them) and its config (rank, alpha,
target modules), through the same bridge, handshake, checks and commit as a full update. The worker's commit
files them in its engine's :class:`Adapters` under ``<name>@v<version>`` and never touches the base weights.

vLLM loads an adapter when a request first names it (``LoRARequest``), from a path; and after every weight
update it drops every loaded adapter (``reset_lora_state``), reloading each on its next use. Both paths go
through the worker's LoRA loader, which ``_compat.serve_adapters`` has ask the engine's :class:`Adapters`
about one path scheme, ``groupbridge:``: such an adapter is built from the filed tensors (vLLM's own
``LoRAModel.from_lora_tensors``), so nothing goes through disk, and a request begun on version 2 goes on
with version 2's adapter after version 3 is committed (its name, and the tensors behind it, are never
reused). Any other path loads as before, and engines of another backend are not touched.

The newest ``max_live`` versions of a name stay filed; an older one leaves at a later commit once no
unfinished request names it (running, waiting or preempted: the engine core tells the workers at each
commit, see ``_compat``). The engine core then admits a request naming a ``groupbridge:`` adapter only
when every worker can load it until the next commit: a load that failed inside a model step would end the
engine, a refused request fails alone.

Any API client of ``vllm serve`` (with runtime LoRA updating on) can ask vLLM to load an adapter; the
loader refuses, at that call and before anything is listed, a ``groupbridge:`` path under any name but its
own (another name would outlive the version filed behind it, and its next load would fail inside a model
step, where it ends the engine) and an adapter from anywhere else under a version name,
``<name>@v<version>`` (names are predictable: a client could take the next version's name ahead of the
trainer, and every request for it would get that client's weights).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("vllm.groupbridge")

SCHEME = "groupbridge:"
"""The ``lora_path`` of an adapter received over the bridge (see :class:`Adapters`)."""

_VERSION_NAME = re.compile(r"[^@/]+@v[0-9]+")
"""The names adapters received over the bridge are served under (:func:`adapter_name`)."""

__all__ = [
    "SCHEME",
    "AdapterSpec",
    "Adapters",
    "adapter_id",
    "adapter_name",
    "adapter_request",
    "peft_adapter",
]


def adapter_name(name: str, version: int) -> str:
    """The name version ``version`` of adapter ``name`` is served under: never reused."""
    return f"{name}@v{version}"


def adapter_id(full_name: str) -> int:
    """vLLM's integer id of an adapter (> 0), the same in every process: from its name."""
    return zlib.crc32(full_name.encode()) % (2**31 - 2) + 1


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter update tells the workers beside the bytes (plain JSON, in the update's info)."""

    name: str
    config: dict[str, Any]
    max_live: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "@" in self.name or "/" in self.name:
            raise ValueError(f"adapter name {self.name!r}: a non-empty name without '@' or '/'")
        if isinstance(self.max_live, bool) or not isinstance(self.max_live, int) or self.max_live < 1:
            raise ValueError(f"max_live_adapters={self.max_live!r} must be an int >= 1")
        r = self.config.get("r") if isinstance(self.config, dict) else None
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"the adapter's config needs its rank r (an int >= 1), got {r!r}")

    @classmethod
    def parse(cls, raw: Any) -> AdapterSpec:
        if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
            raise ValueError(f"adapter must be {{'name', 'config', 'max_live'}}, got {type(raw).__name__}")
        return cls(name=raw.get("name"), config=raw["config"], max_live=raw.get("max_live", 2))  # type: ignore[arg-type]


def peft_adapter(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT model's active adapter: its tensors (named as PEFT saves them, ``...q_proj.lora_A.weight``)
    and its config as plain JSON."""
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError as e:
        raise ImportError("adapter updates read a PEFT model: pip install 'groupbridge[lora]'") from e
    if not isinstance(module, PeftModel):
        raise TypeError(
            f"TrainerInitInfo(adapter=...) sends a PEFT model's adapter; the source's module is a "
            f"{type(module).__name__}"
        )
    actives = list(module.active_adapters)
    if len(actives) != 1:  # PEFT's active_adapter names the first alone: the engine would serve another model
        raise ValueError(
            f"the PEFT model has {len(actives)} active adapters ({', '.join(actives)}); an update sends one: "
            "activate only the adapter to serve (model.set_adapter(name))"
        )
    active = actives[0]
    tensors = get_peft_model_state_dict(module, adapter_name=active)

    def plain(o: Any) -> Any:
        return sorted(o) if isinstance(o, (set, frozenset)) else str(o)

    config = json.loads(json.dumps(module.peft_config[active].to_dict(), default=plain))
    return {n: t.detach() for n, t in tensors.items()}, config


# ---------------------------------------------------------------------------------------------- worker side


class Adapters:
    """One engine worker's adapters received over the bridge: full name -> (tensors, config), the live
    versions of each name (oldest first), and the versions a rollback withdrew. Held by the worker's
    transfer engine (one per engine, never shared by two engines of a process); vLLM's loader finds it
    through ``_compat.serve_adapters``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._filed: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self._live: dict[str, list[str]] = {}
        self._retired: set[str] = set()
        """Withdrawn by a rollback: no longer handed out, still loadable until no request uses them (a
        request that named one between the swap and the rollback would otherwise end vLLM's engine)."""

    def install(
        self, spec: AdapterSpec, version: int, pairs: Iterable[tuple[str, Any]], in_use: Iterable[int]
    ) -> str:
        """File an adapter's tensors (copied: the pairs are views of the kept buffer, reused next update)
        under its fresh name; drop the versions beyond ``max_live`` whose id is not ``in_use`` (by a request
        the engine still serves). Returns the name."""
        full = adapter_name(spec.name, version)
        tensors = {n: t.clone() for n, t in pairs}
        used = set(in_use)
        with self._lock:
            self._filed[full] = (tensors, dict(spec.config))
            names = [n for n in self._live.get(spec.name, []) if n != full] + [full]
            keep = names[-spec.max_live :]
            for old in names[: -spec.max_live]:
                if adapter_id(old) in used:  # a request still generates with it
                    keep.insert(0, old)
                else:
                    self._filed.pop(old, None)
            self._live[spec.name] = keep
            for old in [n for n in self._retired if adapter_id(n) not in used]:
                self._retired.discard(old)
                self._filed.pop(old, None)
        logger.info(
            "groupbridge: adapter %s filed (%d tensors); live: %s", full, len(tensors), ", ".join(keep)
        )
        return full

    def withdraw_newer(self, name: str, version: int) -> list[str]:
        """Drop the versions of adapter ``name`` newer than ``version`` (a rollback); returns their names.
        Raises LookupError, dropping nothing, when ``version`` itself is not served."""
        keep = adapter_name(name, version)
        with self._lock:
            live = self._live.get(name, [])
            if keep not in live:
                raise LookupError(f"cannot roll adapter {name!r} back to version {version}: it serves {live}")
            newer = [n for n in live if int(n.rsplit("@v", 1)[1]) > version]
            self._retired.update(newer)  # dropped at a later commit, once no request uses them
            self._live[name] = [n for n in live if n not in newer]
        logger.warning(
            "groupbridge: adapter %s served again; withdrawn: %s", keep, ", ".join(newer) or "none"
        )
        return newer

    def names(self) -> list[str]:
        """Every adapter version this worker can load."""
        with self._lock:
            return sorted(self._filed)

    def live(self, name: str) -> list[str]:
        with self._lock:
            return list(self._live.get(name, []))

    def filed(self, full: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors and config of version ``full``. Raises ValueError naming what is live."""
        with self._lock:
            entry = self._filed.get(full)
            if entry is None:
                raise ValueError(
                    f"adapter {full!r} is not served by this worker (live: {sorted(self._filed)}): it was "
                    "never received, or is older than the newest max_live_adapters"
                )
            return entry

    def check_load(self, path: str, name: str) -> str | None:
        """What vLLM's loader does with a request to load ``name`` from ``path``: the filed version it
        loads (a ``groupbridge:`` path, under its own name alone), or None (any other path loads as vLLM
        would, under any name but a version name). Raises ValueError for a load refused."""
        if path.startswith(SCHEME):
            own = path[len(SCHEME) :]
            if name != own:
                raise ValueError(f"adapter {path!r} is served only under its own name {own!r}, not {name!r}")
            return own
        if _VERSION_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is a name of the adapter versions this engine receives over the bridge "
                "(<name>@v<version>): load an adapter of your own under another name"
            )
        return None


# ---------------------------------------------------------------------------------------------- user side


def adapter_request(llm: Any, name: str) -> Any:
    """The ``LoRARequest`` of the newest version of adapter ``name`` an offline ``vllm.LLM`` serves
    (``policy@v3``): pass it as ``llm.generate(..., lora_request=...)``. The newest is the last one a
    trainer of this process committed through :class:`groupbridge.vllm.OfflineClient`; else (updates sent
    by another process) the version the engine reports. Raises LookupError when there is none."""
    from vllm.lora.request import LoRARequest

    from ._client import committed_adapter

    full = committed_adapter(llm, name)
    if full is None:
        version = llm.get_weight_version()
        if version is None or not str(version).isdigit():
            raise LookupError(f"this engine serves no version of adapter {name!r} yet")
        full = adapter_name(name, int(version))
    return LoRARequest(full, adapter_id(full), lora_path=SCHEME + full)
