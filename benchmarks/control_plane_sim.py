"""Control plane at scale: N virtual ranks against a real rank 0, rendezvous and negotiation.

    python benchmarks/control_plane_sim.py                         # N = 64, 256, 1024
    python benchmarks/control_plane_sim.py --ranks 32 --hosts 4 --cycles 20 --json out.json

Every virtual rank is a thread that speaks hora's real protocol through hora's real code: a
:class:`~hora.rendezvous.store_client.KVStoreClient` to a real
:class:`~hora.rendezvous.kvstore.KVStoreServer` (run by this script, as ``hora run`` does), a
real :class:`~hora.transports.tcp.TcpTransport` (the store rendezvous, authenticated control and
data connections of :mod:`hora.transports.tcp_mesh`), and control messages encoded by
:mod:`hora.core.op.messages`. Rank 0 runs alone in its own process with a real
:class:`~hora.core.engine.coordinator.Coordinator` and does, per cycle, what the engine thread
of rank 0 does for a negotiated op (:mod:`hora.core.engine.engine` ``_receive``,
:mod:`hora.core.engine.dispatch`): receive and decode every request, ``Coordinator.add``,
``Coordinator.ready`` (validation, fusion), encode and send the response list to every member.
Nothing runs a data collective: this measures the control plane only.

The ranks are laid out on ``--hosts`` simulated hosts (rank 0 alone on host 0, ranks 1..N-1 in
equal blocks on the others); each simulated host is one process, its ranks threads.

Measured per N:

* **rendezvous**: from the moment every process is ready (imports done) until the last rank's
  transport is up: its store connection, publishing its address, learning everyone's, and its
  connections (control to rank 0; data to its eager peers).
* **process-set check**: then every rank runs ``init()``'s check that all ranks passed the same
  process sets (:mod:`hora.core.engine.context`, one set ``[0, 1]``) through the same store:
  when the last rank is done, and the most store requests one rank made for it.
* **uncached cycle**: every rank sends rank 0 a request for the same named 4 KiB allreduce and
  waits for the response; rank 0 parses each, runs the coordinator and sends the response list
  as the engine does, through the hosts' leaders (one frame per host,
  :class:`~hora.core.engine.cross_host.Relay`); every rank receives it through the engine's
  :meth:`~hora.core.engine.cross_link.CrossCache.take` (a leader forwards it first). Rank 0's
  CPU time per cycle (its thread's ``thread_time``) and the wall time per cycle.
* **cached cycle** (:mod:`hora.core.engine.cross_cache`): the name holds a slot on every rank;
  every rank runs the engine's own code: its :class:`~hora.core.engine.cross_link.CrossCache`
  (built by ``CrossCache.for_job``, the host links of :mod:`hora.core.engine.cross_host`
  included: abstract Unix sockets between a simulated host's threads) marks the hit
  (``submit``), and its receive step (``take``) does the rest: each host's leader counts its
  ranks' marks and sends rank 0 one ``cbits``; rank 0 decides and sends each leader one frame,
  which the leader forwards; every rank rebuilds the response from its slot table (nothing runs
  a data collective). Rank 0's CPU time per cycle and wall time.
  ``--per-rank-marks``: ``CrossCache.for_job(per_rank=True)``, every rank its own host: every
  rank sends rank 0 its own ``cbits`` and gets its own ``cdec`` (the engine before host links).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
NAME = "grad.0"  # the named allreduce every cycle negotiates
SHAPE = [1024]  # float32: 4 KiB


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def layout(size: int, hosts: int) -> list[str]:
    """Host name of every rank: rank 0 alone on ``sim0``, the rest in blocks on the others."""
    others = max(1, hosts - 1)
    per = -(-(size - 1) // others)
    return ["sim0"] + [f"sim{1 + (r - 1) // per}" for r in range(1, size)]


def _request(rank: int) -> Any:
    from hora.core.op.messages import OpKind, Request

    return Request(name=NAME, kind=OpKind.ALLREDUCE, rank=rank, dtype="float32",
                   shape=list(SHAPE), op=1)


# ---- the processes -----------------------------------------------------------------------------

class _Proc:
    """What one simulated host's process shares between its rank threads."""

    def __init__(self, args: argparse.Namespace) -> None:
        from hora.core.engine import context  # noqa: F401  (the process-set check)
        from hora.rendezvous.store_client import KVStoreClient
        from hora.transports import tcp_mesh
        from hora.transports.tcp import TcpTransport  # imported before the clock starts

        self.transport_cls = TcpTransport
        self.gathered: dict[int, float] = {}  # rank -> when it knew every rank's address
        original = tcp_mesh._gather_entries

        def gather(store: Any, scope: str, rank: int, *rest: Any, **kw: Any) -> Any:
            out = original(store, scope, rank, *rest, **kw)
            self.gathered[rank] = time.time()
            return out

        tcp_mesh._gather_entries = gather  # (the same function, timed)

        self.args = args
        self.secret = bytes.fromhex(args.secret)
        self.hosts = layout(args.size, args.hosts)
        self.ranks = [int(r) for r in args.ranks_of.split(",")]
        self.store = KVStoreClient("127.0.0.1", args.port, self.secret, 120.0)

    def barrier(self, name: str) -> float:
        """Every process arrives; the parent answers with a start time."""
        self.store.set("sim", f"{name}.{self.args.proc}", b"1")
        return float(self.store.get("sim", f"{name}.go", 600.0))

    def connect(self, rank: int, go: float) -> tuple[Any, list[float]]:
        """Rank ``rank``'s transport, and when (seconds after ``go``) its store connection was
        up, it knew every rank's address, and its transport was up."""
        from hora.rendezvous.store_client import KVStoreClient

        client = KVStoreClient("127.0.0.1", self.args.port, self.secret, 120.0)
        stamps = [time.time() - go]
        self.gathered[rank] = 0.0
        transport = self.transport_cls.create(rank, self.args.size, client, scope="sim.tcp",
                                        secret=self.secret, bind_host="127.0.0.1",
                                        hostname=self.hosts[rank], timeout=300.0,
                                        connect_timeout=300.0, connect_cap=600.0)
        stamps += [self.gathered[rank] - go, time.time() - go]
        from hora.core.engine.context import _check_process_sets
        from hora.core.op.process_set import ProcessSet

        calls = [0]
        call = client._call

        def counted(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            return call(*a, **kw)

        client._call = counted  # type: ignore[method-assign]
        _check_process_sets(client, "sim.tcp", rank, self.args.size, [ProcessSet([0, 1])],
                            False, transport, [])
        stamps += [time.time() - go, float(calls[0])]
        client.close()
        return transport, stamps


def _counts(transport: Any) -> list[int]:
    """``[data, control]`` connections of a transport (before ``connection_counts`` existed:
    its dictionaries, to measure older versions)."""
    if hasattr(transport, "connection_counts"):
        return list(transport.connection_counts())
    return [len(transport._data), len(transport._control)]


def _threads(ranks: list[int], body: Any) -> list[Any]:
    out: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(i: int, rank: int) -> None:
        try:
            out[i] = body(rank)
        except BaseException as exc:  # reported by the process
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, r), daemon=True)
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


