"""An elastic training script for the elastic tests (numpy API, no framework): a linear model
trained with averaged gradients, state committed every few steps.

Environment:
    EW_STEPS: steps to train (default 40); EW_COMMIT: commit every N steps (default 5);
    EW_SLEEP: seconds per step (default 0.05); EW_LOG: directory for per-worker step logs;
    EW_KILL: ``<worker id>:<step>[,...]``: that worker SIGKILLs itself at the top of that step;
    EW_KILL_IN_SYNC: ``<worker id>``: that worker SIGKILLs itself in its second ``sync()``
    (i.e. while the world recovers from the first kill);
    EW_MARK: a file the killer of EW_KILL creates before it dies (then it waits 2.5 s, so that
    a discovery script that reads the file has been run); EW_CRASH: ``<worker id>,...`` exit
    at start; EW_PIDS: a directory where each worker writes ``pid.<id>`` (``<pid>.``).

Each worker appends the steps it completed to ``EW_LOG/worker.<id>`` (one line per step: the
step, the world size and the wall-clock time) and prints one JSON line at the end (with the cores
it runs on and the ``HORA_BOUND_CPUS`` it was given).
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np

import hora
from hora import elastic

WID = int(os.environ["HORA_ELASTIC_WORKER_ID"])
if os.environ.get("EW_PIDS"):
    _pid_file = os.path.join(os.environ["EW_PIDS"], f"pid.{WID}")
    with open(_pid_file + ".tmp", "w") as _f:
        _f.write(f"{os.getpid()}.")
    os.replace(_pid_file + ".tmp", _pid_file)
if str(WID) in os.environ.get("EW_CRASH", "").split(","):
    raise SystemExit(f"worker {WID} crashes at start (EW_CRASH)")
hora.init()
STEPS = int(os.environ.get("EW_STEPS", "40"))
COMMIT = int(os.environ.get("EW_COMMIT", "5"))
SLEEP = float(os.environ.get("EW_SLEEP", "0.05"))
LOG = os.environ.get("EW_LOG")
KILLS = {int(w): int(s) for w, _, s in (entry.partition(":") for entry in
                                         os.environ.get("EW_KILL", "").split(",") if entry)}
KILL_IN_SYNC = int(os.environ.get("EW_KILL_IN_SYNC", "-1"))


class State(elastic.ObjectState):
    syncs = 0

    def sync(self) -> None:
        State.syncs += 1
        if WID == KILL_IN_SYNC and State.syncs == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        super().sync()


state = State(hora.broadcast_object, hora.rank, step=0, samples=0, w=np.zeros(8), sizes=[])


def log_step(step: int) -> None:
    if LOG:
        with open(os.path.join(LOG, f"worker.{WID}"), "a") as f:
            f.write(f"{step} {hora.size()} {time.time():.3f}\n")


@elastic.run
def train(state: State) -> None:
    while state.step < STEPS:
        if KILLS.get(WID) == state.step + 1:
            if os.environ.get("EW_MARK"):
                open(os.environ["EW_MARK"], "w").close()
                time.sleep(2.5)  # discovery runs every second
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.linspace(0.0, 1.0, 8) * (hora.rank() + 1) + state.step
        grad = hora.allreduce(state.w - x, op=hora.Average, name="grad")
        state.w = state.w - 0.1 * grad
        state.samples += 4 * hora.size()
        state.step += 1
        log_step(state.step)
        if not state.sizes or state.sizes[-1] != hora.size():
            state.sizes.append(hora.size())
        time.sleep(SLEEP)
        if state.step % COMMIT == 0:
            state.commit()


train(state)
print(json.dumps({"wid": WID, "rank": hora.rank(), "size": hora.size(), "step": state.step,
                  "samples": state.samples, "w": state.w.tolist(), "sizes": state.sizes,
                  "cpus": sorted(os.sched_getaffinity(0)),
                  "bound": os.environ.get("HORA_BOUND_CPUS")}),
      flush=True)
