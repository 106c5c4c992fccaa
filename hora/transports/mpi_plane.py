"""The mpi data plane: mpi4py over the system MPI (Open MPI in CI), for jobs started by mpirun.

``HORA_DATA_PLANE=mpi`` (or Horovod's ``HOROVOD_CPU_OPERATIONS=mpi``). The ranks must have been
started by ``mpirun`` (directly, or through ``hora run --data-plane mpi``), so that hora's rank
``r`` is ``MPI_COMM_WORLD`` rank ``r``; :meth:`MpiPlane.create` checks it. Each process set gets
its own communicator: ``MPI_COMM_WORLD`` duplicated for the global set, ``MPI_Comm_create_group``
over the members for the others (only the members take part). hora's traffic never shares a
communicator with the program's own MPI calls.

**One thread makes every MPI call** (:class:`_MpiThread`): the op runs there as a blocking call
(Open MPI's tuned blocking collectives, not the slower non-blocking schedules), then finishes
its :class:`~hora.transports.planes.Ticket`. The engine thread meanwhile waits in
:class:`~hora.transports.planes.PeerWatch`, which notices a dead peer on hora's own connections:
MPI calls have no timeout, and Open MPI's shared-memory transport never reports a dead peer, so
a call blocked on one stays blocked. That thread is then abandoned (a daemon): hora fails the
job loudly, and the process still exits normally. Tested here with Open MPI 4.1: neither a
thread blocked on a dead peer nor one blocked on a live rank that left the collective keeps
the process from exiting through ``MPI_Finalize`` (which mpi4py calls at exit).

MPI thread level: the plane thread calls MPI while the program's threads may too, so MPI must
provide ``MPI_THREAD_SERIALIZED`` at least (mpi4py asks for ``MPI_THREAD_MULTIPLE`` by default).

Reductions MPI lacks a type for (float16, bfloat16, bool), or gets wrong (8- and 16-bit
integers: see :data:`_TYPES`), are reported by :meth:`MpiPlane.reduces`, so the caller runs
them on hora's builtin path. Byte counts are MPI
``int`` (Open MPI 4.x has no large-count calls): a block over 2 GiB fails with MPI's error.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora._util.log import get_logger
from hora.errors import ConfigError
from hora.transports.planes import Doorbell, Ticket

log = get_logger(__name__)

_TYPES = {"int32": "INT32_T", "int64": "INT64_T", "float32": "FLOAT", "float64": "DOUBLE"}
"""dtypes hora reduces over MPI, with their MPI datatypes. MPI has no float16, bfloat16 or bool
sum; and Open MPI 4.1's vectorised (op/avx) sum of 8- and 16-bit integers saturates (measured
here: 64 uint8 of 254 summed over 2 ranks give 255, not 252) where numpy and hora's own
collectives wrap around, so those stay on hora's builtin path too."""

_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PROD"}

CLOSE_TIMEOUT_S = 5.0
"""How long closing a plane waits for its communicator's release."""


def import_mpi() -> Any:
    """``mpi4py.MPI`` (initialising MPI if the program has not), or ConfigError.

    When hora is the first to import it, hora also finalizes MPI at exit
    (:func:`_finalize_at_exit`) instead of mpi4py, so that it can skip ``MPI_Finalize`` when
    one of its MPI calls never completed: Open MPI's ``MPI_Finalize`` waits for it for ever
    (measured with Open MPI 4.1: a survivor of a killed rank spun until mpirun killed it).
    """
    fresh = "mpi4py.MPI" not in sys.modules
    try:
        import mpi4py

        if fresh:
            mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(
            "HORA_DATA_PLANE=mpi needs mpi4py over an MPI library: pip install mpi4py (its "
            "wheel uses the system's Open MPI or MPICH; apt-get install openmpi-bin), or "
            f"choose another data plane with HORA_DATA_PLANE / --data-plane: {exc}") from None
    if fresh:
        atexit.register(_finalize_at_exit, MPI)
    return MPI


