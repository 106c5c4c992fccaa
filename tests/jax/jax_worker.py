"""Runs one group of cases inside a real `hora run` job: ``python jax_worker.py GROUP``.

GROUP is a module of this directory with ``init(hvd)`` and ``cases() -> [(id, fn)]``; each
``fn(hvd)`` asserts on its own rank. Every rank prints ``CASE <id> OK``; on the first failure it
prints ``CASE <id> FAIL <error>`` (traceback on stderr) and exits at once.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import jax_case_ids

import hora.jax as hvd


def main(group: str) -> None:
    module = importlib.import_module(group)
    module.init(hvd)
    cases = module.cases()
    want = jax_case_ids.ids(group)
    got = [case_id for case_id, _ in cases]
    assert got == want, f"jax_case_ids.ids({group!r}) is out of date: {got} != {want}"
    for case_id, fn in cases:
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
