"""Set-up of the TCP transport's connections: rendezvous, listening, connecting, authentication.

:func:`connect_mesh` builds the connections one rank of a job needs at start and hands them to
:class:`~hora.transports.tcp.TcpTransport`, which uses them. It listens on the chosen interface,
publishes ``host:port`` and the host name in the rendezvous store, and learns every rank's entry
in **one** store request: the rank whose arrival completes the count gathers the entries into
one key (``all``) that every other rank waits for (N ranks cost O(N) store requests, not the
O(N^2) of every rank reading every entry). It then builds

* a **control** connection between rank 0 and every other rank;
* **data** connections to the peers the collectives always use (:func:`eager_peers`): the two
  neighbours on the ring of all ranks and, for a host's first rank (its leader), the leaders of
  the previous and next host. Every other data connection (a process set's ring, alltoall's
  pairs, a star's spokes) is opened on first use (:mod:`hora.transports.tcp_links`): the
  higher rank of the pair connects, the lower rank's listener (kept open for the life of the
  transport) accepts,
  so both ends agree on one connection without talking first. A rank thus holds
  ``1 + (at most 4) + the peers it actually exchanged data with`` connections instead of the
  full mesh's ``N``; rank 0 holds ``N - 1`` control connections.

Every connection runs :mod:`hora._util.auth` (the scope is bound into the MACs) and then states
its rank and channel, so a process without the job secret, or from another generation of the
job, is refused. Outgoing connections are retried with a growing delay until the set-up
deadline; a missing rank, a refused or unauthenticated connection or a deadline that passes
raises an error naming the ranks concerned.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from hora._util import auth
from hora._util.log import get_logger
from hora._util.net import recv_bytes, send_all
from hora.errors import (
    AuthenticationError,
    HoraTimeoutError,
    RendezvousError,
    RendezvousTimeoutError,
    TransportError,
)
from hora.transports.tcp_links import (
    _ACCEPT,
    _CHANNEL_NAMES,
    _HELLO,
    _HELLO_MAGIC,
    _POLLIN,
    _REJECT,
    CONTROL,
    DATA,
    LOST_HINT,
    TIMEOUT_HINT,
    LazyLinks,
)

if TYPE_CHECKING:
    from hora.rendezvous.store_client import KVStoreClient

log = get_logger(__name__)



class Mesh(NamedTuple):
    """The connections of one rank, as :func:`connect_mesh` returns them."""

    hostnames: list[str]
    """Host identity of every rank, in rank order (as published in the store)."""
    data: dict[int, socket.socket]
    """Data connections made at start (:func:`eager_peers`, and any lazy one that arrived)."""
    control: dict[int, socket.socket]
    """Control connections: rank 0 to every other rank; every other rank to rank 0."""
    wake_pair: tuple[socket.socket, socket.socket]
    """The socket pair used to wake the set-up, left empty for the transport's ``wake()``."""
    links: LazyLinks
    """Opens the other data connections on first use (owns the listener)."""


def eager_peers(rank: int, hostnames: list[str]) -> set[int]:
    """The peers whose data connections :func:`connect_mesh` makes at start: the ring
    neighbours ``rank - 1`` and ``rank + 1`` (mod N) and, when ``rank`` is the first rank of its
    host, the first ranks of the previous and next host (hosts in order of their first rank:
    the ring of host leaders that hierarchical collectives use). Symmetric: ``q`` is in
    ``eager_peers(p)`` exactly when ``p`` is in ``eager_peers(q)``."""
    size = len(hostnames)
    if size < 2:
        return set()
    peers = {(rank - 1) % size, (rank + 1) % size}
    leaders: list[int] = []
    seen: set[str] = set()
    for r, host in enumerate(hostnames):
        if host not in seen:
            seen.add(host)
            leaders.append(r)
    if rank in leaders and len(leaders) > 1:
        i = leaders.index(rank)
        peers |= {leaders[i - 1], leaders[(i + 1) % len(leaders)]}
    peers.discard(rank)
    return peers


