"""hora.torch in this process as a 1-rank job: argument checking, zero-copy conversion, the
size-1 pass-through, and Horovod's public surface (multi-rank behaviour is in the job tests)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import hora.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


HOROVOD_TORCH_NAMES = """
Compression DistributedOptimizer HorovodInternalError ProcessSet SyncBatchNorm Average Sum Adasum
Min Max Product add_process_set allgather allgather_async allgather_object allreduce allreduce_
allreduce_async allreduce_async_ alltoall alltoall_async barrier broadcast broadcast_
broadcast_async broadcast_async_ broadcast_object broadcast_optimizer_state broadcast_parameters
ccl_built cross_rank cross_size cuda_built ddl_built global_process_set gloo_built gloo_enabled
grouped_allgather grouped_allgather_async grouped_allreduce grouped_allreduce_
grouped_allreduce_async grouped_allreduce_async_ grouped_reducescatter
grouped_reducescatter_async init is_initialized join local_rank local_size mpi_built
mpi_enabled mpi_threads_supported nccl_built poll rank reducescatter reducescatter_async
remove_process_set rocm_built shutdown size sparse_allreduce_async start_timeline stop_timeline
synchronize
""".split()


def test_public_surface_matches_horovod_torch() -> None:
    missing = [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)]
    assert not missing
    from hora.torch import mpi_ops

    assert mpi_ops.allreduce_async_ is hvd.allreduce_async_


@pytest.mark.parametrize("dtype,call", [
    (torch.bool, lambda t: hvd.allreduce(t)), (torch.uint8, lambda t: hvd.allreduce_(t)),
    (torch.int16, lambda t: hvd.allreduce_async(t)), (torch.int8, lambda t: hvd.reducescatter(t)),
    (torch.complex64, lambda t: hvd.allgather(t)), (torch.bool, lambda t: hvd.broadcast_(t, 0)),
    (torch.bool, lambda t: hvd.alltoall(t)),
])
def test_unsupported_dtype_message(dtype: torch.dtype, call: object) -> None:
    t = torch.zeros(2, dtype=dtype)
    with pytest.raises(ValueError, match=rf"^Tensor type {t.type()} is not supported\.$"):
        call(t)  # type: ignore[operator]


def test_cpu_tensors_are_not_copied() -> None:
    x = torch.arange(4.0)
    assert hvd.allreduce_(x) is x and torch.equal(x, torch.arange(4.0))
    b = torch.ones(3, dtype=torch.bfloat16)
    ptr = b.data_ptr()
    assert hvd.allreduce_(b, op=hvd.Sum).data_ptr() == ptr
    out = hvd.allreduce(torch.ones(2, 3).t())  # non-contiguous input: accepted (superset)
    assert out.shape == (3, 2) and out.is_contiguous()
    view = torch.zeros(4, 4)[:, 1]
    view += 2
    hvd.allreduce_(view, op=hvd.Sum, postscale_factor=3.0)
    assert torch.all(view == 6)


def test_inplace_ops_bump_the_autograd_version() -> None:
    w = torch.ones(3, requires_grad=True)
    y = torch.ones(3)
    loss = (w * y).sum()  # y saved for backward
    hvd.allreduce_(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_handles() -> None:
    h1 = hvd.allreduce_async(torch.ones(1))
    h2 = hvd.broadcast_async_(torch.ones(1), 0)
    assert isinstance(h1, int) and h2 == h1 + 1
    hvd.init()  # already initialized: a no-op that keeps outstanding handles (Horovod: orphans)
    assert hvd.synchronize(h1).item() == 1 and hvd.synchronize(h2).item() == 1
    assert hvd.synchronize(h1) is None
    with pytest.raises(ValueError, match="was not created or has been cleared"):
        hvd.poll(h1)
    fn = hvd.sparse_allreduce_async(torch.eye(3).to_sparse(), "sp", hvd.Average)
    assert torch.equal(fn().to_dense(), torch.eye(3))


def test_compression() -> None:
    x = torch.linspace(0, 1, 5, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(x)
    assert c.dtype is torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype is x.dtype
    i = torch.arange(3)
    assert hvd.Compression.fp16.compress(i) == (i, None)
    assert hvd.Compression.none.compress(x) == (x, None)

    class Double:  # a user compressor: the two static methods are the whole interface
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, object]:
            return t * 2, None

        @staticmethod
        def decompress(t: torch.Tensor, ctx: object) -> torch.Tensor:
            return t / 2

    assert torch.equal(hvd.allreduce(x, compression=Double), x)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_optimizer_is_a_pass_through_on_one_rank() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opt_a = _opt(a)
    opt_b = hvd.DistributedOptimizer(_opt(b), named_parameters=b.named_parameters())
    assert isinstance(opt_b, torch.optim.SGD) and type(opt_b).__name__ == "SGD"
    assert opt_b._hook_handles == []  # quirk 20: no hooks when size() == 1
    for opt, model in ((opt_a, a), (opt_b, b)):
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(4, 3)).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_elastic_env_installs_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOROVOD_ELASTIC (a knob, read at init like every other) makes a 1-rank job hook up."""
    hvd.shutdown()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    hvd.init()
    try:
        model = nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(_opt(model))
        assert len(opt._hook_handles) == 2
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        opt.step()
    finally:
        hvd.shutdown()
        monkeypatch.delenv("HOROVOD_ELASTIC")
        hvd.init()


def test_named_parameters_validation() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(_opt(model), named_parameters=list(model.parameters()))
    dup = [("w", p) for p in model.parameters()]
    with pytest.raises(ValueError, match="must be unique. Found duplicates: w"):
        hvd.DistributedOptimizer(_opt(model), named_parameters=dup)
    some = list(model[0].named_parameters())
    with pytest.raises(ValueError, match="were not named. Python object ids: "):
        hvd.DistributedOptimizer(_opt(model), named_parameters=some)
    extra = list(model.named_parameters()) + [("unused", torch.zeros(1))]
    hvd.DistributedOptimizer(_opt(model), named_parameters=extra)  # extra names are fine
    two_groups = torch.optim.SGD([{"params": model[0].parameters()},
                                  {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    opt = hvd.DistributedOptimizer(two_groups)
    names = list(opt._parameter_names.values())
    assert len(set(names)) == 4 and names[0] == "allreduce.noname.0.0"
    assert opt.param_groups[1]["lr"] == 0.5


def test_option_validation() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported"):
        hvd.DistributedOptimizer(_opt(model), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd.DistributedOptimizer(_opt(model), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="groups should be"):
        hvd.DistributedOptimizer(_opt(model), groups="two")
    with pytest.raises(ValueError, match="groups must consist of tensors"):
        hvd.DistributedOptimizer(_opt(model), groups=[[1.0]])
    with pytest.raises(ValueError, match="only appear once"):
        hvd.DistributedOptimizer(_opt(model), groups=[[model.weight], [model.weight]])
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(_opt(model), num_groups=1)
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS state"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)


def test_sync_batch_norm_one_rank_and_cpu() -> None:
    torch.manual_seed(0)
    ref, sync = nn.BatchNorm2d(3), hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2)
    assert torch.allclose(sync(x), ref(x))
    assert torch.allclose(sync.running_mean, ref.running_mean)
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(x), ref(x))
    assert isinstance(sync, nn.modules.batchnorm._BatchNorm)


def test_deprecated_average_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.allreduce(torch.ones(1), average=True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
