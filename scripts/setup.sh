#!/usr/bin/env bash
# Set up .venv with hora and everything its tests, demo and benchmarks use. Idempotent.
# PyTorch is installed first and pinned, so that pip never picks a torch by itself. On a public
# index the pinned Linux wheel is the CUDA build (GBs of CUDA packages):
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes it from PyTorch's CPU wheel index.
# tensorflow-cpu (the CPU-only wheel of TensorFlow, with Keras 3) comes next, then tf-keras
# of the same version (Keras 2 under TF_USE_LEGACY_KERAS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  $PIP install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if ! .venv/bin/python -c "import tensorflow" 2>/dev/null; then
  # after torch: tensorflow-cpu keeps the numpy torch was installed with (no GPU wheels)
  echo "[setup] installing tensorflow-cpu==2.21.0 (hora.tensorflow / hora.keras)"
  $PIP install "tensorflow-cpu==2.21.0"
fi
if ! .venv/bin/python -c "import tf_keras" 2>/dev/null; then
  # Keras 2 for TF_USE_LEGACY_KERAS=1 (hora.keras's tf-keras tests); its version must match
  # TensorFlow's, or pip replaces TensorFlow
  echo "[setup] installing tf-keras==2.21.0 (Keras 2 through tf-keras)"
  $PIP install "tf-keras==2.21.0"
fi
if ! .venv/bin/python -c "import jax, optax, flax" 2>/dev/null; then
  # after torch: jax's CPU wheel (jaxlib) keeps numpy as it is (hora.jax)
  echo "[setup] installing jax==0.10.2, optax==0.2.8, flax==0.12.8 (CPU; hora.jax)"
  $PIP install "jax==0.10.2" "optax==0.2.8" "flax==0.12.8"
fi
if ! .venv/bin/python -c "import ray" 2>/dev/null; then
  echo "[setup] installing ray==2.60.0 (hora.ray)"
  $PIP install "ray==2.60.0"
fi
if ! .venv/bin/python -c "import pyspark" 2>/dev/null; then
  # hora.spark; Spark itself needs a Java runtime (.ci/run installs Debian's JRE; tests skip
  # without one)
  echo "[setup] installing pyspark==4.3.0 (hora.spark)"
  $PIP install "pyspark==4.3.0"
fi
if ! .venv/bin/python -c "import pyarrow, fsspec" 2>/dev/null; then
  # the Spark Estimators' store and Parquet reader (hora.spark.common); neither pulls torch
  echo "[setup] installing pyarrow==26.0.1, fsspec (hora.spark Estimators)"
  $PIP install "pyarrow==26.0.1" fsspec
fi
if ! .venv/bin/python -c "import mpi4py" 2>/dev/null; then
  # the mpi data plane (HORA_DATA_PLANE=mpi): mpi4py's binary wheel loads the system's MPI
  # (Open MPI's libmpi.so.40 from openmpi-bin) at run time, so it needs no compiler or MPI
  # headers; without a wheel for this platform the mpi plane's tests skip, saying why
  echo "[setup] installing mpi4py==4.1.2 (the mpi data plane)"
  $PIP install --only-binary :all: "mpi4py==4.1.2" \
    || echo "[setup] could not install mpi4py; the mpi data plane's tests will be skipped"
fi
echo "[setup] installing hora (editable) with test extras"
$PIP install -e ".[test]"
