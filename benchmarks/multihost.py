"""Allreduce / allgather across separate hosts on shaped links: bus bandwidth against the link.

    sudo python benchmarks/multihost.py                     # 4 hosts x 1 rank, 1 Gbit/s, 0.2 ms
    sudo python benchmarks/multihost.py --rate 500mbit --delay 1ms --mib 16 64
    sudo python benchmarks/multihost.py --layout 2x2        # 2 hosts x 2 ranks (flat vs hier.)
    sudo python benchmarks/multihost.py --layout 2x2 --op allgather --rounds 3

Makes its own hosts (network namespaces on a private bridge, each with an sshd: the same code as
the multi-host tests, ``tests/_netns.py``), limits every host's outgoing link with ``tc netem``
(rate and delay), runs ``hora run -H`` from host 0 -- rank 0 local, the others over ssh -- and
deletes everything afterwards. Needs root, iproute2 and the OpenSSH server.

Reported per size: median time of ``hora.allreduce`` (float32, Sum, through the full engine) on
the slowest rank, bus bandwidth = 2 (n-1)/n * bytes / time (the NCCL-tests convention: for a
bandwidth-optimal allreduce each host's link carries that many bytes each way, so busbw equals
the link rate at best), and busbw / link rate. A single TCP stream between two hosts over the
same shaped link is measured too ("TCP goodput"): the most any protocol gets from that link.

Hierarchical allreduce (``HORA_HIERARCHICAL_ALLREDUCE=1``) is measured against the flat ring for
``--layout 2x2``. ``--op allgather``: ``hora.allgather`` instead, ``--mib`` the size of the
gathered result (each rank contributes ``1/n`` of it), bus bandwidth ``(n-1)/n * bytes / time``
(NCCL-tests' allgather convention; the flat ring's link carries that much each way), and for
``--layout 2x2`` the hierarchical allgather (``HORA_HIERARCHICAL_ALLGATHER=1``) against the flat
ring. ``--rounds N`` runs the jobs N times, alternating (flat, hierarchical, flat, ...), since the
speed of this machine drifts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import _netns  # noqa: E402  (tests/_netns.py: one implementation for tests and benchmarks)

PY = sys.executable
MIB = 1024 * 1024


def _rate_bytes(rate: str) -> float:
    """``"1gbit"`` -> bytes per second (tc's units: bit, kbit, mbit, gbit)."""
    text = rate.lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale / 8
    raise SystemExit(f"--rate {rate!r}: use tc units, e.g. 1gbit or 500mbit")


# ---- worker (runs as every rank) ---------------------------------------------------------------

def worker(op: str, sizes_mib: list[float], seconds: float) -> None:
    import numpy as np

    import hora

    hora.init()
    rank, n = hora.rank(), hora.size()
    rows = []

    def step(x: np.ndarray, name: str) -> None:
        if op == "allgather":
            hora.allgather(x, name=name)
        else:
            hora.allreduce_(x, op=hora.Sum, name=name)

    for mib in sizes_mib:
        # zeros: repeated in-place sums stay exact; an allgather's result is mib MiB
        x = np.zeros(int(mib * MIB) // 4 // (n if op == "allgather" else 1), np.float32)
        t0 = time.perf_counter()
        step(x, f"w{mib}")  # warm-up; sizes the repetitions
        once = time.perf_counter() - t0
        reps = hora.broadcast_object(max(3, min(1000, int(seconds / max(once, 1e-6)))), 0,
                                     name=f"r{mib}")
        times: list[float] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step(x, f"b{mib}")
            times.append(time.perf_counter() - t0)
        slowest = max(hora.allgather_object(statistics.median(times), name=f"m{mib}"))
        rows.append({"mib": mib, "seconds": slowest, "reps": len(times)})
    if rank == 0:
        print("RESULT " + json.dumps({"n": n, "rows": rows}), flush=True)
    hora.shutdown()


# ---- orchestration -----------------------------------------------------------------------------

def tcp_goodput(cluster: _netns.Cluster, mib: int = 64) -> float:
    """Bytes/s of one TCP stream from host 1 to host 0 over the shaped link."""
    server = ("import socket, sys, time\n"
              f"s = socket.create_server(('{cluster.hosts[0].address}', 5999))\n"
              "print('up', flush=True)\nc, _ = s.accept()\nbuf = bytearray(1 << 20)\n"
              "got, t0 = 0, None\n"
              "while True:\n    n = c.recv_into(buf)\n    if not n: break\n"
              "    t0 = t0 or time.perf_counter()\n    got += n\n"
              "print(got / (time.perf_counter() - t0), flush=True)\n")
    client = ("import socket\n"
              f"c = socket.create_connection(('{cluster.hosts[0].address}', 5999))\n"
              f"data = bytes(1 << 20)\nfor _ in range({mib}): c.sendall(data)\nc.close()\n")
    srv = subprocess.Popen(cluster.hosts[0].argv(PY, "-c", server), stdout=subprocess.PIPE,
                           text=True)
    assert srv.stdout is not None
    srv.stdout.readline()
    subprocess.run(cluster.hosts[1].argv(PY, "-c", client), check=True, timeout=120)
    out = srv.stdout.readline()
    srv.wait(30)
    return float(out)


def run_job(cluster: _netns.Cluster, layout: list[int], sizes: list[float], seconds: float,
            env: dict[str, str], op: str = "allreduce") -> dict[str, object]:
    hosts = ",".join(f"{h.address}:{k}" for h, k in zip(cluster.hosts, layout))
    argv = cluster.hosts[0].argv(
        PY, "-m", "hora.runner", "run", "-np", str(sum(layout)), "-H", hosts, "-p",
        str(_netns.SSH_PORT), "-i", cluster.identity, PY, __file__, "--worker", "--op", op,
        "--seconds", str(seconds), "--mib", *map(str, sizes))
    job_env = {**os.environ, **env, "PATH": f"{cluster.ssh_bin}:{os.environ['PATH']}"}
    done = subprocess.run(argv, env=job_env, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("[0]<stdout>:RESULT "):
            return dict(json.loads(line.split("RESULT ", 1)[1]))
    raise SystemExit(f"job failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def size_text(mib: float) -> str:
    return f"{mib * 1024:g} KiB" if mib < 1 else f"{mib:g} MiB"


def report(title: str, result: dict[str, object], link: float, op: str = "allreduce") -> None:
    n = int(result["n"])  # type: ignore[call-overload]
    print(f"\n{title}: {n} ranks")
    print(f"{'size':>8} {'median ms':>10} {'reps':>5} {'busbw MB/s':>11} {'of link':>8}")
    factor = (n - 1) / n * (2 if op == "allreduce" else 1)
    for row in result["rows"]:  # type: ignore[attr-defined]
        nbytes = row["mib"] * MIB
        busbw = factor * nbytes / row["seconds"]
        print(f"{size_text(row['mib']):>8} {row['seconds'] * 1e3:10.2f} {row['reps']:5d} "
              f"{busbw / 1e6:11.1f} {busbw / link:8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=["4x1", "2x2"], default="4x1",
                        help="hosts x ranks per host [default: 4x1]")
    parser.add_argument("--rate", default="1gbit", help="link rate per host (tc units)")
    parser.add_argument("--delay", default="0.2ms", help="one-way delay per link ('' for none)")
    parser.add_argument("--mib", type=float, nargs="+", default=[1, 4, 16, 64],
                        help="sizes in MiB (fractions too: 0.00390625 is 4 KiB)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per size")
    parser.add_argument("--mtu", type=int, default=1500, help="link MTU [default: 1500]")
    parser.add_argument("--op", choices=["allreduce", "allgather"], default="allreduce",
                        help="the collective [default: allreduce]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the flat (and hierarchical) jobs this many times, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.op, args.mib, args.seconds)
        return
    reason = _netns.unavailable(ssh=True, shaping=True)
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    hosts, per_host = (4, 1) if args.layout == "4x1" else (2, 2)
    link = _rate_bytes(args.rate)
    knob = f"HORA_HIERARCHICAL_{args.op.upper()}"
    with _netns.Cluster(hosts, mtu=args.mtu) as cluster:
        shaping = cluster.shape(args.rate, args.delay or None)
        print(f"{hosts} hosts x {per_host} rank(s); every host's outgoing link: {shaping}, "
              f"MTU {args.mtu}; link rate {link / 1e6:.1f} MB/s")
        goodput = tcp_goodput(cluster)
        print(f"one TCP stream over a link: {goodput / 1e6:.1f} MB/s = {goodput / link:.1%} "
              "of the link rate")
        for round_ in range(1, args.rounds + 1):
            suffix = f" (round {round_})" if args.rounds > 1 else ""
            flat = run_job(cluster, [per_host] * hosts, args.mib, args.seconds,
                           {knob: "0"}, args.op)
            report(f"{args.op}, flat ring{suffix}", flat, link, args.op)
            if per_host > 1:
                hier = run_job(cluster, [per_host] * hosts, args.mib, args.seconds,
                               {knob: "1"}, args.op)
                report(f"{args.op}, hierarchical{suffix}", hier, link, args.op)
                pairs = zip(flat["rows"], hier["rows"])  # type: ignore[call-overload]
                ratios = [f"{size_text(a['mib'])} {a['seconds'] / b['seconds']:.2f}x"
                          for a, b in pairs]
                print("hierarchical / flat speed: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
