"""A rank of ``test_adasum_jobs.py``: ``op=Adasum`` allreduces in every float dtype, checked on
this rank against a numpy reference of the formula, and byte-equal on every rank.

    python adasum_worker.py HOSTS MODE

HOSTS is every rank's host name, comma-separated (the ranks were started with these as
``HORA_HOSTNAME``). MODE ``hier``: the reference averages each host's vectors and combines the
host means with Adasum (hierarchical); ``flat``: it combines every rank's vector. Prints
``OK <rank>``; a refused allreduce prints ``REFUSED <rank> <error type>: <message>``.
"""

from __future__ import annotations

import sys

import numpy as np

import hora

DTYPES = {"float16": (np.float16, 5e-3), "float32": (np.float32, 1e-5),
          "float64": (np.float64, 1e-12)}
SIZES = (1, 5, 1000, 70001)


def data(rank: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    v = rng.standard_normal(size)
    v[: size // 2] += 2.0  # a shared direction, so the combination is neither sum nor mean
    return v


def reference(vectors: list[np.ndarray]) -> np.ndarray:
    """The recursive pairwise Adasum, float64, from the formula."""
    level = list(vectors)
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, an, bn = a @ b, a @ a, b @ b
            nxt.append((1 - dot / (2 * an) if an >= 1e-8 else 1.0) * a
                       + (1 - dot / (2 * bn) if bn >= 1e-8 else 1.0) * b)
        level = nxt
    return level[0]


def main() -> None:
    hosts, mode = sys.argv[1].split(","), sys.argv[2]
    hora.init()
    rank, n = hora.rank(), hora.size()
    order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
    for seed, size in enumerate(SIZES):
        for dtype, (np_dtype, tol) in DTYPES.items():
            vectors = [data(q, size, seed).astype(np_dtype).astype(np.float64) for q in range(n)]
            if mode == "hier":
                vectors = [np.mean([v for v, h in zip(vectors, hosts) if h == host], axis=0)
                           for host in order]
            want = reference(vectors)
            try:
                got = hora.allreduce(data(rank, size, seed).astype(np_dtype), op=hora.Adasum,
                                     name=f"ada.{size}.{dtype}")
            except (NotImplementedError, ValueError) as exc:
                print(f"REFUSED {rank} {type(exc).__name__}: {exc}", flush=True)
                hora.barrier()  # nothing was submitted: the engine still works
                hora.shutdown()
                return
            assert got.dtype == np_dtype, (dtype, got.dtype)
            scale = max(1.0, float(np.abs(want).max()))
            err = float(np.abs(got.astype(np.float64) - want).max()) / scale
            assert err <= tol, f"{dtype} size {size}: max relative error {err}"
            everyone = hora.allgather(got[None], name=f"check.{size}.{dtype}")
            assert all(row.tobytes() == got.tobytes() for row in everyone), "ranks differ"
    # a grouped call: every member keeps its own coefficients (never fused into one vector)
    parts = [[data(q, 6, 7 + k) * (1 + 3 * k * q) for q in range(n)] for k in range(2)]
    if mode == "hier":
        parts = [[np.mean([v for v, h in zip(p, hosts) if h == host], axis=0) for host in order]
                 for p in parts]
    got = hora.grouped_allreduce([data(rank, 6, 7 + k) * (1 + 3 * k * rank) for k in range(2)],
                                 op=hora.Adasum, name="ada.grouped")
    for k, g in enumerate(got):
        assert np.allclose(g, reference(parts[k]), rtol=1e-12, atol=1e-12), f"member {k}"
    # the same names every step: after the first negotiation the ops run from the fast lane's
    # cache (one host), two of them fused
    for step in range(6):
        vectors = [[data(q, 50, 20 + 2 * step + k) * (1 + k * q) for q in range(n)]
                   for k in range(2)]
        if mode == "hier":
            vectors = [[np.mean([v for v, h in zip(p, hosts) if h == host], axis=0)
                        for host in order] for p in vectors]
        handles = [hora.allreduce_async(data(rank, 50, 20 + 2 * step + k) * (1 + k * rank),
                                        op=hora.Adasum, name=f"ada.steady.{k}")
                   for k in range(2)]
        for k, h in enumerate(handles):
            got = hora.synchronize(h)
            assert np.allclose(got, reference(vectors[k]), rtol=1e-12, atol=1e-12), (step, k)
    hora.barrier()  # a rank that shuts down at once can fail a slower rank's last lane op
    print(f"OK {rank}", flush=True)
    hora.shutdown()


if __name__ == "__main__":
    main()
