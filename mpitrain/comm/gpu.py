"""How device (cupy) buffers reach MPI: NCCL, CUDA-aware MPI or pinned host staging.

The choice is made once, collectively, by :func:`choose_device_transport`:
NCCL when ``cupy.cuda.nccl`` works on every rank, else CUDA-aware MPI when the
library says so and a small device Allreduce proves it, else copies through
reusable pinned host buffers.  NCCL serves the buffer collectives; point to
point calls always use an MPI path.  The GPU stream is synchronised before any
MPI call sees a device buffer (unsynchronised buffers give random results).

cupy itself comes from :mod:`mpitrain.backend`; this module never imports it.

Example::

    choice = choose_device_transport(mpi_comm, cupy, prefer="auto")
    choice.name        # 'nccl', 'cuda-aware-mpi' or 'host-staged'
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .. import backend

PREFERENCES = ("auto", "nccl", "cuda-aware-mpi", "host-staged")

#: "1" forces the CUDA-aware probe even when the library cannot be queried,
#: "0" skips it (staging is then used unless NCCL is available).
CUDA_AWARE_ENV = "MPITRAIN_CUDA_AWARE_MPI"

NCCL_UNIQUE_ID_BYTES = 128


# ------------------------------------------------------------------ MPI paths

class HostPath:
    """Host arrays go to MPI as they are."""

    name = "host"

    def enter(self, buf, *, copy_in: bool):
        return buf, None

    def leave(self, buf, token, *, copy_out: bool) -> None:
        return None


class CudaAwarePath:
    """Device arrays go to MPI directly, after the stream has finished writing them."""

    name = "cuda-aware-mpi"

    def enter(self, buf, *, copy_in: bool):
        backend.synchronize(backend.get_array_module(buf))
        return buf, None

    def leave(self, buf, token, *, copy_out: bool) -> None:
        return None


class PinnedStagingPath:
    """Device arrays are copied through pinned host buffers that are reused.

    Several buffers may be in flight at once (non-blocking calls), so the
    staging memory is a small free list rather than one buffer.
    """

    name = "host-staged"

    def __init__(self, cupy):
        self._cupy = cupy
        self._free: list[np.ndarray] = []

    def _take(self, nbytes: int) -> np.ndarray:
        fitting = [i for i, block in enumerate(self._free) if block.nbytes >= nbytes]
        if fitting:
            # By position: list.remove would compare arrays element-wise.
            return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))
        memory = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(memory, dtype=np.uint8, count=max(nbytes, 1))

    def enter(self, buf, *, copy_in: bool):
        block = self._take(buf.nbytes)
        host = block[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
        if copy_in:
            backend.synchronize(self._cupy)
            buf.get(out=host)  # blocking copy: host holds the data afterwards
        return host, block

    def leave(self, buf, token, *, copy_out: bool) -> None:
        if copy_out:
            host = token[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
            buf.set(host)
            # The block goes back to the free list: the copy must be over first.
            backend.synchronize(self._cupy)
        self._free.append(token)


HOST_PATH = HostPath()


# ----------------------------------------------------------------------- NCCL

def _load_nccl(cupy):
    """cupy's NCCL binding, or None when this CuPy build or machine has none."""
    from .. import backend
    return backend.nccl_module(cupy)


class NcclCollectives:
    """allreduce/bcast of device buffers with NCCL on the current stream.

    Calls block until the stream has finished them, like the MPI paths, so
    ``comm_time`` measures real communication.
    """

    name = "nccl"

    def __init__(self, nccl, nccl_comm, cupy):
        self._nccl = nccl
        self._comm = nccl_comm
        self._cupy = cupy
        self._ops = {"sum": nccl.NCCL_SUM, "mean": nccl.NCCL_SUM,
                     "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        self._dtypes = {np.dtype(np.float16): nccl.NCCL_FLOAT16,
                        np.dtype(np.float32): nccl.NCCL_FLOAT32,
                        np.dtype(np.float64): nccl.NCCL_FLOAT64,
                        np.dtype(np.int32): nccl.NCCL_INT32,
                        np.dtype(np.int64): nccl.NCCL_INT64}

    def _dtype(self, buf):
        try:
            return self._dtypes[np.dtype(buf.dtype)]
        except KeyError:
            raise ValueError(f"nccl: unsupported dtype {buf.dtype}; expected one of "
                             f"{sorted(str(d) for d in self._dtypes)}") from None

    def _launch_allreduce(self, buf, op: str):
        stream = self._cupy.cuda.get_current_stream()
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf),
                             self._ops[op], stream.ptr)
        return stream

    def allreduce_(self, buf, op: str) -> None:
        self._launch_allreduce(buf, op).synchronize()

    def iallreduce_(self, buf, op: str) -> tuple[Callable[[], bool], Callable[[], None]]:
        event = self._launch_allreduce(buf, op).record()
        return (lambda: event.done), event.synchronize

    def bcast_(self, buf, root: int) -> None:
        stream = self._cupy.cuda.get_current_stream()
        self._comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, stream.ptr)
        stream.synchronize()

    def destroy(self) -> None:
        self._comm.destroy()


