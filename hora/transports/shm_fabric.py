"""A same-host group's shared memory and signals: :class:`ShmFabric`.

Transport layer; what :class:`hora.collectives.shm.ShmGroup` runs on (it implements that
module's ``Fabric`` protocol). Every rank of the group owns three segments
(:mod:`hora.transports.shm`): a header and two data segments ``d0`` / ``d1``, which the
collectives use alternately. :meth:`ShmFabric.create` makes this rank's, maps every peer's and
checks (over a few bytes of the group's :class:`~hora.collectives.comm.Comm`) that all ranks
succeeded: ranks that do not share ``/dev/shm`` (other hosts) all fail with a
:class:`~hora.errors.TransportError`. After that the comm is not used, and each rank unlinks
its segments' names (every peer holds a descriptor): nothing of the group stays in
``/dev/shm``, even if every rank is killed.

Board: the rest of each header (:meth:`ShmFabric.board`) is plain shared words, zero at first,
readable and writable by every rank of the group, for protocols built on top.

Signals: each rank's header holds one 32-bit counter that only it increments. A rank *posts* by
incrementing it and waking the peers that flagged (in its header) that they sleep on it; a peer
*waits* for the counter to reach a value by checking it a few hundred times (microseconds;
longer where a collective expects the peer to be a large step behind and every rank has a
core), then sleeping in ``FUTEX_WAIT`` on it (a real blocking wait: no core is burnt) in slices
of :data:`WAIT_SLICE_S`, checking between slices its deadline, whether the peer closed its group
(a header flag; closing wakes waiters at once) and whether the peer's process is still alive
(``/proc/<pid>`` with the start time from its header, so a reused pid is not mistaken for it;
peers in another pid namespace are not checked and rely on the deadline).

Memory ordering: data is written with ordinary stores before the counter store and read after
the counter is seen, which x86-64 (TSO) keeps in order. Elsewhere the spin is skipped and every
wait goes through the futex system call.
"""

from __future__ import annotations

import os
import secrets
import time

from hora._util.cpus import affinity_record, union_cores, usable_cpus
from hora._util.log import get_logger
from hora._util.shm_owners import (
    W_PIDNS,
    pid_namespace,
    remove,
    sweep,
)
from hora.collectives.comm import Comm
from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.transports.shm import (
    HALF,
    MASK,
    MIN_CAPACITY,
    SHM_DIR,
    SPIN_ALLOWED,
    U8,
    Segment,
    capacity_for,
    futex_wake,
    job_id_for,
    process_start_time,
    segment_path,
    valid_job_id,
    wait_word,
)

log = get_logger(__name__)

HEADER_BYTES = 16384
"""Header segment size: the signal words, then :data:`BOARD_WORDS` words of board."""

BOARD_WORD = 64
"""First uint32 word of the header's *board*: words a layer above may use freely (the fast
lane's logs, see :mod:`hora.core.lane.fastlane`); zero when the group is created."""

BOARD_WORDS = HEADER_BYTES // 4 - BOARD_WORD

SPIN_CHECKS = 300
"""Counter checks before a wait blocks in the kernel when every rank of the group can have a
core (:attr:`ShmFabric.cores`): ~15-30 us of a Python loop, long enough to catch a peer that is
a phase behind on another core without the futex sleep and wake-up (tens of microseconds each),
short enough to be small next to a collective of a few MiB. The measurements:
docs/benchmarks.md, "Measurements behind the code's constants"."""

SPIN_CHECKS_OVERSUBSCRIBED = 30
"""Counter checks when the group has more ranks than its members may use cores: a spinning rank
then steals the core that the rank it waits for needs, so it goes to sleep almost at once
(docs/benchmarks.md, "Measurements behind the code's constants")."""


WAIT_SLICE_S = 0.05
"""A blocked wait wakes at least this often to check its deadline and the peer's liveness."""

