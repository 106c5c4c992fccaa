"""init()'s process-set check: O(1) store requests per rank (the last rank to arrive compares
and publishes a verdict), and the same mismatch text on every rank as before."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest

from hora.core.engine import context
from hora.core.op.process_set import ProcessSet
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient


class Counting(KVStoreClient):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.requests = 0

    def _call(self, req: Any, wait: float = 0.0) -> tuple[int, bytes]:
        self.requests += 1
        return super()._call(req, wait)


class Closable:
    closed = False

    def close(self) -> None:
        self.closed = True


def check_all(size: int, sets_of: Any) -> tuple[list[BaseException | None], list[int]]:
    secret = secrets.token_bytes(16)
    errors: list[BaseException | None] = [None] * size
    counts = [0] * size
    with KVStoreServer(secret, "127.0.0.1", 0) as server:

        def rank_main(rank: int) -> None:
            store = Counting("127.0.0.1", server.port, secret, 30.0)
            try:
                sets = [ProcessSet(ranks) for ranks in sets_of(rank)]
                context._check_process_sets(store, "job.g0", rank, size, sets, False,
                                            Closable(), [])  # type: ignore[arg-type]
            except BaseException as exc:
                errors[rank] = exc
            finally:
                counts[rank] = store.requests
                store.close()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    return errors, counts


def test_same_sets_pass_with_a_constant_number_of_store_requests() -> None:
    errors, counts = check_all(48, lambda rank: [[0, 1], [2, 3, 4]])
    assert errors == [None] * 48
    assert max(counts) <= 4  # set, add, get (the last: set, add, get_many, set)


@pytest.mark.parametrize("odd", [0, 5])
def test_mismatch_fails_every_rank_naming_the_lowest_other_rank(odd: int) -> None:
    size = 12
    errors, _ = check_all(size, lambda rank: [[0, 1]] if rank == odd else [[0, 2]])
    same = '{"sets": [[0, 2]], "dynamic": false}'
    other = '{"sets": [[0, 1]], "dynamic": false}'
    low_same = 1 if odd == 0 else 0
    for rank, exc in enumerate(errors):
        assert isinstance(exc, ValueError)
        mine, peer, theirs = (other, low_same, same) if rank == odd else (same, odd, other)
        assert str(exc) == (
            "Horovod initialization failed: different ranks tried to set up mismatching "
            f"process sets: rank {rank} passed {mine}, rank {peer} passed {theirs}. HINT: "
            "pass the same process_sets= list (including sets this rank is not in) on every "
            "rank.")
