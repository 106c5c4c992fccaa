#!/usr/bin/env bash
# Run one of Horovod's own test files unchanged against hora, as Horovod's CI does: `hora run
# -np N`, one pytest process per rank for the whole file, with `horovod` aliased to `hora`.
#
#   bash scripts/horovod_tests.sh PATH/TO/test_torch.py [-np 2] [pytest args...]
#
# Horovod's test files are not part of hora: take them from Horovod's repository (tag v0.28.1,
# test/parallel/ and test/utils/common.py beside them). Needs `mock` (pip) for Horovod's
# common.py. Prints each rank's pytest summary; exits with the job's status.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: bash scripts/horovod_tests.sh PATH/TO/test_file.py [-np N] [pytest args...]" >&2
  exit 2
fi
FILE="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; shift
NP=2
if [ "${1:-}" = "-np" ]; then NP="$2"; shift 2; fi
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
cd "$(dirname "$FILE")"
PYTHONPATH="$ROOT/scripts/horovod_alias${PYTHONPATH:+:$PYTHONPATH}" \
  exec "$PY" -m hora.runner.cli run -np "$NP" "$PY" -m pytest -p no:cacheprovider -rf \
  --timeout 300 "$FILE" "$@"
