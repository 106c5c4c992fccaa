"""Case group: DistributedOptimizer training equals 1-process training on the concatenated batch.

Job size: 2 ranks. Rank r trains on rows [4r, 4r+4) of an 8-row batch; the reference is the same
model trained in this process on all 8 rows with the plain optimizer (MSE loss, mean reduction,
so the average of the two half-batch gradients is the full-batch gradient).

Tolerances: float64 models must match to rtol 1e-10 / atol 1e-12 (only summation order
differs); float32 to 1e-5; fp16 compression to 2e-3 (gradients travel as float16); bfloat16
autocast to 3e-2 (bfloat16 matmuls on 4-row vs 8-row batches round differently).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hora.torch as hvd_module

NP = 2
F64 = {"rtol": 1e-10, "atol": 1e-12}
F32 = {"rtol": 1e-5, "atol": 1e-6}


def init(hvd: Any) -> None:
    hvd.init()


def _model(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return (torch.randn(8, 5, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype))


def _mine(hvd: Any, t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0] // hvd.size()
    return t[hvd.rank() * rows:(hvd.rank() + 1) * rows]


def _train(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _same_everywhere(hvd: Any, model: nn.Module) -> None:
    for name, p in model.state_dict().items():
        rows = hvd.allgather(p.detach().reshape(1, -1).double())
        assert torch.equal(rows[0], rows[-1]), f"{name} differs across ranks"


def _assert_close(got: nn.Module, want: nn.Module, tol: dict[str, float]) -> None:
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.allclose(a, b, **tol), f"{name}: max diff {(a - b).abs().max():.3g}"


def _equivalence(make_opt: Callable[[Any], Any], dtype: torch.dtype, tol: dict[str, float],
                 steps: int = 5, ref_opt: Callable[[Any], Any] | None = None,
                 **dist_kwargs: Any) -> Callable[[Any, Any], None]:
    def case(hvd: Any, f: Any) -> None:
        x, y = _batch(dtype)
        ref = _model(dtype)
        _train(ref, (ref_opt or make_opt)(ref.parameters()), x, y, steps)
        model = _model(dtype, seed=0 if hvd.rank() == 0 else 7)  # broadcast fixes rank 1
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                       named_parameters=model.named_parameters(), **dist_kwargs)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _train(model, opt, _mine(hvd, x), _mine(hvd, y), steps)
        _same_everywhere(hvd, model)
        _assert_close(model, ref, tol)
    return case


def _sgd(params: Any) -> Any:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _adam(params: Any) -> Any:
    return torch.optim.Adam(params, lr=0.01)


def _forced(overlap: bool | list[bool], case: Callable[[Any, Any], None]
            ) -> Callable[[Any, Any], None]:
    """``case`` with CPU gradients' allreduces started during backward (True) or from
    ``synchronize()`` (False), whatever the machine's cores; a list: per rank."""
    from hora.torch import optimizer

    def forced(hvd: Any, f: Any) -> None:
        optimizer.OVERLAP = overlap[hvd.rank()] if isinstance(overlap, list) else overlap
        try:
            case(hvd, f)
        finally:
            optimizer.OVERLAP = None
    return forced


def _inlined(threshold: int | list[int], case: Callable[[Any, Any], None]
             ) -> Callable[[Any, Any], None]:
    """``case`` without overlap, its hooks running the allreduces of gradients of at least
    ``threshold`` bytes on the backward thread (0: all); a list: per rank (a rank that does
    not leaves its peer's hook waiting until its ``synchronize()``)."""
    from hora.torch import optimizer

    def inlined(hvd: Any, f: Any) -> None:
        saved = optimizer.INLINE_BYTES
        optimizer.INLINE_BYTES = (threshold[hvd.rank()] if isinstance(threshold, list)
                                  else threshold)
        try:
            _forced(False, case)(hvd, f)
        finally:
            optimizer.INLINE_BYTES = saved
    return inlined


