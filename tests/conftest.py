"""Suite-wide guard: no test may leave shared memory behind.

After every test, hora segments in /dev/shm whose owner process has exited (what a SIGKILLed
rank leaves when nobody sweeps after it: see hora/_util/shm_owners.py) fail that test, and are
removed so that the next test starts clean. Segments of live processes (a job still running,
this process's own groups) are not judged."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hora._util import shm_owners


@pytest.fixture(autouse=True)
def _no_leaked_shared_memory() -> Iterator[None]:
    yield
    leaked = shm_owners.stale_segments()
    if leaked:
        shm_owners.remove(leaked)
        pytest.fail("left shared memory segments of exited processes in /dev/shm: "
                    + ", ".join(os.path.basename(p) for p in leaked), pytrace=False)
