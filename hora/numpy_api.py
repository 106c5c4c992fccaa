"""The framework-neutral process API and the collectives on numpy arrays: the body of
:mod:`hora`, which loads this module on first use (so that ``hora run`` and other tools that
only need the launcher start without the engine and numpy).

Framework adapters (``hora.torch``, ...) expose the same names on their tensor types. Every
collective must be called by all ranks of its process set with the same name, dtype and shape
rules; see :mod:`hora.core.frontend.api` for the shared contract.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora._util import build_info as _build
from hora._version import __version__ as __version__
from hora.collectives.ops import (
    SUPPORTED_DTYPES,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
)
from hora.core.engine import context as _context
from hora.core.engine.context import init, is_initialized, shutdown
from hora.core.frontend import api as _api
from hora.core.frontend import objects as _objects
from hora.core.frontend import op_forms as _sp
from hora.core.frontend.api import (
    add_process_set,
    poll,
    remove_process_set,
    synchronize,
)
from hora.core.frontend.host_bridge import HostBridge
from hora.core.frontend.objects import allgather_object
from hora.core.op.handle import Handle
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.errors import (
    HoraError,
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    MismatchError,
    NotInitializedError,
)


# ---- topology ------------------------------------------------------------------------------
def rank() -> int:
    """Global rank of this process (0..size-1)."""
    return _context.get("rank").rank


def size() -> int:
    """Number of processes in the job."""
    return _context.get("size").size


def local_rank() -> int:
    """Index of this process among the processes on its host."""
    return _context.get("local_rank").local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _context.get("local_size").local_size


def cross_rank() -> int:
    """Index of this host among hosts that have a process with this local rank."""
    return _context.get("cross_rank").cross_rank


def cross_size() -> int:
    """Number of hosts that have a process with this local rank."""
    return _context.get("cross_size").cross_size


def is_homogeneous() -> bool:
    """True iff every host runs the same number of processes."""
    ctx = _context.get("is_homogeneous")
    counts: dict[str, int] = {}
    for host in ctx.hostnames:
        counts[host] = counts.get(host, 0) + 1
    return len(set(counts.values())) <= 1


# ---- capabilities (answered truthfully: hora has its own engine and controller; its data ----
# ---- planes can move tensors over MPI (mpi4py) or Gloo (torch.distributed)              ----
def mpi_built() -> bool:
    """Whether hora's tensor operations can run on MPI here: the ``mpi`` data plane
    (``HORA_DATA_PLANE=mpi``) with mpi4py installed. ``mpirun`` can launch hora jobs anyway."""
    return _build.mpi_ops()


def mpi_enabled() -> bool:
    """Whether this job moves its tensors over MPI (the ``mpi`` data plane); False before
    init(). MPI is never hora's controller."""
    return _data_plane() == "mpi"


def mpi_threads_supported() -> bool:
    """With the ``mpi`` data plane: whether MPI was initialised with ``MPI_THREAD_MULTIPLE``.

    Raises:
        ValueError: MPI is not enabled (as Horovod raises).
    """
    if not mpi_enabled():
        raise ValueError("MPI is not enabled: hora uses its own engine unless the job's data "
                         "plane is mpi (HORA_DATA_PLANE=mpi, hora run --data-plane mpi); "
                         "mpi_threads_supported is only meaningful then.")
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built() -> bool:
    """Whether hora's tensor operations can run on Gloo here: the ``torch`` data plane
    (torch.distributed's gloo), with PyTorch installed."""
    return _build.gloo_ops()


def gloo_enabled() -> bool:
    """Whether this job moves its tensors over Gloo (the ``torch`` data plane); False before
    init()."""
    return _data_plane() == "torch"


def _data_plane() -> str:
    return _context.get().config.data_plane if _context.is_initialized() else ""


def nccl_built() -> int:
    """0: no NCCL build."""
    return _build.NCCL


def ddl_built() -> bool:
    return _build.DDL


def ccl_built() -> bool:
    return _build.CCL


def cuda_built() -> bool:
    return _build.CUDA


def rocm_built() -> bool:
    return _build.ROCM


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline to ``file_path`` (rank 0); needs HOROVOD_TIMELINE set."""
    _context.get("start_timeline").engine.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close the file (rank 0)."""
    _context.get("stop_timeline").engine.timeline.stop()


