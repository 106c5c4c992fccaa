"""Every knob of the table has an effect, or is refused (docs/config.md).

* Refused: a Horovod knob whose effect hora does not have (torus, NCCL streams, the MPI
  controller, MPI/oneCCL CPU operations) accepts the values that match what
  hora does, silently, and refuses any other, from the environment, a ``hora run`` flag, a
  config file or ``init()``, with a message that says why and what to use instead.
* Built here: ``HOROVOD_THREAD_AFFINITY`` (the engine's threads pinned, read back from
  ``/proc/<pid>/task/<tid>/status`` in a real 2-rank job) and ``HOROVOD_DISABLE_GROUP_FUSION``
  (fusion seen in a real job's timeline, in the coordinator and in the fast lane).
* Every other knob is read by the code that implements it (a static scan).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runner.helpers import clean_env, run_hora

from hora.config import KNOBS, KNOBS_BY_NAME, Config, Knob, check_supported, load, parse_value
from hora.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

REFUSED = [k for k in KNOBS if k.unsupported]

# A value of each refused knob that asks for the effect hora does not have.
REFUSED_VALUE: dict[str, str] = {
    "torus_allreduce": "1", "num_nccl_streams": "2", "controller": "mpi", "cpu_operations": "ccl",
}

# What each refusal must say besides "hora does not support": why, and what to use instead.
REASON: dict[str, str] = {
    "torus_allreduce": r"NCCL.*HOROVOD_HIERARCHICAL_ALLREDUCE=1",
    "num_nccl_streams": r"no NCCL.*torch\.distributed",
    "controller": r"MPI controller.*HOROVOD_CONTROLLER=gloo",
    "cpu_operations": r"oneCCL.*HOROVOD_CPU_OPERATIONS=mpi.*mpi data plane.*HORA_DATA_PLANE",
}


def test_the_refused_knobs_are_the_ones_this_file_covers() -> None:
    assert {k.name for k in REFUSED} == set(REFUSED_VALUE) == set(REASON)


# ---- refused: environment ---------------------------------------------------------------------

@pytest.mark.parametrize("knob", REFUSED, ids=lambda k: k.name)
@pytest.mark.parametrize("which", ["env", "alias"])
def test_a_value_asking_for_a_missing_effect_is_refused_with_why_and_what_instead(
        knob: Knob, which: str) -> None:
    var = knob.env if which == "env" else knob.alias
    assert var is not None
    raw = REFUSED_VALUE[knob.name]
    with pytest.raises(ConfigError, match=rf"^{var}='{raw}': hora does not support") as err:
        load({var: raw})
    message = str(err.value)
    assert re.search(REASON[knob.name], message, re.S), message
    assert f"To go on, unset {var}" in message, message


@pytest.mark.parametrize("knob", REFUSED, ids=lambda k: k.name)
def test_the_value_that_matches_hora_passes_silently(knob: Knob) -> None:
    text = ("1" if knob.default else "0") if isinstance(knob.default, bool) else str(knob.default)
    for var in (knob.env, knob.alias):
        assert var is not None
        assert getattr(load({var: text}), knob.name) == knob.default


def test_what_horovod_users_leave_in_their_environment_is_accepted() -> None:
    from hora.runner.launch import LAUNCHER_DEFAULTS

    assert load(dict(LAUNCHER_DEFAULTS)) == Config()  # what hora run sets for every rank
    left_over = {"HOROVOD_AUTOTUNE": "0", "HOROVOD_CONTROLLER": "GLOO",
                 "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_TORUS_ALLREDUCE": "false",
                 "HOROVOD_NUM_NCCL_STREAMS": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "3",
                 "HOROVOD_AUTOTUNE_LOG": ""}
    assert load(left_over) == Config()
    for value in ("0", "1"):  # hora never initialises MPI: both thread levels hold
        assert load({"HOROVOD_MPI_THREADS_DISABLE": value}).mpi_threads_disable == (value == "1")
        check_supported(KNOBS_BY_NAME["mpi_threads_disable"], value == "1", "--mpi-threads-disable")


def test_controller_and_cpu_operations_refuse_each_missing_library() -> None:
    with pytest.raises(ConfigError, match="HOROVOD_CPU_OPERATIONS='ccl': hora does not support "
                                          "oneCCL CPU operations"):
        load({"HOROVOD_CPU_OPERATIONS": "ccl"})
    with pytest.raises(ConfigError, match="expected one of gloo, mpi"):
        load({"HOROVOD_CONTROLLER": "nccl"})


def test_mpi_cpu_operations_select_the_mpi_data_plane() -> None:
    """Horovod's MPI CPU operations are hora's mpi data plane (docs/data-planes.md)."""
    assert load({"HOROVOD_CPU_OPERATIONS": "MPI"}).data_plane == "mpi"
    assert load({"HOROVOD_CPU_OPERATIONS": "mpi", "HORA_DATA_PLANE": "mpi"}).data_plane == "mpi"
    assert load({"HOROVOD_CPU_OPERATIONS": "gloo", "HORA_DATA_PLANE": "torch"}).data_plane == (
        "torch")
    with pytest.raises(ConfigError, match="HOROVOD_CPU_OPERATIONS=mpi asks for the mpi data "
                                          "plane, but HORA_DATA_PLANE=torch asks for another"):
        load({"HOROVOD_CPU_OPERATIONS": "mpi", "HORA_DATA_PLANE": "torch"})
    with pytest.raises(ConfigError, match=r"HORA_DATA_PLANE='nccl' is not a valid value for knob "
                                          r"'data_plane' \(str\): expected one of builtin, "
                                          r"torch, mpi"):
        load({"HORA_DATA_PLANE": "nccl"})


# ---- refused: hora run flags, config file, hora run's environment, init() ----------------------

def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from hora.runner.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("knob", [k for k in REFUSED if k.cli], ids=lambda k: k.name)
def test_hora_run_refuses_the_flag_before_starting_anything(
        capsys: pytest.CaptureFixture[str], knob: Knob) -> None:
    assert knob.cli is not None
    argv = [knob.cli] if knob.type is bool else [knob.cli, REFUSED_VALUE[knob.name]]
    rc, err = _run_cli(capsys, "run", "-np", "2", *argv, "true")
    assert rc == 2
    assert f"{argv[0]}" in err and "hora does not support" in err and "Drop " + knob.cli in err
    if knob.type is bool:  # --no-<flag> asks for nothing hora lacks
        rc, _ = _run_cli(capsys, "run", "-np", "1", "--no-" + knob.cli[2:], "true")
        assert rc == 0


def test_hora_run_refuses_a_refused_value_in_its_environment(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_NUM_NCCL_STREAMS", "2")
    rc, err = _run_cli(capsys, "run", "-np", "2", "true")
    assert rc == 2 and "HOROVOD_NUM_NCCL_STREAMS='2': hora does not support NCCL streams" in err
    monkeypatch.delenv("HOROVOD_NUM_NCCL_STREAMS")
    rc, err = _run_cli(capsys, "run", "-np", "1", "-x", "HOROVOD_TORUS_ALLREDUCE=1", "true")
    assert rc == 2 and "HOROVOD_TORUS_ALLREDUCE='1': hora does not support the torus" in err


@pytest.mark.parametrize(("data", "words"), [
    ({"params": {"torus_allreduce": True}}, "cfg.yaml: params.torus_allreduce='1': hora does "
                                            "not support the torus allreduce"),
    ({"library_options": {"num_nccl_streams": 4}}, "num_nccl_streams='4': hora does not "
                                                   "support NCCL streams"),
])
def test_a_config_file_asking_for_a_missing_effect_is_refused(data: Any, words: str) -> None:
    from hora.runner.config_file import config_values

    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")) as err:
        config_values(data, "cfg.yaml")
    assert "remove it from the config file" in str(err.value)
    # their "off" values pass
    assert config_values({"params": {"torus_allreduce": False},
                          "autotune": {"enabled": False, "warmup_samples": 3},
                          "library_options": {"num_nccl_streams": 1,
                                              "mpi_threads_disable": True}}, "cfg.yaml")[0] == {
        "torus_allreduce": False, "autotune": False, "autotune_warmup_samples": 3,
        "num_nccl_streams": 1, "mpi_threads_disable": True}


def test_init_refuses_it_without_hora_run() -> None:
    code = ("import hora\n"
            "try:\n    hora.init()\nexcept hora.errors.ConfigError as exc:\n"
            "    print('REFUSED', exc)\nelse:\n    print('STARTED')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, env={**env, "HOROVOD_NUM_NCCL_STREAMS": "4"})
    assert out.stdout.startswith("REFUSED HOROVOD_NUM_NCCL_STREAMS='4': hora does not support "
                                 "NCCL streams"), out.stdout + out.stderr


def test_help_and_hora_check_say_which_settings_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hora.runner.check import main as check_main
    from hora.runner.run_flags import build_run_parser

    text = " ".join(build_run_parser().format_help().split())
    assert "--torus-allreduce, --no-torus-allreduce Horovod's 2-D torus allreduce of GPU " \
           "tensors over NCCL. Not supported in hora: unset or 0 accepted, other values " \
           "refused" in text
    assert "accepted; no effect" not in text
    assert check_main([]) == 0
    out = capsys.readouterr().out
    section = out[out.index("Horovod settings:"):].split("\n\n")[0]
    for knob in REFUSED:
        assert f"[ ] {knob.alias}" in section, section
    sklearn = importlib.util.find_spec("sklearn") is not None  # autotune needs it
    assert f"[{'X' if sklearn else ' '}] HOROVOD_AUTOTUNE" in section, section
    pin = hasattr(os, "sched_setaffinity")
    assert f"[{'X' if pin else ' '}] HOROVOD_THREAD_AFFINITY" in section


# ---- the others have an effect: each is read by the code that implements it ------------------

# Read by hora.config.load itself (it feeds another knob), or set-and-forget by design.
_READ_BY_LOAD = {"gloo_timeout_seconds"}  # feeds timeout_seconds when HORA_TIMEOUT_SECONDS unset
_NO_EFFECT_NEEDED = {"mpi_threads_disable"}  # hora never initialises MPI: both values hold
_TABLE_MODULES = {"hora/config.py", "hora/runner/run_flags.py", "hora/runner/config_file.py"}


def _names_read_in_hora() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "hora").rglob("*.py"):
        if str(path.relative_to(ROOT)) in _TABLE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_knob_not_refused_is_read_by_the_code() -> None:
    used = _names_read_in_hora()
    unread = [k.name for k in KNOBS
              if not k.unsupported and k.name not in _READ_BY_LOAD | _NO_EFFECT_NEEDED
              and k.name not in used and k.env not in used]
    assert not unread, f"knobs accepted but read nowhere in hora/ (wire or refuse them): {unread}"
    assert load({"HOROVOD_GLOO_TIMEOUT_SECONDS": "7"}).timeout_seconds == 7.0


# ---- HOROVOD_THREAD_AFFINITY ------------------------------------------------------------------

def _hora_run(np_: int, script: str, env: dict[str, str], timeout: float = 90
              ) -> tuple[int, str, str]:
    """``hora run -np N python -c script`` under a hard timeout (tests/runner/helpers)."""
    done = run_hora("run", "-np", str(np_), sys.executable, "-c", textwrap.dedent(script),
                    env=clean_env(**env), timeout=timeout)
    return done.rc, done.out, done.err


def _payloads(out: str, prefix: str) -> list[str]:
    return [line.partition(">:")[2] for line in out.splitlines()
            if line.partition(">:")[2].startswith(prefix)]


_AFFINITY_WORKER = """
    import os, threading
    import numpy as np
    import hora as hvd

    hvd.init()
    for _ in range(5):  # the first one starts the fast lane's thread, from the engine thread
        hvd.allreduce(np.ones(4), name="x")
    found = []
    for t in threading.enumerate():  # (short-lived helper threads may be gone: skipped)
        if t.name not in ("MainThread", "hora-engine") and not t.name.startswith("hora-lane"):
            continue
        with open(f"/proc/{os.getpid()}/task/{t.native_id}/status") as f:
            cpus = next(l.split(":")[1].strip() for l in f if l.startswith("Cpus_allowed_list"))
        found.append(f"THREAD {hvd.local_rank()} {t.name} {cpus}")
    hvd.allreduce(np.ones(1), name="read")  # nobody shuts down before everyone has read
    print("\\n".join(found), flush=True)
    hvd.shutdown()
