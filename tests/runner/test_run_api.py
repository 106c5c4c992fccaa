"""``hora.run(func, ...)`` (Horovod's ``horovod.run``): real multi-process jobs started in this
process through the launcher, results and exceptions carried back through the call's store.

The functions below are module-level, so cloudpickle would send them by reference and the ranks
would have to import this test module; it is registered to be pickled by value instead (as a
user would with a module the ranks cannot import).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import hora
from hora.runner.api import RankFailedError, RemoteTraceback
from hora.runner.run_func import SECRET_VAR, STORE_VAR

from .helpers import PY, clean_env, fake_ssh_path

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]



def topology_and_sum(scale: float, *, offset: float = 0.0) -> tuple[int, int, list[float]]:
    hora.init()
    total = hora.allreduce(np.full(4, hora.rank() + 1.0), op=hora.Sum)
    return hora.rank(), hora.size(), (total * scale + offset).tolist()


def fail_in_rank_one(message: str) -> str:
    if os.environ["HORA_RANK"] == "1":
        raise ValueError(message)
    return "fine"


def exit_in_rank_one(how: str, peer: str) -> None:
    hora.init()
    if hora.rank() == 1:
        if how == "os._exit":
            os._exit(3)
        if how == "sys.exit":
            sys.exit(2)
        os.kill(os.getpid(), signal.SIGKILL)
    if peer == "sleeps":
        time.sleep(60)  # rank 0 must be stopped by the launcher, not finish
    # else rank 0 waits in a collective that fails (a ShutdownError or PeerLostError of its
    # own): rank 1 must still be named as the root cause
    hora.allreduce(np.ones(2))


# ---- results ---------------------------------------------------------------------------------

def test_results_in_rank_order_with_an_allreduce() -> None:
    results = hora.run(topology_and_sum, args=(2.0,), kwargs={"offset": 0.5}, np=2)
    assert results == [(0, 2, [6.5] * 4), (1, 2, [6.5] * 4)]


def test_closures_lambdas_and_large_arguments() -> None:
    big = np.arange(1_000_000, dtype=np.float64)  # 8 MB: never on a command line
    factor = 3

    def closure(arr: np.ndarray) -> float:
        return float(arr.sum()) * factor + int(os.environ["HORA_RANK"])

    assert hora.run(closure, args=(big,), np=2) == [float(big.sum()) * 3, float(big.sum()) * 3 + 1]
    rank_of = hora.run(lambda: int(os.environ["HORA_RANK"]) * factor, np=2)
    assert rank_of == [0, 3]
    # np=1 is the default; a returned lambda comes back too (cloudpickle)
    [returned] = hora.run(lambda: (lambda x: x + factor))
    assert returned(1) == 4


def test_the_function_travels_in_the_store_not_on_argv_or_in_the_environment() -> None:
    def inspect() -> dict[str, Any]:
        with open("/proc/self/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")[:-1]
        return {"argv": [a.decode() for a in argv],
                "store_vars": [k for k in (STORE_VAR, SECRET_VAR) if k in os.environ]}

    [seen] = hora.run(inspect, np=1)
    assert seen["argv"][1:] == ["-m", "hora.runner.run_func"]
    assert seen["store_vars"] == []  # removed before func runs


def test_output_and_launch_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def speak() -> dict[str, str]:
        print(f"hello from {os.environ['HORA_RANK']}")
        print("on stderr", file=sys.stderr)
        return {k: os.environ.get(k, "") for k in ("HORA_START_TIMEOUT", "HORA_GLOO_IFACE")}

    out = tmp_path / "logs"
    seen = hora.run(speak, np=2, start_timeout=17, network_interface="lo", verbose=True,
                    output_filename=str(out), disable_cache=True, use_gloo=True)
    assert seen == [{"HORA_START_TIMEOUT": "17", "HORA_GLOO_IFACE": "lo"}] * 2
    captured = capsys.readouterr()
    assert "[0]<stdout>:hello from 0" in captured.out
    assert "[1]<stdout>:hello from 1" in captured.out
    assert "[1]<stderr>:on stderr" in captured.err
    assert "[hora] rank 1: HOROVOD_RANK=1" in captured.err  # verbose
    assert SECRET_VAR not in captured.err and STORE_VAR not in captured.err
    assert (out / "rank.1" / "stdout").read_text() == "hello from 1\n"


# ---- failures --------------------------------------------------------------------------------

def test_an_exception_is_reraised_with_its_type_rank_and_remote_traceback() -> None:
    with pytest.raises(ValueError, match="^bad value in rank 1") as info:
        hora.run(fail_in_rank_one, args=("bad value in rank 1",), np=2)
    assert info.value.args == ("bad value in rank 1",)
    if sys.version_info >= (3, 11):
        assert "raised in rank 1 of 2 of hora.run" in "".join(info.value.__notes__)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.rank == 1
    assert "in fail_in_rank_one" in cause.text
    assert "ValueError: bad value in rank 1" in cause.text


def test_the_failing_rank_is_reported_while_the_other_waits_in_a_collective() -> None:
    def one_rank_raises() -> float:
        hora.init()
        if hora.rank() == 1:
            raise KeyError("rank 1 gave up")
        return float(hora.allreduce(np.ones(2), op=hora.Sum)[0])  # never completes

    with pytest.raises(KeyError, match="rank 1 gave up") as info:
        hora.run(one_rank_raises, np=2)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert info.value.__cause__.rank == 1


def test_a_module_the_ranks_cannot_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    (tmp_path / "only_here_mod.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here_mod  # type: ignore[import-not-found]

    with pytest.raises(ModuleNotFoundError, match="only_here_mod") as info:
        hora.run(only_here_mod.f, np=1)
    if sys.version_info >= (3, 11):
        assert "register_pickle_by_value" in "".join(info.value.__notes__)


def test_an_exception_that_cannot_be_pickled_back_becomes_a_runtime_error() -> None:
    def raise_odd() -> None:
        class OddError(Exception):
            def __init__(self, a: int, b: int) -> None:  # pickle calls OddError("text"): fails
                super().__init__(f"odd {a} {b}")

        raise OddError(1, 2)

    with pytest.raises(RuntimeError, match=r"rank 0 of 1 raised .*OddError: odd 1 2") as info:
        hora.run(raise_odd)
    assert isinstance(info.value, RankFailedError) and info.value.rank == 0
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "OddError: odd 1 2" in info.value.__cause__.text


@pytest.mark.parametrize(("how", "pattern", "status", "peer"), [
    ("os._exit", r"rank 1 of 2 on \S+ exited with code 3 without returning a result", 3,
     "sleeps"),
    ("sys.exit", r"rank 1 of 2 called sys.exit\(2\)", 2, "waits in allreduce"),
    ("SIGKILL", r"rank 1 of 2 on \S+ was killed by signal SIGKILL", 128 + 9,
     "waits in allreduce"),
    ("os._exit", r"rank 1 of 2 on \S+ exited with code 3 without returning a result", 3,
     "waits in allreduce"),
])
def test_a_rank_that_dies_without_a_result_is_named(how: str, pattern: str, status: int,
                                                    peer: str) -> None:
    """The other rank (sleeping, or blocked in a collective) is stopped, not waited for: the
    test's timeout bounds it."""
    with pytest.raises(RuntimeError, match=pattern) as info:
        hora.run(exit_in_rank_one, args=(how, peer), np=2)
    assert isinstance(info.value, RankFailedError)
    assert (info.value.rank, info.value.exit_status) == (1, status)


