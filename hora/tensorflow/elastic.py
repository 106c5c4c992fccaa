"""Elastic training with TensorFlow 2 (Horovod's ``horovod.tensorflow.elastic``, ``hvd.elastic``).

::

    import hora.tensorflow as hvd
    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                  # steps with DistributedGradientTape, state.commit() every few
        ...

    train(state)

Launch with ``hora run -np 4 --min-np 2 python train.py``. The loop is :mod:`hora.elastic`'s
(:func:`hora.elastic.run_fn`); :func:`run` only adds, as Horovod's TensorFlow variant does, the
conversion of a failed collective inside a graph: there a collective is a
``tf.numpy_function`` op (:mod:`hora.tensorflow.bridge`), and the
:class:`~hora.errors.HorovodInternalError` it raised reaches the caller as a
``tf.errors.OpError`` (``UnknownError``) whose message carries the hora error (``hora.errors.
PeerLostError: ...``). :func:`run` turns that back into the hora error, so the loop rolls back
and rebuilds the world instead of ending the worker.

States (every other keyword becomes plain :class:`~hora.elastic.ObjectState` data):

* :class:`TensorFlowKerasState`: a Keras model's weights (``model.weights``: trainable and
  non-trainable, e.g. BatchNormalization statistics; not metric state or RNG seeds) and its
  optimizer's variables (iterations, learning rate, slots);
* :class:`TensorFlowState`: a list of variables, eager, or of a ``tf.compat.v1`` graph run
  by a session (``session=sess``: read, assigned and broadcast by ops run in the session,
  :mod:`hora.tensorflow.v1_state`).

A commit snapshots each variable with ``tf.identity`` (TensorFlow's tensors are values: the next
update of the variable writes a new buffer instead of the snapshot's, so a commit costs about
nothing and a restore never aliases the snapshot); ``sync()`` broadcasts the variables from rank
0 (:func:`~hora.tensorflow.functions.broadcast_variables`, after checking that every rank holds
the same list of shapes and dtypes) and takes the result as the new snapshot. With a session,
a commit holds numpy copies read in the session.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import tensorflow as tf

from hora import errors as _errors
from hora._basics import rank
from hora._util.log import get_logger
from hora.elastic.state import ObjectState, State
from hora.elastic.worker import reset, run_fn
from hora.errors import HorovodInternalError
from hora.tensorflow.functions import allgather_object, broadcast_object, broadcast_variables
from hora.tensorflow.keras_flavor import build_optimizer
from hora.tensorflow.v1_state import SessionVariables, default_session

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# ---- failed collectives inside a graph ------------------------------------------------------

_INTERNAL = sorted((name for name, value in vars(_errors).items()
                    if isinstance(value, type) and issubclass(value, _errors.HoraInternalError)),
                   key=len, reverse=True)
# "hora.errors.PeerLostError: rank 1 ..." in the traceback part of a py_func error, or the
# unqualified "PeerLostError: ..." line TensorFlow puts after "Detected at node ...".
_NAMES = "|".join(_INTERNAL)
_QUALIFIED = re.compile(rf"\bhora\.errors\.({_NAMES})\b")
_BARE = re.compile(rf"^({_NAMES})\b(?=:|$)", re.M)


def _internal_error(exc: BaseException) -> HorovodInternalError | None:
    """The hora collective failure ``exc`` carries, or None.

    ``exc`` counts when it is a ``tf.errors.OpError`` whose message names a
    :class:`~hora.errors.HoraInternalError` (or a subclass: ``PeerLostError``,
    ``HoraTimeoutError``, ``MismatchError``, ...), which is how a collective that failed inside
    ``tf.function`` / Keras ``fit`` surfaces. Returns an instance of that class (so
    ``except HorovodInternalError`` and the narrower clauses both match) with the hora message;
    the caller chains the TensorFlow error to it.
    """
    if not isinstance(exc, tf.errors.OpError):
        return None
    text = str(exc.message or "")
    found = list(_QUALIFIED.finditer(text)) or list(_BARE.finditer(text))
    if not found:
        return None
    name, rest = found[-1].group(1), text[found[-1].end():]
    # the exception's text: up to the blank line that ends it in the formatted traceback
    message = rest[1:].split("\n\n")[0].strip() if rest.startswith(":") else ""
    cls = getattr(_errors, name)
    message = message or f"{name} inside a TensorFlow graph op"
    try:
        converted: HorovodInternalError = cls(message)
    except TypeError:  # a subclass with another constructor
        converted = HorovodInternalError(message)
    return converted


def _converting(func: F) -> F:
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            converted = _internal_error(exc)
            if converted is None:
                raise
            log.debug("a collective failed inside a TensorFlow graph (%s: %s)",
                      type(exc).__name__, converted)
            raise converted from exc
    return wrapper  # type: ignore[return-value]


def run(func: F) -> F:
    """Decorator: run ``func(state, *args, **kwargs)`` elastically (Horovod's
    ``hvd.elastic.run`` for TensorFlow).

    Before every attempt ``state.sync()`` gives every rank rank 0's committed state. When a
    collective fails (``HorovodInternalError``: a peer died), eagerly or inside a graph (a
    ``tf.errors.OpError`` naming a hora collective failure is converted, see
    :func:`_internal_error`; other TensorFlow errors propagate unchanged), ``state.restore()``
    rolls back to the last commit; when ``state.commit()`` finds that hosts changed
    (``HostsUpdatedInterrupt``), nothing is rolled back. Either way the world is rebuilt
    (``shutdown(); init()``), ``state.on_reset()`` runs the reset callbacks, and ``func`` is
    called again. ``func``'s first argument must be a ``hora.elastic.State``, else
    ``TypeError``. No collective may run between ``hvd.init()`` and the call of ``func``
    (workers that join later start from the top of the script).
    """
    return run_fn(_converting(func), reset)


# ---- variable snapshots ---------------------------------------------------------------------


def _eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"{what} needs eager execution (TensorFlow 2): create it and call "
                           "commit() / restore() / sync() outside tf.function (for the "
                           "variables of a tf.compat.v1 graph use TensorFlowState(variables, "
                           "session=sess)).")


def _unique(variables: Sequence[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _describe(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or "variable")


def _signature(variables: Sequence[Any]) -> list[tuple[str, tuple[int | None, ...]]]:
    return [(tf.as_dtype(v.dtype).base_dtype.name,
             tuple(None if d is None else int(d) for d in v.shape)) for v in variables]


class _Snapshot:
    """The committed values of a list of variables (``tf.identity`` of each: a value, not a
    view, so later updates of the variable never change it)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, tf.Tensor]] = []

    def save(self, variables: Sequence[Any]) -> None:
        self.saved = [(v, tf.identity(v)) for v in variables]

    def restore(self, variables: Sequence[Any], owner: str) -> None:
        for v, value in self.saved:
            v.assign(value)
        known = {id(v) for v, _ in self.saved}
        new = [_describe(v) for v in variables if id(v) not in known]
        if new:
            log.warning("%s.restore(): %d variable(s) were created after the last commit and "
                        "keep their current values: %s", owner, len(new), ", ".join(new[:5]))


