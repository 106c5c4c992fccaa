"""An elastic Keras training script for test_tf_elastic.py: ``hora run -np 2 --min-np 1
--max-np 2 python tf_elastic_worker.py``.

A small model trained with ``model.fit`` inside ``hvd.elastic.run``: ``KerasState`` and the
three callbacks (commit every ``TFE_COMMIT`` batches), one ``fit`` per epoch given the batches
of that epoch still to do. Every rank trains on its own data (seeded by rank and epoch).

Environment:
    TFE_EPOCHS, TFE_STEPS (batches per epoch per rank), TFE_COMMIT;
    TFE_KILL=``<worker id>:<epoch>:<batch>``: that worker SIGKILLs itself before the batch
    after ``<batch>`` batches of that epoch (worker ids are never reused, so only in its first
    life);
    TFE_SLOW=seconds: each batch sleeps that long while the world has one rank (so that the
    replacement has time to start and join before training ends).

A TensorFlow error out of ``fit`` (a collective that failed inside the train step, before
``hvd.elastic.run`` converts it) prints ``fit failed: <error class>``. At the end each worker
prints one JSON line: its worker id, rank, size, epoch, the optimizer's
iteration count, a hash of its weights, and the world sizes it trained in.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hora.keras as hvd

WID = int(os.environ["HORA_ELASTIC_WORKER_ID"])
EPOCHS = int(os.environ.get("TFE_EPOCHS", "4"))
STEPS = int(os.environ.get("TFE_STEPS", "30"))
COMMIT = int(os.environ.get("TFE_COMMIT", "2"))
SLOW = float(os.environ.get("TFE_SLOW", "0"))
BATCH = 8
kill_wid, kill_epoch, kill_batch = (int(p) for p in os.environ.get("TFE_KILL", "-1:-1:-1")
                                    .split(":"))

tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()  # no collective before train(): a replacement starts the script from the top

keras.utils.set_random_seed(100 + WID)  # different start on each worker: sync unifies them
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0, batch=0)
sizes: list[int] = []


class Faults(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if kill_wid == WID and (state.epoch, state.batch) == (kill_epoch, kill_batch):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if hvd.size() == 1 and SLOW:
            time.sleep(SLOW)


callbacks = [Faults(), hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT)]


def data(rank: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1000 * epoch + rank)
    x = rng.randn(STEPS * BATCH, 6).astype("float32")
    return x, np.tanh(x @ np.linspace(-1.0, 1.0, 6, dtype="float32"))[:, None]


@hvd.elastic.run
def train(state: Any) -> None:
    while state.epoch < EPOCHS:
        if not sizes or sizes[-1] != hvd.size():
            sizes.append(hvd.size())
        x, y = data(hvd.rank(), state.epoch)
        done = state.batch * BATCH
        try:
            model.fit(x[done:], y[done:], batch_size=BATCH, initial_epoch=state.epoch,
                      epochs=state.epoch + 1, shuffle=False, verbose=0, callbacks=callbacks)
        except tf.errors.OpError as exc:  # what hvd.elastic.run converts
            print(f"fit failed: {type(exc).__name__}", flush=True)
            raise


train(state)
weights = np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])
print(json.dumps({"wid": WID, "rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch,
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "weights": hashlib.sha256(weights.tobytes()).hexdigest(), "sizes": sizes}),
      flush=True)
