"""Each op's handle raises its own copy of the engine's error: the copy keeps the error's type,
attributes and cause (it used to be rebuilt from its text, ``type(e)(str(e))``, which lost
``PeerLostError.peer``); an internal error (a bug in hora's own threads) names the op; the
elastic worker reports the lost peer from the attribute, not only from the text."""

from __future__ import annotations

import pytest

from hora.elastic.worker import lost_peers
from hora.errors import (
    HoraInternalError,
    HostsUpdatedInterrupt,
    PeerLostError,
    RankFailedError,
    copy_error,
    internal_error,
    op_error,
)


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_a_copy_keeps_type_attributes_and_cause() -> None:
    cause = ValueError("socket closed")
    lost = PeerLostError("rank 0: rank 3 (host b) closed its control connection", peer=3)
    lost.__cause__ = cause
    copy = copy_error(_raised(lost))
    assert copy is not lost and type(copy) is PeerLostError
    assert copy.peer == 3 and copy.__cause__ is cause and copy.__traceback__ is None
    with pytest.raises(PeerLostError, match=r"^rank 0: rank 3 \(host b\) closed") as info:
        raise copy
    assert info.value.peer == 3
    merged = copy_error(lost, f"{lost}; other ranks report: rank 1 failed")
    with pytest.raises(PeerLostError, match="other ranks report: rank 1 failed$"):
        raise merged
    assert merged.peer == 3
    assert copy_error(RankFailedError("gone", rank=2, exit_status=137)).exit_status == 137
    assert copy_error(HostsUpdatedInterrupt(skip_sync=True)).skip_sync is True


def test_only_an_internal_error_names_the_op() -> None:
    bug = internal_error("hora's engine thread", KeyError("slot"))
    assert isinstance(bug.__cause__, KeyError)
    with pytest.raises(HoraInternalError, match=r"^op 'allreduce.grad' failed: hora's engine "
                       r"thread failed: KeyError\('slot'\)\. This is a bug in hora"):
        raise op_error(bug, "allreduce.grad")
    named = op_error(bug, "a")
    assert str(op_error(named, "a")) == str(named)  # named once
    lost = PeerLostError("rank 1 (host a) is gone", peer=1)
    with pytest.raises(PeerLostError, match=r"^rank 1 \(host a\) is gone$"):
        raise op_error(lost, "allreduce.grad")


def test_the_elastic_report_takes_the_lost_peer_from_the_error() -> None:
    # the attribute, even where the text names no "rank N (host H)"
    assert lost_peers(PeerLostError("the shared-memory peer closed its group", peer=2), 0) == (2,)
    both = PeerLostError("rank 0: rank 3 (host b) closed; other ranks report: rank 1 (host a) x",
                         peer=3)
    assert lost_peers(both, 0) == (3, 1)
    assert lost_peers(PeerLostError("rank 2 (host c) closed", peer=0), 0) == (2,)  # not itself
    assert lost_peers(HoraInternalError("rank 1 (host a) sent nothing"), 0) == (1,)
