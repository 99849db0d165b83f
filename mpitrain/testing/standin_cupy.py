"""A stand-in for CuPy on machines without a GPU: host memory behind CuPy's interface.

Its arrays hold host memory behind a class of their own (no NumPy
subclass, so NumPy asks them before it takes their data) and behave like
device arrays where it matters for testing the GPU code paths without a
GPU: every result of an operation stays a stand-in array (0-d results too,
as in CuPy), and every implicit read of a value on the host -- ``float(a)``,
``int(a)``, ``bool(a)``, ``bytes(a)``, ``host[k] = a`` of a 0-d array,
``a.item()``, ``a.tolist()``, ``a.tobytes()``, ``str(a)``, ``f"{a:.3f}"``,
``cupy.asnumpy(a)``, ``a.get()`` -- is counted in :data:`READS`.  What CuPy
refuses, it refuses: a host array in a device operation (``np.dot(device,
host)``, ``device * host``, ``cupy.add(a, b, out=host)``), a host array assigned to a basic-indexed slice
(``device[...] = host``), a host array of another dtype or shape in
``get(out=)``, ``asnumpy(out=)`` or ``set()`` (no cast, no broadcast), a
device scalar as an index (``range(a)``: CuPy has no ``__index__``), and,
while installed, any implicit conversion to NumPy (CuPy's ``__array__``
raises): ``np.asarray(device)``, ``np.array([device, ...])``, ``host[...] =
device``, ``np.copyto(host, device)``, ``np.float32(a)`` or ``np.int64(a)``
of a 0-d array, h5py writing a device array.  As CuPy's, its arrays are no
``numpy.ndarray`` (``isinstance(a, np.ndarray)`` is False) and lend no
buffer (``memoryview(a)``, ``struct`` or ``ctypes`` reading them: CuPy's
buffer refuses outside unified memory), nor NumPy's ``__array_interface__``
or ``ctypes``; their ``__cuda_array_interface__`` (what mpi4py hands a
CUDA-aware MPI) is withdrawn by :data:`CUDA_ARRAY_INTERFACE` for a test of
an MPI without CUDA support.  Outside :func:`installed` they convert to
NumPy, so that a test can look at what it kept; code decides host or device with
``backend.is_gpu_array`` and reads with ``backend.to_host``.
``asarray`` hands a device array back as it is, as CuPy does; iterating
gives 0-d device arrays, and an element (``a[k]``) is a 0-d view of the
array's memory, as in CuPy (NumPy's is a copy: a write into it, ``out=``
included, reached the array on a GPU only).
It has no kernel compiler (no ``RawModule``), so code that would launch a
fused kernel takes its array expression path instead, on the same
device-array discipline.  Within :func:`deferred_copies`, asynchronous
device-to-host copies land only when they are waited for, as on a GPU.
Within :func:`unified_memory`, host reads behave as CuPy's under
``CUPY_ENABLE_UMP=1``.  :data:`DEVICE` holds what the
device reports (compute capability, cuBLAS version); ``cuda.cublas`` is a
cuBLAS binding whose ``gemmEx`` reads its host scalars during the call, as
cuBLAS does.

Example::

    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    with standin_cupy.installed() as cp:
        x = cp.zeros(3, dtype=cp.float32)
        float(x.sum())                      # counted
        standin_cupy.READS["implicit"]      # 1
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .cupy_interface import (ARRAY_METHODS, ARRAY_PROPERTIES, CUPY_GENERATOR, CUPY_LINALG,
                             CUPY_NAMES, CUPY_RANDOM, CUPY_UFUNCS, FUNCTION_PARAMETERS,
                             UFUNC_KEYWORDS, UFUNC_METHODS)

#: Host reads of stand-in arrays: implicit conversions, and explicit copies.
READS = {"implicit": 0, "asnumpy": 0}


def reset_counts() -> None:
    for key in READS:
        READS[key] = 0


def _plain(obj):
    """Unwrap stand-in arrays (also inside lists and tuples) to their NumPy arrays."""
    if isinstance(obj, DeviceArray):
        return obj._host
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(o) for o in obj)
    return obj


def _wrap(obj):
    """Results back as stand-in arrays; scalars become 0-d arrays as in CuPy."""
    if isinstance(obj, np.ndarray):
        return DeviceArray._holding(obj)
    if isinstance(obj, np.generic):
        return DeviceArray._holding(np.array(obj))
    if isinstance(obj, tuple):
        return tuple(_wrap(o) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o) for o in obj]
    return obj


def _refuse_host_arrays(inputs, name: str) -> None:
    """CuPy's operations refuse host arrays (0-d ones too, also inside a list such
    as ``concatenate``'s); NumPy scalars and Python numbers are fine."""
    for value in inputs:
        if isinstance(value, (list, tuple)):
            _refuse_host_arrays(value, name)
        elif isinstance(value, np.ndarray):
            if name == "copyto":
                raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
            raise TypeError(f"Unsupported type {type(value)} (a host array in the device "
                            f"operation {name})")


