#!/usr/bin/env bash
# Set up (if needed) and run the demo: a real 2-rank training run on a dataset shipped in a package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hora run -np 2 .venv/bin/python examples/numpy_least_squares.py "$@"
