"""Addresses (IPv4, IPv6, host names, scope ids) and listeners bound before their port is published.

A rendezvous port must be bound by the process that will serve it *before* anyone is told the number:
"find a free port, close it, bind it again" races with every other process on the host. :func:`listen` binds
and listens at once and reports the real address; :class:`Listener` then hands its socket to the store.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "Address",
    "Listener",
    "host_identity",
    "interface_for_address",
    "interface_toward",
    "is_loopback",
    "listen",
    "source_address_for",
    "wait_connectable",
]

_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def _parse_port(text: str, original: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", text):
        raise ValueError(f"address {original!r}: port {text!r} is not a number")
    port = int(text)
    if port > 65535:
        raise ValueError(f"address {original!r}: port {port} is outside 0-65535")
    return port


def _check_host(host: str, original: str) -> int:
    """Return the address family of ``host``, raising ``ValueError`` quoting ``original`` when invalid."""
    if not host:
        raise ValueError(f"address {original!r} has no host")
    if not host.isascii() or not host.isprintable():
        raise ValueError(f"address {original!r}: the host must be printable ASCII")
    if ":" in host:
        addr, _, scope = host.partition("%")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            raise ValueError(
                f"address {original!r}: {addr!r} is not a valid IPv6 address "
                "(an IPv6 address with a port is written [addr]:port)"
            ) from None
        if "%" in host and not re.fullmatch(r"[A-Za-z0-9_.\-]+", scope):
            raise ValueError(f"address {original!r}: bad IPv6 scope id {scope!r}")
        return socket.AF_INET6
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"address {original!r}: {host!r} is not a valid IPv4 address") from None
        return socket.AF_INET
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"address {original!r}: {host!r} is not a valid host name")
    try:
        socket.inet_aton(name)
    except OSError:
        return socket.AF_UNSPEC
    # "0x7f000001", "127.1", "2130706433": the resolver reads these as IPv4 addresses, not names.
    raise ValueError(
        f"address {original!r}: {host!r} is an ambiguous numeric host; write a dotted IPv4 address"
    )


@dataclass(frozen=True, slots=True)
class Address:
    """A host (IPv4, IPv6 with optional scope id, or host name) and an optional port.

    ``family`` is ``AF_INET`` or ``AF_INET6`` for literal addresses and ``AF_UNSPEC`` for host names, which
    are resolved only when used. ``str(a)`` writes IPv6 in brackets when a port is present, so
    ``Address.parse(str(a)) == a`` always holds.
    """

    host: str
    port: int | None = None
    family: int = socket.AF_UNSPEC

    def __post_init__(self) -> None:
        family = _check_host(self.host, self.host)
        if self.family != family:
            object.__setattr__(self, "family", family)
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is outside 0-65535")

    @classmethod
    def parse(cls, text: str, default_port: int | None = None) -> Address:
        """Parse ``"1.2.3.4:29500"``, ``"[fd00::1]:29500"``, ``"host:29500"``, ``"fe80::1%eth0"``, bare hosts.

        Raises:
            ValueError: the text is not an address; the message quotes it.
        """
        if not isinstance(text, str):
            raise TypeError(f"address must be a str, got {type(text).__name__}")
        original = text
        text = text.strip()
        if not text:
            raise ValueError(f"address {original!r} is empty")
        if any(c.isspace() for c in text) or "/" in text:
            raise ValueError(
                f"address {original!r} contains a space or '/'; expected host, host:port or [v6]:port"
            )
        port: int | None = default_port
        if text.startswith("["):
            close = text.find("]")
            if close < 0:
                raise ValueError(f"address {original!r}: '[' without a closing ']'")
            host, rest = text[1:close], text[close + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"address {original!r}: expected ':port' after ']'")
                port = _parse_port(rest[1:], original)
            if ":" not in host:
                raise ValueError(f"address {original!r}: only IPv6 addresses go in brackets")
        elif "]" in text:
            raise ValueError(f"address {original!r}: ']' without an opening '['")
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
            port = _parse_port(port_text, original)
        else:
            host = text  # a bare IPv6 address (two or more colons) or a bare host
        _check_host(host, original)
        return cls(host, port)

    def with_port(self, port: int) -> Address:
        return Address(self.host, port)

    def __str__(self) -> str:
        if self.port is None:
            return self.host
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    def url(self, scheme: str = "tcp") -> str:
        """``scheme://host:port`` with IPv6 bracketed (what torch's init_method expects)."""
        if self.port is None:
            raise ValueError(f"address {self} has no port")
        return f"{scheme}://{self}"

    def resolve(self, *, passive: bool = False) -> tuple[int, tuple[object, ...]]:
        """Resolve to ``(family, sockaddr)`` (the first result, as the kernel orders them)."""
        flags = socket.AI_PASSIVE if passive else 0
        try:
            infos = socket.getaddrinfo(self.host, self.port or 0, self.family, socket.SOCK_STREAM, 0, flags)
        except socket.gaierror as e:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot resolve host {self.host!r}: {e.strerror}") from e
        family, _, _, _, sockaddr = infos[0]
        return int(family), tuple(sockaddr)


