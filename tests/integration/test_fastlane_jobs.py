"""The fast lane in real multi-process jobs (`hora run`, real /dev/shm, real process deaths).

Each test writes a small worker script to a temporary directory and runs it with
``hora run -np 2``, killed (whole process group) after a hard timeout.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from _case_jobs import run_group

from .conftest import Job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SHM_DIR = "/dev/shm"

_PRELUDE = """\
import os
import signal
import sys
import time

import numpy as np

import hora
from hora.core.engine import context
from hora.transports.shm import job_id_from_env, job_segments

hora.init()
r, n = hora.rank(), hora.size()
"""


def _run_script(tmp_path: Path, body: str, np_: int = 2, timeout: float = 90,
                env: dict[str, str] | None = None) -> Job:
    """`hora run -np N python SCRIPT` (SCRIPT = prelude + body), killed after ``timeout``."""
    script = tmp_path / "fastlane_worker.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), sys.executable,
           str(script)]
    ran = run_group(cmd, timeout=timeout, env={**os.environ, **(env or {})},
                    cwd=Path(__file__).resolve().parents[2])
    if ran.timed_out:
        pytest.fail(f"job did not finish in {timeout} s\nstdout:\n{ran.stdout}\n"
                    f"stderr:\n{ran.stderr}")
    return Job(ran.returncode, ran.stdout, ran.stderr)


def _shm_names() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("hora-")}
    except OSError:
        return set()


def _seconds(line: str) -> float:
    m = re.search(r"after ([\d.]+)s", line)
    assert m is not None, line
    return float(m.group(1))


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
def test_steady_loop_takes_the_lane_and_leaves_no_segments(tmp_path: Path) -> None:
    before = _shm_names()
    job = _run_script(tmp_path, """
        job = job_id_from_env()
        shapes = {"b": (8,), "w": (3, 4), "s": (1,)}
        for i in range(300):
            name = "bws"[i % 3]
            base = np.arange(np.prod(shapes[name]), dtype=np.float64).reshape(shapes[name])
            x = base * (r + 1) + i * (r + 2)
            want = base * sum(range(1, n + 1)) + i * sum(q + 2 for q in range(n))
            hora.allreduce_(x, op=hora.Sum, name=name)
            assert np.array_equal(x, want), (i, name, x, want)
        lane = context.get().engine.lane(0)
        d = lane.describe()
        # the lane's segments are named with this job's prefix (checked below) and unlinked
        # already: their names go as soon as the group exists
        named = [p for p in lane._fabric.paths if os.path.basename(p).startswith(f"hora-{job}-")]
        live = len(named) if not job_segments(job) else -1
        print(f"LANE rank {r} fast_ops {d['fast_ops']} slots {d['slots']} off {d['off']} "
              f"job {job} segments {live}", flush=True)
        hora.shutdown()
        print(f"OK rank {r}", flush=True)
    """)
    assert job.returncode == 0, job.stdout + job.stderr
    lanes = job.lines("LANE")
    assert len(lanes) == 2, job.stdout + job.stderr
    jobs = set()
    for line in lanes:
        m = re.search(r"fast_ops (\d+) slots (\d+) off (\w+) job (\S+) segments (\d+)", line)
        assert m is not None, line
        assert int(m.group(1)) >= 250, line
        assert int(m.group(2)) == 3 and m.group(3) == "False", line
        assert int(m.group(5)) == 3, line  # the prefix below names this job's segments
        jobs.add(m.group(4))
    assert len(jobs) == 1 and len(job.lines("OK rank")) == 2
    job_id = jobs.pop()
    leftovers = sorted(n for n in _shm_names() if n.startswith(f"hora-{job_id}-"))
    assert leftovers == [], leftovers
    # (other jobs' segments may come and go meanwhile: only this job's are checked, and none
    # of them existed before it started)
    assert not [n for n in before if n.startswith(f"hora-{job_id}-")]


def test_sigkilled_rank_fails_the_survivor_fast(tmp_path: Path) -> None:
    job = _run_script(tmp_path, """
        # The launcher SIGTERMs the other ranks as soon as one is killed by a signal; the
        # survivor ignores it (it is SIGKILLed after the grace period) so that it can report.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        i, t0 = -1, time.monotonic()
        try:
            for i in range(100000):
                if r == 1 and i == 50:
                    os.kill(os.getpid(), signal.SIGKILL)
                x = np.full(64, float(r + i))
                t0 = time.monotonic()
                hora.allreduce_(x, op=hora.Sum, name="k")
                assert x[0] == 2 * i + 1, (i, x[0])
                if i == 40 and r == 0:
                    d = context.get().engine.lane(0).describe()
                    print(f"LANE fast_ops {d['fast_ops']}", flush=True)
            print("NOERR", flush=True)
        except hora.HoraError as exc:
            print(f"ERR rank {r} at {i} after {time.monotonic() - t0:.1f}s: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            sys.exit(3)
        except BaseException as exc:
            print(f"RAW rank {r} at {i}: {type(exc).__name__}: {exc}", flush=True)
            sys.exit(4)
    """, timeout=90)
    out = job.stdout + job.stderr
    assert job.returncode != 0, out
    raw = job.lines("RAW")  # e.g. a released memoryview (see test_engine_stop_while_a_thread_...)
    assert not raw and not job.lines("NOERR"), out
    errors = job.lines("ERR")
    assert len(errors) == 1, out
    line = errors[0]
    assert line.startswith("ERR rank 0 at 50 "), line
    assert _seconds(line) < 15, line
    assert "rank 1" in line, line
    assert re.search(r"lost|died|dead|exited|closed|killed|vanished", line), line
    lane = job.lines("LANE")
    assert len(lane) == 1 and int(lane[0].split()[-1]) >= 30, out  # it was in the lane


def test_rank_that_shuts_down_early_fails_the_others_extra_op(tmp_path: Path) -> None:
    job = _run_script(tmp_path, """
        count = 30 if r == 0 else 29  # rank 1's loop ends one op early
        for i in range(count):
            x = np.full(16, float(r + i))
            t0 = time.monotonic()
            try:
                hora.allreduce_(x, op=hora.Sum, name="c")
            except hora.HoraError as exc:
                print(f"ERR rank {r} at {i} after {time.monotonic() - t0:.1f}s: "
                      f"{type(exc).__name__}: {exc}", flush=True)
                break
            except BaseException as exc:
                print(f"RAW rank {r} at {i}: {type(exc).__name__}: {exc}", flush=True)
                break
            assert x[0] == 2 * i + 1, (i, x[0])
            if i == 20:
                d = context.get().engine.lane(0).describe()
                print(f"LANE rank {r} fast_ops {d['fast_ops']}", flush=True)
        hora.shutdown()
        print(f"DONE rank {r}", flush=True)
    """, timeout=90)
    out = job.stdout + job.stderr
    assert not job.lines("RAW"), out
    errors = job.lines("ERR")
    assert len(errors) == 1, out
    line = errors[0]
    assert line.startswith("ERR rank 0 at 29 "), line
    assert _seconds(line) < 15, line
    assert "shut down" in line, line
    assert len(job.lines("DONE")) == 2, out
    lanes = job.lines("LANE")
    assert len(lanes) == 2 and all(int(ln.split()[-1]) >= 15 for ln in lanes), out
    assert job.returncode == 0, out


def test_async_ops_around_the_lane_opening_do_not_stall_later_steps(tmp_path: Path) -> None:
    job = _run_script(tmp_path, """
        a, b = np.ones(4), np.ones(4)
        if r == 0:
            time.sleep(0.3)  # rank 0 is a little late for the first step
            hora.allreduce(a, op=hora.Sum, name="A")  # A runs: rank 0's lane opens
            hora.allreduce(b, op=hora.Sum, name="B")  # so B is logged in it (a miss)
        else:
            ha = hora.allreduce_async(a, op=hora.Sum, name="A")  # both submitted before any
            hb = hora.allreduce_async(b, op=hora.Sum, name="B")  # allreduce ran: no lane yet
            hora.synchronize(ha)
            hora.synchronize(hb)
        t0 = time.monotonic()
        for i in range(5):  # A is cached on both ranks
            x = np.full(4, float(i + r))
            hora.allreduce_(x, op=hora.Sum, name="A")
            assert x[0] == 2 * i + 1, (i, x)
        print(f"LOOP rank {r} after {time.monotonic() - t0:.1f}s", flush=True)
        hora.shutdown()
    """, timeout=90, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "6"})
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    loops = job.lines("LOOP")
    assert len(loops) == 2, out
    for line in loops:
        assert _seconds(line) < 3, line  # 5 cached allreduces: milliseconds, not the stall time


# ---- grouped calls and sparse allreduce (one unit each in the lane) -------------------------
def test_grouped_and_sparse_ops_run_in_the_lane_one_unit_each(tmp_path: Path) -> None:
    """torch: grouped_allreduce of 10 tensors is one fused lane op per call; a sparse allreduce
    (two allgathers) and DistributedOptimizer's groups and sparse gradients take the lane too;
    every result is exact."""
    job = _run_script(tmp_path, """
        import torch
        import hora.torch as hvd

        torch.set_num_threads(1)
        lane = None
        xs = [torch.arange(k + 3, dtype=torch.float64) for k in range(10)]
        for i in range(40):
            if i == 5:
                lane = context.get().engine.lane(0)
                d0 = lane.describe()
            out = hvd.grouped_allreduce([x * (r + 1) + i for x in xs], name="g", op=hvd.Sum)
            for x, o in zip(xs, out):
                assert torch.equal(o, x * 3 + 2 * i), (i, o)
        d1 = lane.describe()
        print(f"GROUP rank {r} batches {d1['batches'] - d0['batches']} "
              f"fast {d1['fast_ops'] - d0['fast_ops']}", flush=True)
        for i in range(30):
            rows = torch.tensor([[r, (i + r) % 5]])
            sp = torch.sparse_coo_tensor(rows.t(), torch.tensor([float(r + i)]), (2, 5))
            got = hvd.sparse_allreduce_async(sp, name="emb", op=hvd.Sum)().to_dense()
            want = torch.zeros(2, 5)
            for q in range(n):
                want[q, (i + q) % 5] += q + i
            assert torch.equal(got, want), (i, got, want)
        d2 = lane.describe()
        print(f"SPARSE rank {r} fast {d2['fast_ops'] - d1['fast_ops']}", flush=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True),
                                    torch.nn.Flatten(), torch.nn.Linear(8, 2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), groups=1)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(12):
            opt.zero_grad()
            model(torch.tensor([[r + step % 3, 7]])).sum().backward()
            opt.step()
        d3 = lane.describe()
        w = model[2].weight.detach().reshape(1, -1)
        same = torch.equal(hvd.allgather(w)[0], hvd.allgather(w)[-1])
        print(f"OPT rank {r} fast {d3['fast_ops'] - d2['fast_ops']} same {same} "
              f"off {d3['off']}", flush=True)
        hora.shutdown()
    """)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    for line in job.lines("GROUP"):  # 35 cached calls: one collective each, 10 ops each
        assert line.endswith("batches 35 fast 350"), line
    sparse = job.lines("SPARSE")
    assert len(sparse) == 2 and all(int(s.split()[-1]) >= 50 for s in sparse), out
    opt = job.lines("OPT")
    assert len(opt) == 2, out
    for line in opt:  # 12 steps x (1 sparse gradient: 2 allgathers, 1 group of 2 dense ones)
        assert int(line.split()[4]) >= 30 and "same True off False" in line, line


def test_rank_that_never_submits_a_group_member_fails_every_rank(tmp_path: Path) -> None:
    job = _run_script(tmp_path, """
        xs = [np.ones(4) for _ in range(3)]
        for i in range(5):  # cached, in the lane
            hora.grouped_allreduce(xs, name="grads", op=hora.Sum)
        t0 = time.monotonic()
        try:
            hora.grouped_allreduce(xs if r == 0 else xs[:2], name="grads", op=hora.Sum)
            print(f"NOERR rank {r}", flush=True)
        except hora.HoraError as exc:
            print(f"ERR rank {r} after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: "
                  f"{exc}", flush=True)
        hora.shutdown()
    """, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "60"})
    out = job.stdout + job.stderr
    errors = job.lines("ERR")
    assert len(errors) == 2 and not job.lines("NOERR"), out
    for line in errors:
        assert "DeadlockError" in line and _seconds(line) < 10, line
        assert "grouped_allreduce.grads_1of3" in line and "grouped_allreduce.grads_1of2" in line


def test_sparse_allreduce_waiting_for_a_rank_in_another_op_is_a_deadlock(tmp_path: Path) -> None:
    """The sparse allreduce's handle reports its wait (its two allgathers), so a rank blocked
    in it is seen by the deadlock detector."""
    job = _run_script(tmp_path, """
        import torch
        import hora.torch as hvd

        sp = torch.sparse_coo_tensor(torch.tensor([[r], [1]]), torch.tensor([1.0]), (2, 3))
        for i in range(3):
            hvd.sparse_allreduce_async(sp, name="emb", op=hvd.Sum)()
        t0 = time.monotonic()
        try:
            if r == 0:
                hvd.sparse_allreduce_async(sp, name="emb", op=hvd.Sum)()
            else:
                hvd.barrier()
            print(f"NOERR rank {r}", flush=True)
        except hora.HoraError as exc:
            print(f"ERR rank {r} after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: "
                  f"{exc}", flush=True)
        hora.shutdown()
    """)
    out = job.stdout + job.stderr
    errors = job.lines("ERR")
    assert len(errors) == 2 and not job.lines("NOERR"), out
    for line in errors:
        assert "DeadlockError" in line and _seconds(line) < 10, line
        assert "allgather.emb.values" in line and "barrier" in line, line


def test_rank_killed_mid_group_fails_the_survivor_fast(tmp_path: Path) -> None:
    job = _run_script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (see test_sigkilled_rank_fails_...)
        xs = [np.full(256, float(r)) for _ in range(10)]
        t0 = time.monotonic()
        try:
            for i in range(100000):
                t0 = time.monotonic()
                h = hora.grouped_allreduce_async(xs, name="g", op=hora.Sum)
                if r == 1 and i == 40:  # its unit is logged: rank 0 starts the collective
                    os.kill(os.getpid(), signal.SIGKILL)
                out = hora.synchronize(h)
                assert out[9][0] == 1.0, out[9][0]
            print("NOERR", flush=True)
        except hora.HoraError as exc:
            print(f"ERR rank {r} at {i} after {time.monotonic() - t0:.1f}s: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            sys.exit(3)
    """, timeout=90)
    out = job.stdout + job.stderr
    assert job.returncode != 0 and not job.lines("NOERR"), out
    errors = job.lines("ERR")
    # (op 40 itself may complete: rank 1's lane thread can run it before the kill lands)
    assert len(errors) == 1 and errors[0].startswith(("ERR rank 0 at 40 ",
                                                      "ERR rank 0 at 41 ")), out
    assert _seconds(errors[0]) < 15 and "rank 1" in errors[0], errors[0]


