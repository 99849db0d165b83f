"""The CuPy stand-in for MPI workers without a GPU, with a stand-in NCCL binding.

Built on :mod:`mpitrain.testing.standin_cupy`: its device arrays (no NumPy
subclass: NumPy, h5py and the buffer protocol refuse them as they refuse
CuPy's) and its array functions.  What the workers need beyond it is here:
the rank's device (id, PCI bus id), counts of pinned allocations, stream
synchronisations and ``get``/``set`` copies, whether the MPI library takes
device memory (:func:`set_cuda_aware_mpi`), and the NCCL stand-in.

:func:`install` registers a package (``fake_device_module``, with ``.cuda``
and optionally ``.cuda.nccl``) in ``sys.modules`` and makes it
mpitrain.backend's cupy, so ``backend.nccl_module`` finds the NCCL stand-in
by import like the real one; the stand-in stays installed until the worker
exits.  The MPI library of these workers has no CUDA support, so by default
mpi4py refuses a device array (no ``__cuda_array_interface__``): a route that
hands one to MPI without staging it fails here as it would crash on a GPU.
:func:`set_cuda_aware_mpi` stands for a CUDA-aware MPI; the worker also sets
``MPITRAIN_CUDA_AWARE_MPI=1``, since MPICH here says it has no CUDA support.

The NCCL stand-in (:func:`make_nccl`) mimics one CuPy API variant at a time
and really reduces the data: through MPI on the host memory behind the
arrays' ``.data.ptr``.  Its ``NcclCommunicator`` blocks like NCCL's init
until every rank joined with the same unique id (a rendezvous through files
named after the id), so a rank that never joins leaves the others waiting,
as NCCL would.

Example::

    nccl = make_nccl(id_form="bytes", accepts="bytes", rendezvous_dir=tmp)
    fake = install(device_id=rank, nccl=nccl)
    buf = device([1.0, 2.0])            # counted get/set
    fake.asnumpy(buf)                   # its values, for a check
"""

import contextlib
import ctypes
import hashlib
import os
import sys
import time
import types

import numpy as np
from mpi4py import MPI

from mpitrain import backend
from mpitrain.testing import standin_cupy

NAME = "fake_device_module"

counts = {"get": 0, "set": 0, "sync": 0, "pinned": 0,
          "nccl_init": 0, "nccl_allreduce": 0, "nccl_bcast": 0, "nccl_destroy": 0}

# The stand-in NCCL's own channel between the ranks (created on every rank at import).
_NCCL_WORLD = MPI.COMM_WORLD.Dup()

# standin_cupy.installed(), entered by the first install() for the worker's lifetime
_STANDIN, _STANDIN_ENTERED = contextlib.ExitStack(), []


class CountedDeviceArray(standin_cupy.DeviceArray):
    """The stand-in's device array, its copies to and from the host counted."""

    __slots__ = ()

    def get(self, stream=None, out=None):
        counts["get"] += 1
        return super().get(stream=stream, out=out)

    def set(self, array, stream=None):
        counts["set"] += 1
        super().set(array, stream=stream)


def device(values, dtype=np.float32):
    """A device array holding ``values`` (its get/set counted)."""
    return CountedDeviceArray._holding(np.array(values, dtype=dtype))


def set_cuda_aware_mpi(aware: bool) -> None:
    """Whether MPI takes device memory: mpi4py then reads a device array's
    ``__cuda_array_interface__``; without, it refuses the array (TypeError)."""
    standin_cupy.CUDA_ARRAY_INTERFACE["offered"] = bool(aware)


def _pinned(nbytes):
    counts["pinned"] += 1
    return standin_cupy.module.cuda.alloc_pinned_memory(nbytes)


class _Stream:
    """The stand-in's current stream, its synchronisations counted."""

    ptr = 0

    def synchronize(self):
        counts["sync"] += 1
        standin_cupy.module.cuda.get_current_stream().synchronize()

    def record(self, event=None):
        return standin_cupy.module.cuda.get_current_stream().record()


_STREAM = _Stream()


def _device_class(device_id: int, pci_bus_id):
    class Device:
        """cupy.cuda.Device: ``Device()`` is the current one, ``Device(n).use()`` selects."""

        def __init__(self, device=None):
            self.id = device_id if device is None else int(device)

        @property
        def pci_bus_id(self):
            if pci_bus_id is None:
                raise AttributeError("pci_bus_id")   # an older CuPy
            return pci_bus_id

        def use(self):
            if self.id != device_id:
                raise RuntimeError(f"fake device: rank uses device {device_id}, "
                                   f"asked for {self.id}")

    return Device


