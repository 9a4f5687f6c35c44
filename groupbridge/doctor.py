"""What this machine can do for groupbridge: the facts behind ``groupbridge doctor``."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch

from .devices import KNOWN_BACKENDS, accelerator, backend_available, split_backend
from .net import Address, listen
from .store import connect_store, host_store

__all__ = ["diagnose"]


def _loopback(host: str) -> dict[str, Any]:
    result: dict[str, Any] = {"host": host, "listen": False, "store": False, "error": None}
    try:
        lis = listen(host, 0)
    except OSError as e:
        result["error"] = str(e)
        return result
    result["listen"] = True
    addr = lis.address
    try:
        store = host_store(lis, timedelta(seconds=5))
        client = connect_store(addr, timedelta(seconds=5))
        client.set("doctor", "ok")
        result["store"] = store.get("doctor") == b"ok"
        del client, store
    except Exception as e:  # report any failure as a finding, not a crash
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        lis.close()
    return result


def _gloo_interface() -> dict[str, Any]:
    """Which interface gloo would bind to: GLOO_SOCKET_IFNAME, else the one that reaches MASTER_ADDR."""
    from .env import gloo_ifname, read_dist_env
    from .net import interface_toward

    chosen = gloo_ifname()
    if chosen is not None:
        return {"interface": chosen, "why": "GLOO_SOCKET_IFNAME is set"}
    master = read_dist_env().master_addr or "127.0.0.1"
    try:
        iface = interface_toward(Address.parse(master).with_port(9))
    except ValueError as e:
        return {"interface": None, "why": str(e)}
    return {"interface": iface, "why": f"the interface that reaches MASTER_ADDR={master}"}


def has_ipv6_loopback() -> bool:
    try:
        listen("::1", 0).close()
        return True
    except OSError:
        return False


def diagnose() -> dict[str, Any]:
    """Collect the facts ``doctor`` reports, as plain JSON-able values."""
    return {
        "torch": torch.__version__,
        "accelerator": accelerator(),
        "backends": {b: backend_available(b) for b in KNOWN_BACKENDS},
        "split_backend": split_backend(),
        "hostname": socket.gethostname(),
        "ipv4_loopback": _loopback("127.0.0.1"),
        "ipv6_loopback": _loopback("::1") if socket.has_ipv6 else {"host": "::1", "listen": False},
        "gloo_interface": _gloo_interface(),
    }