#: CuPy functions that copy a host array argument to the device instead of refusing it.
_TAKE_HOST_ARRAYS = frozenset(("take", "atleast_1d", "atleast_2d", "atleast_3d", "real",
                               "imag", "unique", "histogram"))
#: ... and those that read only a host array's shape and dtype (or none at all).
_READ_HOST_TEMPLATES = frozenset(("empty_like", "zeros_like", "ones_like", "full_like",
                                  "result_type", "can_cast", "min_scalar_type", "shape",
                                  "ndim", "size", "isscalar"))


def _sized(values):
    """``values`` without 0-d host arrays (also inside lists)."""
    return [_sized(v) if isinstance(v, (list, tuple)) else v for v in values
            if not (isinstance(v, np.ndarray) and v.ndim == 0)]


#: CuPy's refusal of an implicit copy to the host (``ndarray.__array__``).
IMPLICIT_CONVERSION = ("Implicit conversion to a NumPy array is not allowed. "
                       "Please use `.get()` to construct a NumPy array explicitly.")

_installed = {"depth": 0, "lock": threading.Lock()}     # (installed() may nest)


def _basic_index(key) -> bool:
    """Whether an index is basic (integers, slices, ``...``, ``None``), not advanced."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, np.integer, slice))
               for k in keys)


class _Pointer:
    """The ``.data`` of a stand-in array: its address and an async copy to the host."""

    def __init__(self, array):
        self._array = array
        self.ptr = array._host.__array_interface__["data"][0]

    def copy_to_host_async(self, dst_ptr: int, nbytes: int, stream=None) -> None:
        import ctypes
        array, src = self._array, self.ptr       # (the array stays alive while queued)

        def copy():
            ctypes.memmove(dst_ptr, src, nbytes)
            return array
        if _deferred["on"]:
            with _deferred["lock"]:
                _deferred["queue"].append(copy)
        else:
            copy()


#: Whether device arrays hand their address out through ``__cuda_array_interface__``,
#: as CuPy's always do.  mpi4py gives that address to MPI, which can read it only when
#: built with CUDA support: a test standing for an MPI without it turns this off, so
#: that mpi4py refuses a device array (TypeError) where on a GPU the MPI would crash or
#: read device memory as host memory.  Tests change it with ``monkeypatch.setitem``.
CUDA_ARRAY_INTERFACE = {"offered": True}


def _check_parameters(name: str, params: tuple, args: tuple, kwargs: dict) -> None:
    """Refuse what CuPy's signature refuses: an unknown keyword, too many arguments."""
    for key in kwargs:
        if key not in params:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    if "*" not in params and len(args) > len(params):
        raise TypeError(f"{name}() takes at most {len(params)} positional arguments "
                        f"({len(args)} given)")


