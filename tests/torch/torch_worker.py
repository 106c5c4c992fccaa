"""Runs one group of cases inside a real `hora run` job: ``python torch_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``. Each rank
runs every case in order and prints ``CASE <id> OK``; on the first failure it prints
``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once, so the other ranks fail fast
instead of waiting for it.
"""

from __future__ import annotations

import importlib
import sys

import torch
from _case_runner import run_cases
from torch_factory import TorchFactory

import hora.torch as hvd


def main(group: str) -> None:
    torch.set_num_threads(1)
    module = importlib.import_module(group)
    module.init(hvd)
    factory = TorchFactory()
    run_cases(hvd, module.cases(), factory)


if __name__ == "__main__":
    main(sys.argv[1])
