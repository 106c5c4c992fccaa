"""Runs one group of cases inside a real `hora run` job: ``python torch_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``. Each rank
runs every case in order and prints ``CASE <id> OK``; on the first failure it prints
``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once, so the other ranks fail fast
instead of waiting for it.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import torch
from torch_factory import TorchFactory

import hora.torch as hvd


def main(group: str) -> None:
    torch.set_num_threads(1)
    module = importlib.import_module(group)
    module.init(hvd)
    factory = TorchFactory()
    for case_id, fn in module.cases():
        try:
            fn(hvd, factory)
        except BaseException as exc:  # noqa: BLE001 - report, then leave at once
            detail = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
            print(f"CASE {case_id} FAIL {detail}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print(f"CASE {case_id} OK", flush=True)
    hvd.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