"""

_needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores this process may run on")


@_needs_two_cores
def test_thread_affinity_pins_each_local_rank_s_engine_threads_in_a_real_job() -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    rc, out, err = _hora_run(2, _AFFINITY_WORKER, {"HOROVOD_THREAD_AFFINITY": f"{b},{a}"})
    assert rc == 0, out + err
    seen = {}
    for payload in _payloads(out, "THREAD "):
        _, local_rank, name, cpus = payload.split()
        seen[int(local_rank), name] = cpus
    everything = _ranges(os.sched_getaffinity(0))
    # local rank 0 -> the first core of the list, local rank 1 -> the second
    assert seen[0, "hora-engine"] == str(b) and seen[1, "hora-engine"] == str(a), seen
    assert seen[0, "hora-lane-0"] == str(b) and seen[1, "hora-lane-0"] == str(a), seen
    assert seen[0, "MainThread"] == seen[1, "MainThread"] == everything, seen  # user's: not


@_needs_two_cores
def test_without_thread_affinity_nor_cpu_binding_nothing_is_pinned() -> None:
    rc, out, err = _hora_run(2, _AFFINITY_WORKER, {"HORA_CPU_BINDING": "none"})
    assert rc == 0, out + err
    everything = _ranges(os.sched_getaffinity(0))
    threads = [p.split() for p in _payloads(out, "THREAD ")]
    assert {t[2] for t in threads} >= {"hora-engine", "hora-lane-0", "MainThread"}
    assert all(t[3] == everything for t in threads), threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds two ranks to two cores")
def test_cpu_binding_puts_every_thread_of_a_rank_on_its_share() -> None:
    from hora.runner.binding import share

    rc, out, err = _hora_run(2, _AFFINITY_WORKER, {})  # --cpu-binding auto, the default
    assert rc == 0, out + err
    cores = sorted(os.sched_getaffinity(0))
    threads = [p.split() for p in _payloads(out, "THREAD ")]
    assert {t[2] for t in threads} >= {"hora-engine", "hora-lane-0", "MainThread"}
    for _, rank, name, mask in threads:
        assert mask == _ranges(set(share(cores, int(rank), 2) or ())), (name, threads)


def test_thread_affinity_with_too_few_cores_fails_the_job_naming_the_knob() -> None:
    rc, _out, err = _hora_run(2, "import hora; hora.init()", {"HOROVOD_THREAD_AFFINITY": "0"})
    assert rc != 0
    assert ("HORA_THREAD_AFFINITY / HOROVOD_THREAD_AFFINITY='0' lists 1 core(s) for the 2 ranks "
            "on this host: give one core per local rank, e.g. '0,1'") in err, err


def test_thread_affinity_values_are_checked() -> None:
    from hora.core.engine.affinity import core_for

    knob = KNOBS_BY_NAME["thread_affinity"]
    assert parse_value(knob, "3, 1", "HOROVOD_THREAD_AFFINITY") == "3, 1"
    with pytest.raises(ConfigError, match="HOROVOD_THREAD_AFFINITY='0;1' is not a valid value "
                                          "for knob 'thread_affinity'.*'0;1' is not a core"):
        load({"HOROVOD_THREAD_AFFINITY": "0;1"})
    with pytest.raises(ConfigError, match="is not a core number"):
        load({"HORA_THREAD_AFFINITY": "0,-1"})
    assert core_for("", 0, 4) is None
    if hasattr(os, "sched_getaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        assert core_for(f"{allowed[-1]},{allowed[0]}", 1, 2) == allowed[0]
        with pytest.raises(ConfigError, match="would be pinned to core 99999, which this process "
                                              "may not run on"):
            core_for("99999", 0, 1)


def _ranges(cores: set[int]) -> str:
    from hora.core.engine.affinity import _ranges as ranges

    return ranges(cores)


# ---- HOROVOD_DISABLE_GROUP_FUSION ---------------------------------------------------------------

_GROUP_WORKER = """
    import numpy as np
    import hora as hvd

    hvd.init()
    handles = [hvd.grouped_allreduce_async([np.ones(4) * k for k in range(3)], name="g")]
    handles += [hvd.allreduce_async(np.ones(4), name=f"p{k}") for k in range(3)]
    for h in handles:
        hvd.synchronize(h)
    hvd.shutdown()
