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
from typing import Optional

import numpy as np

_cupy = None


class DeviceError(RuntimeError):
    """Raised when a GPU was asked for but cannot be used."""


class UnsupportedSetting(DeviceError):
    """A setting that the selected GPU cannot run (every rank with such a GPU
    raises it alike)."""


def _import_cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as exc:
            raise DeviceError(
                "device: gpu needs CuPy; install it with "
                "`pip install cupy-cuda12x` for CUDA 12, `cupy-cuda13x` for CUDA 13") from exc
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

    For 'gpu' the CUDA device ``local_rank % device_count`` becomes current
    (callers pass ``comm.device_rank``: the rank among those seeing these GPUs),
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


def select_for_run(device: str, device_rank: int, *, precision: str, fused_kernels: bool):
    """:func:`select` the device of a training run, with the run's matrix-product
    precision and fused kernels (a process may have set others before); raises
    :class:`DeviceError` where they cannot be had."""
    xp = select(device, device_rank)
    set_fused_kernels(fused_kernels)
    set_precision(xp, precision)
    return xp


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


# -- reading device memory from the host -------------------------------------------
# Every device-to-host read goes through to_host (it waits for the GPU) or
# copy_to_host_async (it does not); both are counted so that tests can prove a
# training step never stalls on the host.
_host_reads = {"blocking": 0, "async": 0}


def host_read_counts() -> dict:
    """How many device arrays were read so far: ``{"blocking": n, "async": m}``.

    Example::

        before = host_read_counts()["blocking"]
        to_host(device_array)
        host_read_counts()["blocking"] - before    # 1
    """
    return dict(_host_reads)


def to_host(array) -> np.ndarray:
    """A NumPy copy (or the array itself when it already lives on the host).

    For a device array this waits for the GPU: the one blocking read.
    """
    if is_gpu_array(array):
        _host_reads["blocking"] += 1
        host = _cupy.asnumpy(array)
        if not host.flags.owndata:
            # CuPy 13+ with CUPY_ENABLE_UMP=1 hands back the device memory itself,
            # without waiting for the stream: wait, and copy it (later device work
            # would change it under the caller)
            _cupy.cuda.get_current_stream().synchronize()
            host = host.copy()
        return host
    return np.asarray(array)


class HostCopy:
    """A device-to-host copy in flight; :meth:`result` waits for it only.

    Waiting on its event leaves the GPU running whatever was queued after it.
    """

    def __init__(self, host, event=None):
        self._host, self._event = host, event

    def result(self) -> np.ndarray:
        event = self._event         # one local name: two threads may wait at once
        if event is not None:
            event.synchronize()
            self._event = None
        return self._host


def thread_setup(xp):
    """A function for a new host thread to run first, so that it uses this
    thread's GPU: a worker that waits on this GPU's events must not start a
    context on device 0 of a node whose rank uses another.  Nothing on the host.

    Example::

        pool = ThreadPoolExecutor(2, initializer=thread_setup(xp))
    """
    if xp is np or xp is not _cupy:
        return lambda: None
    device_id = _cupy.cuda.runtime.getDevice()
    return lambda: _cupy.cuda.runtime.setDevice(device_id)


