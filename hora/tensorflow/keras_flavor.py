"""Which Keras ``tf.keras`` is: Keras 3, or Keras 2 through tf-keras.

TensorFlow 2.16+ makes ``tf.keras`` Keras 3 unless ``TF_USE_LEGACY_KERAS=1`` was set before
TensorFlow was imported; then ``tf.keras`` is the ``tf_keras`` package (``pip install
tf-keras``), Keras 2 as Horovod knew it. :mod:`hora.tensorflow.keras` serves whichever one
``tf.keras`` is (:func:`legacy_keras`); an optimizer is wrapped by its own class
(:func:`is_keras2`), so an optimizer made with ``import tf_keras`` directly is served as Keras 2
whatever ``tf.keras`` is. Nothing here imports a Keras package that the process has not already
loaded through ``tf.keras``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import tensorflow as tf


def keras_of_tf() -> ModuleType:
    """The module behind ``tf.keras`` (Keras 3's ``keras._tf_keras.keras`` or tf-keras's
    ``tf_keras.api._v2.keras``): what a script's ``tf.keras.X`` resolves to."""
    module: ModuleType = tf.keras
    return module


def _root_is_keras2(name: str) -> bool:
    root = name.split(".")[0]
    if root == "tf_keras":
        return True
    version = str(getattr(sys.modules.get(root), "__version__", "3"))
    return root == "keras" and version.startswith("2.")


def legacy_keras() -> bool:
    """True when ``tf.keras`` is Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``): told by where
    its optimizer class comes from (once a script has imported ``tensorflow.keras.X``,
    ``tf.keras`` is a module named ``tensorflow.keras`` whichever Keras it is)."""
    return _root_is_keras2(keras_of_tf().optimizers.Optimizer.__module__)


def is_keras2(obj: Any) -> bool:
    """True when ``obj`` (an optimizer, a model) is a Keras 2 object: a class in its MRO comes
    from tf-keras."""
    return any(_root_is_keras2(cls.__module__) for cls in type(obj).__mro__)


def build_optimizer(optimizer: Any, variables: list[Any]) -> None:
    """Create ``optimizer``'s variables (slots) for ``variables`` now if it has none yet:
    Keras 3 and tf-keras optimizers create them at their first update, tf-keras's legacy
    (``optimizer_v2``) ones as well."""
    if not is_keras2(optimizer):
        if not getattr(optimizer, "built", True) and callable(getattr(optimizer, "build", None)):
            optimizer.build(variables)
        return
    if hasattr(optimizer, "_create_all_weights"):  # tf-keras legacy OptimizerV2 (idempotent)
        optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "_built", False):
        optimizer.build(variables)


__all__ = ["build_optimizer", "is_keras2", "keras_of_tf", "legacy_keras"]
