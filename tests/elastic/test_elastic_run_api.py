"""``hora.run(func, min_np=...)``: Horovod's elastic ``horovod.run``, end to end on this host.
This module is pickled by value (the ranks cannot import it), as in tests/runner/test_run_api.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import pytest

import hora
from hora.errors import ElasticError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def train(kill_worker: int, steps: int) -> dict[str, Any]:
    """An elastic job's function: averages a counter every step, commits every 5; the worker
    ``kill_worker`` SIGKILLs itself once, at step 12."""
    import signal
    import time

    import numpy as np

    import hora
    from hora import elastic

    hora.init()
    wid = int(os.environ["HORA_ELASTIC_WORKER_ID"])
    state = elastic.ObjectState(hora.broadcast_object, hora.rank, step=0, total=0.0)

    @elastic.run
    def loop(state: elastic.ObjectState) -> None:
        while state.step < steps:
            if wid == kill_worker and state.step == 12:
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hora.allreduce(np.ones(1), op=hora.Sum, name="x")[0])
            state.step += 1
            time.sleep(0.03)
            if state.step % 5 == 0:
                state.commit()

    loop(state)
    return {"rank": hora.rank(), "size": hora.size(), "step": state.step,
            "total": state.total, "wid": wid}


def test_elastic_run_survives_a_killed_worker_and_returns_min_np_results() -> None:
    results = hora.run(train, args=(2, 120), np=3, min_np=2, max_np=3)
    assert len(results) == 2  # ranks 0..min_np-1 of the last generation (Horovod's rule)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["step"] == 120 for r in results)
    assert len({r["total"] for r in results}) == 1
    assert results[0]["wid"] == 0  # the oldest survivor stays rank 0


def fails_everywhere() -> None:
    raise ValueError("bad hyperparameter")


def test_elastic_run_reraises_a_failure_it_cannot_recover_from() -> None:
    with pytest.raises(ValueError, match="bad hyperparameter"):
        hora.run(fails_everywhere, np=2, min_np=2)


def test_elastic_run_that_cannot_go_on_raises_the_reason() -> None:
    # a reset limit of 0: the first failure ends the job; the workers' ElasticError comes back
    with pytest.raises(ElasticError, match="exceeded limit: 0 \\(--reset-limit\\)"):
        hora.run(train, args=(1, 10_000), np=3, min_np=2, max_np=3, reset_limit=0)
