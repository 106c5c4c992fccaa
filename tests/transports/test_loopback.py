"""The in-process loopback transport: data plane, control plane, failures, run_world."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hora.collectives.comm import Comm
from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.transports.base import MAX_CONTROL_MESSAGE, Transport
from hora.transports.loopback import LoopbackTransport, make_world, run_world


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    """Start ``fn()`` in a daemon thread; the list receives its result or exception."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            box.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, box


def test_world_shape_and_interfaces() -> None:
    world = make_world(3)
    assert [t.rank for t in world] == [0, 1, 2]
    assert all(t.size == 3 and t.name == "loopback" for t in world)
    assert all(isinstance(t, Transport) for t in world)
    comm = world[1].comm()
    assert isinstance(comm, Comm) and comm is world[1].comm()
    assert (comm.rank, comm.size) == (1, 3)
    assert world[0].describe(2) == comm.describe(2) == "rank 2 (host loopback)"
    with pytest.raises(ValueError, match="at least one rank"):
        make_world(0)


def test_byte_streams_are_fifo_and_ignore_message_boundaries() -> None:
    a, b = (t.comm() for t in make_world(2))
    a.send(1, b"hello ")
    a.send(1, bytearray(b"world"))
    a.send(1, np.array([1, 2], dtype=np.uint16))
    first, rest = bytearray(4), bytearray(7)
    b.recv_into(0, first)
    b.recv_into(0, memoryview(rest))
    assert bytes(first + rest) == b"hello world"
    out = np.zeros(2, np.uint16)
    b.recv_into(0, out)
    assert out.tolist() == [1, 2]


def test_any_dtype_and_shape_moves_as_bytes() -> None:
    import ml_dtypes

    a, b = (t.comm() for t in make_world(2))
    src = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    a.send(1, src)
    dst = np.zeros((2, 3), ml_dtypes.bfloat16)
    b.recv_into(0, dst)
    assert (dst == src).all()
    with pytest.raises(ValueError, match="C-contiguous"):
        a.send(1, np.zeros(4)[::2])
    with pytest.raises(ValueError, match="read-only"):
        b.recv_into(0, b"immutable")


def test_send_does_not_block_and_sendrecv_ring_completes() -> None:
    comms = [t.comm() for t in make_world(4)]
    big = np.ones(1 << 20, np.uint8)
    comms[0].send(1, big)  # nobody is receiving yet: buffered
    comms[1].recv_into(0, np.empty_like(big))

    def step(comm: Any) -> int:
        got = np.empty(1, np.int64)
        comm.sendrecv((comm.rank + 1) % 4, np.array([comm.rank], np.int64), (comm.rank - 1) % 4,
                      got)
        return int(got[0])

    assert run_world(4, lambda t: step(t.comm())) == [3, 0, 1, 2]


def test_recv_timeout_names_the_peer() -> None:
    world = make_world(3, timeout=0.1)
    started = time.monotonic()
    with pytest.raises(HoraTimeoutError, match=r"rank 0: timed out .*rank 2 \(host loopback\)"):
        world[0].comm().recv_into(2, bytearray(4))
    assert time.monotonic() - started < 2.0
    world[2].comm().send(0, b"ab")
    with pytest.raises(HoraTimeoutError, match=r"\(2 of 4 bytes received\)"):
        world[0].comm().recv_into(2, bytearray(4))


def test_closed_peer_raises_peer_lost_after_its_data_is_read() -> None:
    world = make_world(3)
    comm = world[0].comm()
    world[2].comm().send(0, b"last words")
    world[2].close()
    world[2].close()  # idempotent
    buf = bytearray(10)
    comm.recv_into(2, buf)
    assert bytes(buf) == b"last words"
    with pytest.raises(PeerLostError, match=r"rank 2 \(host loopback\) closed its connection") as e:
        comm.recv_into(2, bytearray(1))
    assert e.value.peer == 2
    with pytest.raises(PeerLostError, match=r"cannot send to rank 2 \(host loopback\)"):
        comm.send(2, b"x")
    comm.send(1, b"x")  # other peers are unaffected
    with pytest.raises(TransportError, match="rank 2: the loopback transport is closed"):
        world[2].comm().recv_into(0, bytearray(1))


def test_close_wakes_a_blocked_receiver_promptly() -> None:
    world = make_world(2, timeout=30.0)
    thread, box = _in_thread(lambda: world[0].comm().recv_into(1, bytearray(8)))
    time.sleep(0.05)
    started = time.monotonic()
    world[1].close()
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - started < 2.0
    assert isinstance(box[0], PeerLostError) and "rank 1 (host loopback)" in str(box[0])


def test_closing_yourself_wakes_your_own_waiters() -> None:
    world = make_world(2, timeout=30.0)
    recv, recv_box = _in_thread(lambda: world[0].comm().recv_into(1, bytearray(8)))
    ctrl, ctrl_box = _in_thread(lambda: world[0].recv_control(None))
    time.sleep(0.05)
    world[0].close()
    recv.join(5.0)
    ctrl.join(5.0)
    assert isinstance(recv_box[0], TransportError)  # data: "the loopback transport is closed"
    assert ctrl_box == [None]  # control: like a wake, so an engine loop can check its stop flag
    assert world[0].recv_control(None) is None
    assert world[0].closed and not world[1].closed


