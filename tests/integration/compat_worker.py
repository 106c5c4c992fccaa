"""One rank of the compatibility job: pytest over compat_cases.py in an order shuffled by the
seed on the command line (the same on every rank), in this one process."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest


class Shuffle:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        random.Random(self.seed).shuffle(items)
        print("ORDER " + " ".join(item.name for item in items), flush=True)


if __name__ == "__main__":
    cases = str(Path(__file__).with_name("compat_cases.py"))
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "python_files=compat_cases.py",
                          "-o", "addopts=", "--timeout", "60", cases],
                         plugins=[Shuffle(int(sys.argv[1]))]))