def _method(bound, name):
    """A NumPy array's method on stand-in arrays: host arrays refused (0-d ones
    taken), results wrapped, and an ``out`` handed back as it was given."""
    def call(*args, **kwargs):
        if name not in _TAKE_HOST_ARRAYS:
            _refuse_host_arrays(_sized(args + tuple(kwargs.values())), name)
        result = bound(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if isinstance(out, DeviceArray) else _wrap(result)
    call.__name__ = name
    return call


class DeviceArray(NDArrayOperatorsMixin):
    """Host memory that answers like a device array (see the module docstring).

    Not a NumPy subclass, so that NumPy asks before it takes one: ``__array__``
    refuses while installed, and there is no buffer protocol."""

    __slots__ = ("_host", "__weakref__")

    def __new__(cls, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None:
            raise NotImplementedError("the stand-in allocates its own memory")
        return cls._holding(np.ndarray(shape, dtype, strides=strides, order=order))

    @classmethod
    def _holding(cls, host: np.ndarray) -> "DeviceArray":
        array = object.__new__(cls)
        array._host = host
        return array

    def __array__(self, dtype=None, copy=None):
        if _installed["depth"]:
            raise TypeError(IMPLICIT_CONVERSION)
        # (NumPy's own conversion once uninstalled: a test looks at what it kept)
        host = self._host if dtype is None else self._host.astype(dtype, copy=False)
        return host.copy() if copy else host

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # CuPy 12 hands only a call of a ufunc it has on to CuPy (``np.add.at(device,
        # ...)`` is refused), with CuPy's keywords
        if method != "__call__" or ufunc.__name__ not in CUPY_NAMES:
            return NotImplemented
        _check_parameters(ufunc.__name__, tuple(UFUNC_KEYWORDS), (), kwargs)
        out = kwargs.get("out")
        _refuse_host_arrays(inputs + (out or ()), ufunc.__name__)
        result = getattr(ufunc, method)(*_plain(inputs),
                                        **{k: _plain(v) for k, v in kwargs.items()})
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        # CuPy's functions refuse host operands (np.dot(device, host)) and a host
        # ``out``; a few copy a host argument over (take's indices), and 0-d host
        # values are taken by some (copyto, full) and not by others: let them by.
        name = func.__name__
        namespace = CUPY_LINALG if func.__module__ == "numpy.linalg" else CUPY_NAMES
        if func.__module__ not in ("numpy", "numpy.linalg") or name not in namespace:
            return NotImplemented       # (what CuPy lacks, NumPy's __array_function__ refuses)
        if name == "copyto" and isinstance(args[0] if args else kwargs.get("dst"), np.ndarray):
            raise TypeError("copyto: a host array cannot be the destination of a device "
                            "array (use .get(out=))")
        operands = tuple(args) + tuple(v for k, v in kwargs.items() if k != "out")
        if name not in _TAKE_HOST_ARRAYS:
            _refuse_host_arrays(_sized(operands), name)
        out = kwargs.get("out")
        _refuse_host_arrays((out,), name)
        result = func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        return out if isinstance(out, DeviceArray) else _wrap(result)

    # -- what a CuPy array has -------------------------------------------------------
    @property
    def shape(self):
        return self._host.shape

    @shape.setter
    def shape(self, value):
        self._host.shape = value

    @property
    def dtype(self):
        return self._host.dtype

    @property
    def ndim(self):
        return self._host.ndim

    @property
    def size(self):
        return self._host.size

    @property
    def nbytes(self):
        return self._host.nbytes

    @property
    def itemsize(self):
        return self._host.itemsize

    @property
    def strides(self):
        return self._host.strides

    @property
    def flags(self):
        return self._host.flags

    @property
    def T(self):
        return DeviceArray._holding(self._host.T)

    @property
    def data(self):
        return _Pointer(self)

    @property
    def device(self):
        return _Device()

    @property
    def __cuda_array_interface__(self):
        # (what a CUDA-aware MPI is given: the address of the memory)
        if not CUDA_ARRAY_INTERFACE["offered"]:
            raise AttributeError("'ndarray' (stand-in device array): no "
                                 "__cuda_array_interface__ for an MPI without CUDA support")
        host = self._host
        return {"shape": host.shape, "typestr": host.dtype.str, "version": 3,
                "data": (host.__array_interface__["data"][0], False),
                "strides": None if host.flags.c_contiguous else host.strides}

    def __getattr__(self, name):
        # the rest of NumPy's array methods (reshape, sum, astype, fill...), on
        # device arrays; never its special names (``__array_interface__`` would let
        # NumPy read the memory without asking) nor what CuPy has not
        if name.startswith("_"):
            raise AttributeError(f"'ndarray' (stand-in device array) has no attribute "
                                 f"{name!r}")
        if name in ARRAY_METHODS:
            method = _method(getattr(self._host, name), name)

            def checked(*args, **kwargs):
                _check_parameters(name, ARRAY_METHODS[name], args, kwargs)
                return method(*args, **kwargs)
            checked.__name__ = name
            return checked
        if name in ARRAY_PROPERTIES:
            return _wrap(getattr(self._host, name))
        raise AttributeError(f"'ndarray' object has no attribute {name!r}")

    def astype(self, dtype, *args, copy=True, **kwargs):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return DeviceArray._holding(self._host.astype(dtype, *args, **kwargs))

    def __len__(self):
        return len(self._host)

    def __iter__(self):
        if self._host.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._host)))

    def __copy__(self):
        return DeviceArray._holding(self._host.copy())

    def __deepcopy__(self, memo):
        return DeviceArray._holding(self._host.copy())

    def __getitem__(self, key):
        plain = self._host
        found = plain[_plain(key)]
        if isinstance(found, np.generic):
            # an element is a 0-d view of the array's memory in CuPy (writes through
            # it land in the array), not NumPy's copy
            index = key if isinstance(key, tuple) else (key,)
            found = plain[_plain(index) + (Ellipsis,)]
        return DeviceArray._holding(found)

    def __setitem__(self, key, value):
        # CuPy fills a basic-indexed target from a scalar or a device array only
        # (a host array there is refused); with an advanced index it
        # copies a host value to the device.
        if _basic_index(key) and not isinstance(value, DeviceArray) and np.ndim(value):
            if isinstance(value, np.ndarray):
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            raise TypeError(f"Unsupported type {type(value)}")
        self._host[_plain(key)] = _plain(value)

    # -- implicit host reads: counted --------------------------------------------
    def __float__(self):
        READS["implicit"] += 1
        return float(self._host)

    def __int__(self):
        READS["implicit"] += 1
        return int(self._host)

    def __complex__(self):
        READS["implicit"] += 1
        return complex(self._host)

    def __bool__(self):
        READS["implicit"] += 1
        return bool(self._host)

    def item(self):
        # (CuPy's takes no index: ``a[k].item()``)
        READS["implicit"] += 1
        return self._host.item()

    def tolist(self):
        READS["implicit"] += 1
        return self._host.tolist()

    def tobytes(self, order="C"):
        READS["implicit"] += 1
        return self._host.tobytes(order)

    def __bytes__(self):
        READS["implicit"] += 1
        return bytes(self._host)

    # CuPy prints a device array by copying it to the host: a read too
    def __repr__(self):
        READS["implicit"] += 1
        return repr(self._host)

    def __str__(self):
        READS["implicit"] += 1
        return str(self._host)

    def __format__(self, spec):
        READS["implicit"] += 1
        return format(self._host, spec)

    def get(self, stream=None, out=None):
        if out is not None:
            _check_host_twin(self, out, "obtained from")
        READS["asnumpy"] += 1
        if out is None and _deferred["ump"]:
            return _ump_view(self)
        _land_copies()
        if out is None:
            return np.array(self._host)
        if _deferred["on"] and _deferred["early_get"] and _is_pinned(out):
            # CuPy 12 on a stream other than the legacy one: an async copy, not waited for
            source = np.array(self._host)

            def copy():
                out[...] = source
            with _deferred["lock"]:
                _deferred["queue"].append(copy)
            return out
        out[...] = self._host
        return out

    def set(self, array, stream=None):
        _check_host_twin(self, array, "set to")
        if not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        self._host[...] = array


