"""The rank side of :func:`hora.run` (``python -m hora.runner.run_func``), and the store protocol
both sides share.

Runner layer: imports only base and rendezvous modules (the function it runs may of course call
``hora.init()`` and anything else).

:func:`hora.runner.api.run` serves a private, authenticated key-value store
(:class:`hora.rendezvous.kvstore.KVStoreServer`) for the life of one call and starts every rank
with this module as its command. The store's address and secret reach the rank in two
environment variables (:data:`STORE_VAR`, :data:`SECRET_VAR`; over ssh's stdin for a rank on
another host, never on a command line), which this module removes from ``os.environ`` before
the function runs. A rank then:

1. fetches the pickled ``(func, args, kwargs)`` (:data:`FUNC_KEY`);
2. calls ``func(*args, **kwargs)``;
3. stores one record under ``rank.<r>`` (:func:`record_key`): a JSON header and, in chunks,
   the pickled return value (``kind`` ``"result"``), or the exception (``"error"``: its type
   name, message, traceback text, the ``phase`` it happened in (``"load"``: unpickling
   ``func``, ``"call"``, ``"result"``: pickling the return value) and, when it survives a
   pickle round trip, the pickled exception), or the status of a ``sys.exit`` inside ``func``
   (``"exit"``);
4. exits 0 after a result, 1 after an exception (the launcher then stops the other ranks, as
   for any failed rank), or with the ``sys.exit`` status.

Values are pickled with cloudpickle when it is installed (closures, lambdas, functions defined
in ``__main__``), else with :mod:`pickle`. Large values are split into chunks below the store's
frame limit.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hora.config import load
from hora.rendezvous.store_client import KVStoreClient

STORE_VAR = "_HORA_RUN_STORE"
"""``host:port`` of the store of one :func:`hora.run` call (not ``HORA_*``: not a knob)."""

SECRET_VAR = "_HORA_RUN_SECRET"
"""The hex secret of that store. Environment only: never argv, never printed."""

SCOPE = "hora.run"
FUNC_KEY = "func"
FAILURE_COUNTER = "failures"
"""A counter giving every stored exception / ``sys.exit`` record its order (``seq``)."""
CHUNK_BYTES = 32 * 1024 * 1024
"""Largest value stored under one key (the store's frame limit is 64 MiB)."""


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with cloudpickle when available (by value where needed), else pickle."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return data


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` made (cloudpickle's output loads with plain pickle)."""
    return pickle.loads(data)  # noqa: S301 (from the job's own authenticated store)


def record_key(rank: int) -> str:
    """The key of rank ``rank``'s outcome record."""
    return f"rank.{rank}"


def put_blob(client: KVStoreClient, key: str, data: bytes, header: dict[str, Any]) -> None:
    """Store ``data`` in chunks under ``key.<i>``, then ``header`` (JSON, with ``chunks``) under
    ``key``: a reader that sees the header finds every chunk."""
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        client.set(SCOPE, f"{key}.{i}", chunk)
    client.set(SCOPE, key, json.dumps({**header, "chunks": len(chunks)}).encode())


def get_header(client: KVStoreClient, key: str, timeout: float) -> dict[str, Any]:
    """The JSON header under ``key``, waiting up to ``timeout`` s for it.

    Raises:
        RendezvousTimeoutError: it did not appear in time.
        ValueError: it is not a JSON object.
    """
    header = json.loads(client.get(SCOPE, key, timeout))
    if not isinstance(header, dict):
        raise ValueError(f"hora.run: malformed record {key!r} in the store")
    return header


def get_blob(client: KVStoreClient, key: str, header: dict[str, Any]) -> bytes:
    """The data :func:`put_blob` stored under ``key`` (whose header is ``header``)."""
    return b"".join(client.get(SCOPE, f"{key}.{i}", 0.0) for i in range(int(header["chunks"])))


def exit_code(exc: SystemExit) -> int:
    """The process status ``raise SystemExit(code)`` gives: None -> 0, an int, else 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    return 1


def error_record(exc: BaseException, rank: int) -> tuple[dict[str, Any], bytes]:
    """The header and payload describing ``exc`` raised in rank ``rank``.

    The payload is the pickled exception, or empty when it does not survive a pickle round trip
    (the caller then raises a RuntimeError with the type name and message).
    """
    kind = type(exc)
    tb = exc.__traceback__
    text = "".join(traceback.format_exception(kind, exc, tb))
    header: dict[str, Any] = {"kind": "error", "type": f"{kind.__module__}.{kind.__qualname__}",
                              "message": _safe_str(exc), "traceback": text, "rank": rank}
    try:
        payload = dumps(exc)
        loads(payload)
    except Exception as why:  # noqa: BLE001 (any failure means: send the text only)
        header["unpicklable"] = f"{type(why).__name__}: {_safe_str(why)}"
        payload = b""
    return header, payload


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 (a broken __str__ must not hide the error)
        return f"<{type(exc).__name__}: str() failed>"


def _take_store() -> tuple[str, int, bytes]:
    """The store's address and secret, removed from ``os.environ`` (``func`` and the processes
    it starts do not see them)."""
    where = os.environ.pop(STORE_VAR, "")
    secret = os.environ.pop(SECRET_VAR, "")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not secret:
        raise SystemExit("hora.runner.run_func: this module is the rank side of hora.run(); "
                         f"it needs {STORE_VAR} and {SECRET_VAR}, which hora.run() sets.")
    return host.strip("[]"), int(port), bytes.fromhex(secret)


def _report(client: KVStoreClient, rank: int, exc: BaseException, phase: str) -> None:
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    header, payload = error_record(exc, rank)
    header["phase"] = phase
    header["seq"] = client.add(SCOPE, FAILURE_COUNTER, 1)
    put_blob(client, record_key(rank), payload, header)


def _rank() -> int:
    """This process's rank now: an elastic worker's changes at each reset (``init()`` rewrites
    ``HORA_RANK``), so it is read when a record is stored."""
    return int(os.environ.get("HORA_RANK", "0"))


def main() -> int:
    """Run this rank's share of a :func:`hora.run` call; returns the exit status."""
    host, port, secret = _take_store()
    rank = _rank()
    elastic = "HORA_ELASTIC_WORKER_ID" in os.environ
    timeout = load(strict=False).start_timeout
    with KVStoreClient(host, port, secret, timeout=timeout) as client:
        try:
            header = get_header(client, FUNC_KEY, timeout)
            func: Callable[..., Any]
            func, args, kwargs = loads(get_blob(client, FUNC_KEY, header))
        except Exception as exc:  # noqa: BLE001 (e.g. func's module cannot be imported here)
            _report(client, rank, exc, "load")
            return 1
        try:
            value = func(*args, **kwargs)
        except SystemExit as exc:
            if elastic and exit_code(exc) == 0:
                raise  # an elastic worker told to leave (removed, or training finished elsewhere)
            rank = _rank()
            put_blob(client, record_key(rank), b"", {
                "kind": "exit", "code": exit_code(exc), "rank": rank,
                "seq": client.add(SCOPE, FAILURE_COUNTER, 1)})
            raise
        except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt too: report, exit 1)
            rank = _rank()
            tb = exc.__traceback__
            _report(client, rank, exc.with_traceback(tb.tb_next if tb is not None else None),
                    "call")
            return 1
        rank = _rank()
        try:
            data = dumps(value)
        except Exception as exc:  # noqa: BLE001
            try:
                raise TypeError(f"rank {rank}'s return value of type {type(value).__name__} "
                                f"cannot be pickled: {exc}") from exc
            except TypeError as wrapped:
                _report(client, rank, wrapped, "result")
            return 1
        put_blob(client, record_key(rank), data, {"kind": "result"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
