"""The CuPy stand-in (mpitrain/testing/standin_cupy.py) refuses what CuPy refuses:
a host array, even a 0-d one, inside a device operation."""

import numpy as np
import pytest

from mpitrain.testing import standin_cupy


def test_host_arrays_in_device_operations_are_refused_as_cupy_refuses_them():
    with standin_cupy.installed() as cp:
        device = cp.ones(4, dtype=cp.float32)
        out = cp.empty(4, dtype=cp.float32)
        with pytest.raises(TypeError, match="host array"):
            cp.multiply(device, np.asarray(2.0, dtype=np.float32), out=out)
        with pytest.raises(TypeError, match="host array"):
            device * np.ones(4, dtype=np.float32)
        # NumPy scalars and Python numbers are what CuPy takes
        cp.multiply(device, np.float32(2.0), out=out)
        device *= 3
        assert np.array_equal(cp.asnumpy(out + device), np.full(4, 5.0, dtype=np.float32))


def test_deferred_copies_land_when_waited_for():
    """Within deferred_copies an asynchronous copy to the host lands when its event,
    the stream or a blocking read waits for it, not before (as on a GPU)."""
    from mpitrain import backend
    with standin_cupy.installed() as cp, standin_cupy.deferred_copies():
        x = cp.arange(4, dtype=cp.float32)
        out = np.zeros(4, dtype=np.float32)
        pending = backend.copy_to_host_async(x, out=out)
        assert standin_cupy.copies_in_flight() == 1 and not out.any()
        assert np.array_equal(pending.result(), np.arange(4, dtype=np.float32))
        assert standin_cupy.copies_in_flight() == 0
        backend.copy_to_host_async(x * 2, out=out)
        backend.to_host(x)                         # a blocking read waits for the stream
        assert standin_cupy.copies_in_flight() == 0 and out[3] == 6.0