def inline_hooks(hvd: Any, f: Any) -> None:
    """Without overlap, a large gradient's hook runs its allreduce at once: done (averaged in
    place) before backward reaches the first layer; small ones are only noted as ready."""
    from hora.torch import optimizer

    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    big = model[2].weight  # 24 float64s; 0.weight has 40, the biases 8 and 3
    optimizer.INLINE_BYTES = big.numel() * big.element_size()
    done: list[list[str]] = []

    def first_layer_backward(module: Any, grad_in: Any, grad_out: Any) -> None:
        done.append(sorted(opt._parameter_names[p] for p, (wait, _) in opt._handles.items()
                           if wait is not None and wait.args[0].done()))

    model[0].register_full_backward_hook(first_layer_backward)
    x, y = _batch()
    nn.functional.mse_loss(model(_mine(hvd, x)), _mine(hvd, y)).backward()
    assert done == [["2.weight"]], done
    assert torch.equal(big.grad, hvd.allreduce(big.grad.clone(), name="check"))  # one value
    started = {opt._parameter_names[p]: wait is not None for p, (wait, _) in opt._handles.items()}
    assert started == {"0.weight": True, "0.bias": False, "2.weight": True, "2.bias": False}, \
        started
    opt.step()
    assert not opt._handles
    _same_everywhere(hvd, model)


def deferred_gradients_one_unit(hvd: Any, f: Any) -> None:
    """Without overlap, ``synchronize()`` submits the gradients no hook started as one unit of
    single ops (one fused collective in a fast lane), each under its parameter's name, largest
    first; a sparse gradient goes on its own. The result is the plain average."""
    from hora.core.frontend import grouped

    units: list[list[str]] = []
    submit = grouped.allreduce_unit_async

    def recording(tensors: Any, names: Any, **kwargs: Any) -> Any:
        units.append(list(names))
        return submit(tensors, names, **kwargs)

    grouped.allreduce_unit_async = recording  # type: ignore[assignment]
    try:
        model = _model()
        embedding = nn.Embedding(6, 2, sparse=True).double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(list(model.parameters()) + list(embedding.parameters()), lr=0.1),
            named_parameters=[*model.named_parameters(), ("emb", embedding.weight)])
        x, y = _batch()
        loss = nn.functional.mse_loss(model(_mine(hvd, x)), _mine(hvd, y))
        (loss + embedding(torch.tensor([hvd.rank()])).sum()).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
    finally:
        grouped.allreduce_unit_async = submit  # type: ignore[assignment]
    assert units == [["0.weight", "2.weight", "0.bias", "2.bias"]], units  # 40, 24, 8, 3
    for name, p in model.named_parameters():
        want = hvd.allreduce(local[name], name=f"check.{name}")
        assert torch.allclose(p.grad, want, **F64), name
    assert embedding.weight.grad.is_sparse
    with opt.skip_synchronize():
        opt.step()


def wrapped_class_and_overlap(hvd: Any, f: Any) -> None:
    """The wrapper is an SGD; allreduces of the last layer start while backward is still
    computing the first layer's gradients (with a core to spare for them), or are only noted
    as ready and started by ``step()`` (without)."""
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.backward_passes_per_step == 1
    assert opt.op == hvd.Average and opt.process_set is hvd.global_process_set
    in_flight: list[list[str]] = []

    def first_layer_backward(module: Any, grad_in: Any, grad_out: Any) -> None:
        in_flight.append(sorted(opt._parameter_names[p] for p in opt._handles))

    model[0].register_full_backward_hook(first_layer_backward)
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    assert in_flight == [["2.bias", "2.weight"]], in_flight
    started = [wait is not None for wait, _ in opt._handles.values()]
    assert started == [opt._overlap] * 4, (started, opt._overlap)
    opt.step()
    assert not opt._handles