class Listener:
    """A TCP socket bound and listening now; its ``address`` carries the real port.

    Hand it to :class:`groupbridge.StatelessGroup` (or close it). Ownership of the file descriptor moves to
    whoever calls :meth:`detach`; after that, :meth:`close` does nothing, so the descriptor is never closed
    twice (closing a number someone else has since been given would close *their* socket).
    """

    def __init__(self, sock: socket.socket, address: Address) -> None:
        self._sock: socket.socket | None = sock
        self.address = address

    @property
    def port(self) -> int:
        assert self.address.port is not None
        return self.address.port

    def fileno(self) -> int:
        if self._sock is None:
            raise ValueError(f"listener {self.address} was closed or handed over")
        return self._sock.fileno()

    def detach(self) -> int:
        """Give up ownership of the descriptor and return it."""
        if self._sock is None:
            raise ValueError(f"listener {self.address} was closed or handed over")
        fd = self._sock.detach()
        self._sock = None
        return fd

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else "listening"
        return f"Listener({self.address}, {state})"


def listen(host: str | Address, port: int = 0, *, backlog: int = 4096) -> Listener:
    """Bind and listen on ``host:port`` now (port 0: the kernel picks one), IPv6 with ``IPV6_V6ONLY``.

    Raises:
        ValueError: ``host`` is not an address.
        OSError: the port is in use (``EADDRINUSE``) or the address is not on this host; the message names
            host:port.
    """
    addr = host if isinstance(host, Address) else Address.parse(host)
    if addr.port is not None and port == 0:
        port = addr.port
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0-65535")
    family, sockaddr = Address(addr.host, port).resolve(passive=True)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        where = Address(addr.host, port)
        if e.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {where}: address already in use") from e
        raise OSError(e.errno, f"cannot listen on {where}: {e.strerror}") from e
    real_port = sock.getsockname()[1]
    return Listener(sock, Address(addr.host, real_port))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (a store there is reachable only locally)."""
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def source_address_for(peer: Address) -> str:
    """The local IP address the kernel would use to reach ``peer`` (no packet is sent)."""
    family, sockaddr = peer.with_port(peer.port or 9).resolve()
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        local = s.getsockname()[0]
    return str(local)


def wait_connectable(peer: Address, timeout: timedelta, *, refused_for: timedelta | None = None) -> None:
    """Retry a TCP connect to ``peer`` until it is accepted or ``timeout`` passes.

    torch's TCPStore client retries on its own but may overrun its timeout by a factor of two; probing first
    keeps the bound the caller asked for. ``refused_for``: a peer known to be listening already (its address
    was published after it bound the socket) that refuses every connection for this long is gone.

    Raises:
        TimeoutError: nothing accepted within ``timeout``; the message names the address and the wait.
        ConnectionRefusedError: with ``refused_for``, every connection was refused for that long.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.01
    last: OSError | None = None
    refused_since: float | None = None
    while True:
        try:
            family, sockaddr = peer.resolve()
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(max(0.05, min(2.0, deadline - time.monotonic())))
                s.connect(sockaddr)
                return
        except ConnectionRefusedError as e:
            last = e
            now = time.monotonic()
            refused_since = now if refused_since is None else refused_since
            if refused_for is not None and now - refused_since >= refused_for.total_seconds():
                raise ConnectionRefusedError(
                    f"{peer} refused every connection for {now - refused_since:.1f}s: the address was "
                    "published, so its host has closed it (it exited, or its join failed and it gave up)"
                ) from None
        except OSError as e:
            last, refused_since = e, None
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"nothing accepted a connection at {peer} within {timeout.total_seconds():g}s "
                f"(last error: {last})"
            )
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


def host_identity() -> str:
    """Who can share memory with whom: host name, kernel boot id, process (pid) namespace and user.

    Two members with the same identity can open each other's anonymous shared memory through
    /proc/<pid>/fd (what the ``shm`` transport does); containers that share a host name and kernel but not
    a pid namespace cannot, so they get different identities, and neither can processes of two users (the
    kernel refuses the open: EACCES). Mount namespaces do not matter (the slots are ``memfd_create`` files,
    in no file system).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "unknown-pidns"
    return f"{socket.gethostname()}/{boot}/pidns:{pidns}/uid:{os.geteuid()}"


def interface_for_address(ip: str) -> str | None:
    """The name of the local network interface that holds ``ip`` (Linux), or None."""
    import fcntl
    import struct

    addr = ipaddress.ip_address(ip.split("%")[0])
    if addr.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == addr:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                )  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(addr):
                return name
    return None


def interface_toward(peer: Address) -> str | None:
    """The interface the kernel would use to reach ``peer`` (what gloo should bind to), or None."""
    try:
        return interface_for_address(source_address_for(peer))
    except (OSError, ValueError):
        return None
