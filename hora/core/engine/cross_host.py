"""The response cache across hosts, one host at a time: who leads each host, the links between
a host's ranks, and rank 0's relay through the leaders (:mod:`hora.core.engine.cross_link` uses
them; the protocol is :mod:`hora.core.engine.cross_cache`).

* **Layout** (:class:`HostLayout`, every rank alike from the ranks' host names): a host's
  *leader* is its lowest rank other than 0 (rank 0 hands the work of its own host to a
  neighbour, so that it hears from one rank per host, its own included); a host where rank 0
  is alone has rank 0 as its leader.
* **Links** (:func:`open_links`): every other rank of a host holds one stream connection to its
  leader, an abstract Unix socket (``\\0hora-<job>-xc<size>-<host>``: per network namespace,
  nothing on disk), added to the transport's control plane
  (:meth:`~hora.transports.base.Transport.attach_control`): framed like the rest, in the same
  control wait as the connection to rank 0, and a rank or leader that dies closes it, which the
  other side reports at once as :class:`~hora.errors.PeerLostError` naming it. Rank 0 and its
  host's leader talk over their existing TCP control connection.
* **Relay, one path per rank** (:class:`Relay`, rank 0): every message rank 0 sends that must
  keep its place in the order (responses of any process set, cache decisions and
  invalidations, fast-lane closes, tunables) goes to a host's other ranks *through the host's
  leader*: rank 0 sends the leader one frame (:func:`frame`) naming the ranks it is for, the
  leader forwards it to them at once, before it runs anything itself. A rank therefore hears
  everything ordered from one FIFO path (rank 0 -> leader -> rank), and every rank runs
  negotiated responses and cached decisions in rank 0's one order, with no numbering: a
  relayed decision cannot overtake a response, because the response came the same way.
  Heartbeats, aborts and requests still go straight between rank 0 and each rank.
* **The relay's end** (:class:`RelayGate`, every other rank): when a leader leaves (its goodbye)
  or rank 0 shuts down, rank 0 sends the host one last frame, ``cend``, and from then on
  sends to the host's ranks directly. A message that comes straight from rank 0 while this
  rank's relay is still on (it can only have been sent after ``cend``) is held, and released
  after ``cend``: the two paths never reorder.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Set
from typing import Any

from hora.core.op.messages import MSG_ABORT, MSG_SHUTDOWN, decode
from hora.errors import HoraError, HoraTimeoutError, PeerLostError, ProtocolError, TransportError
from hora.transports.base import Transport

MSG_RELAY_END = "cend"
"""Rank 0 -> a host's ranks (through its leader): the relay ends; rank 0 now sends directly."""
MSG_LOCAL_BYE = "cbye"
"""A rank -> its leader: I leave (the link's close that follows is not a failure)."""

_FRAME = 0  # first byte of a relay frame (a control message is JSON: '{')
Item = tuple[int, str, dict[str, Any]]
"""A decoded control message: ``(sender, kind, body)``."""
_UNORDERED = frozenset({"hb", "abort"})  # straight from rank 0 whatever the relay (heartbeats)
_HELLO = struct.Struct("!II")  # (magic, rank) from a rank to its leader
_MAGIC = 0x68786331


def control_links(transport: Transport) -> bool:
    """Whether ``transport`` can carry host links (:meth:`Transport.attach_control`)."""
    return type(transport).attach_control is not Transport.attach_control


class HostLayout:
    """Hosts, their ranks and leaders, from every rank's host name (``per_rank``: every rank
    its own host: rank 0 then hears from every rank, the cache's fallback)."""

    def __init__(self, hostnames: list[str], per_rank: bool = False) -> None:
        size = len(hostnames)
        index: dict[str, int] = {}
        self.hosts: list[list[int]] = []
        self.host_of: list[int] = []
        for rank in range(size):
            key = str(rank) if per_rank else hostnames[rank]
            if key not in index:
                index[key] = len(self.hosts)
                self.hosts.append([])
            self.hosts[index[key]].append(rank)
            self.host_of.append(index[key])
        self.leaders = [next((r for r in ranks if r != 0), 0) for ranks in self.hosts]

    def leader_of(self, rank: int) -> int:
        return self.leaders[self.host_of[rank]]

    def linked(self, rank: int) -> list[int]:
        """The ranks ``rank`` holds a local link to (a leader: its host's others but rank 0; any
        other rank but 0: its leader; rank 0: none, it reaches its leader over TCP)."""
        if rank == 0:
            return []
        leader = self.leader_of(rank)
        if rank != leader:
            return [leader]
        return [r for r in self.hosts[self.host_of[rank]] if r not in (0, rank)]


