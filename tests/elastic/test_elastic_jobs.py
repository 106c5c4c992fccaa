"""Elastic jobs end to end on this host: real `hora run` elastic drivers, real worker processes
killed with SIGKILL, real rendezvous. Every job runs under a hard timeout and is killed with its
workers on exit (tests/runner/helpers.Launcher)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from runner.helpers import PY, Result, clean_env, run_hora

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
JOB_TIMEOUT = 60.0


def elastic_job(*flags: str, timeout: float = JOB_TIMEOUT, **env: str) -> Result:
    return run_hora("run", *flags, PY, WORKER, env=clean_env(**env), timeout=timeout)


def steps_done(log: Path, wid: int) -> Counter[int]:
    path = log / f"worker.{wid}"
    if not path.exists():
        return Counter()
    return Counter(int(line.split()[0]) for line in path.read_text().splitlines())


def test_killed_worker_is_replaced_and_uncommitted_steps_replay_once(tmp_path: Path) -> None:
    # 3 workers on one host, commits every 5 steps; worker 2 dies at the top of step 18, after
    # the commit at step 15: the survivors roll back to 15 and replay steps 16 and 17 once.
    # 80 steps of >= 50 ms: the replacement has seconds to start and join before the end
    result = elastic_job("-np", "3", "--min-np", "2", "--max-np", "3", "--verbose",
                         EW_LOG=str(tmp_path), EW_KILL="2:18", EW_STEPS="80")
    assert result.rc == 0, result.err[-3000:]
    done = result.json_lines("wid")
    assert sorted(done) == [0, 1, 3]  # worker 3 replaced worker 2
    weights = {tuple(d["w"]) for d in done.values()}
    assert len(weights) == 1, "the final model differs between ranks"
    assert all(d["step"] == 80 and d["size"] == 3 for d in done.values())
    assert done[0]["sizes"] == [3, 2, 3]
    assert len({d["samples"] for d in done.values()}) == 1
    for survivor in (0, 1):
        counts = steps_done(tmp_path, survivor)
        replayed = sorted(step for step, n in counts.items() if n > 1)
        assert replayed == [16, 17] and max(counts.values()) == 2, counts
        assert sorted(counts) == list(range(1, 81))
    joined = steps_done(tmp_path, 3)
    assert joined and min(joined) > 17 and max(joined.values()) == 1
    messages = "\n".join(result.hora_messages())
    assert "worker 2 on localhost was killed by SIGKILL" in messages
    assert "generation 2: 2 worker(s) (left: worker 2 on localhost; joined: none)" in messages
    assert "generation 3: 3 worker(s) (left: none; joined: worker 3 on localhost)" in messages
    assert "s after the failure" in messages


def test_a_second_failure_during_the_recovery_sync_recovers_too(tmp_path: Path) -> None:
    # Worker 2 dies at step 12; worker 1 then dies inside the state sync of the recovery. Two
    # names of this machine make two hosts, so that neither reaches the blacklisting threshold.
    result = elastic_job("-np", "3", "--min-np", "1", "--max-np", "3",
                         "-H", "localhost:2,127.0.0.1:1",
                         EW_LOG=str(tmp_path), EW_KILL="2:12", EW_KILL_IN_SYNC="1",
                         EW_STEPS="40")
    assert result.rc == 0, result.err[-3000:]
    done = result.json_lines("wid")
    assert 0 in done and 1 not in done and 2 not in done
    assert len({tuple(d["w"]) for d in done.values()}) == 1
    assert all(d["step"] == 40 for d in done.values())
    messages = "\n".join(result.hora_messages())
    assert "worker 2 on 127.0.0.1 was killed by SIGKILL" in messages
    assert "worker 1 on localhost was killed by SIGKILL" in messages


def test_survivors_below_min_np_fail_after_the_elastic_timeout(tmp_path: Path) -> None:
    mark = tmp_path / "killed"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {mark} ]; then echo localhost:1; "
                      "else echo localhost:2; fi\n")
    script.chmod(0o755)
    started = time.monotonic()
    result = elastic_job("-np", "2", "--min-np", "2", "--host-discovery-script", str(script),
                         "--elastic-timeout", "3", EW_KILL="1:8", EW_MARK=str(mark),
                         EW_STEPS="1000")
    assert result.rc == 1, result.err[-3000:]
    # the kill happens ~3 s in (2.5 s of it waiting for discovery): timeout 3 s + 10 s
    assert time.monotonic() - started < 3 + 3 + 10 + 5
    messages = "\n".join(result.hora_messages())
    assert "fewer than --min-np 2; waiting up to 3 s (--elastic-timeout)" in messages
    assert "error: elastic job failed: only 1 worker(s) (worker 0 on localhost) were ready" \
        in messages
    worker0 = "\n".join(result.lines("stderr").get(0, []))
    assert "ElasticError: the elastic job failed: only 1 worker(s)" in worker0


def test_discovery_failing_at_start_ends_the_job_at_once(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'no cluster here' >&2\nexit 4\n")
    script.chmod(0o755)
    result = elastic_job("-np", "2", "--host-discovery-script", str(script), timeout=20)
    assert result.rc == 1
    messages = "\n".join(result.hora_messages())
    assert "host discovery failed at start" in messages
    assert "exit code 4" in messages and "no cluster here" in messages


def test_discovery_garbage_later_is_reported_and_the_job_goes_on(tmp_path: Path) -> None:
    # first poll: a host listed twice (same line: de-duplicated); later polls: garbage.
    count = tmp_path / "count"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {count} ]; then echo 'not a host list!'; "
                      f"else touch {count}; echo localhost:2; echo localhost:2; fi\n")
    script.chmod(0o755)
    result = elastic_job("-np", "2", "--host-discovery-script", str(script), EW_STEPS="40",
                         EW_SLEEP="0.06")
    assert result.rc == 0, result.err[-3000:]
    assert sorted(result.json_lines("wid")) == [0, 1]
    messages = "\n".join(result.hora_messages())
    assert "host discovery failed; keeping the last hosts it listed (localhost:2)" in messages
    assert "is not <hostname>[:<slots>]" in messages


def test_reset_limit_ends_the_job_with_horovods_message(tmp_path: Path) -> None:
    # two failures on two host names (neither is blacklisted): the second reset passes the limit
    result = elastic_job("-np", "3", "--min-np", "1", "--max-np", "3", "--reset-limit", "1",
                         "-H", "localhost:2,127.0.0.1:1", EW_KILL="2:8", EW_KILL_IN_SYNC="1",
                         EW_STEPS="1000")
    assert result.rc == 1, result.err[-3000:]
    messages = "\n".join(result.hora_messages())
    assert ("Horovod was shutdown because number of resets during elastic job exceeded "
            "limit: 1 (--reset-limit)") in messages
    assert "ElasticError" in "\n".join(result.lines("stderr").get(0, []))
