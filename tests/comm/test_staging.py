"""Pinned host staging of device buffers, in one process with the CuPy stand-in."""

import numpy as np

from mpitrain.testing import standin_cupy


def test_staged_buffer_holds_the_device_data_when_mpi_reads_it():
    """CuPy 12's ``get(out=pinned)`` on a stream other than the legacy default one
    (a run with cuda_graph has its own) queues the copy and returns without
    waiting: the staging path must wait for it before MPI reads the host buffer."""
    from mpitrain.comm.gpu import PinnedStagingPath
    with standin_cupy.installed() as cp, standin_cupy.deferred_copies(early_get=True):
        path = PinnedStagingPath(cp)
        buf = cp.arange(6, dtype=cp.float32)
        staged, token = path.enter(buf, copy_in=True)
        np.testing.assert_array_equal(staged, np.arange(6, dtype=np.float32))
        staged *= 2                                  # what MPI's reduction writes
        path.leave(buf, token, copy_out=True)
        np.testing.assert_array_equal(cp.asnumpy(buf), 2 * np.arange(6, dtype=np.float32))
        # the block is reused for the next buffer, which must not see stale data
        staged, token = path.enter(cp.full(6, 7, dtype=cp.float32), copy_in=True)
        np.testing.assert_array_equal(staged, np.full(6, 7, dtype=np.float32))
        path.leave(buf, token, copy_out=False)


def test_the_cuda_aware_variable_is_read_or_its_value_said(monkeypatch):
    """MPITRAIN_CUDA_AWARE_MPI=yes was taken for unset, without a word."""
    from mpitrain.comm.gpu import CUDA_AWARE_ENV, cuda_aware_setting
    for value, wanted in [("", (None, None)), ("1", (True, None)), ("yes", (True, None)),
                          ("True", (True, None)),
                          ("0", (False, f"disabled by {CUDA_AWARE_ENV}=0")),
                          ("off", (False, f"disabled by {CUDA_AWARE_ENV}=off")),
                          ("maybe", (False, f"not tried: {CUDA_AWARE_ENV}='maybe' is "
                                            "neither 1 (yes) nor 0 (no)"))]:
        monkeypatch.setenv(CUDA_AWARE_ENV, value)
        assert cuda_aware_setting() == wanted, value
    monkeypatch.delenv(CUDA_AWARE_ENV)
    assert cuda_aware_setting() == (None, None)
