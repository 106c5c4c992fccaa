"""Same-host shared memory segments: named files under ``/dev/shm``, futexes, and cleanup.

Transport layer. The pieces :class:`hora.transports.shm_fabric.ShmFabric` builds a same-host
group from (and :mod:`hora.collectives.shm` runs collectives on):

* **names**: every segment is ``/dev/shm/hora-<job_id>-<group>-<rank>-<kind>``
  (:func:`segment_path`); ``job_id`` comes from ``HORA_JOB_ID`` (exported by ``hora run``) or a
  hash of the job secret (:func:`job_id_from_env`);
* :class:`Segment`: one such file, created ``O_EXCL`` with mode 0600 by its owner, mapped
  ``MAP_SHARED`` by everyone, grown in place (content kept; peers keep their descriptor, so a
  segment stays mappable after its owner unlinked it). Space is reserved with
  ``posix_fallocate``, so a full ``/dev/shm`` is a clear :class:`~hora.errors.TransportError`
  instead of a SIGBUS later;
* :func:`futex_wait` / :func:`futex_wake` on a 32-bit word of a segment (Linux ``futex(2)``
  through ctypes, process-shared): a real blocking wait that another process wakes;
* **counters**: 32-bit words that only grow (and wrap): :func:`reached` is the one wrap-around
  compare, :func:`wait_word` the one spin-then-futex wait every shared-memory wait uses (the
  fabric's signals, the fast lane's doorbells), :func:`ring` advances and wakes;
* **cleanup**: a segment's name is only needed until every peer has mapped it: the fabric
  unlinks its names as soon as the group is created (:meth:`Segment.unlink`), so even a rank
  killed with SIGKILL leaves nothing behind (the kernel frees the memory with the last
  mapping). Until then, an owner unlinks on :meth:`Segment.close` and, as a last resort, at
  interpreter exit. For a rank killed in that window (or segments of older versions): the
  survivors, the next job's sweep and ``hora clean`` (:mod:`hora._util.shm_owners`), and the
  launcher (``hora run``), which removes ``/dev/shm/hora-<job_id>-*`` when the job ends
  (:func:`remove_job_segments`).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import platform
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from hora._util.log import get_logger
from hora._util.shm_names import (  # the naming rule lives there; re-exported (__all__)
    PREFIX,
    SHM_DIR,
    job_id_for,
    job_id_from_env,
    job_segments,
    remove_job_segments,
    segment_path,
    valid_job_id,
)
from hora._util.shm_owners import process_start_time  # re-exported (__all__)
from hora.errors import TransportError

log = get_logger(__name__)

MIN_CAPACITY = 64 * 1024
"""Smallest data segment: small collectives never regrow it."""

U8 = npt.NDArray[np.uint8]


# ---- names and cleanup: hora/_util/shm_names.py ------------------------------------------

_OWNED: dict[str, int] = {}
"""Segments this process created and has not unlinked yet -> the creating pid."""


@atexit.register
def _unlink_owned() -> None:  # pragma: no cover - runs at interpreter exit
    me = os.getpid()
    for path, pid in list(_OWNED.items()):
        if pid == me:  # not in a forked child that exits normally
            try:
                os.unlink(path)
            except OSError:
                pass
    _OWNED.clear()


# ---- futex ------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "s390x": 238, "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
SPIN_ALLOWED = platform.machine().lower() in ("x86_64", "amd64")
"""Spinning on a counter is only correct where loads and stores keep program order (TSO)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_futex() -> Any:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return syscall


