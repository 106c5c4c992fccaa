"""``import horovod...`` -> hora: lets Horovod's own test files and scripts run unchanged.

Used by ``scripts/horovod_tests.sh`` (put this directory first on ``PYTHONPATH``); not part of
the installed package. ``horovod.X`` resolves to ``hora.X`` when hora has it; the few helpers
Horovod's tests import from Horovod internals are provided here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import hora
from hora import *  # noqa: F401,F403

__version__ = "0.28.1"


@contextlib.contextmanager
def _env(**kwargs: str) -> Iterator[None]:
    """horovod.common.util.env: set environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _version_at_least(v1: str, v2: str) -> bool:
    """horovod.common.util.is_version_greater_equal_than."""
    from packaging import version

    return bool(version.parse(v1.replace("-tf", "+tf")) >= version.parse(v2))


def _in_thread(target: Any, args: tuple[Any, ...] = (), name: str | None = None,
               daemon: bool = True, silent: bool = False) -> threading.Thread:
    """horovod.runner.util.threads.in_thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


_EXTRAS: dict[str, dict[str, Any]] = {
    "horovod.common": {},
    "horovod.common.util": {"env": _env, "is_version_greater_equal_than": _version_at_least},
    "horovod.runner": {"run": getattr(hora, "run", None)},
    "horovod.runner.util": {},
    "horovod.runner.util.threads": {"in_thread": _in_thread},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("horovod."):
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        name = spec.name
        if name in _EXTRAS:
            module = types.ModuleType(name)
            module.__path__ = []  # type: ignore[attr-defined]
            module.__dict__.update(_EXTRAS[name])
            return module
        module = importlib.import_module("hora" + name[len("horovod"):])
        if name.count(".") <= 2 and hasattr(module, "init") and not hasattr(module, "sycl_built"):
            module.sycl_built = lambda: False  # Intel's fork of the tests asks for it
        return module

    def exec_module(self, module: Any) -> None:
        pass


sys.meta_path.insert(0, _Alias())
