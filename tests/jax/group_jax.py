"""Case group: the framework-neutral collective suite through the JAX factory (eager), then the
JAX-only cases (pytrees, jit, vmap, gradients, optax, mismatches). 2 ranks.

``hora.jax`` has Horovod's asynchronous forms but not the in-place ones (JAX arrays are
immutable), so the suite sees the adapter without its ``x_async`` names (the suite's
:func:`has_forms` then skips both); the async forms are covered by ``tree-async`` here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import collective_suite
import jax_cases
from jax_factory import JaxFactory


def init(hvd: Any) -> None:
    collective_suite.init(hvd)


def _without_async(hvd: Any) -> Any:
    return SimpleNamespace(**{k: getattr(hvd, k) for k in hvd.__all__
                              if not k.endswith("_async") and k not in ("synchronize", "poll")})


def cases() -> list[tuple[str, Any]]:
    f = JaxFactory()
    suite = [(case_id, lambda hvd, fn=fn: fn(_without_async(hvd), f))
             for case_id, fn in collective_suite.cases(f)]
    # join must stay last: after it, every rank has left the data loop
    return suite[:-1] + jax_cases.cases() + suite[-1:]