def install(*, device_id: int = 0, pci_bus_id=None, nccl=None, cuda_aware_mpi: bool = False):
    """Register the stand-in cupy (and ``nccl`` as its ``cuda.nccl``) and hand it to backend."""
    if not _STANDIN_ENTERED:
        _STANDIN.enter_context(standin_cupy.installed())
        _STANDIN_ENTERED.append(True)
    set_cuda_aware_mpi(cuda_aware_mpi)
    fake = types.ModuleType(NAME)
    fake.__path__ = []          # a package: importlib looks for its submodules
    fake.__getattr__ = lambda name: getattr(standin_cupy.module, name)
    fake.ndarray = standin_cupy.DeviceArray
    fake.asnumpy = standin_cupy.module.asnumpy
    # this module, not the stand-in's: backend.synchronize(xp) waits only for its cupy
    fake.get_array_module = lambda *arrays: (
        fake if any(isinstance(a, standin_cupy.DeviceArray) for a in arrays) else np)
    cuda = types.ModuleType(NAME + ".cuda")
    cuda.__path__ = []
    cuda.__getattr__ = lambda name: getattr(standin_cupy.module.cuda, name)
    cuda.alloc_pinned_memory = _pinned
    cuda.get_current_stream = lambda: _STREAM
    cuda.Device = _device_class(device_id, pci_bus_id)
    fake.cuda = cuda
    sys.modules[NAME] = fake
    sys.modules[NAME + ".cuda"] = cuda
    sys.modules.pop(NAME + ".cuda.nccl", None)
    if nccl is not None:
        cuda.nccl = nccl
        sys.modules[NAME + ".cuda.nccl"] = nccl
    backend._cupy = fake
    return fake


# ----------------------------------------------------------------------- NCCL

_OPS = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}
_DTYPES = {2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32, 8: np.float64}


def _host_array(ptr: int, count: int, dtype) -> np.ndarray:
    """The memory at ``ptr`` as a writable array (the fake device memory is host memory)."""
    dtype = np.dtype(dtype)
    memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(memory, dtype=dtype, count=count)


def _raw_id(commId, accepts: str) -> bytes:
    """The 128 bytes of ``commId``, converted the way that CuPy variant's Cython would."""
    if accepts == "bytes":
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, "
                            f"got {type(commId).__name__})")
        raw = commId
    else:
        if not isinstance(commId, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, "
                            f"got {type(commId).__name__})")
        low, high = (-128, 127) if accepts == "signed-tuple" else (0, 255)
        for value in commId:
            if not low <= value <= high:
                raise OverflowError(f"value {value} out of range for "
                                    f"{'char' if low < 0 else 'unsigned char'}")
        raw = bytes(value & 0xFF for value in commId)
    assert len(raw) == 128, len(raw)
    return raw


def make_nccl(*, id_form: str, accepts: str, rendezvous_dir: str, available: bool = True,
              fail_init: bool = False, hang_init: bool = False, fail_unique_id: bool = False):
    """An NCCL binding stand-in for one CuPy API variant.

    ``id_form``: what ``get_unique_id`` returns ('bytes', 'signed-tuple',
    'unsigned-tuple'); ``accepts``: the only form ``NcclCommunicator`` takes;
    ``fail_init``/``hang_init``: this rank's init raises / never returns.
    """
    nccl = types.ModuleType(NAME + ".cuda.nccl")
    nccl.available = available
    nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN = 0, 1, 2, 3
    nccl.NCCL_INT32, nccl.NCCL_INT64 = 2, 4
    nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64 = 6, 7, 8

    def get_unique_id():
        if fail_unique_id:
            raise RuntimeError("NCCL error: unhandled system error (injected)")
        # Both a byte above 127 and one below: a signedness slip changes the id.
        raw = b"\xff\x01" + os.urandom(126)
        if id_form == "bytes":
            return raw
        if id_form == "signed-tuple":
            return tuple(value - 256 if value > 127 else value for value in raw)
        return tuple(raw)

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):
            counts["nccl_init"] += 1
            raw = _raw_id(commId, accepts)
            if fail_init:
                raise RuntimeError("NCCL error: invalid usage (injected on this rank)")
            while hang_init:
                time.sleep(0.05)
            assert ndev == _NCCL_WORLD.Get_size() and rank == _NCCL_WORLD.Get_rank()
            # Block until all ranks joined with these very bytes, like ncclCommInitRank.
            meeting = os.path.join(rendezvous_dir, hashlib.sha1(raw).hexdigest())
            os.makedirs(meeting, exist_ok=True)
            open(os.path.join(meeting, f"rank{rank}"), "w").close()
            while len(os.listdir(meeting)) < ndev:
                time.sleep(0.005)
            self.destroyed = False

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            assert not self.destroyed
            counts["nccl_allreduce"] += 1
            recv = _host_array(recvbuf, count, _DTYPES[datatype])
            send = MPI.IN_PLACE if sendbuf == recvbuf else \
                _host_array(sendbuf, count, _DTYPES[datatype])
            _NCCL_WORLD.Allreduce(send, recv, op=_OPS[op])

        def bcast(self, buff, count, datatype, root, stream):
            assert not self.destroyed
            counts["nccl_bcast"] += 1
            _NCCL_WORLD.Bcast(_host_array(buff, count, _DTYPES[datatype]), root=root)

        def destroy(self):
            if not self.destroyed:
                counts["nccl_destroy"] += 1
            self.destroyed = True

        abort = destroy

    nccl.get_unique_id = get_unique_id
    nccl.NcclCommunicator = NcclCommunicator
    return nccl
