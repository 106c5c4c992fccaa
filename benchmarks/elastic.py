"""Elastic training: how long a SIGKILL stops training, and what a commit costs.

    python benchmarks/elastic.py                    # both parts
    python benchmarks/elastic.py --part recovery --rounds 5
    python benchmarks/elastic.py --part commit --mb 100

**recovery** runs ``hora run -np 3 --min-np 2 --max-np 3`` of a PyTorch MLP trained with
``hvd.elastic.run`` + ``TorchState`` (commit every 5 steps); worker 2 SIGKILLs itself mid-run,
a replacement joins later. From time stamps the workers write (``time.time()``, one clock: one
host), the time from the kill to the survivors' next completed step, in parts:

* detection: kill -> the survivors' failed collective raised (``restore()`` starts);
* rendezvous: -> the new generation is connected (rollback, shutdown, asking the driver,
  connecting; ``on_reset``);
* state sync: -> ``sync()`` returned (rank 0's committed model + optimizer broadcast);
* first step: -> the first step after the recovery completed.

The peer is a job restart (what fixed-size jobs do): the same script started from nothing by
``hora run -np 2`` up to its first step, i.e. the interpreter, imports, rendezvous and model
set-up a restart pays before loading a checkpoint.

**commit** times ``TorchState.commit()`` of a model + Adam state of ``--mb`` MB on one rank
against copying those bytes once (``Tensor.copy_`` into preallocated tensors) in the same
process: median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 1024

WORKER = r'''
import json, os, signal, sys, time
import torch
import hora.torch as hvd

t_start = time.time()
hvd.init()
torch.set_num_threads(1)
LOG = os.environ["EB_LOG"]
WID = int(os.environ.get("HORA_ELASTIC_WORKER_ID", "-1"))
H = int(os.environ["EB_HIDDEN"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, H), torch.nn.ReLU(), torch.nn.Linear(H, H),
                            torch.nn.ReLU(), torch.nn.Linear(H, 10))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters())
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

def mark(what, **extra):
    with open(os.path.join(LOG, f"w{WID}"), "a") as f:
        f.write(json.dumps({"what": what, "t": time.time(), "size": hvd.size(), **extra}) + "\n")

class State(hvd.elastic.TorchState):
    def restore(self):
        mark("restore")
        super().restore()

    def sync(self):
        super().sync()
        mark("synced")

state = State(model, opt, step=0)
state.register_reset_callbacks([lambda: mark("reset")])

@hvd.elastic.run
def train(state):
    while state.step < int(os.environ["EB_STEPS"]):
        if WID == 2 and state.step == int(os.environ["EB_KILL_AT"]):
            mark("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        mark("step", step=state.step)
        if state.step % 5 == 0:
            state.commit()
        time.sleep(0.02)

if os.environ.get("EB_RESTART"):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    print(json.dumps({"restart_to_first_step": time.time() - float(os.environ["EB_T0"])}))
    sys.exit(0)
train(state)
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def recovery_round(script: Path, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as log:
        done = subprocess.run(
            [sys.executable, "-m", "hora.runner", "run", "-np", "3", "--min-np", "2",
             "--max-np", "3", sys.executable, str(script)],
            env=_env(EB_LOG=log, EB_STEPS=str(steps), EB_KILL_AT="15",
                     EB_HIDDEN=str(HIDDEN)), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"elastic job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        marks = {int(p.name[1:]): [json.loads(line) for line in p.read_text().splitlines()]
                 for p in Path(log).iterdir()}
    kill = next(m["t"] for m in marks[2] if m["what"] == "kill")
    parts: dict[str, list[float]] = {"detection": [], "rendezvous": [], "state sync": [],
                                     "first step": []}
    for wid in (0, 1):
        seq = [m for m in marks[wid] if m["t"] >= kill]
        restore = next(m["t"] for m in seq if m["what"] == "restore")
        reset = next(m["t"] for m in seq if m["what"] == "reset")
        synced = next(m["t"] for m in seq if m["what"] == "synced" and m["t"] >= reset)
        step = next(m["t"] for m in seq if m["what"] == "step" and m["t"] >= synced)
        parts["detection"].append(restore - kill)
        parts["rendezvous"].append(reset - restore)
        parts["state sync"].append(synced - reset)
        parts["first step"].append(step - synced)
    out = {k: max(v) for k, v in parts.items()}  # the slower survivor decides
    out["total"] = sum(out.values())
    return out


def restart_round(script: Path) -> float:
    with tempfile.TemporaryDirectory() as log:
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "hora.runner", "run", "-np", "2", sys.executable,
             str(script)],
            env=_env(EB_LOG=log, EB_STEPS="1", EB_KILL_AT="-1", EB_HIDDEN=str(HIDDEN),
                     EB_RESTART="1", EB_T0=str(t0)),
            capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"restart job failed:\n{done.stderr[-3000:]}")
        return max(json.loads(line.split(":", 1)[1])["restart_to_first_step"]
                   for line in done.stdout.splitlines() if "restart_to_first_step" in line)


def recovery(rounds: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "elastic_worker.py"
        script.write_text(WORKER)
        results = [recovery_round(script, steps) for _ in range(rounds)]
        restarts = [restart_round(script) for _ in range(rounds)]
    print(f"recovery from a SIGKILL, 3 -> 2 workers on one host, MLP 256-{HIDDEN}-{HIDDEN}-10 "
          f"+ Adam, {rounds} rounds (median, slower survivor):")
    for part in ("detection", "rendezvous", "state sync", "first step", "total"):
        values = [r[part] for r in results]
        print(f"  {part:<11} {statistics.median(values) * 1e3:9.1f} ms   "
              f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")
    hora_s = statistics.median(r["total"] for r in results)
    restart_s = statistics.median(restarts)
    print(f"  restart of the job up to its first step (the peer, before any checkpoint load): "
          f"{restart_s:.2f} s")
    print(f"  hora elastic {hora_s:.3f} s vs restart {restart_s:.2f} s: "
          f"{restart_s / hora_s:.1f}x faster; target <= 5 s: "
          f"{'met' if hora_s <= 5 else 'MISSED'}")


def commit(mb: float, rounds: int) -> None:
    import torch

    import hora.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    # Adam keeps 2 moments per parameter: params + state = 3x the parameter bytes
    n = int(mb * 2**20 / 4 / 3)
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, n // 1024)).sum().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    tensors = [model.weight.data] + [t for s in opt.state.values() for t in s.values()
                                     if torch.is_tensor(t) and t.numel() > 1]
    total = sum(t.numel() * t.element_size() for t in tensors)
    copies = [torch.empty_like(t) for t in tensors]
    copy_s, commit_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.commit()
        commit_s.append(time.perf_counter() - t0)
    c, m = statistics.median(copy_s), statistics.median(commit_s)
    print(f"commit of model + Adam state, {total / 2**20:.1f} MiB, {rounds} rounds (median):")
    print(f"  copy the bytes once   {c * 1e3:8.2f} ms")
    print(f"  TorchState.commit()   {m * 1e3:8.2f} ms   ratio {m / c:.2f}x; target <= 2x: "
          f"{'met' if m / c <= 2 else 'MISSED'}")
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("recovery", "commit", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mb", type=float, default=100.0)
    args = parser.parse_args()
    if args.part in ("recovery", "all"):
        recovery(args.rounds, args.steps)
    if args.part in ("commit", "all"):
        commit(args.mb, max(args.rounds, 9))


if __name__ == "__main__":
    main()
