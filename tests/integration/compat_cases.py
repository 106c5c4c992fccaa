"""Many tests in one process per rank, the way Horovod's CI runs its own test files.

Run by tests/integration/test_compat.py through ``compat_worker.py``: ``hora run -np 2``, one
pytest process per rank, every rank in the same shuffled order. Each test starts with
``hvd.init()`` (a no-op when already initialized), as Horovod's tests do, and must leave the
process in a state the next test survives, whichever it is: shut down, re-initialized with other
process sets, after a failed op, a deadlock, a join, a timeline.

Not collected by the main suite (the file name does not start with ``test_``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import pytest
import torch

import hora.torch as hvd


def _other_tensor(r: int) -> torch.Tensor:
    return torch.full((3,), float(r + 1))


def test_init_and_shutdown_a_hundred_times() -> None:
    for i in range(100):
        hvd.init()
        if i % 10 == 0:
            total = hvd.allreduce(torch.ones(2), op=hvd.Sum)
            assert total.tolist() == [hvd.size()] * 2
        hvd.shutdown()
    hvd.init()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_allreduce_names_stay_aligned_after_a_failed_allgather() -> None:
    """One rank's op fails because the other joined; later unnamed ops still pair up."""
    hvd.init()
    if hvd.rank() == 0:
        hvd.join()
    else:
        with pytest.raises(hvd.HorovodInternalError, match="not supported with Join"):
            hvd.allgather(torch.ones(2, 2))
        hvd.join()
    assert hvd.allgather_object(hvd.rank()) == list(range(hvd.size()))
    assert hvd.allgather(torch.ones(1, 2)).shape == (hvd.size(), 2)


def test_broadcast_object_when_only_the_root_has_the_object() -> None:
    hvd.init()
    obj = {"epoch": 3, "lr": [0.1]} if hvd.rank() == 0 else None
    assert hvd.broadcast_object(obj, root_rank=0) == {"epoch": 3, "lr": [0.1]}


def test_mismatched_shapes_fail_everywhere_and_the_job_goes_on() -> None:
    hvd.init()
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(torch.ones(hvd.rank() + 1))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def test_deadlock_fails_everywhere_and_the_job_goes_on() -> None:
    hvd.init()
    with pytest.raises(hvd.HorovodInternalError, match="Deadlock: .* waits in"):
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(2))
        else:
            hvd.barrier()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
    hvd.barrier()


def test_dynamic_process_sets_added_and_removed() -> None:
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    for _ in range(3):
        ps = hvd.add_process_set([1])
        if hvd.rank() == 1:
            out = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps)
            assert out.tolist() == [1.0, 1.0]
        assert hvd.remove_process_set(ps)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
    hvd.shutdown()
    hvd.init()


def test_static_process_sets_then_plain_init() -> None:
    hvd.shutdown()
    single = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
    hvd.init(process_sets=single)
    mine = single[hvd.rank()]
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine).item() == 1.0
    hvd.barrier()  # shutdown is job-wide: it would fail the other rank's op still in flight
    hvd.shutdown()
    hvd.init()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_join_on_every_rank_returns_the_last_rank() -> None:
    hvd.init()
    if hvd.rank() == 0:
        time.sleep(0.05)
    assert hvd.join() in range(hvd.size())


def test_join_with_uneven_allreduces() -> None:
    hvd.init()
    for _ in range(hvd.rank() + 1):
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="uneven")
        assert out.tolist()[0] in (1.0, 2.0)
    hvd.join()


def test_timeline_on_and_off() -> None:
    hvd.shutdown()
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
    try:
        hvd.init()
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(2):
                path = os.path.join(tmp, f"timeline{round_}.json")
                hvd.start_timeline(path)
                hvd.allreduce(torch.ones(4), name=f"timeline_probe{round_}")
                hvd.stop_timeline()
                if hvd.rank() == 0:
                    with open(path) as f:
                        assert f"timeline_probe{round_}" in json.dumps(json.load(f))
                hvd.barrier()
    finally:
        hvd.shutdown()
        del os.environ["HOROVOD_TIMELINE"]
    hvd.init()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_prescale_and_postscale_in_float16() -> None:
    hvd.init()
    factor = 0.1915194503788923
    x = torch.arange(-8, 9, dtype=torch.float16)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor)
    want = ((x.float() * factor).half().float() * hvd.size()).half()
    assert torch.equal(got, want)
    got = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor)
    assert torch.equal(got, ((x.float() * hvd.size()) * factor).half())


def test_integer_reducescatter_scales_in_float64() -> None:
    hvd.init()
    x = torch.arange(-10, 10, dtype=torch.int32).reshape(10, 2)
    got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.3)
    want = ((x.double() * 0.3).int() * hvd.size())
    rows = want.shape[0] // hvd.size()
    assert torch.equal(got, want[hvd.rank() * rows:(hvd.rank() + 1) * rows])


def test_async_ops_and_handles() -> None:
    hvd.init()
    handles = [hvd.allreduce_async(torch.full((5,), float(i)), op=hvd.Sum) for i in range(5)]
    for i, h in enumerate(handles):
        assert hvd.synchronize(h).tolist() == [i * hvd.size()] * 5
    h = hvd.allgather_async(_other_tensor(hvd.rank()).reshape(1, 3))
    assert hvd.synchronize(h).shape == (hvd.size(), 3)


def test_alltoall_and_grouped_ops() -> None:
    hvd.init()
    n = hvd.size()
    out, splits = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32), splits=[2] * n)
    assert splits.tolist() == [2] * n and out.numel() == 2 * n
    outs = hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], op=hvd.Sum)
    assert [o.tolist() for o in outs] == [[n] * 2, [n] * 3]


def test_numpy_and_torch_share_one_engine() -> None:
    import hora

    hvd.init()
    assert hora.allreduce(np.ones(2, np.float32), op=hora.Sum).tolist() == [hvd.size()] * 2
