"""Which address the launcher's rendezvous store listens on.

Runner layer. :func:`store_address` decides, in this order:

1. a network interface was chosen (``--network-interface IF``, ``HORA_GLOO_IFACE`` or
   ``HOROVOD_GLOO_IFACE``, knob ``gloo_iface``): the IPv4 address of ``IF`` on this machine. The
   ranks bind their own transport to their address on ``IF`` (the worker side reads the same
   knob);
2. every rank runs on this machine: ``127.0.0.1`` (Horovod: the interface owning 127.0.0.1);
3. otherwise this machine's address on the route toward the remote hosts: the source address
   the kernel picks for a UDP "connect" to each of them (no packet is sent). The first remote
   host decides; :func:`hora.runner.ssh.check_hosts` then makes *every* host prove it can open
   a TCP connection to that address before any rank starts, so a wrong guess is a clear error
   naming the host, never a hang.

The store never binds the wildcard address (0.0.0.0).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hora._util.net import interface_address, interface_names, is_loopback, local_hostname
from hora._util.net import route_source as _route_source
from hora.errors import ConfigError

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class StoreAddress:
    """Where the store listens and why (the reason is shown with ``--verbose``)."""

    address: str
    interface: str | None
    reason: str


def interface_of(address: str) -> str | None:
    """The name of this machine's interface whose IPv4 address is ``address``, or None."""
    for name in interface_names():
        try:
            if interface_address(name) == address:
                return name
        except ConfigError:
            continue
    return None


def resolve(host: str) -> str:
    """An IP address of ``host`` (IPv4 preferred).

    Raises:
        ConfigError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve host {host!r} on {local_hostname()}: "
                          f"{exc.strerror or exc}") from None
    addresses = [str(info[4][0]) for info in infos]
    ipv4 = [a for a in addresses if ":" not in a]
    return (ipv4 or addresses)[0]


def route_source(address: str) -> str:
    """This machine's source address for packets to ``address`` (kernel routing; nothing is
    sent).

    Raises:
        ConfigError: there is no route to ``address``.
    """
    try:
        return _route_source(address)
    except OSError as exc:
        raise ConfigError(f"no route from {local_hostname()} to {address}: "
                          f"{exc.strerror or exc}") from None


def store_address(remote_addresses: Sequence[str], iface: str) -> StoreAddress:
    """Choose the store's address (see the module docstring).

    Args:
        remote_addresses: the hosts that are not this machine, resolved to IP addresses
            (with ``iface`` only whether there are any matters).
        iface: the chosen network interface, or ``""``.

    Raises:
        ConfigError: the interface does not exist or has no IPv4 address; no route to a host.
    """
    if iface:
        address = interface_address(iface)
        if remote_addresses and is_loopback(address):
            raise ConfigError(f"network interface {iface} has the loopback address {address}, "
                              "which the other hosts of this job cannot reach; choose an "
                              f"interface they share, e.g. one of: {', '.join(interface_names())}")
        return StoreAddress(address, iface, f"the address of network interface {iface}")
    if not remote_addresses:
        return StoreAddress(LOOPBACK, interface_of(LOOPBACK), "every rank runs on this host")
    sources = {a: route_source(a) for a in remote_addresses}
    first = remote_addresses[0]
    address = sources[first]
    if is_loopback(address):
        raise ConfigError(f"the route to {first} leaves through loopback ({address}): that host "
                          "is this machine under another name. List it as localhost.")
    others = sorted({s for s in sources.values() if s != address})
    reason = f"this host's address on the route to {first}"
    if others:
        reason += (f" (routes to other hosts leave from {', '.join(others)}; every host is "
                   "checked to reach this one)")
    return StoreAddress(address, interface_of(address), reason)


__all__ = ["StoreAddress", "interface_of", "resolve", "route_source", "store_address"]