def connect_mesh(rank: int, size: int, store: KVStoreClient | None, scope: str, secret: bytes,
                 bind_host: str, hostname: str, idle: float, deadline: float) -> Mesh:
    """Rendezvous through ``store`` under ``scope`` and connect to every other rank.

    Arguments are those of :meth:`~hora.transports.tcp.TcpTransport.create` (``size > 1``).
    Waiting for the other ranks to publish their address fails when none arrived for ``idle``
    seconds (so a slow but steady start succeeds), and so does connecting (no new connection
    for ``idle`` seconds); both end at ``deadline`` (on the :func:`time.monotonic` clock) at
    the latest.

    Raises:
        RendezvousTimeoutError: some ranks never published their address (lists them).
        RendezvousError: the store failed.
        HoraTimeoutError: some ranks published but never connected (lists them).
        TransportError: a peer could not be reached or ``bind_host`` is not local;
            AuthenticationError (a subclass) when a peer rejected our credentials.
    """
    if store is None:
        raise TransportError(f"a {size}-rank TCP transport needs a rendezvous store")
    try:
        listener = socket.create_server((bind_host, 0), backlog=2 * size + 8,
                                        family=socket.AF_INET6 if ":" in bind_host
                                        else socket.AF_INET)
    except OSError as exc:
        raise TransportError(
            f"rank {rank} cannot listen on {bind_host!r}: {exc}. HINT: it must be an address "
            "of this host; choose the interface with HORA_GLOO_IFACE."
        ) from exc
    wake_pair = socket.socketpair()
    try:
        port = listener.getsockname()[1]
        advertised = bind_host if bind_host not in ("", "0.0.0.0", "::") else hostname
        entry = {"host": advertised, "port": port, "hostname": hostname, "size": size}
        store.set(scope, str(rank), json.dumps(entry).encode())
        arrived = store.add(scope, _ARRIVED, 1)
        entries = _gather_entries(store, scope, rank, size, idle, deadline,
                                  last=arrived == size)
        hostnames = [str(entries[r]["hostname"]) for r in range(size)]
        setup = _MeshSetup(rank, size, entries, secret, scope, idle, deadline, listener,
                           wake_pair, eager_peers(rank, hostnames))
        data, control = setup.run()
    except BaseException:
        listener.close()
        for sock in wake_pair:
            sock.close()
        raise
    links = LazyLinks(rank, size, entries, secret, scope, listener, data)
    with setup.lock:
        setup.handoff = links.adopt
        late, setup.late = setup.late, {}
    for peer, sock in late.items():
        links.adopt(peer, sock)
    return Mesh(hostnames, data, control, wake_pair, links)


_ARRIVED = "arrived"
"""Counter of ranks that published their address (the waiters' measure of progress)."""
_ALL = "all"
"""Every rank's entry, one JSON list, published by the rank whose arrival completed the count."""


def _gather_entries(store: KVStoreClient, scope: str, rank: int, size: int, idle: float,
                    deadline: float, *, last: bool = False) -> dict[int, dict[str, Any]]:
    keys = [str(r) for r in range(size)]
    try:
        if last:  # every rank set its entry before counting itself: all are there
            got = store.get_many(scope, keys)  # one request (a thousand round trips took
            if len(got) < size:  # seconds on a loaded store); ... a store that lost some?
                got = store.wait(scope, keys, max(1.0, deadline - time.monotonic()))
            listed = [json.loads(got[k]) for k in keys]
            store.set(scope, _ALL, json.dumps(listed).encode())
        else:
            blob = store.wait_arrivals(scope, [_ALL], idle, deadline, counter=_ARRIVED)[_ALL]
            listed = json.loads(blob)
            if not isinstance(listed, list) or len(listed) != size:
                raise RendezvousError(f"the rendezvous store's list of ranks in scope {scope!r} "
                                      "is malformed; are all ranks running the same hora "
                                      "version?")
    except ValueError:
        raise RendezvousError(f"malformed rank entries in scope {scope!r}; are all ranks "
                              "running the same hora version?") from None
    except RendezvousTimeoutError:
        missing = [int(k) for k in store.missing(scope, keys)]
        shown = str(missing[:32])[:-1] + (", ...]" if len(missing) > 32 else "]")
        why = (f"no rank arrived for {idle:g} s" if time.monotonic() < deadline
               else "start-up reached its overall limit")
        raise RendezvousTimeoutError(
            f"rank {rank}: {len(missing)} of {size} ranks never published their address in "
            f"scope {scope!r} ({why}): ranks {shown}. They never started or never reached "
            "hora.init() (or crashed before). HINT: check their output; raise "
            "HORA_START_TIMEOUT (seconds without a new rank) or HORA_START_TIMEOUT_CAP (the "
            "whole start-up) if start-up is this slow."
        ) from None
    entries: dict[int, dict[str, Any]] = {}
    for r in range(size):
        try:
            entry = listed[r]
            entry["port"] = int(entry["port"])
            entry["host"], entry["hostname"] = str(entry["host"]), str(entry["hostname"])
        except (ValueError, KeyError, TypeError):
            raise RendezvousError(f"rank {r} published a malformed address in scope {scope!r}; "
                                  "are all ranks running the same hora version?") from None
        if int(entry.get("size", size)) != size:
            raise RendezvousError(f"rank {r} thinks the job has {entry['size']} ranks, rank "
                                  f"{rank} thinks {size}; did two jobs share a scope?")
        entries[r] = entry
    return entries


