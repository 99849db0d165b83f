#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# CPU-only CI: GPU tests skip unless MPITRAIN_TEST_GPU=1 is set on a GPU machine.
exec .venv/bin/python -m pytest -q -ra "$@"
