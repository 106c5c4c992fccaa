"""Horovod's TensorFlow exception types for hora's failures, eagerly and in TF1 sessions.

Horovod's TensorFlow ops fail with ``tf.errors`` classes, which its users and tests catch:

=====================================  ========================================================
failure                                raised as
=====================================  ========================================================
ranks disagree on a collective         :class:`MismatchOpError`: ``tf.errors.
(dtype, shape, op, root, ...)          FailedPreconditionError`` and hora's ``MismatchError``
a bad argument found when the op runs  :class:`InvalidArgumentOpError`: ``tf.errors.
(alltoall splits, ...)                 InvalidArgumentError`` and ``ValueError``
=====================================  ========================================================

Eagerly, :func:`translated` converts the exception a host call raised. In a graph a
collective is a ``tf.numpy_function``, whose Python exceptions TensorFlow maps by type only
(``ValueError`` -> ``InvalidArgumentError``, anything else -> ``UnknownError``); a TF1
``Session`` (:func:`install_session_translation`) re-raises an ``UnknownError`` whose message
names hora's ``MismatchError`` as :class:`MismatchOpError`, with TensorFlow's message. Inside
``tf.function`` a mismatch stays an ``UnknownError`` carrying hora's message (``hvd.elastic.run``
recognises it).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import tensorflow as tf

from hora.errors import HoraError, MismatchError


class MismatchOpError(tf.errors.FailedPreconditionError, MismatchError):
    """Ranks disagree on a collective: Horovod's ``FailedPreconditionError``, also catchable
    as hora's :class:`~hora.errors.MismatchError` (``HorovodInternalError``)."""

    def __init__(self, message: str, node_def: Any = None, op: Any = None) -> None:
        tf.errors.FailedPreconditionError.__init__(self, node_def, op, message)

    def __reduce__(self) -> Any:
        return type(self), (self.message, self.node_def, self.op)


class InvalidArgumentOpError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's argument is invalid (found when it runs): Horovod's
    ``InvalidArgumentError``, also catchable as ``ValueError``."""

    def __init__(self, message: str, node_def: Any = None, op: Any = None) -> None:
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message)

    def __reduce__(self) -> Any:
        return type(self), (self.message, self.node_def, self.op)


def translated(exc: BaseException) -> BaseException | None:
    """The ``tf.errors`` form of an exception a host call raised eagerly, or None to keep it."""
    if isinstance(exc, tf.errors.OpError):
        return None
    if isinstance(exc, MismatchError):
        return MismatchOpError(str(exc))
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, HoraError):
        return InvalidArgumentOpError(str(exc))
    return None


# "hora.errors.MismatchError: ..." in the formatted traceback of a py_func error, or the bare
# "MismatchError: ..." line TensorFlow puts after "Detected at node ...".
_MISMATCH = re.compile(r"(?:\bhora\.errors\.|^)MismatchError\b", re.M)


def _session_error(exc: tf.errors.OpError) -> tf.errors.OpError | None:
    if isinstance(exc, tf.errors.UnknownError) and _MISMATCH.search(str(exc.message or "")):
        return MismatchOpError(exc.message, exc.node_def, exc.op)
    return None


def install_session_translation() -> None:
    """Make TF1 sessions raise :class:`MismatchOpError` for a mismatched collective (see the
    module docstring). Idempotent; wraps ``BaseSession._do_call``, the one place a session's
    run raises, and does nothing if this TensorFlow has no such method."""
    from tensorflow.python.client import session

    original = getattr(session.BaseSession, "_do_call", None)
    if original is None or getattr(original, "_hora_translates", False):
        return

    @functools.wraps(original)
    def _do_call(self: Any, fn: Any, *args: Any) -> Any:
        try:
            return original(self, fn, *args)
        except tf.errors.OpError as exc:
            converted = _session_error(exc)
            if converted is None:
                raise
            raise converted from None

    _do_call._hora_translates = True  # type: ignore[attr-defined]
    session.BaseSession._do_call = _do_call


__all__ = ["InvalidArgumentOpError", "MismatchOpError", "install_session_translation",
           "translated"]
