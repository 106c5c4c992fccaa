"""Typing helpers that newer Pythons have built in (``typing.override`` arrives in 3.12)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 12):
    from typing import override
elif TYPE_CHECKING:  # mypy ships typing_extensions' stubs; no runtime dependency needed
    from typing_extensions import override
else:
    def override(func: T) -> T:
        """No-op stand-in for :func:`typing.override` before Python 3.12."""
        return func

__all__ = ["override"]
