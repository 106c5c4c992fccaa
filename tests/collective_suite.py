"""The framework-neutral collective suite: one body, run through any adapter's tensor factory.

Nothing here imports a framework. A :class:`Factory` turns float64 numpy values into the
framework's tensors of a named dtype and back; ``hvd`` is the adapter module (``hora.torch``,
later ``hora.tensorflow``...). :func:`cases` lists ``(case_id, fn)``; every rank runs them in
the same order inside one real multi-rank job (see ``torch_worker.py``), each ``fn(hvd, f)``
asserting on its own rank. Expects a job of >= 2 ranks started with
``init(process_sets=[ProcessSet(SUBSET)])``: call :func:`init` rather than ``hvd.init``.

An adapter without Horovod's in-place or asynchronous spellings (``hora.tensorflow``: TensorFlow
tensors are immutable and its ops are graph nodes) skips those forms: :func:`has_forms`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

OPS = ("Sum", "Average", "Min", "Max", "Product")
SUBSET = [0, 2]  # registered at init; rank 1 is not a member ([1] in a job of 2 ranks)


def has_forms(hvd: Any) -> bool:
    """Whether the adapter has Horovod's in-place and asynchronous forms (``x_``, ``x_async``,
    ``synchronize``, ``poll``)."""
    return hasattr(hvd, "allreduce_async") and hasattr(hvd, "synchronize")


class Factory(Protocol):
    reduce_dtypes: list[str]
    move_dtypes: list[str]
    rejected: dict[str, list[str]]  # op family -> dtypes that must raise ValueError

    def make(self, values: np.ndarray, dtype: str) -> Any: ...
    def values(self, tensor: Any) -> np.ndarray: ...  # float64 copy
    def dtype(self, tensor: Any) -> str: ...


Case = Callable[[Any, Factory], None]


def _data(shape: tuple[int, ...], rank: int, salt: int = 0) -> np.ndarray:
    """Small integers (exact in every dtype, products stay small)."""
    n = int(np.prod(shape))
    return ((np.arange(n) + rank + salt) % 3 + 1).astype(np.float64).reshape(shape)


def _tol(dtype: str) -> float:
    return {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype, 0.0)


def _close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=_tol(dtype), atol=_tol(dtype)), \
        f"{what}: got {got.ravel()[:8]} want {want.ravel()[:8]}"


def _reference(op: str, parts: list[np.ndarray], dtype: str) -> np.ndarray:
    if op == "Sum":
        return np.sum(parts, 0)
    if op == "Average":
        total = np.sum(parts, 0)
        return np.trunc(total * (1.0 / len(parts))) if dtype.startswith("int") else \
            total / len(parts)
    return {"Min": np.min, "Max": np.max, "Product": np.prod}[op](parts, 0)


def _check_result(f: Factory, t: Any, want: np.ndarray, dtype: str, what: str) -> None:
    assert f.dtype(t) == dtype, f"{what}: dtype {f.dtype(t)} != {dtype}"
    _close(f.values(t), want, dtype, what)


# ---- allreduce ---------------------------------------------------------------------------------
def _allreduce(dtype: str, op: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        x = f.make(_data((3, 4), r), dtype)
        out = hvd.allreduce(x, op=getattr(hvd, op), name=f"ar.{dtype}.{op}")
        want = _reference(op, [_data((3, 4), q) for q in range(n)], dtype)
        _check_result(f, out, want, dtype, "allreduce")
        _close(f.values(x), _data((3, 4), r), dtype, "input untouched")
    return case


def _allreduce_variants(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        total = np.sum([_data((5,), q) for q in range(n)], 0)
        if has_forms(hvd):
            x = f.make(_data((5,), r), dtype)
            same = hvd.allreduce_(x, op=hvd.Sum, name=f"arv.inplace.{dtype}")
            assert same is x, "allreduce_ returns its input"
            _check_result(f, x, total, dtype, "allreduce_")
            h1 = hvd.allreduce_async(f.make(_data((5,), r), dtype), op=hvd.Sum)
            y = f.make(_data((5,), r), dtype)
            h2 = hvd.allreduce_async_(y, op=hvd.Sum, name=f"arv.async_.{dtype}")
            assert isinstance(h1, int) and isinstance(h2, int) and h1 != h2
            _check_result(f, hvd.synchronize(h1), total, dtype, "allreduce_async")
            assert hvd.synchronize(h2) is y
            _check_result(f, y, total, dtype, "allreduce_async_")
        scaled = hvd.allreduce(f.make(_data((5,), r), dtype), op=hvd.Sum, prescale_factor=2.0,
                               postscale_factor=0.5, name=f"arv.scale.{dtype}")
        _check_result(f, scaled, total, dtype, "pre/postscale")
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summed = hvd.allreduce(f.make(_data((5,), r), dtype), average=False)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        _check_result(f, summed, total, dtype, "average=False")
    return case


def _grouped_allreduce(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        shapes = [(2,), (3, 2), (1, 1, 4)]
        want = [np.sum([_data(s, q, i) for q in range(n)], 0) for i, s in enumerate(shapes)]

        def fresh() -> list[Any]:
            return [f.make(_data(s, r, i), dtype) for i, s in enumerate(shapes)]

        outs = hvd.grouped_allreduce(fresh(), op=hvd.Sum, name=f"gar.{dtype}")
        if not has_forms(hvd):
            for t, w in zip(outs, want):
                _check_result(f, t, w, dtype, "grouped_allreduce")
            return
        ins = fresh()
        outs_ = hvd.grouped_allreduce_(ins, op=hvd.Sum, name=f"gar_.{dtype}")
        assert all(a is b for a, b in zip(outs_, ins))
        outs_async = hvd.synchronize(hvd.grouped_allreduce_async(fresh(), op=hvd.Sum))
        ins2 = fresh()
        hvd.synchronize(hvd.grouped_allreduce_async_(ins2, op=hvd.Sum))
        for results in (outs, outs_, outs_async, ins2):
            assert len(results) == 3
            for t, w in zip(results, want):
                _check_result(f, t, w, dtype, "grouped_allreduce")
    return case


# ---- allgather / broadcast / alltoall ----------------------------------------------------------
def _allgather(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        want = np.concatenate([_data((q + 1, 2), q) for q in range(n)])
        out = hvd.allgather(f.make(_data((r + 1, 2), r), dtype), name=f"ag.{dtype}")
        _check_result(f, out, want, dtype, "allgather")
        if has_forms(hvd):
            h = hvd.allgather_async(f.make(_data((r + 1, 2), r), dtype))
            _check_result(f, hvd.synchronize(h), want, dtype, "allgather_async")
        outs = hvd.grouped_allgather([f.make(_data((r + 1, 2), r), dtype),
                                      f.make(_data((1,), r, 1), dtype)], name=f"gag.{dtype}")
        _check_result(f, outs[0], want, dtype, "grouped_allgather[0]")
        _check_result(f, outs[1], np.concatenate([_data((1,), q, 1) for q in range(n)]), dtype,
                      "grouped_allgather[1]")
        empty = hvd.allgather(f.make(_data((r % 2, 3), r), dtype), name=f"ag.empty.{dtype}")
        assert tuple(f.values(empty).shape) == (sum(q % 2 for q in range(n)), 3)
    return case


def _broadcast(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        for root in range(n):
            x = f.make(_data((2, 3), r), dtype)
            out = hvd.broadcast(x, root, name=f"bc.{dtype}.{root}")
            _check_result(f, out, _data((2, 3), root), dtype, f"broadcast root {root}")
            _close(f.values(x), _data((2, 3), r), dtype, "input untouched")
        if not has_forms(hvd):
            return
        y = f.make(_data((4,), r), dtype)
        assert hvd.broadcast_(y, n - 1, name=f"bc_.{dtype}") is y
        _check_result(f, y, _data((4,), n - 1), dtype, "broadcast_")
        h = hvd.broadcast_async(f.make(_data((4,), r), dtype), 0)
        _check_result(f, hvd.synchronize(h), _data((4,), 0), dtype, "broadcast_async")
        z = f.make(_data((), r), dtype)
        hvd.synchronize(hvd.broadcast_async_(z, 1))
        _check_result(f, z, _data((), 1), dtype, "broadcast_async_ 0-d")
    return case


def _alltoall(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        splits = [(r + j) % 2 + 1 for j in range(n)]
        rows = np.repeat(np.arange(n, dtype=np.float64), splits)[:, None] * 10 + r
        out, received = hvd.alltoall(f.make(np.tile(rows, (1, 2)), dtype), splits=splits,
                                     name=f"a2a.{dtype}")
        want_counts = [(q + r) % 2 + 1 for q in range(n)]
        assert [int(v) for v in f.values(received)] == want_counts
        want = np.concatenate([np.full((c, 2), r * 10 + q, np.float64)
                               for q, c in enumerate(want_counts)])
        _check_result(f, out, want, dtype, "alltoall")
        even = hvd.alltoall(f.make(np.full((2 * n, 1), float(r)), dtype), name=f"a2a.even.{dtype}")
        _check_result(f, even, np.repeat(np.arange(n, dtype=np.float64), 2)[:, None], dtype,
                      "alltoall without splits")
        extra = np.concatenate([np.full((n, 1), float(r)), np.full((2, 1), 99.0)])
        out, _ = (hvd.synchronize(hvd.alltoall_async(f.make(extra, dtype), [1] * n))
                  if has_forms(hvd) else hvd.alltoall(f.make(extra, dtype), [1] * n))
        _check_result(f, out, np.arange(n, dtype=np.float64)[:, None], dtype,
                      "rows beyond sum(splits) are not sent")
    return case


# ---- reducescatter -----------------------------------------------------------------------------
def _reducescatter(dtype: str, op: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        rows = 2 * n + 1
        full = _reference(op, [_data((rows, 2), q) for q in range(n)], dtype)
        counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
        start = sum(counts[:r])
        out = hvd.reducescatter(f.make(_data((rows, 2), r), dtype), op=getattr(hvd, op),
                                name=f"rs.{dtype}.{op}")
        _check_result(f, out, full[start:start + counts[r]], dtype, "reducescatter")
    return case


def _reducescatter_variants(dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        r, n = hvd.rank(), hvd.size()
        total = np.sum([_data((n, 3), q) for q in range(n)], 0)
        if has_forms(hvd):
            h = hvd.reducescatter_async(f.make(_data((n, 3), r), dtype), op=hvd.Sum)
            _check_result(f, hvd.synchronize(h), total[r:r + 1], dtype, "reducescatter_async")
        outs = hvd.grouped_reducescatter([f.make(_data((n, 3), r), dtype),
                                          f.make(_data((n, 3), r), dtype)], op=hvd.Sum,
                                         prescale_factor=2.0, postscale_factor=0.5)
        for o in outs:
            _check_result(f, o, total[r:r + 1], dtype, "grouped_reducescatter")
        if not has_forms(hvd):
            return
        h = hvd.grouped_reducescatter_async([f.make(_data((n, 3), r), dtype)], op=hvd.Sum)
        _check_result(f, hvd.synchronize(h)[0], total[r:r + 1], dtype,
                      "grouped_reducescatter_async")
    return case


# ---- dtype rejection, process sets, control ops ------------------------------------------------
SCALE = 0.1915194503788923  # not representable in any float type: its rounding shows


def _horovod_scaled(values: np.ndarray, dtype: str, factor: float) -> np.ndarray:
    """Horovod's scaling arithmetic: integers in float64 (truncated back), float16/bfloat16 in
    float32 (rounded back once), other floats in their own dtype."""
    from hora.collectives.ops import to_dtype

    kind = to_dtype(dtype)
    x = values.astype(kind)
    if kind.kind in "iu":
        wide = x.astype(np.float64) * factor
    elif kind.itemsize == 2:
        wide = x.astype(np.float32) * np.float32(factor)
    else:
        wide = x * kind.type(factor)
    return wide.astype(kind).astype(np.float64)


def _scaling(dtype: str) -> Case:
    """prescale applies to each rank's tensor before the sum, postscale to the sum, in
    Horovod's arithmetic, for allreduce, reducescatter and their grouped forms: exact results
    (every rank holds the same values, so the sum's order cannot round differently)."""
    def case(hvd: Any, f: Factory) -> None:
        from hora.collectives.ops import to_dtype

        n = hvd.size()
        base = np.arange(-40, 37, 7, dtype=np.float64).repeat(2).reshape(11, 2)
        exact = to_dtype(dtype)
        want = {"prescale": (_horovod_scaled(base, dtype, SCALE) * n).astype(exact)
                .astype(np.float64),
                "postscale": _horovod_scaled(base * n, dtype, SCALE)}
        rows = [len(base) // n + (1 if q < len(base) % n else 0) for q in range(n)]
        start = sum(rows[:hvd.rank()])
        mine = slice(start, start + rows[hvd.rank()])
        for which, expected in want.items():
            kw = {f"{which}_factor": SCALE}
            got = {"allreduce": [hvd.allreduce(f.make(base, dtype), op=hvd.Sum, **kw)],
                   "grouped_allreduce": hvd.grouped_allreduce(
                       [f.make(base, dtype), f.make(base, dtype)], op=hvd.Sum, **kw),
                   "reducescatter": [hvd.reducescatter(f.make(base, dtype), op=hvd.Sum, **kw)],
                   "grouped_reducescatter": hvd.grouped_reducescatter(
                       [f.make(base, dtype), f.make(base, dtype)], op=hvd.Sum, **kw)}
            for op_name, results in got.items():
                part = expected[mine] if "reducescatter" in op_name else expected
                for t in results:
                    values = f.values(t)
                    assert np.array_equal(values, part), (
                        f"{op_name} {which} {dtype}: got {values.ravel()[:6]} want "
                        f"{part.ravel()[:6]}")
    return case


def _rejected(family: str, dtype: str) -> Case:
    def case(hvd: Any, f: Factory) -> None:
        x = f.make(np.ones((hvd.size(), 2)), dtype)
        call = {
            "allreduce": lambda: hvd.allreduce(x), "allreduce_": lambda: hvd.allreduce_(x),
            "grouped_allreduce": lambda: hvd.grouped_allreduce([x]),
            "allgather": lambda: hvd.allgather(x), "broadcast": lambda: hvd.broadcast(x, 0),
            "alltoall": lambda: hvd.alltoall(x), "reducescatter": lambda: hvd.reducescatter(x),
        }[family]
        try:
            call()
        except ValueError as exc:
            assert "is not supported" in str(exc) and "Tensor type" in str(exc), str(exc)
        else:
            raise AssertionError(f"{family} accepted {dtype}")
    return case


def _process_set(hvd: Any, f: Factory) -> None:
    # Ops on a subset are named: unnamed ones draw from a per-process counter that ranks
    # outside the set do not advance (Horovod's quirk 3), which would desynchronize later
    # unnamed global ops.
    r = hvd.rank()
    ps = _SETS["subset"]
    if r not in SUBSET:
        return
    me, m = SUBSET.index(r), len(SUBSET)
    out = hvd.allreduce(f.make(np.full(3, float(r)), "float32"), op=hvd.Sum, process_set=ps,
                        name="ps.sum")
    _close(f.values(out), np.full(3, float(sum(SUBSET))), "float32", "set allreduce")
    avg = hvd.allreduce(f.make(np.full(2, float(r)), "float64"), process_set=ps, name="ps.avg")
    _close(f.values(avg), np.full(2, sum(SUBSET) / m), "float64", "set average")
    got = hvd.allgather(f.make(np.full((1, 1), float(r)), "int32"), process_set=ps,
                        name="ps.ag")
    _close(f.values(got), np.array([[float(q)] for q in SUBSET]), "int32", "set allgather order")
    b = hvd.broadcast(f.make(np.full(2, float(r)), "float32"), SUBSET[-1], process_set=ps,
                      name="ps.bc")
    _close(f.values(b), np.full(2, float(SUBSET[-1])), "float32", "set broadcast (global root)")
    rs = hvd.reducescatter(f.make(np.ones((m, 2)), "float32"), op=hvd.Sum, process_set=ps,
                           name="ps.rs")
    _close(f.values(rs), np.full((1, 2), float(m)), "float32", "set reducescatter")
    a2a, recv = hvd.alltoall(f.make(np.arange(m, dtype=np.float64)[:, None] + 10 * me,
                                    "float32"), [1] * m, process_set=ps, name="ps.a2a")
    _close(f.values(a2a), np.array([[me + 10.0 * q] for q in range(m)]), "float32",
           "set alltoall")


def _join(hvd: Any, f: Factory) -> None:
    r, n = hvd.rank(), hvd.size()
    for step in range(r + 1):  # rank r has r + 1 batches
        out = hvd.allreduce(f.make(np.ones(2), "float32"), name=f"join.step{step}")
        present = n - step  # ranks < step have joined and contribute zeros
        _close(f.values(out), np.full(2, present / n), "float32", f"join step {step}")
    assert int(hvd.join()) == n - 1


def _control(hvd: Any, f: Factory) -> None:
    hvd.barrier()
    zero_d = hvd.allreduce(f.make(np.array(float(hvd.rank())), "float64"), op=hvd.Max)
    assert f.values(zero_d).shape == () and float(f.values(zero_d)) == hvd.size() - 1
    empty = hvd.allreduce(f.make(np.zeros((0, 3)), "float32"), name="control.empty")
    assert f.values(empty).shape == (0, 3)
    if not has_forms(hvd):
        return
    assert hvd.synchronize(987654) is None  # unknown handle: None, as Horovod
    try:
        hvd.poll(987654)
    except ValueError as exc:
        assert "987654" in str(exc)
    else:
        raise AssertionError("poll of an unknown handle must raise ValueError")
    h = hvd.allreduce_async(f.make(np.ones(2), "float32"), op=hvd.Sum, name="control.poll")
    import time
    deadline = time.monotonic() + 30
    while not hvd.poll(h):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    _close(f.values(hvd.synchronize(h)), np.full(2, float(hvd.size())), "float32", "poll")


_SETS: dict[str, Any] = {}


def init(hvd: Any) -> None:
    """``hvd.init`` with the process set the suite uses."""
    import os

    if int(os.environ.get("HORA_SIZE") or os.environ.get("HOROVOD_SIZE") or 3) == 2:
        SUBSET[:] = [1]
    _SETS["subset"] = hvd.ProcessSet(SUBSET)
    hvd.init(process_sets=[_SETS["subset"]])


def cases(f: Factory) -> list[tuple[str, Case]]:
    """Every case of the suite for this factory, in execution order."""
    out: list[tuple[str, Case]] = []
    for dtype in f.reduce_dtypes:
        out += [(f"allreduce-{dtype}-{op}", _allreduce(dtype, op)) for op in OPS]
        out.append((f"allreduce_variants-{dtype}", _allreduce_variants(dtype)))
        out.append((f"grouped_allreduce-{dtype}", _grouped_allreduce(dtype)))
        out += [(f"reducescatter-{dtype}-{op}", _reducescatter(dtype, op))
                for op in ("Sum", "Average")]
        out.append((f"reducescatter_variants-{dtype}", _reducescatter_variants(dtype)))
        out.append((f"scaling-{dtype}", _scaling(dtype)))
    for dtype in f.move_dtypes:
        out += [(f"allgather-{dtype}", _allgather(dtype)),
                (f"broadcast-{dtype}", _broadcast(dtype)), (f"alltoall-{dtype}", _alltoall(dtype))]
    for family, dtypes in f.rejected.items():
        out += [(f"rejected-{family}-{dtype}", _rejected(family, dtype)) for dtype in dtypes]
    out += [("process_set", _process_set), ("control", _control), ("join", _join)]
    return out
