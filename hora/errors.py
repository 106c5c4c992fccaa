"""Typed errors for hora, with Horovod's names as aliases.

Bottom layer: imports nothing from ``hora``. Every message says what went wrong, where
(rank, host, tensor) and what to do about it.
"""

from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)


class HoraError(Exception):
    """Root of every error hora raises on purpose."""


class NotInitializedError(HoraError, ValueError, RuntimeError):
    """An op or query was used before ``init()``.

    Horovod raises ``ValueError`` from topology queries and a ``RuntimeError`` from ops; this is
    both, so either ``except`` clause catches it.
    """

    def __init__(self, what: str = "") -> None:
        prefix = f"{what}: " if what else ""
        super().__init__(
            f"{prefix}Horovod has not been initialized; use hvd.init(). "
            "(hora: call hora.init() / hvd.init() first, once per process.)"
        )


class ConfigError(HoraError, ValueError):
    """A configuration knob (env var, CLI flag) has an unknown or malformed value."""


class HoraInternalError(HoraError, RuntimeError):
    """A collective failed: a peer died, ranks disagreed, or hora was shut down.

    Horovod's ``HorovodInternalError``; elastic training treats it as recoverable.
    """


HorovodInternalError = HoraInternalError


class MismatchError(HoraInternalError):
    """Ranks submitted the same tensor name with different dtype/shape/op/root/scale."""


class PeerLostError(HoraInternalError):
    """A peer rank closed its connection or stopped answering.

    ``peer`` is the lost peer's global rank when known. A transport raises this once per lost
    control connection and then stops watching that connection.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class HoraTimeoutError(HoraInternalError, TimeoutError):
    """A wait passed its deadline."""


class TransportError(HoraInternalError):
    """A transport could not connect, authenticate or move bytes."""


class AuthenticationError(TransportError):
    """A connection did not prove knowledge of the job secret."""


class RendezvousError(HoraError, RuntimeError):
    """Ranks could not find each other (store unreachable, timeout, bad environment)."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """The rendezvous did not complete before its deadline."""


class DeadlockError(HoraInternalError):
    """Every rank was blocked in a wait and none of their ops could complete (hora-only): the
    message names each rank's op and the ranks that never submitted it."""


class ShutdownError(HoraInternalError):
    """The engine was shut down while the op was pending."""


def copy_error(error: _E, message: str | None = None) -> _E:
    """A copy of ``error`` to raise once more (every op's handle raises an object of its own):
    the same type and attributes (``PeerLostError.peer``, ``RankFailedError.rank``, ...) and
    ``__cause__``; ``message`` (if given) replaces its text. Never calls ``__init__``, so a
    class whose constructor takes other arguments copies alike."""
    cls = type(error)
    args = error.args if message is None else (message, *error.args[1:])
    new = cls.__new__(cls, *args)
    new.args = args
    new.__dict__.update(vars(error))
    new.__cause__ = error.__cause__
    new.__suppress_context__ = error.__suppress_context__
    return new


def op_error(error: _E, op: str) -> _E:
    """``error`` for the handle of op ``op`` (:func:`copy_error`); an :func:`internal_error`
    names the op in front of its text."""
    if getattr(error, "names_op", False):
        named = copy_error(error, f"op '{op}' failed: {error}")
        named.names_op = False  # type: ignore[attr-defined]  # (named once)
        return named
    return copy_error(error)


def internal_error(where: str, exc: BaseException) -> HoraInternalError:
    """The error every op of this rank fails with when ``exc`` escaped one of hora's own
    threads (``where``: which), a bug in hora: it names ``exc`` (its ``__cause__``, so the
    traceback shows where it was raised), and each op's copy (:func:`op_error`) names the op.
    """
    error = HoraInternalError(
        f"{where} failed: {exc!r}. This is a bug in hora, not in the training script: every "
        "op of this rank fails and the job is aborted. HINT: report it with this rank's log "
        "(hora logged the traceback).")
    error.__cause__ = exc
    error.names_op = True  # type: ignore[attr-defined]
    return error


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic: the set of hosts changed; Horovod's exception of the same name."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class DiscoveryError(HoraError, RuntimeError):
    """Elastic: the host discovery script failed, timed out, or printed a line that is not
    ``<hostname>[:<slots>]`` (the message names the script, the line and the fix)."""


class ElasticError(HoraError, RuntimeError):
    """Elastic: the job cannot go on (too few workers within the elastic timeout, the reset
    limit was reached, every host is blacklisted, or this worker was removed); the message says
    what was waited for and what to change."""


class ProtocolError(HoraInternalError):
    """A control message could not be parsed (corrupt, or not from hora)."""


class FrameError(HoraError, ValueError):
    """A rendezvous-store frame or request payload that does not follow the store's wire
    format."""


class TimelineFormatError(HoraError, ValueError):
    """The file is not a Chrome-trace JSON array (or object with ``traceEvents``)."""


class HostCheckError(HoraError):
    """One or more remote hosts cannot run ranks (unreachable, no Python, cannot connect back)."""


class RankFailedError(HoraError, RuntimeError):
    """``hora.run``: a rank ended without a result: killed, ``os._exit``, ``sys.exit`` in
    ``func``, could not start, or raised an exception that could not be pickled back.

    Attributes:
        rank: the rank, when known.
        exit_status: the rank's (or the job's) exit status, when known: the exit code, or 128 + N
            for a death by signal N.
    """

    def __init__(self, message: str, rank: int | None = None,
                 exit_status: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_status = exit_status


__all__ = [
    "AuthenticationError",
    "ConfigError",
    "DeadlockError",
    "DiscoveryError",
    "ElasticError",
    "FrameError",
    "HostCheckError",
    "HoraError",
    "HoraInternalError",
    "HoraTimeoutError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "MismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ProtocolError",
    "RankFailedError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "ShutdownError",
    "TimelineFormatError",
    "TransportError",
    "copy_error",
    "internal_error",
    "op_error",
]
