"""Runs one group of cases inside a real `hora run` job: ``python tf_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``; each
``fn(hvd)`` asserts on its own rank. Each rank prints ``CASE <id> OK``, or on the first failure
``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once, so the others fail fast.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import tensorflow as tf

import hora.tensorflow as hvd


def main(group: str) -> None:
    tf.config.threading.set_inter_op_parallelism_threads(1)
    module = importlib.import_module(group)
    module.init(hvd)
    for case_id, fn in module.cases():
        try:
            fn(hvd)
        except BaseException as exc:  # noqa: BLE001 - report, then leave at once
            detail = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:2000]
            print(f"CASE {case_id} FAIL {detail}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print(f"CASE {case_id} OK", flush=True)
    hvd.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
