"""MpiCommunicator under real `mpiexec -n 2` and `-n 4` launches.

Each launch costs about a second, so one worker script (tests/workers/comm_worker.py)
runs all buffer and object checks per rank count, on host buffers and (marked
gpu) on device buffers.
"""

import os

import pytest

from mpitrain import backend
from mpitrain.testing.mpirun import run_mpi

from ..helpers import WORKERS

pytestmark = pytest.mark.mpi

CHECKS = ["identity", "allreduce_", "allreduce_ in pieces", "bcast_", "sendrecv ring", "isend/irecv",
          "send/recv/iprobe", "iallreduce_", "split", "dup", "allreduce_scalar",
          "objects", "comm_time", "wtime"]


def _output(result):
    return f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


@pytest.mark.parametrize("nranks", [2, 4])
def test_comm_worker_all_checks(nranks):
    result = run_mpi(nranks, [str(WORKERS / "comm_worker.py"), str(nranks)], timeout=120)
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == CHECKS, _output(result)
    assert f"all checks passed on {nranks} ranks" in result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["auto", "host-staged"])
def test_comm_worker_device_buffers(transport):
    if not backend.gpu_available():
        if os.environ.get("MPITRAIN_TEST_GPU") == "1":
            pytest.fail("MPITRAIN_TEST_GPU=1 but no CUDA device is usable")
        pytest.skip("needs cupy and a CUDA device")
    result = run_mpi(2, [str(WORKERS / "comm_worker.py"), "2", "--xp", "cupy",
                         "--transport", transport], timeout=180)
    assert result.returncode == 0, _output(result)
    assert "all checks passed on 2 ranks (cupy)" in result.stdout, _output(result)
