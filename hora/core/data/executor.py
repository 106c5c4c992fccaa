"""Execution of negotiated responses on this rank: fuse, run the collective, unpack, complete.

Each executor is driven by one thread at a time: the engine's own executor by the engine thread;
a fast lane's executor (built by :meth:`hora.core.lane.lanes.Lanes.lane_executor`) by whichever
thread drives that lane (its lane thread or a waiting caller). An executor calls nothing back:
the engine tells the lanes what was negotiated before it runs a response. Each
:class:`~hora.core.op.messages.Response` is executed identically (same algorithm, same sizes)
by every member of its process set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from hora._util.log import get_logger
from hora.collectives.comm import Comm, SubComm
from hora.collectives.ops import SUPPORTED_DTYPES as DTYPES
from hora.collectives.ops import ReduceOp, scale_inplace, to_dtype
from hora.config import Config
from hora.core.data import aligned, device_exec, host_forms, paths
from hora.core.data.device_exec import holds_device, stage
from hora.core.data.routing import Route, SetSite, close_quietly
from hora.core.op.entry import Buffer, Entry
from hora.core.op.messages import ERROR_DEADLOCK, ERROR_SHUTDOWN, ERROR_STALL, OpKind, Response
from hora.core.op.process_set import Registry
from hora.errors import (
    DeadlockError,
    HoraInternalError,
    HoraTimeoutError,
    MismatchError,
    ShutdownError,
    op_error,
)
from hora.timeline.writer import (
    MEMCPY_IN_FUSION_BUFFER,
    MEMCPY_OUT_FUSION_BUFFER,
    Timeline,
    collective_activity,
)

log = get_logger(__name__)

_OPS = {int(op): op for op in ReduceOp}

_may_share_memory = np.may_share_memory

# (module constants: an enum member read through its class costs 100-200 ns in Python 3.11,
# and every response runs these tests)
_ERROR, _ALLREDUCE = OpKind.ERROR, OpKind.ALLREDUCE
_CONTROL = (OpKind.BARRIER, OpKind.JOIN, OpKind.REMOVE_PROCESS_SET, OpKind.ADD_PROCESS_SET)
_AVERAGE, _ADASUM = ReduceOp.Average, ReduceOp.Adasum

_ERROR_TYPES: dict[int, type[HoraInternalError]] = {
    ERROR_SHUTDOWN: ShutdownError, ERROR_STALL: HoraTimeoutError, ERROR_DEADLOCK: DeadlockError,
}


class Executor:
    """Runs responses over the global data-plane comm."""

    def __init__(self, comm: Comm, registry: Registry, config: Config,
                 timeline: Timeline | None = None, hostnames: list[str] | None = None,
                 job_id: str = "") -> None:
        self._tl = timeline if timeline is not None else Timeline()
        # False for a fast lane's executor: its timeline never records (a lane exists only
        # without a configured timeline), so its ops skip the timeline hooks without a call
        self._recordable = timeline is not None
        # no device buffers in this job (its plane moves no framework's tensors as they are):
        # the device forms are never looked for
        self._host_only = not paths.native_frameworks(config)
        self._comm = comm
        self._registry = registry
        self._config = config
        self._hostnames = hostnames
        self._job_id = job_id
        self._subcomms: dict[int, Comm] = {}
        self._routes: dict[int, Route] = {}
        self._fusion = np.empty(0, dtype=np.uint8)
        self._scratch = np.empty(0, dtype=np.uint8)
        self.unfinished: list[Entry] = []
        """Ops of a collective that failed: the engine fails them (:meth:`fail_unfinished`) with
        the job's error once it has heard the other ranks' reasons, since a connection lost here
        is often only the echo of another rank's failure (its waiters wait until then)."""
        # rank 0 with autotune on: sees each allreduce and allgather it runs (the score)
        self.observe: Callable[[Response], None] | None = None

    def comm_for(self, set_id: int) -> Comm:
        comm = self._subcomms.get(set_id)
        if comm is None:
            ranks = self._registry.ranks(set_id)
            if ranks is None:
                raise MismatchError(f"process set {set_id} is not registered on this rank")
            comm = self._comm if set_id == 0 else SubComm(self._comm, ranks)
            self._subcomms[set_id] = comm
        return comm

    def route_for(self, set_id: int) -> Route:
        """The set's data path, built (collectively) at its first data collective."""
        route = self._routes.get(set_id)
        if route is None:
            comm = self.comm_for(set_id)
            ranks = self._registry.ranks(set_id) or []
            hosts = self._hostnames or ["localhost"] * self._comm.size
            route = paths.build_set_route(SetSite(self._comm, ranks, comm,
                                                  [hosts[r] for r in ranks], self._config,
                                                  self._job_id, set_id))
            self._routes[set_id] = route
            log.info("process set %d (%d ranks) data path: %s", set_id, comm.size, route.name)
        return route

    def existing_route(self, set_id: int) -> Route | None:
        """The set's route if it was built already."""
        return self._routes.get(set_id)

    def adopt_route(self, set_id: int, route: Route) -> None:
        """Use ``route`` for ``set_id`` (an executor of the fast lane, over its own group)."""
        self._routes[set_id] = route

    def retune(self, config: Config) -> None:
        """Autotune: build routes by ``config`` from now on. When a hierarchical choice changed,
        every route without shared memory over its whole set (a set across hosts) is dropped,
        to be rebuilt at its next collective; every member retunes at the same point of the
        response order (:mod:`hora.core.autotune.autotune`), so all of them rebuild it together."""
        old, self._config = self._config, config
        if (old.hierarchical_allreduce, old.hierarchical_allgather) == (
                config.hierarchical_allreduce, config.hierarchical_allgather):
            return
        for set_id, route in list(self._routes.items()):
            if route.group is None and route.lane_group is None:
                self.forget_set(set_id)

    def route_name(self, set_id: int) -> str | None:
        """The data path a set uses ('shm', 'ring', 'shard', 'leader'), once it has one."""
        route = self._routes.get(set_id)
        return None if route is None else route.name

    def forget_set(self, set_id: int) -> None:
        self._subcomms.pop(set_id, None)
        route = self._routes.pop(set_id, None)
        if route is not None:
            close_quietly(route)

    def close(self) -> None:
        """Release every route's shared memory (local; not collective)."""
        for set_id in list(self._routes):
            self.forget_set(set_id)

    def fail_unfinished(self, error: BaseException) -> None:
        """Fail every op in :attr:`unfinished` with ``error`` (a fresh copy each)."""
        entries, self.unfinished = self.unfinished, []
        for entry in entries:
            entry.handle.set_error(op_error(error, entry.request.name))

    def execute(self, resp: Response, entries: dict[str, Entry]) -> None:
        """Run ``resp``; ``entries`` are this rank's local ops by name (popped when done)."""
        kind = resp.kind
        if kind is _ERROR:
            for name in resp.names:
                entry = entries.pop(name, None)
                if entry is not None:
                    error_type = _ERROR_TYPES.get(resp.value, MismatchError)
                    entry.handle.set_error(error_type(resp.error))
            return
        tl = self._tl
        if kind in _CONTROL:
            self._control_op(resp, entries)
            tl.op_end(resp.names[0])
            return
        route = self._routes.get(resp.set_id)
        if route is None:
            route = self.route_for(resp.set_id)
        if self.observe is not None:
            self.observe(resp)
        if kind is _ALLREDUCE:
            try:
                self._allreduce(route, resp, entries)
            except BaseException as exc:
                for name in resp.names:
                    tl.error(name, str(exc))
                raise
            return
        entry = entries.pop(resp.names[0])
        try:
            tl.activity_start(resp.names[0], collective_activity("hora", kind))
            host, on_device = _FORMS[kind]
            plane = None if self._host_only else self._on_device(route, [entry])
            result = (host(self, route, resp, entry) if plane is None
                      else on_device(plane, resp, entry, self))
        except BaseException as exc:
            tl.error(resp.names[0], str(exc))
            self.unfinished.append(entry)  # the caller aborts the job, then fails it
            raise
        tl.op_end(resp.names[0], resp.dtype, resp.shapes[0] if resp.shapes else ())
        _complete(entry, result)

    def execute_one(self, resp: Response, entry: Entry) -> None:
        """:meth:`execute` of ``resp`` for one local op (the fast lane's single ops), with its
        common case written out: one host allreduce that nothing observes or records, reduced
        over the route at once (no dict of entries, no fusion path; ~1 us less per op)."""
        route = self._routes.get(resp.set_id)
        out, x = entry.output, entry.tensor
        if resp.kind is not _ALLREDUCE or route is None or self.observe is not None \
                or not self._host_only or self._recordable or len(resp.names) != 1 \
                or resp.joined or resp.prescale != 1.0 or resp.op == _ADASUM \
                or type(out) is not np.ndarray or type(x) is not np.ndarray \
                or resp.names[0] != entry.request.name:
            self.execute(resp, {entry.request.name: entry})
            return
        try:  # (what _allreduce does for a single host tensor)
            src = None
            if out is not x:
                if not _may_share_memory(out, x):
                    src = x if x.ndim == 1 else x.reshape(-1)
                else:
                    np.copyto(out, x)
            buf = out if out.ndim == 1 else out.reshape(-1)
            scratch = self._scratch
            if scratch.nbytes < buf.nbytes:
                scratch = self._scratch_for(buf.nbytes)
            route.allreduce(buf, _OPS[resp.op], scratch, src=src, postscale=resp.postscale
                            / route.comm.size if resp.op == _AVERAGE else resp.postscale)
        except BaseException as exc:
            self._tl.error(resp.names[0], str(exc))
            self.unfinished.append(entry)  # see execute()
            raise
        if entry.finish is None:
            entry.handle.set_result(out)
        else:
            _complete(entry, out)

    # ---- ops --------------------------------------------------------------------------------
    def _control_op(self, resp: Response, entries: dict[str, Entry]) -> None:
        if resp.kind is OpKind.ADD_PROCESS_SET and resp.ranks is not None:
            self._registry.register(resp.ranks, resp.value)
        elif resp.kind is OpKind.REMOVE_PROCESS_SET:
            self._registry.remove(resp.value)
            self.forget_set(resp.value)
        entry = entries.pop(resp.names[0], None)
        if entry is not None:
            value: Any = resp.value if resp.kind is not OpKind.BARRIER else None
            _complete(entry, value)

    def _allreduce(self, route: Route, resp: Response, entries: dict[str, Entry]) -> None:
        dtype = DTYPES.get(resp.dtype) or to_dtype(resp.dtype)
        names = resp.names
        # Decided from the response alone, so every rank takes the same path (a shared-memory
        # allreduce must be staged on all ranks or on none).
        single = len(names) == 1 and not resp.joined
        if single:  # (one op: no comprehension, every step of the fast lane runs this)
            local = [entries.pop(names[0], None)]
            sizes = [math.prod(resp.shapes[0])]
        else:
            local = [entries.pop(n, None) for n in names]
            sizes = [math.prod(s) for s in resp.shapes]
        try:
            total = sum(sizes)
            if single and (local[0] is None or local[0].output is None):
                raise MismatchError(f"allreduce '{names[0]}' has no output on this rank")
            plane = None if self._host_only else self._on_device(route, local)
            like = device_exec.template(resp, local) if plane is not None else None
            if plane is not None and like is not None:  # on the device (the torch plane)
                if self._tl.recording:
                    self._tl.activity_start_all(names, collective_activity(route.name, resp.kind))
                device_exec.allreduce(plane, resp, local, like,
                                      self._scratch_for(total * dtype.itemsize), self._done)
                return
            if not single and resp.prescale == 1.0 and not resp.joined \
                    and route.takes_parts(total * dtype.itemsize, resp.op):
                self._allreduce_parts(route, resp, local, dtype)  # no fusion buffer
                return
            src = None  # the input, when the collective reads it from there (no copy in)
            if single:
                entry = local[0]
                assert entry is not None
                out, x = entry.output, entry.tensor
                assert isinstance(out, np.ndarray) and isinstance(x, np.ndarray), \
                    "a host form got a device buffer"
                if out is not x:
                    # (its bounds test: ~0.15 us; reading __array_interface__ costs ~2 us)
                    if resp.prescale == 1.0 and not _may_share_memory(out, x):
                        src = x if x.ndim == 1 else x.reshape(-1)
                    else:
                        np.copyto(out, x)
                buf = out if out.ndim == 1 else out.reshape(-1)
            else:
                self._tl.activity_start_all(names, MEMCPY_IN_FUSION_BUFFER)
                staged = (route.staging(total * dtype.itemsize)  # shared memory: packing is
                          if resp.op != _ADASUM else None)  # the only copy (not Adasum's)
                buf = (staged.view(dtype) if staged is not None
                       else self._fusion_view(dtype, total))
                offset = 0
                for entry, n in zip(local, sizes):
                    if entry is None:  # this rank joined: contribute zeros
                        buf[offset:offset + n] = 0
                    else:
                        buf[offset:offset + n] = _host(entry.tensor).reshape(-1)
                    offset += n
            postscale = resp.postscale
            if resp.op == _AVERAGE:
                postscale = postscale / route.comm.size
            if resp.prescale != 1.0:
                scale_inplace(buf, resp.prescale)
            recording = self._recordable and self._tl.recording
            if recording:
                self._tl.activity_start_all(names, collective_activity(route.name, resp.kind))
            scratch = self._scratch  # (enough for one ring chunk, or for a whole small buffer)
            if scratch.nbytes < buf.nbytes:
                scratch = self._scratch_for(buf.nbytes)
            route.allreduce(buf, _OPS[resp.op], scratch,  # Adasum: each tensor's size
                            counts=sizes if resp.op == _ADASUM and not single else None,
                            src=src, postscale=postscale)
            if single and not recording:
                entry = local[0]
                assert entry is not None
                if entry.finish is None:
                    entry.handle.set_result(entry.output)
                else:
                    _complete(entry, entry.output)
                return
            if not single and recording:
                self._tl.activity_start_all(names, MEMCPY_OUT_FUSION_BUFFER)
            offset = 0
            for name, entry, n, shape in zip(names, local, sizes, resp.shapes):
                if recording:
                    self._tl.op_end(name, resp.dtype, shape)
                if entry is not None:
                    if not single:
                        result = (_host(entry.output) if entry.output is not None
                                  else aligned.empty(shape, dtype))
                        result.reshape(-1)[...] = buf[offset:offset + n]
                        entry.output = result
                    _complete(entry, entry.output)
                offset += n
        except BaseException:
            self.unfinished.extend(e for e in local if e is not None)  # see execute()
            raise

    def _allreduce_parts(self, route: Route, resp: Response, local: list[Entry | None],
                         dtype: np.dtype[Any]) -> None:
        """A fused allreduce of host arrays without a fusion buffer: each op's input read, and
        its result written, where it lives (:meth:`Route.allreduce_parts`)."""
        srcs: list[np.ndarray | None] = []
        dsts: list[np.ndarray] = []
        for entry, shape in zip(local, resp.shapes):
            assert entry is not None, "a joined rank's response is packed"
            x = _host(entry.tensor)
            if entry.output is None:
                entry.output = aligned.empty(shape, dtype)
            out = _host(entry.output)
            if out is not x and _may_share_memory(out, x):
                np.copyto(out, x)
            srcs.append(None if out is x or _may_share_memory(out, x) else x.reshape(-1))
            dsts.append(out.reshape(-1))
        recording = self._recordable and self._tl.recording
        if recording:  # (the fusion's copies are the collective's first and last passes here:
            # zero-length phases, so a timeline still shows which ops were fused, as Horovod's)
            self._tl.activity_start_all(resp.names, MEMCPY_IN_FUSION_BUFFER)
            self._tl.activity_start_all(resp.names, collective_activity(route.name, resp.kind))
        route.allreduce_parts(dsts, _OPS[resp.op], srcs, resp.postscale / route.comm.size
                              if resp.op == _AVERAGE else resp.postscale)
        if recording:
            self._tl.activity_start_all(resp.names, MEMCPY_OUT_FUSION_BUFFER)
        for name, entry, shape in zip(resp.names, local, resp.shapes):
            if recording:
                self._tl.op_end(name, resp.dtype, shape)
            assert entry is not None
            _complete(entry, entry.output)

    def root_index(self, resp: Response) -> int:
        """A broadcast's root as an index into its set's members."""
        return (self._registry.ranks(resp.set_id) or []).index(resp.root)

    # ---- buffers ----------------------------------------------------------------------------
    def _fusion_view(self, dtype: np.dtype[Any], count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self._fusion.nbytes < nbytes:
            self._fusion = np.empty(max(nbytes, 2 * self._fusion.nbytes), dtype=np.uint8)
        return self._fusion[:nbytes].view(dtype)

    def scratch_for(self, nbytes: int) -> np.ndarray:
        """The scratch buffer, at least ``nbytes`` (enough for one ring chunk, or the whole
        buffer for star/small algorithms)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 4096), dtype=np.uint8)
        return self._scratch

    _scratch_for = scratch_for

    # ---- device buffers (hora.core.op.device) -------------------------------------------------
    def _on_device(self, route: Route,
                   local: list[Entry | None]) -> device_exec.DeviceRoute | None:
        """``route`` when this rank's ops of a response all hold device buffers and the route
        takes them as they are (:attr:`Route.native`: the device forms,
        :mod:`hora.core.data.device_exec`, run); otherwise None, after staging any device
        buffer through host memory (the host forms run). Called only in a job whose plane
        moves some framework's tensors (adapters make device buffers only for such a plane)."""
        if route.native and all(e is None or holds_device(e) for e in local):
            return cast(device_exec.DeviceRoute, route)
        for e in local:
            if e is not None and holds_device(e):
                stage(e)
        return None

    def _done(self, entry: Entry, result: Any) -> None:
        """A device form's op completed (its timeline mark, then its handle)."""
        if self._tl.recording:
            self._tl.op_end(entry.request.name, entry.request.dtype, entry.request.shape)
        _complete(entry, result)


HostForm = Callable[[device_exec.Site, Route, Response, Entry], Any]

_FORMS: dict[OpKind, tuple[HostForm, device_exec.Form]] = {
    OpKind.ALLGATHER: (host_forms.allgather, device_exec.allgather),
    OpKind.BROADCAST: (host_forms.broadcast, device_exec.broadcast),
    OpKind.ALLTOALL: (host_forms.alltoall, device_exec.alltoall),
    OpKind.REDUCESCATTER: (host_forms.reducescatter, device_exec.reducescatter),
}
"""The one dispatch of the data path by op kind, for every collective but allreduce (which
fuses, :meth:`Executor._allreduce`) and the control ops: (host form, device form). A new
collective is one row here, its host form (:mod:`hora.core.data.host_forms`) and its device
form."""


def _complete(entry: Entry, result: Any) -> None:
    if entry.finish is not None:
        result = entry.finish(result)
    entry.handle.set_result(result)


def _host(x: Buffer | None) -> np.ndarray:
    """``x`` as the host array the host forms work on (device buffers were staged before)."""
    assert isinstance(x, np.ndarray), "a host form got a device buffer"
    return x
