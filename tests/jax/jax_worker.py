"""Runs one group of cases inside a real `hora run` job: ``python jax_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``; each
``fn(hvd)`` asserts on its own rank. Every rank prints ``CASE <id> OK``; on the first failure it
prints ``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once.
"""

from __future__ import annotations

import importlib
import sys

import jax_case_ids
from _case_runner import run_cases

import hora.jax as hvd


def main(group: str) -> None:
    module = importlib.import_module(group)
    module.init(hvd)
    cases = module.cases()
    want = jax_case_ids.ids(group)
    got = [case_id for case_id, _ in cases]
    assert got == want, f"jax_case_ids.ids({group!r}) is out of date: {got} != {want}"
    run_cases(hvd, cases)


if __name__ == "__main__":
    main(sys.argv[1])
