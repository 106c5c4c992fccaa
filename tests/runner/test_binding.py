"""``--cpu-binding``: each local rank on its own share of the launcher's cores (real launches)."""

from __future__ import annotations

import json
import os

import pytest

from hora.runner import binding

from .helpers import clean_env, run_hora, worker

SHOW_MASK = ("import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), "
             "os.environ.get('HORA_BOUND_CPUS')]))")
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.parametrize(("cores", "size", "parts"), [
    ([0, 1], 2, [(0,), (1,)]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ([0, 1, 2, 3, 4], 2, [(0, 1, 2), (3, 4)]),  # the first ranks take the extra cores
    ([4, 2, 9, 7], 4, [(2,), (4,), (7,), (9,)]),  # sorted, gaps kept
    ([0, 1, 2, 3, 4, 5, 6], 3, [(0, 1, 2), (3, 4), (5, 6)]),
])
def test_share_splits_the_cores_into_contiguous_near_equal_parts(
        cores: list[int], size: int, parts: list[tuple[int, ...]]) -> None:
    got = [binding.share(cores, r, size) for r in range(size)]
    assert got == parts
    assert sorted(c for part in got if part for c in part) == sorted(cores)


@pytest.mark.parametrize(("cores", "rank", "size"), [
    ([0, 1], 0, 1),  # one local rank has every core anyway
    ([0, 1], 0, 3),  # more ranks than cores: nothing to bind
    ([0, 1], 0, 0),  # elastic slots carry no local size
    ([0, 1], 2, 2),
])
def test_share_is_none_when_there_is_nothing_to_bind(cores: list[int], rank: int,
                                                    size: int) -> None:
    assert binding.share(cores, rank, size) is None


def test_cores_for_follows_the_knob_and_yields_to_thread_affinity() -> None:
    assert binding.cores_for("none", "", 0, 2) is None
    assert binding.cores_for("auto", "0,1", 0, 2) is None  # the user placed the threads
    if len(CORES) >= 2:
        assert binding.cores_for("auto", "", 0, 2) == binding.share(CORES, 0, 2)


def test_cpu_list_and_environment() -> None:
    assert binding.cpu_list([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert binding.bound_environment((4, 5)) == {"HORA_BOUND_CPUS": "4-5"}
    assert binding.bound_environment(None) == {}


def masks(*args: str) -> dict[int, tuple[list[int], str | None]]:
    result = run_hora("run", *args, *worker(SHOW_MASK), env=clean_env())
    assert result.rc == 0, result.err
    return {rank: tuple(json.loads(out[0])) for rank, out in result.lines().items()}


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to bind two ranks apart")
def test_two_ranks_run_on_disjoint_shares_that_cover_the_launchers_cores() -> None:
    got = masks("-np", "2")
    for rank in (0, 1):
        cores, named = got[rank]
        assert tuple(cores) == binding.share(CORES, rank, 2)
        assert named == binding.cpu_list(cores)
    assert sorted(got[0][0] + got[1][0]) == CORES


def test_ranks_are_not_bound_with_none_or_more_ranks_than_cores() -> None:
    for rank, (cores, named) in masks("-np", "2", "--cpu-binding", "none").items():
        assert (cores, named) == (CORES, None), rank
    over = str(len(CORES) + 1)
    got = masks("-np", over)
    assert sorted(got) == list(range(len(CORES) + 1))
    assert all(v == (CORES, None) for v in got.values())


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to bind two ranks apart")
def test_the_binding_benchmark_runs_both_settings_and_torch_follows_the_mask() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_binding.py"
    out = subprocess.run([sys.executable, str(script), "--jobs", "1", "--steps", "2",
                          "--warmup", "1", "--hidden", "32", "--batch", "8"],
                         capture_output=True, text=True, timeout=240, env=clean_env(),
                         check=False)
    assert out.returncode == 0, out.stderr
    share = len(binding.share(CORES, 0, 2) or ())
    assert "auto: median" in out.stdout and "none: median" in out.stdout, out.stdout
    assert "--cpu-binding auto: " in out.stdout
    assert f"({share} torch threads per rank)" in out.stdout  # torch sized its pool to the share
    assert "none / auto time:" in out.stdout


def test_the_variable_the_ranks_read_is_the_one_the_launcher_sets() -> None:
    from hora._util import cpus

    assert binding.BOUND_VAR == cpus.BOUND_VAR  # (spelled twice: binding runs without hora)