def _all_agree(mpi_comm, flag: bool) -> bool:
    value = np.array([1 if flag else 0], dtype=np.int64)
    mpi_comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
    return bool(value[0])


def create_nccl(mpi_comm, cupy) -> Optional[NcclCollectives]:
    """Collective: an NCCL communicator over ``mpi_comm``'s ranks, or None on any rank failing."""
    nccl = _load_nccl(cupy)
    if not _all_agree(mpi_comm, nccl is not None):
        return None
    # The unique id is 128 signed chars; send them as int64 so no pickle is needed.
    uid = np.zeros(NCCL_UNIQUE_ID_BYTES, dtype=np.int64)
    if mpi_comm.Get_rank() == 0:
        uid[:] = nccl.get_unique_id()
    mpi_comm.Bcast(uid, root=0)
    try:
        nccl_comm = nccl.NcclCommunicator(mpi_comm.Get_size(), tuple(int(x) for x in uid),
                                          mpi_comm.Get_rank())
        ok = True
    except Exception:
        nccl_comm, ok = None, False
    if not _all_agree(mpi_comm, ok):
        if nccl_comm is not None:
            nccl_comm.destroy()
        return None
    return NcclCollectives(nccl, nccl_comm, cupy)


# ------------------------------------------------------------- CUDA-aware MPI

def query_cuda_support() -> Optional[bool]:
    """What the MPI library says about device pointers; None when it cannot say."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            pass
    try:
        # MPICH and Open MPI both export MPIX_Query_cuda_support from libmpi.
        function = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return bool(function())


def probe_cuda_aware_mpi(mpi_comm, cupy) -> bool:
    """Collective: True when every rank can Allreduce a device buffer correctly.

    The device Allreduce is only tried when the library claims support (or
    MPITRAIN_CUDA_AWARE_MPI=1): handing a device pointer to an MPI without it
    can crash instead of raising.
    """
    setting = os.environ.get(CUDA_AWARE_ENV, "").strip()
    claimed = {"1": True, "0": False}.get(setting)
    if claimed is None:
        claimed = bool(query_cuda_support())
    if not _all_agree(mpi_comm, claimed):
        return False
    size = mpi_comm.Get_size()
    ok = False
    try:
        probe = cupy.full(4, mpi_comm.Get_rank() + 1, dtype=cupy.float32)
        backend.synchronize(cupy)
        mpi_comm.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM)
        ok = bool(np.all(cupy.asnumpy(probe) == size * (size + 1) / 2))
    except Exception:
        ok = False
    return _all_agree(mpi_comm, ok)


# ------------------------------------------------------------------- choosing

@dataclass
class DeviceTransport:
    """The device route chosen for one communicator: ``path`` for MPI calls,
    ``nccl`` (or None) for the buffer collectives."""

    path: object
    nccl: Optional[NcclCollectives] = None

    @property
    def name(self) -> str:
        return self.nccl.name if self.nccl is not None else self.path.name

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None


def choose_device_transport(mpi_comm, cupy, *, prefer: str = "auto") -> DeviceTransport:
    """Collective: pick the fastest device route every rank supports.

    ``prefer`` forces one route ('nccl', 'cuda-aware-mpi', 'host-staged');
    a forced route that does not work raises RuntimeError on every rank.

    Example::

        transport = choose_device_transport(MPI.COMM_WORLD, cupy)
    """
    if prefer not in PREFERENCES:
        raise ValueError(f"device transport: expected one of {', '.join(PREFERENCES)}, "
                         f"got {prefer!r}")
    if prefer == "host-staged":
        return DeviceTransport(PinnedStagingPath(cupy))
    nccl = create_nccl(mpi_comm, cupy) if prefer in ("auto", "nccl") else None
    if prefer == "nccl" and nccl is None:
        raise RuntimeError("device transport 'nccl' was requested but cupy.cuda.nccl "
                           "is unavailable or failed to initialise on some rank")
    aware = probe_cuda_aware_mpi(mpi_comm, cupy)
    if prefer == "cuda-aware-mpi" and not aware:
        raise RuntimeError("device transport 'cuda-aware-mpi' was requested but the MPI "
                           f"library does not pass device buffers correctly (set "
                           f"{CUDA_AWARE_ENV}=1 to probe a library that cannot be queried)")
    path = CudaAwarePath() if aware else PinnedStagingPath(cupy)
    return DeviceTransport(path, nccl)
