"""Horovod settings in the launcher's environment are honoured or refused by ``hora run``, never
replaced without a word (real launcher processes, hard timeouts).

``hora run`` sets ``HOROVOD_CONTROLLER=gloo`` and ``HOROVOD_CPU_OPERATIONS=gloo`` for its ranks
as horovodrun does, but only where the launcher's environment does not set them:
``HOROVOD_CPU_OPERATIONS=mpi`` selects the mpi data plane (ranks under mpirun, one line says
so), ``HOROVOD_CONTROLLER=mpi`` and ``HOROVOD_CPU_OPERATIONS=ccl`` are refused before any rank
starts, as they are under ``python`` or torchrun.
"""

from __future__ import annotations

import shutil

import pytest

from .helpers import clean_env, run_hora, worker

REPORT = "import hora; hora.init(); print('mpi_enabled', hora.mpi_enabled(), hora.size())"


def _mpi_missing() -> str:
    if shutil.which("mpirun") is None:
        return "Open MPI's mpirun is not installed (apt-get install openmpi-bin)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py)"
    return ""


@pytest.mark.parametrize("setting, refusal", [
    ("HOROVOD_CONTROLLER=mpi", "HOROVOD_CONTROLLER='mpi': hora does not support the MPI "
                               "controller"),
    ("HOROVOD_CPU_OPERATIONS=ccl", "HOROVOD_CPU_OPERATIONS='ccl': hora does not support oneCCL"),
])
def test_an_unsupported_setting_is_refused_before_any_rank_starts(setting: str,
                                                                  refusal: str) -> None:
    name, value = setting.split("=")
    result = run_hora("run", "-np", "2", *worker("print('rank started')"),
                      env=clean_env(**{name: value}))
    assert result.rc == 2, (result.rc, result.err)
    assert refusal in result.err, result.err
    assert "rank started" not in result.out, "refused before anything started"


def test_cpu_operations_mpi_is_not_replaced_by_gloo_without_mpirun() -> None:
    """Without mpirun the setting cannot be honoured: a clear error, not a silent gloo job."""
    result = run_hora("run", "-np", "2", *worker(REPORT),
                      env=clean_env(HOROVOD_CPU_OPERATIONS="mpi", PATH="/nonexistent"))
    assert result.rc != 0, result.out
    assert "mpi_enabled False" not in result.out, "ran on hora's own transport instead"
    assert "starts the ranks with mpirun, which is not on PATH" in result.err, result.err


@pytest.mark.skipif(bool(_mpi_missing()), reason=_mpi_missing() or "mpi ready")
def test_cpu_operations_mpi_is_honoured_with_one_line_saying_so() -> None:
    result = run_hora("run", "-np", "2", *worker(REPORT), timeout=90,
                      env=clean_env(HOROVOD_CPU_OPERATIONS="mpi", OMPI_ALLOW_RUN_AS_ROOT="1",
                                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    assert result.rc == 0, result.err
    assert result.lines() == {0: ["mpi_enabled True 2"], 1: ["mpi_enabled True 2"]}, result.out
    notes = [m for m in result.hora_messages() if m.startswith("HOROVOD_CPU_OPERATIONS=mpi")]
    assert notes == ["HOROVOD_CPU_OPERATIONS=mpi: the ranks start under mpirun and their tensors "
                     "move over MPI (the mpi data plane, as with --mpi)."], result.err


def test_gloo_settings_stay_what_horovodrun_sets() -> None:
    result = run_hora("run", "-np", "1", *worker(
        "import os; print(os.environ['HOROVOD_CONTROLLER'], os.environ['HOROVOD_CPU_OPERATIONS'])"),
        env=clean_env(HOROVOD_CPU_OPERATIONS="gloo"))
    assert result.rc == 0, result.err
    assert result.lines() == {0: ["gloo gloo"]}