def pinned_empty(shape, dtype) -> np.ndarray:
    """A host array in page-locked memory (plain host memory without CuPy)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if _cupy is None:
        return np.empty(shape, dtype=dtype)
    memory = _cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


def copy_to_host_async(array, out=None) -> HostCopy:
    """Start copying a contiguous array to the host; returns a :class:`HostCopy`.

    ``out`` (pinned, from :func:`pinned_empty`) is reused when given.  On the
    host the copy is immediate.

    Example::

        pending = copy_to_host_async(gram)        # queued behind the GEMM that wrote it
        ...                                       # more GPU work is queued meanwhile
        gram_host = pending.result()
    """
    if not is_gpu_array(array):
        host = np.array(array) if out is None else out
        if out is not None:
            out[...] = array
        return HostCopy(host)
    _host_reads["async"] += 1
    if not array.flags.c_contiguous:
        array = _cupy.ascontiguousarray(array)
    host = pinned_empty(array.shape, array.dtype) if out is None else out
    stream = _cupy.cuda.get_current_stream()
    array.data.copy_to_host_async(host.ctypes.data, array.nbytes, stream)
    return HostCopy(host, stream.record())


def to_device(array, xp):
    """Move a host array onto the device of ``xp`` (no copy for numpy).

    CuPy stages host arrays through pinned memory, so this does not wait for
    the GPU.
    """
    if xp is np:
        return np.asarray(array)
    return xp.asarray(array)


def synchronize(xp=None) -> None:
    """Wait for queued GPU work; a no-op on the CPU.

    Called before any MPI call touches a device buffer.
    """
    if _cupy is not None and (xp is None or xp is _cupy):
        _cupy.cuda.get_current_stream().synchronize()


# -- fused kernels and matrix products ------------------------------------------------
_fused_kernels = True
PRECISIONS = ("fp32", "tf32", "bf16")
_precision = "fp32"


def set_fused_kernels(enabled: bool) -> None:
    """Allow (default) or forbid the hand-written CUDA kernels of nn, optim and data."""
    global _fused_kernels
    _fused_kernels = bool(enabled)


def fused_kernels(xp) -> bool:
    """True when ``xp`` compiles CUDA kernels (CuPy) and they are allowed."""
    return _fused_kernels and xp is not np and xp is _cupy and hasattr(xp, "RawModule")


def set_precision(xp, precision: str) -> None:
    """Matrix products in fp32, TF32 or bf16 (fp32 storage, fp32 accumulation).

    bf16: both operands of every float32 product are rounded to bf16 (nearest,
    ties to even) and multiplied with fp32 accumulation, as the GPU's bf16
    tensor cores do; on the CPU the same rounding is emulated (slower than
    fp32, to preview bf16's effect on accuracy).  TF32 needs a GPU.

    Example::

        set_precision(cupy, "tf32")
    """
    global _precision, _bf16_on_host
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "tf32" and xp is np:
        raise DeviceError("precision: tf32 needs device: gpu (the CPU computes in fp32; "
                          "bf16 is emulated there)")
    if precision in REDUCED_PRECISION_CAPABILITY and xp is not np and xp is _cupy:
        capability, needed = compute_capability(xp), REDUCED_PRECISION_CAPABILITY[precision]
        if capability < needed:
            raise UnsupportedSetting(
                f"precision: {precision} needs a GPU of compute capability "
                f"{needed[0]}.{needed[1]} or newer ({precision} tensor cores); "
                f"{device_name(xp)} has {capability[0]}.{capability[1]}: use fp32 there")
    if xp is not np and xp is _cupy and hasattr(xp, "RawModule"):
        import importlib
        linalg = importlib.import_module(xp.__name__ + "._core._routines_linalg")
        # cupy.matmul (used outside backend.gemm) follows its compute type: 7 is
        # TF32, 1 the default; bf16 products go through backend.gemm only.
        linalg.set_compute_type(np.float32, 7 if precision == "tf32" else 1)
    _precision = precision
    _bf16_on_host = precision == "bf16" and xp is np


def precision() -> str:
    return _precision


#: bf16 and TF32 products need compute capability 8.0.  Older GPUs have no bf16
#: tensor cores, and cuBLAS refuses bf16 GEMMs on some of them (NOT_SUPPORTED on
#: sm_60, and on sm_70 before cuBLAS 12.3), which a run would meet at its first
#: step; nor TF32 ones, where cuBLAS and CuPy's matmul quietly compute in fp32
#: (CuPy with a warning) and the run would report a precision it never used.
REDUCED_PRECISION_CAPABILITY = {"bf16": (8, 0), "tf32": (8, 0)}


def compute_capability(xp) -> Optional[tuple]:
    """``(major, minor)`` of the current GPU, None on the host."""
    if xp is np:
        return None
    digits = str(_cupy.cuda.Device().compute_capability)     # "75" is 7.5
    return int(digits[:-1]), int(digits[-1])


# machine epsilon of the products' reduced precision (TF32: 10-bit mantissa, bf16: 7)
_PRECISION_EPSILON = {"tf32": 2.0 ** -10, "bf16": 2.0 ** -7}
_bf16_on_host = False     # bf16 chosen for the CPU: host products round their operands


def _reduced_products(array) -> bool:
    """True when float32 products on ``array``'s device use the reduced precision."""
    return array.dtype == np.float32 and (is_gpu_array(array) or _bf16_on_host)


def gemm_epsilon(array) -> float:
    """The machine epsilon of matrix products on ``array``'s device and dtype: the
    dtype's, or coarser when the products use reduced precision (``precision``).

    Example::

        gemm_epsilon(np.ones(2, np.float32))   # 1.19e-07
    """
    eps = float(np.finfo(array.dtype).eps)
    if _reduced_products(array):
        eps = max(eps, _PRECISION_EPSILON.get(_precision, 0.0))
    return eps


def round_to_bf16(x):
    """A float32 copy of ``x`` with every value rounded to the nearest bf16 (ties to
    even; infinities and NaNs stay what they are): the operand a bf16 product sees.

    Example::

        round_to_bf16(np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], np.float32))  # [1, 1 + 2**-6]
    """
    xp = get_array_module(x)
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    # NaN payloads would carry into the exponent: keep NaNs as they are
    rounded = xp.where((bits & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000), bits, rounded)
    return rounded.view(xp.float32).reshape(x.shape)


# fp32 -> bf16 bits (nearest, ties to even) into a compact copy whose rows are
# padded to 8 elements, so that the tensor cores' 16-byte alignment holds.
BF16_SOURCE = r"""
extern "C" __global__ void mpitrain_to_bf16(const float* src, long long rows, long long cols,
                                            long long ld, long long padded,
                                            unsigned short* dst)
{
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols;
    const long long c = i - r * cols;
    const unsigned int u = __float_as_uint(src[r * ld + c]);
    unsigned short h;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        h = (unsigned short)((u >> 16) | 0x40u);            // NaN stays a quiet NaN
    else
        h = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    dst[r * padded + c] = h;
}
"""


_compiled = {}
#: What CuPy's NVRTC compiles each raw_module source with (the tests compile the
#: sources with these without a GPU).
RAW_MODULE_OPTIONS = ("--std=c++14",)


def raw_module(xp, name: str, source: str):
    """``xp.RawModule`` of CUDA ``source``, compiled once per process.

    Example::

        backend.raw_module(cupy, "nn", kernels.SOURCE).get_function("mpitrain_softmax_xent")
    """
    key = ("module", name)
    module = _compiled.get(key)
    if module is None:
        module = _compiled[key] = xp.RawModule(code=source, options=RAW_MODULE_OPTIONS)
    return module


def elementwise_kernel(xp, in_params: str, out_params: str, body: str, name: str):
    """``xp.ElementwiseKernel`` built once per process (compiled on first use per dtype)."""
    key = ("elementwise", name)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = xp.ElementwiseKernel(in_params, out_params, body, name)
    return kernel


# -- CUDA graphs ------------------------------------------------------------------------
def use_own_stream(xp):
    """Make a new non-blocking stream current for this thread (graphs cannot be
    captured on the legacy default stream); returns it.  None on the host."""
    if not fused_kernels(xp):
        return None
    # A non-blocking stream does not wait for the legacy stream: finish its work first.
    xp.cuda.get_current_stream().synchronize()
    stream = xp.cuda.Stream(non_blocking=True)
    stream.use()
    return stream


def capture_graph(xp, work):
    """Capture the device work that ``work()`` launches as a CUDA graph.

    Returns ``(graph, "")``, or ``(None, reason)`` when the capture failed or
    the work allocated device memory (an allocation inside a graph could be
    handed to someone else after the capture).  The work is recorded, not run:
    launch the graph to run it.

    Example::

        graph, why = capture_graph(cupy, lambda: step_body())
        graph.launch()
    """
    stream = xp.cuda.get_current_stream()
    allocations = []

    class _Count(xp.cuda.MemoryHook):
        name = "mpitrain_capture_allocations"

        def malloc_preprocess(self, **kwargs):
            allocations.append(kwargs.get("size"))

        def alloc_preprocess(self, **kwargs):
            allocations.append(kwargs.get("mem_size"))

    global _capturing
    graph, reason = None, ""
    try:
        with _Count():
            stream.begin_capture()
            _capturing = True
            try:
                work()
            finally:
                _capturing = False
                graph = stream.end_capture()
    except Exception as exc:           # a capture error leaves nothing to run
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    if allocations:
        return None, f"the step allocated device memory {len(allocations)} time(s)"
    return graph, reason


#: cuBLAS before 12.2 allocates a new workspace for every stream capture, even on
#: the same handle, so memory grows with each capture (PyTorch gave its handles a
#: fixed workspace until CUDA 12.2, CublasHandlePool.cpp); from 12.2 it does not.
GRAPH_CUBLAS_VERSION = (12, 2)


def cublas_release(version: int) -> tuple:
    """``(major, minor)`` of a cublasGetVersion number (major * 10000 + minor * 100 +
    patch; major * 1000 + minor * 100 + patch before cuBLAS 11.9 or so)."""
    if version >= 100000:
        return version // 10000, version // 100 % 100
    return version // 1000, version // 100 % 10


def graph_capture_problem(xp) -> str:
    """Why steps should not be captured as CUDA graphs with this process's cuBLAS,
    or '' (a GPU with fused kernels assumed).

    Example::

        graph_capture_problem(cupy)     # '' with cuBLAS 12.2 or later
    """
    try:
        version = int(_cupy.cuda.cublas.getVersion(_cupy.cuda.device.get_cublas_handle()))
    except Exception:       # (a CuPy without this binding: capture as before)
        return ""
    release = cublas_release(version)
    if release >= GRAPH_CUBLAS_VERSION:
        return ""
    return (f"cuBLAS {release[0]}.{release[1]} allocates a new workspace for every capture "
            f"(fixed in {GRAPH_CUBLAS_VERSION[0]}.{GRAPH_CUBLAS_VERSION[1]}), and each new "
            "chunk of data is captured anew: GPU memory would grow all run")


# CuPy's cuBLAS binding refuses to run while a stream is being captured
# (cuBLAS itself supports capture), so during a capture the GEMMs call the
# library that binding loaded directly.
_capturing = False
_cublas_direct = None


def loaded_library(binding_file: str, symbol: str, name: str,
                   maps: str = "/proc/self/maps"):
    """The shared library whose ``symbol`` the extension module at ``binding_file``
    calls, opened with ctypes: looked up through the module's own dependencies
    first, else the one mapped file whose name holds ``name``.  Another copy
    of a library may be mapped in the same process (PyTorch's cuBLAS, in a
    benchmark), and a handle made by one copy must not go to the other's
    functions: with two copies mapped and none among the module's
    dependencies (a binding that loads its library at run time), this raises
    rather than guess.

    Example::

        lib = loaded_library(cupy_backends.cuda.libs.cublas.__file__, "cublasGemmEx",
                             "libcublas.so")
    """
    import ctypes
    try:
        binding = ctypes.CDLL(binding_file)
        getattr(binding, symbol)        # (dlsym searches the module's dependencies)
        return binding
    except (OSError, AttributeError):
        pass
    found = {}
    with open(maps, encoding="utf-8") as mapped:
        for line in mapped:
            fields = line.split()
            if len(fields) >= 6 and name in os.path.basename(fields[-1]):
                # (the map lists files by address, not by load order)
                found.setdefault(os.path.realpath(fields[-1]), fields[-1])
    if not found:
        raise RuntimeError(f"{name} not found among the loaded libraries")
    if len(found) > 1:
        raise RuntimeError(f"{len(found)} copies of {name} are loaded "
                           f"({', '.join(sorted(found))}); cannot tell which one "
                           f"{os.path.basename(binding_file)} uses")
    return ctypes.CDLL(next(iter(found.values())))


def _direct_cublas():
    global _cublas_direct
    if _cublas_direct is None:
        import ctypes
        from cupy_backends.cuda.libs import cublas      # (loads libcublas)
        lib = loaded_library(cublas.__file__, "cublasGemmEx", "libcublas.so")
        gemm_ex = lib.cublasGemmEx
        gemm_ex.restype = ctypes.c_int
        gemm_ex.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int, ctypes.c_int]
        set_stream = lib.cublasSetStream_v2
        set_stream.restype = ctypes.c_int
        set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        set_mode = lib.cublasSetPointerMode_v2
        set_mode.restype = ctypes.c_int
        set_mode.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _cublas_direct = (gemm_ex, set_stream, set_mode)
    return _cublas_direct


