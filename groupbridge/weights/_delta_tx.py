"""What a source holds to send deltas (``WeightSender(delta=True)``): the policy, the fan-out base, the diff
(:class:`Diffs`, of every delta stream); see :mod:`._delta_sync` for what travels."""

from __future__ import annotations

import time
from collections import deque
from functools import partial

import torch

from ..stateless import StatelessGroup
from . import _bytes, _delta, _delta_sync
from ._copier import Copier, Job
from ._delta_sync import Policy
from ._session import Session
from ._sharded_delta import FANOUT, Bases
from ._source import Puller, SourceReads
from .manifest import Manifest
from .plan import Plan

Diffed = tuple[_delta_sync.Diffed, bool]
"""A bucket's diff, and whether its new bytes were read in place."""


class DeltaSender:
    """The policy that decides, per sync, whether a delta pays, and the source's fan-out base (the plan-layout
    bytes of the version every receiver acknowledged), kept in the member's one store of bases
    (:class:`~._sharded_delta.Bases`, under :data:`~._sharded_delta.FANOUT`) beside its pairs' bases."""

    def __init__(
        self, group: StatelessGroup, copier: Copier, scratch: _bytes.BufferCache, always: bool, bases: Bases,
        policy: Policy | None = None,
    ) -> None:  # fmt: skip
        self.group, self.copier, self.scratch, self.bases = group, copier, scratch, bases
        self.policy = policy if policy is not None else Policy()
        """An earlier sender's measurements of the link when its memory kept them (``always``: this one's)."""
        self.policy.always = always
        self._second: Copier | None = None

    def offer(self, manifest: Manifest) -> int | None:
        """The base version this sync's header offers a delta against, if the policy wants one."""
        offer = self.bases.held(FANOUT, manifest.digest)
        return offer if self.policy.wants_delta() else None

    def prepare(self, session: Session, plan: Plan, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        """The buffer this sync writes the new version into (None: the base is not refreshed, so the next
        sync cannot be a delta), and whether a full sync should time a diff on the way. The base is invalid
        until the sync is acknowledged everywhere (:func:`._tx_stream.source_sync`; a sync that fails midway
        leaves receivers on different versions: the next one is then a full sync)."""
        sample = self.bases.held(FANOUT, session.manifest.digest) is not None and not session.delta
        if not (session.delta or self.policy.keep_base()):
            self.bases.invalidate(FANOUT)
            return None, False
        return self.bases.begin(FANOUT, session.manifest.digest, plan.total_bytes, device)[0], sample

    def sample(self, puller: Puller, plan: Plan, old: torch.Tensor, k: int) -> None:
        """Pack bucket ``k`` into scratch and bring ``old`` (its base) up to it, diffing a slice on the
        way to time the diff (on the copy thread)."""
        new = self.scratch.get("delta-new0", old.numel(), old.device)
        _bytes.pack(new, plan.buckets[k], puller.live, puller.wire)
        w = _delta.word_size(plan, puller.manifest, k)
        m = min(old.numel(), Policy.SAMPLE_BYTES) // w * w
        t0 = time.perf_counter()
        enc = _delta.encode(new[:m], old[:m], w)
        seconds = time.perf_counter() - t0
        wire = _delta.payload_nbytes(enc.code, enc.count, enc.words, w)
        self.policy.record_sample(seconds, m, enc.count / max(enc.words, 1), wire)
        old[m:].copy_(new[m:])

    def workers(self) -> list[Copier]:
        """Two copy threads diff buckets side by side (the diff is the source's bottleneck; they run ahead
        into a fan-out's next group of buckets while this one travels)."""
        if self._second is None:
            self._second = Copier(f"{self.group.name}-{self.group.rank}-diff")
        self._second.deadline = self.copier.deadline
        return [self.copier, self._second]

    def close(self) -> None:
        if self._second is not None:
            self._second.close()
            self._second = None


class Diffs:
    """Each bucket of a stream's cut (``reads.cut``) diffed against its base (bringing the base up to the new
    version) on demand: the one diff of every delta stream's source, a fan-out's or a pair's. The copy
    threads are kept a few buckets ahead of the caller, each packing its bucket (unless the source holds it
    where it lies) and diffing it; the source's tensors a bucket reads are pulled on the caller's thread
    first (a lazy source yields them there) and let go once it is diffed (see :class:`._source.SourceReads`).
    Returns each bucket's diff and whether its new bytes were read in place."""

    def __init__(
        self, reads: SourceReads, base: torch.Tensor, words: list[int], workers: list[Copier],
        scratch: _bytes.BufferCache, kind: str, group: StatelessGroup,
    ) -> None:  # fmt: skip
        self.reads, self.cut, self.base, self.words, self.workers = reads, reads.cut, base, words, workers
        self.scratch, self.kind, self.group = scratch, kind, group
        self.biggest = max((e - s for s, e in reads.cut.bounds), default=0)
        self.results: list[Diffed | None] = [None] * len(reads.cut.bounds)
        self.pending: deque[tuple[int, Job[Diffed]]] = deque()
        self.submitted = 0

    def _diff(self, k: int, worker: int) -> Diffed:
        """On a copy thread, while the other diffs the next bucket and the caller's thread sends."""
        start, end = self.cut.bucket_range(k)
        new = self.reads.direct(k)
        flat = new is not None
        if new is None:
            new = self.scratch.get(f"delta-new{worker}", end - start, self.base.device)
            self.reads.pack(k, new)
        mask = self.scratch.get(f"delta-mask{worker}", self.biggest, self.base.device).view(torch.bool)
        return _delta_sync.diff(new, self.base[start:end], self.words[k], mask, self.kind, self.group), flat

    def __call__(self, k: int) -> Diffed:
        n = len(self.cut.bounds)
        while self.results[k] is None:
            while self.submitted < n and len(self.pending) < 2 * len(self.workers):
                s = self.submitted
                self.reads.pull(s)
                w = s % len(self.workers)
                self.pending.append((s, self.workers[w].submit(partial(self._diff, s, w))))
                self.submitted += 1
            j, job = self.pending.popleft()
            self.results[j] = job.result()
            self.reads.release(j)
        r = self.results[k]
        assert r is not None
        return r

    def described(self, a: int, b: int) -> tuple[_delta_sync.Description, list[torch.Tensor], list[Diffed]]:
        """Buckets [a, b) diffed: what the receivers are told of them, the payloads that travel (one per
        bucket that changed, in order: the wire plan's buckets) and each one's diff."""
        done = [self(k) for k in range(a, b)]
        payloads = [
            d.payload(self.base[slice(*self.cut.bucket_range(a + i))]) for i, (d, _) in enumerate(done)
        ]
        return _delta_sync.describe([d for d, _ in done]), [t for t in payloads if t is not None], done
