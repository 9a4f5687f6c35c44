"""Shared buffers on one host: POSIX shared memory (``shm``) or CUDA IPC (``cuda_ipc``).

The sender owns a ring of bucket-sized slots that every receiver maps; for each bucket the sender fills a
slot and says so through the group's store, the receivers copy out in parallel and say they are done, and the
sender refills the slot two buckets later. Shared-memory segments are created private to the user (0600),
faulted in before use, and unlinked as soon as every receiver has mapped them, so nothing is left in
/dev/shm whoever is killed afterwards. CUDA IPC slots live as long as the sender's transport; receivers drop
their mappings when the sender announces new slots or when they close.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from ...errors import GroupBridgeError, TransportUnavailableError, WeightSyncError
from ...stateless import StatelessGroup
from ..plan import Plan
from .base import Land

__all__ = ["SHM_DIR", "SLOTS", "SharedRx", "SharedTx", "leftover_segments"]

SLOTS = 2
SHM_DIR = "/dev/shm"
PREFIX = "groupbridge-"


def _max_bucket(plan: Plan) -> int:
    return max((e - s for s, e in plan.bounds), default=0)


def _shm_create(nbytes: int) -> tuple[str, torch.Tensor]:
    if not os.path.isdir(SHM_DIR):
        raise TransportUnavailableError(f"transport='shm' needs {SHM_DIR}, which this host lacks")
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0)  # fault every page in now, not inside a timed transfer
    return name, t


def _shm_open(name: str, nbytes: int) -> torch.Tensor:
    if not name.startswith(PREFIX) or "/" in name:
        raise WeightSyncError(f"refusing shared-memory name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _unlink(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


class SharedTx:
    def __init__(self, group: StatelessGroup, kind: str) -> None:
        self.group = group
        self.name = kind
        self.kind = kind
        self._slots: list[torch.Tensor] = []
        self._gen = 0
        self._sid = ""
        self._timeout: timedelta | None = None
        self._posted = 0
        self.external = 0
        """Buckets of the last sync that receivers read from the sender's own shared memory (no copy)."""

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        self._timeout = options.get("timeout")
        self._sid = str(options["sync_id"])
        self._posted = 0
        self.external = 0
        need = _max_bucket(plan)
        names: list[str] = []
        fresh = not self._slots or self._slots[0].numel() < need or self._slots[0].device != device
        if fresh:
            self._slots = []
            self._gen += 1
            try:
                for _ in range(SLOTS):
                    if self.kind == "shm":
                        name, t = _shm_create(need)
                        names.append(name)
                        self._slots.append(t)
                    else:
                        self._slots.append(torch.zeros(need, dtype=torch.uint8, device=device))
                descs: list[Any] = (
                    names
                    if self.kind == "shm"
                    else [list(s.untyped_storage()._share_cuda_()) for s in self._slots]  # type: ignore[no-untyped-call]
                )
                announce = {"gen": self._gen, "nbytes": need, "slots": descs}
                self.group.broadcast_obj(announce, src=self.group.rank)
                verdicts = self.group.all_gather_obj(None)
            finally:
                _unlink(names)  # every receiver has mapped them (or failed): nothing stays in /dev/shm
        else:
            self.group.broadcast_obj({"gen": self._gen}, src=self.group.rank)
            verdicts = self.group.all_gather_obj(None)
        errors = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v]
        if errors:
            self._slots = []
            raise TransportUnavailableError(f"{self.kind} slots could not be mapped:\n" + "\n".join(errors))

    def _key(self, what: str, k: int) -> str:
        return f"wx/{self._sid}/{what}/{k}"

    def _wait_free(self, k: int) -> None:
        """Wait until every receiver is done with the bucket that used slot k % SLOTS before."""
        prev = k - SLOTS
        if prev < 0:
            return
        receivers = self.group.world_size - 1
        key = self._key("done", prev)
        store = self.group._store
        deadline = self.group._deadline(self._timeout)
        others = [r for r in range(self.group.world_size) if r != self.group.rank]
        self.group._poll(
            lambda: store.add(key, 0) >= receivers, deadline, f"receivers done with bucket {prev}", others
        )
        self.group._store_call(
            lambda: store.delete_key(key) and store.delete_key(self._key("ready", prev)), "shm"
        )

    def buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        self._wait_free(k)
        return self._slots[k % SLOTS][:nbytes]

    def post(self, k: int, view: torch.Tensor) -> None:
        slot = self._slots[k % SLOTS]
        signal = "1"
        source = _shared_source(view) if self.kind == "shm" and view.data_ptr() != slot.data_ptr() else None
        if source is not None:
            signal = json.dumps(source)  # receivers read the sender's own shared memory: no copy here
            self.external += 1
        elif view.data_ptr() != slot.data_ptr():
            self._wait_free(k)
            slot[: view.numel()].copy_(view)
        _sync(slot)
        ready = self._key("ready", k)
        self.group._store_call(lambda: self.group._store.set(ready, signal), "signalling a bucket")
        self._posted = k + 1

    def finish(self) -> None:
        for k in range(max(0, self._posted - SLOTS), self._posted):
            self._wait_free(k + SLOTS)

    def close(self) -> None:
        self._slots = []


