"""Algorithm selection policy."""

from __future__ import annotations

import logging

import pytest

from hora.collectives.select import (
    DEFAULT_SMALL_ALLREDUCE_BYTES,
    PIPELINE_CHUNK_BYTES,
    select_allreduce,
    select_broadcast,
)
from hora.errors import ConfigError

MiB = 1024 * 1024


@pytest.mark.parametrize(("nbytes", "size", "requested", "expected"), [
    (4, 4, "auto", "small"),
    (DEFAULT_SMALL_ALLREDUCE_BYTES, 8, "auto", "small"),
    (DEFAULT_SMALL_ALLREDUCE_BYTES + 1, 8, "auto", "ring"),
    (4 * MiB, 2, "auto", "ring"),
    (0, 4, "auto", "ring"),           # nothing to reduce: the ring returns at once
    (4, 1, "auto", "ring"),           # one rank: no-op
    (4, 4, "ring", "ring"),
    (4 * MiB, 4, "star", "star"),
    (4 * MiB, 4, "small", "small"),
])
def test_select_allreduce(nbytes: int, size: int, requested: str, expected: str) -> None:
    assert select_allreduce(nbytes, size, requested, DEFAULT_SMALL_ALLREDUCE_BYTES) == expected


def test_small_bytes_is_a_parameter() -> None:
    assert select_allreduce(1000, 4, "auto", small_bytes=999) == "ring"
    assert select_allreduce(1000, 4, "auto", small_bytes=1000) == "small"


def test_select_allreduce_logs_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="hora.collectives.select"):
        select_allreduce(4194304, 4, "auto", DEFAULT_SMALL_ALLREDUCE_BYTES)
    assert "allreduce: ring for 4194304 bytes on 4 ranks" in caplog.text


def test_select_allreduce_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match="unknown allreduce algorithm 'tree'.*auto, ring, star"):
        select_allreduce(4, 4, "tree", DEFAULT_SMALL_ALLREDUCE_BYTES)


@pytest.mark.parametrize(("nbytes", "size", "expected"), [
    (4, 8, "tree"),
    (PIPELINE_CHUNK_BYTES, 8, "tree"),  # one chunk: a chain is just a slow tree
    (64 * MiB, 2, "tree"),              # two ranks: tree and chain are the same single hop
    (64 * MiB, 3, "chain"),
    (8 * MiB, 8, "chain"),
    (2 * MiB, 8, "tree"),               # 2 chunks through 8 ranks: pipeline never fills
])
def test_select_broadcast(nbytes: int, size: int, expected: str) -> None:
    assert select_broadcast(nbytes, size) == expected
