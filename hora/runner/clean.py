"""``hora clean``: remove the shared-memory segments hora left on this host.

A rank's segments live in ``/dev/shm`` (``hora-<job>-<group>-<rank>-{h,d0,d1}``). Ranks unlink
their own when they close, survivors unlink a dead peer's, the next job's ranks sweep those of
dead processes, and ``hora run`` removes a job's when it ends; what a host can still hold after
all that (every rank of a job SIGKILLed at once and no job since, or segments of an older hora)
is what this command is for. By default it removes only segments whose owner process is gone,
so it is safe while jobs run; ``--job`` removes one job's segments; ``--all`` removes every hora
segment on the host (stop hora jobs first).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hora._util import shm_owners
from hora._util.shm_names import PREFIX, SHM_DIR, job_segments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hora clean",
        description="Remove shared-memory segments that hora jobs left in /dev/shm on this host. "
                    "By default only those whose owner process has exited (safe while jobs "
                    "run).")
    p.add_argument("--dry-run", "-n", action="store_true",
                   help="list what would be removed, remove nothing")
    p.add_argument("--job", metavar="JOB_ID",
                   help="remove every segment of this job id (HORA_JOB_ID), live or not")
    p.add_argument("--all", action="store_true",
                   help="remove every hora segment on this host, including running jobs' "
                        "(their ranks then fail): stop hora jobs first")
    p.add_argument("--shm-dir", default=SHM_DIR, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``hora clean``; returns the exit status."""
    ns = _parser().parse_args(list(argv))
    if ns.all:
        try:
            names = sorted(n for n in os.listdir(ns.shm_dir) if n.startswith(PREFIX))
        except OSError as exc:
            sys.stderr.write(f"hora clean: cannot list {ns.shm_dir}: {exc}\n")
            return 1
        paths = [os.path.join(ns.shm_dir, n) for n in names]
    elif ns.job:
        paths = job_segments(ns.job, ns.shm_dir)
    else:
        paths = shm_owners.stale_segments(ns.shm_dir, orphans=True)
    if ns.dry_run:
        for path in paths:
            print(f"would remove {path}")
        print(f"{len(paths)} segment(s) would be removed")
        return 0
    removed = shm_owners.remove(paths)
    for path in removed:
        print(f"removed {path}")
    print(f"removed {len(removed)} segment(s)" + (
        "" if removed or ns.all or ns.job else " (none left by exited processes)"))
    left = [p for p in paths if os.path.exists(p)]
    if left:
        sys.stderr.write(f"hora clean: could not remove {len(left)} segment(s), e.g. {left[0]} "
                         "(permissions? run as the user who ran the job)\n")
        return 1
    return 0


__all__ = ["main"]
