"""Shared buffers on one host: anonymous shared memory (``shm``) or CUDA IPC (``cuda_ipc``).

The sender owns a ring of bucket-sized slots that every receiver maps; per bucket the sender fills a slot
and signals it on the group's control channel, the receivers copy out in parallel and signal they are done,
and the sender refills the slot ``slots`` buckets later.

Shared-memory slots are ``memfd_create`` files: nameless, so nothing is left in /dev/shm whoever is killed
when, and a small /dev/shm (Docker's 64 MiB) does not limit them. Their pages are reserved with
``posix_fallocate`` first, so a host short of memory refuses the transport with an error instead of killing
the sender with SIGBUS at its first write. A receiver opens only a slot the sender announced on the (sealed,
with a token) control channel, through ``/proc/<pid>/fd/<n>`` of the pid the sender declared at join, and
checks the announced inode. CUDA IPC slots live as long as the sender's transport; receivers drop their
mappings when the sender announces new slots or when they close.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ... import _torch_private
from ...control import Deadline
from ...errors import GroupBridgeError, ProtocolError, TransportUnavailableError, WeightSyncError
from ...stateless import StatelessGroup
from ..plan import Plan
from .base import Land, Landing, PlainOptions, Sync, TransportSpec, wire_int

logger = logging.getLogger(__name__)

__all__ = ["CUDA_IPC", "SHM", "SharedOptions", "SharedRx", "SharedTx"]

MAX_SLOTS = 16


@dataclass(frozen=True, slots=True)
class SharedOptions(PlainOptions):
    """Options of transports ``shm`` and ``cuda_ipc``."""

    transport: ClassVar[tuple[str, ...]] = ("shm", "cuda_ipc")
    slots: int = 2
    """Bucket-sized shared buffers in the ring: while receivers copy out of one, the sender fills the next."""

    def __post_init__(self) -> None:
        if type(self.slots) is not int or not 2 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots={self.slots!r} must be an int in 2..{MAX_SLOTS}")

    @classmethod
    def parse(cls, d: Any, world_size: int, src: int) -> SharedOptions:
        return cls(wire_int(d, "slots", "shared-buffer options", 2, MAX_SLOTS))


def _max_bucket(plan: Plan) -> int:
    return max((e - s for s, e in plan.bounds), default=0)


class _Segment:
    """One anonymous shared-memory file and its mapping in this process."""

    def __init__(self, nbytes: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise TransportUnavailableError("transport='shm' needs memfd_create (Linux)")
        try:
            self.fd = os.memfd_create("groupbridge-slot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:  # EMFILE/ENFILE at the descriptor limit, ENOMEM
            raise TransportUnavailableError(
                f"transport='shm' could not make a shared-memory file on this host: {e.strerror or e}"
            ) from e
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # reserve now: ENOSPC here, never SIGBUS later
            # torch maps the file and keeps no descriptor: after close(), none is left, whoever holds a view
            size = max(nbytes, 1)
            tensor = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as e:
            os.close(self.fd)
            raise TransportUnavailableError(
                f"transport='shm' could not reserve {nbytes / 2**20:.0f} MiB of shared memory on this host: "
                f"{getattr(e, 'strerror', None) or e}"
            ) from e
        _seal_memfd(self.fd)  # at once: this process's mapping is the only writable one there will be
        self.ino = os.fstat(self.fd).st_ino
        self.tensor = tensor[:nbytes]
        self.tensor.fill_(0)  # fault every page in now, not inside a timed transfer

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python names it from 3.12


def _seal_memfd(fd: int) -> None:
    """Once the sender's own writable mapping exists, nobody may write the file (a process of the same user
    opening /proc/<sender>/fd/<n> read-write, a compromised receiver) nor resize it (a receiver's read would
    fault): a slot's bytes are the sender's, so its digest is that of what the sender packed. Kernels before
    5.1 (no future-write seal) get the size seals only."""
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
        return
    except OSError:
        logger.warning("this kernel cannot seal shared-memory slots against other writers (Linux < 5.1)")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError:
        logger.warning("this kernel cannot seal shared-memory slots at all")


def _open_peer_fd(pid: int, fd: int, ino: int, nbytes: int, *, writable: bool) -> torch.Tensor:
    """Map another process's descriptor (same host, same pid namespace) after checking it is the one meant."""
    path = f"/proc/{pid}/fd/{fd}"
    opened = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        st = os.fstat(opened)
        if st.st_ino != ino:
            raise WeightSyncError(f"{path} is not the announced shared memory (inode {st.st_ino}, not {ino})")
        if st.st_size < nbytes:
            raise WeightSyncError(f"{path} holds {st.st_size} bytes, fewer than the {nbytes} announced")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(opened, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(opened)
    with warnings.catch_warnings():  # read-only on purpose: this side only copies out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def _int(d: Any, key: str, limit: int = 1 << 62) -> int:
    return wire_int(d, key, "bucket signal", 0, limit)


class SharedTx:
    """The source's ring of slots; see the module's docstring."""

    def __init__(self, group: StatelessGroup, options: SharedOptions, kind: str) -> None:
        self.group = group
        self.kind = kind
        self.slots = options.slots
        self._slots: list[torch.Tensor] = []
        self._segments: list[_Segment] = []
        self._offer: dict[str, Any] = {}
        self._gen = 0
        self._key = ""
        self._deadline: Deadline | None = None
        self._copy: Any = None
        self._posted = 0
        self._receivers = [r for r in range(group.world_size) if r != group.rank]
        self._to: tuple[int, ...] | None = None
        self._index: list[int] = []
        """With ``Sync.to``: each bucket's place among its receiver's own (what that receiver calls it)."""
        self.external = 0
        """Buckets of the last sync that receivers read from the sender's own shared memory (no copy)."""

    def reserve(self, plan: Plan, device: torch.device) -> None:
        self.external = 0  # called before every sync
        need = _max_bucket(plan)
        if self._slots and self._slots[0].numel() >= need and self._slots[0].device == device:
            return
        self._release()
        self._gen += 1
        try:
            for _ in range(self.slots):
                if self.kind == "shm":
                    seg = _Segment(need)
                    self._segments.append(seg)
                    self._slots.append(seg.tensor)
                else:
                    self._slots.append(torch.zeros(need, dtype=torch.uint8, device=device))
        except BaseException:
            self._release()  # all slots or none: never a ring short of a slot
            raise
        descs: list[Any] = (
            [{"fd": seg.fd, "ino": seg.ino} for seg in self._segments]
            if self.kind == "shm"
            else [_torch_private.share_cuda(s.untyped_storage()) for s in self._slots]
        )
        self._offer = {"gen": self._gen, "nbytes": self._slots[0].numel(), "slots": descs}

    def offer(self) -> dict[str, Any]:
        return self._offer

    def open(self, plan: Plan, device: torch.device, sync: Sync[SharedOptions]) -> None:
        if not self._slots or self._slots[0].numel() < _max_bucket(plan):
            raise WeightSyncError(
                f"{self.kind}: a stream of buckets up to {_max_bucket(plan)} bytes was opened on slots that "
                "were not reserved for it"
            )
        self._deadline = sync.deadline
        self._copy = sync.copy
        self._key = sync.key
        self._posted = 0
        self._to = sync.to
        if sync.to is not None:
            seen: dict[int, int] = {}
            self._index = []
            for dst in sync.to:
                self._index.append(seen.get(dst, 0))
                seen[dst] = self._index[-1] + 1

    def _signal(self, what: str, k: int) -> str:
        if self._to is None:
            return f"{self._key}/{what}/{k}"
        return f"{self._key}/{what}/{self._to[k]}/{self._index[k]}"

    def _wait_free(self, k: int) -> None:
        """Wait until every receiver is done with the bucket that used slot k % slots before."""
        prev = k - self.slots
        if prev < 0:
            return
        assert self._deadline is not None
        receivers = self._receivers if self._to is None else [self._to[prev]]
        keys = [f"{self._signal('done', prev)}/{r}" for r in receivers]
        ctl = self.group.control
        ctl.get(keys, receivers, self._deadline, f"receivers done with bucket {prev}")
        ctl.discard([*keys, self._signal("ready", prev)])  # deleted off the data path

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._wait_free(k)
        return self._slots[k % self.slots][:nbytes]

    def post(self, k: int, view: torch.Tensor) -> None:
        slot = self._slots[k % self.slots]
        signal: dict[str, Any] = {"slot": k % self.slots, "nbytes": view.numel()}
        source = _shared_source(view) if self.kind == "shm" and view.data_ptr() != slot.data_ptr() else None
        if source is not None:
            signal = source  # receivers read the sender's own shared memory: no copy here
            self.external += 1
        elif view.data_ptr() != slot.data_ptr():
            self._wait_free(k)
            self._copy(slot[: view.numel()], view)
        _sync(slot)
        # not acknowledged on its own: the next call on this connection (the wait for receivers to free a
        # slot, or for their acknowledgements) is answered after the store applied it, or fails
        self.group.control.post(self._signal("ready", k), json.dumps(signal).encode(), "signalling a bucket")
        self._posted = k + 1

    def finish(self) -> None:
        for k in range(max(0, self._posted - self.slots), self._posted):
            self._wait_free(k + self.slots)

    def _release(self) -> None:
        self._slots = []
        self._offer = {}
        for seg in self._segments:
            seg.close()
        self._segments = []

    def close(self) -> None:
        self._release()


class SharedRx:
    """A receiver's mappings of the source's slots; see the module's docstring."""

    def __init__(self, group: StatelessGroup, kind: str) -> None:
        self.group = group
        self.kind = kind
        self.src = 0
        self.scratch_buffers = 2
        self._slots: list[torch.Tensor] = []
        self._gen: tuple[int, int] = (-1, 0)
        """(source, generation) of the slots mapped."""
        self._key = ""
        self._copy: Any = None
        self._pair = False
        """This receiver's pair of a many-source stream (``Sync.to``): its buckets' signals carry its rank."""
        self._sources: dict[tuple[int, int], torch.Tensor] = {}
        """The sender's own shared storages mapped during the current sync (dropped at the next)."""

    def attach(self, offer: dict[str, Any], src: int) -> str | None:
        """Map the offered slots unless they are mapped already; why not, if this receiver cannot."""
        self.src = src
        self._sources.clear()
        try:
            gen = (src, _int(offer, "gen"))
            if gen != self._gen or not self._slots:
                nbytes = _int(offer, "nbytes")
                slots = offer.get("slots")
                if not isinstance(slots, list) or not 2 <= len(slots) <= MAX_SLOTS:
                    raise ProtocolError("the offer does not name the ring's slots")
                self._slots = []
                self._slots = [self._map(d, nbytes) for d in slots]
                self._gen = gen
        except (OSError, RuntimeError, GroupBridgeError) as e:  # GroupBridgeError: a malformed offer
            self._slots = []
            return f"could not map the sender's {self.kind} slots: {type(e).__name__}: {e}"
        return None

    def open(self, plan: Plan, device: torch.device, sync: Sync[SharedOptions]) -> None:
        if len(self._slots) != sync.options.slots:
            raise ProtocolError(
                f"the source announced {sync.options.slots} slots and offered {len(self._slots)}"
            )
        self._key = sync.key
        self._copy = sync.copy
        self._pair = sync.to is not None

    def _signal(self, what: str, k: int) -> str:
        return f"{self._key}/{what}/{self.group.rank}/{k}" if self._pair else f"{self._key}/{what}/{k}"

    def _map(self, desc: Any, nbytes: int) -> torch.Tensor:
        if self.kind == "shm":
            pid = self.group.pids[self.src]
            return _open_peer_fd(pid, _int(desc, "fd"), _int(desc, "ino"), nbytes, writable=False)
        storage = _torch_private.open_shared_cuda(desc)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))

    def buckets(self, plan: Plan, land: Land, deadline: Deadline) -> Iterator[tuple[int, torch.Tensor, bool]]:
        ctl = self.group.control
        for k in range(len(plan.buckets)):
            start, end = plan.bucket_range(k)
            raw = ctl.get_one(self._signal("ready", k), self.src, deadline, f"bucket {k}")
            try:
                signal = json.loads(raw)
            except ValueError as e:
                raise ProtocolError(f"bucket {k}'s signal is not JSON: {e}") from None
            slot = self._slot_for(signal, end - start)
            landed = land(k)
            view = landed.view
            if landed.landing is Landing.SCRATCH and view.device == slot.device:
                yield k, slot, False  # the slot is freed when the next bucket is asked for
                _sync(slot)  # what the consumer queued on the device reading it (CUDA IPC) ran first
            else:
                self._copy(view, slot)
                _sync(view)
                self._done(k)
                yield k, view, landed.in_place
                continue
            self._done(k)

    def _slot_for(self, signal: Any, nbytes: int) -> torch.Tensor:
        if _int(signal, "nbytes") != nbytes:
            raise ProtocolError(f"a bucket signal announces {signal.get('nbytes')} bytes, the plan {nbytes}")
        if "slot" in signal:
            return self._slots[_int(signal, "slot", len(self._slots) - 1)][:nbytes]
        return self._external(signal, nbytes)

    def _external(self, d: Any, nbytes: int) -> torch.Tensor:
        """The sender's own shared storage holding this bucket, mapped through /proc (this sync only)."""
        if self.kind != "shm":
            raise ProtocolError("an external source is announced outside transport 'shm'")
        fd, ino, size, offset = _int(d, "fd"), _int(d, "ino"), _int(d, "size"), _int(d, "offset")
        if offset + nbytes > size:
            raise ProtocolError(
                f"the announced bucket [{offset}, {offset + nbytes}) lies outside {size} bytes"
            )
        mapped = self._sources.get((fd, ino))
        if mapped is None:
            mapped = _open_peer_fd(self.group.pids[self.src], fd, ino, size, writable=False)
            self._sources[(fd, ino)] = mapped
        return mapped[offset : offset + nbytes]

    def _done(self, k: int) -> None:
        self.group.control.post(f"{self._signal('done', k)}/{self.group.rank}", b"1", f"bucket {k} done")

    def close(self) -> None:
        self._slots = []
        self._sources.clear()


def _shared_source(view: torch.Tensor) -> dict[str, int] | None:
    """Where a receiver on this host can map ``view`` from, if it is in shared memory (``share_memory_()``):
    torch keeps such an unlinked file open, which a process of the same user and host can reopen through
    /proc/<pid>/fd/<n>; the inode guards against a reused descriptor number."""
    if view.device.type != "cpu":
        return None
    storage = view.untyped_storage()
    if not storage.is_shared():
        return None
    try:
        fd, size = _torch_private.share_fd_cpu(storage)
        ino = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return None
    offset = view.data_ptr() - storage.data_ptr()
    return {"fd": fd, "ino": int(ino), "size": size, "offset": offset, "nbytes": view.numel()}


def _spec(kind: str, device: str) -> TransportSpec[SharedOptions]:
    return TransportSpec(
        kind, SharedOptions, SharedOptions.parse,
        lambda group, options: SharedTx(group, options, kind),
        lambda group: SharedRx(group, kind),
        one_host=True, devices=(device,), pairs=True,
    )  # fmt: skip


SHM = _spec("shm", "cpu")
CUDA_IPC = _spec("cuda_ipc", "cuda")
