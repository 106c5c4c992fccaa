"""Cases for the 2-rank training job: parameter / optimizer-state broadcast, object helpers and
SyncBatchNorm against BatchNorm over the full batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

F64 = {"rtol": 1e-10, "atol": 1e-12}


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def broadcast_parameters(hvd: Any, f: Any) -> None:
    r = hvd.rank()
    root = hvd.size() - 1
    model = _net(seed=r)
    model[1].num_batches_tracked += r
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    want = _net(seed=root)
    for (name, a), b in zip(model.state_dict().items(), want.state_dict().values()):
        if name != "1.num_batches_tracked":
            assert torch.equal(a, b), name
    assert int(model[1].num_batches_tracked) == root
    params = [torch.full((2,), float(r)), torch.full((3,), float(r) + 1)]
    hvd.broadcast_parameters(params, 0)
    named = [("a", torch.full((2,), float(r))), ("b", torch.full((1,), float(r)))]
    hvd.broadcast_parameters(named, 0)
    assert all(torch.all(p == q) for p, q in zip(params, [0.0, 1.0]))
    assert all(torch.all(t == 0) for _, t in named)


def _trained(opt_cls: Any, seed: int, **kwargs: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2).double()
    opt = opt_cls(model.parameters(), **kwargs)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _assert_same_state(hvd: Any, opt: Any, root: int) -> None:
    mine = opt.state_dict()
    theirs = hvd.broadcast_object(mine, root_rank=root)
    assert mine["param_groups"] == theirs["param_groups"], (mine["param_groups"],
                                                            theirs["param_groups"])
    assert mine["state"].keys() == theirs["state"].keys()
    for pid, entries in mine["state"].items():
        for key, value in entries.items():
            other = theirs["state"][pid][key]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, (pid, key, value, other)


def broadcast_optimizer_state(hvd: Any, f: Any) -> None:
    """SGD+momentum, Adam, AdamW (trained differently per rank, different lr) and a wrapped
    DistributedOptimizer end with the root's state and hyperparameters."""
    r = hvd.rank()
    for opt_cls, kwargs in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                            (torch.optim.Adam, {"lr": 0.01}),
                            (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})):
        model, opt = _trained(opt_cls, seed=10 + r, **kwargs)
        opt.param_groups[0]["lr"] = 0.5 + r
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _assert_same_state(hvd, opt, 0)
        assert opt.param_groups[0]["lr"] == 0.5
        assert opt.state_dict()["state"], opt_cls
    model, plain = _trained(torch.optim.Adam, seed=20 + r, lr=0.01)
    dist = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    assert dist.state_dict()["state"], "state of the wrapped optimizer is carried over"
    hvd.broadcast_optimizer_state(dist, root_rank=1)
    _assert_same_state(hvd, dist, 1)


def broadcast_fresh_optimizer_state(hvd: Any, f: Any) -> None:
    """An optimizer with no state yet: parameters do not move (weight decay), every rank stays
    fresh, hyperparameters come from the root. A rank with state while the root has none is
    reset to fresh too; a rank without state while the root has some receives it."""
    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (r + 1), weight_decay=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # as Horovod: every trainable parameter is left with a zero gradient (code written for
    # Horovod broadcasts p.grad right after this call)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert not any(opt.state.values()) and opt.param_groups[0]["lr"] == 0.01
    if r == 1:  # rank 1 has state, the root has none: rank 1 becomes fresh
        _, opt = _trained(torch.optim.Adam, seed=3, lr=0.01)
    else:
        opt = torch.optim.Adam(nn.Linear(3, 2).double().parameters(), lr=0.01)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert not any(opt.state.values())
    # root with state, rank 0 fresh: rank 0 creates state and receives rank 1's
    if r == 0:
        model = nn.Linear(3, 2).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
        before = [p.detach().clone() for p in model.parameters()]
    else:
        model, opt = _trained(torch.optim.SGD, seed=4, lr=0.1, momentum=0.9, weight_decay=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    _assert_same_state(hvd, opt, 1)
    if r == 0:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    stateless = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.3 + r)
    hvd.broadcast_optimizer_state(stateless, root_rank=0)
    assert stateless.param_groups[0]["lr"] == 0.3


