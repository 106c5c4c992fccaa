"""Failure detection: how fast do the surviving ranks fail when one rank is SIGKILLed?

    python benchmarks/failure_detection.py                    # victims 2 and 0, all scenarios
    python benchmarks/failure_detection.py --victims 1 --mib 256 --scenarios allreduce
    python benchmarks/failure_detection.py --scenarios stop   # SIGSTOP: alive but silent
    python benchmarks/failure_detection.py --launcher env     # no hora run (as under torchrun)

Each scenario is one ``hora run -np 3`` job. The victim rank kills itself with SIGKILL (from a
helper thread, so the main thread is really inside the collective):

* ``allreduce``: mid-allreduce of a large float32 tensor (``--mib``, default 64 MiB);
* ``broadcast``: mid-broadcast of a tensor of the same size (the root is a survivor);
* ``idle``: between steps, while every rank sits in user code with no op pending; the survivors
  start their next step ``--idle`` seconds later;
* ``stop`` (not in the default set): the victim is SIGSTOPped mid-allreduce instead, i.e. alive,
  sockets open, silent: only a heartbeat or an op deadline can notice that.

For each survivor the worker prints ``time.monotonic()`` stamps (one clock for every process of
the machine): when its engine recorded the failure (``detected``, polled every 2 ms), when the
user's call raised ``HoraInternalError`` (``raised``) and when the launcher's SIGTERM arrived
(survivors ignore it, to measure hora rather than the launcher; the launcher SIGKILLs them 5 s
later). A broadcast root may legitimately *complete* (its data went out before the receiver
died); it counts by its ``detected`` time. The table shows seconds after the kill, the slowest
survivor per column, and the error text. The issue's goal: every survivor fails within 5 s.

``--launcher env`` starts the three ranks directly with torchrun-style variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...), so no launcher stops the survivors: this measures hora
alone, as under mpirun / srun / torchrun, and shows how long a survivor would otherwise hang.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("allreduce", "broadcast", "idle")
EXTRA_SCENARIOS = ("stop",)
GOAL_S = 5.0


_SAY_LOCK = threading.Lock()


def _say(text: str) -> None:
    with _SAY_LOCK:  # one write per line: the watcher thread prints too
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


# ---- worker (one rank) -------------------------------------------------------------------------

def _watch_engine(engine: Any, until: float) -> None:
    """Print when this rank's engine first records an error (the moment of detection)."""
    while time.monotonic() < until:
        if engine.error is not None:
            _say(f"DETECTED {time.monotonic():.6f}")
            return
        time.sleep(0.002)


def _kill_self_later(delay: float, sig: int) -> None:
    def run() -> None:
        time.sleep(delay)
        _say(f"KILL {time.monotonic():.6f}")
        os.kill(os.getpid(), sig)

    threading.Thread(target=run, daemon=True).start()


def worker(scenario: str, victim: int, mib: int, delay: float, idle: float,
           linger: float) -> None:
    import hora
    from hora.core.engine import context

    signal.signal(signal.SIGTERM, lambda *_: _say(f"SIGTERM {time.monotonic():.6f}"))
    hora.init()
    rank, size = hora.rank(), hora.size()
    n = mib * (1 << 20) // 4
    x = np.ones(n, np.float32)
    hora.allreduce(np.ones(1), name="warm")
    t = time.monotonic()
    hora.allreduce(x, name="warm.big", op=hora.Sum)  # buffers allocated, connections hot
    took = {"allreduce": time.monotonic() - t}
    t = time.monotonic()
    hora.broadcast(x, (victim + 1) % size, name="warm.bcast")
    took["broadcast"] = time.monotonic() - t
    took["stop"], took["idle"] = took["allreduce"], 1.0
    if delay <= 0:  # auto: a third into the op, so the victim surely dies inside it
        delay = took[scenario] / 3
    if rank == victim:
        _say(f"TIMING {time.monotonic():.6f} op {took[scenario]:.3f}s, kill after {delay:.3f}s")
    hora.allreduce(np.ones(1), name="ready")
    watcher = threading.Thread(target=_watch_engine, daemon=True,
                               args=(context.get().engine, time.monotonic() + linger))
    watcher.start()
    sig = signal.SIGSTOP if scenario == "stop" else signal.SIGKILL
    started = time.monotonic()
    try:
        if scenario in ("allreduce", "stop"):
            if rank == victim:
                _kill_self_later(delay, sig)
            hora.allreduce(x, name="big", op=hora.Sum)
        elif scenario == "broadcast":
            if rank == victim:
                _kill_self_later(delay, sig)
            root = next(r for r in range(size) if r != victim)
            hora.broadcast(x, root, name="big.bcast")
        else:  # idle: nothing pending anywhere while the victim dies
            if rank == victim:
                _kill_self_later(delay, sig)
            time.sleep(idle)
            hora.allreduce(np.ones(1), name="next.step")
        _say(f"COMPLETED {time.monotonic():.6f} after {time.monotonic() - started:.3f}s")
    except hora.HorovodInternalError as exc:
        text = " ".join(str(exc).split())
        _say(f"RAISED {time.monotonic():.6f} {type(exc).__name__}: {text}")
    # Stay alive, as a survivor that catches the error (elastic training) does: a peer blocked
    # on this rank must learn of the failure from hora, not from this process exiting. Under
    # hora run the launcher ends the job; with --launcher env the driver does once all reported.
    watcher.join()
    time.sleep(max(0.0, linger - (time.monotonic() - started)))
    os._exit(0)