_MAGIC, _VERSION = 0x41524F48, 1  # "HORA"
# header layout, in uint32 words; the counter sits alone on its cache line
(_W_MAGIC, _W_VERSION, _W_STATE, _W_PID, _W_START_LO, _W_START_HI, _W_TOKEN_LO,
 _W_TOKEN_HI) = range(8)
_W_CAP = (8, 9)  # capacity of data segment d0 / d1, in KiB
_W_COUNTER = 16
_W_ASLEEP = 32  # word 32 + r: 1 while rank r sleeps on this header's counter (own cache line)
_ASLEEP_RANKS = BOARD_WORD - _W_ASLEEP  # groups up to this size flag their sleepers
_READY, _CLOSED = 1, 2
_KINDS = ("h", "d0", "d1")


def _exchange(comm: Comm, record: bytes) -> list[bytes]:
    """Allgather one fixed-size record per rank over ``comm`` (ring of ``sendrecv``)."""
    size, rank = comm.size, comm.rank
    records: list[bytes] = [b""] * size
    records[rank] = record
    right, left = (rank + 1) % size, (rank - 1) % size
    incoming = bytearray(len(record))
    for step in range(size - 1):
        comm.sendrecv(right, records[(rank - step) % size], left, incoming)
        records[(rank - step - 1) % size] = bytes(incoming)
    return records


# ---- the fabric -------------------------------------------------------------------------------

