"""hora.keras: Horovod's ``horovod.keras`` API (``import hora.keras as hvd``).

Keras 3 runs on TensorFlow here (``KERAS_BACKEND=tensorflow``, the default): this is the API
of :mod:`hora.tensorflow.keras`, re-exported (Horovod kept two copies for standalone Keras and
``tf.keras``; Keras 3 is one package). With ``TF_USE_LEGACY_KERAS=1`` it serves Keras 2
through tf-keras, as :mod:`hora.tensorflow.keras` does.
"""

from __future__ import annotations

from hora.tensorflow.keras import *  # noqa: F403 - the same API under Horovod's other name
from hora.tensorflow.keras import __all__ as __all__
from hora.tensorflow.keras import callbacks as callbacks
from hora.tensorflow.keras import elastic as elastic
from hora.tensorflow.keras.sharded import ShardedOptimizer as ShardedOptimizer  # hora-only
