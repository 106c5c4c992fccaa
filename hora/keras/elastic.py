"""``hora.keras.elastic`` (Horovod's ``horovod.keras.elastic``): the elastic states, callbacks and
``run`` of :mod:`hora.tensorflow.keras.elastic` (Keras 3 is one package)."""

from __future__ import annotations

from hora.tensorflow.keras.elastic import *  # noqa: F403 - the same API, Horovod's other path
from hora.tensorflow.keras.elastic import __all__ as __all__
