"""``hora.ray``: run hora jobs on a Ray cluster, with Horovod's ``horovod.ray`` API.

Launcher side, like :mod:`hora.runner`: importing it imports Ray, never hora's engine. The
workers are Ray actors; the function they run calls ``hora.init()`` / ``hvd.init()`` and trains::

    import ray
    from hora.ray import RayExecutor

    def train(lr):
        import hora.torch as hvd
        hvd.init()
        ...
        return hvd.rank()

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    results = executor.run(train, args=[0.01])   # [0, 1]: one result per rank, in rank order
    executor.shutdown()

See docs/ray.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hora.ray import ray_logger
    from hora.ray.elastic import ElasticRayExecutor
    from hora.ray.runner import RayExecutor
    from hora.ray.settings import MiniSettings
    from hora.ray.worker import BaseHorovodWorker

# Loaded on first use (PEP 562): a worker actor imports hora.ray.worker, and must not pay for
# the driver's modules (runner, rendezvous store, launcher) when it starts.
_LAZY = {"RayExecutor": "hora.ray.runner", "ElasticRayExecutor": "hora.ray.elastic",
         "MiniSettings": "hora.ray.settings", "BaseHorovodWorker": "hora.ray.worker"}


def __getattr__(name: str) -> Any:
    if name == "ray_logger":
        return importlib.import_module("hora.ray.ray_logger")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hora.ray' has no attribute {name!r}")


__all__ = ["BaseHorovodWorker", "ElasticRayExecutor", "MiniSettings", "RayExecutor",
           "ray_logger"]
