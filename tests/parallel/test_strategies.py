"""The parallel strategies' arithmetic under real `mpiexec -n 2` and `-n 4` launches.

One worker (tests/workers/strategy_worker.py) checks every strategy per rank
count: averages equal the mean of the pre-averaging buffers on every rank,
BMUF follows the spec's block formula, Kaldi averaging counts only the active
ranks, gradient allreduce on N ranks equals one rank with an N times larger
minibatch, and model averaging every step equals gradient allreduce.
"""

import pytest

from mpitrain.testing.mpirun import run_mpi

from ..helpers import WORKERS

pytestmark = pytest.mark.mpi

STRATEGY_CHECKS = ["model averaging", "bmuf nesterov", "bmuf classic", "kaldi idle ranks",
                   "allreduce equals one rank with N*B",
                   "allreduce with overlap equals one rank with N*B",
                   "model averaging K=1 equals allreduce"]


def _output(result):
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("nranks", [2, 4])
def test_strategies_average_and_match_their_references(nranks):
    result = run_mpi(nranks, [str(WORKERS / "strategy_worker.py"), str(nranks)], timeout=120)
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == STRATEGY_CHECKS, _output(result)
    assert f"all strategy checks passed on {nranks} ranks" in result.stdout
