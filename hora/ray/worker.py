"""The worker actor of a :class:`~hora.ray.RayExecutor`: one per rank.

Actor side. The class is a plain Python class that :mod:`hora.ray.placement` turns into a Ray
actor (``ray.remote(BaseHorovodWorker).options(...)``). It imports nothing of hora's engine:
the function it runs does, when it calls ``hora.init()`` / ``hvd.init()``, after the executor
has set this process's identity, rendezvous and secret variables (:meth:`setup`). The secret
reaches the actor as an argument of that method call (through Ray), never on a command line.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hora._util.shm_names import remove_job_segments
from hora.ray import ray_logger


class BaseHorovodWorker:
    """One rank's actor (Horovod's class of the same name).

    Args:
        world_rank: the rank the actor was created for (the executor may renumber ranks so
            that each node's ranks are contiguous; :meth:`setup` sets the final one).
        world_size: number of workers.
    """

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        self._created_rank = world_rank
        self._created_size = world_size

    # ---- where am I ----------------------------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node id (hex) this actor runs on."""
        return str(ray.get_runtime_context().get_node_id())

    def hostname(self) -> str:
        """The host name of this actor's machine."""
        return socket.gethostname()

    def get_gpu_ids(self) -> list[Any]:
        """The GPU ids Ray assigned to this actor (empty without ``use_gpu``)."""
        return list(ray.get_gpu_ids())

    def placement(self) -> dict[str, Any]:
        """Everything the driver needs to rank this actor, in one round trip."""
        return {"node_id": self.node_id(), "hostname": self.hostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": self.get_gpu_ids()}

    # ---- environment ---------------------------------------------------------------------------

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Set ``env_vars`` (values converted with :class:`str`) in this process."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This process's environment."""
        return dict(os.environ)

    def setup(self, env_vars: Mapping[str, str], unset: Sequence[str]) -> None:
        """Set this rank's variables (identity, rendezvous, secret, knobs) and remove
        ``unset`` (stale identity variables inherited from whoever started Ray)."""
        for name in unset:
            os.environ.pop(name, None)
        self.update_env_vars(env_vars)

    # ---- running -------------------------------------------------------------------------------

    def start_executable(self, executable_cls: type | None = None,
                         executable_args: Sequence[Any] | None = None,
                         executable_kwargs: Mapping[str, Any] | None = None) -> None:
        """Create ``executable_cls(*executable_args, **executable_kwargs)`` as this worker's
        executable (the object :meth:`execute` hands to its function); None leaves it None."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()),
                                             **dict(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any], queue: Any = None) -> Any:
        """Return ``func(self.executable)``; while it runs, ``ray_logger.log`` sends to
        ``queue`` (the driver's callbacks) when one is given."""
        if queue is None:
            return func(self.executable)
        ray_logger.configure(queue)
        try:
            return func(self.executable)
        finally:
            ray_logger.configure(None)

    def set_queue(self, queue: Any) -> None:
        """Horovod's way to route ``ray_logger.log`` to a queue for the actor's lifetime."""
        ray_logger.configure(queue)


class ElasticCall:
    """What an :class:`~hora.ray.ElasticRayExecutor` worker runs: ``fn()``, reported with the
    worker's rank and elastic generation at the end (both change at every reset) as
    ``("result", rank, generation, value)``; ``("error", rank, generation, header, payload)``
    when it raised (:func:`hora.runner.run_func.error_record`: the type, message and traceback,
    and the pickled exception when it pickles); ``("exit", status)`` when it left through
    ``SystemExit`` (status 0: the driver told it to leave)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self, executable: Any) -> tuple[Any, ...]:
        try:
            value = self.fn()
        except SystemExit as exc:
            code = exc.code
            return ("exit", 0 if code is None else code if isinstance(code, int) else 1)
        except Exception as exc:  # noqa: BLE001 (reported to the driver, which decides)
            from hora.runner.run_func import error_record

            rank, generation = _position()
            header, payload = error_record(exc, rank)
            return ("error", rank, generation, header, payload)
        rank, generation = _position()
        return ("result", rank, generation, value)


def _position() -> tuple[int, int]:
    """This worker's rank and elastic generation now."""
    from hora.rendezvous.elastic import session

    current = session(connect=False)
    return (int(os.environ.get("HORA_RANK", "-1")),
            current.generation if current is not None else 0)


def remove_segments(job_id: str) -> int:
    """Unlink the job's shared memory segments on this node (a Ray task run on each node
    whose workers were killed: a killed rank cannot unlink its own). Returns how many."""
    return len(remove_job_segments(job_id))


__all__ = ["BaseHorovodWorker", "ElasticCall", "remove_segments"]