def _check_host_twin(device, host, verb: str) -> None:
    """CuPy's ``get(out=host)`` and ``set(host)`` take a NumPy array of the device
    array's own dtype and shape only: nothing is cast or broadcast."""
    if not isinstance(host, np.ndarray):
        raise TypeError(f"Only numpy.ndarray can be {verb} cupy.ndarray")
    if host.dtype != device.dtype:
        raise TypeError(f"{host.dtype} array cannot be {verb} {device.dtype} array")
    if host.shape != device.shape:
        raise ValueError(f"Shape mismatch. Expected shape: {device.shape}, "
                         f"actual shape: {host.shape}")
    if not (host.flags.c_contiguous or host.flags.f_contiguous):
        raise RuntimeError(f"a non-contiguous array cannot be {verb} cupy.ndarray")


# Device-to-host copies in flight (``deferred_copies``): they land, in order, when
# the stream or an event recorded on it is waited for, as a GPU's would.
_deferred = {"on": False, "early_get": False, "ump": False, "queue": [],
             "lock": threading.Lock()}


def _land_copies() -> None:
    with _deferred["lock"]:         # (worker threads wait for copies too)
        queue = _deferred["queue"]
        while queue:
            queue.pop(0)()


def copies_in_flight() -> int:
    """How many device-to-host copies have not landed yet (``deferred_copies``)."""
    return len(_deferred["queue"])


