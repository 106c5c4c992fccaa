"""Elastic training, framework-neutral: Horovod's ``hvd.elastic`` names for the numpy API.

``run`` (decorator), :class:`State`, :class:`ObjectState`; the torch adapter adds
``TorchState`` and ``ElasticSampler`` (:mod:`hora.torch.elastic`). See docs/elastic.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hora.elastic.state import ObjectState, State
from hora.elastic.worker import reset, run_fn
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt
from hora.rendezvous.elastic import HostUpdateResult

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Run ``func(state, ...)`` elastically: roll back and rejoin on failures, let newcomers in
    at commits (see :mod:`hora.elastic.worker`)."""
    return run_fn(func, reset)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState",
           "State", "run", "run_fn"]
