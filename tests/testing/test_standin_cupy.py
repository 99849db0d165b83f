"""The CuPy stand-in (mpitrain/testing/standin_cupy.py) refuses what CuPy refuses:
a host array, even a 0-d one, inside a device operation, a host array into a
basic-indexed slice, and an implicit conversion of a device array to NumPy."""

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


def test_implicit_conversions_to_numpy_are_refused_as_cupy_refuses_them():
    """CuPy's ``ndarray.__array__`` raises: NumPy's conversions of a device array
    (also inside a list) fail instead of copying it to the host unseen."""
    with standin_cupy.installed() as cp:
        device = cp.arange(3, dtype=cp.float32)
        conversions = [np.asarray, np.array, np.asanyarray, np.ascontiguousarray,
                       np.asfortranarray, np.asarray_chkfinite, lambda a: np.require(a, requirements="C"),
                       lambda a: np.array([a[0], a[1]]), lambda a: np.asarray((a, a))]
        for convert in conversions:
            with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
                convert(device)
        assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}
        # the explicit reads, and NumPy's conversions of host data, still work
        assert np.asarray([1.0, 2.0]).tolist() == [1.0, 2.0]
        assert cp.asnumpy(device).tolist() == device.get().tolist() == [0.0, 1.0, 2.0]
    assert np.asarray(device).tolist() == [0.0, 1.0, 2.0]      # NumPy's own again


def test_host_arrays_in_device_functions_are_refused_as_cupy_refuses_them():
    with standin_cupy.installed() as cp:
        device = cp.ones(4, dtype=cp.float32)
        host = np.ones(4, dtype=np.float32)
        for call in (lambda: np.dot(device, host), lambda: np.concatenate([device, host]),
                     lambda: np.where(device > 0, host, device),
                     lambda: np.add(device, device, out=host),
                     lambda: np.sum(device, out=np.zeros((), np.float32))):
            with pytest.raises(TypeError, match="host array"):
                call()
        # CuPy copies take's host indices over, and copyto takes a 0-d host value
        assert isinstance(np.take(device, np.array([0, 1])), cp.ndarray)
        np.copyto(device, np.asarray(2.0, dtype=np.float32))
        assert float(np.dot(device, device)) == 16.0


def test_a_host_array_into_a_basic_slice_is_refused_as_cupy_refuses_it():
    """CuPy 12-14 fill a basic-indexed target from a scalar or a device array only;
    with an advanced index they copy a host value over."""
    with standin_cupy.installed() as cp:
        device = cp.zeros(4, dtype=cp.float32)
        with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
            device[...] = np.ones(4, dtype=np.float32)
        with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
            device[1:3] = np.ones(2, dtype=np.float32)
        with pytest.raises(TypeError, match="Unsupported type"):
            device[:2] = [1.0, 2.0]
        device[...] = np.asarray(1.0, dtype=np.float32)
        device[:2] = cp.full(2, 2.0, dtype=cp.float32)
        device[np.array([3])] = np.array([5.0], dtype=np.float32)
        assert cp.asnumpy(device).tolist() == [2.0, 2.0, 1.0, 5.0]


def test_iterating_gives_device_arrays_as_cupy_does():
    """Each element a 0-d device array, whose conversion is a read of its own."""
    with standin_cupy.installed() as cp:
        device = cp.arange(3, dtype=cp.float32)
        elements = list(device)
        assert all(isinstance(e, cp.ndarray) and e.shape == () for e in elements)
        assert standin_cupy.READS["implicit"] == 0
        assert [float(e) for e in elements] == [0.0, 1.0, 2.0]
        assert standin_cupy.READS["implicit"] == 3 and len(device) == 3
        with pytest.raises(TypeError, match="iteration over a 0-d array"):
            iter(device[0])


def test_printing_a_device_array_is_a_counted_read():
    """CuPy's repr, str, format and tobytes copy the array to the host (``get()``)."""
    with standin_cupy.installed() as cp:
        device = cp.arange(3, dtype=cp.float32)
        assert (repr(device), str(device), f"{device[1]:.2f}") == (
            "array([0., 1., 2.], dtype=float32)", "[0. 1. 2.]", "1.00")
        assert device.tobytes() == np.arange(3, dtype=np.float32).tobytes()
        assert standin_cupy.READS == {"implicit": 4, "asnumpy": 0}