def _sync_variables(variables: Sequence[Any], owner: str,
                    broadcast: Callable[[], None] | None = None) -> None:
    """Broadcast ``variables`` from rank 0 (eagerly, or by calling ``broadcast``) after
    checking that every rank holds the same list of dtypes and shapes (else ``ValueError`` on
    every rank, naming the first difference)."""
    mine = _signature(variables)
    everyone = allgather_object(mine, name=f"{owner}.sync.signature")
    root = everyone[0]
    for r, theirs in enumerate(everyone):
        if theirs == root:
            continue
        if len(theirs) != len(root):
            detail = f"rank 0 has {len(root)} variables, rank {r} has {len(theirs)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(root, theirs)) if a != b)
            here = f" ({_describe(variables[i])} here)" if i < len(variables) else ""
            detail = (f"variable {i}{here} is "
                      f"{root[i][0]}{list(root[i][1])} on rank 0 and "
                      f"{theirs[i][0]}{list(theirs[i][1])} on rank {r}")
        raise ValueError(
            f"{owner}.sync(): the ranks do not hold the same variables ({detail}). Every "
            "worker must build the same model and optimizer before the elastic function runs "
            "(a Keras optimizer creates its slots lazily: TensorFlowKerasState builds it for "
            "model.trainable_variables when it is created).")
    if broadcast is not None:
        broadcast()
    else:
        broadcast_variables(list(variables), root_rank=0)


