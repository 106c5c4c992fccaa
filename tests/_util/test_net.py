"""Networking helpers: interface addresses, free ports, exact send/receive with deadlines."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hora._util import net
from hora.errors import ConfigError


def test_loopback_interface_address() -> None:
    assert "lo" in net.interface_names()
    assert net.interface_address("lo") == "127.0.0.1"


def test_unknown_interface_lists_the_real_ones() -> None:
    with pytest.raises(ConfigError, match=r"'nosuch0' does not exist.*available interfaces:.*lo"):
        net.interface_address("nosuch0")


def test_free_port_is_bindable() -> None:
    port = net.free_port("127.0.0.1")
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_is_loopback() -> None:
    assert net.is_loopback("127.0.0.1") and net.is_loopback("::1")
    assert net.is_loopback("localhost") and net.is_loopback("127.0.1.1")
    assert not net.is_loopback("10.1.2.3") and not net.is_loopback("node01")


def test_local_hostname() -> None:
    assert net.local_hostname() == socket.gethostname()


def test_send_all_and_recv_exact() -> None:
    a, b = socket.socketpair()
    try:
        data = bytes(range(256)) * 4096  # 1 MiB: more than one socket buffer
        sender = threading.Thread(target=net.send_all, args=(a, data, time.monotonic() + 5))
        sender.start()
        got = net.recv_bytes(b, len(data), time.monotonic() + 5)
        sender.join()
        assert got == data
    finally:
        a.close()
        b.close()


def test_recv_exact_deadline_and_eof() -> None:
    a, b = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):
            net.recv_bytes(b, 4, time.monotonic() + 0.1)
        a.sendall(b"ab")
        a.close()
        with pytest.raises(EOFError, match="after 2 of 4 bytes"):
            net.recv_bytes(b, 4, time.monotonic() + 1)
    finally:
        a.close()
        b.close()