# ---- driver ------------------------------------------------------------------------------------

_LINE = re.compile(
    r"^\[(\d+)\]<stdout>:(KILL|DETECTED|RAISED|COMPLETED|SIGTERM|TIMING) ([\d.]+) ?(.*)$")


def _run_hora(worker_args: list[str], timeout: float) -> tuple[str, bool]:
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", "3", sys.executable,
           os.path.abspath(__file__), *worker_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_env(worker_args: list[str], timeout: float, victim: int) -> tuple[str, bool]:
    """The three ranks without a launcher: torchrun-style variables, rank 0 serves the store.

    Ends the job as soon as every survivor has reported both detection and its op's outcome.
    """
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines: list[str] = []
    lock = threading.Lock()

    def relay(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                lines.append(f"[{rank}]<stdout>:{line.rstrip()}")

    procs, relays = [], []
    for rank in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
        env.update(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="3",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *worker_args],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proc)
        relays.append(threading.Thread(target=relay, args=(rank, proc), daemon=True))
        relays[-1].start()
    deadline = time.monotonic() + timeout
    timed_out = True
    while time.monotonic() < deadline:
        with lock:
            text = "\n".join(lines)
        if all(f"[{r}]<stdout>:DETECTED" in text and (f"[{r}]<stdout>:RAISED" in text or
                                                      f"[{r}]<stdout>:COMPLETED" in text)
               for r in range(3) if r != victim):
            timed_out = False
            break
        if all(p.poll() is not None for p in procs):
            timed_out = False
            break
        time.sleep(0.05)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for relay_thread in relays:
        relay_thread.join(5)
    with lock:
        return "\n".join(lines), timed_out


def run_scenario(scenario: str, victim: int, args: argparse.Namespace) -> dict[str, Any]:
    worker_args = ["--worker", scenario, "--victim", str(victim), "--mib", str(args.mib),
                   "--delay", str(args.delay), "--idle", str(args.idle),
                   "--linger", str(args.linger)]
    t0 = time.monotonic()
    if args.launcher == "hora":
        out, timed_out = _run_hora(worker_args, args.timeout)
    else:
        out, timed_out = _run_env(worker_args, args.timeout, victim)
    events: dict[int, dict[str, tuple[float, str]]] = {}
    for line in out.splitlines():
        m = _LINE.match(line)
        if m:
            events.setdefault(int(m.group(1)), {}).setdefault(
                m.group(2), (float(m.group(3)), m.group(4)))
    kill = events.get(victim, {}).get("KILL", (None, ""))[0]
    timing = events.get(victim, {}).get("TIMING", (0.0, ""))[1]
    survivors = [r for r in range(3) if r != victim]
    result: dict[str, Any] = {"scenario": scenario, "victim": victim, "timed_out": timed_out,
                              "wall": time.monotonic() - t0, "kill": kill, "survivors": {},
                              "output": out, "timing": timing}
    for r in survivors:
        ev = events.get(r, {})
        row: dict[str, Any] = {}
        for what in ("DETECTED", "RAISED", "SIGTERM", "COMPLETED"):
            if what in ev and kill is not None:
                row[what.lower()] = ev[what][0] - kill
        row["error"] = ev.get("RAISED", (0.0, ""))[1]
        result["survivors"][r] = row
    return result