def test_control_messages_between_rank_0_and_the_others() -> None:
    world = make_world(3)
    world[1].send_control(0, b"request from 1")
    world[2].send_control(0, b"request from 2")
    assert world[0].recv_control(1.0) == (1, b"request from 1")
    assert world[0].recv_control(1.0) == (2, b"request from 2")
    world[0].send_control(2, b"response")
    assert world[2].recv_control(1.0) == (0, b"response")
    assert world[1].recv_control(0.0) is None


def test_control_star_rule_and_size_bound() -> None:
    world = make_world(3)
    with pytest.raises(ValueError, match="rank 1 cannot send one to rank 2"):
        world[1].send_control(2, b"x")
    with pytest.raises(ValueError, match="rank 0 cannot send one to rank 0"):
        world[0].send_control(0, b"x")
    with pytest.raises(ValueError, match="peer 3 is not a rank"):
        world[0].send_control(3, b"x")
    with pytest.raises(ValueError, match="exceeds MAX_CONTROL_MESSAGE"):
        world[1].send_control(0, bytes(MAX_CONTROL_MESSAGE + 1))


def test_recv_control_timeout_returns_none() -> None:
    world = make_world(2)
    started = time.monotonic()
    assert world[0].recv_control(0.05) is None
    assert 0.04 <= time.monotonic() - started < 2.0


def test_wake_interrupts_a_blocked_recv_control() -> None:
    world = make_world(2)
    thread, box = _in_thread(lambda: world[0].recv_control(None))
    time.sleep(0.05)
    assert thread.is_alive()
    world[0].wake()
    thread.join(5.0)
    assert not thread.is_alive() and box == [None]


def test_a_pending_wake_returns_none_after_queued_messages() -> None:
    world = make_world(2)
    world[1].wake()
    world[1].wake()  # repeated wakes collapse into one
    world[0].send_control(1, b"queued")
    assert world[1].recv_control(10.0) == (0, b"queued")
    assert world[1].recv_control(10.0) is None
    assert world[1].recv_control(0.01) is None


def test_recv_control_reports_a_closed_peer_after_its_messages() -> None:
    world = make_world(3)
    world[2].send_control(0, b"goodbye")
    world[2].close()
    world[1].send_control(0, b"still here")
    assert world[0].recv_control(1.0) == (2, b"goodbye")
    with pytest.raises(PeerLostError, match=r"rank 2 \(host loopback\) closed its control") as e:
        world[0].recv_control(1.0)
    assert e.value.peer == 2
    assert world[0].recv_control(1.0) == (1, b"still here")  # raised once per closed peer
    assert world[0].recv_control(0.0) is None
    with pytest.raises(PeerLostError, match="cannot send a control message to rank 2"):
        world[0].send_control(2, b"x")
    assert world[1].recv_control(0.0) is None  # rank 1 only hears about rank 0


def test_rank_0_closing_reaches_every_rank_and_wakes_waiters() -> None:
    world = make_world(3)
    thread, box = _in_thread(lambda: world[2].recv_control(None))
    time.sleep(0.05)
    world[0].close()
    thread.join(5.0)
    assert isinstance(box[0], PeerLostError) and "rank 0 (host loopback)" in str(box[0])
    with pytest.raises(PeerLostError, match=r"rank 0 \(host loopback\)"):
        world[1].recv_control(1.0)


def test_pending_data_counts_unread_bytes() -> None:
    world = make_world(3)
    world[1].comm().send(0, b"abc")
    world[2].comm().send(0, b"de")
    assert world[0].pending_data() == {1: 3, 2: 2}
    world[0].comm().recv_into(1, bytearray(3))
    assert world[0].pending_data() == {2: 2}


def test_run_world_returns_results_in_rank_order() -> None:
    assert run_world(5, lambda t: t.rank * 10) == [0, 10, 20, 30, 40]


def test_run_world_reraises_the_first_error_and_peers_fail_fast() -> None:
    def body(t: LoopbackTransport) -> None:
        if t.rank == 1:
            raise KeyError("boom on rank 1")
        t.comm().recv_into(1, bytearray(4))  # would wait 30 s, but rank 1's close ends it

    started = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank 1"):
        run_world(3, body, timeout=30.0)
    assert time.monotonic() - started < 5.0


def test_run_world_join_timeout_reports_stuck_ranks() -> None:
    def body(t: LoopbackTransport) -> None:
        if t.rank == 2:
            t.recv_control(None)  # blocks until run_world gives up and closes the world

    with pytest.raises(HoraTimeoutError, match=r"ranks \[2\] did not finish within 0.2 s"):
        run_world(3, body, join_timeout=0.2)


def test_run_world_detects_unread_bytes() -> None:
    def body(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.comm().send(1, b"never read")

    with pytest.raises(AssertionError, match=r"\{1: \{0: 10\}\}"):
        run_world(2, body)
    run_world(2, body, check_drained=False)
