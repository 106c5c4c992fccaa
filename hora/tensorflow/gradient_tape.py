"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` averages across ranks.

As in Horovod, :func:`DistributedGradientTape` returns an instance of a runtime subclass of the
tape's own class that shares the wrapped tape's state (so wrapping before or after the
``with`` block both work); ``gradient()`` computes the local gradients and reduces them with a
:class:`~hora.tensorflow.gradients.GradientReducer` (one fused host call, eager or in
``tf.function``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression, Compressor
from hora.tensorflow.gradients import GradientReducer


class _DistributedGradientTape(tf.GradientTape):
    """Methods mixed into the runtime subclass of the wrapped tape's class."""

    _hora_reducer: GradientReducer
    _hora_base: Any = tf.GradientTape

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        """The wrapped tape's gradients of ``target`` w.r.t. ``sources``, reduced across the
        process set (``None`` gradients stay ``None``; registered local sources are only
        scaled). ``use_generic_names`` is accepted for Horovod compatibility."""
        grads = self._hora_base.gradient(self, target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._hora_reducer(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """:meth:`gradient`, split in two as Horovod's tape does (for model-parallel code that
        needs e.g. a gradient norm over the local and the shared gradients apart).

        Returns ``(local_vars_grads, global_vars_grads)``: two lists of ``(source, gradient)``
        pairs, each in the order of ``sources`` (flattened): the sources registered with
        :meth:`register_local_source` (or by ``PartialDistributedGradientTape``'s
        ``local_layers``) with their local gradients (divided by the set size when
        ``scale_local_gradients``), and every other source with its reduced gradient.
        ``None`` gradients are kept as ``None``. Collective like :meth:`gradient`."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local_ids = self._hora_reducer.local_ids
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if id(source) in local_ids else shared).append((source, grad))
        return local, shared

    def register_local_source(self, source: Any) -> None:
        """Leave ``source``'s gradient out of the allreduce (divided by the set size instead,
        when ``scale_local_gradients``)."""
        self._hora_reducer.register_local(source)


def _check(op: int, gradient_predivide_factor: float, num_groups: int, groups: Any,
           process_set: ProcessSet) -> Any:
    groups = distopt.check_options(op, gradient_predivide_factor, 1, num_groups, groups)
    if isinstance(groups, list):
        distopt.check_explicit_groups(groups, lambda v: hasattr(v, "shape") and hasattr(v, "dtype"),
                                      "tf.Variable")
    distopt.adasum_active(op, process_set)  # Adasum's rules, raised now rather than at a step
    return groups


def DistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 - Horovod's name
                            device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: int = ReduceOp.Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> Any:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients reduced (``op``, default
    Average) across ``process_set``. With ``op=Adasum`` the gradients are combined with Adasum,
    one tensor at a time (Horovod's tape; global set, 2^k ranks or hosts).

    Args:
        compression: ``Compression.none`` or ``Compression.fp16`` (or your own compressor).
        sparse_as_dense: allreduce ``tf.IndexedSlices`` as dense tensors (else allgather them).
        gradient_predivide_factor: Average is done as ``1/f`` before and ``f/size`` after.
        num_groups: deprecated, use ``groups``.
        groups: an int k (gradients split into k grouped allreduces) or a list of lists of
            variables.
        scale_local_gradients: divide gradients of registered local sources by the set size.

    ``device_dense`` / ``device_sparse`` are accepted for Horovod compatibility.
    """
    groups = _check(op, gradient_predivide_factor, num_groups, groups, process_set)
    base = gradtape.__class__
    namespace = dict(_DistributedGradientTape.__dict__)
    namespace["_hora_base"] = base
    cls: Any = type(base.__name__, (base,), namespace)
    tape = cls.__new__(cls)
    object.__setattr__(tape, "__dict__", gradtape.__dict__)  # one shared state
    tape._hora_reducer = GradientReducer(
        "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
        groups, process_set, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 - Horovod's name
                                   device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = ReduceOp.Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedGradientTape` whose gradients for the trainable weights of
    ``local_layers`` (a Keras layer or a list of them) stay local."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else (
        local_layers if isinstance(local_layers, (list, tuple)) else [local_layers])
    for layer in layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