def test_group_larger_than_the_log_keeps_the_lane(tmp_path: Path) -> None:
    """A grouped call of more members than a lane log holds is logged in several units (one
    unit of it would close the log, and the lane with it, for good)."""
    from hora.core.lane.fastlane import LOG_CAPACITY

    job = _run_script(tmp_path, f"""
        xs = [np.full(1, float(k)) for k in range({LOG_CAPACITY + 200})]
        for i in range(4):
            out = hora.grouped_allreduce(xs, name="huge", op=hora.Sum)
            assert all(o[0] == 2 * x[0] for o, x in zip(out, xs)), i
        d = context.get().engine.lane(0).describe()
        print(f"LANE rank {{r}} fast {{d['fast_ops']}} off {{d['off']}}", flush=True)
        hora.shutdown()
    """, env={"HOROVOD_CACHE_CAPACITY": str(2 * LOG_CAPACITY)})
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    lanes = job.lines("LANE")
    assert len(lanes) == 2, out
    for line in lanes:  # the first call was negotiated; the next three ran in the lane
        assert line.endswith(f"fast {3 * (LOG_CAPACITY + 200)} off False"), line


def test_rank_0_shutting_down_after_its_last_op_does_not_fail_it_elsewhere(
        tmp_path: Path) -> None:
    # Rank 0 completes its last lane op and shuts down at once; rank 1 (slowed by a thread that
    # holds the GIL) may still be finishing that op when the shutdown notice arrives: the op
    # must complete there too (rank 0 completed it), and only an op rank 0 never submitted
    # fails. A race: several short jobs (before the fix about 1 in 3 failed).
    body = """
        import threading
        if r == 1:
            def hog():
                while True:
                    pass
            threading.Thread(target=hog, daemon=True).start()
        for i in range(4):
            x = hora.allreduce(np.full(1 << 18, float(r + i), np.float32), name="g",
                               op=hora.Average)
            assert x[0] == i + 0.5, (i, x[0])
        print(f"DONE rank {r} fast_ops {context.get().engine.lane(0).fast_ops}", flush=True)
        if r == 1:
            t0 = time.monotonic()
            try:
                hora.allreduce(np.ones(4, np.float32), name="extra")
            except hora.HoraError as exc:
                print(f"EXTRA after {time.monotonic() - t0:.1f}s: {type(exc).__name__}",
                      flush=True)
        hora.shutdown()
    """
    for _ in range(4):
        job = _run_script(tmp_path, body, timeout=60)
        out = job.stdout + job.stderr
        assert job.returncode == 0, out
        done = job.lines("DONE")
        assert len(done) == 2 and all(int(ln.split()[-1]) >= 2 for ln in done), out
        extra = job.lines("EXTRA")
        assert len(extra) == 1 and extra[0].endswith("ShutdownError"), out
        assert _seconds(extra[0]) < 10, out
