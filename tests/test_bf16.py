"""bf16 products (``precision: bf16``) without a GPU.

The rounding is checked against an independent float64 reference; the CPU's
emulated products against products of the rounded operands; and the cuBLAS
path of ``backend.gemm`` against a stand-in for CuPy and cuBLAS that keeps
device memory on the host and reads its operands through the pointers and
leading dimensions it is handed, column-major as cuBLAS does.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from mpitrain import backend


def reference_bf16(x):
    """float32 values rounded to 8 significant bits, ties to even, in float64 arithmetic."""
    x = np.asarray(x, dtype=np.float64)
    out = np.array(x, copy=True)
    finite = np.isfinite(x) & (x != 0)
    tiny = finite & (np.abs(x) < 2.0 ** -126)          # bf16's subnormals: spacing 2^-133
    normal = finite & ~tiny
    m, e = np.frexp(x[normal])
    out[normal] = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)
    out[tiny] = np.rint(np.ldexp(x[tiny], 133)) * 2.0 ** -133
    with np.errstate(over="ignore"):
        return out.astype(np.float32)                  # past bf16's largest: infinity


@pytest.fixture
def restore_precision():
    yield
    backend.set_precision(np, "fp32")


def test_rounding_is_to_nearest_with_ties_to_even():
    one = np.float32(1.0)
    cases = {
        one + 2.0 ** -8: 1.0,                          # tie: down to the even 1.0
        one + 3 * 2.0 ** -8: 1.0 + 2.0 ** -6,          # tie: up to the even neighbour
        one + 2.0 ** -8 + 2.0 ** -20: 1.0 + 2.0 ** -7,  # just past the tie
        one + 2.0 ** -9: 1.0,
        -2.5: -2.5,                                    # representable: unchanged
        np.finfo(np.float32).max: np.inf,              # past bf16's largest finite value
        -np.inf: -np.inf,
        2.0 ** -140: 0.0,                              # below half of bf16's smallest step
        3 * 2.0 ** -134: 2.0 ** -132,                  # tie between subnormals: to even
    }
    x = np.array(list(cases), dtype=np.float32)
    np.testing.assert_array_equal(backend.round_to_bf16(x), np.array(list(cases.values()),
                                                                       dtype=np.float32))
    nan = backend.round_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(nan).all()


def test_rounding_matches_the_reference_on_random_values():
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    got = backend.round_to_bf16(x)
    np.testing.assert_array_equal(got, reference_bf16(x))
    assert not (got.view(np.uint32) & 0xFFFF).any()      # bf16: the low 16 bits are zero
    # a strided 2-D view keeps its shape and values
    m = rng.standard_normal((6, 9)).astype(np.float32)
    np.testing.assert_array_equal(backend.round_to_bf16(m[:, 1:7].T),
                                  reference_bf16(m[:, 1:7].T))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_cpu_products_round_both_operands(restore_precision, trans_a, trans_b):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((40, 33) if trans_a else (33, 40)).astype(np.float32)
    b = rng.standard_normal((25, 40) if trans_b else (40, 25)).astype(np.float32)
    c = rng.standard_normal((33, 26)).astype(np.float32)
    left, right = (a.T if trans_a else a), (b.T if trans_b else b)
    exact = left @ right
    backend.set_precision(np, "bf16")
    out = c.copy()
    backend.gemm(a, b, out[:, :25], trans_a=trans_a, trans_b=trans_b, alpha=0.5, beta=2.0)
    want = 0.5 * (reference_bf16(left).astype(np.float64) @ reference_bf16(right)) \
        + 2.0 * c[:, :25]
    # fp32 accumulation of 40 terms: well within 1e-5 of the exact product of the
    # rounded operands; the fp32 product itself differs by bf16's 2^-8 relative steps.
    np.testing.assert_allclose(out[:, :25], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 25], c[:, 25])
    assert np.abs(out[:, :25] - (0.5 * exact + 2.0 * c[:, :25])).max() > 1e-4
    assert backend.gemm_epsilon(out) == 2.0 ** -7
    # float64 products (NG-SGD's small host matrices) keep their precision
    d = rng.standard_normal((5, 5))
    e = np.empty((5, 5))
    backend.gemm(d, d, e)
    np.testing.assert_allclose(e, d @ d, rtol=1e-14)
    backend.set_precision(np, "fp32")
    backend.gemm(a, b, out[:, :25], trans_a=trans_a, trans_b=trans_b)
    np.testing.assert_allclose(out[:, :25], exact, rtol=1e-5, atol=1e-5)
    assert backend.gemm_epsilon(out) == np.finfo(np.float32).eps


def test_tf32_still_needs_a_gpu(restore_precision):
    with pytest.raises(backend.DeviceError, match="precision: tf32 needs device: gpu"):
        backend.set_precision(np, "tf32")


# -- the cuBLAS path, on a stand-in that reads memory through pointers -----------------
class _DeviceArray(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


_DTYPE_OF_CUDA_TYPE = {0: np.float32, 14: np.uint16}


def _matrix_at(ptr: int, dtype, rows: int, cols: int, ld: int):
    """The column-major (rows, cols) matrix at ``ptr`` with leading dimension ``ld``,
    as a writable view of that memory (cuBLAS's layout)."""
    itemsize = np.dtype(dtype).itemsize
    count = (cols - 1) * ld + rows
    buf = (ctypes.c_char * (count * itemsize)).from_address(ptr)
    flat = np.frombuffer(buf, dtype=dtype, count=count)
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, cols),
                                           strides=(itemsize, ld * itemsize))


