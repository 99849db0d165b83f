"""run_mpi, the launcher of the MPI tests: a hung job is killed, a worker's skip code
becomes a pytest skip."""

import time

import pytest

from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi

pytestmark = pytest.mark.mpi


def test_hung_job_is_killed_with_a_clear_error():
    start = time.monotonic()
    with pytest.raises(MpiTimeoutError, match=r"did not finish within 3 s"):
        run_mpi(2, ["-c", "import time; time.sleep(60)"], timeout=3)
    assert time.monotonic() - start < 20


def test_worker_skip_code_becomes_pytest_skip():
    code = ("from mpitrain.testing.mpirun import skip_worker; "
            "skip_worker('nothing to do here')")
    with pytest.raises(pytest.skip.Exception, match="nothing to do here"):
        run_mpi(2, ["-c", code], timeout=60)
