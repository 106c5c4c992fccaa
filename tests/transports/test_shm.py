"""hora.transports.shm: segment files, names and cleanup, futex signals, ShmFabric set-up."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.runner.local import remove_shm_segments
from hora.transports.loopback import run_world
from hora.transports.shm import (
    MIN_CAPACITY,
    Segment,
    available_bytes,
    capacity_for,
    futex_wait,
    futex_wake,
    job_id_for,
    job_id_from_env,
    job_segments,
    process_start_time,
    remove_job_segments,
    segment_path,
)
from hora.transports.shm_fabric import _W_ASLEEP, ShmFabric

_ids = itertools.count()


@pytest.fixture
def job_id() -> Iterator[str]:
    jid = f"tt{os.getpid()}n{next(_ids)}"
    yield jid
    left = remove_job_segments(jid)
    assert not left, f"segments left behind: {left}"


# ---- names -------------------------------------------------------------------------------------

def test_job_id_uses_hora_job_id_or_hashes_the_secret() -> None:
    assert job_id_for("0123abcd", None) == "0123abcd"
    hashed = job_id_for(None, b"secret")
    assert hashed == job_id_for(None, b"secret") != job_id_for(None, b"other")
    assert len(hashed) == 16 and hashed.isalnum()
    dashed = job_id_for("a-b", None)  # '-' would make one job's prefix match another's
    assert "-" not in dashed and dashed == job_id_for("a-b", None)
    assert "/" not in job_id_for("../x*", None)
    env = {"HORA_JOB_ID": "abc", "HORA_SECRET_KEY": "00ff"}
    assert job_id_from_env(env) == "abc"
    assert job_id_from_env({"HORA_SECRET_KEY": "00ff"}) == job_id_for(None, b"\x00\xff")


def test_segment_names_match_what_the_launcher_removes(job_id: str) -> None:
    other = job_id + "x"  # a longer id with ours as a prefix must survive
    mine = Segment.create(segment_path(job_id, "g", 0, "h"), 4096)
    theirs = Segment.create(segment_path(other, "g", 0, "h"), 4096)
    try:
        assert os.path.basename(mine.path).startswith(f"hora-{job_id}-")
        assert job_segments(job_id) == [mine.path]
        assert remove_shm_segments(job_id) == [os.path.basename(mine.path)]
        assert not os.path.exists(mine.path) and os.path.exists(theirs.path)
        assert remove_shm_segments("bad id*") == [] and remove_shm_segments(None) == []
    finally:
        mine.close()  # already unlinked: close still succeeds
        theirs.close()
    assert not job_segments(other)


# ---- segments ----------------------------------------------------------------------------------

def test_segment_create_grow_open_and_unlink(job_id: str) -> None:
    path = segment_path(job_id, "g", 0, "d0")
    seg = Segment.create(path, 4096)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        with pytest.raises(TransportError, match="cannot create"):
            Segment.create(path, 4096)  # exclusive
        seg.array[:4] = [1, 2, 3, 4]
        peer = Segment.open(path)
        assert peer.size == 4096 and peer.array[:4].tolist() == [1, 2, 3, 4]
        seg.grow(1 << 20)
        assert seg.size == 1 << 20 and seg.array[:4].tolist() == [1, 2, 3, 4]
        seg.array[-1] = 9
        peer.remap(1 << 20)
        assert peer.array[-1] == 9
        seg.close()
        seg.close()  # idempotent
        assert not os.path.exists(path)
        peer.array[0] = 7  # the peer's mapping outlives the owner's unlink
        assert peer.array[0] == 7
        peer.close()
    finally:
        seg.close()


def test_full_dev_shm_is_a_clear_error(job_id: str, monkeypatch: Any) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = segment_path(job_id, "g", 0, "d0")
    with pytest.raises(TransportError, match="shm-size"):
        Segment.create(path, 1 << 20)
    assert not os.path.exists(path)


def test_available_bytes(tmp_path: Any) -> None:
    assert available_bytes() > 0
    assert available_bytes(str(tmp_path / "missing")) == 0


def test_capacity_is_the_next_power_of_two() -> None:
    assert capacity_for(0) == capacity_for(MIN_CAPACITY) == MIN_CAPACITY
    assert capacity_for(MIN_CAPACITY + 1) == 2 * MIN_CAPACITY
    assert capacity_for(3 << 20) == 4 << 20


# ---- futex -------------------------------------------------------------------------------------

def test_futex_wait_returns_on_wake_and_on_timeout(job_id: str) -> None:
    seg = Segment.create(segment_path(job_id, "g", 0, "h"), 4096)
    try:
        word = seg.array[:4].view(np.uint32)
        start = time.monotonic()
        futex_wait(seg.address, 0, 0.05)
        assert 0.03 < time.monotonic() - start < 1.0
        futex_wait(seg.address, 1, 5.0)  # value differs: returns at once
        assert time.monotonic() - start < 1.0

        def waker() -> None:
            time.sleep(0.05)
            word[0] = 1
            futex_wake(seg.address)

        thread = threading.Thread(target=waker)
        thread.start()
        futex_wait(seg.address, 0, 5.0)
        thread.join()
        assert word[0] == 1 and time.monotonic() - start < 2.0
    finally:
        seg.close()


# ---- fabric ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_fabric_creates_maps_and_removes_segments(job_id: str, n: int) -> None:
    def body(transport: Any) -> list[str]:
        fabric = ShmFabric.create(transport.comm(), job_id, timeout=5.0)
        paths = fabric.paths
        # Once the group exists its names are gone (peers hold descriptors): a SIGKILLed rank
        # leaves nothing. Data still flows, through segments grown past their first size.
        assert len(paths) == 3 and not any(os.path.exists(p) for p in paths)
        fabric.reserve(0, 100_000)[:4] = transport.rank + 1
        fabric.wait_all(fabric.post())
        for peer in range(n):
            if peer != transport.rank:
                assert fabric.peer(peer, 0, 100_000)[3] == peer + 1
        fabric.wait_all(fabric.post())
        fabric.close()
        fabric.close()
        return paths

    paths = [p for ps in run_world(n, body) for p in ps]
    assert len(set(paths)) == 3 * n
    assert not any(os.path.exists(p) for p in paths)


def test_ranks_that_do_not_share_segments_all_fail(job_id: str) -> None:
    """As if rank 1 were on another host: nobody can map its segments, and every rank raises."""

    def body(transport: Any) -> str:
        jid = job_id if transport.rank != 1 else job_id + "other"
        with pytest.raises(TransportError, match="shared memory") as info:
            ShmFabric.create(transport.comm(), jid, timeout=5.0)
        return str(info.value)

    messages = run_world(3, body)
    assert "same host" in messages[0] or "one host" in messages[0]
    assert not job_segments(job_id + "other")


def test_wait_times_out_naming_the_peer(job_id: str) -> None:
    def body(transport: Any) -> float:
        fabric = ShmFabric.create(transport.comm(), job_id, timeout=0.2)
        try:
            if transport.rank == 0:
                start = time.monotonic()
                with pytest.raises(HoraTimeoutError, match=r"rank 1 \(host loopback\)"):
                    fabric.wait(1, 1)
                return time.monotonic() - start
            time.sleep(0.5)
            return 0.0
        finally:
            fabric.close()

    assert 0.15 < run_world(2, body)[0] < 0.6


def test_a_sleeping_wait_is_woken_by_the_post(job_id: str, monkeypatch: Any) -> None:
    """A waiter that goes to sleep flags it in the poster's header, and the post wakes it: with
    the wait's slices an hour long, a lost wake-up would hang this test (until its timeout)."""
    monkeypatch.setattr("hora.transports.shm_fabric.WAIT_SLICE_S", 3600.0)

    def body(transport: Any) -> tuple[int, list[int]]:
        fabric = ShmFabric.create(transport.comm(), job_id, timeout=3600.0)
        fabric._spin = 0  # every wait that is not already satisfied sleeps at once
        try:
            for i in range(1, 101):
                if transport.rank == i % 2:
                    time.sleep(0.002)  # the other rank gets there first, and sleeps
                fabric.wait_all(fabric.post())
            # this rank's sleep flag in the peer's header
            return fabric.posted, [fabric._peer_headers[1 - transport.rank][
                _W_ASLEEP + transport.rank]]
        finally:
            fabric.close()

    assert run_world(2, body) == [(100, [0]), (100, [0])]  # and every sleep flag is down


