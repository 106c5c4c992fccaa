"""What the Keras 3 and the Keras 2 (tf-keras) ``DistributedOptimizer`` share: the checked
options of one call (:class:`Options`, which makes the step's
:class:`~hora.tensorflow.gradients.GradientReducer`), the runtime subclass of the wrapped
optimizer's class (:func:`runtime_class`, Horovod's: same name, and here the same module) and
``load_model``'s custom-object classes (:func:`loading_class`). Imports no Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hora.core.op.process_set import ProcessSet
from hora.tensorflow.compression import Compressor
from hora.tensorflow.gradients import GradientReducer


@dataclass(frozen=True)
class Options:
    """The checked options of one ``DistributedOptimizer`` call (both Keras generations)."""

    prefix: str
    compression: type[Compressor]
    sparse_as_dense: bool
    op: int
    gradient_predivide_factor: float
    groups: Any
    process_set: ProcessSet
    scale_local_gradients: bool
    backward_passes_per_step: int
    average_aggregated_gradients: bool

    def reducer(self) -> GradientReducer:
        """A new reducer of these options (its own local variables and output pool)."""
        return GradientReducer(self.prefix, self.compression, self.sparse_as_dense, self.op,
                               self.gradient_predivide_factor, self.groups, self.process_set,
                               self.scale_local_gradients)


def runtime_class(base: type, mixin: type, exclude: tuple[str, ...] = (), **attrs: Any) -> Any:
    """A subclass of ``base`` with ``mixin``'s methods (but ``exclude``), under ``base``'s
    name, module and qualified name (a saved model names the wrapped class and reloads without
    hora); ``attrs`` become class attributes."""
    namespace = {k: v for k, v in mixin.__dict__.items()
                 if k not in ("__dict__", "__weakref__", *exclude)}
    namespace.update(_hora_base=base, __module__=base.__module__,
                     __qualname__=base.__qualname__, **attrs)
    return type(base.__name__, (base,), namespace)


def loading_class(base: type, make: Callable[[dict[str, Any]], Any]) -> type:
    """A subclass of ``base`` (same name) whose ``from_config(config)`` returns
    ``make(config)``: ``load_model``'s custom object that wraps a loaded optimizer."""
    def from_config(_cls: Any, config: dict[str, Any], custom_objects: Any = None) -> Any:
        return make(dict(config))
    return type(base.__name__, (base,), {"from_config": classmethod(from_config)})


__all__ = ["Options", "loading_class", "runtime_class"]