def horovod_style_script(hvd: Any, f: Any) -> None:
    """The contract of DESIGN.md, as a Horovod user writes it (DistributedSampler, lr scaled by
    size, metric averaging by name)."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(0)
    model = _model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = _batch(torch.float32)
    dataset = TensorDataset(x.repeat(4, 1), y.repeat(4, 1))
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    losses = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name="avg_loss").item())
    assert losses[-1] < losses[0]
    _same_everywhere(hvd, model)


def backward_passes(hvd: Any, f: Any) -> None:
    """backward_passes_per_step=2 equals gradient accumulation over two micro-batches."""
    x, y = _batch()
    ref = _model()
    _train(ref, _sgd(ref.parameters()), x, y, 3)
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    xs, ys = _mine(hvd, x), _mine(hvd, y)
    for _ in range(3):
        opt.zero_grad()
        for half in (slice(0, 2), slice(2, 4)):
            (nn.functional.mse_loss(model(xs[half]), ys[half]) / 2).backward()
            if half.start == 0:  # first pass: gradients stay local, nothing launched
                assert opt._handles and all(h is None for h, _ in opt._handles.values())
        opt.step()
    _assert_close(model, ref, F64)


def unused_parameter(hvd: Any, f: Any) -> None:
    """A parameter that one rank's graph skips is averaged with zeros from that rank, also when
    it belongs to a group (rank 0 launches the group from its hooks, rank 1 from synchronize:
    the same op names, no stall)."""
    for grouped in (False, True):
        torch.manual_seed(3)
        body, head = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
        params = list(body.parameters()) + list(head.parameters())
        names = [("b.w", params[0]), ("b.b", params[1]), ("h.w", params[2]), ("h.b", params[3])]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=names,
                                       groups=[params[2:]] if grouped else None)
        x = torch.ones(2, 4, dtype=torch.float64)
        out = body(x)
        loss = out.sum() + (head(out).sum() if hvd.rank() == 0 else 0.0)
        loss.backward()
        opt.step()
        local = torch.autograd.grad(head(body(x)).sum(), [head.weight, head.bias])
        assert torch.allclose(head.weight.grad, local[0] / 2), grouped
        assert torch.allclose(head.bias.grad, local[1] / 2), grouped


def sparse_embedding(hvd: Any, f: Any) -> None:
    """Sparse gradients: allgathered (default) or allreduced as dense (sparse_as_dense)."""
    idx = torch.tensor([[0, 3, 3, 7], [1, 3, 8, 9]])
    target = torch.linspace(-1, 1, 8 * 4, dtype=torch.float64).reshape(2, 4, 4)

    def run(emb: nn.Embedding, opt: Any, rows: slice) -> None:
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(emb(idx[rows]), target[rows]).backward()
            opt.step()

    for sparse_as_dense in (False, True):
        torch.manual_seed(5)
        ref = nn.Embedding(10, 4).double()
        run(ref, torch.optim.SGD(ref.parameters(), lr=0.5), slice(0, 2))
        torch.manual_seed(5)
        emb = nn.Embedding(10, 4, sparse=True).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        r = hvd.rank()
        run(emb, opt, slice(r, r + 1))
        assert emb.weight.grad is not None and emb.weight.grad.is_sparse
        assert torch.allclose(emb.weight, ref.weight, **F64), sparse_as_dense


def groups_explicit(hvd: Any, f: Any) -> None:
    model = _model()
    first = list(model[0].parameters())
    _equivalence(_sgd, torch.float64, F64, groups=[first])(hvd, f)
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()), groups=[first])
    assert len(set(opt._p_to_group.values())) == 1


def join_with_optimizer(hvd: Any, f: Any) -> None:
    """Rank 1 runs out of data after one step and joins; rank 0's next step averages its
    gradient with rank 1's zeros (Average keeps the full divisor)."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    x, y = _batch()
    steps = 2 if hvd.rank() == 0 else 1
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if hvd.rank() == 0:
        local = torch.autograd.grad(nn.functional.mse_loss(model(x), y), model[2].bias)[0]
        assert torch.allclose(model[2].bias.grad, local / hvd.size(), **F64)
    assert hvd.join() == 0


def step_warning_and_zero_grad(hvd: Any, f: Any) -> None:
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    opt.load_state_dict(opt.state_dict())
    opt.set_backward_passes_per_step(1)


