"""The rendezvous store: a TCPStore served on a pre-bound socket, and per-group key namespaces.

The store host serves only the address it was given (never every interface) and a client connect is
bounded by the caller's timeout. Every key of a group lives under ``groupbridge/<name>/<generation>/`` so
two groups on one store, or the same group made again, never read each other's keys.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

from . import _torch_private
from ._torch_private import PrefixStore, Store, TCPStore
from .errors import StoreUnreachableError
from .net import Address, Listener, wait_connectable

logger = logging.getLogger(__name__)

__all__ = [
    "ROOT_PREFIX",
    "StoreClient",
    "connect_store",
    "host_store",
    "namespace",
    "namespaced",
    "open_client",
]

ROOT_PREFIX = "groupbridge"


def host_store(listener: Listener, timeout: timedelta, *, use_libuv: bool = True) -> TCPStore:
    """Serve a TCPStore on ``listener``'s socket, taking over its descriptor.

    After this the listener is closed from the caller's point of view: the store owns the descriptor and
    closes it when destroyed. If the store cannot be built, the listener stays the caller's to close.
    """
    fd = listener.fileno()
    store = _torch_private.host_tcp_store(fd, timeout, use_libuv=use_libuv)
    listener.detach()
    logger.debug("store serving on %s (libuv=%s)", listener.address, use_libuv)
    return store


def connect_store(address: Address, timeout: timedelta, *, use_libuv: bool = True) -> TCPStore:
    """Connect to the store at ``address``, giving up after ``timeout``.

    Raises:
        StoreUnreachableError: nothing accepted a connection there within ``timeout``.
    """
    if address.port is None:
        raise ValueError(f"store address {address} has no port")
    try:
        wait_connectable(address, timeout)
        return TCPStore(
            address.host, address.port, None, False, timeout, wait_for_workers=False, use_libuv=use_libuv
        )
    except (TimeoutError, OSError, RuntimeError) as e:
        raise StoreUnreachableError(
            f"could not reach the store at {address} within {timeout.total_seconds():g}s: {e}"
        ) from e


def namespace(name: str, generation: int) -> str:
    return f"{ROOT_PREFIX}/{name}/{generation}"


def namespaced(store: Store, name: str, generation: int) -> PrefixStore:
    return PrefixStore(namespace(name, generation), store)


class StoreClient:
    """One connection to a store, bounded against a frozen server and wakeable from another thread.

    torch's client waits for a reply forever when the store host is stopped (SIGSTOP, a partition): a
    ``check`` then blocks far past any timeout. Here every send and receive on the connection is bounded by
    ``io_timeout`` (socket timeouts), and :meth:`interrupt` shuts the connection down so that a call blocked
    in a long server-side wait returns at once; the liveness watcher uses it when a peer dies. After either,
    the connection is unusable (a late reply would answer the wrong request), which is right: the group is
    broken by then.
    """

    def __init__(self, store: TCPStore, fd: int | None, address: Address) -> None:
        self.store: TCPStore | None = store
        self.address = address
        self._fd = fd
        self._lock = threading.Lock()
        self.interrupted = False

    def get(self) -> TCPStore:
        store = self.store
        if store is None:
            raise StoreUnreachableError(f"the connection to the store at {self.address} was closed")
        return store

    def interrupt(self) -> None:
        """Wake any call blocked on this connection (it raises); safe from any thread, idempotent."""
        with self._lock:
            self.interrupted = True
            if self._fd is not None and self.store is not None:
                _torch_private.shutdown_socket(self._fd)

    def close(self) -> None:
        with self._lock:
            self.store = None  # the descriptor goes with the last reference; never touched again here
            self._fd = None


def open_client(
    address: Address, timeout: timedelta, io_timeout: timedelta, *, use_libuv: bool = True,
    refused_for: timedelta | None = None,
) -> StoreClient:  # fmt: skip
    """Connect to the store at ``address`` (within ``timeout``; a host known to listen that refuses for
    ``refused_for`` is gone), every later I/O bounded by ``io_timeout``."""
    if address.port is None:
        raise ValueError(f"store address {address} has no port")
    port = address.port
    try:
        wait_connectable(address, timeout, refused_for=refused_for)
        store, fd = _torch_private.client_socket(
            lambda: TCPStore(
                address.host, port, None, False, timeout, wait_for_workers=False, use_libuv=use_libuv
            ),
            address.host,
            port,
        )
    except (TimeoutError, OSError, RuntimeError) as e:
        raise StoreUnreachableError(
            f"could not reach the store at {address} within {timeout.total_seconds():g}s: {e}"
        ) from e
    if fd is not None:
        _torch_private.set_socket_timeouts(fd, io_timeout)
    elif os.path.isdir("/proc/self/fd"):
        logger.warning(
            "the connection to the store at %s could not be told from this process's other sockets: a wait "
            "on it is not woken early when a peer fails, only bounded by its timeout", address,
        )  # fmt: skip
    # Socket timeouts do not bound a server-side wait (the client polls for its reply): the store's own
    # timeout does. Callers that wait longer set it per call.
    store.set_timeout(io_timeout)
    return StoreClient(store, fd, address)
