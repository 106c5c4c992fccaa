"""The runtime subclass of a user's optimizer (as Horovod builds ``DistributedOptimizer``):
starting it like the original. Shared by :mod:`hora.torch.optimizer` and
:mod:`hora.torch.adasum_optimizer`."""

from __future__ import annotations

from typing import Any


def init_wrapped(opt: Any, params: Any, base_kwargs: dict[str, Any],
                 state: dict[Any, Any]) -> None:
    """Run the wrapped optimizer class's ``__init__`` on ``opt`` (the runtime subclass) with
    the original's options, and take over the original's state."""
    try:
        opt._hora_base.__init__(opt, params, **base_kwargs)
    except TypeError:  # a custom __init__ that does not take its defaults back as kwargs
        opt._hora_base.__init__(opt, params)
    for p, s in state.items():
        opt.state[p] = s


__all__ = ["init_wrapped"]
