"""The torch data plane: ``torch.distributed`` process groups built from hora's rendezvous.

``HORA_DATA_PLANE=torch``. Each process set gets its own group over its members only (the
equivalent of ``new_group(ranks, use_local_synchronization=True)``, built without touching
``torch.distributed``'s default group, so a program may still use ``init_process_group`` for
itself). The group meets through hora's authenticated rendezvous store: :class:`HoraStore` is a
``torch.distributed.Store`` over hora's store client, under a scope that set rank 0 draws for
each group, so no ``MASTER_ADDR`` / ``env://`` is needed and nothing is published to anyone
without the job secret. (The group's own connections are gloo's, which are not authenticated:
the same as any ``torch.distributed`` job.)

The backend follows the device of the buffers: **gloo** for host memory (numpy arrays, CPU
tensors), **NCCL** for CUDA tensors (:func:`make_group` with ``"nccl"``: the same code, only the
backend name differs). ``native = True``: the core hands this plane hora.torch's tensors as they
are, on their device (:mod:`hora.core.op.device`), so CUDA tensors reach NCCL without a host copy.
The NCCL form has not run on a GPU here: this machine has none.

Every op is started asynchronously (``work.get_future()``); its completion callback, on
torch's thread, finishes the :class:`~hora.transports.planes.Ticket` (on a GPU the waiter then
settles it: ``work.wait()`` orders its stream after NCCL's). Host buffers are shared with
numpy, never copied (``torch.from_numpy``; bfloat16 through an int16 view). gloo's timeout is
``HORA_TIMEOUT_SECONDS``. Reductions gloo lacks (int16 and uint16) are reported by
:meth:`TorchPlane.reduces` so the caller can run them on hora's builtin path.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora._util.log import get_logger
from hora.errors import ConfigError, RendezvousError
from hora.rendezvous.store_client import KVStoreClient
from hora.transports.planes import Doorbell, Ticket

log = get_logger(__name__)

_REDUCIBLE = frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64",
                        "bool", "bfloat16"})
"""dtypes gloo reduces (measured: int16 and uint16 raise 'Invalid scalar type')."""

_STORE_CLASS: type | None = None

NCCL_HINT = (" (HINT: NCCL needs a GPU of its own for every rank of a host: call "
             "torch.cuda.set_device(hvd.local_rank()) after hvd.init(), as with Horovod)")


def import_torch() -> Any:
    """``torch.distributed``, or ConfigError saying how to get it."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ConfigError("HORA_DATA_PLANE=torch needs PyTorch: pip install torch (or choose "
                          f"another data plane with HORA_DATA_PLANE / --data-plane): {exc}"
                          ) from None
    if not dist.is_available():
        raise ConfigError("HORA_DATA_PLANE=torch needs torch.distributed, which this PyTorch "
                          "build lacks")
    return dist


def store_class() -> type:
    """:class:`HoraStore`'s class (defined on first use: it subclasses torch's Store)."""
    global _STORE_CLASS
    if _STORE_CLASS is None:
        dist = import_torch()

        class HoraStore(dist.Store):  # type: ignore[misc,name-defined]
            """A ``torch.distributed.Store`` over hora's authenticated store, in one scope.

            Implements what the process groups' rendezvous uses: set, get (waits up to the
            timeout), add, check, wait, delete_key.
            """

            def __init__(self, client: KVStoreClient, scope: str, timeout: float) -> None:
                super().__init__()
                self._client, self._scope, self._timeout = client, scope, timeout

            def set(self, key: str, value: Any) -> None:
                data = value.encode() if isinstance(value, str) else bytes(value)
                self._client.set(self._scope, key, data)

            def get(self, key: str) -> bytes:
                return self._client.get(self._scope, key, self._timeout)

            def add(self, key: str, value: int) -> int:
                return self._client.add(self._scope, key, int(value))

            def check(self, keys: list[str]) -> bool:
                return not self._client.missing(self._scope, keys)

            def wait(self, keys: list[str], timeout: Any = None) -> None:
                seconds = (timeout.total_seconds() if isinstance(timeout, datetime.timedelta)
                           else self._timeout)
                self._client.wait(self._scope, keys, seconds)

            def delete_key(self, key: str) -> bool:
                return self._client.delete(self._scope, key)

        _STORE_CLASS = HoraStore
    return _STORE_CLASS