def mixed_precision(hvd: Any, f: Any) -> None:
    """torch.autocast(bfloat16) + GradScaler with the synchronize / unscale_ / clip /
    skip_synchronize recipe."""
    def run(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, dist: bool) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if dist:
                opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if dist:
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()

    x, y = _batch(torch.float32)
    ref = _model(torch.float32)
    run(ref, _adam(ref.parameters()), x, y, dist=False)
    model = _model(torch.float32)
    opt = hvd.DistributedOptimizer(_adam(model.parameters()),
                                   named_parameters=model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run(model, opt, _mine(hvd, x), _mine(hvd, y), dist=True)
    _same_everywhere(hvd, model)
    _assert_close(model, ref, {"rtol": 3e-2, "atol": 3e-2})


def adasum_delta_optimizer(hvd: Any, f: Any) -> None:
    """op=Adasum: each rank steps on its own half batch (plain SGD: delta = -lr * grad); the
    parameters become start + adasum(delta_0, delta_1), per parameter, identical on both ranks.
    Then SGD with momentum, and Adam, still keep the ranks identical."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert type(opt).__name__ == "SGD" and isinstance(opt, torch.optim.SGD)
    x, y = _batch()
    opt.zero_grad()
    nn.functional.mse_loss(model(_mine(hvd, x)), _mine(hvd, y)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        both = hvd.allgather(grads[n].reshape(1, -1))  # each rank's gradient, in rank order
        a, b = (-0.1 * both[0]).double(), (-0.1 * both[1]).double()
        dot = a @ b
        want = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
        torch.testing.assert_close(p.detach().reshape(-1), start[n].reshape(-1) + want, **F64)
    _same_everywhere(hvd, model)
    for seed, make in ((1, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
                       (2, lambda ps: torch.optim.Adam(ps, lr=0.01))):
        model = _model(seed=seed)  # (a fresh model: an optimizer's hooks stay on its params)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(make(model.parameters()), op=hvd.Adasum,
                                       named_parameters=model.named_parameters())
        _train(model, opt, _mine(hvd, x), _mine(hvd, y), steps=3)
        _same_everywhere(hvd, model)
    try:
        with opt.skip_synchronize():
            pass
    except AssertionError as exc:
        assert "not supported when using Adasum" in str(exc)
    else:
        raise AssertionError("skip_synchronize accepted with Adasum")


def cases() -> list[tuple[str, Any]]:
    from state_cases import CASES as STATE_CASES

    return [
        ("wrapped_class_and_overlap", _forced(True, wrapped_class_and_overlap)),
        ("wrapped_class_deferred", _forced(False, wrapped_class_and_overlap)),
        ("sgd_momentum_float64_overlap", _forced(True, _equivalence(_sgd, torch.float64, F64))),
        ("sgd_momentum_float64_deferred", _forced(False, _equivalence(_sgd, torch.float64,
                                                                      F64))),
        ("sgd_overlap_on_one_rank_only", _forced([True, False], _equivalence(
            _sgd, torch.float64, F64))),
        ("groups_int_deferred", _forced(False, _equivalence(_sgd, torch.float64, F64,
                                                            groups=2))),
        ("groups_int_overlap_on_one_rank_only", _forced([False, True], _equivalence(
            _sgd, torch.float64, F64, groups=2))),
        ("fp16_compression_deferred", _forced(False, _equivalence(
            _sgd, torch.float32, {"rtol": 2e-3, "atol": 2e-3},
            compression=hvd_module.Compression.fp16))),
        ("deferred_gradients_one_unit", _inlined(1 << 40, deferred_gradients_one_unit)),
        ("inline_hooks", _inlined(1 << 40, inline_hooks)),
        ("sgd_momentum_float64_inline", _inlined(0, _equivalence(_sgd, torch.float64, F64))),
        ("adam_float32_inline_on_one_rank_only", _inlined([0, 1 << 40], _equivalence(
            _adam, torch.float32, F32))),
        ("fp16_compression_inline", _inlined(0, _equivalence(
            _sgd, torch.float32, {"rtol": 2e-3, "atol": 2e-3},
            compression=hvd_module.Compression.fp16))),
        ("backward_passes_per_step_inline", _inlined(0, backward_passes)),
        ("unused_parameter_inline", _inlined(0, unused_parameter)),
        ("backward_passes_per_step_overlap", _forced(True, backward_passes)),
        ("unused_parameter_overlap", _forced(True, unused_parameter)),
        ("horovod_style_script", horovod_style_script),
        ("sgd_momentum_float64", _equivalence(_sgd, torch.float64, F64)),
        ("adam_float32", _equivalence(_adam, torch.float32, F32)),
        ("adamw_float64_predivide", _equivalence(
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), torch.float64, F64,
            gradient_predivide_factor=2.0)),
        ("sum_op_half_lr", _equivalence(lambda p: torch.optim.SGD(p, lr=0.05), torch.float64,
                                        F64, ref_opt=lambda p: torch.optim.SGD(p, lr=0.1),
                                        op=hvd_module.Sum)),
        ("fp16_compression", _equivalence(_sgd, torch.float32, {"rtol": 2e-3, "atol": 2e-3},
                                          compression=hvd_module.Compression.fp16)),
        ("groups_int", _equivalence(_sgd, torch.float64, F64, groups=2)),
        ("groups_explicit", groups_explicit),
        ("backward_passes_per_step", backward_passes),
        ("unused_parameter", unused_parameter),
        ("sparse_embedding", sparse_embedding),
        ("adasum_delta_optimizer", adasum_delta_optimizer),
        ("step_warning_and_zero_grad", step_warning_and_zero_grad),
        ("mixed_precision_bf16_gradscaler", mixed_precision),
        *STATE_CASES,
        ("join_with_optimizer", join_with_optimizer),
    ]

