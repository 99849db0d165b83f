#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One BLAS thread per process: tests launch several ranks on few cores, and
# multi-threaded BLAS collapses under that load.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# CPU-only CI: GPU tests skip unless MPITRAIN_TEST_GPU=1 is set on a GPU machine.
exec .venv/bin/python -m pytest -q -ra "$@"