class _MeshSetup:
    """Accept and make every connection of one rank, in parallel, while connections keep
    being made (none for ``idle`` seconds fails) and before ``deadline``."""

    def __init__(self, rank: int, size: int, entries: dict[int, dict[str, Any]], secret: bytes,
                 scope: str, idle: float, deadline: float, listener: socket.socket,
                 wake_pair: tuple[socket.socket, socket.socket], eager: set[int]) -> None:
        self.rank, self.size, self.entries = rank, size, entries
        self.secret, self.idle, self.deadline, self.listener = secret, idle, deadline, listener
        self.context = b"hora-tcp\0" + scope.encode()
        self.wake_r, self.wake_w = wake_pair
        self.incoming = {(p, DATA) for p in eager if p > rank}
        if rank == 0:
            self.incoming |= {(p, CONTROL) for p in range(1, size)}
        self.outgoing = ([(p, DATA) for p in sorted(eager) if p < rank]
                         + ([(0, CONTROL)] if rank else []))
        self.lock = threading.Lock()
        self.done = False
        self.late: dict[int, socket.socket] = {}
        self.handoff: Callable[[int, socket.socket], None] | None = None
        self.conns: dict[tuple[int, int], socket.socket] = {}
        self.errors: queue.Queue[BaseException] = queue.Queue()

    def describe(self, peer: int) -> str:
        return f"rank {peer} (host {self.entries[peer]['hostname']})"

    def offer(self, key: tuple[int, int], sock: socket.socket) -> bool:
        with self.lock:
            if self.done and key[1] == DATA and key not in self.conns:
                # A higher rank's lazy connection accepted as set-up ended: the transport's
                # LazyLinks takes it (the peer was told it is accepted).
                if self.handoff is not None:
                    self.handoff(key[0], sock)
                else:
                    self.late[key[0]] = sock
                return True
            if self.done or key in self.conns:
                sock.close()
                return False
            self.conns[key] = sock
            # Under the lock: the run loop sees the mesh complete only after this byte is
            # written, so its final drain removes it. Written after, it would stay in the pair
            # and wake the transport's first control receive for nothing.
            self._poke()
        return True

    def _poke(self) -> None:
        try:
            self.wake_w.send(b"\x00")
        except OSError:
            pass

    def run(self) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
        threads = [threading.Thread(target=self._connect, args=(peer, ch), daemon=True,
                                    name=f"hora-tcp-connect-{peer}") for peer, ch in self.outgoing]
        for thread in threads:
            thread.start()
        wanted = self.incoming | set(self.outgoing)
        poller = select.poll()
        poller.register(self.listener, _POLLIN)
        poller.register(self.wake_r, _POLLIN)
        made, idle_until = 0, time.monotonic() + self.idle
        try:
            while True:
                with self.lock:
                    if wanted <= self.conns.keys():
                        break
                    now_made = len(self.conns)
                if not self.errors.empty():
                    raise self.errors.get()
                now = time.monotonic()
                if now_made > made:  # progress: more connections since the last look
                    made, idle_until = now_made, now + self.idle
                left = min(idle_until, self.deadline) - now
                if left <= 0:
                    raise self._timeout(wanted)
                for fd, _ in poller.poll(min(left, 1.0) * 1000):
                    if fd == self.wake_r.fileno():
                        self.wake_r.recv(4096)
                    else:
                        self._accept()
        except BaseException:
            with self.lock:
                self.done = True
                for sock in self.conns.values():
                    sock.close()
            raise
        with self.lock:
            self.done = True
        for thread in threads:
            thread.join(timeout=1.0)
        try:  # leave the pair empty for the transport's wake()
            while self.wake_r.recv(4096, socket.MSG_DONTWAIT):
                pass
        except (BlockingIOError, OSError):
            pass
        data = {p: s for (p, ch), s in self.conns.items() if ch == DATA}
        control = {p: s for (p, ch), s in self.conns.items() if ch == CONTROL}
        return data, control

    def _timeout(self, wanted: set[tuple[int, int]]) -> BaseException:
        with self.lock:
            missing = sorted(wanted - self.conns.keys())
        inbound = sorted({p for p, ch in missing if (p, ch) in self.incoming})
        outbound = sorted({p for p, ch in missing if (p, ch) not in self.incoming})
        parts = []
        if inbound:
            parts.append(f"ranks {inbound} never connected to it")
        if outbound:
            parts.append(f"it could not finish connecting to ranks {outbound}")
        return HoraTimeoutError(
            f"rank {self.rank}: TCP mesh set-up did not finish in time: {'; '.join(parts)}. They "
            "may have crashed, be unable to reach this host (firewall, wrong interface: set "
            "HORA_GLOO_IFACE), or be slow; see their output. " + TIMEOUT_HINT
        )

    def _handshake_deadline(self) -> float:
        """One connection's handshake may take until the deadline: on a crowded host (hundreds
        of ranks on a few cores) one handshake can wait long for its turn, while the run loop
        sees connections being made; a stuck mesh fails there, after ``idle`` seconds without
        a new connection."""
        return self.deadline

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except OSError:
            return
        threading.Thread(target=self._handshake_in, args=(sock, addr), daemon=True,
                         name="hora-tcp-accept").start()

    def _handshake_in(self, sock: socket.socket, addr: Any) -> None:
        where = f"{addr[0]}:{addr[1]}"
        deadline = self._handshake_deadline()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.server_handshake(sock, self.secret, deadline, self.context)
            magic, peer, size, channel = _HELLO.unpack(
                recv_bytes(sock, _HELLO.size, deadline))
            key = (peer, channel)
            problem = ""
            if magic != _HELLO_MAGIC:
                problem = "bad hello"
            elif size != self.size:
                problem = f"it is in a {size}-rank job, this rank in a {self.size}-rank job"
            elif key not in self.incoming and not (channel == DATA and self.rank < peer < size):
                # (a higher rank's data connection that is not eager: it opened it lazily,
                # already past its own set-up; kept for the transport)
                problem = f"unexpected {_CHANNEL_NAMES.get(channel, channel)} connection"
            elif key in self.conns:
                problem = "duplicate connection"
            if problem:
                send_all(sock, _REJECT, deadline)
                raise TransportError(f"rank {peer} from {where}: {problem}")
            send_all(sock, _ACCEPT, deadline)
        except (AuthenticationError, TransportError) as exc:
            log.warning("rank %d refused a connection during TCP set-up: %s", self.rank, exc)
            sock.close()
            return
        except (OSError, EOFError) as exc:
            log.warning("rank %d dropped a connection from %s during TCP set-up: %s",
                        self.rank, where, exc)
            sock.close()
            return
        self.offer(key, sock)

    def _connect(self, peer: int, channel: int) -> None:
        entry = self.entries[peer]
        address = (str(entry["host"]), int(entry["port"]))
        delay, last = 0.01, None
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.errors.put(TransportError(
                    f"rank {self.rank} could not connect to {self.describe(peer)} at "
                    f"{address[0]}:{address[1]}: {last}. HINT: the peer may have exited, or its "
                    "address is not reachable from this host (set HORA_GLOO_IFACE)."))
                self._poke()
                return
            with self.lock:
                if self.done:
                    return
            try:
                sock = socket.create_connection(address, timeout=min(left, self.idle))
                break
            except OSError as exc:
                last = exc
                time.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))
                delay = min(2 * delay, 0.25)
        deadline = self._handshake_deadline()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self.secret, deadline, self.context)
            send_all(sock, _HELLO.pack(_HELLO_MAGIC, self.rank, self.size, channel), deadline)
            verdict = recv_bytes(sock, 1, deadline)
            if verdict != _ACCEPT:
                raise TransportError(
                    f"{self.describe(peer)} refused this rank's {_CHANNEL_NAMES[channel]} "
                    "connection (duplicate rank? two jobs sharing a scope?)")
        except AuthenticationError as exc:
            sock.close()
            self.errors.put(AuthenticationError(
                f"rank {self.rank} could not authenticate with {self.describe(peer)}: {exc}"))
            self._poke()
            return
        except TimeoutError:
            sock.close()
            self.errors.put(HoraTimeoutError(
                f"rank {self.rank}: {self.describe(peer)} accepted the connection but did not "
                f"complete the handshake in time; it may be stuck. {TIMEOUT_HINT}"))
            self._poke()
            return
        except (TransportError, OSError, EOFError) as exc:
            sock.close()
            self.errors.put(exc if isinstance(exc, TransportError) else TransportError(
                f"rank {self.rank} lost its new connection to {self.describe(peer)} during "
                f"set-up ({exc}): {LOST_HINT}"))
            self._poke()
            return
        self.offer((peer, channel), sock)


__all__ = ["CONTROL", "DATA", "LOST_HINT", "TIMEOUT_HINT", "Mesh", "connect_mesh", "eager_peers"]