class _Runs:
    """The engine's :class:`~hora.core.engine.dispatch.Responses` as the cache sees it: what
    would run (nothing runs a data collective here) and rank 0's ordered sending."""

    def __init__(self) -> None:
        self.ran = 0
        self.send_ordered: Any = None

    def execute(self, responses: list[Any]) -> None:
        self.ran += 1


def _cross_cache(proc: _Proc, transport: Any, runs: _Runs, coordinator: Any) -> Any:
    """The engine's :class:`~hora.core.engine.cross_link.CrossCache` for one rank, built as the
    engine builds it (its host's links included, unless ``--per-rank-marks``)."""
    from hora import config as config_mod
    from hora.core.engine.cross_link import CrossCache

    cross = CrossCache.for_job(transport, config_mod.load({}), proc.hosts, runs, coordinator,
                               set(), False, job_id=f"sim{proc.args.secret[:12]}",
                               per_rank=proc.args.per_rank_marks)
    if cross is None:
        raise SystemExit("the response cache across hosts does not apply to this layout")
    return cross


def _drive(transport: Any, cross: Any, until: Any, what: str) -> None:
    """The engine thread's receive step (``Engine._receive``: ``CrossCache.take``) until
    ``until()``; returns the messages left for the engine are ignored but for ``until``."""
    while not until():
        msg = transport.recv_control(120.0)
        if msg is None:
            raise RuntimeError(f"rank {transport.rank}: no {what} for 120 s")
        for item in cross.take(*msg):
            until.seen(item)