def test_host_arrays_in_the_modules_functions_are_refused_as_cupy_refuses_them():
    """cupy.concatenate, cupy.dot, cupy.ascontiguousarray... take device arrays only;
    cupy.asarray and cupy.asanyarray copy host data over, take copies host indices."""
    with standin_cupy.installed() as cp:
        device = cp.ones(4, dtype=cp.float32)
        host = np.ones(4, dtype=np.float32)
        for call in (lambda: cp.concatenate([device, host]), lambda: cp.dot(device, host),
                     lambda: cp.ascontiguousarray(host), lambda: cp.stack([host, device])):
            with pytest.raises(TypeError, match="host array"):
                call()
        for call in (lambda: cp.copyto(device, host), lambda: np.copyto(device, host)):
            with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
                call()
        copied = cp.asanyarray(host)
        host[0] = 5.0
        assert float(copied[0]) == 1.0
        assert float(cp.take(device, np.array([1]))[0]) == 1.0
        assert cp.zeros_like(host).shape == (4,)
        cp.copyto(device, np.asarray(3.0, dtype=np.float32))
        assert float(cp.full(2, np.asarray(2.0, dtype=np.float32)).sum()) == 4.0


def test_numpys_conversions_take_their_data_by_keyword_while_installed():
    """NumPy's own signatures hold while the refusing conversions stand in for them:
    ``np.asarray(a=...)`` failed on a missing positional argument."""
    with standin_cupy.installed() as cp:
        assert np.asarray(a=[1.0]).tolist() == [1.0]
        assert np.array(object=[2.0]).tolist() == [2.0]
        assert np.frombuffer(buffer=b"\x01\x02", dtype=np.uint8).tolist() == [1, 2]
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
            np.asarray(a=cp.ones(2, dtype=cp.float32))


def test_a_conversion_bound_while_installed_is_numpys_own_once_uninstalled():
    """A module imported inside ``installed()`` that binds ``np.asarray`` (``from
    numpy import asarray``) keeps the stand-in's: it refused device arrays after."""
    with standin_cupy.installed() as cp:
        bound = np.asarray
        device = cp.arange(2, dtype=cp.float32)
    assert bound(device).tolist() == [0.0, 1.0]
    with standin_cupy.installed():
        with pytest.raises(TypeError, match="Implicit conversion"):
            bound(device)


def test_get_into_and_set_from_host_arrays_take_the_same_dtype_and_shape_only():
    """CuPy's ``get(out=)``, ``asnumpy(out=)`` and ``set()`` copy bytes: a host array of
    another dtype or shape is refused (no cast, no broadcast), as are a non-contiguous
    host array and, for ``set``, a non-contiguous device array."""
    with standin_cupy.installed() as cp:
        device = cp.arange(4, dtype=cp.float32)
        for call in (lambda: device.get(out=np.empty(4, dtype=np.float64)),
                     lambda: cp.asnumpy(device, out=np.empty(4, dtype=np.float64)),
                     lambda: device.set(np.zeros(4, dtype=np.float64)),
                     lambda: device.get(out=[0.0] * 4)):
            with pytest.raises(TypeError):
                call()
        for call in (lambda: device.get(out=np.empty((1, 4), dtype=np.float32)),
                     lambda: device.set(np.zeros(1, dtype=np.float32))):
            with pytest.raises(ValueError, match="Shape mismatch"):
                call()
        with pytest.raises(RuntimeError, match="non-contiguous"):
            device[::2].set(np.zeros(2, dtype=np.float32))
        with pytest.raises(RuntimeError, match="non-contiguous"):
            device[:2].get(out=np.empty(4, dtype=np.float32)[::2])
        out = np.empty(4, dtype=np.float32)
        assert device.get(out=out) is out and out.tolist() == [0.0, 1.0, 2.0, 3.0]
        device.set(np.ones(4, dtype=np.float32))
        assert cp.asnumpy(device).tolist() == [1.0] * 4


def test_asarray_of_a_device_array_is_that_array_as_in_cupy():
    """cupy.asarray and asanyarray hand a device array of the asked dtype back as it
    is (no copy: writes through either name show in both); cupy.array copies, and
    ``copy=False`` with another dtype is refused (CuPy 14, as NumPy 2)."""
    with standin_cupy.installed() as cp:
        device = cp.zeros(3, dtype=cp.float32)
        assert cp.asarray(device) is device
        assert cp.asanyarray(device, dtype=np.float32) is device
        assert cp.array(device) is not device
        assert cp.asarray(device, dtype=np.float64).dtype == np.float64
        with pytest.raises(ValueError, match="Unable to avoid copy"):
            cp.asarray(device, dtype=np.float64, copy=False)
        assert cp.asarray(device, copy=False) is device