# ---- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"np": 0}, ValueError, "np must be >= 1"),
    ({"np": "2"}, TypeError, "np must be an int"),
    ({"np": 2, "min_np": 3}, ValueError, "--min-np 3 is more than -np 2"),
    ({"np": 2, "reset_limit": 2}, ValueError, "reset_limit only apply to elastic mode"),
    ({"np": 2, "slots": 2}, ValueError, "slots only apply to elastic mode"),
    ({"np": 2, "min_np": 1, "cooldown_range": (0, 5)}, ValueError,
     "--blacklist-cooldown-range"),
    ({"np": 2, "use_mpi": True}, ValueError, "use_mpi=True is not available"),
    ({"np": 2, "hosts": "a:2", "hostfile": "f"}, ValueError, "hosts or hostfile, not both"),
    ({"np": 3, "hosts": "localhost:2"}, ValueError, "too few slots"),
    ({"np": 2, "network_interface": "nosuchif0"}, ValueError, "'nosuchif0' does not exist"),
])
def test_bad_arguments_start_nothing(kwargs: dict[str, Any], error: type[Exception],
                                     pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        hora.run(os.getpid, **kwargs)


def test_an_executable_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot start rank 0: .*no-python") as info:
        hora.run(os.getpid, np=2, executable=str(tmp_path / "no-python"))
    assert isinstance(info.value, RankFailedError) and info.value.rank == 0


def test_func_and_arguments_must_be_usable() -> None:
    with pytest.raises(TypeError, match="func must be callable"):
        hora.run(42, np=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be picklable"):
        hora.run(print, args=(threading.Lock(),), np=1)


def test_import_hora_does_not_import_the_launcher() -> None:
    code = ("import json, sys, hora; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hora.runner'))))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True,
                         env=clean_env(), check=True, timeout=20).stdout
    assert json.loads(out) == []


# ---- other hosts (fake ssh: the "remote" ranks run here, set up through the ssh path) ----------

REMOTE_SCRIPT = """\
import json, os, sys
import hora.runner.launch as launch, hora.runner.network as network
launch.is_local_host = lambda host: not host.startswith("fake")
launch.store_address = lambda remote, config: network.StoreAddress("127.0.0.1", "lo", "test")
import hora

def where(greeting):
    hora.init()
    return [greeting, hora.rank(), os.environ["HOROVOD_HOSTNAME"], hora.local_rank()]

print("RESULT " + json.dumps(hora.run(where, args=("hi-7f3a",), np=3, hosts="fake1:2,fake2:1")))
"""


def test_ranks_on_other_hosts_over_the_ssh_path(tmp_path: Path) -> None:
    log = tmp_path / "ssh.log"
    env = clean_env(PATH=fake_ssh_path(tmp_path), FAKE_SSH_LOG=str(log))
    proc = subprocess.run([PY, "-c", REMOTE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=25, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert json.loads(line[len("RESULT "):]) == [
        ["hi-7f3a", 0, "fake1", 0], ["hi-7f3a", 1, "fake1", 1], ["hi-7f3a", 2, "fake2", 0]]
    # every rank went through ssh, and neither the secret nor the function was on its argv
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    rank_calls = [c for c in calls if any("hora-rank=" in a for a in c)]
    assert len(rank_calls) == 3
    assert not any("_HORA_RUN" in a or "7f3a" in a for c in calls for a in c)