def _check_cublas(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


# cublasComputeType_t: 32F, 32F_FAST_TF32, and 32F for the bf16 operands
_GEMM_COMPUTE = {"fp32": 68, "tf32": 77, "bf16": 68}
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_host_scalars = {}


def _host_scalar(value: float) -> np.ndarray:
    # A small cached cell; the cache may be emptied at any look-up, so the caller
    # holds the cell while cuBLAS can read it.
    cell = _host_scalars.get(value)
    if cell is None:
        if len(_host_scalars) > 64:
            _host_scalars.clear()
        cell = _host_scalars[value] = np.array([value], dtype=np.float32)
    return cell


_device_scalars = {}


def _device_scalar(value: float):
    # With a device alpha cuBLAS reads beta from the device too; one cell per value.
    cell = _device_scalars.get(value)
    if cell is None:
        cell = _device_scalars[value] = _cupy.full((), value, dtype=np.float32)
    return cell


def _leading_dim(a) -> Optional[int]:
    """Row stride in elements of a 2-D array with unit column stride, else None."""
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize:
        return None
    lead = a.strides[0] // a.itemsize
    return lead if lead >= max(a.shape[1], 1) else None


def gemm(a, b, out, *, trans_a: bool = False, trans_b: bool = False, alpha=1.0,
         beta: float = 0.0):
    """``out = alpha op(a) @ op(b) + beta out`` for float32 matrices, in place.

    ``op`` transposes when asked.  ``alpha`` may be a 0-d device array (read by
    the GPU, so nothing waits for it).  On the GPU this is one cuBLAS call in
    the configured precision; elsewhere array expressions.

    Example::

        gemm(dy, x, grad_block, trans_a=True)            # grad = dy^T x
        gemm(h, w, x, alpha=-1.0, beta=1.0)               # x -= h w
    """
    left = a.T if trans_a else a
    right = b.T if trans_b else b
    if not (fused_kernels(_cupy) and is_gpu_array(out)) or out.dtype != np.float32:
        return _gemm_expressions(left, right, out, alpha, beta)
    lda, ldb, ldc = _leading_dim(a), _leading_dim(b), _leading_dim(out)
    if None in (lda, ldb, ldc) or a.dtype != np.float32 or b.dtype != np.float32:
        return _gemm_expressions(left, right, out, alpha, beta)
    m, n = out.shape
    k = left.shape[1]
    if left.shape[0] != m or right.shape != (k, n):
        raise ValueError(f"gemm: shapes {left.shape} @ {right.shape} do not give {out.shape}")
    if m == 0 or n == 0:
        return out
    from cupy_backends.cuda.libs import cublas
    handle = _cupy.cuda.device.get_cublas_handle()
    device_alpha = is_gpu_array(alpha)
    if device_alpha:
        alpha_ptr = alpha.data.ptr
        beta_ptr = _device_scalar(float(beta)).data.ptr
    else:
        # cuBLAS reads host scalars during the call: both cells are held until it
        # returns (looking up beta may empty the cache that held alpha's)
        host_scalars = (_host_scalar(float(alpha)), _host_scalar(float(beta)))
        alpha_ptr, beta_ptr = (cell.ctypes.data for cell in host_scalars)
    compute = _GEMM_COMPUTE[_precision]
    algo = 99 if _precision == "tf32" else -1     # 99: CUBLAS_GEMM_DEFAULT_TENSOR_OP
    operand_type, a_ptr, b_ptr = _CUDA_R_32F, a.data.ptr, b.data.ptr
    if _precision == "bf16":
        operand_type = _CUDA_R_16BF
        a_ptr, lda = _bf16_operand(a, lda, "a")
        b_ptr, ldb = _bf16_operand(b, ldb, "b")
    # Row-major out (m, n) is column-major out^T = op(b)^T op(a)^T.
    args = (handle, 1 if trans_b else 0, 1 if trans_a else 0, n, m, k,
            alpha_ptr, b_ptr, operand_type, ldb, a_ptr, operand_type, lda,
            beta_ptr, out.data.ptr, _CUDA_R_32F, ldc, compute, algo)
    if _capturing:
        gemm_ex, set_stream, set_mode = _direct_cublas()
        _check_cublas(set_stream(handle, _cupy.cuda.get_current_stream().ptr), "SetStream")
        _check_cublas(set_mode(handle, 1 if device_alpha else 0), "SetPointerMode")
        try:
            _check_cublas(gemm_ex(*args), "GemmEx")
        finally:
            set_mode(handle, 0)
        return out
    if device_alpha:
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_DEVICE)
    try:
        cublas.gemmEx(*args)
    finally:
        if device_alpha:
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    return out