def test_an_element_is_a_view_of_the_arrays_memory_as_in_cupy():
    # NumPy's a[k] is a copy: a kernel's out= into it, or a write through it, left
    # the array as it was on the stand-in and changed it on a GPU (the natural
    # gradient's fixed scalar cells are written that way)
    with standin_cupy.installed() as cp:
        cells = cp.zeros(3, dtype=cp.float32)
        cell = cells[1]
        assert isinstance(cell, standin_cupy.DeviceArray) and cell.shape == ()
        cp.multiply(cp.float32(2), cp.float32(3), out=cell)
        grid = cp.zeros((2, 3), dtype=cp.float64)
        grid[1, 2][...] = 7
        grid[(0, 1)][...] = 5
        assert cells.tolist() == [0.0, 6.0, 0.0]
        assert grid.tolist() == [[0.0, 5.0, 0.0], [0.0, 0.0, 7.0]]


def test_a_device_array_is_no_numpy_array_and_lends_no_buffer_as_in_cupy():
    """CuPy's arrays are no numpy.ndarray and have no buffer protocol: code that
    decided host or device by isinstance, or read a device array through
    memoryview, struct or ctypes, worked on the stand-in only."""
    import ctypes
    import struct
    with standin_cupy.installed() as cp:
        device = cp.arange(4, dtype=cp.float32)
        assert not isinstance(device, np.ndarray) and isinstance(device, cp.ndarray)
        for read in (lambda: memoryview(device), lambda: struct.unpack("4f", device),
                     lambda: (ctypes.c_float * 4).from_buffer(device)):
            with pytest.raises(TypeError):
                read()
        # nor NumPy's ways around the device: its array interface, ctypes, tofile
        for name in ("__array_interface__", "__array_struct__", "ctypes"):
            assert not hasattr(device, name), name
        assert device.data.ptr and device.__cuda_array_interface__["shape"] == (4,)
        assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}


def test_the_cuda_array_interface_is_withdrawn_for_an_mpi_without_cuda_support(monkeypatch):
    # mpi4py hands a device array to MPI through __cuda_array_interface__; a test of
    # an MPI built without CUDA support turns it off, so that mpi4py refuses the array
    with standin_cupy.installed() as cp:
        device = cp.arange(4, dtype=cp.float32)
        monkeypatch.setitem(standin_cupy.CUDA_ARRAY_INTERFACE, "offered", False)
        assert not hasattr(device, "__cuda_array_interface__")
        assert not hasattr(device[1:], "__cuda_array_interface__")
        assert device.data.ptr          # (NCCL takes the address itself)
        monkeypatch.setitem(standin_cupy.CUDA_ARRAY_INTERFACE, "offered", True)
        assert device[1:].__cuda_array_interface__["shape"] == (3,)


def test_numpy_asks_before_it_takes_a_device_array_into_host_memory():
    """``host[...] = device``, ``np.copyto(host, device)``, ``np.float32(a)`` and
    h5py writing a device array are TypeErrors with CuPy; a NumPy subclass let
    NumPy copy it over unasked.  Nothing of the host array is written."""
    import io

    import h5py
    with standin_cupy.installed() as cp:
        device = cp.arange(4, dtype=cp.float32)
        host = np.zeros(4, dtype=np.float32)
        with h5py.File(io.BytesIO(), "w") as h5:
            dataset = h5.create_dataset("x", shape=(4,), dtype="f4")
            for write in (lambda: host.__setitem__(Ellipsis, device),
                          lambda: host.__setitem__(slice(1, 3), device[:2]),
                          lambda: np.copyto(host, device), lambda: np.float32(device[1]),
                          lambda: np.int64(device.astype(cp.int64)[1]),
                          lambda: h5.create_dataset("y", data=device),
                          lambda: dataset.__setitem__(Ellipsis, device)):
                with pytest.raises(TypeError):
                    write()
            assert "y" not in h5 and not dataset[...].any()
        assert not host.any()
        assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}


