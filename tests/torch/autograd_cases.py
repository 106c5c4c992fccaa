"""Gradients of the differentiable collectives follow Horovod's rules (spec §2.9, quirks 12-13).

Each case uses a rank-dependent upstream gradient ``w_r`` (``loss = sum(out * w_r)``) so that the
checks see more than constants. Run in a job of n >= 2 ranks.
"""

from __future__ import annotations

from typing import Any

import torch


def _w(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    return torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=torch.float64
                        ).reshape(shape) + 10 * rank


def _x(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    return (torch.ones(shape, dtype=torch.float64) * (rank + 1)).requires_grad_()


def _mean_w(shape: tuple[int, ...], n: int) -> torch.Tensor:
    return torch.stack([_w(shape, q) for q in range(n)]).mean(0)


def allreduce_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.25),
                          (hvd.Max, 1.0, 1.0)):
        x = _x((2, 3), r)
        (hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post) * _w((2, 3), r)
         ).sum().backward()
        want = torch.stack([_w((2, 3), q) for q in range(n)]) * pre
        want = want.sum(0) if op != hvd.Average else want.mean(0)
        if op == hvd.Max:  # quirk 13: the op is re-applied to the gradients
            want = torch.stack([_w((2, 3), q) for q in range(n)]).max(0).values
        assert torch.allclose(x.grad, want * post), (op, x.grad, want * post)
    ones = _x((3,), r)
    hvd.allreduce(ones, op=hvd.Sum).sum().backward()
    assert torch.all(ones.grad == n)  # Horovod's test expectation: Sum -> size
    ones = _x((3,), r)
    hvd.allreduce(ones).sum().backward()
    assert torch.all(ones.grad == 1)  # Average -> 1


def grouped_allreduce_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    xs = [_x((2,), r), _x((3, 1), r)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum(((o * _w(tuple(o.shape), r)).sum() for o in outs), torch.zeros((), dtype=torch.float64)
        ).backward()
    for x in xs:
        shape = tuple(x.shape)
        assert torch.allclose(x.grad, torch.stack([_w(shape, q) for q in range(n)]).sum(0))


def allgather_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x = _x((r + 1, 2), r)
    out = hvd.allgather(x)
    rows = n * (n + 1) // 2
    (out * _w((rows, 2), r)).sum().backward()
    start = r * (r + 1) // 2
    assert torch.allclose(x.grad, _mean_w((rows, 2), n)[start:start + r + 1]), x.grad
    xs = [_x((r + 1, 2), r), _x((1,), r)]
    outs = hvd.grouped_allgather(xs)
    ((outs[0] * _w((rows, 2), r)).sum() + (outs[1] * _w((n,), r)).sum()).backward()
    assert torch.allclose(xs[0].grad, _mean_w((rows, 2), n)[start:start + r + 1])
    assert torch.allclose(xs[1].grad, _mean_w((n,), n)[r:r + 1])


def broadcast_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    x = _x((4,), r)
    (hvd.broadcast(x, root) * _w((4,), r)).sum().backward()
    want = _mean_w((4,), n) if r == root else torch.zeros(4, dtype=torch.float64)
    assert torch.allclose(x.grad, want), x.grad


def alltoall_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    splits = [(r + j) % 2 + 1 for j in range(n)]
    rows = sum(splits)
    x = (torch.arange(rows, dtype=torch.float64) + 100 * r).unsqueeze(1).requires_grad_()
    out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32))
    assert not received.requires_grad and received.dtype is torch.int32
    # upstream gradient = the received values themselves: going back, each row's gradient
    # is its own original value, so x.grad == x
    (out * out.detach()).sum().backward()
    assert torch.allclose(x.grad, x.detach()), (x.grad, x)
    y = (torch.ones(2 * n, 1, dtype=torch.float64) * r).requires_grad_()
    even = hvd.alltoall(y)
    assert isinstance(even, torch.Tensor)
    even.sum().backward()
    assert torch.all(y.grad == 1)


def reducescatter_grads(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):  # quirk 12: Sum -> size
        x = _x((n, 2), r)
        hvd.reducescatter(x, op=op).sum().backward()
        assert torch.all(x.grad == factor), (op, x.grad)
    x = _x((n, 2), r)
    out = hvd.reducescatter(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0)
    (out * _w((1, 2), r)).sum().backward()
    want = torch.cat([_w((1, 2), q) for q in range(n)]) * 6.0
    assert torch.allclose(x.grad, want), x.grad
    xs = [_x((n, 2), r), _x((n,), r)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    (outs[0].sum() + outs[1].sum()).backward()
    assert all(torch.all(x.grad == n) for x in xs)


def compression_fp16(hvd: Any, f: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x = torch.full((3,), float(r), dtype=torch.float32, requires_grad=True)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype is torch.float32 and torch.all(out == n * (n - 1) / 2)
    out.sum().backward()
    assert x.grad is not None and torch.all(x.grad == n)
    i = torch.arange(3, dtype=torch.int32)
    assert hvd.Compression.fp16.compress(i)[0] is i


CASES = [(fn.__name__, fn) for fn in (allreduce_grads, grouped_allreduce_grads, allgather_grads,
                                      broadcast_grads, alltoall_grads, reducescatter_grads,
                                      compression_fp16)]
