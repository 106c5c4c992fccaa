"""``TorchState``: the elastic state of a PyTorch training process.

::

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

Every keyword becomes an attribute. A value whose type has a handler in the registry
(:func:`get_handler_registry`) is tracked by that handler; everything else is plain
:class:`~hora.elastic.ObjectState` data (deep-copied, synced with one ``broadcast_object``).

========================  ====================================  ==================================
type                      commit (``save``)                     ``sync``
========================  ====================================  ==================================
``torch.nn.Module``       copy of ``state_dict()``              ``broadcast_parameters``
``torch.optim.Optimizer`` copy of ``state_dict()``              ``broadcast_optimizer_state``
``ElasticSampler``        its ``state_dict()`` (two ints)       ``broadcast_object`` + load
LR scheduler (hora)       copy of ``state_dict()``              ``broadcast_object`` + load
========================  ====================================  ==================================

Handlers run before plain attributes in ``save``, ``restore`` and ``sync``. Snapshots are
copied into buffers kept from the previous commit (``Tensor.copy_``, no allocation in the
steady state) and never handed out: after ``restore()`` the live objects share no memory with
the snapshot, so a failure before the next commit rolls back to the same values again.

Differences from Horovod (supersets): an LR scheduler handler (Horovod 0.28 keeps schedulers
as plain data, whose deep copy also copies the optimizer they point to); assigning a model,
optimizer, ... to an attribute that held plain data (``TorchState(model=None)`` then
``state.model = model``) moves it to its handler instead of deep-copying it at every commit;
assigning an object no handler takes to a handled attribute raises ``TypeError`` at once;
``reset()`` re-partitions ``ElasticSampler``\\ s even when the sync is skipped (only hosts
removed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hora._basics import rank
from hora._util.log import get_logger
from hora.elastic.state import ObjectState
from hora.torch.elastic._snapshot import snapshot, thawed
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

log = get_logger(__name__)


class StateHandler:
    """Tracks one object of a :class:`TorchState` (Horovod's ``StateHandler``).

    Subclass it for your own types and register the subclass with :func:`set_handler_registry`.
    Contract: ``save()`` snapshots ``self.value``; ``restore()`` puts the snapshot back into
    ``self.value`` without letting it alias the snapshot; ``sync()`` is collective (every rank
    calls it, in the same order) and leaves ``self.value`` equal to rank 0's.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Track ``value`` instead (``state.<attr> = value``) and snapshot it at once."""
        self.value = value
        self.save()

    def reset(self) -> None:
        """Hook: the world changed (called by :meth:`TorchState.reset`). hora extension."""


class _StateDictHandler(StateHandler):
    """Snapshots ``value.state_dict()`` and restores with ``value.load_state_dict``."""

    _copy_on_restore = True  # the consumer's load_state_dict may keep the tensors it gets

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved: Any = None
        self.save()

    def save(self) -> None:
        self._saved = snapshot(self.value.state_dict(), self._saved)

    def restore(self) -> None:
        live = self.value.state_dict() if self._copy_on_restore else None
        self.value.load_state_dict(thawed(self._saved, live, self._copy_on_restore))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


class ModelStateHandler(_StateDictHandler):
    """``torch.nn.Module``: restore copies into the parameters (``load_state_dict``); sync
    broadcasts ``state_dict()`` from rank 0 in place (``broadcast_parameters``)."""

    _copy_on_restore = False  # Module.load_state_dict copies into the live tensors

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """``torch.optim.Optimizer``: ``Optimizer.load_state_dict`` keeps the tensors it is given,
    so restore copies the snapshot into the live state tensors (cloning where they are
    missing); sync is ``broadcast_optimizer_state`` from rank 0."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """:class:`ElasticSampler`: its ``{'epoch', 'processed_num'}``; sync broadcasts rank 0's
    (live) state dict and loads it, which re-partitions for the current world."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved = dict(sampler.state_dict())

    def save(self) -> None:
        self._saved = dict(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(dict(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))

    def reset(self) -> None:
        self.value.reset()


class LRSchedulerStateHandler(_StateDictHandler):
    """LR schedulers (hora extension): ``state_dict()`` snapshots; sync broadcasts rank 0's."""


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]
_LR_SCHEDULER = getattr(torch.optim.lr_scheduler, "LRScheduler", None)  # torch >= 2.0
if isinstance(_LR_SCHEDULER, type):
    _handler_registry.append((_LR_SCHEDULER, LRSchedulerStateHandler))


def get_handler_registry() -> list[tuple[type, type]]:
    """The ``(type, handler class)`` pairs :class:`TorchState` uses; the first pair whose type
    matches (``isinstance``) wins. The list itself, as in Horovod."""
    return _handler_registry


def set_handler_registry(registry: Sequence[tuple[type, type]]) -> None:
    """Replace the registry (applies to :class:`TorchState`\\ s made afterwards), e.g.
    ``set_handler_registry([(MyThing, MyThingHandler), *get_handler_registry()])``.

    Raises:
        TypeError: an entry that is not a ``(type, handler class)`` pair.
    """
    global _handler_registry
    checked = []
    for entry in registry:
        pair = tuple(entry) if isinstance(entry, (tuple, list)) else ()
        if len(pair) != 2 or not isinstance(pair[0], type) or not callable(pair[1]):
            raise TypeError(f"set_handler_registry: each entry must be a (type, handler class) "
                            f"pair such as (torch.nn.Module, ModelStateHandler), got {entry!r}")
        checked.append((pair[0], pair[1]))
    _handler_registry = checked


def _handler_class(value: Any) -> type | None:
    for handled_type, handler_cls in _handler_registry:
        if isinstance(value, handled_type):
            return handler_cls
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process (Horovod's ``horovod.torch.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer`` (or None).
        **kwargs: more attributes: models, optimizers, ``ElasticSampler``\\ s, LR schedulers or
            types registered with :func:`set_handler_registry` go to their handler; anything
            else must be picklable and is deep-copied at every commit.

    Uses ``hora.torch.broadcast_object`` and ``hora.torch.rank``; :meth:`sync` and
    :meth:`commit` are collective.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler_cls = _handler_class(value)
            if handler_cls is None:
                plain[name] = value
            else:
                self._handlers[name] = handler_cls(value)
                setattr(self, name, value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """The world changed: let every handler adapt (``ElasticSampler``\\ s re-partition)."""
        super().reset()
        for handler in self._handlers.values():
            hook = getattr(handler, "reset", None)
            if hook is not None:
                hook()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers: dict[str, StateHandler] | None = self.__dict__.get("_handlers")
        if handlers is not None and name in self.__dict__:
            if name in handlers:
                if _handler_class(value) is None:
                    raise TypeError(
                        f"TorchState.{name} is tracked by {type(handlers[name]).__name__}; "
                        f"cannot assign a {type(value).__name__} to it (no entry of "
                        f"get_handler_registry() takes that type). Assign an object of the same "
                        f"kind, or build a new TorchState.")
                handlers[name].set_value(value)
            elif name in self.__dict__.get("_saved_state", {}):
                handler_cls = _handler_class(value)
                if handler_cls is not None:
                    log.debug("TorchState.%s now holds a %s: tracked by %s from now on", name,
                              type(value).__name__, handler_cls.__name__)
                    handlers[name] = handler_cls(value)
                    saved = dict(self._saved_state)
                    del saved[name]
                    super().__setattr__("_saved_state", saved)
        super().__setattr__(name, value)

    if TYPE_CHECKING:  # the keyword attributes (state.model, state.epoch, ...) for type checkers
        def __getattr__(self, name: str) -> Any: ...


__all__ = ["LRSchedulerStateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "SamplerStateHandler", "StateHandler", "TorchState", "get_handler_registry",
           "set_handler_registry"]
