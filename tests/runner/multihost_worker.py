"""A rank for the multi-host launcher tests (test_multihost.py, test_ssh_launch.py).

    python multihost_worker.py report DIR   allreduce, then print one JSON line describing this
                                            rank (identity, cwd, selected variables, and
                                            whether the job secret is on any command line)
    python multihost_worker.py hold DIR     init, write DIR/pid.<rank>, then sleep (to be stopped)
    python multihost_worker.py die DIR R    like hold, but rank R SIGKILLs itself once every
                                            rank has written its pid file
    python multihost_worker.py allgather DIR  allgathers with uneven first dimensions in several
                                            dtypes; print one JSON line: the cases whose result
                                            differs from numpy's (none, when all is well)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import hora


def secret_on_a_command_line(secret: str) -> list[int]:
    """Pids (on this machine: every namespace shares the process table) whose argv holds it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if secret.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def write_pid(directory: Path, rank: int) -> None:
    tmp = directory / f"pid.{rank}.tmp"
    tmp.write_text(f"{os.getpid()}.")
    os.replace(tmp, directory / f"pid.{rank}")


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    hora.init()
    rank, size = hora.rank(), hora.size()
    if mode == "report":
        total = hora.allreduce(np.arange(4, dtype=np.float64) + rank, op=hora.Sum, name="sum")
        env = os.environ
        print(json.dumps({
            "rank": rank, "size": size, "local_rank": hora.local_rank(),
            "local_size": hora.local_size(), "cross_rank": hora.cross_rank(),
            "cross_size": hora.cross_size(), "sum": total.tolist(), "cwd": os.getcwd(),
            "env": {k: env.get(k) for k in (
                "HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_RANK",
                "HORA_RENDEZVOUS_ADDR", "HORA_GLOO_IFACE", "FROM_X", "FROM_LAUNCHER",
                "CUDA_VISIBLE_DEVICES", "FAKE_SSH_HOST")},
            "secret_in_argv": secret_on_a_command_line(env["HORA_SECRET_KEY"]),
        }), flush=True)
        print(f"stderr line of rank {rank}", file=sys.stderr, flush=True)
        hora.shutdown()
        return
    if mode == "allgather":
        wrong = []
        for dtype, width in (("float32", 3), ("int64", 1), ("float16", 4), ("uint8", 1000)):
            parts = [((np.arange(rows * width) + 100 * q) % 120).astype(dtype).reshape(rows, width)
                     for q, rows in enumerate((q * 5 + 2) % 7 for q in range(size))]
            got = hora.allgather(parts[rank], name=f"ag.{dtype}")  # 2, 0, 5, 3 rows
            if got.tobytes() != np.concatenate(parts).tobytes():
                wrong.append(dtype)
        print(json.dumps({"rank": rank, "wrong": wrong}), flush=True)
        hora.shutdown()
        return
    write_pid(directory, rank)
    if mode == "die" and rank == int(sys.argv[3]):
        while not all((directory / f"pid.{r}").exists() for r in range(size)):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    main()
