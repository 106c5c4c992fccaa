"""Which hosts a job runs on: ``-H`` / ``--hostfile`` parsing and slot assignment.

Runner layer. One implementation, used by :func:`hora.runner.launch.launch`:

* :func:`parse_hosts` reads ``-H "a:2,b:4"`` (a host without ``:slots`` has one slot);
* :func:`parse_hostfile` reads lines ``<hostname> slots=<n>`` (``#`` comments, blank lines);
* :func:`assign_hosts` gives each rank ``0..np-1`` its host in Horovod's order: hosts in the
  order given, each filled to its slots before the next. Unlike Horovod's static gloo launcher
  (which runs a rank on *every* listed slot), exactly ``np`` ranks are started; local and cross
  ranks then come from :func:`hora.rendezvous.topology.compute_topology`;
* :func:`is_local_host` tells whether a host is this machine (started directly) or another one
  (started over ssh, :mod:`hora.runner.ssh`).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hora._util.net import is_loopback, local_hostname
from hora.errors import ConfigError

_HOST_ENTRY = re.compile(r"^[\w.-]+(:\d+)?$")


@dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks may run on it."""

    host: str
    slots: int


def parse_hosts(text: str) -> tuple[HostSlots, ...]:
    """Parse ``-H``: ``"h1:2,h2:4"``; a host without ``:slots`` has one slot.

    Raises:
        ConfigError: an entry is not ``<hostname>[:<slots>]`` or has 0 slots.
    """
    hosts = []
    for entry in text.split(","):
        entry = entry.strip()
        if not _HOST_ENTRY.match(entry):
            raise ConfigError(
                f"-H/--hosts {text!r}: {entry!r} is not <hostname>:<slots>; expected e.g. "
                "-H localhost:4 or -H host1:2,host2:2")
        host, _, slots = entry.partition(":")
        hosts.append(HostSlots(host, _slot_count(slots or "1", f"-H/--hosts {text!r}")))
    return tuple(hosts)


def parse_hostfile(path: str | os.PathLike[str]) -> tuple[HostSlots, ...]:
    """Parse a host file: lines ``<hostname> slots=<n>`` (``slots`` optional, default 1).

    Blank lines and ``#`` comments are ignored; ``max_slots=<n>`` (Open MPI's) is accepted and
    ignored.

    Raises:
        ConfigError: the file cannot be read, a line is malformed, or it lists no host.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {str(path)!r}: cannot read it: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {str(path)!r} line {number}"
        slots = "1"
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("slots", "max_slots"):
                raise ConfigError(f"{where}: {line.strip()!r} is not '<hostname> slots=<n>'")
            if key == "slots":
                slots = value
        if not _HOST_ENTRY.match(words[0]) or ":" in words[0]:
            raise ConfigError(f"{where}: {words[0]!r} is not a host name")
        hosts.append(HostSlots(words[0], _slot_count(slots, where)))
    if not hosts:
        raise ConfigError(f"--hostfile {str(path)!r} lists no hosts")
    return tuple(hosts)


def _slot_count(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{where}: slots must be a whole number >= 1, not {text!r}")
    return int(text)


def _is_own_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is assigned to an interface here: binding it works."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: ``localhost``, a loopback address, this host's
    name, or a name or address that resolves to an address of one of this host's interfaces."""
    name = host.lower()
    if is_loopback(name) or name in ("localhost.localdomain", "ip6-localhost"):
        return True
    me = local_hostname().lower()
    if name in (me, me.split(".")[0]):
        return True
    try:
        theirs = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return any(is_loopback(addr) or (addr not in ("0.0.0.0", "::") and _is_own_address(addr))
               for addr in theirs)


def assign_hosts(np: int, hosts: Sequence[HostSlots]) -> list[str]:
    """Host of each rank ``0..np-1``: hosts in the given order, each filled to its slots.

    No hosts means ``localhost:<np>``. Exactly ``np`` ranks are placed: hosts (or slots) beyond
    them get no rank.

    Raises:
        ConfigError: fewer slots than ``np``.
    """
    if not hosts:
        hosts = (HostSlots("localhost", np),)
    total = sum(h.slots for h in hosts)
    if total < np:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ConfigError(f"too few slots: -np {np} but the hosts ({listed}) provide only "
                          f"{total}; add slots or lower -np")
    names: list[str] = []
    for host in hosts:
        names += [host.host] * min(host.slots, np - len(names))
    return names


__all__ = ["HostSlots", "assign_hosts", "is_local_host", "parse_hostfile", "parse_hosts"]
