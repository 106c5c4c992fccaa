"""``hora.keras.callbacks``: the callbacks of :mod:`hora.tensorflow.keras.callbacks`."""

from __future__ import annotations

from hora.tensorflow.keras.callbacks import *  # noqa: F403 - same callbacks, Horovod's other path
from hora.tensorflow.keras.callbacks import __all__ as __all__
