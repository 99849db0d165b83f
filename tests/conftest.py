"""Shared fixtures: array modules to test with, the MPI launcher, a small corpus.

Kinds of tests are markers (declared in pyproject.toml): ``mpi`` (launches
mpiexec), ``gpu`` (needs CuPy and a CUDA device; MPITRAIN_TEST_GPU=1 turns
their skips into failures) and ``slow`` (end-to-end training runs, Slurm).
"""

import os

import numpy
import pytest

from mpitrain import backend
from mpitrain.testing import gpu_required

GPU_REQUIRED_ENV = "MPITRAIN_TEST_GPU"


def skip_or_fail_gpu(reason: str) -> None:
    """Skip a GPU test, or fail it when MPITRAIN_TEST_GPU=1 says a GPU must be there."""
    if os.environ.get(GPU_REQUIRED_ENV) == "1":
        pytest.fail(f"{GPU_REQUIRED_ENV}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def stop_signals_left_as_found():
    """A test that leaves the process's stop signals ignored fails (and they are put
    back): every later test's subprocess inherits SIG_IGN, so a batch script cannot
    trap them and a run cannot be stopped, failing tests far from the cause."""
    import signal
    from mpitrain.train.stop import STOP_SIGNALS
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    yield
    left = [signal.Signals(number).name for number, handler in before.items()
            if handler != signal.SIG_IGN and signal.getsignal(number) == signal.SIG_IGN]
    for number, handler in before.items():
        signal.signal(number, handler)
    assert not left, f"the test left {', '.join(left)} ignored in the test process"


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


@pytest.fixture
def cp():
    """CuPy with a device selected and the fused kernels on, for tests marked gpu."""
    xp = gpu_required()
    backend.set_fused_kernels(True)
    assert backend.fused_kernels(xp)
    return xp


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """0.15 h of training speech (4 shards) and 0.03 h of held-out speech."""
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("corpus")
    synthesize(str(out), hours=0.15, speakers=20, shards=4, seed=7, dev_hours=0.03,
               dev_speakers=4)
    return str(out)