class _Until:
    def __init__(self, test: Any) -> None:
        self.test = test
        self.kinds: list[str] = []

    def __call__(self) -> bool:
        return bool(self.test(self))

    def seen(self, item: tuple[int, str, dict[str, Any]]) -> None:
        self.kinds.append(item[1])


def root_main(args: argparse.Namespace) -> None:
    """Rank 0: a real Coordinator, the engine thread's steps for negotiated and cached ops."""
    from hora import config as config_mod
    from hora.core.engine.coordinator import Coordinator
    from hora.core.op.messages import MSG_REQUESTS, MSG_RESPONSES, decode, encode
    from hora.core.op.process_set import Registry

    proc = _Proc(args)
    go = proc.barrier("rdv")
    transport, took = proc.connect(0, go)
    size = args.size
    registry = Registry(size)
    coordinator = Coordinator(registry, config_mod.load())
    members = list(range(1, size))
    proc.store.set("sim", "res.0", json.dumps({"took": [took], "conns": [
        _counts(transport)]}).encode())
    runs = _Runs()
    proc.barrier("links")
    cross = _cross_cache(proc, transport, runs, coordinator)
    learn = cross.wrap_dispatch(lambda responses: True)  # (rank 0 learns what it sends)

    count = dict.fromkeys(("uncached_in", "uncached_in_bytes", "uncached_out",
                           "uncached_out_bytes", "cached_in", "cached_in_bytes", "cached_out",
                           "cached_out_bytes"), 0)
    phase = ["uncached"]
    send, recv = transport.send_control, transport.recv_control

    def counted_send(peer: int, payload: bytes) -> None:
        count[phase[0] + "_out"] += 1
        count[phase[0] + "_out_bytes"] += len(payload)
        send(peer, payload)

    def counted_recv(timeout: float | None) -> Any:
        msg = recv(timeout)
        if msg is not None:
            count[phase[0] + "_in"] += 1
            count[phase[0] + "_in_bytes"] += len(msg[1])
        return msg

    transport.send_control, transport.recv_control = counted_send, counted_recv
    uncached_cpu, uncached_wall = [], []
    proc.barrier("uncached")
    for _ in range(args.cycles):
        c0, w0 = time.thread_time(), time.perf_counter()
        coordinator.add([_request(0)])
        ready: list[Any] = []
        while not ready:
            msg = transport.recv_control(60.0)
            if msg is None:
                raise SystemExit("rank 0: no request for 60 s")
            sender, payload = msg
            kind, body = decode(payload)
            if kind == MSG_REQUESTS:
                for req in body["reqs"]:
                    req.rank = sender
                coordinator.add(body["reqs"])
            ready = coordinator.ready()
        learn(ready)
        # as dispatch.Responses: encoded once, sent in its place through the hosts' leaders
        cross.relay.send(members, encode(MSG_RESPONSES, resps=ready))
        uncached_cpu.append(time.thread_time() - c0)
        uncached_wall.append(time.perf_counter() - w0)

    phase[0] = "cached"
    cached_cpu, cached_wall = [], []
    proc.barrier("cached")
    for _ in range(args.cycles):
        c0, w0 = time.thread_time(), time.perf_counter()
        before = runs.ran
        if cross.submit([_request(0)]):  # the engine's _take_submissions: a hit, marked
            raise SystemExit("rank 0: the cached name missed")
        _drive(transport, cross, _Until(lambda u, b=before: runs.ran > b), "cache marks")
        cached_cpu.append(time.thread_time() - c0)
        cached_wall.append(time.perf_counter() - w0)
    proc.store.set("sim", "cycles", json.dumps({
        "uncached_cpu": uncached_cpu, "uncached_wall": uncached_wall,
        "cached_cpu": cached_cpu, "cached_wall": cached_wall,
        "hosts": len(set(proc.hosts)), "cache_hosts": len(cross.layout.hosts),
        "marks_from": len(cross.marks_from),
        "per_cycle": {k: v / args.cycles for k, v in count.items()}}).encode())
    proc.barrier("end")
    transport.close()