class ShmFabric:
    """Segments and signals shared by the ranks of one same-host group. Build with :meth:`create`.

    Used by one thread at a time (the engine's). Data segment ``parity`` of rank ``r`` is
    ``own(parity)`` on rank ``r`` and ``peer(r, parity, nbytes)`` elsewhere.
    """

    def __init__(self, comm: Comm, group: str, timeout: float, segments: list[Segment],
                 peers: dict[int, list[Segment]], cores: int = 0) -> None:
        self._comm = comm
        self.group = group
        self.timeout = timeout
        self.rank, self.size = comm.rank, comm.size
        self._own = segments
        self._peers = peers
        self._closed = False
        self._header = segments[0].array.data.cast("I")
        self._counter_address = segments[0].address + 4 * _W_COUNTER
        self._posted = 0
        self._peer_headers = {p: s[0].array.data.cast("I") for p, s in peers.items()}
        self._peer_counters = {p: s[0].address + 4 * _W_COUNTER for p, s in peers.items()}
        self._peer_start = {p: self._verifiable_start(h) for p, h in self._peer_headers.items()}
        self._lost_global = getattr(comm, "ranks", None)
        self.cores = cores or usable_cpus()
        """Cores the group's ranks may run on together (:func:`~hora._util.cpus.union_cores` of
        their masks): ``size <= cores`` when every rank has one, as under ``mpirun``'s binding."""
        # A poster wakes the futex only when a peer flagged that it sleeps on the counter (the
        # wake is a system call, ~1 us, on every signal otherwise); larger groups always wake.
        flagged = self.size <= _ASLEEP_RANKS
        self._asleep_words = [_W_ASLEEP + p for p in peers] if flagged else []
        self._asleep = _W_ASLEEP + self.rank if flagged else -1
        self._long_spins = SPIN_ALLOWED and self.size <= self.cores
        self._spin = (SPIN_CHECKS if self.size <= self.cores else SPIN_CHECKS_OVERSUBSCRIBED
                      ) if SPIN_ALLOWED else 0

    # -- construction --
    @classmethod
    def create(cls, comm: Comm, job_id: str, *, timeout: float) -> ShmFabric:
        """Create this rank's segments, map every peer's, and check they are the same host's.

        Every rank of ``comm`` calls this at the same time (it exchanges a few bytes over
        ``comm``). All ranks succeed or all raise.

        Raises:
            TransportError: a segment could not be created (``/dev/shm`` missing or full) or a
                peer's could not be mapped (the ranks do not share ``/dev/shm``: not one host).
            PeerLostError, HoraTimeoutError: from ``comm``.
        """
        if not valid_job_id(job_id):
            job_id = job_id_for(job_id, None)
        _sweep_once()
        records = _exchange(comm, secrets.token_bytes(8) + affinity_record())
        group = records[0][:8].hex()
        token = int.from_bytes(records[0][:8], "little")
        cores = union_cores([r[8:] for r in records])
        rank, size = comm.rank, comm.size
        own: list[Segment] = []
        peers: dict[int, list[Segment]] = {}
        try:
            error: BaseException | None = None
            try:
                own = [Segment.create(segment_path(job_id, group, rank, "h"), HEADER_BYTES)]
                own += [Segment.create(segment_path(job_id, group, rank, k), MIN_CAPACITY)
                        for k in _KINDS[1:]]
                _init_header(own[0], token)
            except (OSError, TransportError) as exc:
                error = exc
            _agree(comm, error, "create its shared memory segments")
            try:
                for peer in range(size):
                    if peer != rank:
                        peers[peer] = _open_peer(job_id, group, peer, token)
            except (OSError, TransportError) as exc:
                error = exc
            _agree(comm, error, "map its peers' shared memory segments (HINT: shared memory "
                   f"only works between ranks on one host that share {SHM_DIR})")
            # Every peer holds a descriptor of every segment now: the names are not needed any
            # more. Without them a rank killed with SIGKILL (or a whole job) leaves nothing in
            # /dev/shm: the kernel frees the memory when its last mapping goes.
            for seg in own:
                seg.unlink()
        except BaseException:
            for seg in own + [s for segs in peers.values() for s in segs]:
                seg.close()
            raise
        fabric = cls(comm, group, timeout, own, peers, cores)
        log.debug("shm group %s: %d ranks on %d cores, job %s", group, size, cores, job_id)
        return fabric

    def _verifiable_start(self, header: memoryview) -> int | None:
        pid = header[_W_PID]
        start = header[_W_START_LO] | (header[_W_START_HI] << 32)
        return start if start and process_start_time(pid) == start else None

    # -- identity --
    def describe(self, peer: int) -> str:
        return self._comm.describe(peer)

    @property
    def paths(self) -> list[str]:
        """This rank's segment files."""
        return [s.path for s in self._own]

    # -- data segments --
    def reserve(self, parity: int, nbytes: int) -> U8:
        """This rank's data segment ``parity``, grown to hold ``nbytes``; publishes the size.

        Call before posting the signal after which peers read it.
        """
        seg = self._own[1 + parity]
        if seg.size < nbytes:
            cap = capacity_for(nbytes)
            seg.grow(cap)
            self._header[_W_CAP[parity]] = cap >> 10
        return seg.array

    def own(self, parity: int) -> U8:
        return self._own[1 + parity].array

    def peer(self, peer: int, parity: int, nbytes: int) -> U8:
        """Peer ``peer``'s data segment ``parity`` (at least ``nbytes``), remapped if it grew.

        Call only after waiting for the peer's signal that follows its :meth:`reserve`.
        """
        seg = self._peers[peer][1 + parity]
        if seg.size < nbytes:
            cap = self._peer_headers[peer][_W_CAP[parity]] << 10
            if cap < nbytes:
                raise TransportError(
                    f"rank {self.rank}: {self.describe(peer)} published a {cap}-byte shared "
                    f"segment but this collective needs {nbytes}: the ranks disagree on the "
                    "collective's size (a bug: every rank must run the same collectives)")
            seg.remap(cap)
        return seg.array

    @property
    def spin_checks(self) -> int:
        """How many times a wait checks its word before it sleeps (0: always sleep)."""
        return self._spin

    # -- board --
    def board(self, peer: int) -> memoryview:
        """Rank ``peer``'s board (this rank's own when ``peer == rank``): uint32 words."""
        header = self._header if peer == self.rank else self._peer_headers[peer]
        return header[BOARD_WORD:]

    def board_address(self, peer: int, word: int) -> int:
        """Address of word ``word`` of ``peer``'s board (for :func:`futex_wait` / wake)."""
        seg = self._own[0] if peer == self.rank else self._peers[peer][0]
        return seg.address + 4 * (BOARD_WORD + word)

    def check_peer(self, peer: int) -> None:
        """Raise :class:`~hora.errors.PeerLostError` if ``peer`` closed its group or died."""
        if self._peer_headers[peer][_W_STATE] != _READY:
            raise self._lost(peer, "closed its shared memory group")
        if not self._alive(peer):
            raise self._lost(peer, "died")

    # -- signals --
    @property
    def posted(self) -> int:
        """Signals this rank has posted so far (mod 2**32)."""
        return self._posted

    def post(self) -> int:
        """Signal every peer (increment this rank's counter and wake waiters); the new count.

        A peer about to sleep on the counter sets its flag in this header, then sleeps only while
        the counter holds the value it read (``FUTEX_WAIT`` compares it): only a flag set calls
        for a wake (:func:`~hora.transports.shm.wait_word`, as the fast lane's doorbells)."""
        self._posted = (self._posted + 1) & MASK
        header = self._header
        header[_W_COUNTER] = self._posted
        if self._asleep < 0:
            futex_wake(self._counter_address)
        else:
            for word in self._asleep_words:
                if header[word]:
                    futex_wake(self._counter_address)
                    break
        return self._posted

    def wait_all(self, target: int, spins: int = 0) -> None:
        """Wait until every peer has posted ``target`` signals (in this group's lifetime).

        ``spins``: check at least this many times before sleeping, where every rank has a core
        (a wait after a large step of the peer's:
        :data:`hora.collectives.shm_allreduce.WAIT_SPIN_BYTES`); else the fabric's own spin."""
        for peer, header in self._peer_headers.items():
            if ((header[_W_COUNTER] - target) & MASK) >= HALF:  # (not there yet: no call else)
                self.wait(peer, target, spins)

    def wait(self, peer: int, target: int, spins: int = 0) -> None:
        """Wait until ``peer`` has posted ``target`` signals (:func:`wait_word`: spin, then
        futex slices, checking between slices that the peer is open and alive); ``spins`` as in
        :meth:`wait_all`.

        Raises:
            HoraTimeoutError: not within ``timeout`` seconds of the first sleep (names the peer).
            PeerLostError: the peer closed its group or its process died (names it).
        """
        header = self._peer_headers[peer]
        address = self._peer_counters[peer]
        spin = self._spin if spins <= self._spin or not self._long_spins else spins
        if wait_word(header, _W_COUNTER, address, target, spin,
                     min(WAIT_SLICE_S, self.timeout), self._asleep):
            return
        start = time.monotonic()
        deadline = start + self.timeout
        check_alive = start
        while True:
            if header[_W_STATE] != _READY:
                raise self._lost(peer, "closed its shared memory group")
            now = time.monotonic()
            if now >= check_alive:
                if not self._alive(peer):
                    raise self._lost(peer, "died")
                check_alive = now + WAIT_SLICE_S
            if now >= deadline:
                raise HoraTimeoutError(
                    f"rank {self.rank}: {self.describe(peer)} sent no shared-memory signal for "
                    f"{self.timeout:g} s (waiting for signal {target}, it is at "
                    f"{header[_W_COUNTER]}); it may be stuck, much slower, or in a different "
                    "collective. HINT: raise HORA_TIMEOUT_SECONDS if this is expected.")
            if wait_word(header, _W_COUNTER, address, target, 0,
                         min(WAIT_SLICE_S, deadline - now), self._asleep):
                return

    def _alive(self, peer: int) -> bool:
        start = self._peer_start.get(peer)
        if start is None:
            return True  # not verifiable (another pid namespace): rely on the deadline
        return process_start_time(self._peer_headers[peer][_W_PID]) == start

    def _lost(self, peer: int, what: str) -> PeerLostError:
        ranks = self._lost_global
        global_peer = ranks[peer] if isinstance(ranks, list) else peer
        return PeerLostError(
            f"rank {self.rank}: {self.describe(peer)} {what} during a shared-memory collective; "
            "HINT: look at that rank's output for the original error", peer=global_peer)

    # -- shutdown --
    def close(self) -> None:
        """Tell peers this rank left (they raise PeerLostError if waiting), unmap, unlink."""
        if self._closed:
            return
        self._closed = True
        try:
            self._header[_W_STATE] = _CLOSED
            futex_wake(self._counter_address)
        except (ValueError, IndexError):
            pass
        # Peers that died cannot unlink their segments: the survivors do (shm_owners' rule).
        dead = [peer for peer in self._peers if not self._alive(peer)]
        self._header.release()
        for view in self._peer_headers.values():
            view.release()
        for seg in self._own + [s for segs in self._peers.values() for s in segs]:
            seg.close()
        removed = remove([seg.path for peer in dead for seg in self._peers[peer]])
        if removed:
            log.info("removed the shared memory segments of %s (died): %s",
                     ", ".join(self.describe(p) for p in dead),
                     ", ".join(os.path.basename(p) for p in removed))

    def __del__(self) -> None:  # pragma: no cover - best effort if close() was forgotten
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass


_swept = False


def _sweep_once() -> None:
    """A process's first group removes segments that dead processes left on this host (a rank
    SIGKILLed under torchrun, mpirun or srun has no launcher to sweep after it)."""
    global _swept
    if not _swept:
        _swept = True
        sweep(SHM_DIR)


def _init_header(seg: Segment, token: int) -> None:
    header = seg.array.data.cast("I")
    pid = os.getpid()
    start = process_start_time(pid) or 0
    header[_W_VERSION], header[_W_PID], header[W_PIDNS] = _VERSION, pid, pid_namespace()
    header[_W_START_LO], header[_W_START_HI] = start & MASK, (start >> 32) & MASK
    header[_W_TOKEN_LO], header[_W_TOKEN_HI] = token & MASK, token >> 32
    header[_W_CAP[0]] = header[_W_CAP[1]] = MIN_CAPACITY >> 10
    header[_W_COUNTER] = 0
    header[_W_MAGIC] = _MAGIC  # the identity is complete (a sweeper may judge the owner now)
    header[_W_STATE] = _READY
    header.release()


def _open_peer(job_id: str, group: str, peer: int, token: int) -> list[Segment]:
    segs: list[Segment] = []
    try:
        for kind in _KINDS:
            segs.append(Segment.open(segment_path(job_id, group, peer, kind)))
        header = segs[0].array.data.cast("I")
        got = (header[_W_MAGIC], header[_W_VERSION],
               header[_W_TOKEN_LO] | (header[_W_TOKEN_HI] << 32), header[_W_STATE])
        header.release()
        if got != (_MAGIC, _VERSION, token, _READY):
            raise TransportError(f"{segs[0].path} is not the segment rank {peer} just created "
                                 f"(magic/version/token/state {got})")
    except BaseException:
        for seg in segs:
            seg.close()
        raise
    return segs


def _agree(comm: Comm, error: BaseException | None, doing: str) -> None:
    """All ranks learn whether every rank succeeded; all raise if one failed."""
    flags = _exchange(comm, b"\x00" if error is None else b"\x01")
    failed = [r for r, f in enumerate(flags) if f != b"\x00"]
    if not failed:
        return
    if error is not None:
        raise TransportError(f"rank {comm.rank} could not {doing}: {error}") from error
    names = ", ".join(comm.describe(r) for r in failed)
    raise TransportError(f"{names} could not {doing}; see that rank's error")


__all__ = ["BOARD_WORD", "BOARD_WORDS", "HEADER_BYTES", "SPIN_CHECKS",
           "SPIN_CHECKS_OVERSUBSCRIBED", "WAIT_SLICE_S", "ShmFabric"]