def _as_float(matrix):
    if matrix.dtype == np.uint16:                       # bf16 bits -> float32
        return (matrix.astype(np.uint32) << 16).view(np.float32)
    return matrix


class StandInCublas:
    """``gemmEx`` computing C = alpha op(A) op(B) + beta C, column-major, from pointers."""

    CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1

    def __init__(self):
        self.calls = []

    def setPointerMode(self, handle, mode):
        pass

    def gemmEx(self, handle, transa, transb, m, n, k, alpha_ptr, a_ptr, a_type, lda,
               b_ptr, b_type, ldb, beta_ptr, c_ptr, c_type, ldc, compute, algo):
        self.calls.append({"types": (a_type, b_type, c_type), "ld": (lda, ldb, ldc),
                           "compute": compute, "algo": algo})
        assert c_type == 0 and a_type == b_type
        a = _matrix_at(a_ptr, _DTYPE_OF_CUDA_TYPE[a_type], k if transa else m,
                       m if transa else k, lda)
        b = _matrix_at(b_ptr, _DTYPE_OF_CUDA_TYPE[b_type], n if transb else k,
                       k if transb else n, ldb)
        c = _matrix_at(c_ptr, np.float32, m, n, ldc)
        op_a = _as_float(a).T if transa else _as_float(a)
        op_b = _as_float(b).T if transb else _as_float(b)
        alpha = ctypes.c_float.from_address(alpha_ptr).value
        beta = ctypes.c_float.from_address(beta_ptr).value
        c[...] = (alpha * (op_a.astype(np.float64) @ op_b) + beta * c).astype(np.float32)


class StandInRawModule:
    """Runs ``mpitrain_to_bf16`` as the CUDA source says, with the reference rounding."""

    compiled = []

    def __init__(self, code, options=()):
        assert "mpitrain_to_bf16" in code
        StandInRawModule.compiled.append(code)

    def get_function(self, name):
        assert name == "mpitrain_to_bf16"

        def launch(grid, block, args):
            src, rows, cols, ld, padded, dst = args
            rows, cols, ld, padded = int(rows), int(cols), int(ld), int(padded)
            assert grid[0] * block[0] >= rows * cols
            x = np.lib.stride_tricks.as_strided(src, shape=(rows, cols),
                                                strides=(ld * 4, 4))
            bits = reference_bf16(x).view(np.uint32) >> 16
            for r in range(rows):
                dst[r * padded:r * padded + cols] = bits[r]
        return launch