def host_main(args: argparse.Namespace) -> None:
    """One simulated host: its ranks as threads, each with the engine's CrossCache (the host's
    leader combines its ranks' marks over the host's links and relays rank 0's messages)."""
    from hora.core.op.messages import MSG_REQUESTS, MSG_RESPONSES, encode

    proc = _Proc(args)
    ranks = proc.ranks
    go = proc.barrier("rdv")
    results = _threads(ranks, lambda r: proc.connect(r, go))
    transports = {r: t for r, (t, _) in zip(ranks, results)}
    proc.store.set("sim", f"res.{args.proc}", json.dumps({
        "took": [took for _, took in results],
        "conns": [_counts(t) for t, _ in results]}).encode())
    runs = {r: _Runs() for r in ranks}
    proc.barrier("links")
    caches = dict(zip(ranks, _threads(ranks, lambda r: _cross_cache(proc, transports[r],
                                                                     runs[r], None))))

    def uncached(rank: int) -> None:
        transport, cross = transports[rank], caches[rank]
        for _ in range(args.cycles):
            transport.send_control(0, encode(MSG_REQUESTS, reqs=[_request(rank)]))
            _drive(transport, cross, _Until(lambda u: MSG_RESPONSES in u.kinds), "response")

    proc.barrier("uncached")
    _threads(ranks, uncached)

    def cached(rank: int) -> None:
        transport, cross = transports[rank], caches[rank]
        for _ in range(args.cycles):
            before = runs[rank].ran
            if cross.submit([_request(rank)]):
                raise RuntimeError(f"rank {rank}: the cached name missed")
            _drive(transport, cross, _Until(lambda u, b=before: runs[rank].ran > b), "decision")

    proc.barrier("cached")
    _threads(ranks, cached)
    proc.barrier("end")
    for t in transports.values():
        t.close()


# ---- the parent ----------------------------------------------------------------------------------

