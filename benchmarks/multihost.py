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


def _gloo_group() -> None:
    """A torch.distributed gloo group over the same ranks, rank 0's address from ``-H``."""
    import socket

    import torch.distributed as dist

    import hora

    addr = os.environ.get("HORA_HOSTNAME", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _netns.IFACE)  # (else it binds 127.0.0.1)
    if hora.rank() == 0:
        with socket.socket() as probe:
            probe.bind((addr, 0))
            port = probe.getsockname()[1]
    where = hora.broadcast_object((addr, port) if hora.rank() == 0 else None, 0, name="gloo")
    dist.init_process_group("gloo", init_method=f"tcp://{where[0]}:{where[1]}",
                            rank=hora.rank(), world_size=hora.size())


def latency_worker(kib: float, reps: int, rounds: int) -> None:
    """A named small allreduce repeated: hora vs gloo in the same processes, alternating."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import hora

    torch.set_num_threads(1)
    hora.init()
    _gloo_group()
    x = np.zeros(int(kib * 1024) // 4, np.float32)
    t = torch.zeros(x.size)
    times: dict[str, list[float]] = {"hora": [], "gloo": []}
    for _ in range(20):  # warm-up: the name negotiated once, connections up
        hora.allreduce_(x, op=hora.Sum, name="lat")
        dist.all_reduce(t)
    for _ in range(rounds):
        for lib in ("hora", "gloo"):
            dist.barrier()
            for _ in range(reps):
                t0 = time.perf_counter()
                if lib == "hora":
                    hora.allreduce_(x, op=hora.Sum, name="lat")
                else:
                    dist.all_reduce(t)
                times[lib].append(time.perf_counter() - t0)
    med = {lib: statistics.median(v) for lib, v in times.items()}
    slowest = hora.allgather_object(med, name="lat.med")
    if hora.rank() == 0:
        out = {lib: max(m[lib] for m in slowest) for lib in med}
        engine = hora.core.engine.context.get().engine
        cross = getattr(engine, "_cross", None)
        print("RESULT " + json.dumps({"n": hora.size(), "kib": kib, "reps": reps * rounds,
                                      "path": engine.data_path(),
                                      "eager": getattr(cross, "eager", None) is not None,
                                      **out}), flush=True)
    dist.destroy_process_group()
    hora.shutdown()


def train_worker(steps: int, rounds: int, hidden: int) -> None:
    """A training step: hora.torch.DistributedOptimizer vs DDP (gloo), same processes."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    _gloo_group()
    torch.manual_seed(0)

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, 10))

    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    x = torch.randn(64, 784, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    steps_of = {}
    for variant in ("hora", "ddp"):
        model = mlp()
        if variant == "hora":
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters())
        else:
            model = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        steps_of[variant] = step
    times: dict[str, list[float]] = {"hora": [], "ddp": []}
    for r in range(rounds):
        for variant in (("hora", "ddp") if r % 2 == 0 else ("ddp", "hora")):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                steps_of[variant]()
            times[variant].append((time.perf_counter() - t0) / steps)
    med = {v: statistics.median(t) for v, t in times.items()}
    slowest = hvd.allgather_object(med, name="train.med")
    if hvd.rank() == 0:
        params = sum(p.numel() for p in mlp().parameters())
        out = {v: max(m[v] for m in slowest) for v in med}
        print("RESULT " + json.dumps({"n": hvd.size(), "params": params, **out}), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


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
            env: dict[str, str], op: str = "allreduce",
            worker_args: list[str] | None = None) -> dict[str, object]:
    hosts = ",".join(f"{h.address}:{k}" for h, k in zip(cluster.hosts, layout))
    args = worker_args or ["--op", op, "--seconds", str(seconds), "--mib", *map(str, sizes)]
    argv = cluster.hosts[0].argv(
        PY, "-m", "hora.runner", "run", "-np", str(sum(layout)), "-H", hosts, "-p",
        str(_netns.SSH_PORT), "-i", cluster.identity, PY, __file__, "--worker", *args)
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


def small_jobs(args: argparse.Namespace) -> None:
    """--latency / --train: hora against gloo in the same processes, on unshaped links unless
    a rate was asked for."""
    reason = _netns.unavailable(ssh=True, shaping=False)
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    hosts, per_host = (4, 1) if args.layout == "4x1" else (2, 2)
    load = os.getloadavg()[0]
    with _netns.Cluster(hosts, mtu=args.mtu) as cluster:
        if "--rate" in sys.argv:
            print("links: " + cluster.shape(args.rate, args.delay or None))
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load:.1f}; "
              f"{hosts} hosts x {per_host} rank(s)", flush=True)
        if args.latency:
            res = run_job(cluster, [per_host] * hosts, [], 0, {}, worker_args=[
                "--latency", str(args.latency), "--reps", str(args.reps),
                "--rounds", str(args.rounds)])
            # small cached ops of a one-rank-per-host job agree inside their own exchange
            path = "eager slots, star through rank 0" if res.get("eager") else res["path"]
            print(f"named {args.latency:g} KiB allreduce x {res['reps']}, median of the "
                  f"slowest rank: hora {res['hora'] * 1e3:.3f} ms ({path}), gloo "
                  f"{res['gloo'] * 1e3:.3f} ms: hora/gloo {res['hora'] / res['gloo']:.2f}x")
        else:
            res = run_job(cluster, [per_host] * hosts, [], 0, {}, worker_args=[
                "--train", "--steps", str(args.steps), "--rounds", str(args.rounds),
                "--hidden", str(args.hidden)])
            print(f"training step, MLP 784-{args.hidden}-{args.hidden}-10 ({res['params']} "
                  f"parameters), batch 64 per rank, median of the slowest rank: hora "
                  f"{res['hora'] * 1e3:.1f} ms, DDP (gloo) {res['ddp'] * 1e3:.1f} ms: "
                  f"hora/DDP time {res['hora'] / res['ddp']:.2f}x")
        print(json.dumps(res))


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
    parser.add_argument("--latency", type=float, metavar="KIB",
                        help="instead: a named allreduce of KIB KiB repeated, hora vs gloo in "
                             "the same processes (unshaped links unless --rate is given)")
    parser.add_argument("--train", action="store_true",
                        help="instead: a training step (MLP 784-H-H-10), hora.torch's "
                             "DistributedOptimizer vs DDP over gloo (use --layout 2x2)")
    parser.add_argument("--hidden", type=int, default=1024, help="--train: hidden width")
    parser.add_argument("--reps", type=int, default=200, help="--latency: ops per round")
    parser.add_argument("--steps", type=int, default=5, help="--train: steps per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.latency:
            latency_worker(args.latency, args.reps, args.rounds)
        elif args.train:
            train_worker(args.steps, args.rounds, args.hidden)
        else:
            worker(args.op, args.mib, args.seconds)
        return
    if args.latency or args.train:
        small_jobs(args)
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
