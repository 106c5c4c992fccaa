"""Start-up of a 2-rank job: ``RayExecutor.start()`` to the first allreduce done, against
``hora run -np 2`` of an equivalent script (process start to its first allreduce done).

    .venv/bin/python tests/ray/startup_bench.py --rounds 5

Rounds alternate (hora run, Ray, hora run, Ray, ...) so that both see the same machine load.
``ray.init()`` is not counted: a Ray driver connects to a running cluster (here: one local Ray
started once, before the rounds). Ray prestarts idle worker processes when the driver connects,
so the first executor's actors start in ~0.1 s; once those are used, each new executor waits
for new worker processes (a Python that imports Ray): both cases are printed. Used by
tests/ray/test_ray_startup.py and for the numbers in docs/ray.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """\
import time
import numpy as np
import hora
hora.init()
hora.allreduce(np.ones(4), name="first")
print("FIRST_ALLREDUCE_DONE", repr(time.time()), flush=True)
hora.shutdown()
"""


def first_allreduce() -> float:
    """The worker side: init, one allreduce, the wall-clock time it completed."""
    import numpy as np

    import hora

    hora.init()
    hora.allreduce(np.ones(4), name="first")
    return time.time()


def hora_run_seconds(np_: int = 2, timeout: float = 60.0) -> float:
    """Seconds from starting ``hora run -np N python script.py`` to the last rank's first
    allreduce done."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "first_allreduce.py"
        script.write_text(SCRIPT)
        start = time.time()
        out = subprocess.run([sys.executable, "-m", "hora.runner", "run", "-np", str(np_),
                              sys.executable, str(script)], capture_output=True, text=True,
                             timeout=timeout, check=True).stdout
    done = [float(line.split()[-1]) for line in out.splitlines()
            if "FIRST_ALLREDUCE_DONE" in line]
    if len(done) != np_:
        raise RuntimeError(f"expected {np_} FIRST_ALLREDUCE_DONE lines, got:\n{out}")
    return max(done) - start


def ray_seconds(np_: int = 2) -> float:
    """Seconds from ``RayExecutor.start()`` to the last rank's first allreduce done (Ray must
    be initialized)."""
    from hora.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=np_)
    start = time.time()
    executor.start()
    try:
        done = executor.run(first_allreduce)
    finally:
        executor.shutdown()
    return max(done) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    import ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(address="local", num_cpus=max(4, args.np), include_dashboard=False,
             log_to_driver=False)
    time.sleep(2.0)  # let Ray finish prestarting its idle workers
    try:
        hora_s, ray_s = [], []
        for i in range(args.rounds):
            hora_s.append(hora_run_seconds(args.np))
            ray_s.append(ray_seconds(args.np))
            kind = "prestarted workers" if i == 0 else "new worker processes"
            print(f"round {i + 1}: hora run {hora_s[-1]:.3f} s, RayExecutor {ray_s[-1]:.3f} s "
                  f"({kind})", flush=True)
    finally:
        ray.shutdown()
    h = statistics.median(hora_s)
    print(f"hora run -np {args.np}: median {h:.3f} s (min {min(hora_s):.3f})")
    print(f"RayExecutor, Ray's prestarted workers (round 1): {ray_s[0]:.3f} s = "
          f"{ray_s[0] / h:.2f} x hora run's median")
    if len(ray_s) > 1:
        cold = statistics.median(ray_s[1:])
        print(f"RayExecutor, new worker processes (rounds 2-{args.rounds}): median {cold:.3f} s "
              f"(min {min(ray_s[1:]):.3f}) = {cold / h:.2f} x hora run's median")


if __name__ == "__main__":
    main()
