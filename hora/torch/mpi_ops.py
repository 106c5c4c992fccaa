"""Alias of Horovod's ``horovod.torch.mpi_ops`` module path: re-exports the ops of
:mod:`hora.torch` so ``from hora.torch.mpi_ops import allreduce_async_`` keeps working."""

from __future__ import annotations

from hora.torch import *  # noqa: F401,F403
from hora.torch import __all__  # noqa: F401
