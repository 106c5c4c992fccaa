#!/usr/bin/env bash
# Set up (if needed) and run the demo: a real 2-rank training run on a dataset shipped in a package
# (scikit-learn's digits, no download): examples/torch_digits.py through `hora run -np 2`.
#
# The demo has its own environment, .venv-demo/, with only what it runs: torch==2.13.0 (installed
# first and pinned, so pip never picks a torch by itself), then hora with scikit-learn and tqdm
# (about 1 GB). The test environment, .venv/ (scripts/setup.sh), keeps everything the suite
# needs. On a public index the pinned Linux torch wheel is the CUDA build (GBs of CUDA packages):
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes torch from PyTorch's CPU wheel index.
# Extra args go to the example (e.g. --epochs 5); the progress bar is shown on a terminal only.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=.venv-demo
TORCH="torch==2.13.0"
if [ ! -x "$ENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$ENV"
fi
# --no-compile: Python compiles only the modules the demo imports, when it first imports them
# (faster, and ~200 MB less than byte-compiling all of torch at install time)
INSTALL="$ENV/bin/pip --disable-pip-version-check -q install --no-compile"
if ! "$ENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[demo] installing $TORCH into $ENV${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  $INSTALL "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# hora from this tree (editable), with what the example imports; the pin again, so that resolving
# hora's extra can never replace the torch installed above.
if ! "$ENV/bin/python" - "$PWD" 2>/dev/null <<'EOF'
import sys, hora, sklearn, tqdm  # noqa: F401
sys.exit(not hora.__file__.startswith(sys.argv[1] + "/"))
EOF
then
  echo "[demo] installing hora (editable), scikit-learn and tqdm into $ENV"
  $INSTALL "$TORCH" -e ".[torch]"
fi
progress=()
[ -t 1 ] || progress=(--no-progress)
exec "$ENV/bin/hora" run -np 2 "$ENV/bin/python" examples/torch_digits.py "${progress[@]}" "$@"