# ---- collectives on numpy arrays -------------------------------------------------------------
class _NumpyBridge(HostBridge):
    """The numpy side of :mod:`hora.core.frontend.op_forms`: arrays are the core's own buffers
    (every dtype the core supports; received alltoall splits as the core gives them)."""

    def received_splits(self, splits: Any, received: np.ndarray) -> Any:
        return received


_NUMPY = _NumpyBridge()


def _spell(family: _sp.OpForm, public: str, inplace: bool, wait: bool) -> Any:
    return _sp.spell(_NUMPY, family, public, inplace=inplace, wait=wait, module=__name__)


_allreduce = _spell(_sp.ALLREDUCE, "allreduce", False, True)
_allreduce_ = _spell(_sp.ALLREDUCE, "allreduce_", True, True)


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    if type(tensor) is np.ndarray and average is None and (op is None or type(op) is ReduceOp):
        # What a training loop does every step: an array and an op constant. The same call as
        # the op form's (which also takes array-likes and resolves ``average`` or an int op),
        # without the bridge's calls: the core reduces into a new 64-byte aligned array.
        return _api.allreduce_async(tensor, name=name, op=ReduceOp.Average if op is None else op,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=process_set,
                                    sync=True).wait()
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    if type(tensor) is np.ndarray and average is None and (op is None or type(op) is ReduceOp):
        # (as allreduce above, in place)
        return _api.allreduce_async(tensor, name=name, op=ReduceOp.Average if op is None else op,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=process_set,
                                    inplace=True, sync=True).wait()
    return _allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)


allreduce.__doc__ = _allreduce.__doc__
allreduce_.__doc__ = _allreduce_.__doc__
allreduce_async = _spell(_sp.ALLREDUCE, "allreduce_async", False, False)
allreduce_async_ = _spell(_sp.ALLREDUCE, "allreduce_async_", True, False)
grouped_allreduce = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce", False, True)
grouped_allreduce_ = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_", True, True)
grouped_allreduce_async = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_async", False, False)
grouped_allreduce_async_ = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_async_", True,
                                  False)
allgather = _spell(_sp.ALLGATHER, "allgather", False, True)
allgather_async = _spell(_sp.ALLGATHER, "allgather_async", False, False)
grouped_allgather = _spell(_sp.GROUPED_ALLGATHER, "grouped_allgather", False, True)
grouped_allgather_async = _spell(_sp.GROUPED_ALLGATHER, "grouped_allgather_async", False, False)
broadcast = _spell(_sp.BROADCAST, "broadcast", False, True)
broadcast_ = _spell(_sp.BROADCAST, "broadcast_", True, True)
broadcast_async = _spell(_sp.BROADCAST, "broadcast_async", False, False)
broadcast_async_ = _spell(_sp.BROADCAST, "broadcast_async_", True, False)
_alltoall_pair = _spell(_sp.ALLTOALL, "alltoall", False, True)


def alltoall(tensor: np.ndarray, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows of dimension 0 to set member ``j`` (an even split when
    ``splits`` is None). Returns the received rows; with ``splits``, ``(received,
    received_splits)`` (Horovod's convention; ``synchronize`` of :func:`alltoall_async` always
    gives the pair)."""
    out, received = _alltoall_pair(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


alltoall_async = _spell(_sp.ALLTOALL, "alltoall_async", False, False)
reducescatter = _spell(_sp.REDUCESCATTER, "reducescatter", False, True)
reducescatter_async = _spell(_sp.REDUCESCATTER, "reducescatter_async", False, False)
grouped_reducescatter = _spell(_sp.GROUPED_REDUCESCATTER, "grouped_reducescatter", False, True)
grouped_reducescatter_async = _spell(_sp.GROUPED_REDUCESCATTER, "grouped_reducescatter_async",
                                     False, False)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the set calls barrier."""
    _api.barrier(process_set)


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """This rank has no more data: contribute zeros until all join; returns the last joiner."""
    return _api.join(process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return a copy of ``root_rank``'s picklable object on every rank."""
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


__all__ = [
    "SUPPORTED_DTYPES",
    "Adasum",
    "Average",
    "Handle",
    "HoraError",
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "MismatchError",
    "NotInitializedError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]


def run(*args: Any, **kwargs: Any) -> list[Any]:
    """Horovod's ``horovod.run``: run a function in ``np`` new ranks, return their results in
    rank order. See :func:`hora.runner.api.run` (imported on first use)."""
    from hora.runner.api import run as _run

    return _run(*args, **kwargs)


__all__ += ["run"]
