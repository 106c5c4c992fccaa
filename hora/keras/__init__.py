"""hora.keras: Horovod's ``horovod.keras`` API for Keras 3 (``import hora.keras as hvd``).

Keras 3 runs on TensorFlow here (``KERAS_BACKEND=tensorflow``, the default): this is the API
of :mod:`hora.tensorflow.keras`, re-exported (Horovod kept two copies for standalone Keras and
``tf.keras``; Keras 3 is one package).
"""

from __future__ import annotations

from hora.tensorflow.keras import *  # noqa: F403 - the same API under Horovod's other name
from hora.tensorflow.keras import __all__ as __all__
from hora.tensorflow.keras import callbacks as callbacks
from hora.tensorflow.keras import elastic as elastic