_bf16_scratch = {}


def _bf16_operand(x, ld: int, slot: str):
    """(device pointer, leading dimension) of a bf16 copy of the stored matrix ``x``
    (row stride ``ld``), rows padded to 8 elements.

    The copy lives in a scratch buffer kept per thread, operand and power-of-two
    capacity and never freed: a captured CUDA graph keeps the buffers it used,
    and the products of a stream run in order, so each may reuse its buffer.
    """
    import threading
    rows, cols = x.shape
    padded = max(8, -(-cols // 8) * 8)
    size = max(rows * padded, 1)
    capacity = 1 << (size - 1).bit_length()
    key = (threading.get_ident(), slot, capacity)
    scratch = _bf16_scratch.get(key)
    if scratch is None:
        scratch = _bf16_scratch[key] = _cupy.empty(capacity, dtype=np.uint16)
    if rows * cols:
        kernel = raw_module(_cupy, "bf16", BF16_SOURCE).get_function("mpitrain_to_bf16")
        threads = 256
        kernel(((rows * cols + threads - 1) // threads,), (threads,),
               (x, np.int64(rows), np.int64(cols), np.int64(ld), np.int64(padded), scratch))
    return scratch.data.ptr, padded


def _gemm_expressions(left, right, out, alpha, beta):
    xp = get_array_module(out)
    if _precision == "bf16" and _reduced_products(out) and left.dtype == right.dtype == out.dtype:
        left, right = round_to_bf16(left), round_to_bf16(right)
    plain_alpha = not is_gpu_array(alpha) and float(alpha) == 1.0
    if beta == 0.0 and plain_alpha:
        xp.matmul(left, right, out=out)
        return out
    product = xp.matmul(left, right)
    if not plain_alpha:
        product *= alpha
    if beta == 0.0:
        out[...] = product
    else:
        if beta != 1.0:
            out *= out.dtype.type(beta)
        out += product
    return out


def synchronize_device(xp) -> None:
    """Wait for all work on every stream of the current GPU (no-op on the host)."""
    if xp is not np and xp is _cupy:
        _cupy.cuda.Device().synchronize()


def device_info(xp) -> dict:
    """GPU name, NVIDIA driver, CUDA runtime and CuPy versions (empty on the CPU)."""
    if xp is np:
        return {}
    runtime = _cupy.cuda.runtime

    def version(number: int) -> str:
        return f"{number // 1000}.{number % 1000 // 10}"

    driver = "unknown"
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            words = fh.readline().split()
        driver = next((w for w in words if w[:1].isdigit() and "." in w), driver)
    except OSError:
        pass
    return {"gpu": device_name(xp), "driver": driver,
            "cuda_driver_api": version(runtime.driverGetVersion()),
            "cuda_runtime": version(runtime.runtimeGetVersion()), "cupy": _cupy.__version__}


def device_index(xp) -> Optional[int]:
    """The current CUDA device's number in this process, None on the host."""
    if xp is np:
        return None
    return int(_cupy.cuda.Device().id)


def device_name(xp) -> str:
    if xp is np:
        return "cpu"
    props = _cupy.cuda.runtime.getDeviceProperties(_cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)
