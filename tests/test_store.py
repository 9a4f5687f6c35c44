from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

import groupbridge as gb
from groupbridge.store import connect_store, host_store, namespaced
from tests.helpers import host_params


def _listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket in LISTEN state on ``port``, from the kernel's socket tables."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                addr_hex, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:
                    found.append(addr_hex)
    return found


def _hex(host: str) -> str:
    packed = socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    # /proc/net/tcp* prints each 32-bit word in host (little-endian) order
    return "".join(packed[i : i + 4][::-1].hex().upper() for i in range(0, len(packed), 4))


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "classic"])
@pytest.mark.parametrize("host", host_params())
def test_store_listens_only_where_told(host: str, use_libuv: bool) -> None:
    lis = gb.listen(host, 0)
    addr = lis.address
    store = host_store(lis, timedelta(seconds=5), use_libuv=use_libuv)
    assert lis.closed  # the store owns the descriptor now
    assert _listening_addresses(addr.port or 0) == [_hex(host)]
    client = connect_store(addr, timedelta(seconds=5), use_libuv=use_libuv)
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    deadline = time.monotonic() + 5  # the server thread closes its socket on its own schedule
    while _listening_addresses(addr.port or 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _listening_addresses(addr.port or 0) == []


def test_connect_is_bounded() -> None:
    # a bound socket that never listens: connects are refused, the port is ours and nobody else's
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(gb.StoreUnreachableError) as info:
            connect_store(gb.Address("127.0.0.1", port), timedelta(seconds=1.5))
        took = time.monotonic() - t0
        assert took < 3.0
        assert f"127.0.0.1:{port}" in str(info.value) and "1.5s" in str(info.value)
    finally:
        s.close()


def test_namespaces_do_not_collide() -> None:
    lis = gb.listen("127.0.0.1", 0)
    store = host_store(lis, timedelta(seconds=5))
    a, b, a2 = namespaced(store, "a", 0), namespaced(store, "b", 0), namespaced(store, "a", 1)
    a.set("x", "1")
    b.set("x", "2")
    a2.set("x", "3")
    assert (a.get("x"), b.get("x"), a2.get("x")) == (b"1", b"2", b"3")


@pytest.mark.timeout(30)
def test_a_queue_reader_clears_what_torchs_server_keeps_of_its_waits() -> None:
    """What the control channel's blocking pops rely on (``groupbridge.control``'s docstring): torch's server
    keeps a client registered on a queue it once waited on, so a later push ends that client's wait on
    anything else; a ``compare_set`` of the queue's name with an expected value that is not there clears
    those registrations and creates no key."""
    from groupbridge.control import _ABSENT

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    reader = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
    writer = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))

    def waits_on_queue() -> None:
        for _ in range(3):
            pusher = threading.Timer(0.02, writer.queue_push, ("q", b"m"))
            pusher.start()
            assert bytes(reader.queue_pop("q", block=True)) == b"m"
            pusher.join()

    def wait_ended_by_a_push() -> bool:
        """Whether a push to the queue ends the reader's 1 s wait on a key nobody writes."""
        reader.set_timeout(timedelta(seconds=1))
        pusher = threading.Timer(0.1, writer.queue_push, ("q", b"m"))
        pusher.start()
        try:
            reader.wait(["never"])
            ended = True
        except RuntimeError:  # the wait's own timeout
            ended = False
        pusher.join()
        assert bytes(reader.queue_pop("q", block=False)) == b"m"
        reader.set_timeout(timedelta(seconds=10))
        return ended

    waits_on_queue()
    if not wait_ended_by_a_push():
        pytest.skip("this torch forgets a queue's waiters itself: there is nothing to clear")
    waits_on_queue()
    reader.compare_set("q", _ABSENT, "x")
    assert not reader.check(["q"])  # no key made, the queue is empty
    assert not wait_ended_by_a_push()
    assert int(reader.num_keys()) == 0


def test_the_clients_connection_is_found_when_it_takes_a_descriptor_freed_meanwhile() -> None:
    """The store host's own server thread closes sockets whenever peers hang up; a client connecting
    meanwhile may get a descriptor number that was open a moment before. It is still found (by its socket,
    not its number), so a wait on it can be woken when a peer dies."""
    from groupbridge import _torch_private

    lis = gb.listen("127.0.0.1", 0)
    port = lis.address.port or 0
    store = host_store(lis, timedelta(seconds=5))
    spare = socket.socket()
    freed = spare.fileno()

    def connect_after_freeing_a_descriptor() -> TCPStore:
        spare.close()  # its number is the lowest free one now: the client's socket takes it
        return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)

    client, fd = _torch_private.client_socket(connect_after_freeing_a_descriptor, "127.0.0.1", port)
    assert fd == freed, (fd, freed)
    client.set("k", "v")
    assert store.get("k") == b"v"
