"""What an engine tells a worker session about its model: the :class:`Loader`, and what more it may do."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

from ..errors import TornUpdateError
from ..weights.manifest import Manifest
from ..weights.shard import Box

__all__ = ["Loader", "ReadsBoxes", "Swaps", "load_whole"]

Pairs = Iterator[tuple[str, torch.Tensor]]


class Loader(Protocol):
    """What an engine tells a :class:`WorkerSession` about its model.

    ``check`` runs during the handshake, before any bytes move: None takes the manifest, a message refuses
    it (every member then raises the same ``ManifestMismatchError`` and the bridge stays usable). ``load``
    consumes the pairs (views of the kept buffer, valid until the next update: it may hold them until the
    update is whole, never write to them). ``finish`` is called after every ``load``, returned or raised: it
    leaves the model able to serve (a reload finalized, kernels repacked).
    """

    def check(self, manifest: Manifest) -> str | None: ...

    def load(self, weights: Pairs) -> None: ...

    def finish(self) -> None: ...


class Swaps(Protocol):
    """A :class:`Loader` that keeps a second copy of its model, the shadow: an update is loaded and
    processed into the shadow off the serving path (an atomic update's on the landing thread, before the
    sender is acknowledged), and the commit exchanges the two copies, a pause that does not grow with the
    model. The copy that served is then the shadow, holding the previous version: a rollback exchanges
    them back.

    ``swapping()``: whether the update being received goes through the shadow (one that does not, an
    adapter's, is loaded as by any loader). ``prepare(pairs)``: load and process them into the shadow, all
    of it, the serving copy untouched (views of the kept buffer, as ``load`` gets). ``swap()``: exchange
    the copies; it runs where ``load`` would (the engine's commit). An atomic update through the shadow
    has its handshake on the landing thread too, the engine serving meanwhile: ``check`` (and ``reads``)
    then runs there, so it must not touch the serving copy (a dry run checks against the shadow)."""

    def swapping(self) -> bool: ...

    def prepare(self, weights: Pairs) -> None: ...

    def swap(self) -> None: ...


class ReadsBoxes(Protocol):
    """A :class:`Loader` that also says, after ``check``, which box of each tensor its model reads (a
    tensor-parallel worker keeps its slice; None: none of it): every later update from the same trainer
    manifests brings this worker only those boxes (see ``WeightReceiver.receive(reads=...)``)."""

    def reads(self, manifest: Manifest) -> Mapping[str, Box | None]: ...


def load_whole(
    loader: Loader, weights: Pairs, version: int, mix: Sequence[object], log: logging.Logger
) -> float:
    """``loader``'s load of ``weights`` (version ``version``), then its finish, whatever happened; returns
    the finish's seconds. A load that fails midway raises TornUpdateError naming what was written and the
    versions the model then holds parts of (``mix``: what it held, ``version`` among them)."""
    loaded: list[str] = []

    def counted() -> Pairs:
        for name, t in weights:
            loaded.append(name)
            yield name, t

    try:
        loader.load(counted())
    except Exception as e:
        try:
            loader.finish()
        except Exception:
            log.exception("groupbridge: finishing the interrupted load failed")
        raise TornUpdateError(
            f"loading version {version} failed after {len(loaded)} tensors: {type(e).__name__}: {e}; the "
            f"model now holds {_mixed(mix)}, torn until an update loads (the next one loads every tensor)",
            written=loaded,
        ) from e
    except BaseException:
        loader.finish()
        raise
    t0 = time.perf_counter()
    loader.finish()
    return time.perf_counter() - t0


def _mixed(mix: Sequence[object]) -> str:
    """The versions a torn model holds parts of, in words: "a mix of two versions (1 and 2)"."""
    words = [str(v) for v in mix]
    if len(words) < 2:
        return f"version {words[0] if words else '?'}, partly rewritten"
    count = {2: "two", 3: "three"}.get(len(words), str(len(words)))
    return f"a mix of {count} versions ({', '.join(words[:-1])} and {words[-1]})"
