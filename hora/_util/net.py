"""Small networking helpers shared by the rendezvous store, authentication and the TCP transport.

Leaf module: imports only :mod:`hora.errors`. Nothing here knows about ranks or jobs; it finds
free ports and interface addresses, and moves exact byte counts over *blocking* sockets with an
absolute deadline (``time.monotonic()`` seconds). The TCP transport's hot path does not use these
helpers: it runs its own non-blocking loops.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time

from hora.errors import ConfigError

_SIOCGIFADDR = 0x8915  # Linux ioctl: get the IPv4 address of an interface


def local_hostname() -> str:
    """This machine's host name as the OS reports it (``socket.gethostname()``)."""
    return socket.gethostname()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close).

    Another process may take it before the caller binds it; callers that can should bind port 0
    themselves and publish the port they got instead.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def interface_names() -> list[str]:
    """Names of this machine's network interfaces (``lo``, ``eth0``, ...)."""
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """IPv4 address of the network interface ``name`` (e.g. ``"eth0"`` -> ``"10.0.0.5"``).

    Uses the ``SIOCGIFADDR`` ioctl; runs no external command.

    Raises:
        ConfigError: the interface does not exist (the message lists the ones that do) or it has
            no IPv4 address.
    """
    names = interface_names()
    if name not in names:
        raise ConfigError(
            f"network interface {name!r} does not exist on {local_hostname()}; available "
            f"interfaces: {', '.join(names) or '(none)'}. HINT: set HORA_GLOO_IFACE / "
            "hora run --network-interface to one of them."
        )
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            raise ConfigError(
                f"network interface {name!r} on {local_hostname()} has no IPv4 address "
                f"({exc.strerror}); choose another of: {', '.join(names)}."
            ) from None
    return socket.inet_ntoa(reply[20:24])


def route_source(address: str) -> str:
    """This machine's source address for packets to ``address``, by the kernel's routing table
    (a UDP socket is connected; nothing is sent).

    Raises:
        OSError: no route to ``address``.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def is_loopback(host: str) -> bool:
    """True if ``host`` is a loopback IP literal or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` (a writable byte memoryview) from a blocking ``sock`` before ``deadline``.

    Raises:
        TimeoutError: the deadline passed first.
        EOFError: the peer closed the connection first (the message says how many bytes came).
        OSError: any other socket error (e.g. ``ConnectionResetError``).
    """
    got, want = 0, len(view)
    while got < want:
        sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"connection closed after {got} of {want} bytes")
        got += n


def recv_bytes(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """Receive exactly ``nbytes`` bytes; see :func:`recv_exact` for the errors."""
    buf = bytearray(nbytes)
    recv_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes | bytearray | memoryview, deadline: float) -> None:
    """Send every byte of ``data`` over a blocking ``sock`` before ``deadline``.

    Raises:
        TimeoutError: the deadline passed first.
        OSError: the connection failed (``BrokenPipeError``, ``ConnectionResetError``, ...).
    """
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        sock.settimeout(_remaining(deadline))
        sent += sock.send(view[sent:])


__all__ = ["free_port", "interface_address", "interface_names", "is_loopback", "local_hostname",
           "recv_bytes", "recv_exact", "send_all"]