class SharedRx:
    def __init__(self, group: StatelessGroup, src: int, kind: str) -> None:
        self.group = group
        self.src = src
        self.kind = kind
        self._slots: list[torch.Tensor] = []
        self._gen = 0
        self._sid = ""
        self._sources: dict[tuple[int, int, int], torch.Tensor] = {}

    def setup(self, plan: Plan, device: torch.device, options: dict[str, Any]) -> None:
        self._sid = str(options["sync_id"])
        announce = self.group.broadcast_obj(None, src=self.src)
        error = None
        if announce["gen"] != self._gen or not self._slots:
            if "slots" not in announce:
                error = f"holds no slots of generation {announce['gen']}"
            else:
                try:
                    self._slots = [self._map(d, int(announce["nbytes"])) for d in announce["slots"]]
                    self._gen = announce["gen"]
                except (OSError, RuntimeError) as e:
                    self._slots = []
                    error = f"{type(e).__name__}: {e}"
        try:
            self.group.all_gather_obj(error)
        except GroupBridgeError:
            if self.kind == "shm" and "slots" in announce:
                _unlink(list(announce["slots"]))  # the sender died before it could unlink them
            raise
        if error:
            raise TransportUnavailableError(
                f"rank {self.group.rank} could not map the sender's {self.kind} slots: {error}"
            )

    def _map(self, desc: Any, nbytes: int) -> torch.Tensor:
        if self.kind == "shm":
            return _shm_open(str(desc), nbytes)
        storage = torch.UntypedStorage._new_shared_cuda(*desc)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))

    def buckets(
        self, plan: Plan, land: Land, timeout: timedelta | None
    ) -> Iterator[tuple[int, torch.Tensor, bool]]:
        store = self.group._store
        for k in range(len(plan.buckets)):
            start, end = plan.bucket_range(k)
            ready = f"wx/{self._sid}/ready/{k}"
            deadline = self.group._deadline(timeout)
            self.group._poll(_has(store, ready), deadline, f"bucket {k}", [self.src])
            signal = self.group._store_call(_getter(store, ready), "reading a bucket signal")
            slot = self._slots[k % SLOTS][: end - start] if signal == b"1" else self._external(signal)
            view, kind = land(k)
            if kind == "scratch" and view.device == slot.device:
                yield k, slot, False
            else:
                view.copy_(slot)
                _sync(view)
                self._done(k)
                yield k, view, kind == "target"
                continue
            self._done(k)

    def _external(self, signal: bytes) -> torch.Tensor:
        """The sender's own shared-memory storage holding this bucket, mapped through /proc (cached)."""
        d = json.loads(signal)
        key = (int(d["pid"]), int(d["fd"]), int(d["ino"]))
        mapped = self._sources.get(key)
        if mapped is None:
            fd = os.open(f"/proc/{key[0]}/fd/{key[1]}", os.O_RDONLY)
            try:
                if os.fstat(fd).st_ino != key[2]:
                    raise WeightSyncError(f"the sender's shared storage {key} changed under this receiver")
                mm = mmap.mmap(fd, int(d["size"]), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # read-only on purpose: this side only copies out of it
                warnings.simplefilter("ignore", UserWarning)
                mapped = torch.frombuffer(mm, dtype=torch.uint8)
            self._sources[key] = mapped
        offset = int(d["offset"])
        return mapped[offset : offset + int(d["nbytes"])]

    def _done(self, k: int) -> None:
        key = f"wx/{self._sid}/done/{k}"
        self.group._store_call(lambda: self.group._store.add(key, 1), f"signalling bucket {k} done")

    def close(self) -> None:
        self._slots = []
        self._sources.clear()


def _shared_source(view: torch.Tensor) -> dict[str, int] | None:
    """Where a receiver on this host can map ``view`` from, if it is in shared memory (``share_memory_()``).

    torch's file-descriptor sharing keeps an unlinked shm file open; a process of the same user on the same
    host can reopen it through /proc/<pid>/fd/<n>. The inode guards against a reused descriptor number.
    """
    if view.device.type != "cpu":
        return None
    storage = view.untyped_storage()
    if not storage.is_shared():
        return None
    try:
        fd, size = storage._share_fd_cpu_()  # type: ignore[attr-defined]
        ino = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return None
    offset = view.data_ptr() - storage.data_ptr()
    return {"pid": os.getpid(), "fd": int(fd), "ino": int(ino), "size": int(size), "offset": offset,
            "nbytes": view.numel()}  # fmt: skip


def leftover_segments() -> list[str]:
    """Names of groupbridge segments in /dev/shm (for tests and the doctor)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def _has(store: Any, key: str) -> Callable[[], bool]:
    return lambda: bool(store.check([key]))


def _getter(store: Any, key: str) -> Callable[[], bytes]:
    return lambda: bytes(store.get(key))