class TensorFlowKerasState(ObjectState):
    """State of a Keras model and its optimizer (Horovod's
    ``horovod.tensorflow.elastic.TensorFlowKerasState``).

    Args:
        model: a built Keras model (``ValueError`` otherwise: call ``model.build(...)`` or give
            it an ``Input``).
        optimizer: a Keras optimizer; default ``model.optimizer`` (the compiled one, or none:
            then only the model is tracked). One that has no variables yet (Keras 3 and tf-keras
            create slots on the first update) is built now for ``model.trainable_variables``,
            so that a commit before the first step covers the slots and every worker, a
            newcomer included, holds the same optimizer variables.
        backend: accepted for Horovod compatibility (the Keras backend of TF1 sessions); unused.
        **kwargs: plain attributes (``epoch=0, batch=0``), deep-copied at every commit.

    ``save`` / ``restore`` / ``sync`` cover ``model.weights`` and the optimizer's
    ``variables``, read again at every call (assigning ``state.model = other`` is honoured).
    :meth:`sync` and :meth:`commit` are collective. A hora ``ShardedOptimizer``'s slots are
    kept by its own handler instead (the full state at commit; each rank's shard loaded on
    restore, sync and reset: :mod:`hora.tensorflow.keras.sharded_elastic`). After every
    reset the model's compiled Keras functions are dropped (:meth:`reset`), so that the next
    ``fit`` traces its step for the new world size.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        _eager(type(self).__name__)
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)` (or "
                             "start it with keras.Input) before creating the elastic state.")
        self.model = model
        self.optimizer: Any = optimizer if optimizer is not None else getattr(
            model, "optimizer", None)
        self.backend = backend
        # hora-only: a ShardedOptimizer's slots differ per rank; its own handler keeps them
        make_handler = getattr(self.optimizer, "_hora_elastic_handler", None)
        self._sharded: Any = make_handler(model) if make_handler is not None else None
        if self.optimizer is not None and self._sharded is None:
            log.debug("%s: building the optimizer's variables (if it has none) for the model's "
                      "%d trainable variables", type(self).__name__,
                      len(model.trainable_variables))
            build_optimizer(self.optimizer, list(model.trainable_variables))
        self._snapshot = _Snapshot()
        self._snapshot.save(self._variables())
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _variables(self) -> list[Any]:
        found = list(self.model.weights)
        if self.optimizer is not None and self._sharded is None:
            opt_vars = self.optimizer.variables
            found += list(opt_vars() if callable(opt_vars) else opt_vars)
        return _unique(found)

    def save(self) -> None:
        _eager(f"{type(self).__name__}.save()")
        self._snapshot.save(self._variables())
        if self._sharded is not None:
            self._sharded.save()
        super().save()

    def restore(self) -> None:
        _eager(f"{type(self).__name__}.restore()")
        self._snapshot.restore(self._variables(), type(self).__name__)
        if self._sharded is not None:
            self._sharded.restore()
        super().restore()

    def sync(self) -> None:
        _eager(f"{type(self).__name__}.sync()")
        variables = self._variables()
        _sync_variables(variables, type(self).__name__)
        self._snapshot.save(variables)
        if self._sharded is not None:
            self._sharded.sync()
        super().sync()

    def reset(self) -> None:
        """The world changed: drop the model's compiled ``train_function`` /
        ``test_function`` / ``predict_function`` (Keras rebuilds them at the next ``fit``), so
        that no step traced for the old world size runs in the new one."""
        super().reset()
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(self.model, attr, None) is not None:
                setattr(self.model, attr, None)
        if self._sharded is not None:
            self._sharded.reset()

    if TYPE_CHECKING:  # the keyword attributes (state.epoch, ...) for type checkers
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...


class TensorFlowState(ObjectState):
    """State of a list of TensorFlow variables (Horovod's
    ``horovod.tensorflow.elastic.TensorFlowState``): TensorFlow 2 eager variables, or the
    variables of a ``tf.compat.v1`` graph run by a session.

    Args:
        variables: ``tf.Variable``\\ s or Keras variables (a list, or one variable). Required
            eagerly (TensorFlow 2 has no global variables to default to); with a session,
            default ``tf.compat.v1.global_variables()`` of the session's graph.
        session: a ``tf.compat.v1.Session`` whose graph holds the variables: commits read the
            values with it, restores assign them back and syncs broadcast rank 0's values by
            running ops in it (:class:`~hora.tensorflow.v1_state.SessionVariables`: built now,
            so later calls never grow the graph). In graph mode without ``session``, the
            default session (``with sess.as_default():``); none is ``ValueError``.
        **kwargs: plain attributes, deep-copied at every commit.

    :meth:`sync` and :meth:`commit` are collective.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        owner = type(self).__name__
        if session is None and not tf.executing_eagerly():
            if tf.inside_function():
                _eager(owner)  # inside tf.function: RuntimeError
            session = default_session(owner)
        self.session = session
        self._graph: SessionVariables | None = None
        if session is not None:
            self._graph = SessionVariables(variables, session, owner)
            self.variables = self._graph.variables
            self._graph.save()
        else:
            _eager(owner)
            if variables is None:
                raise ValueError("TensorFlowState needs variables=[...] under TensorFlow 2 "
                                 "(eager execution has no global variables to default to), "
                                 "e.g. TensorFlowState(model.variables + optimizer.variables)"
                                 "; or pass session=sess for a tf.compat.v1 graph.")
            many = isinstance(variables, (list, tuple)) or (
                not hasattr(variables, "assign") and hasattr(variables, "__iter__"))
            found = _unique(list(variables) if many else [variables])
            bad = [type(v).__name__ for v in found if not hasattr(v, "assign")]
            if bad:
                raise TypeError(f"TensorFlowState: variables must be tf.Variable or Keras "
                                f"variables (objects with assign()); got "
                                f"{', '.join(sorted(set(bad)))}")
            self.variables = found
            self._snapshot = _Snapshot()
            self._snapshot.save(self.variables)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        if self._graph is not None:
            self._graph.save()
        else:
            _eager("TensorFlowState.save()")
            self._snapshot.save(self.variables)
        super().save()

    def restore(self) -> None:
        if self._graph is not None:
            self._graph.restore()
        else:
            _eager("TensorFlowState.restore()")
            self._snapshot.restore(self.variables, "TensorFlowState")
        super().restore()

    def sync(self) -> None:
        if self._graph is not None:
            _sync_variables(self.variables, "TensorFlowState", self._graph.broadcast)
            self._graph.save()
        else:
            _eager("TensorFlowState.sync()")
            _sync_variables(self.variables, "TensorFlowState")
            self._snapshot.save(self.variables)
        super().sync()

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...


__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]
