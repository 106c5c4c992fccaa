"""Autotune in real jobs (``hora run --autotune`` and ranks started as torchrun would).

A small training loop (``autotune_worker.py``) runs until rank 0's tuner has settled: the log
file has Horovod's columns, one row per sample and the chosen setting last; the settings
changed from sample to sample; every rank applied the same settings in the same order; the
trained weights are the same bytes on every rank. Across hosts (ranks with their own
``HORA_HOSTNAME``), hierarchical allreduce and allgather are tried the other way round, every
rank rebuilding its route at the same point. Asking for autotune without scikit-learn, or with
a log file that cannot be written, fails at ``init()`` with a message saying so.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from _case_jobs import spawn_ranks
from runner.helpers import clean_env, run_hora

from hora._util.net import free_port
from hora.core.autotune.autotune_search import HEADER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKER = str(Path(__file__).with_name("autotune_worker.py"))
FAST = ("--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2")


def _reports(out: str) -> dict[int, dict]:
    found = {}
    for line in out.splitlines():
        payload = line.partition(">:")[2] if line.startswith("[") else line
        if payload.startswith("{"):
            data = json.loads(payload)
            found[data["rank"]] = data
    return found


def _rows(path: Path) -> tuple[list[str], list[dict[str, float]]]:
    with path.open() as f:
        reader = csv.reader(f)
        header = next(reader)
        return header, [dict(zip(header, map(float, row))) for row in reader]


def _setting(row: dict[str, float]) -> tuple[float, ...]:
    return tuple(row[k] for k in HEADER.split(",")[:-1])


def test_autotune_settles_on_the_best_scored_setting_alike_on_every_rank(tmp_path: Path) -> None:
    log_file = tmp_path / "autotune.csv"
    done = run_hora("run", "-np", "2", "--autotune", "--autotune-log-file", str(log_file), *FAST,
                    "--autotune-bayes-opt-max-samples", "6", "--log-level", "info",
                    sys.executable, WORKER, "400", env=clean_env(), timeout=150)
    assert done.rc == 0, done.out + done.err
    header, rows = _rows(log_file)
    assert ",".join(header) == HEADER
    assert len(rows) == 6 + 1, rows  # one per sample, the best last
    samples, final = rows[:-1], rows[-1]
    assert len({(r["tensor_fusion_threshold"], r["cycle_time_ms"]) for r in samples}) >= 4
    # the last row: the measured setting the model rates best, with its estimate (scores are
    # relative to the starting setting, whose own is 1 by definition)
    assert any(_setting(final) == _setting(r) for r in samples), (final, samples)
    if _setting(final) == _setting(samples[0]):
        assert final["score"] == pytest.approx(1.0, abs=1e-3)
    assert all(0 < r["score"] < 10 for r in rows)
    assert {r["torus_allreduce"] for r in rows} == {0} and {r["cache_enabled"] for r in rows} == {1}
    # the first sample is the starting setting (128 MB clipped to 64), then Horovod's probes
    assert [(r["tensor_fusion_threshold"], r["cycle_time_ms"]) for r in samples[:5]] == [
        (64, 0), (4, 1), (32, 10), (16, 5), (8, 2)]

    reports = _reports(done.out)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["active"] is False, report
        assert report["applied"] == reports[0]["applied"]  # the same settings, in order
        assert report["digest"] == reports[0]["digest"]  # the same trained weights
        assert report["steps"] == reports[0]["steps"] < 400
    applied = reports[0]["applied"]
    assert [a["active"] for a in applied] == [True] * (len(applied) - 1) + [False]
    last = applied[-1]
    # the log prints 6 significant digits (%g), the settings are exact
    assert last["fusion"] / 2**20 == pytest.approx(final["tensor_fusion_threshold"], rel=1e-5)
    assert last["cycle"] == pytest.approx(final["cycle_time_ms"], rel=1e-5)
    rank0 = [ln for ln in done.err.splitlines() if ln.startswith("[0]<stderr>")]
    assert sum("autotune: [hierarchical_allreduce" in ln and " score " in ln
               and "for the starting setting" in ln for ln in rank0) == 6
    assert sum("autotune: warming up" in ln for ln in rank0) == 1
    assert any("autotune: done after 6 sample(s); best: fusion threshold" in ln for ln in rank0)
    assert any("autotune: the model's best of 6 settings:" in ln for ln in rank0)
    for rank in (0, 1):  # every rank logs the final setting
        lines = [ln for ln in done.err.splitlines() if ln.startswith(f"[{rank}]<stderr>")
                 and "hora.core.autotune.autotune] autotune: fusion threshold" in ln]
        assert len(lines) == 1 and lines[0].endswith("(final)"), lines


def _spawn_across_hosts(tmp_path: Path, hostnames: list[str], extra: dict[str, str]
                        ) -> list[str]:
    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(len(hostnames)), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "HORA_RENDEZVOUS_PORT": store_port,
             "HORA_JOB_ID": f"at{os.getpid()}", "HORA_HOSTNAME": host, "HORA_LOG_LEVEL": "info",
             "HORA_START_TIMEOUT": "30", "OMP_NUM_THREADS": "1", **extra}
            for r, host in enumerate(hostnames)]
    outs = []
    for rank, (code, out) in enumerate(spawn_ranks([sys.executable, WORKER, "300",
                                                    "--allgather"], envs, timeout=150)):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        outs.append(out)
    return outs


def test_across_hosts_hierarchical_choices_are_tried_and_routes_rebuilt_together(
        tmp_path: Path) -> None:
    """2 hosts x 2 ranks; the fusion threshold and cycle time set explicitly stay fixed, so the
    samples are: the start (hierarchical allreduce automatic: on), flat allreduce, then the
    allgather flipped with the better allreduce."""
    log_file = tmp_path / "autotune.csv"
    outs = _spawn_across_hosts(tmp_path, ["a", "a", "b", "b"], {
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log_file),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HOROVOD_FUSION_THRESHOLD": str(8 * 2**20), "HOROVOD_CYCLE_TIME": "0"})
    _, rows = _rows(log_file)
    assert len(rows) == 3 + 1, rows
    assert {(r["tensor_fusion_threshold"], r["cycle_time_ms"]) for r in rows} == {(8, 0)}
    assert [(r["hierarchical_allreduce"], r["hierarchical_allgather"]) for r in rows[:2]] == [
        (1, 0), (0, 0)]
    better_allreduce = rows[0] if rows[0]["score"] >= rows[1]["score"] else rows[1]  # (a tie:
    # the first stays best)
    assert (rows[2]["hierarchical_allreduce"], rows[2]["hierarchical_allgather"]) == (
        better_allreduce["hierarchical_allreduce"], 1)
    best = max(rows[:-1], key=lambda r: r["score"])
    assert _setting(rows[-1]) == _setting(best)

    reports = [_reports(out) for out in outs]
    paths = []
    for rank, (out, report) in enumerate(zip(outs, reports)):
        mine = report[rank]
        assert mine["applied"] == reports[0][0]["applied"] and mine["active"] is False
        assert mine["digest"] == reports[0][0]["digest"]
        # the data path of the global set, each time it was (re)built
        paths.append([ln.rsplit(": ", 1)[1] for ln in out.splitlines()
                      if "process set 0 (4 ranks) data path:" in ln])
    assert all(p == paths[0] for p in paths), paths
    assert paths[0][:2] == ["shard", "ring"], paths[0]  # hierarchical, then flat


def test_autotune_needs_scikit_learn_and_a_writable_log(tmp_path: Path) -> None:
    no_sklearn = ("import sys; sys.modules['sklearn'] = None\n"  # as if not installed
                  "import hora; hora.init()")
    done = run_hora("run", "-np", "2", "--autotune", sys.executable, "-c", no_sklearn,
                    env=clean_env(), timeout=60)
    assert done.rc != 0
    assert ("autotune (HOROVOD_AUTOTUNE=1, hora run --autotune) needs scikit-learn" in done.err
            and "pip install scikit-learn" in done.err), done.err
    missing = tmp_path / "no" / "such" / "dir" / "log.csv"
    done = run_hora("run", "-np", "2", "--autotune", "--autotune-log-file", str(missing),
                    sys.executable, "-c", "import hora; hora.init()", env=clean_env(),
                    timeout=60)
    assert done.rc != 0
    assert f"HOROVOD_AUTOTUNE_LOG='{missing}': cannot write the autotune log there" in done.err


def test_bad_autotune_values_are_refused_before_anything_starts() -> None:
    for flag, value, words in (
            ("--autotune-gaussian-process-noise", "1.5", "must be <= 1.0"),
            ("--autotune-gaussian-process-noise", "-0.5", "must be >= 0"),
            ("--autotune-warmup-samples", "-1", "must be >= 0"),
            ("--autotune-steps-per-sample", "0", "must be >= 1"),
            ("--autotune-bayes-opt-max-samples", "-3", "must be >= 1")):
        done = run_hora("run", "-np", "2", "--autotune", flag, value, "true", env=clean_env())
        assert done.rc == 2 and f"{flag}='{value}'" in done.err and words in done.err, done.err
    done = run_hora("run", "-np", "1", "-x", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE=2",
                    sys.executable, "-c", "import hora; hora.init()", env=clean_env())
    assert done.rc != 0 and ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE='2': knob "
                             "'autotune_gaussian_process_noise' must be <= 1.0") in done.err


def test_a_config_file_s_autotune_section_is_read() -> None:
    from hora.runner.config_file import config_values

    values, _ = config_values({"autotune": {
        "enabled": True, "log_file": "tune.csv", "warmup_samples": 5, "steps_per_sample": 20,
        "bayes_opt_max_samples": 40, "gaussian_process_noise": 0.5}}, "cfg.yaml")
    assert values == {"autotune": True, "autotune_log": "tune.csv", "autotune_warmup_samples": 5,
                      "autotune_steps_per_sample": 20, "autotune_bayes_opt_max_samples": 40,
                      "autotune_gaussian_process_noise": 0.5}