def make_group(backend: str, store: Any, rank: int, size: int, timeout: float,
               iface: str = "") -> Any:
    """A process group of ``backend`` (``"gloo"`` or ``"nccl"``) over ``store`` (collective
    over its ``size`` members); gloo binds to network interface ``iface`` when given (else
    ``GLOO_SOCKET_IFNAME``, else the address of the host name, as torch does). NCCL is untested
    here (no GPU)."""
    dist = import_torch()
    limit = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        iface = iface or os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
        if not iface:
            return dist.ProcessGroupGloo(store, rank, size, limit)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
        options._timeout = limit
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ConfigError("CUDA tensors on the torch data plane need NCCL, which this "
                              "PyTorch build lacks")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unknown torch.distributed backend {backend!r}")


class TorchPlane:
    """``torch.distributed`` collectives over the members of one process set (see the module
    docstring). Build with :meth:`create` on every member."""

    name = "torch"
    native = True  # takes torch tensors as they are (hora.core.op.device)

    def __init__(self, client: KVStoreClient, scope: str, rank: int, size: int,
                 timeout: float, iface: str = "") -> None:
        self._dist = import_torch()
        import torch

        self._torch = torch
        self._client, self._scope = client, scope
        self.rank, self.size = rank, size
        self._timeout = timeout
        self._iface = iface
        self._groups: dict[str, Any] = {}
        self.bell = Doorbell()

    @classmethod
    def create(cls, client: KVStoreClient, scope: str, rank: int, size: int,
               timeout: float, iface: str = "") -> TorchPlane:
        """Build the set's host-memory (gloo) group: collective over the set's members
        (``iface``: the network interface gloo binds, ``HORA_GLOO_IFACE``).

        Raises:
            ConfigError: PyTorch or torch.distributed is missing.
            RendezvousError: the members did not all meet within the timeout.
        """
        plane = cls(client, scope, rank, size, timeout, iface)
        plane._group("cpu")
        return plane

    def _group(self, device: str) -> Any:
        group = self._groups.get(device)
        if group is None:
            backend = "gloo" if device == "cpu" else "nccl"
            store = store_class()(self._client, f"{self._scope}.{backend}", self._timeout)
            try:
                group = make_group(backend, store, self.rank, self.size, self._timeout,
                                   self._iface)
            except RuntimeError as exc:
                raise RendezvousError(f"the torch data plane's {backend} group of {self.size} "
                                      f"ranks could not be built: {exc}") from exc
            self._groups[device] = group
            log.debug("torch data plane: %s group of %d ranks", backend, self.size)
        return group

    # ---- buffers -----------------------------------------------------------------------------
    def _tensor(self, buf: Any) -> Any:
        """A tensor over ``buf``'s memory: a host array's (a copy only for a read-only one), or
        ``buf`` itself when it is a tensor already (a device buffer's, on its device)."""
        if not isinstance(buf, np.ndarray):
            return buf
        if not buf.flags.writeable:
            buf = buf.copy()
        if str(buf.dtype) == "bfloat16":
            return self._torch.from_numpy(buf.view(np.int16)).view(self._torch.bfloat16)
        return self._torch.from_numpy(buf)

    def reduces(self, dtype: np.dtype[Any], op: str) -> bool:
        return str(dtype) in _REDUCIBLE and op in ("sum", "min", "max", "product")

    def _ticket(self, work: Any, keep: Any, device: str,
                after: Callable[[], None] | None = None) -> Ticket:
        """The op's ticket, finished by torch's completion callback. Host memory: ``after``
        runs in the callback. Device memory (NCCL's callback fires once the op is queued, not
        done): the waiter settles the ticket, ``work.wait()`` making its thread's stream wait
        for the op's, then runs ``after`` in that order."""
        if device == "cpu":
            ticket = Ticket(self.bell, keep=(work, keep))
        else:
            def settle() -> None:
                work.wait()
                if after is not None:
                    after()

            ticket = Ticket(self.bell, keep=keep, settle=settle)
            after = None

        def done(future: Any) -> None:
            try:
                future.value()
                if after is not None:
                    after()
            except Exception as exc:  # the op failed: the waiter reports it
                ticket.finish((str(exc) or type(exc).__name__)
                              + (NCCL_HINT if device != "cpu" else ""))
            else:
                ticket.finish()

        try:
            future = work.get_future()
        except RuntimeError:  # some gloo works (reduce_scatter) have no future: wait on a thread
            _waiter().put((work, done))
        else:
            future.add_done_callback(done)
        return ticket

    def _op(self, op: str) -> Any:
        return {"sum": self._dist.ReduceOp.SUM, "min": self._dist.ReduceOp.MIN,
                "max": self._dist.ReduceOp.MAX, "product": self._dist.ReduceOp.PRODUCT}[op]

    # ---- collectives -------------------------------------------------------------------------
    # Each takes host arrays or tensors (on one device); the group follows the device.
    def allreduce(self, buf: Any, op: str) -> Ticket:
        t = self._tensor(buf)
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._op(op)
        device = t.device.type
        return self._ticket(self._group(device).allreduce([t], opts), t, device)

    def allgather(self, send: Any, counts: Sequence[int], out: Any) -> Ticket:
        s, o = self._tensor(send), self._tensor(out)
        device = o.device.type
        group = self._group(device)
        width = max(counts) if counts else 0
        if all(c == width for c in counts):  # gathered as equal blocks straight into `out`
            outs = [o[i * width:(i + 1) * width] for i in range(self.size)]
            return self._ticket(group.allgather([outs], [s]), outs, device)
        # uneven (gloo gathers equal blocks only): blocks padded to the widest, then each
        # block's own part moves into `out`
        padded = o.new_zeros(width * self.size)
        mine = o.new_zeros(width)
        mine[:s.numel()] = s
        outs = [padded[i * width:(i + 1) * width] for i in range(self.size)]

        def compact() -> None:
            offset = 0
            for i, count in enumerate(counts):
                o[offset:offset + count] = padded[i * width:i * width + count]
                offset += count

        work = group.allgather([outs], [mine])
        return self._ticket(work, (outs, mine, padded, o), device, after=compact)

    def broadcast(self, buf: Any, root: int) -> Ticket:
        t = self._tensor(buf)
        opts = self._dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        device = t.device.type
        return self._ticket(self._group(device).broadcast([t], opts), t, device)

    def alltoall(self, send: Any, send_counts: Sequence[int], out: Any,
                 recv_counts: Sequence[int]) -> Ticket:
        s, r = self._tensor(send), self._tensor(out)
        device = r.device.type
        work = self._group(device).alltoall_base(r, s, list(recv_counts), list(send_counts),
                                                 self._dist.AllToAllOptions())
        return self._ticket(work, (s, r), device)

    def reducescatter(self, buf: Any, counts: Sequence[int], op: str, out: Any) -> Ticket:
        t = self._tensor(buf)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        parts = [t[offsets[i]:offsets[i + 1]] for i in range(self.size)]
        target = self._tensor(out)
        opts = self._dist.ReduceScatterOptions()
        opts.reduceOp = self._op(op)
        device = target.device.type
        work = self._group(device).reduce_scatter([target], [parts], opts)
        return self._ticket(work, (parts, target), device)

    def close(self) -> None:
        self._groups.clear()  # torch frees a group with its last reference
        self.bell.close()
        self._client.close()



_WAITS: queue.SimpleQueue[tuple[Any, Callable[[Any], None]]] | None = None


def _waiter() -> queue.SimpleQueue[tuple[Any, Callable[[Any], None]]]:
    """The queue of the thread that waits for works without a future (started on first use)."""
    global _WAITS
    if _WAITS is None:
        waits: queue.SimpleQueue[tuple[Any, Callable[[Any], None]]] = queue.SimpleQueue()

        def run() -> None:
            while True:
                work, done = waits.get()
                done(_Waited(work))

        threading.Thread(target=run, name="hora-torch-wait", daemon=True).start()
        _WAITS = waits
    return _WAITS


class _Waited:
    """A finished work seen as a future: ``value()`` waits for it and raises its error."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def value(self) -> None:
        self._work.wait()
