"""Case group: the framework-neutral collective suite through the torch factory, then the
torch-only gradient checks. Job size: 3 ranks (odd, so uneven splits are exercised)."""

from __future__ import annotations

from typing import Any

import collective_suite
from autograd_cases import CASES as AUTOGRAD
from torch_factory import TorchFactory

NP = 3


def init(hvd: Any) -> None:
    collective_suite.init(hvd)


def cases() -> list[tuple[str, Any]]:
    suite = collective_suite.cases(TorchFactory())
    # join must stay last: after it, every rank has left the data loop
    return suite[:-1] + [(f"grad-{name}", fn) for name, fn in AUTOGRAD] + suite[-1:]
