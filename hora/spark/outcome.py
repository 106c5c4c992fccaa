"""What a :func:`hora.spark.run` job left in the driver's store: the results in rank order, or
the root cause's error; and the driver-side reader of relayed rank output.

Launcher layer. The records are those of :func:`hora.run`'s protocol
(:mod:`hora.runner.run_func`: ``rank.<r>`` holds a rank's pickled result, exception or
``sys.exit`` status) plus the tasks' exit reports (:func:`hora.spark.task.exit_key`).
"""

from __future__ import annotations

import json
import re
import threading
from typing import IO, Any

from hora.errors import HoraError, RankFailedError, RendezvousTimeoutError
from hora.rendezvous.store_client import KVStoreClient
from hora.runner import run_func as proto
from hora.runner.api import raise_stored_error, read_records
from hora.runner.failures import WorkerFailure
from hora.spark.task import OUT_COUNTER, SCOPE, exit_key, out_key

WHO = "hora.spark.run"


class SparkJobError(HoraError, RuntimeError):
    """The Spark job failed without any rank reporting why: a task could not import hora or
    reach the driver, an executor was lost, Spark refused the barrier stage. The message
    quotes Spark's reason; ``__cause__`` is Spark's own exception."""


def read_exits(client: KVStoreClient, np: int) -> dict[int, dict[str, Any]]:
    """The tasks' exit reports present, by rank."""
    keys = [exit_key(r) for r in range(np)]
    absent = set(client.missing(SCOPE, keys))
    return {r: json.loads(client.get(SCOPE, key, 0.0)) for r, key in enumerate(keys)
            if key not in absent}


def _failure(report: dict[str, Any]) -> WorkerFailure:
    return WorkerFailure(rank=int(report["rank"]), size=int(report["size"]),
                         hostname=str(report["host"]), returncode=int(report["returncode"]),
                         stderr_tail=tuple(report.get("tail", ())),
                         start_error=str(report.get("start_error", "")))


def _raise_first_failure(client: KVStoreClient, np: int) -> None:
    """Raise the root cause when a rank failed: a rank that died without a record (signal,
    ``os._exit``, could not start) when it was the first to fail, else the earliest stored
    exception or ``sys.exit`` (a rank stores its exception before it exits, so the errors it
    causes in its peers come later)."""
    records = read_records(client, np)
    failed = {r: rec for r, rec in records.items() if rec.get("kind") in ("error", "exit")}
    reports = [rep for rep in read_exits(client, np).values() if "seq" in rep]
    first = min(reports, key=lambda rep: int(rep["seq"])) if reports else None
    if first is not None and int(first["rank"]) not in failed:
        failure = _failure(first)
        suffix = "" if failure.start_error else " without returning a result"
        tail = [line for line in failure.stderr_tail[-3:] if line.strip()]
        detail = ("; its last stderr lines: " + " | ".join(tail)) if tail else ""
        raise RankFailedError(f"{WHO}: {failure.describe()}{suffix}{detail}",
                              rank=failure.rank, exit_status=failure.exit_status)
    if failed:
        earliest = min(failed.values(), key=lambda rec: int(rec.get("seq", 0)))
        if earliest.get("kind") == "error":
            raise_stored_error(client, earliest, np, WHO, "on the executors")
        rank, code = int(earliest["rank"]), int(earliest.get("code", 0))
        raise RankFailedError(f"{WHO}: rank {rank} of {np} called sys.exit({code}) in fn "
                              f"instead of returning (exit status {code})", rank=rank,
                              exit_status=code)


_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")


def spark_reason(error: BaseException) -> str:
    """A short reason from a Spark (Py4J) error: the Python exception a task raised when there is
    one, else the first line that says why the job was aborted or cancelled."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines()]
    python = [line for line in lines if _PY_ERROR.match(line)]
    if python:
        return python[-1]
    aborted = [line for line in lines if "aborted" in line or "cancelled" in line
               or "SparkException" in line]
    return (aborted or [line for line in lines if line] or [type(error).__name__])[0][:500]


def results_or_raise(client: KVStoreClient, np: int, spark_error: BaseException | None
                     ) -> list[Any]:
    """The results of the ranks in rank order, or the job's root-cause error.

    Raises:
        Exception: a rank's own exception (its type when it unpickles here), with a
            :class:`RemoteTraceback` as ``__cause__``.
        RankFailedError: a rank ended without a result (signal, ``os._exit``, ``sys.exit``,
            could not start).
        SparkJobError: Spark failed the job and no rank said why.
    """
    _raise_first_failure(client, np)
    if spark_error is not None:
        reason = spark_reason(spark_error)
        hint = ""
        if "No module named 'hora" in str(spark_error):
            hint = (" HINT: the executors' Python cannot import hora: install it there, or point "
                    "Spark at a Python that has it (spark.pyspark.python / PYSPARK_PYTHON).")
        raise SparkJobError(f"{WHO}: the Spark job failed: {reason}{hint}") from spark_error
    records = read_records(client, np)
    results: list[Any] = []
    for rank in range(np):
        record = records.get(rank, {})
        if record.get("kind") != "result":
            raise RankFailedError(f"{WHO}: rank {rank} of {np} ended without returning a "
                                  "result (os._exit(0)?)", rank=rank, exit_status=0)
        results.append(proto.loads(proto.get_blob(client, proto.record_key(rank), record)))
    return results


class OutputReader(threading.Thread):
    """Copies the rank output the tasks relay through the store (``out.<n>`` records) to the
    driver's ``stdout`` / ``stderr`` streams, in the order the tasks sent it.

    Call :meth:`finish` once the job has ended: the reader then copies what is left and stops.
    """

    def __init__(self, client: KVStoreClient, stdout: IO[str] | None,
                 stderr: IO[str] | None) -> None:
        super().__init__(name="hora-spark-output", daemon=True)
        self._client = client
        self._streams = {b"o"[0]: stdout, b"e"[0]: stderr}
        self._done = threading.Event()

    def finish(self, timeout: float = 10.0) -> None:
        """Copy what is left, stop, and close the reader's store connection."""
        self._done.set()
        self.join(timeout)
        self._client.close()

    def run(self) -> None:
        seq = 1
        try:
            while True:
                try:
                    data = self._client.get(SCOPE, out_key(seq), 0.2)
                except RendezvousTimeoutError:
                    if not self._done.is_set():
                        continue
                    if seq > self._client.add(SCOPE, OUT_COUNTER, 0):
                        return
                    try:  # numbered but not written yet, or never (its task was killed)
                        data = self._client.get(SCOPE, out_key(seq), 1.0)
                    except RendezvousTimeoutError:
                        seq += 1
                        continue
                self._client.delete(SCOPE, out_key(seq))
                seq += 1
                stream = self._streams.get(data[0]) if data else None
                if stream is not None:
                    stream.write(data[1:].decode("utf-8", "replace"))
                    stream.flush()
        except (HoraError, OSError, ValueError):
            return  # the store closed, or the stream did


__all__ = ["OutputReader", "SparkJobError", "read_exits", "results_or_raise",
           "spark_reason"]