def open_links(transport: Transport, layout: HostLayout, job_id: str,
               timeout: float) -> None:
    """Connect this rank and its host's leader (see the module's docstring); the links join the
    transport's control plane.

    Raises:
        HoraTimeoutError: the host's ranks did not all connect within ``timeout``.
        TransportError: a link could not be made.
    """
    rank = transport.rank
    peers = layout.linked(rank)
    if not peers:
        return
    leader = layout.leader_of(rank)
    name = f"\0hora-{job_id}-xc{transport.size}-{layout.host_of[rank]}"
    deadline = time.monotonic() + timeout
    if rank != leader:
        sock = _connect(name, deadline, leader)
        sock.sendall(_HELLO.pack(_MAGIC, rank))
        transport.attach_control(leader, sock)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
        listener.listen(len(peers))
        waiting = set(peers)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HoraTimeoutError(
                    f"rank {rank} (leader of its host for the response cache across hosts): "
                    f"ranks {sorted(waiting)} did not connect within {timeout:.0f} s")
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            peer = _hello(conn, waiting)
            if peer is None:
                conn.close()
                continue
            waiting.discard(peer)
            transport.attach_control(peer, conn)
    except OSError as exc:
        raise TransportError(f"rank {rank}: could not link the ranks of its host ({exc})") \
            from exc
    finally:
        listener.close()


def _connect(name: str, deadline: float, leader: int) -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                raise TransportError(f"could not reach rank {leader}, the leader of this host "
                                     f"for the response cache across hosts ({exc})") from exc
        if time.monotonic() >= deadline:
            raise HoraTimeoutError(f"rank {leader}, the leader of this host for the response "
                                   "cache across hosts, did not listen in time")
        time.sleep(0.01)


def _hello(conn: socket.socket, expected: Set[int]) -> int | None:
    """The rank a new link comes from, if it is one of ``expected`` and runs as our user."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            return None
        conn.settimeout(5.0)
        data = b""
        while len(data) < _HELLO.size:
            part = conn.recv(_HELLO.size - len(data))
            if not part:
                return None
            data += part
    except OSError:
        return None
    magic, peer = _HELLO.unpack(data)
    return peer if magic == _MAGIC and peer in expected else None


def frame(to: list[int], me: bool, payload: bytes) -> bytes:
    """A relay frame: the leader forwards ``payload`` to ``to`` and takes it itself if ``me``."""
    head = json.dumps([to, me], separators=(",", ":")).encode()
    return bytes((_FRAME,)) + head + b"\0" + payload


def unframe(data: bytes) -> tuple[list[int], bool, bytes] | None:
    """``(to, me, payload)`` of a relay frame; None for a plain control message.

    Raises:
        ProtocolError: a malformed frame.
    """
    if not data or data[0] != _FRAME:
        return None
    try:
        end = data.index(b"\0", 1)
        to, me = json.loads(data[1:end])
        if not (isinstance(to, list) and all(isinstance(r, int) for r in to)
                and isinstance(me, bool)):
            raise ValueError("bad header")
    except ValueError as exc:
        raise ProtocolError(f"malformed relay frame ({exc})") from None
    return to, me, data[end + 1:]


def forward(transport: Transport, to: list[int], payload: bytes, left: Set[int]) -> None:
    """A leader passes rank 0's ``payload`` on to ``to`` (but the ranks that left). A rank
    whose link fails here left (its goodbye not read yet) or died: its link's close is
    reported when it is read, unless it said goodbye, so the send's error is not raised."""
    for peer in to:
        if peer not in left:
            try:
                transport.send_control(peer, payload)
            except HoraError:
                pass


