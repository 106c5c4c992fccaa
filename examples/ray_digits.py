"""``torch_digits.py``'s training on Ray: the same script, its ranks as Ray actors.

``hora.ray.RayExecutor`` (Horovod's ``horovod.ray`` API) reserves one CPU per worker in a
placement group, starts one actor per worker, serves the rendezvous in this process and sets
each actor's rank, rendezvous address and job secret; then every worker runs
``torch_digits.main(...)``, which calls ``hvd.init()`` and trains exactly as under ``hora run``.
With the same arguments it reaches the same accuracy as
``hora run -np 2 python examples/torch_digits.py``.

    python examples/ray_digits.py                                # 2 workers, local Ray
    python examples/ray_digits.py --num-workers 4 -- --epochs 5  # args after -- go to training
    python examples/ray_digits.py --address auto                 # an existing Ray cluster

Needs ``ray``, ``torch`` and ``scikit-learn`` (on every node of a real cluster, with hora).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import ray

from hora.ray import RayExecutor

HERE = Path(__file__).resolve().parent


def train(examples_dir: str, argv: list[str]) -> float:
    """Runs on every worker: torch_digits.main(argv), its final validation accuracy."""
    if examples_dir not in sys.path:
        sys.path.insert(0, examples_dir)
    import torch_digits

    return float(torch_digits.main(argv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=2, help="ranks (Ray actors)")
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join ('auto', 'host:port'); default: start a "
                             "local Ray with one CPU per worker")
    parser.add_argument("train_args", nargs="*",
                        help="arguments for torch_digits.py (after --), e.g. --epochs 5")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.address is None:
        ray.init(num_cpus=args.num_workers * args.cpus_per_worker)
    else:
        ray.init(address=args.address)
    train_args = list(args.train_args)
    if "--no-progress" not in train_args:
        train_args.append("--no-progress")  # workers' output is relayed by Ray, line by line
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=args.num_workers,
                           cpus_per_worker=args.cpus_per_worker)
    started = time.perf_counter()
    executor.start()
    try:
        accuracies = executor.run(train, args=[str(HERE), train_args])
    finally:
        executor.shutdown()
    print(f"trained on {args.num_workers} Ray workers in {time.perf_counter() - started:.1f} s; "
          f"accuracy per rank: {', '.join(f'{100 * a:.1f}%' for a in accuracies)}")
    print(f"final validation accuracy {100 * accuracies[0]:.1f}% ({args.num_workers} ranks, "
          "Ray)", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
