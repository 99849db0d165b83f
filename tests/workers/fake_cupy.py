"""A stand-in for cupy and its NCCL binding, on host memory, for MPI workers without a GPU.

:func:`install` registers a fake package (``fake_device_module``, with
``.cuda`` and optionally ``.cuda.nccl``) in ``sys.modules`` and makes it
mpitrain.backend's cupy, so ``backend.nccl_module`` finds the NCCL stand-in
by import like the real one.  Device arrays are a numpy subclass that must
be copied with ``get``/``set`` and exposes ``.data.ptr``; the NCCL stand-in
(:func:`make_nccl`) mimics one CuPy API variant at a time and really reduces
the data: through MPI on the host memory behind those pointers.

Its ``NcclCommunicator`` blocks like NCCL's init until every rank joined
with the same unique id (a rendezvous through files named after the id), so
a rank that never joins leaves the others waiting, as NCCL would.

Example::

    nccl = make_nccl(id_form="bytes", accepts="bytes", rendezvous_dir=tmp)
    fake = install(device_id=rank, nccl=nccl)
"""

import ctypes
import hashlib
import os
import sys
import time
import types

import numpy as np
from mpi4py import MPI

from mpitrain import backend

NAME = "fake_device_module"

counts = {"get": 0, "set": 0, "sync": 0, "pinned": 0,
          "nccl_init": 0, "nccl_allreduce": 0, "nccl_bcast": 0, "nccl_destroy": 0}

# The stand-in NCCL's own channel between the ranks (created on every rank at import).
_NCCL_WORLD = MPI.COMM_WORLD.Dup()


class FakeDeviceArray(np.ndarray):
    """Host memory that must be copied with get/set, like a cupy array."""

    def get(self, out=None):
        counts["get"] += 1
        out[...] = self.view(np.ndarray)
        return out

    def set(self, array):
        counts["set"] += 1
        self.view(np.ndarray)[...] = array

    @property
    def data(self):
        # cupy's ``a.data.ptr``: the address NCCL reads and writes.
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def device(values, dtype=np.float32):
    """A fake device array holding ``values``."""
    return np.asarray(values, dtype=dtype).copy().view(FakeDeviceArray)


def _pinned(nbytes):
    counts["pinned"] += 1
    return bytearray(nbytes)


class _Event:
    done = True

    def synchronize(self):
        return None


class _Stream:
    ptr = 0

    def synchronize(self):
        counts["sync"] += 1

    def record(self):
        return _Event()


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


def install(*, device_id: int = 0, pci_bus_id=None, nccl=None):
    """Register the fake cupy (and ``nccl`` as its ``cuda.nccl``) and hand it to backend."""
    fake = types.ModuleType(NAME)
    fake.__path__ = []          # a package: importlib looks for its submodules
    fake.ndarray = FakeDeviceArray
    fake.float32 = np.float32
    fake.full = lambda *a, **k: np.full(*a, **k).view(FakeDeviceArray)
    fake.asnumpy = lambda a: np.array(a.view(np.ndarray))
    fake.get_array_module = lambda *arrays: (
        fake if any(isinstance(a, FakeDeviceArray) for a in arrays) else np)
    cuda = types.ModuleType(NAME + ".cuda")
    cuda.__path__ = []
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
