"""The rank side of a case job (tests/_case_jobs.py runs the job): run every case in order,
print ``CASE <id> OK``, and on the first failure ``CASE <id> FAIL <error>`` (traceback on
stderr) and leave at once, so the other ranks fail fast instead of waiting. Standard library
only: it runs inside every rank."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any


def run_cases(hvd: Any, cases: Iterable[tuple[str, Callable[..., Any]]], *args: Any) -> None:
    """``fn(hvd, *args)`` for every ``(case_id, fn)``, then ``hvd.shutdown()`` and ``DONE``."""
    for case_id, fn in cases:
        try:
            fn(hvd, *args)
        except BaseException as exc:  # noqa: BLE001 - report, then leave at once
            detail = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:2000]
            print(f"CASE {case_id} FAIL {detail}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print(f"CASE {case_id} OK", flush=True)
    hvd.shutdown()
    print("DONE", flush=True)
