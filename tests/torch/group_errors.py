"""Case group: error cases raise the documented error, on every rank, and never hang.

Job size: 3 ranks, process set [0, 1] registered at init (rank 2 is outside it). After each
error the job goes on (the last case checks that collectives still work).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NP = 3
PAIR = [0, 1]
_SETS: dict[str, Any] = {}


def init(hvd: Any) -> None:
    _SETS["pair"] = hvd.ProcessSet(PAIR)
    hvd.init(process_sets=[_SETS["pair"]])


def _raises(exc_type: type[BaseException], *fragments: str) -> Any:
    class _Ctx:
        def __enter__(self) -> None:
            return None

        def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
            assert et is not None, f"expected {exc_type.__name__}, nothing was raised"
            assert issubclass(et, exc_type), f"expected {exc_type.__name__}, got {et!r}: {ev}"
            for fragment in fragments:
                assert fragment in str(ev), f"{fragment!r} not in {str(ev)!r}"
            return True

    return _Ctx()


def mismatched_shapes(hvd: Any, f: Any) -> None:
    r = hvd.rank()
    with _raises(hvd.HorovodInternalError, "Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(torch.zeros(3 if r else 4), name="bad.shape")
    with _raises(hvd.HorovodInternalError, "Mismatched ALLGATHER tensor shapes", "dimension 1"):
        hvd.allgather(torch.zeros(2, 3 if r else 4), name="bad.ag")
    with _raises(hvd.HorovodInternalError, "Mismatched BROADCAST tensor shapes"):
        hvd.broadcast(torch.zeros(2, 1 + r), 0, name="bad.bc")
    with _raises(hvd.HorovodInternalError, "rank-zero tensor"):
        hvd.allgather(torch.tensor(float(r)), name="bad.scalar")
    handle = hvd.allreduce_async_(torch.zeros(2 + (r == 2)), name="bad.async")
    with _raises(hvd.HorovodInternalError, "Mismatched"):
        hvd.synchronize(handle)


def mismatched_dtypes(hvd: Any, f: Any) -> None:
    r = hvd.rank()
    dtype = torch.float64 if r == 1 else torch.float32
    with _raises(hvd.HorovodInternalError, "Mismatched data types"):
        hvd.allreduce(torch.zeros(3, dtype=dtype), name="bad.dtype")
    with _raises(hvd.HorovodInternalError, "Mismatched BROADCAST root ranks"):
        hvd.broadcast(torch.zeros(2), r % 2, name="bad.root")
    with _raises(hvd.HorovodInternalError, "Mismatched reduction operation"):
        hvd.allreduce(torch.zeros(2), op=hvd.Sum if r else hvd.Max, name="bad.op")


def device_mismatch(hvd: Any, f: Any) -> None:
    """One rank's tensor 'lives on a GPU' (its request says cuda): every rank fails."""
    from hora.torch import ops

    real = ops.device_kind
    if hvd.rank() == 1:
        ops.device_kind = lambda t: "cuda"
    try:
        with _raises(hvd.HorovodInternalError, "CPU/GPU device selection"):
            # (a tensor that records gradients takes the bridge's path, where device_kind is)
            hvd.allreduce(torch.ones(2, requires_grad=True), name="bad.device")
    finally:
        ops.device_kind = real
    meta = torch.empty(2, device="meta")
    with _raises(ValueError, "Tensors in list must be on same device."):
        hvd.grouped_allreduce([torch.ones(2), meta])


def zero_grad_pending(hvd: Any, f: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    with _raises(AssertionError, "optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    with _raises(AssertionError, "Gradients were computed more than backward_passes_per_step"):
        model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()


def generator_params(hvd: Any, f: Any) -> None:
    model = nn.Linear(2, 2)
    with _raises(ValueError, "invalid params of type"):
        hvd.broadcast_parameters(model.parameters(), root_rank=0)
    with _raises(ValueError, "invalid params of type"):
        hvd.broadcast_parameters(model.named_parameters(), root_rank=0)


def not_in_process_set(hvd: Any, f: Any) -> None:
    pair = _SETS["pair"]
    r = hvd.rank()
    if r in PAIR:
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="pair.ok", process_set=pair)
        assert torch.all(out == 2)
        return
    for call in (lambda: hvd.allreduce(torch.ones(2), process_set=pair),
                 lambda: hvd.allgather(torch.ones(2), process_set=pair),
                 lambda: hvd.broadcast(torch.ones(2), 0, process_set=pair),
                 lambda: hvd.barrier(process_set=pair)):
        with _raises(ValueError, f"Rank {r} is not a member"):
            call()
    with _raises(ValueError, "invalid root rank"):
        hvd.broadcast(torch.ones(2), 5)


def bad_arguments(hvd: Any, f: Any) -> None:
    n = hvd.size()
    with _raises(horovod_error := hvd.HorovodInternalError, "only supports AVERAGE and SUM"):
        hvd.reducescatter(torch.ones(n, 2), op=hvd.Max)
    assert issubclass(horovod_error, RuntimeError)
    with _raises(ValueError, "Reducescatter does not support scalar inputs"):
        hvd.reducescatter(torch.tensor(1.0))
    with _raises(ValueError, "Adasum reduces floating-point tensors"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with _raises(NotImplementedError, f"non-power of 2 ranks is not supported yet: this "
                 f"process set has {n} ranks"):  # a 3-rank job
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with _raises(NotImplementedError, f"process set has {n} ranks"):
        hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1),
                                 op=hvd.Adasum)
    with _raises(ValueError, "not an even multiple of the number of workers"):
        hvd.alltoall(torch.ones(n + 1))
    with _raises(ValueError, "int32"):
        hvd.alltoall(torch.ones(n), splits=torch.ones(n))
    with _raises(ValueError, "one non-negative entry per rank"):
        hvd.alltoall(torch.ones(n), splits=[1])
    with _raises(ValueError, "more than the first dimension"):
        hvd.alltoall(torch.ones(n), splits=[2] * n)
    with _raises(ValueError, "The op parameter supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    # A duplicate in-flight name: the op cannot complete (and free its name) before the check,
    # because one rank submits it only after a barrier; two rounds so every rank checks.
    for late in (0, 1):
        name = f"dup.{late}"
        handle = None
        if hvd.rank() != late:
            handle = hvd.allreduce_async(torch.ones(1), name=name)
            with _raises(ValueError, "same name as another tensor that is currently being "
                                     "processed"):
                hvd.allreduce_async(torch.ones(1), name=name)
        hvd.barrier()
        if handle is None:
            handle = hvd.allreduce_async(torch.ones(1), name=name)
        assert hvd.synchronize(handle).item() == 1
    with _raises(ValueError, "expected at least 2D input"):
        hvd.SyncBatchNorm(2)(torch.ones(2))


def still_working(hvd: Any, f: Any) -> None:
    out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after.errors")
    assert torch.all(out == hvd.size())
    hvd.barrier()


def cases() -> list[tuple[str, Any]]:
    return [(fn.__name__, fn) for fn in (
        mismatched_shapes, mismatched_dtypes, device_mismatch, zero_grad_pending,
        generator_params, not_in_process_set, bad_arguments, still_working)]
