"""The only module that touches torch.distributed APIs outside its documented surface.

Building a process group without ``init_process_group`` (so it never joins torch's global state) needs the
backend classes directly; their constructors are public in C++ but only loosely documented in Python and have
changed between releases. Everything version-sensitive lives here, checked against ``MIN_TORCH``.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, PrefixStore, ProcessGroupGloo, Store, TCPStore

__all__ = [
    "MIN_TORCH",
    "Backend",
    "PrefixStore",
    "Store",
    "TCPStore",
    "abort_backend",
    "as_default_pg_store",
    "host_tcp_store",
    "new_device_group",
    "new_gloo_group",
    "torch_version",
]

MIN_TORCH = (2, 4)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _check_version() -> None:
    if torch_version() < MIN_TORCH:
        raise RuntimeError(
            f"groupbridge needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}"
        )


def host_tcp_store(sock: socket.socket, timeout: timedelta, *, use_libuv: bool = True) -> TCPStore:
    """Serve a TCPStore on an already listening socket; the store takes ownership of its descriptor.

    Given a host name instead, TCPStore binds every interface; handed ``master_listen_fd`` it serves exactly
    the socket it was given. On success the socket object is detached (the store closes the descriptor when
    it is destroyed); on failure the caller still owns it.
    """
    _check_version()
    host, port = sock.getsockname()[:2]
    store = TCPStore(
        host,
        port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=use_libuv,
    )
    sock.detach()
    return store


def new_gloo_group(store: Store, rank: int, world_size: int, timeout: timedelta, bind_host: str) -> Backend:
    """A gloo ProcessGroup outside torch's global state, its sockets bound to ``bind_host``."""
    _check_version()
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=bind_host)]
    options._threads = 2
    return ProcessGroupGloo(store, rank, world_size, options)


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