def test_a_post_nobody_sleeps_on_makes_no_system_call(job_id: str, monkeypatch: Any) -> None:
    wakes: list[int] = []
    monkeypatch.setattr("hora.transports.shm_fabric.futex_wake", wakes.append)
    posted = threading.Event()

    def body(transport: Any) -> int:
        fabric = ShmFabric.create(transport.comm(), job_id, timeout=10.0)
        try:
            if transport.rank == 0:
                for _ in range(10):
                    fabric.post()
                made = len(wakes)
                posted.set()
                return made
            posted.wait(10.0)
            fabric.wait(0, 10)  # reached already: no sleep, no flag
            return 0
        finally:
            fabric.close()

    assert run_world(2, body) == [0, 0]


def test_a_dead_peer_process_is_detected(job_id: str) -> None:
    """The header names the peer's pid and start time; a waiter notices the process died."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def body(transport: Any) -> float:
            fabric = ShmFabric.create(transport.comm(), job_id, timeout=10.0)
            try:
                fabric.wait_all(fabric.post())
                if transport.rank == 1:  # pretend rank 1 is the sleeper process
                    header = fabric._own[0].array.view(np.uint32)  # noqa: SLF001
                    start = process_start_time(sleeper.pid) or 0
                    header[3], header[4], header[5] = sleeper.pid, start & 0xFFFFFFFF, start >> 32
                fabric.wait_all(fabric.post())
                if transport.rank == 1:
                    time.sleep(1.0)  # not posting
                    return 0.0
                fabric._peer_start[1] = fabric._verifiable_start(  # noqa: SLF001
                    fabric._peer_headers[1])  # noqa: SLF001
                assert fabric._peer_start[1] is not None  # noqa: SLF001
                threading.Timer(0.1, sleeper.kill).start()
                began = time.monotonic()
                with pytest.raises(PeerLostError, match=r"rank 1 \(host loopback\) died"):
                    fabric.wait(1, fabric.posted + 1)
                return time.monotonic() - began
            finally:
                fabric.close()

        elapsed = run_world(2, body, join_timeout=30.0)[0]
        assert elapsed < 1.0, elapsed
    finally:
        sleeper.kill()
        sleeper.wait()


def test_segments_a_process_forgot_to_close_are_unlinked_at_exit(job_id: str) -> None:
    path = segment_path(job_id, "g", 0, "h")
    code = ("import sys; from hora.transports.shm import Segment; "
            f"seg = Segment.create({path!r}, 4096); "
            "import os; pid = os.fork()\n"
            "if pid == 0: sys.exit(0)  # a forked child exiting normally must not unlink\n"
            f"os.waitpid(pid, 0); assert os.path.exists({path!r}); print('OK')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "OK", done.stderr
    assert not os.path.exists(path)
