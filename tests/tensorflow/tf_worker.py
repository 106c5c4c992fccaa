"""Runs one group of cases inside a real `hora run` job: ``python tf_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``; each
``fn(hvd)`` asserts on its own rank. Each rank prints ``CASE <id> OK``, or on the first failure
``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once, so the others fail fast.
"""

from __future__ import annotations

import importlib
import sys

import tensorflow as tf
from _case_runner import run_cases

import hora.tensorflow as hvd


def main(group: str) -> None:
    tf.config.threading.set_inter_op_parallelism_threads(1)
    module = importlib.import_module(group)
    module.init(hvd)
    run_cases(hvd, module.cases())


if __name__ == "__main__":
    main(sys.argv[1])