_syscall = _load_futex()


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the uint32 at ``address`` equals ``expected``, at most ``seconds``.

    Returns on a wake, a changed value, a signal or the timeout (callers re-check). Without
    futexes (not Linux) it sleeps ``min(seconds, 1 ms)``.
    """
    if _syscall is None:
        time.sleep(min(seconds, 0.001))
        return
    whole = int(seconds)
    ts = _Timespec(whole, int((seconds - whole) * 1e9))
    _syscall(_SYS_FUTEX, address, _FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)


def futex_wake(address: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on ``address``."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


# ---- counters: the one wrap compare and the one wait ---------------------------------------------
MASK, HALF = 0xFFFFFFFF, 0x80000000
"""Shared counters are 32-bit words that wrap: ``value`` has reached ``target`` when it is at most
half the range past it."""


def reached(value: int, target: int) -> bool:
    """Whether 32-bit counter ``value`` has reached ``target`` (wrap-around compare)."""
    return ((value - target) & MASK) < HALF


def wait_word(words: memoryview, index: int, address: int, target: int, spins: int,
              seconds: float, asleep: int = -1) -> bool:
    """Every shared-memory wait: until counter ``words[index]`` (at ``address``) reaches ``target``.

    Checks the word ``spins`` times (a peer on another core answers within microseconds), then
    sleeps on its futex at most ``seconds``; while it sleeps, ``words[asleep]`` (if given) is 1
    so that a ringer may skip the wake system call when nobody sleeps. Returns whether the target
    was reached: callers loop, with their own deadline and liveness checks between slices.
    """
    for _ in range(spins):
        if ((words[index] - target) & MASK) < HALF:
            return True
    value = words[index]
    if ((value - target) & MASK) < HALF:
        return True
    if asleep >= 0:
        words[asleep] = 1
    futex_wait(address, value, seconds)
    if asleep >= 0:
        words[asleep] = 0
    return ((words[index] - target) & MASK) < HALF


def ring(words: memoryview, index: int, address: int) -> None:
    """Advance counter ``words[index]`` (at ``address``) by one and wake its sleepers."""
    words[index] = (words[index] + 1) & MASK
    futex_wake(address)


# ---- segments ---------------------------------------------------------------------------------

def _no_space(path: str, size: int, exc: OSError) -> TransportError:
    return TransportError(
        f"cannot allocate {size} bytes of shared memory for {path}: {exc.strerror or exc}. "
        f"HINT: {SHM_DIR} is too small (Docker's default is 64 MiB: run with --shm-size=2g or "
        "more), or disable the shared-memory path."
    )


class Segment:
    """One file under ``/dev/shm`` mapped into this process; the owner creates and grows it."""

    def __init__(self, path: str, fd: int, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self.owner = owner
        self._map: mmap.mmap | None = None
        self.array: U8 = np.empty(0, np.uint8)
        self.address = 0
        self.size = 0  # bytes mapped (an attribute: collectives read it on every op)

    @classmethod
    def create(cls, path: str, size: int) -> Segment:
        """Create ``path`` exclusively (mode 0600) with ``size`` bytes reserved, and map it.

        Raises:
            TransportError: it exists already, ``/dev/shm`` is missing or full.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create shared memory segment {path}: "
                                 f"{exc.strerror or exc}") from exc
        _OWNED[path] = os.getpid()
        seg = cls(path, fd, owner=True)
        try:
            seg.grow(size)
        except BaseException:
            seg.close()
            raise
        return seg

    @classmethod
    def open(cls, path: str) -> Segment:
        """Map a peer's existing segment at its current size (raises OSError if missing)."""
        fd = os.open(path, os.O_RDWR)
        seg = cls(path, fd, owner=False)
        try:
            seg.remap(os.fstat(fd).st_size)
        except BaseException:
            seg.close()
            raise
        return seg

    def grow(self, size: int) -> None:
        """Owner: make the file at least ``size`` bytes (content kept) and remap it."""
        if size <= self.size:
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise _no_space(self.path, size, exc) from exc
            os.ftruncate(self._fd, size)
        self.remap(size)

    def remap(self, size: int) -> None:
        """Map the first ``size`` bytes (the file must be that large)."""
        new = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._release()
        self._map = new
        self.array = np.frombuffer(new, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.size = size

    def _release(self) -> None:
        old, self._map = self._map, None
        self.array = np.empty(0, np.uint8)
        self.address = 0
        self.size = 0
        if old is not None:
            try:
                old.close()
            except BufferError:
                pass  # a caller still holds a view (e.g. staging): unmapped when it is freed

    def unlink(self) -> None:
        """Owner: remove the name (every peer holds a descriptor already; the memory lives on
        until the last mapping goes, and then nothing is left in ``/dev/shm``). Idempotent."""
        if self.owner and self.path in _OWNED:
            _OWNED.pop(self.path, None)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap, close the descriptor and, for the owner, unlink. Idempotent."""
        self._release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.unlink()


def available_bytes(shm_dir: str = SHM_DIR) -> int:
    """Free space in ``/dev/shm`` (0 if it is missing): check before relying on shared memory,
    e.g. Docker's default is 64 MiB."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def capacity_for(nbytes: int) -> int:
    """Data segment capacity for ``nbytes``: the next power of two, at least MIN_CAPACITY."""
    cap = MIN_CAPACITY
    while cap < nbytes:
        cap *= 2
    return cap


__all__ = [
    "MIN_CAPACITY",
    "PREFIX",
    "SHM_DIR",
    "SPIN_ALLOWED",
    "Segment",
    "available_bytes",
    "capacity_for",
    "futex_wait",
    "futex_wake",
    "job_id_for",
    "job_id_from_env",
    "job_segments",
    "process_start_time",
    "reached",
    "remove_job_segments",
    "ring",
    "segment_path",
    "valid_job_id",
    "wait_word",
]