def run_one(size: int, hosts: int, cycles: int, timeout: float,
            per_rank_marks: bool = False) -> dict[str, Any]:
    from hora.rendezvous.kvstore import KVStoreServer
    from hora.rendezvous.store_client import KVStoreClient

    secret = secrets.token_bytes(16)
    names = layout(size, hosts)
    groups: dict[str, list[int]] = {}
    for r, h in enumerate(names):
        groups.setdefault(h, []).append(r)
    with KVStoreServer(secret, "127.0.0.1", 0) as server:
        store = KVStoreClient("127.0.0.1", server.port, secret, 60.0)
        procs = []
        for i, ranks in enumerate(sorted(groups.values(), key=lambda rs: rs[0])):
            cmd = [PY, str(Path(__file__).resolve()), "--worker", "root" if i == 0 else "host",
                   "--size", str(size), "--hosts", str(hosts), "--port", str(server.port),
                   "--secret", secret.hex(), "--proc", str(i), "--cycles", str(cycles),
                   "--ranks-of", ",".join(map(str, ranks))]
            if per_rank_marks:
                cmd.append("--per-rank-marks")
            procs.append(subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT))))
        nproc = len(procs)
        deadline = time.monotonic() + timeout
        try:
            def barrier(name: str) -> None:
                store.wait("sim", [f"{name}.{i}" for i in range(nproc)],
                           max(1.0, deadline - time.monotonic()))
                store.set("sim", f"{name}.go", repr(time.time()).encode())

            barrier("rdv")
            barrier("links")  # (every rank's transport is up)
            barrier("uncached")  # (every rank's cache, its host's links included, is up)
            took: list[list[float]] = []
            conns: list[list[int]] = []
            for i in range(nproc):
                part = json.loads(store.get("sim", f"res.{i}", 10.0))
                took += part["took"]
                conns += part["conns"]
            barrier("cached")
            barrier("end")
            cyc = json.loads(store.get("sim", "cycles", 10.0))
            for p in procs:
                p.wait(max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            store.close()
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise SystemExit(f"N={size}: a process failed (exit codes {bad})")
    data = [c[0] for c in conns]
    skip = min(3, cycles // 4)  # the first cycles warm caches and threads up
    return {
        "ranks": size, "hosts": cyc["hosts"], "cache_hosts": cyc["cache_hosts"],
        "marks_from": cyc["marks_from"], "rendezvous_s": max(t[2] for t in took),
        "store_connected_s": max(t[0] for t in took),
        "addresses_known_s": max(t[1] for t in took),
        "sets_checked_s": max(t[3] for t in took) if len(took[0]) > 3 else None,
        "sets_store_requests_max": max(t[4] for t in took) if len(took[0]) > 3 else None,
        "rank0_per_cycle": cyc["per_cycle"],
        "data_conns_max": max(data[1:]), "data_conns_rank0": data[0],
        "control_conns_rank0": conns[0][1],
        "uncached_cpu_ms": 1e3 * statistics.median(cyc["uncached_cpu"][skip:]),
        "uncached_wall_ms": 1e3 * statistics.median(cyc["uncached_wall"][skip:]),
        "cached_cpu_ms": 1e3 * statistics.median(cyc["cached_cpu"][skip:]),
        "cached_wall_ms": 1e3 * statistics.median(cyc["cached_wall"][skip:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--hosts", type=int, default=9,
                        help="simulated hosts, rank 0's own included (default 9: 1 + 8)")
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--per-rank-marks", action="store_true",
                        help="cached: every rank sends its marks to rank 0 itself (what the "
                             "engine does today) instead of one leader per host")
    parser.add_argument("--worker", choices=["root", "host"], help=argparse.SUPPRESS)
    for name in ("size", "port", "proc"):
        parser.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--secret", help=argparse.SUPPRESS)
    parser.add_argument("--ranks-of", dest="ranks_of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _raise_fd_limit()
    if args.worker:
        (root_main if args.worker == "root" else host_main)(args)
        return
    rows = []
    print(f"{'ranks':>6} {'hosts':>5} {'rendezvous':>11} {'data conns':>10} "
          f"{'uncached rank0 cpu':>18} {'wall':>8} {'cached rank0 cpu':>16} {'wall':>8}",
          flush=True)
    for size in args.ranks:
        row = run_one(size, args.hosts, args.cycles, args.timeout, args.per_rank_marks)
        rows.append(row)
        per = row["rank0_per_cycle"]
        print(f"{row['ranks']:>6} {row['hosts']:>5} {row['rendezvous_s']:>9.2f} s "
              f"{row['data_conns_max']:>10} {row['uncached_cpu_ms']:>15.2f} ms "
              f"{row['uncached_wall_ms']:>5.1f} ms {row['cached_cpu_ms']:>13.3f} ms "
              f"{row['cached_wall_ms']:>5.1f} ms", flush=True)
        print(f"{'':>13}(store connected {row['store_connected_s']:.2f} s, addresses known "
              f"{row['addresses_known_s']:.2f} s; process sets checked "
              f"{row['sets_checked_s']:.2f} s, <= {row['sets_store_requests_max']:.0f} store "
              f"requests per rank; rank 0 per cycle: uncached "
              f"{per['uncached_in']:.0f} msgs in / {per['uncached_out']:.0f} out, "
              f"{per['uncached_in_bytes'] + per['uncached_out_bytes']:.0f} B; cached "
              f"{per['cached_in']:.0f} in / {per['cached_out']:.0f} out, "
              f"{per['cached_in_bytes'] + per['cached_out_bytes']:.0f} B)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
