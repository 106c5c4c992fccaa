"""Elastic recovery on Ray against ``hora run``: how long a SIGKILLed worker stops training.

    python benchmarks/ray_elastic.py --rounds 4

The same function, a PyTorch MLP trained with ``hvd.elastic.run`` + ``TorchState`` (commit
every 5 steps), runs as a 3-worker elastic job (min 2, max 3) in two ways, alternating rounds
(ABAB) so that both see the same machine load:

* ``hora.run``: ``hora.run(train, np=3, min_np=2, max_np=3)``, workers are processes;
* ``ray``: ``ElasticRayExecutor`` (min_num_proc=2, max_num_proc=3, num_proc=3) on a local Ray
  with 3 CPUs (``ray.init`` once, not counted), workers are Ray actors.

Worker 2 SIGKILLs itself at step 30. Measured from time stamps the workers append to a file
(``time.time()``, one host, one clock): the kill -> the survivors' next completed step (the
slower survivor). Both run hora's one elastic driver; what differs is how a death is seen (the
process's exit vs Ray's actor death) and how workers start. Prints the medians and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def train(log: str, kill_wid: int, kill_at: int, steps: int) -> int:
    """The elastic job's function (both launchers)."""
    import signal

    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    hvd.init()
    wid = int(os.environ["HORA_ELASTIC_WORKER_ID"])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def mark(what: str) -> None:
        with open(log, "a") as f:
            f.write(json.dumps({"what": what, "wid": wid, "t": time.time(),
                                "step": state.step}) + "\n")

    @hvd.elastic.run
    def loop(state: Any) -> None:
        while state.step < steps:
            if wid == kill_wid and state.step == kill_at:
                mark("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            mark("step")
            time.sleep(0.02)
            if state.step % 5 == 0:
                state.commit()

    loop(state)
    return state.step


def recovery(log: Path) -> float:
    """Seconds from the kill to the slower survivor's next completed step."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kill = next(r["t"] for r in records if r["what"] == "kill")
    after: dict[int, float] = {}
    for r in records:
        if r["what"] == "step" and r["t"] > kill and r["wid"] != 2:
            after.setdefault(r["wid"], r["t"])
    if len(after) < 2:
        raise RuntimeError(f"the survivors did not both step after the kill: {after}")
    return max(after.values()) - kill


def one_round(how: str, tmp: Path, n: int) -> float:
    log = tmp / f"{how}.{n}.jsonl"
    fn = functools.partial(train, str(log), 2, 30, 90)
    if how == "hora.run":
        import hora

        hora.run(fn, np=3, min_np=2, max_np=3)
    else:
        from hora.ray import ElasticRayExecutor

        settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                      num_proc=3, elastic_timeout=60)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        executor.start()
        executor.run(fn)
    return recovery(log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each (alternating)")
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    times: dict[str, list[float]] = {"hora.run": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            for how in ("hora.run", "ray"):
                seconds = one_round(how, Path(tmp), n)
                times[how].append(seconds)
                print(f"round {n + 1}: {how:8s} kill -> next step {1000 * seconds:7.1f} ms",
                      flush=True)
    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    for how, values in times.items():
        print(f"{how:8s} median {1000 * med[how]:7.1f} ms  (min {1000 * min(values):.1f}, "
              f"max {1000 * max(values):.1f})")
    print(f"ray / hora.run: {med['ray'] / med['hora.run']:.2f}x  (load: "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
