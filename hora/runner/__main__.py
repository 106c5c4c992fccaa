"""``python -m hora.runner``: the same as the ``hora`` console script."""

from __future__ import annotations

import sys

from hora.runner.cli import main

sys.exit(main())
