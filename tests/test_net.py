from __future__ import annotations

import errno
import socket

import pytest

import groupbridge as gb
from tests.helpers import host_params

GOOD = [
    ("1.2.3.4:29500", "1.2.3.4", 29500, socket.AF_INET),
    ("[fd00::1]:29500", "fd00::1", 29500, socket.AF_INET6),
    ("fd00::1", "fd00::1", None, socket.AF_INET6),
    ("host:29500", "host", 29500, socket.AF_UNSPEC),
    ("trainer-0.cluster.local", "trainer-0.cluster.local", None, socket.AF_UNSPEC),
    ("fe80::1%eth0", "fe80::1%eth0", None, socket.AF_INET6),
    ("[fe80::1%eth0]:80", "fe80::1%eth0", 80, socket.AF_INET6),
    ("127.0.0.1", "127.0.0.1", None, socket.AF_INET),
    ("[::1]:0", "::1", 0, socket.AF_INET6),
    ("localhost:1", "localhost", 1, socket.AF_UNSPEC),
]


@pytest.mark.parametrize(("text", "host", "port", "family"), GOOD)
def test_parse_round_trip(text: str, host: str, port: int | None, family: int) -> None:
    a = gb.Address.parse(text)
    assert (a.host, a.port, a.family) == (host, port, family)
    assert gb.Address.parse(str(a)) == a
    assert hash(gb.Address.parse(str(a))) == hash(a)
    with pytest.raises(AttributeError):
        a.port = 1  # type: ignore[misc]


BAD = [
    "",
    "   ",
    ":29500",
    "1.2.3.4:",
    "1.2.3.4:abc",
    "1.2.3.4:70000",
    "1.2.3.4:-1",
    "[fd00::1",
    "fd00::1]:80",
    "[1.2.3.4]:80",
    "[fd00::1]80",
    "::1:29500:",
    "fd00::zz",
    "300.1.1.1",
    "1.2.3",
    "bad host:80",
    "-host:80",
    "host_name:80",
    "tcp://1.2.3.4:80",
    "fe80::1%",
]


@pytest.mark.parametrize("text", BAD)
def test_malformed_addresses(text: str) -> None:
    with pytest.raises(ValueError) as info:
        gb.Address.parse(text)
    assert repr(text) in str(info.value)


def test_url_and_with_port() -> None:
    assert gb.Address.parse("::1").with_port(5).url() == "tcp://[::1]:5"
    assert gb.Address.parse("10.0.0.1:7").url("http") == "http://10.0.0.1:7"
    with pytest.raises(ValueError):
        gb.Address.parse("::1").url()


@pytest.mark.parametrize("host", host_params())
def test_listen_port_zero_reports_real_port(host: str) -> None:
    with gb.listen(host, 0) as lis:
        assert lis.port > 0
        assert lis.address.host == host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # it is listening now: a client connects without anyone calling accept
        with socket.create_connection((host, lis.port), timeout=2):
            pass
        if family == socket.AF_INET6:
            s = socket.socket(fileno=lis.fileno())
            try:
                assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
            finally:
                s.detach()
    assert lis.closed


@pytest.mark.parametrize("host", host_params())
def test_port_in_use_is_immediate(host: str) -> None:
    with gb.listen(host, 0) as lis:
        with pytest.raises(OSError) as info:
            gb.listen(host, lis.port)
        assert info.value.errno == errno.EADDRINUSE
        assert str(lis.address) in str(info.value)


def test_listener_detach_hands_over_once() -> None:
    lis = gb.listen("127.0.0.1", 0)
    fd = lis.detach()
    lis.close()  # no-op: must not close the descriptor it gave away
    socket.socket(fileno=fd).close()
    with pytest.raises(ValueError):
        lis.detach()
