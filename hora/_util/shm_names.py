"""Names of hora's shared-memory segments, and their cleanup: the one rule, used by the
transport (:mod:`hora.transports.shm`), the launcher (:mod:`hora.runner.local`) and, through the
names the launcher sends, the remote side of ssh launches (:mod:`hora.runner.remote`).

Every segment is ``/dev/shm/hora-<job_id>-<group>-<rank>-<kind>``; a rank on a remote host
marks itself live with ``/dev/shm/hora-<job_id>.live.<rank>``. A job id is 1-64 characters of
``[A-Za-z0-9_.]`` (no ``-``, so one job's prefix is never a prefix of another's).
Standard library only (base layer).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where POSIX shared memory lives on Linux (a tmpfs)."""

PREFIX = "hora-"
"""Every segment hora creates is named ``hora-<job_id>-...`` (what the launcher removes)."""

_JOB_ID = re.compile(r"[A-Za-z0-9_.]{1,64}")


def valid_job_id(job_id: str | None) -> bool:
    """Whether ``job_id`` can be used in segment names as is (see :func:`job_id_for`)."""
    return bool(job_id) and _JOB_ID.fullmatch(job_id or "") is not None


def job_id_for(env_job_id: str | None, secret: bytes | None) -> str:
    """The job id used in segment names: ``HORA_JOB_ID`` when usable, else a hash of the secret.

    Anything that is not a valid id is hashed. Every rank of a job gets the same id.
    """
    if env_job_id and valid_job_id(env_job_id):
        return env_job_id
    seed = (env_job_id or "").encode() + b"\0" + (secret or b"")
    return hashlib.sha256(b"hora-shm\0" + seed).hexdigest()[:16]


def job_id_from_env(environ: Mapping[str, str] | None = None, secret: bytes | None = None) -> str:
    """:func:`job_id_for` from ``HORA_JOB_ID`` (exported by ``hora run``) and the job secret."""
    env = os.environ if environ is None else environ
    if secret is None and env.get("HORA_SECRET_KEY"):
        try:
            secret = bytes.fromhex(env["HORA_SECRET_KEY"])
        except ValueError:
            secret = env["HORA_SECRET_KEY"].encode()
    return job_id_for(env.get("HORA_JOB_ID"), secret)


def segment_prefix(job_id: str) -> str:
    """The file-name prefix of every segment of ``job_id``."""
    return f"{PREFIX}{job_id}-"


def live_marker_prefix(job_id: str) -> str:
    """The file-name prefix of the markers of ``job_id``'s live ranks on a host."""
    return f"{PREFIX}{job_id}.live."


def segment_path(job_id: str, group: str, rank: int, kind: str, shm_dir: str = SHM_DIR) -> str:
    """``/dev/shm/hora-<job_id>-<group>-<rank>-<kind>``."""
    return os.path.join(shm_dir, f"{segment_prefix(job_id)}{group}-{rank}-{kind}")


def job_segments(job_id: str | None, shm_dir: str = SHM_DIR) -> list[str]:
    """Paths of every segment of ``job_id`` that exists now (none for an invalid id)."""
    if not valid_job_id(job_id):
        return []
    start = segment_prefix(job_id or "")
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(os.path.join(shm_dir, n) for n in names if n.startswith(start))


def remove_job_segments(job_id: str | None, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment of ``job_id`` (ranks that were killed leave theirs); returns the
    paths removed."""
    return remove(job_segments(job_id, shm_dir))


def remove(paths: list[str]) -> list[str]:
    """Unlink ``paths``; returns those removed (already gone is not an error)."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove shared memory segment %s: %s", path, exc)
    return removed
