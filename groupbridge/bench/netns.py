"""Simulated hosts on one machine: network namespaces on a bridge, IPv6 ULA addresses, links shaped with tc.

For tests and the benchmark only (needs root and iproute2). Every namespace is removed on exit, on failure
too; traffic stays inside the namespaces. A spawned process joins a host with :func:`enter`.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["Host", "SimulatedHosts", "enter", "unavailable_reason"]

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"gbprobe{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def enter(namespace: str, *, own_name: bool = False) -> None:
    """Move the calling process (before it opens sockets) into a named network namespace; ``own_name``:
    also into a UTS namespace of its own, named after it, so that it is a host of its own to the library too
    (no shared memory with the others: what ``transport="auto"`` picks is what it picks across hosts)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
    if own_name:
        name = namespace.encode()
        if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"naming simulated host {namespace} failed: {os.strerror(err)}")


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    """Its IPv6 ULA address (fd00::/8)."""


class SimulatedHosts:
    """``n`` hosts on one bridge, each link shaped to ``rate`` (tc syntax, e.g. ``"800mbit"``) both ways."""

    def __init__(self, n: int, rate: str | None = "800mbit") -> None:
        if n < 2:
            raise ValueError(f"n={n}: at least two hosts")
        self.n = n
        self.rate = rate
        tag = secrets.token_hex(2)
        self._tag = f"gb{os.getpid() % 100000}x{tag}"
        self._prefix = f"fd00:{tag}:{os.getpid() % 0xFFFF:x}"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def _tc(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
               "burst", "256kb", "latency", "100ms"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def __enter__(self) -> SimulatedHosts:
        try:
            bridge = f"{self._tag}br"
            self._ip("netns", "add", bridge)
            self._namespaces.append(bridge)
            self._ip("link", "add", "br0", "type", "bridge", ns=bridge)
            self._ip("link", "set", "br0", "up", ns=bridge)
            for i in range(self.n):
                ns = f"{self._tag}h{i}"
                self._ip("netns", "add", ns)
                self._namespaces.append(ns)
                self._ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{i}",
                    "netns",
                    bridge,
                )
                self._ip("link", "set", f"p{i}", "master", "br0", "up", ns=bridge)
                addr = f"{self._prefix}::{i + 1}"
                self._ip("addr", "add", f"{addr}/64", "dev", "eth0", "nodad", ns=ns)
                self._ip("link", "set", "eth0", "up", ns=ns)
                self._ip("link", "set", "lo", "up", ns=ns)
                self._tc(ns, "eth0")  # host -> bridge
                self._tc(bridge, f"p{i}")  # bridge -> host
                self.hosts.append(Host(ns, addr))
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, i: int, *, down: bool = True) -> None:
        """Unplug host ``i``'s link from the bridge (``down=False`` plugs it back): its packets go nowhere
        and nobody hears of it, like a pulled cable or a partition."""
        self._ip("link", "set", f"p{i}", "down" if down else "up", ns=f"{self._tag}br")

    def lossy(self, rate: str = "200mbit", queue: str = "64kb") -> None:
        """Make every link drop packets: a token bucket of ``rate`` with a queue of only ``queue`` bytes
        drops whatever overflows it (congestion loss, both ways). Random loss would need ``tc netem``,
        which kernels without ``sch_netem`` lack; :meth:`drops` tells how much was dropped."""
        for i in range(self.n):
            for ns, dev in ((f"{self._tag}h{i}", "eth0"), (f"{self._tag}br", f"p{i}")):
                cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                       "rate", rate, "burst", queue, "limit", queue]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def drops(self) -> tuple[int, int]:
        """(packets dropped, packets sent) by the links' queues so far."""
        dropped = sent = 0
        for i in range(self.n):
            for ns, dev in ((f"{self._tag}h{i}", "eth0"), (f"{self._tag}br", f"p{i}")):
                cmd = ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30).stdout
                m = re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+)", out)
                if m:
                    sent += int(m.group(1))
                    dropped += int(m.group(2))
        return dropped, sent

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=30)
        self._namespaces.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()
