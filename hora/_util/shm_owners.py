"""Who owns a shared-memory segment, and the sweep of segments whose owner is gone.

Every same-host group's rank writes its identity at the start of its header segment
(``/dev/shm/hora-<job>-<group>-<rank>-h``, see :mod:`hora.transports.shm_fabric`): a magic word,
its pid, its start time (``/proc/<pid>/stat`` field 22, so a reused pid is not mistaken for it)
and its pid namespace. A segment whose owner is *gone* (no such process, another process under
that pid, a zombie) is garbage: a rank killed with SIGKILL cannot unlink its own, and under
torchrun, mpirun or srun no hora launcher sweeps them. Three sweepers use this one rule:

* a surviving peer, when it closes its group, removes the segments of peers that died;
* every rank's first shared-memory group sweeps the host (the next job cleans up the last);
* ``hora clean`` (docs/faults.md) removes what is left, on demand.

Segments whose owner lived in another pid namespace (a container sharing ``/dev/shm``) cannot
be judged from here and are never swept automatically. Standard library only (base layer).
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass

from hora._util.shm_names import PREFIX, SHM_DIR, remove

log = logging.getLogger(__name__)

MAGIC = 0x41524F48  # "HORA"
"""First word of every header segment, written last during its creation (with its identity)."""

# uint32 words of the header that identify its owner (the rest of the layout: shm_fabric).
W_MAGIC, W_PID, W_START_LO, W_START_HI, W_PIDNS = 0, 3, 4, 5, 10
_IDENTITY = struct.Struct("<11I")

HEADER_SUFFIX = "-h"


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (``/proc/<pid>/stat`` field 22); None when there
    is no such process or it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19]) if fields[0] not in (b"Z", b"X") else None
    except (IndexError, ValueError):
        return None


def pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``, 32 bits), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


@dataclass(frozen=True)
class Owner:
    """The identity a header segment records."""

    pid: int
    start: int
    pidns: int

    def gone(self) -> bool:
        """Whether the owner has exited (judged only in this pid namespace; else False)."""
        if not self.pid or not self.start or not self.pidns or self.pidns != pid_namespace():
            return False
        return process_start_time(self.pid) != self.start


def owner_of(header_path: str) -> Owner | None:
    """The owner a header segment records, or None (unreadable, or not initialised yet)."""
    try:
        fd = os.open(header_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, _IDENTITY.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < _IDENTITY.size:
        return None
    words = _IDENTITY.unpack(raw)
    if words[W_MAGIC] != MAGIC:
        return None
    return Owner(words[W_PID], words[W_START_LO] | (words[W_START_HI] << 32), words[W_PIDNS])


def stale_segments(shm_dir: str = SHM_DIR, *, orphans: bool = False) -> list[str]:
    """Paths of hora segments whose owner is gone: a dead owner's header and its data
    segments. ``orphans``: also data segments whose header no longer exists (a rank killed
    while it unlinked; only safe when no job is starting or closing on this host)."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError:
        return []
    owners = {n[:-len(HEADER_SUFFIX)] for n in names if n.endswith(HEADER_SUFFIX)}
    dead = set()
    for stem in owners:
        owner = owner_of(os.path.join(shm_dir, stem + HEADER_SUFFIX))
        if owner is not None and owner.gone():
            dead.add(stem)
    found = []
    for name in names:
        stem, _, kind = name.rpartition("-")
        if not stem or "." in kind:
            continue  # not a segment (e.g. a live marker)
        if stem in dead or (orphans and stem not in owners):
            found.append(os.path.join(shm_dir, name))
    return sorted(found)


def sweep(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments of owners that are gone; returns the paths removed."""
    removed = remove(stale_segments(shm_dir))
    if removed:
        log.info("removed %d shared memory segments left by processes that died: %s",
                 len(removed), ", ".join(os.path.basename(p) for p in removed))
    return removed


__all__ = ["MAGIC", "Owner", "owner_of", "pid_namespace", "process_start_time", "remove",
           "stale_segments", "sweep"]
