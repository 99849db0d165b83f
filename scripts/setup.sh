#!/usr/bin/env bash
# Create .venv (if missing) and install mpitrain with MPICH from PyPI, so no
# system MPI is needed.  Safe to run again: it only installs what is missing.
# On a cluster with its own MPI, see docs/user-guide.md instead.
# PYTHON: the interpreter that creates .venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
.venv/bin/python -m pip install --quiet -e ".[mpich,test]"
