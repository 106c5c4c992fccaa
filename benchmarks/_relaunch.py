"""Start a benchmark script again as every rank of a ``hora run -np N`` job.

The step benchmarks run as ``python benchmarks/X.py ...``: that launcher process re-runs the
same script with ``--worker`` under hora's own launcher and exits with the job's status.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


def relaunch(script: str, np: int, argv: list[str] | None, env: dict[str, str]) -> None:
    """Run ``script --worker <argv>`` on ``np`` ranks with ``env`` added; exit with its status.

    ``argv`` is the script's own arguments (None: ``sys.argv[1:]``); a ``--worker`` among them
    is dropped, since this adds it.
    """
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    path = os.path.abspath(script)
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np), sys.executable, path,
           "--worker", *passed]
    shown = os.path.join("benchmarks", os.path.basename(path))
    print("launching: " + shlex.join(["hora", "run", "-np", str(np), "python", shown,
                                      "--worker", *passed]))
    sys.exit(subprocess.call(cmd, env={**os.environ, **env}))
