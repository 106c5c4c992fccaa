"""Case group: on the torch data plane hora.torch's tensors reach ``torch.distributed`` as they
are, on their device (no host copy). Job size: 2 ranks, ``--data-plane torch``.

The device is ``HORA_TEST_DEVICE`` (default ``cpu``: gloo moves the tensors; ``cuda``: NCCL,
each rank on GPU ``local_rank``). The cases watch two real functions without changing them:
``TorchPlane._tensor`` (what the plane is handed) and ``TorchBuffer.to_host`` (a device buffer
staged through host memory).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hora.core.op.device import DeviceBuffer
from hora.torch.buffers import TorchBuffer
from hora.transports.torch_plane import TorchPlane

NP = 2
DEVICE = os.environ.get("HORA_TEST_DEVICE", "cpu")
SEEN: dict[str, list[Any]] = {"handed": [], "staged": []}


def _watch() -> None:
    tensor, to_host = TorchPlane._tensor, TorchBuffer.to_host

    def handed(self: TorchPlane, buf: Any) -> Any:
        SEEN["handed"].append(type(buf).__module__.split(".")[0])
        return tensor(self, buf)

    def staged(self: TorchBuffer) -> Any:
        SEEN["staged"].append(self.shape)
        return to_host(self)

    TorchPlane._tensor = handed  # type: ignore[method-assign]
    TorchBuffer.to_host = staged  # type: ignore[method-assign]


def init(hvd: Any) -> None:
    hvd.init()
    if DEVICE == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    _watch()


def _t(values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _clear() -> None:
    for seen in SEEN.values():
        seen.clear()


def the_bridge_hands_over_the_tensor(hvd: Any, f: Any) -> None:
    x = _t([1.0, 2.0])
    host = hvd.ops.TORCH.host(x, "reduce")
    assert isinstance(host.array, DeviceBuffer), type(host.array)
    assert host.array.native.data_ptr() == x.data_ptr()
    assert host.array.device == DEVICE


def every_collective_moves_tensors(hvd: Any, f: Any) -> None:
    _clear()
    r = hvd.rank()
    x = _t([1.0, 2.0, 3.0]) * (r + 1)
    ptr = x.data_ptr()
    hvd.allreduce_(x, op=hvd.Sum, name="dev.inplace")
    assert x.data_ptr() == ptr and x.tolist() == [3.0, 6.0, 9.0], x
    handles = [hvd.allreduce_async(_t([float(r)] * (k + 1)), name=f"dev.fused{k}",
                                   op=hvd.Average, prescale_factor=2.0) for k in range(4)]
    for k, h in enumerate(handles):
        out = hvd.synchronize(h)
        assert out.device.type == DEVICE and out.tolist() == [1.0] * (k + 1), out
    g = hvd.grouped_allreduce([_t([r, r], torch.int32), _t([r + 0.5], torch.float64)],
                              op=hvd.Sum, name="dev.grouped")
    assert g[0].tolist() == [1, 1] and g[1].tolist() == [2.0], g
    gathered = hvd.allgather(_t(list(range(r + 1)), torch.int16), name="dev.gather")
    assert gathered.dtype == torch.int16 and gathered.tolist() == [0, 0, 1], gathered
    b = hvd.broadcast(_t([r, r + 1], torch.bfloat16), root_rank=1, name="dev.bcast")
    assert b.tolist() == [1.0, 2.0], b
    sent = _t([10 * r, 10 * r + 1, 10 * r + 2])
    received, splits = hvd.alltoall(sent, splits=torch.tensor([1, 2], dtype=torch.int32),
                                    name="dev.a2a")
    assert received.tolist() == ([0.0, 10.0] if r == 0 else [1.0, 2.0, 11.0, 12.0]), received
    assert splits.tolist() == ([1, 1] if r == 0 else [2, 2]), splits
    share = hvd.reducescatter(_t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]) * (r + 1), op=hvd.Sum,
                              name="dev.rs")
    assert share.tolist() == ([[3.0, 6.0], [9.0, 12.0]] if r == 0 else [[15.0, 18.0]]), share
    assert SEEN["handed"] and set(SEEN["handed"]) == {"torch"}, SEEN["handed"]
    assert not SEEN["staged"], f"staged through host memory: {SEEN['staged']}"


def what_the_plane_cannot_reduce_is_staged(hvd: Any, f: Any) -> None:
    _clear()
    r = hvd.rank()
    x = _t([1.0, 0.0] if r == 0 else [0.0, 1.0])
    out = hvd.allreduce(x, op=hvd.Adasum, name="dev.adasum")
    assert out.device.type == DEVICE and out.tolist() == [1.0, 1.0], out
    assert SEEN["staged"] == [(2,)], SEEN["staged"]  # Adasum runs on hora's builtin path


def host_arrays_and_tensors_in_flight_together(hvd: Any, f: Any) -> None:
    """hora's numpy API beside hora.torch: ops the coordinator may fuse into one response, with
    host arrays and device buffers in it (the device buffers are then staged)."""
    import numpy as np

    import hora

    r = hvd.rank()
    handles = []
    for k in range(6):
        handles.append(hvd.allreduce_async(_t([float(r + k)] * 3), name=f"dev.mix.t{k}",
                                           op=hvd.Sum))
        handles.append(hora.allreduce_async(np.full(2, r + k, np.float32),
                                            name=f"dev.mix.n{k}", op=hora.Sum))
    for k in range(6):
        t, n = hvd.synchronize(handles[2 * k]), hora.synchronize(handles[2 * k + 1])
        assert t.device.type == DEVICE and t.tolist() == [2.0 * k + 1] * 3, t
        assert isinstance(n, np.ndarray) and n.tolist() == [2.0 * k + 1] * 2, n


def a_joined_rank_contributes_zeros(hvd: Any, f: Any) -> None:
    r = hvd.rank()
    if r == 0:
        out = hvd.allreduce(_t([4.0, 8.0]), op=hvd.Sum, name="dev.joined")
        assert out.tolist() == [4.0, 8.0], out
    last = hvd.join()
    assert last in (0, 1), last


CASES = [the_bridge_hands_over_the_tensor, every_collective_moves_tensors,
         what_the_plane_cannot_reduce_is_staged, host_arrays_and_tensors_in_flight_together,
         a_joined_rank_contributes_zeros]


def cases() -> list[tuple[str, Any]]:
    return [(fn.__name__, fn) for fn in CASES]