@pytest.fixture
def standin_gpu(monkeypatch):
    cublas = StandInCublas()
    module = types.ModuleType("standin_gpu")
    module.ndarray = _DeviceArray
    module.RawModule = StandInRawModule
    module.empty = lambda n, dtype: np.empty(n, dtype=dtype).view(_DeviceArray)
    module.get_array_module = lambda *arrays: module
    module.cuda = types.SimpleNamespace(device=types.SimpleNamespace(
        get_cublas_handle=lambda: 7))
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = cublas
    for name in ("cupy_backends", "cupy_backends.cuda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", cublas)
    monkeypatch.setattr(backend, "_cupy", module)
    monkeypatch.setattr(backend, "_compiled", {})
    monkeypatch.setattr(backend, "_bf16_scratch", {})
    monkeypatch.setattr(backend, "_precision", "bf16")
    yield cublas


def _device(x):
    return np.array(x, dtype=np.float32).view(_DeviceArray)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_gpu_path_hands_cublas_padded_bf16_copies(standin_gpu, trans_a, trans_b):
    rng = np.random.default_rng(5)
    m, k, n = 13, 21, 10
    # operands as the layers hand them: strided views of wider buffers (a [W|b] block)
    a_store = rng.standard_normal((k, m + 1) if trans_a else (m, k + 1)).astype(np.float32)
    b_store = rng.standard_normal((n, k + 3) if trans_b else (k, n + 3)).astype(np.float32)
    a = _device(a_store)[:, :m] if trans_a else _device(a_store)[:, :k]
    b = _device(b_store)[:, :k] if trans_b else _device(b_store)[:, :n]
    c = rng.standard_normal((m, n + 2)).astype(np.float32)
    out = _device(c)
    backend.gemm(a, b, out[:, :n], trans_a=trans_a, trans_b=trans_b, alpha=0.5, beta=2.0)
    left = np.asarray(a).T if trans_a else np.asarray(a)
    right = np.asarray(b).T if trans_b else np.asarray(b)
    want = 0.5 * (reference_bf16(left).astype(np.float64) @ reference_bf16(right)) \
        + 2.0 * c[:, :n]
    np.testing.assert_allclose(np.asarray(out[:, :n]), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[:, n:]), c[:, n:])   # outside the view
    call, = standin_gpu.calls
    assert call["types"] == (14, 14, 0) and call["compute"] == 68 and call["algo"] == -1
    lda_cublas, ldb_cublas, ldc = call["ld"]           # cuBLAS's A is our b (transposed view)
    assert lda_cublas % 8 == 0 and ldb_cublas % 8 == 0 and ldc == n + 2
    assert lda_cublas == -(-b.shape[1] // 8) * 8 and ldb_cublas == -(-a.shape[1] // 8) * 8


def test_gpu_path_keeps_its_scratch_for_captured_graphs(standin_gpu):
    rng = np.random.default_rng(9)
    a, b = _device(rng.standard_normal((16, 24))), _device(rng.standard_normal((24, 8)))
    out = _device(np.zeros((16, 8)))
    backend.gemm(a, b, out)
    first = dict(backend._bf16_scratch)
    backend.gemm(a, b, out)
    assert backend._bf16_scratch == first              # same shapes: the same buffers
    big = _device(rng.standard_normal((64, 24)))
    backend.gemm(big, b, _device(np.zeros((64, 8))))
    # a larger operand gets a buffer of its own; the old ones stay (a graph may use them)
    assert all(backend._bf16_scratch[key] is buf for key, buf in first.items())
    assert len(backend._bf16_scratch) == len(first) + 1


def test_fp32_path_hands_cublas_the_stored_matrices(standin_gpu, monkeypatch):
    monkeypatch.setattr(backend, "_precision", "fp32")
    a = _device(np.ones((4, 6)))[:, :5]
    b = _device(np.ones((5, 3)))
    out = _device(np.zeros((4, 3)))
    backend.gemm(a, b, out)
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 3), 5.0, np.float32))
    call, = standin_gpu.calls
    assert call["types"] == (0, 0, 0) and call["ld"] == (3, 6, 3)
    assert not backend._bf16_scratch