def test_a_device_scalar_is_read_by_float_and_int_but_is_no_index_as_in_cupy():
    """CuPy's ``__float__``, ``__int__`` and ``__bytes__`` copy to the host (counted
    reads: ``host[k] = a`` of a 0-d array is one); it has no ``__index__``, so a
    device scalar cannot stand for a Python integer (``range(a)``, ``h[a]``), and no
    ``__round__`` (``round(a)``)."""
    import operator
    with standin_cupy.installed() as cp:
        device = cp.arange(4, dtype=cp.int64)
        host = np.zeros(4, dtype=np.float32)
        host[0] = device[3]
        assert host[0] == 3.0 and standin_cupy.READS["implicit"] == 1
        assert (int(device[2]), bytes(device[:1])) == (2, np.int64(0).tobytes())
        assert standin_cupy.READS["implicit"] == 3
        for use in (lambda: operator.index(device[1]), lambda: range(device[1]),
                    lambda: [0, 1][device[1]], lambda: round(device[1])):
            with pytest.raises(TypeError):
                use()


def test_what_cupy_lacks_is_refused_as_cupy_refuses_it():
    """The stand-in offers CuPy's interface (12 to 14), not all of NumPy's: a name,
    method, ufunc method or keyword CuPy lacks fails here as on a GPU."""
    with standin_cupy.installed() as cp:
        device = cp.arange(6, dtype=cp.float32)
        for missing in (lambda: cp.delete, lambda: cp.acos, lambda: cp.errstate,
                        lambda: cp.linalg.eig, lambda: cp.random.default_rng(0).normal,
                        lambda: device.byteswap, lambda: device.mT, lambda: device.resize,
                        lambda: device.ctypes):
            with pytest.raises(AttributeError, match="has no attribute"):
                missing()
        for wrong in (lambda: device.sort(kind="stable"),         # (CuPy 14 only)
                      lambda: device.sum(where=device > 0),
                      lambda: cp.max(device, initial=0.0),
                      lambda: cp.take(device, cp.asarray([0]), mode="clip"),
                      lambda: cp.zeros(3, device="cpu"),
                      lambda: cp.add(device, 1, where=device > 0),
                      lambda: device.item(0),
                      lambda: np.add.at(device, [0], 1.0),         # (CuPy 12)
                      lambda: np.delete(device, 0)):
            with pytest.raises(TypeError):
                wrong()
        for unsupported in (lambda: cp.maximum.reduce(device),
                            lambda: cp.multiply.reduceat(device, cp.asarray([0, 3])),
                            lambda: cp.multiply.at(device, cp.asarray([0]), 2.0)):
            with pytest.raises(NotImplementedError, match="is not supported yet"):
                unsupported()


def test_what_cupy_has_is_there_on_device_arrays():
    with standin_cupy.installed() as cp:
        device = cp.arange(6, dtype=cp.float32)
        cp.add.at(device, cp.asarray([0, 0]), 1.0)
        assert cp.asnumpy(device)[0] == 2.0
        assert float(cp.add.reduce(device)) == 17.0
        sums = cp.add.reduceat(device, cp.asarray([0, 3]))
        assert isinstance(sums, cp.ndarray) and np.array_equal(cp.asnumpy(sums), [5, 12])
        assert cp.multiply.outer(cp.ones(2), device).shape == (2, 6)
        solved = cp.linalg.solve(cp.eye(2), cp.ones(2))
        draws = cp.random.default_rng(0).standard_normal(3)
        assert all(isinstance(a, cp.ndarray) for a in (solved, draws, cp.random.rand(2)))
        assert device.argmax(axis=0, keepdims=True).shape == (1,)
        assert cp.sort(device, kind="stable").shape == (6,)     # (the function has kind)


def test_a_host_out_of_a_cupy_ufunc_is_refused_as_cupy_refuses_it():
    """``cupy.add(a, b, out=host)``: CuPy's ufuncs write device arrays only (the
    stand-in's wrote the host array, so code doing it passed and failed on a GPU)."""
    with standin_cupy.installed() as cp:
        device = cp.ones(4, dtype=cp.float32)
        host = np.zeros(4, dtype=np.float32)
        for out in (host, (host,), np.zeros((), np.float32)):
            with pytest.raises(TypeError, match="Output arguments type must be cupy.ndarray"):
                cp.add(device, device, out=out)
        assert not host.any()
        out = cp.empty(4, dtype=cp.float32)
        assert cp.add(device, device, out=out) is out
        assert float(out.sum()) == 8.0


def test_a_ufunc_reduction_into_out_hands_back_that_array_as_cupy_does():
    with standin_cupy.installed() as cp:
        device = cp.ones((2, 3), dtype=cp.float32)
        total, running = cp.empty(3, dtype=cp.float32), cp.empty((2, 3), dtype=cp.float32)
        assert cp.add.reduce(device, 0, None, total) is total
        assert cp.add.accumulate(device, 0, None, running) is running
        assert float(total.sum()) == 6.0 and float(running[1].sum()) == 6.0