def _finalize_at_exit(mpi: Any) -> None:
    """At exit: ``MPI_Finalize``, unless hora's MPI thread is stuck in a call (a lost peer)."""
    _THREAD.finalized = True  # the MPI thread takes no more work
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if not _THREAD.idle():
        log.warning("an MPI call of hora's mpi data plane never completed (a peer was lost): "
                    "MPI is not finalized, so that this process can exit")
        return
    mpi.Finalize()


class _MpiThread:
    """The one thread of this process that makes hora's MPI calls (started on first use)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Ticket | None]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.busy = False  # a job is running (or stuck) on the thread
        self.finalized = False  # MPI is finalized (at exit): no more jobs

    def submit(self, job: Callable[[], None], ticket: Ticket) -> Ticket:
        """Run ``job`` on the thread; ``ticket`` finishes when it returns (or raises)."""
        if self.finalized:
            ticket.finish("MPI was finalized (the process is exiting)")
            return ticket
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hora-mpi", daemon=True)
                self._thread.start()
        self._jobs.put((job, ticket))
        return ticket

    def call(self, job: Callable[[], Any], timeout: float, what: str) -> Any:
        """Run ``job`` on the thread and return its result (set-up calls).

        Raises:
            HoraTimeoutError: it did not return within ``timeout`` seconds.
            ConfigError / RuntimeError: what ``job`` raised.
        """
        from hora.errors import HoraTimeoutError

        done = threading.Event()
        box: list[Any] = [None, None]

        def run() -> None:
            try:
                box[0] = job()
            except BaseException as exc:  # handed to the caller
                box[1] = exc
            finally:
                done.set()

        bell = Doorbell()
        try:
            self.submit(run, Ticket(bell))
            if not done.wait(timeout):
                raise HoraTimeoutError(f"the mpi data plane's {what} did not complete within "
                                       f"{timeout:g} s; are all ranks started by one mpirun?")
        finally:
            bell.close()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def idle(self) -> bool:
        """No job is running or queued."""
        return not self.busy and self._jobs.empty()

    def _run(self) -> None:
        while True:
            job, ticket = self._jobs.get()
            self.busy = True
            try:
                job()
            except Exception as exc:  # the waiter reports it
                self.busy = False
                if ticket is not None:
                    ticket.finish(f"{type(exc).__name__}: {exc}")
                continue
            self.busy = False
            if ticket is not None:
                ticket.finish()


_THREAD = _MpiThread()


class MpiPlane:
    """MPI collectives over the members of one process set (see the module docstring). Build
    with :meth:`create` on every member."""

    name = "mpi"

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm = comm
        self._mpi = mpi
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.bell = Doorbell()
        self._healthy = True

    @classmethod
    def create(cls, ranks: Sequence[int], rank: int, world: int, tag: int,
               timeout: float) -> MpiPlane:
        """The plane of the set of global ``ranks`` (collective over them).

        Args:
            ranks: the set's members (global hora ranks, sorted).
            rank: this process's global hora rank.
            world: hora's job size.
            tag: a tag distinct from other sets built at the same time (the set id).
            timeout: seconds the set-up may take.

        Raises:
            ConfigError: mpi4py is missing, MPI's world is not hora's (ranks not started by
                one mpirun), or MPI's thread level is too low.
        """

        def build() -> Any:
            mpi = import_mpi()
            me, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
            if size != world or me != rank:
                raise ConfigError(
                    f"HORA_DATA_PLANE=mpi: this is hora rank {rank} of {world}, but MPI rank "
                    f"{me} of {size}: the mpi data plane needs ranks started by one mpirun "
                    "(`mpirun -np N python train.py`, or `hora run --data-plane mpi -np N "
                    "python train.py`)")
            level = mpi.Query_thread()
            if level < mpi.THREAD_SERIALIZED:
                raise ConfigError(
                    "HORA_DATA_PLANE=mpi calls MPI from hora's own thread, which needs "
                    f"MPI_THREAD_SERIALIZED or better; MPI was initialised with level {level} "
                    "(leave mpi4py.rc.thread_level at its default, 'multiple')")
            if len(ranks) == size:
                comm = mpi.COMM_WORLD.Dup()
            else:
                group = mpi.COMM_WORLD.Get_group().Incl(list(ranks))
                comm = mpi.COMM_WORLD.Create_group(group, tag % 32768)
                group.Free()
            comm.Set_errhandler(mpi.ERRORS_RETURN)
            return cls(comm, mpi)

        plane: MpiPlane = _THREAD.call(build, timeout, f"communicator of {len(ranks)} ranks")
        log.debug("mpi data plane: communicator of %d ranks", plane.size)
        return plane

    def reduces(self, dtype: np.dtype[Any], op: str) -> bool:
        return str(dtype) in _TYPES and op in _OPS

    def _start(self, job: Callable[[], None], keep: Any) -> Ticket:
        return _THREAD.submit(job, _Flagged(self, keep))

    def _typed(self, buf: np.ndarray) -> list[Any]:
        return [buf, getattr(self._mpi, _TYPES[str(buf.dtype)])]

    def _counts(self, counts: Sequence[int]) -> tuple[list[int], list[int]]:
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        return [int(c) for c in counts], displs

    # ---- collectives -------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: str) -> Ticket:
        mpi, comm, typed, mpi_op = self._mpi, self._comm, self._typed(buf), getattr(
            self._mpi, _OPS[op])
        return self._start(lambda: comm.Allreduce(mpi.IN_PLACE, typed, mpi_op), buf)

    def allgather(self, send: np.ndarray, counts: Sequence[int], out: np.ndarray) -> Ticket:
        mpi, comm = self._mpi, self._comm
        sizes, displs = self._counts(counts)
        spec = [out, sizes, displs, mpi.BYTE]
        return self._start(lambda: comm.Allgatherv([send, mpi.BYTE], spec), (send, out))

    def broadcast(self, buf: np.ndarray, root: int) -> Ticket:
        mpi, comm = self._mpi, self._comm
        return self._start(lambda: comm.Bcast([buf, mpi.BYTE], root), buf)

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], out: np.ndarray,
                 recv_counts: Sequence[int]) -> Ticket:
        mpi, comm = self._mpi, self._comm
        sc, sd = self._counts(send_counts)
        rc, rd = self._counts(recv_counts)
        return self._start(lambda: comm.Alltoallv([send, sc, sd, mpi.BYTE],
                                                  [out, rc, rd, mpi.BYTE]), (send, out))

    def reducescatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                      out: np.ndarray) -> Ticket:
        comm, src, dst = self._comm, self._typed(buf), self._typed(out)
        mpi_op, sizes = getattr(self._mpi, _OPS[op]), [int(c) for c in counts]
        return self._start(lambda: comm.Reduce_scatter(src, dst, sizes, mpi_op), (buf, out))

    def close(self) -> None:
        """Free the communicator (on the MPI thread, waiting for it), unless an op was
        abandoned in it or MPI is finalized already."""
        if self._healthy and not _THREAD.finalized:
            try:
                _THREAD.call(self._comm.Free, CLOSE_TIMEOUT_S, "communicator release")
            except Exception as exc:  # closing is local and best effort
                log.debug("mpi data plane: freeing a communicator failed: %s", exc)
        self.bell.close()


class _Flagged(Ticket):
    """A ticket that marks its plane unhealthy while its op is in flight."""

    __slots__ = ("_plane",)

    def __init__(self, plane: MpiPlane, keep: Any) -> None:
        super().__init__(plane.bell, keep)
        self._plane = plane
        plane._healthy = False  # until the op returns

    def finish(self, error: str | None = None) -> None:
        self._plane._healthy = error is None
        super().finish(error)
