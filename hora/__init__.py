"""hora: distributed data-parallel training with Horovod's API, in pure Python.

This module is the framework-neutral process API and the collectives on numpy arrays::

    import numpy as np, hora
    hora.init()
    total = hora.allreduce(np.ones(3, np.float32) * hora.rank(), op=hora.Sum)

Framework adapters (``hora.torch``, ...) expose the same names on their tensor types. Every
collective must be called by all ranks of its process set with the same name, dtype and shape
rules; see :mod:`hora.core.frontend.api` for the shared contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hora._version import __version__ as __version__

if TYPE_CHECKING:  # what the lazy attributes are, for type checkers and IDEs
    from hora.numpy_api import *  # noqa: F403


def __getattr__(name: str) -> Any:
    """Load the API on first use (PEP 562): ``import hora`` alone costs nothing, and the
    launcher (``hora.runner``) never imports the engine."""
    if name == "numpy_api" or (name.startswith("__") and name != "__all__"):
        raise AttributeError(f"module 'hora' has no attribute {name!r}")
    api = importlib.import_module("hora.numpy_api")
    try:
        value = getattr(api, name)
    except AttributeError:
        raise AttributeError(f"module 'hora' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    api = importlib.import_module("hora.numpy_api")
    return sorted(set(globals()) | set(api.__all__))
