"""The only module that touches torch.distributed APIs outside its documented surface.

Building a process group without ``init_process_group`` (so it never joins torch's global state) needs the
backend classes directly; their constructors are public in C++ but only loosely documented in Python and have
changed between releases. Everything version-sensitive lives here, checked against ``MIN_TORCH``.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, PrefixStore, ProcessGroupGloo, Store, TCPStore
from torch.distributed import QueueEmptyError

__all__ = [
    "MIN_TORCH",
    "Backend",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "TCPStore",
    "abort_backend",
    "as_default_pg_store",
    "client_socket",
    "host_tcp_store",
    "new_device_group",
    "new_gloo_group",
    "open_shared_cuda",
    "set_backend_timeout",
    "set_socket_timeouts",
    "share_cuda",
    "share_fd_cpu",
    "shutdown_socket",
    "torch_version",
]

MIN_TORCH = (2, 8)  # TCPStore queues (the libuv server has them since 2.8)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _check_version() -> None:
    if torch_version() < MIN_TORCH:
        raise RuntimeError(
            f"groupbridge needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}"
        )


def host_tcp_store(fd: int, timeout: timedelta, *, use_libuv: bool = True) -> TCPStore:
    """Serve a TCPStore on an already listening socket; the store takes ownership of its descriptor.

    Given a host name instead, TCPStore binds every interface; handed ``master_listen_fd`` it serves exactly
    the socket it was given. On success the caller must give up the descriptor (the store closes it when
    it is destroyed); on failure the caller still owns it.
    """
    _check_version()
    sock = socket.socket(fileno=fd)
    try:
        host, port = sock.getsockname()[:2]
    finally:
        sock.detach()
    store = TCPStore(
        host,
        port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
        use_libuv=use_libuv,
    )
    return store


def new_gloo_group(store: Store, rank: int, world_size: int, timeout: timedelta, bind_host: str) -> Backend:
    """A gloo ProcessGroup outside torch's global state, its sockets bound to ``bind_host``."""
    _check_version()
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=bind_host)]
    options._threads = 2
    return ProcessGroupGloo(store, rank, world_size, options)


def set_backend_timeout(backend: Backend, timeout: timedelta) -> None:
    """Change a built group's operation timeout (gloo takes one timeout for connecting and for every op)."""
    setter = getattr(backend, "_set_default_timeout", None)
    if setter is not None:
        setter(timeout)


_connect_lock = threading.Lock()


def _sockets() -> set[tuple[int, str]]:
    """(descriptor, socket inode) of every open socket: a descriptor number freed and taken again by another
    thread meanwhile is a different socket, told apart by its inode."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            out.add((int(name), link))
    return out


def _peer_port(fd: int) -> tuple[str, int] | None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed by another thread meanwhile, or not a socket any more
        return None
    try:
        host, port = sock.getpeername()[:2]
        return str(host).removeprefix("::ffff:"), int(port)
    except OSError:
        return None
    finally:
        sock.detach()


def client_socket(connect: Callable[[], TCPStore], host: str, port: int) -> tuple[TCPStore, int | None]:
    """Make a TCPStore client with ``connect`` and find the descriptor of its connection to host:port.

    torch exposes neither the descriptor nor any bound on a reply from a frozen server: a ``check`` against a
    stopped store host waits forever. Knowing the descriptor lets the caller set socket timeouts and shut
    the connection down to wake a blocked call. TCPStore clients hold one connection each (torch >= 2.4),
    found as the new socket whose peer is the store. None where /proc is missing (the caller then has no
    interrupt and relies on the store's own timeouts).
    """
    if not os.path.isdir("/proc/self/fd"):
        return connect(), None
    with _connect_lock:
        before = _sockets()
        store = connect()
        new = sorted(fd for fd, _ in _sockets() - before)
    host = host.removeprefix("::ffff:").split("%")[0]
    matches = [fd for fd in new if (p := _peer_port(fd)) is not None and p[1] == port]
    exact = [fd for fd in matches if _peer_port(fd) == (host, port)]
    found = exact or matches
    return store, (found[0] if len(found) == 1 else None)


def set_socket_timeouts(fd: int, timeout: timedelta) -> None:
    """Bound every blocking send and receive on ``fd`` (SO_RCVTIMEO / SO_SNDTIMEO)."""
    secs = max(timeout.total_seconds(), 0.001)
    packed = struct.pack("ll", int(secs), int((secs % 1) * 1e6))
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, packed)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, packed)
    finally:
        sock.detach()


def shutdown_socket(fd: int) -> None:
    """Shut a connection down (not close it: the descriptor stays its owner's), waking blocked calls."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already down
        pass
    finally:
        sock.detach()


def share_cuda(storage: torch.UntypedStorage) -> list[object]:
    """The IPC handle of a CUDA storage, to rebuild it in another process with :func:`open_shared_cuda`."""
    return list(storage._share_cuda_())  # type: ignore[attr-defined,no-untyped-call]


def open_shared_cuda(handle: list[object]) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_cuda(*handle)  # type: ignore[attr-defined,no-any-return]


def share_fd_cpu(storage: torch.UntypedStorage) -> tuple[int, int]:
    """(descriptor, size) of a CPU storage in shared memory (``share_memory_()`` with the file-descriptor
    strategy): the storage keeps an unlinked file open; another process may reopen it via /proc."""
    fd, size = storage._share_fd_cpu_()  # type: ignore[attr-defined]
    return int(fd), int(size)


def new_device_group(
    device_type: str, store: Store, rank: int, world_size: int, timeout: timedelta
) -> Backend:
    """A NCCL (cuda), HCCL (npu) or XCCL (xpu) ProcessGroup outside torch's global state."""
    _check_version()
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)  # type: ignore[return-value]
    if device_type == "npu":
        import torch_npu  # noqa: F401

        pg_hccl = torch.distributed.ProcessGroupHCCL  # type: ignore[attr-defined]
        return pg_hccl(store, rank, world_size, timeout)  # type: ignore[no-any-return,call-arg,return-value]
    if device_type == "xpu":
        pg_xccl = torch.distributed.ProcessGroupXCCL  # type: ignore[attr-defined]
        return pg_xccl(store, rank, world_size)  # type: ignore[no-any-return,call-arg,return-value]
    raise ValueError(f"no device process group for device type {device_type!r}")


def as_default_pg_store(store: Store) -> Store:
    """Wrap a store the way ``init_process_group(init_method=...)`` wraps its own.

    torch prefixes the default group's keys with ``default_pg`` when it builds the store from a URL, but not
    when it is handed one; a rank given a store must match peers that were given a URL.
    """
    return PrefixStore("default_pg", store)


def abort_backend(backend: object) -> None:
    """Abort a process-group backend so that dropping it does not wait for work stuck on a dead peer.

    Without this, destroying a gloo group with an operation in flight blocks until that operation's own
    timeout. ``abort`` exists on the backends of recent torch releases; older ones fall back to waiting.
    """
    abort = getattr(backend, "abort", None)
    if abort is not None:
        abort()