def objects(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    got = hvd.broadcast_object({"rank": r} if r == 1 else None, root_rank=1)
    assert got == {"rank": 1}  # differently typed objects per rank: no hang (Horovod's name)
    assert hvd.allgather_object(("x" * (r * 50), r)) == [("x" * (q * 50), q) for q in range(n)]


def _bn_pair(module_cls: Any, channels: int, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    import hora.torch as hvd

    torch.manual_seed(7)
    ref = module_cls(channels, **kwargs).double()
    if ref.affine:
        nn.init.uniform_(ref.weight, 0.5, 1.5)
        nn.init.uniform_(ref.bias, -0.5, 0.5)
    sync = hvd.SyncBatchNorm(channels, **kwargs).double()
    sync.load_state_dict(ref.state_dict())
    return ref, sync


def sync_batch_norm(hvd: Any, f: Any) -> None:
    """Output, running statistics, input gradient (and summed weight gradients) equal those of
    BatchNorm over the concatenated batch; also in eval mode and with momentum=None."""
    r, n = hvd.rank(), hvd.size()
    for module_cls, shape, kwargs in ((nn.BatchNorm1d, (8, 3), {}),
                                      (nn.BatchNorm1d, (8, 3, 5), {"momentum": None}),
                                      (nn.BatchNorm2d, (6, 2, 3, 3), {"affine": False})):
        ref, sync = _bn_pair(module_cls, shape[1], **kwargs)
        g = torch.Generator().manual_seed(11)
        x_full = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
        w_full = torch.randn(shape, generator=g, dtype=torch.float64)
        rows = shape[0] // n
        mine = slice(r * rows, (r + 1) * rows)
        for _ in range(2):  # two steps: running statistics accumulate
            xr = x_full.clone().requires_grad_()
            out_ref = ref(xr)
            (out_ref * w_full).sum().backward()
            x = x_full[mine].clone().requires_grad_()
            out = sync(x)
            (out * w_full[mine]).sum().backward()
            assert torch.allclose(out, out_ref[mine], **F64)
            assert torch.allclose(x.grad, xr.grad[mine], **F64)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                assert torch.allclose(getattr(sync, name).double(), getattr(ref, name).double(),
                                      **F64), name
            if ref.affine:
                for name in ("weight", "bias"):
                    summed = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum)
                    assert torch.allclose(summed, getattr(ref, name).grad, **F64), name
                    getattr(sync, name).grad = None
                    getattr(ref, name).grad = None
        sync.eval()
        ref.eval()
        assert torch.allclose(sync(x_full[mine]), ref(x_full)[mine], **F64)


def optimizer_state_with_none_entries(hvd: Any, f: Any) -> None:
    """A frozen parameter (no gradient, no state) and state values that are None (SGD without
    momentum keeps ``momentum_buffer: None``): broadcast_optimizer_state skips and keeps them;
    the trainable parameter's gradient is a tensor afterwards, so it can be broadcast."""
    r = hvd.rank()
    torch.manual_seed(1)
    frozen = nn.Parameter(torch.tensor([1.0, 3.0]), requires_grad=False)
    weight = nn.Parameter(torch.rand(4))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([frozen, weight], lr=0.001, weight_decay=1e-6, momentum=0.9,
                        nesterov=True), named_parameters=[("frozen", frozen), ("weight", weight)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = hvd.broadcast(weight.grad, root_rank=0)
    assert frozen.grad is None and torch.equal(grad, weight.grad)
    plain = torch.optim.SGD([weight], lr=0.1 * (r + 1), momentum=0.9)
    if r == 0:
        weight.grad = torch.ones(4)
        plain.step()
        plain.state[weight]["no_buffer_yet"] = None  # a None state value
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    state = plain.state[weight]
    assert "no_buffer_yet" in state and state["no_buffer_yet"] is None
    assert torch.equal(state["momentum_buffer"], torch.ones(4))
    assert plain.param_groups[0]["lr"] == 0.1


CASES = [(fn.__name__, fn) for fn in (broadcast_parameters, broadcast_optimizer_state,
                                      broadcast_fresh_optimizer_state,
                                      optimizer_state_with_none_entries, objects,
                                      sync_batch_norm)]