def forward_until_end(transport: Transport, left: set[int], wait: float) -> None:
    """A leader leaving: forward rank 0's frames to the host's ranks (not to those in ``left``,
    the ranks that left; updated here) until rank 0 ends the host's relay, shuts down or is
    gone, or ``wait`` seconds pass; whatever else comes is dropped (this rank has stopped)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            msg = transport.recv_control(max(0.0, end - time.monotonic()))
        except PeerLostError as exc:
            if exc.peer == 0:
                return
            continue
        if msg is None:
            continue
        sender, payload = msg
        framed = unframe(payload)
        if framed is not None:
            to, _, payload = framed
            forward(transport, to, payload, left)
        kind = decode(payload)[0]
        if sender == 0 and kind in (MSG_RELAY_END, MSG_SHUTDOWN):
            return
        if kind == MSG_LOCAL_BYE:
            left.add(sender)


class Relay:
    """Rank 0's ordered sending (see the module's docstring): one frame per host, through its
    leader, while the leader is there; straight to the ranks after the relay's end."""

    def __init__(self, transport: Transport, layout: HostLayout, departed: Set[int]) -> None:
        self._transport = transport
        self._layout = layout
        self._departed = departed
        self._ended: set[int] = set()  # hosts whose relay ended
        self.frames = 0  # messages sent (benchmarks)
        self._plan: list[tuple[int, bytes | None, list[int]]] = []  # send_all's, per host
        self._plan_key = (-1, -1)

    def send_all(self, payload: bytes) -> None:
        """:meth:`send` to every rank but 0 still there: one message per host (the host's
        frame header made once per change of the departed or ended, not per message)."""
        key = (len(self._departed), len(self._ended))
        if key != self._plan_key:
            self._plan_key = key
            self._plan = []
            for host, ranks in enumerate(self._layout.hosts):
                live = [r for r in ranks if r != 0 and r not in self._departed]
                leader = self._layout.leaders[host]
                if not live:
                    continue
                if host in self._ended or leader == 0:
                    self._plan += [(r, None, []) for r in live]
                    continue
                to = [r for r in live if r != leader]
                head = frame(to, leader in live, b"") if to else None
                self._plan.append((leader, head, to))
        send = self._transport.send_control
        for peer, head, _ in self._plan:
            send(peer, payload if head is None else head + payload)
            self.frames += 1

    def send(self, peers: list[int], payload: bytes) -> None:
        """Send ``payload`` to ``peers`` (not rank 0), in this message's place in the order."""
        layout, send = self._layout, self._transport.send_control
        by_host: dict[int, list[int]] = {}
        for peer in peers:
            if peer != 0 and peer not in self._departed:
                by_host.setdefault(layout.host_of[peer], []).append(peer)
        for host, ranks in by_host.items():
            leader = layout.leaders[host]
            if host in self._ended or leader == 0:
                for peer in ranks:
                    send(peer, payload)
                    self.frames += 1
                continue
            to = [r for r in ranks if r != leader]
            me = len(to) < len(ranks)
            send(leader, frame(to, me, payload) if to else payload)
            self.frames += 1

    def send_one(self, peer: int, payload: bytes) -> None:
        self.send([peer], payload)

    def end(self, host: int, payload: bytes) -> None:
        """The host's relay ends with ``payload`` (``cend``) to the host's ranks still there."""
        if host in self._ended:
            return
        leader = self._layout.leaders[host]
        if leader != 0:
            to = [r for r in self._layout.hosts[host]
                  if r not in (0, leader) and r not in self._departed]
            try:
                self._transport.send_control(leader, frame(to, True, payload))
            except Exception:  # noqa: BLE001  (a leader already gone: its ranks hear EOF)
                pass
        self._ended.add(host)

    def end_all(self, payload: bytes) -> None:
        for host in range(len(self._layout.hosts)):
            self.end(host, payload)


class RelayGate:
    """A rank's side of the relay's order: while its leader relays, a message straight from
    rank 0 that must keep its place (anything but heartbeats and aborts) is held until the
    relay's end (``cend``) arrives from the leader; then they run in the order they came."""

    def __init__(self, relayed: bool) -> None:
        self.on = relayed
        self._held: deque[Item] = deque()
        self._lost0: PeerLostError | None = None

    def lost(self, exc: PeerLostError, leader: int) -> bool:
        """A control connection closed while the relay may be on: rank 0's is no failure yet
        (its last messages, a shutdown among them, may still come through the leader: the loss
        counts after them, at the relay's end, or when the leader's link closes too).

        Raises:
            PeerLostError: rank 0's loss, when the leader's link closed after it.
        """
        if not self.on:
            return False
        if exc.peer == 0:
            self._lost0 = exc
            return True
        if exc.peer == leader and self._lost0 is not None:
            raise self._lost0
        return False

    def direct(self, item: Item) -> list[Item]:
        """A message straight from rank 0: what to handle now."""
        if self.on and item[1] not in _UNORDERED:
            self._held.append(item)
            return []
        return [item]

    def end(self) -> list[Item]:
        """The relay ended: the held messages, in order."""
        self.on = False
        held = list(self._held)
        self._held.clear()
        if self._lost0 is not None and all(kind != MSG_SHUTDOWN for _, kind, _ in held):
            held.append((0, MSG_ABORT, {"reason": str(self._lost0)}))  # rank 0 is gone
        return held


def goodbye(cross: Any, say_goodbye: Callable[[], None], rank0: bool) -> None:
    """The engine's goodbye with a :class:`~hora.core.engine.cross_link.CrossCache` (or None):
    rank 0 ends the relays before its own goodbye; a leader relays after its own until rank 0
    ended its host's relay (``CrossCache.leave``)."""
    if cross is not None and rank0:
        cross.leave()
    say_goodbye()
    if cross is not None and not rank0:
        cross.leave()


class OrderedTransport:
    """A transport whose :meth:`send_control` goes through rank 0's :class:`Relay` (for
    autotune's tunables, which must keep their place among the responses); the rest is the
    transport's."""

    def __init__(self, transport: Transport, send: Callable[[int, bytes], None]) -> None:
        self._transport = transport
        self.send_control = send

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


__all__ = ["MSG_LOCAL_BYE", "MSG_RELAY_END", "HostLayout", "Item", "OrderedTransport", "Relay",
           "RelayGate", "control_links", "forward", "forward_until_end", "frame", "goodbye",
           "open_links",
           "unframe"]