"""


def _fused_names(timeline: Path) -> list[str]:
    events = json.loads(timeline.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return sorted(names[e["pid"]] for e in events if e.get("name") == "MEMCPY_IN_FUSION_BUFFER")


@pytest.mark.parametrize("disable", [False, True])
def test_disable_group_fusion_in_a_real_job(tmp_path: Path, disable: bool) -> None:
    """A grouped allreduce of 3 tensors and 3 plain allreduces, all ready within one 1 s cycle:
    one fused buffer of all 6 by default; with the knob only the group's 3 are fused."""
    timeline = tmp_path / "timeline.json"
    rc, out, err = _hora_run(2, _GROUP_WORKER, {
        "HOROVOD_DISABLE_GROUP_FUSION": "1" if disable else "0",
        "HOROVOD_TIMELINE": str(timeline), "HOROVOD_CYCLE_TIME": "1000"})
    assert rc == 0, out + err
    group = [f"grouped_allreduce.g_{i}of3" for i in (1, 2, 3)]
    plain = [f"allreduce.p{k}" for k in range(3)]
    assert _fused_names(timeline) == (group if disable else sorted(plain + group))


def test_disable_group_fusion_on_the_coordinator() -> None:
    from hora.core.engine.coordinator import Coordinator
    from hora.core.op.messages import OpKind, Request
    from hora.core.op.process_set import Registry

    def fused(**cfg: Any) -> list[list[str]]:
        coord = Coordinator(Registry(2), Config().replace(cycle_time=0.0, **cfg))
        for rank in (0, 1):
            coord.add([Request(name=n, kind=OpKind.ALLREDUCE, rank=rank, dtype="float32",
                               shape=[4], group=g)
                       for n, g in (("a1", "A"), ("p", ""), ("a2", "A"), ("b1", "B"),
                                    ("q", ""), ("b2", "B"))])
        return [r.names for r in coord.ready()]

    assert fused() == [["a1", "p", "a2", "b1", "q", "b2"]]
    assert fused(disable_group_fusion=True) == [["a1", "a2"], ["p"], ["b1", "b2"], ["q"]]