@contextlib.contextmanager
def deferred_copies(*, early_get: bool = False):
    """Within: ``copy_to_host_async`` writes its host buffer only when the stream, an
    event recorded after it, or a blocking read waits for it, so code that reads
    (or lets go of) such a buffer too early is caught.  A host buffer given as
    ``out`` must outlive its copy, as on a GPU (pinned blocks are kept).

    ``early_get``: ``a.get(out=pinned)`` is such a copy too, as in CuPy 12 on a
    stream other than the legacy default one (its ``get`` then queues an
    asynchronous copy into page-locked memory and returns without waiting;
    CuPy 13 waits).

    Example::

        with standin_cupy.installed(), standin_cupy.deferred_copies():
            pending = backend.copy_to_host_async(x)
            standin_cupy.copies_in_flight()       # 1
            pending.result()                      # lands
    """
    _deferred["on"], _deferred["early_get"] = True, bool(early_get)
    try:
        yield
    finally:
        _deferred["on"], _deferred["early_get"] = False, False
        _land_copies()


def queue_device_work(work) -> None:
    """Within :func:`deferred_copies`: ``work()`` stands for a kernel still running;
    it runs when the stream, an event or a blocking read waits for it."""
    if not _deferred["on"]:
        raise RuntimeError("queue_device_work needs deferred_copies()")
    with _deferred["lock"]:
        _deferred["queue"].append(work)


def _ump_view(array):
    # CuPy 13+ with CUPY_ENABLE_UMP=1: get() without ``out`` hands back the device
    # memory itself as a NumPy array, without waiting for the stream.
    return array._host.view()


@contextlib.contextmanager
def unified_memory():
    """Within: ``a.get()`` and ``cupy.asnumpy(a)`` return a view of the device memory
    without waiting for queued work, as CuPy 13+ does under ``CUPY_ENABLE_UMP=1``
    on a system whose GPU can read host memory (HMM or ATS)."""
    _deferred["ump"] = True
    try:
        yield
    finally:
        _deferred["ump"] = False


