"""What a worker's model serves, and every way that changes (see :class:`ServedModel`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from ..errors import WeightSyncError
from ..weights.manifest import Manifest
from ._loader import Loader, Swaps, load_whole
from ._rollback import KeptCopy

__all__ = ["ServedModel"]

Pairs = Iterator[tuple[str, torch.Tensor]]


class ServedModel:
    """A worker's model as its session changes it: the version it serves, a load into it (torn until a
    load succeeds, when one fails midway), its shadow (an update prepared there off the serving path, then
    swapped in; the copy that served then holds the previous version), and a rollback (the shadow swapped
    back, or the bytes kept aside, :class:`KeptCopy`, loaded again). ``timings`` is the session's, filled
    with what each of these took."""

    def __init__(
        self, loader: Loader, swaps: Swaps | None, log: logging.Logger, timings: dict[str, float]
    ) -> None:
        self.loader = loader
        self.swaps = swaps
        self.log = log
        self.timings = timings
        self.version: int | None = None
        """The version the model holds (None: the weights it was started with)."""
        self.shadow_holds: int | None = None
        """The version the shadow holds, complete (the one served before the last swap); None: none."""
        self.clean = True
        """The serving copy holds ``version`` and nothing else (no load into it failed midway since)."""
        self.mix: tuple[object, ...] = ()
        """While not ``clean``: the versions the serving copy holds parts of (each load that failed midway
        adds its own), for the texts that say what a torn model holds."""
        self.kept = KeptCopy()
        """The bytes of the version served before the update in flight (``BridgeInfo.rollback``)."""

    def _held(self, initial: str = "the initial weights") -> object:
        return self.version if self.version is not None else initial

    def check(self, manifest: Manifest, seconds: list[float]) -> str | None:
        """The loader's dry run of ``manifest`` (None: it loads; else why not), its time onto ``seconds``."""
        t0 = time.perf_counter()
        try:
            return self.loader.check(manifest)
        finally:
            seconds.append(time.perf_counter() - t0)

    def load(self, weights: Pairs, version: int) -> None:
        """The loader's load, then its finish, whatever happened; a load that fails midway is torn."""
        before = self.mix if not self.clean else (self._held("the initial one"),)
        mix = before if version in before else (*before, version)
        self.clean, self.mix = False, mix
        self.timings["finish"] = load_whole(self.loader, weights, version, mix, self.log)
        self.clean, self.mix = True, ()

    def prepare(self, weights: Pairs, version: int | None) -> None:
        """The update into the shadow (see :class:`Swaps`); the serving copy is untouched whatever happens."""
        assert self.swaps is not None
        t0 = time.perf_counter()
        try:
            self.swaps.prepare(weights)
        except Exception as e:
            raise WeightSyncError(
                f"{'the update' if version is None else f'version {version}'} did not reach the shadow "
                f"whole ({type(e).__name__}: {e}); the serving model is untouched and serves {self._held()}"
            ) from e
        self.timings["prepare"] = time.perf_counter() - t0

    def swap(self, version: int, what: str) -> int:
        """The shadow, holding ``version``, becomes the serving copy; the copy that served, the shadow."""
        assert self.swaps is not None
        t0 = time.perf_counter()
        self.swaps.swap()
        self.timings[what] = time.perf_counter() - t0
        self.shadow_holds, self.version = self.version, version
        self.clean = True
        if what == "swap":
            self.log.info("groupbridge: version %d committed by a swap: %s", version,
                          ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items()))  # fmt: skip
        return version

    def check_rollback(self, version: int) -> None:
        """Raise WeightSyncError unless this model can serve ``version`` again: it serves it still, its
        shadow holds it, or the bytes kept aside are its."""
        if self.swaps is not None and version in (self.shadow_holds, self.version) and self.clean:
            return
        kept = self.kept.copy
        if kept is None or kept[0] != version:
            has = (
                f"version {kept[0]}"
                if kept
                else "none (rollback is off, or no update followed one it committed)"
            )
            raise WeightSyncError(
                f"cannot roll back to version {version}: this worker keeps the bytes of {has}; it still "
                f"serves {self._held()}"
            )

    def roll_back(self, version: int) -> int:
        """Serve ``version`` again (see :meth:`check_rollback`)."""
        if self.swaps is not None and self.clean and version == self.version:
            self.log.warning("groupbridge: version %d is served still: nothing to roll back", version)
            return version
        if self.swaps is not None and self.clean and version == self.shadow_holds:
            self.swap(version, "rollback")
            self.log.warning("groupbridge: rolled back to version %d by a swap (%.3f s)", version,
                             self.timings["rollback"])  # fmt: skip
            return version
        assert self.kept.copy is not None
        t0 = time.perf_counter()
        self.load(iter(self.kept.copy[1]), version)
        self.timings.clear()
        self.timings["rollback"] = time.perf_counter() - t0
        self.version = version
        self.kept.rolled_back()
        self.log.warning("groupbridge: rolled back to version %d (%.3f s)", version, self.timings["rollback"])
        return version
