"""The one place that chooses between NumPy and CuPy.

Everything else either receives an array module ``xp`` from here or asks for
the module of an array it already holds with :func:`get_array_module`.

Example::

    xp = backend.select("cpu")          # numpy
    x = xp.zeros(4, dtype=xp.float32)
    backend.get_array_module(x) is xp   # True
"""

from __future__ import annotations

import os
import numpy as np

_cupy = None


class DeviceError(RuntimeError):
    """Raised when a GPU was asked for but cannot be used."""


def _import_cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as exc:
            raise DeviceError(
                "device: gpu needs CuPy; install it with "
                "`pip install cupy-cuda12x` (or the build matching your CUDA)") from exc
        _cupy = cupy
    return _cupy


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    try:
        cupy = _import_cupy()
        # is_available() is the reliable probe: the import succeeds without a GPU.
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def select(device: str = "cpu", local_rank: int = 0):
    """Return the array module for ``device`` ('cpu' or 'gpu').

    For 'gpu' the CUDA device ``local_rank % device_count`` becomes current,
    so one process per GPU needs no further setup.
    """
    if device == "cpu":
        return np
    if device != "gpu":
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
    cupy = _import_cupy()
    if not cupy.cuda.is_available():
        raise DeviceError("device: gpu was requested but CuPy finds no CUDA device "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    count = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(local_rank % count).use()
    return cupy


def nccl_module(cupy=None):
    """CuPy's NCCL binding, or None when this CuPy build or machine has none.

    ``cupy`` may be a stand-in module (tests); by default the real CuPy.
    """
    try:
        import importlib
        cupy = cupy or _import_cupy()
        nccl = importlib.import_module(cupy.__name__ + ".cuda.nccl")
    except Exception:
        return None
    return nccl if getattr(nccl, "available", False) else None


def get_array_module(*arrays):
    """numpy or cupy, whichever owns the arrays (numpy when CuPy is absent)."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def is_gpu_array(array) -> bool:
    return _cupy is not None and isinstance(array, _cupy.ndarray)


def to_host(array) -> np.ndarray:
    """A NumPy copy (or the array itself when it already lives on the host)."""
    if is_gpu_array(array):
        return _cupy.asnumpy(array)
    return np.asarray(array)


def to_device(array, xp):
    """Move a host array onto the device of ``xp`` (no copy for numpy)."""
    if xp is np:
        return np.asarray(array)
    return xp.asarray(array)


def synchronize(xp=None) -> None:
    """Wait for queued GPU work; a no-op on the CPU.

    Called before any MPI call touches a device buffer.
    """
    if _cupy is not None and (xp is None or xp is _cupy):
        _cupy.cuda.get_current_stream().synchronize()


def device_name(xp) -> str:
    if xp is np:
        return "cpu"
    props = _cupy.cuda.runtime.getDeviceProperties(_cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def set_blas_threads(n: int) -> None:
    """Ask the BLAS for ``n`` threads; effective only before numpy's BLAS starts.

    The CLI calls this from ``__main__`` before importing numpy-heavy modules.
    """
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