def _fmt(values: list[float | None]) -> str:
    if any(v is None for v in values) or not values:
        return "never" if values else "-"
    return f"{max(v for v in values if v is not None):.3f}"


def args_launcher(res: dict[str, Any]) -> str:
    return str(res.get("launcher", "hora"))


def report(results: list[dict[str, Any]], verbose: bool) -> int:
    _say("")
    _say(f"{'scenario':<10} {'victim':>6} {'detected s':>11} {'raised s':>9} {'SIGTERM s':>10}"
         f"  verdict")
    bad = 0
    for res in results:
        rows = list(res["survivors"].values())
        for r in rows:  # the engine knew no later than the user's call raised
            if r.get("raised") is not None:
                r["detected"] = min(r.get("detected", r["raised"]), r["raised"])
        detected = [r.get("detected") for r in rows]
        raised = [r.get("raised") for r in rows]
        term = [r.get("sigterm") for r in rows]
        idle = res["scenario"] == "idle"
        failed_at = [r.get("detected") if idle or r.get("completed") is not None
                     else r.get("raised") for r in rows]
        if res["kill"] is None:
            verdict = "victim never reached the kill (see output)"
        elif any(r.get("completed") is not None and r.get("completed") < 0 for r in rows):
            verdict = "an op completed before the kill (raise --mib or lower --delay)"
        elif any(v is None for v in failed_at):
            verdict = ("NOT every survivor failed: hung until " + (
                "the launcher killed it" if args_launcher(res) == "hora" else "the timeout"))
        else:
            worst = max(v for v in failed_at if v is not None)
            notes = [n for n, on in (("idle: by 'detected'", idle), ("a broadcast root "
                     "completed; counted by 'detected'", any(r.get("completed") is not None
                                                             for r in rows))) if on]
            verdict = f"{'OK' if worst < GOAL_S else 'SLOW'}: {worst:.3f} s" + (
                f" ({'; '.join(notes)})" if notes else "")
        if not verdict.startswith("OK"):
            bad += 1
        _say(f"{res['scenario']:<10} {res['victim']:>6} {_fmt(detected):>11} {_fmt(raised):>9} "
             f"{_fmt(term):>10}  {verdict}")
        if res.get("timing"):
            _say(f"{'':<18} {res['timing']}")
        texts = sorted({r["error"] for r in rows if r.get("error")})
        for text in texts:
            _say(f"{'':<18} error: {text[:400]}")
        if verbose or res["kill"] is None or res["timed_out"]:
            _say("    --- job output ---")
            for line in res["output"].splitlines()[-40:]:
                _say(f"    {line}")
    _say("")
    _say("detected: the survivor's engine recorded the error; raised: the user's call raised "
         "HoraInternalError; SIGTERM: the launcher began stopping the job (hora run only). "
         "Seconds after the kill; the slowest survivor; 'never': not within the job.")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="SCENARIO", help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--victims", default="2,0",
                        help="ranks to kill, one job each (0 is the coordinator) [default: 2,0]")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma list of {', '.join(SCENARIOS + EXTRA_SCENARIOS)} "
                             f"[default: {','.join(SCENARIOS)}]")
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB [default: 64]")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="seconds after the op starts that the victim dies [default: 0: a "
                             "third of the op's time, measured in a warm-up op]")
    parser.add_argument("--idle", type=float, default=3.0,
                        help="idle scenario: seconds the survivors wait before their next "
                             "step [default: 3]")
    parser.add_argument("--launcher", choices=("hora", "env"), default="hora",
                        help="hora: `hora run -np 3` (default); env: start the ranks directly "
                             "(torchrun variables), so no launcher stops the survivors")
    parser.add_argument("--linger", type=float, default=60.0,
                        help="seconds a survivor stays alive watching for its engine to notice "
                             "[default: 60]")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds allowed per job [default: 90]")
    parser.add_argument("--verbose", action="store_true", help="print every job's output")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.victim, args.mib, args.delay, args.idle, args.linger)
        return 0
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - set(SCENARIOS + EXTRA_SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    victims = [int(v) for v in args.victims.split(",")]
    results = []
    for scenario in scenarios:
        for victim in victims:
            _say(f"running {scenario} with rank {victim} killed ...")
            res = run_scenario(scenario, victim, args)
            res["launcher"] = args.launcher
            results.append(res)
    return report(results, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
