"""Certain deadlocks: how long until every rank raises, hora against torch.distributed (gloo).

    python benchmarks/deadlock.py                  # hora's cases at the default deadlock time
    python benchmarks/deadlock.py --gloo-timeout 30

hora: one ``hora run -np 3`` job runs the deadlock cases of
``tests/integration/deadlock_worker.py`` (mismatched names, reducescatter vs barrier, an
allreduce in the fast lane vs barrier, join vs allgather_object, a subset that never submits)
with ``HORA_DEADLOCK_TIME_SECONDS`` at its default unless ``--deadlock-time`` is given; the table
shows, per case, the slowest rank's seconds from its call to the raise.

Peer: torch.distributed with gloo, 2 ranks, the same kind of mistake (rank 0 in ``all_reduce``,
rank 1 in ``barrier``): gloo has no deadlock detection, so both ranks wait for the process
group's timeout (``--gloo-timeout``; torch's default is 30 minutes) and the message names no op
of the other rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "integration" / "deadlock_worker.py"
CASES = ("names", "reducescatter_vs_barrier", "lane_vs_barrier", "join_vs_allgather_object",
         "subset_never_submits")


def run_hora(deadlock_time: float | None) -> dict[str, list[tuple[float, str]]]:
    env = dict(os.environ)
    if deadlock_time is not None:
        env["HORA_DEADLOCK_TIME_SECONDS"] = str(deadlock_time)
    proc = subprocess.run([sys.executable, "-m", "hora.runner.cli", "run", "-np", "3",
                           sys.executable, str(WORKER)], capture_output=True, text=True,
                          env=env, timeout=300)
    found: dict[str, list[tuple[float, str]]] = {}
    for line in proc.stdout.splitlines():
        _, _, payload = line.partition(">:")
        if payload.startswith("CASE "):
            _, case, seconds, outcome = payload.split(" ", 3)
            found.setdefault(case, []).append((float(seconds), outcome))
    return found


def gloo_worker(rank: int, port: int, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=timeout))
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.barrier()
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - whatever gloo raises is the measurement
        outcome = f"{type(exc).__name__} {str(exc).splitlines()[0][:110]}"
    print(f"GLOO {rank} {time.monotonic() - start:.2f} {outcome}", flush=True)
    os._exit(0)  # the group is broken: do not wait in its destructor


def run_gloo(timeout: float) -> list[tuple[float, str]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--gloo-worker", str(r), str(port),
                               str(timeout)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    out: list[tuple[float, str]] = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        for line in stdout.splitlines():
            if line.startswith("GLOO "):
                _, _, seconds, outcome = line.split(" ", 3)
                out.append((float(seconds), outcome))
    return out


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--gloo-worker":
        gloo_worker(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deadlock-time", type=float, default=None,
                        help="HORA_DEADLOCK_TIME_SECONDS for the hora job (default: hora's)")
    parser.add_argument("--gloo-timeout", type=float, default=10.0,
                        help="the gloo process group's timeout in seconds (default 10)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed run")
    args = parser.parse_args()
    hora = run_hora(args.deadlock_time)
    print(f"{'case':<28} {'hora: slowest rank raised after':>32}  error")
    for case in CASES:
        rows = hora.get(case, [])
        if not rows:
            print(f"{case:<28} {'no report':>32}")
            continue
        slowest = max(s for s, _ in rows)
        kinds = {o.split(" ", 1)[0] for _, o in rows}
        print(f"{case:<28} {slowest:>30.2f} s  {', '.join(sorted(kinds))} on {len(rows)} ranks")
    if not args.no_gloo:
        gloo = run_gloo(args.gloo_timeout)
        slowest = max((s for s, _ in gloo), default=float("nan"))
        print(f"\ntorch.distributed gloo, all_reduce vs barrier (timeout {args.gloo_timeout:g} s):"
              f" slowest rank raised after {slowest:.2f} s")
        for seconds, outcome in gloo:
            print(f"  {seconds:6.2f} s  {outcome}")
        fastest_hora = max((max(s for s, _ in hora[c]) for c in CASES if c in hora),
                           default=float("nan"))
        print(f"ratio (gloo / hora, slowest case): {slowest / fastest_hora:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
