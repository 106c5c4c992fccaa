"""``hvd.elastic`` for TensorFlow and Keras: the 1-rank semantics as one ``hora run -np 1`` case
job (group_tf_elastic.py), and a real elastic job: ``hora run -np 2 --min-np 1 --max-np 2`` of
a Keras model trained with ``hvd.elastic.run`` + ``KerasState`` + the callbacks, where one worker
SIGKILLs itself mid-training. This process never imports TensorFlow or Keras."""

from __future__ import annotations

import sys

import pytest
from runner.helpers import clean_env, run_hora
from tf_jobs import HERE, JOB_ENV, CaseJob, case_ids, needs_tf, run_cases

pytestmark = [pytest.mark.integration, needs_tf]

WORKER = str(HERE / "tf_elastic_worker.py")




@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_elastic", np_=1, timeout=110.0)  # < pytest-timeout


@pytest.mark.parametrize("case_id", case_ids("group_tf_elastic"))
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == 1


def test_keras_elastic_job_survives_a_killed_worker() -> None:
    # worker 1 dies before its 4th batch of epoch 1 (commits every 2 batches: one batch is
    # uncommitted); rank 0's allreduce inside fit's train step fails, run() converts the
    # TensorFlow error, the state rolls back to the commit, rank 0 goes on alone (--min-np 1,
    # slowed down) until the replacement (worker 2) joins at a commit and gets the state in
    # sync(); both finish with the same weights and every batch applied exactly once
    epochs, steps = 4, 30
    env = clean_env(**{k: v for k, v in JOB_ENV.items() if k != "PYTHONPATH"},
                    TFE_EPOCHS=str(epochs), TFE_STEPS=str(steps), TFE_COMMIT="2",
                    TFE_KILL="1:1:3", TFE_SLOW="0.4")
    result = run_hora("run", "-np", "2", "--min-np", "1", "--max-np", "2",
                      sys.executable, WORKER, env=env, timeout=110.0)
    assert result.rc == 0, result.err[-4000:]
    done = result.json_lines("wid")
    assert sorted(done) == [0, 2], (sorted(done), result.err[-3000:])  # 2 replaced 1
    assert done[0]["weights"] == done[2]["weights"], "the final model differs between ranks"
    for d in done.values():
        assert d["size"] == 2 and d["epoch"] == epochs, d
        assert d["iterations"] == epochs * steps, d  # replayed batches counted once
    assert done[0]["sizes"][:3] == [2, 1, 2], done[0]["sizes"]
    assert done[2]["sizes"] == [2], done[2]["sizes"]
    messages = "\n".join(result.hora_messages())
    assert "worker 1 on localhost was killed by SIGKILL" in messages, messages
    assert "generation 2: 1 worker(s) (left: worker 1 on localhost; joined: none)" in messages
    assert "generation 3: 2 worker(s) (left: none; joined: worker 2 on localhost)" in messages
    # the failure reached rank 0 as a TensorFlow error out of fit's train step, and the loop
    # treated it as a failed collective (else rank 0 would have exited with it)
    assert result.lines("stdout").get(0, [])[0] == "fit failed: UnknownError", result.out
    rank0 = "\n".join(result.lines("stderr").get(0, []))
    assert "a collective failed" in rank0 and "rolling back to the last commit" in rank0
