"""Shared fixtures: array modules to test with, and the MPI launcher."""

import os

import numpy
import pytest

from mpitrain import backend

GPU_REQUIRED_ENV = "MPITRAIN_TEST_GPU"


def skip_or_fail_gpu(reason: str) -> None:
    """Skip a GPU test, or fail it when MPITRAIN_TEST_GPU=1 says a GPU must be there."""
    if os.environ.get(GPU_REQUIRED_ENV) == "1":
        pytest.fail(f"{GPU_REQUIRED_ENV}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """numpy, and cupy when it imports and a CUDA device answers."""
    if request.param == "numpy":
        return numpy
    if not backend.gpu_available():
        skip_or_fail_gpu("cupy with a usable CUDA device is not available")
    return backend.select("gpu")


@pytest.fixture(scope="session")
def mpiexec():
    """Path of the MPI launcher; skips the test when there is none."""
    from mpitrain.testing.mpirun import find_mpiexec
    launcher = find_mpiexec()
    if launcher is None:
        pytest.skip("no MPI launcher: set $MPIEXEC or `pip install mpich` into the venv")
    return launcher
