"""One local op on its way through the engine: the request, its buffers and its handle.

Created by :mod:`hora.core.api` (the user's call), carried by the engine, the coordinator's
responses and the fast lane, completed by :mod:`hora.core.executor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from hora.core.handle import Handle
from hora.core.messages import Request

if TYPE_CHECKING:
    from hora.core.device import DeviceBuffer

Buffer = Union[np.ndarray, "DeviceBuffer"]
"""An op's input or output: host memory, or a device buffer (:mod:`hora.core.device`)."""


@dataclass
class Entry:
    """One local op waiting for its response.

    ``tensor`` is the contiguous input: a host array, or a device buffer when the job's data
    plane takes the adapter's tensors as they are (:mod:`hora.core.device`; only the
    executor's device forms, :mod:`hora.core.device_exec`, see those). ``output`` is where the
    result goes (may be ``tensor`` itself for in-place ops; None when the size is only known
    after negotiation). ``finish`` post-processes the result (e.g. copy back into a
    non-contiguous original) before the handle completes.
    """

    request: Request
    tensor: Buffer
    output: Buffer | None
    handle: Handle
    finish: Callable[[Any], Any] | None = None
    sync: bool = False  # the submitter waits for it at once (the fast lane lets it run the op)
