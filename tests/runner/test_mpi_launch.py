"""hora run's mpirun launch (hora/runner/mpi_launch.py): the command line it builds, and the
relay that turns mpirun's tagged pieces back into hora's per-rank lines. The jobs themselves
run in tests/integration/test_data_planes.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.runner.mpi_launch import SIGKILL_GRACE_S, _Copies, _relay, mpirun_argv, mpirun_program
from hora.runner.output import Console


class Captured(Console):
    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {"stdout": "", "stderr": ""}

    def write(self, stream: str, text: str) -> bool:
        self.text[stream] += text
        return True


def test_one_host_oversubscribes_and_forwards_variables_by_name() -> None:
    argv = mpirun_argv("/usr/bin/mpirun", 4, None, ("python", "train.py"),
                       ["HORA_SECRET_KEY", "PATH"])
    assert argv[:4] == ["/usr/bin/mpirun", "-np", "4", "--oversubscribe"]
    assert argv[-2:] == ["python", "train.py"]
    joined = " ".join(argv)
    assert "--bind-to none --map-by slot --tag-output" in joined
    assert f"--mca odls_base_sigkill_timeout {SIGKILL_GRACE_S}" in joined
    assert "-x HORA_SECRET_KEY -x PATH" in joined  # names only: values never reach argv
    assert "=" not in joined


def test_hosts_binding_ssh_interface_and_extra_arguments() -> None:
    argv = mpirun_argv("mpirun", 8, "a:4,b:4", ("train",), [], mpi_args="--mca btl ^openib -v",
                       binding_args="--bind-to core", ssh_port=2222,
                       ssh_identity_file="/k/id job", iface="eth1")
    joined = " ".join(argv)
    assert "-H a:4,b:4" in joined and "--oversubscribe" not in joined
    assert "--bind-to core" in joined and "--bind-to none" not in joined
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 2222 -i '/k/id job'"
    assert "--mca btl_tcp_if_include eth1 --mca oob_tcp_if_include eth1" in joined
    assert joined.endswith("--mca btl ^openib -v train")


def test_without_mpirun_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match=r"--data-plane mpi starts the ranks with mpirun, which "
                                          r"is not on PATH: install Open MPI \(apt-get install "
                                          r"openmpi-bin\) and mpi4py"):
        mpirun_program()


def test_pieces_of_a_rank_s_line_are_joined_and_mpirun_s_own_lines_pass(tmp_path: Path) -> None:
    read, write = os.pipe()
    console = Captured()
    copies = _Copies(str(tmp_path), 2)
    relay = threading.Thread(target=_relay, args=(os.fdopen(read, "rb"), "stdout", console,
                                                  copies, False))
    relay.start()
    with os.fdopen(write, "wb") as pipe:  # what mpirun writes when ranks print in pieces
        pipe.write(b"[1,0]<stdout>:loss [1,1]<stdout>:epoch 1\n"
                   b"[1,0]<stdout>:0.5\n[1,0]<stdout>:done\n"
                   b"mpirun noticed that process rank 1 exited\n"
                   b"[1,1]<stdout>:no newline at the end")
    relay.join(10)
    copies.close()
    assert console.text["stdout"].splitlines() == [
        "[1]<stdout>:epoch 1", "[0]<stdout>:loss 0.5", "[0]<stdout>:done",
        "mpirun noticed that process rank 1 exited", "[1]<stdout>:no newline at the end"]
    assert (tmp_path / "rank.0" / "stdout").read_text() == "loss 0.5\ndone\n"
    assert (tmp_path / "rank.1" / "stdout").read_text() == "epoch 1\nno newline at the end\n"


def test_error_blocks_are_held_and_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """hora.runner.mpi_errors: a failed job's blocks become one report (the root cause in
    full, the consequence in one line); a rank that ran on gets its block at once; a job that
    succeeded gets its blocks as they were."""
    from hora.runner import mpi_errors

    clock = [100.0]
    monkeypatch.setattr(mpi_errors.time, "monotonic", lambda: clock[0])
    said: list[str] = []
    console = Captured()
    errors = mpi_errors.MpiErrors(console.write, said.append)

    def feed(rank: int, text: str) -> bool:
        return errors.line(rank, "stderr", f"[{rank}]<stderr>:{text}\n", text)

    assert not feed(0, "loading data")  # not an error: written out by the relay
    assert feed(0, "[2026-01-01 10:00:00.000: ERROR rank 0/2 hora.core.engine.engine] slow")
    clock[0] += 10  # rank 0 ran on: its block is written, the line relayed
    assert not feed(0, "epoch 2")
    assert console.text["stderr"].endswith("slow\n")
    for line in ("Traceback (most recent call last):", '  File "t.py", line 6, in <module>',
                 "ValueError: bad input shape 42"):
        assert feed(1, line)
    for line in ("Traceback (most recent call last):",
                 "hora.errors.ShutdownError: Horovod has been shut down: rank 1 shut down"):
        assert feed(0, line)
    shown = len(console.text["stderr"])
    errors.report(1)
    rest = console.text["stderr"][shown:]
    assert rest.count("Traceback") == 1 and "ValueError: bad input shape 42" in rest, rest
    assert said[0].startswith("also failed after rank 1: rank 0 raised ShutdownError"), said
    assert said[1].splitlines() == [
        "job failed: mpirun exited with status 1; the root cause: rank 1's error (its "
        "traceback is above):", "  ValueError: bad input shape 42"]
    fine = mpi_errors.MpiErrors(console.write, said.append)
    fine.line(0, "stderr", "[0]<stderr>:Traceback (most recent call last):\n",
              "Traceback (most recent call last):")
    shown = len(console.text["stderr"])
    fine.report(0)
    assert console.text["stderr"][shown:] == "[0]<stderr>:Traceback (most recent call last):\n"
    assert len(said) == 2