def test_disable_group_fusion_in_the_fast_lane() -> None:
    """Cached allreduces take the fast lane (no coordinator); there too a plain allreduce is
    never fused with anything under the knob, while the group's members still may be."""
    from hora.collectives.ops import ReduceOp
    from hora.core.engine.engine import Engine
    from hora.core.op.entry import Entry
    from hora.core.op.handle import Handle
    from hora.core.op.messages import OpKind, Request
    from hora.core.op.process_set import Registry
    from hora.transports.loopback import make_world

    members = [("g1", "G"), ("g2", "G"), ("g3", "G"), ("p1", ""), ("p2", ""), ("p3", "")]

    def run(disable: bool) -> tuple[list[int], list[int], int]:
        transports = make_world(2, timeout=5.0)
        config = Config().replace(disable_group_fusion=disable)
        engines = [Engine(t, config, Registry(2)) for t in transports]
        for e in engines:
            e.start()
        try:
            def round_(i: int) -> None:
                handles = []
                for rank in (1, 0):
                    for name, group in members:
                        x = np.full(4, float(rank + i), np.float32)
                        req = Request(name=name, kind=OpKind.ALLREDUCE, rank=rank,
                                      dtype="float32", shape=[4], op=int(ReduceOp.Sum),
                                      group=group)
                        h = Handle(name)
                        engines[rank].submit(Entry(request=req, tensor=x,
                                                   output=np.empty_like(x), handle=h))
                        handles.append(h)
                for h in handles:
                    np.testing.assert_array_equal(h.wait(20.0), np.full(4, 2.0 * i + 1))

            round_(0)  # negotiated once: the lane learns every name
            lanes = [lane for lane in (e.lane(0) for e in engines) if lane is not None]
            assert len(lanes) == 2
            before = [lane.describe() for lane in lanes]
            fewest = len(members)
            for i in range(1, 9):
                b = [lane.describe()["batches"] for lane in lanes]
                round_(i)
                fewest = min(fewest, min(lane.describe()["batches"] - x
                                         for lane, x in zip(lanes, b)))
            after = [lane.describe() for lane in lanes]
            fast = [a["fast_ops"] - x["fast_ops"] for a, x in zip(after, before)]
            batches = [a["batches"] - x["batches"] for a, x in zip(after, before)]
            return fast, batches, fewest
        finally:
            for e in engines:
                e.stop(timeout=5.0)

    fast, batches, fewest = run(disable=True)
    assert fast == [8 * len(members)] * 2, fast  # every op took the lane
    # the 3 plain ops each alone, the group in at most 3: never fewer than 4 per round
    assert fewest >= 4 and all(b >= 8 * 4 for b in batches), (batches, fewest)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # without the knob, some round fuses below 4
        fast, batches, fewest = run(disable=False)
        if fewest < 4:
            break
    assert fewest < 4, (batches, fewest)
