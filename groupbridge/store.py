"""The rendezvous store: a TCPStore served on a pre-bound socket, and per-group key namespaces.

The store host serves only the address it was given (never every interface) and a client connect is
bounded by the caller's timeout. Every key of a group lives under ``groupbridge/<name>/<generation>/`` so
two groups on one store, or the same group made again, never read each other's keys.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from . import _torch_private
from ._torch_private import PrefixStore, Store, TCPStore
from .errors import StoreUnreachableError
from .net import Address, Listener, wait_connectable

logger = logging.getLogger(__name__)

__all__ = ["ROOT_PREFIX", "connect_store", "host_store", "namespace", "namespaced"]

ROOT_PREFIX = "groupbridge"


def host_store(listener: Listener, timeout: timedelta, *, use_libuv: bool = True) -> TCPStore:
    """Serve a TCPStore on ``listener``'s socket, taking over its descriptor.

    After this the listener is closed from the caller's point of view: the store owns the descriptor and
    closes it when destroyed. If the store cannot be built, the listener stays the caller's to close.
    """
    sock = listener._sock
    if sock is None:
        raise ValueError(f"listener {listener.address} was closed or already handed over")
    store = _torch_private.host_tcp_store(sock, timeout, use_libuv=use_libuv)
    listener._sock = None
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