class _Event:
    @property
    def done(self) -> bool:
        return not _deferred["queue"]

    def synchronize(self) -> None:
        _land_copies()


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        _land_copies()

    def record(self, event=None):
        return _Event()


def _asnumpy(array, stream=None, order="C", out=None):
    if out is not None and isinstance(array, DeviceArray):
        _check_host_twin(array, out, "obtained from")
    READS["asnumpy"] += 1
    if out is None and _deferred["ump"] and isinstance(array, DeviceArray):
        return _ump_view(array)
    _land_copies()              # a blocking read waits for the stream
    host = np.array(_plain(array), order=order)
    if out is not None:
        out[...] = host
        return out
    return host


def _get_array_module(*arrays):
    return module if any(isinstance(a, DeviceArray) for a in arrays) else np


# Pinned blocks stay allocated, as in CuPy's pinned pool (which hands a block
# let go of to the next request instead of freeing it): a copy that lands late
# writes into a live block, never into freed memory.
_pinned_blocks: list = []


def _alloc_pinned_memory(nbytes: int):
    block = bytearray(nbytes)
    _pinned_blocks.append(block)
    return block


def _is_pinned(array) -> bool:
    """Whether a host array is a view of a pinned block."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):        # (np.frombuffer's base)
        base = base.obj
    return any(base is block for block in _pinned_blocks)


_threads = threading.local()    # each host thread's current device, as CUDA keeps it


def _get_device() -> int:
    return getattr(_threads, "device", 0)


def _set_device(device_id: int) -> None:
    _threads.device = int(device_id)


#: What the stand-in device reports: its compute capability as CuPy writes it
#: (``"90"`` is 9.0; or a dict of them by device number, with ``device_count``
#: devices) and the cuBLAS version (major * 10000 + minor * 100 + patch).
#: Tests change them with ``monkeypatch.setitem``.
DEVICE = {"compute_capability": "90", "device_count": 1, "cublas_version": 120800}


class _Device:
    def __init__(self, device_id=None):
        self.id = _get_device() if device_id is None else int(device_id)

    def use(self) -> None:
        _set_device(self.id)

    def synchronize(self) -> None:
        """Every stream of the device has finished: host work always has."""

    @property
    def compute_capability(self) -> str:
        capability = DEVICE["compute_capability"]
        return capability[self.id] if isinstance(capability, dict) else capability


def _host_memory(ptr: int, count: int) -> np.ndarray:
    import ctypes
    return np.frombuffer((ctypes.c_float * count).from_address(ptr), dtype=np.float32)


def _column_major(ptr: int, rows: int, cols: int, ld: int) -> np.ndarray:
    # element (i, j) at ptr + (i + j * ld) floats
    memory = _host_memory(ptr, ld * max(cols - 1, 0) + rows)
    return np.lib.stride_tricks.as_strided(memory, shape=(rows, cols), strides=(4, 4 * ld))


def _gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta,
             c, ctype, ldc, compute_type, algo):
    """cublasGemmEx for float32 operands on host memory: ``c = alpha op(a) op(b) + beta c``
    in column-major order; alpha and beta are read now, as cuBLAS reads them."""
    if not atype == btype == ctype == 0:
        raise NotImplementedError("the stand-in cuBLAS multiplies float32 operands only")
    alpha_value, beta_value = _host_memory(alpha, 1)[0], _host_memory(beta, 1)[0]
    left = _column_major(a, k, m, lda).T if transa else _column_major(a, m, k, lda)
    right = _column_major(b, n, k, ldb).T if transb else _column_major(b, k, n, ldb)
    out = _column_major(c, m, n, ldc)
    product = alpha_value * (left.astype(np.float64) @ right)
    out[...] = product if beta_value == 0 else product + beta_value * out
    CUBLAS_CALLS.append({"alpha": float(alpha_value), "beta": float(beta_value)})


#: gemmEx calls of the stand-in cuBLAS: the alpha and beta each read.
CUBLAS_CALLS: list = []


def _build_cublas():
    return types.SimpleNamespace(
        getVersion=lambda handle: DEVICE["cublas_version"], gemmEx=_gemm_ex,
        setPointerMode=lambda handle, mode: None,
        CUBLAS_POINTER_MODE_HOST=0, CUBLAS_POINTER_MODE_DEVICE=1)


def _device_function(function, name):
    """A NumPy function as CuPy's: host arrays refused (but where CuPy copies or only
    reads them), results on the device, an ``out`` handed back as it was given."""
    def wrapped(*args, **kwargs):
        if name in FUNCTION_PARAMETERS:
            _check_parameters(name, FUNCTION_PARAMETERS[name], args, kwargs)
        if name not in _TAKE_HOST_ARRAYS | _READ_HOST_TEMPLATES:
            # cupy.concatenate([device, host]), cupy.ascontiguousarray(host)...
            _refuse_host_arrays(_sized(args + tuple(kwargs.values())), name)
        result = function(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if isinstance(out, DeviceArray) else _wrap(result)
    wrapped.__name__ = name
    return wrapped


class _Ufunc:
    """A CuPy ufunc: CuPy's call keywords, and its methods where CuPy has them."""

    def __init__(self, name):
        self._numpy = getattr(np, name)
        self.__name__ = self._numpy.__name__
        self.name = "cupy_" + self._numpy.__name__
        self.nin, self.nout, self.nargs = self._numpy.nin, self._numpy.nout, self._numpy.nargs

    def __repr__(self):
        return f"<ufunc '{self.name}'>"

    def __call__(self, *args, **kwargs):
        if set(kwargs) - UFUNC_KEYWORDS:
            raise TypeError(f"Wrong arguments {sorted(kwargs)}")
        _refuse_host_arrays(args, self.__name__)
        # (NumPy would write a host out, 0-d too, and the code pass here, not on a GPU)
        outs = kwargs.get("out")
        if outs is not None and not all(isinstance(out, DeviceArray) for out in
                                        (outs if isinstance(outs, tuple) else (outs,))):
            raise TypeError("Output arguments type must be cupy.ndarray")
        result = self._numpy(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if isinstance(out, DeviceArray) else _wrap(result)

    def _supported(self, method):
        if self.__name__ not in UFUNC_METHODS[method]:
            raise NotImplementedError(f"`{self.name}.{method}` is not supported yet")

    def outer(self, a, b, **kwargs):
        # (CuPy copies host operands over for outer)
        a = a if isinstance(a, DeviceArray) else module.array(a)
        b = b if isinstance(b, DeviceArray) else module.array(b)
        return self(a.reshape(a.shape + (1,) * b.ndim), b.reshape((1,) * a.ndim + b.shape),
                    **kwargs)

    def at(self, a, indices, b=None):
        self._supported("at")
        if not isinstance(a, DeviceArray):
            raise AttributeError(f"'{type(a).__name__}' object has no attribute '_scatter_op'")
        _refuse_host_arrays((b,), self.name + ".at")
        self._numpy.at(a._host, _plain(indices), _plain(b))

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        self._supported("reduce")
        method = "sum" if self.__name__ == "add" else "prod"
        # (by keyword: the array method hands back a given out only so)
        return getattr(array, method)(axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        self._supported("accumulate")
        method = "cumsum" if self.__name__ == "add" else "cumprod"
        return getattr(array, method)(axis=axis, dtype=dtype, out=out)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        self._supported("reduceat")
        _refuse_host_arrays((array, out), self.name + ".reduceat")
        result = self._numpy.reduceat(_plain(array), _plain(indices), axis, dtype, _plain(out))
        return out if isinstance(out, DeviceArray) else _wrap(result)


def _namespace(source, names, owner: str):
    """``names`` of ``source`` as device functions; any other name refused as CuPy
    refuses it (``owner``: "module 'cupy.linalg'", "'Generator' object")."""
    namespace = types.ModuleType(owner)

    def _getattr(name):
        if name not in names:
            raise AttributeError(f"{owner} has no attribute {name!r}")
        value = getattr(source, name)
        return value if isinstance(value, type) else _device_function(value, name)
    namespace.__getattr__ = _getattr
    return namespace


def _build_random():
    """``cupy.random``: its functions, ``RandomState`` and ``default_rng`` giving
    device arrays, each with only CuPy's methods."""
    random = _namespace(np.random, CUPY_RANDOM, "module 'cupy.random'")
    random.RandomState = lambda seed=None: _namespace(
        np.random.RandomState(seed), CUPY_RANDOM, "'RandomState' object")
    random.default_rng = lambda seed=None: _namespace(
        np.random.default_rng(seed), CUPY_GENERATOR, "'Generator' object")
    return random


def _build_module():
    mod = types.ModuleType("standin_cupy_device")
    mod.ndarray = DeviceArray
    mod.asnumpy = _asnumpy
    mod.get_array_module = _get_array_module
    mod.__version__ = "stand-in"
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: DEVICE["device_count"], getDevice=_get_device, setDevice=_set_device,
        getDeviceProperties=lambda i: {"name": b"stand-in device"},
        driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 0)
    mod.cuda = types.SimpleNamespace(
        is_available=lambda: True, runtime=runtime, Device=_Device,
        get_current_stream=lambda: _Stream(), alloc_pinned_memory=_alloc_pinned_memory,
        Event=_Event, cublas=_build_cublas(), get_cublas_handle=lambda: 1,
        device=types.SimpleNamespace(get_cublas_handle=lambda: 1))

    mod.ufunc = _Ufunc
    mod.linalg = _namespace(np.linalg, CUPY_LINALG, "module 'cupy.linalg'")
    mod.random = _build_random()

    def _getattr(name):
        if name not in CUPY_NAMES:
            raise AttributeError(f"module 'cupy' has no attribute {name!r}")
        value = getattr(np, name)
        if name in CUPY_UFUNCS:
            return _Ufunc(name)
        if callable(value) and not isinstance(value, type):
            return _device_function(value, name)
        return value

    def _copying(name, default_copy):
        # CuPy copies host data to the device; a view would alias host memory.  A
        # device array is copied only when asked (array's default) or when its
        # dtype changes; copy=False refuses a change of dtype (CuPy 14, as NumPy 2).
        def make(obj, dtype=None, *, copy=default_copy, **kwargs):
            if isinstance(obj, DeviceArray):
                same = dtype is None or np.dtype(dtype) == obj.dtype
                if copy is False and not same:
                    raise ValueError("Unable to avoid copy while creating an array "
                                     "as requested.")
                if not copy and same:
                    return obj
            return DeviceArray._holding(np.array(_plain(obj), dtype=dtype, copy=True))
        make.__name__ = name
        return make

    mod.asarray = _copying("asarray", None)
    mod.array = _copying("array", True)
    mod.asanyarray = _copying("asanyarray", None)
    mod.__getattr__ = _getattr
    return mod


module = _build_module()


@contextlib.contextmanager
def installed():
    """Make the stand-in the backend's CuPy (``backend.select('gpu')`` returns it),
    and NumPy's conversions (``np.asarray``...) refuse its arrays, as CuPy's."""
    from mpitrain import backend
    saved = backend._cupy
    backend._cupy = module
    sys.modules.setdefault("standin_cupy_device", module)
    reset_counts()
    CUBLAS_CALLS.clear()
    with _installed["lock"]:
        _installed["depth"] += 1
    try:
        yield module
    finally:
        with _installed["lock"]:
            _installed["depth"] -= 1
        backend._cupy = saved
        _land_copies()
        _pinned_blocks.clear()
