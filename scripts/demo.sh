#!/usr/bin/env bash
# Set up (if needed) and run the demo: a real 2-rank training run on a dataset shipped in a package
# (scikit-learn's digits, no download): examples/torch_digits.py through `hora run -np 2`.
# Extra args go to the example (e.g. --epochs 5); the progress bar is shown on a terminal only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
progress=()
[ -t 1 ] || progress=(--no-progress)
exec .venv/bin/hora run -np 2 .venv/bin/python examples/torch_digits.py "${progress[@]}" "$@"
