"""One local op on its way through the engine: the request, its buffers and its handle.

Created by :mod:`hora.core.api` (the user's call), carried by the engine, the coordinator's
responses and the fast lane, completed by :mod:`hora.core.executor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.core.handle import Handle
from hora.core.messages import Request


@dataclass
class Entry:
    """One local op waiting for its response.

    ``tensor`` is the contiguous input. ``output`` is where the result goes (may be ``tensor``
    itself for in-place ops; None when the size is only known after negotiation). ``finish``
    post-processes the result (e.g. copy back into a non-contiguous original) before the handle
    completes.
    """

    request: Request
    tensor: np.ndarray
    output: np.ndarray | None
    handle: Handle
    finish: Callable[[Any], Any] | None = None
    sync: bool = False  # the submitter waits for it at once (the fast lane lets it run the op)
