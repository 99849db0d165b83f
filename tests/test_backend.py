"""The backend on a GPU: the cuBLAS path of backend.gemm against NumPy, asynchronous
host copies, and the device of each local rank.

Skipped without CuPy and a CUDA device; MPITRAIN_TEST_GPU=1 turns the skip
into a failure.  GEMMs with inner dimension K differ from NumPy by ~sqrt(K)
ulps (rtol 1e-4 at K <= 2048).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain import backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_gemm_matches_numpy(cp, trans_a, trans_b):
    rng = np.random.default_rng(6)
    m, k, n = 70, 2048, 33
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    c = rng.standard_normal((m, n + 1)).astype(np.float32)   # a strided output view
    want = 0.5 * ((a.T if trans_a else a) @ (b.T if trans_b else b)) + 2.0 * c[:, :n]
    out = cp.asarray(c)
    backend.gemm(cp.asarray(a), cp.asarray(b), out[:, :n], trans_a=trans_a, trans_b=trans_b,
                 alpha=0.5, beta=2.0)
    got = backend.to_host(out)
    np.testing.assert_allclose(got[:, :n], want, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(got[:, n], c[:, n])
    # alpha read from the device
    out2 = cp.empty((m, n), dtype=cp.float32)
    backend.gemm(cp.asarray(a), cp.asarray(b), out2, trans_a=trans_a, trans_b=trans_b,
                 alpha=cp.asarray(np.float32(3.0)))
    np.testing.assert_allclose(backend.to_host(out2),
                               3.0 * ((a.T if trans_a else a) @ (b.T if trans_b else b)),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("precision,rtol", [("tf32", 5e-3), ("bf16", 3e-2)])
def test_reduced_precision_gemm_is_close(cp, precision, rtol):
    """TF32 keeps 10 mantissa bits (relative error ~1e-3 per product), bf16 7 bits."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 128)).astype(np.float32)
    out = cp.empty((256, 128), dtype=cp.float32)
    backend.set_precision(cp, precision)
    try:
        backend.gemm(cp.asarray(a), cp.asarray(b), out)
    finally:
        backend.set_precision(cp, "fp32")
    want = a @ b
    err = np.linalg.norm(backend.to_host(out) - want) / np.linalg.norm(want)
    assert err < rtol


def test_precision_sets_the_compute_type_of_cupys_own_matmul(cp):
    """set_precision reaches into CuPy's private _core._routines_linalg (7: TF32,
    1: the default) for cupy.matmul outside backend.gemm; fp32 there multiplies
    in full fp32 (even under CUPY_TF32=1): 8 products of 1 + 2^-20 with itself
    sum exactly to 8 + 2^-16, which TF32's 10-bit operands would lose."""
    import importlib
    linalg = importlib.import_module(cp.__name__ + "._core._routines_linalg")
    a = cp.full((256, 8), 1 + 2.0 ** -20, dtype=cp.float32)
    backend.set_precision(cp, "fp32")
    assert linalg.get_compute_type(np.float32) == 1
    product = backend.to_host(cp.matmul(a, a.T))
    assert (product == np.float32(8 + 2.0 ** -16)).all()
    if backend.compute_capability(cp) >= (8, 0):
        backend.set_precision(cp, "tf32")
        try:
            assert linalg.get_compute_type(np.float32) == 7
        finally:
            backend.set_precision(cp, "fp32")
        assert linalg.get_compute_type(np.float32) == 1


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_bf16_gemm_multiplies_the_rounded_operands(cp, trans_a, trans_b):
    """bf16: cuBLAS multiplies bf16 copies of both operands with fp32 accumulation,
    so it matches the CPU's emulation (the rounded operands' exact product) up to
    fp32 accumulation error: products of bf16 values are exact in fp32, and 2049
    terms summed in fp32 drift by about sqrt(2049) 2^-24 = 3e-6 relative (bound
    2e-5); the exact fp32 product is 2^-9-ish away, so the test sees bf16 in use."""
    rng = np.random.default_rng(8)
    m, k, n = 96, 2049, 40                  # k: a [W|b] block's inner dimension
    a = rng.standard_normal((k, m + 3) if trans_a else (m, k + 3)).astype(np.float32)
    b = rng.standard_normal((n, k + 1) if trans_b else (k, n + 1)).astype(np.float32)
    a_view = a[:, :m] if trans_a else a[:, :k]
    b_view = b[:, :k] if trans_b else b[:, :n]
    left = a_view.T if trans_a else a_view
    right = b_view.T if trans_b else b_view
    out = cp.zeros((m, n + 2), dtype=cp.float32)
    backend.set_precision(cp, "bf16")
    try:
        backend.gemm(cp.asarray(a)[:, :a_view.shape[1]], cp.asarray(b)[:, :b_view.shape[1]],
                     out[:, :n], trans_a=trans_a, trans_b=trans_b)
    finally:
        backend.set_precision(cp, "fp32")
    got = backend.to_host(out)
    want = backend.round_to_bf16(left).astype(np.float64) @ backend.round_to_bf16(right)
    err = np.linalg.norm(got[:, :n] - want) / np.linalg.norm(want)
    assert err < 2e-5, err
    assert np.linalg.norm(got[:, :n] - left.astype(np.float64) @ right) \
        / np.linalg.norm(want) > 1e-4
    assert not got[:, n:].any()


def test_bf16_copy_kernel_rounds_as_the_host_does(cp):
    rng = np.random.default_rng(12)
    bits = rng.integers(0, 2 ** 32, (37, 300), dtype=np.uint64).astype(np.uint32)
    bits[0, :4] = [0x7F800000, 0xFF800000, 0x7F800001, 0x00000001]   # inf, -inf, NaN, tiny
    x = bits.view(np.float32)
    ptr, ld = backend._bf16_operand(cp.asarray(x)[:, :299], 300, "a")
    scratch = next(buf for buf in backend._bf16_scratch.values() if buf.data.ptr == ptr)
    got = backend.to_host(scratch[:37 * ld]).reshape(37, ld)[:, :299]
    want = backend.round_to_bf16(x[:, :299]).view(np.uint32) >> 16
    nan = np.isnan(x[:, :299])
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert nan.any() and ((got[nan] & 0x7FFF) > 0x7F80).all()     # still NaN as bf16


def test_async_host_copy_waits_only_for_its_data(cp):
    x = cp.arange(1000, dtype=cp.float32)
    pending = backend.copy_to_host_async(x * 2)
    np.testing.assert_array_equal(pending.result(), np.arange(1000, dtype=np.float32) * 2)


def test_gpu_device_selection_by_local_rank(cp):
    count = cp.cuda.runtime.getDeviceCount()
    backend.select("gpu", local_rank=count + 1)
    assert cp.cuda.Device().id == 1 % count
    backend.select("gpu", local_rank=0)


def test_gemm_epsilon_follows_dtype_and_device_precision():
    from mpitrain.testing import standin_cupy
    assert backend.gemm_epsilon(np.ones(2, np.float32)) == np.finfo(np.float32).eps
    assert backend.gemm_epsilon(np.ones(2, np.float64)) == np.finfo(np.float64).eps
    with standin_cupy.installed() as xp:
        x = xp.ones(2, dtype=np.float32)
        assert backend.gemm_epsilon(x) == np.finfo(np.float32).eps
        backend.set_precision(xp, "tf32")
        try:
            assert backend.gemm_epsilon(x) == 2.0 ** -10
            assert backend.gemm_epsilon(np.ones(2, np.float32)) == np.finfo(np.float32).eps
        finally:
            backend.set_precision(xp, "fp32")


def test_a_bindings_library_is_found_through_its_own_dependencies(tmp_path):
    """The GEMMs inside a CUDA-graph capture call the cuBLAS that CuPy's binding
    uses; with two copies mapped (PyTorch's beside CuPy's) the first one in the
    address map may be the other.  Here with libffi behind the _ctypes module."""
    import _ctypes
    import math
    lib = backend.loaded_library(_ctypes.__file__, "ffi_call", "libffi.so")
    assert lib.ffi_call
    # a module without that dependency: the first mapped file of the name
    ffi_path = next(line.split()[-1] for line in open("/proc/self/maps")
                    if "libffi.so" in line.split()[-1])
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libother.so.1\n"
                    f"7f01-7f02 r-xp 00000000 08:01 2 {ffi_path}\n")
    if getattr(math, "__file__", None):
        lib = backend.loaded_library(math.__file__, "ffi_call", "libffi.so", maps=str(maps))
        assert lib.ffi_call
    with pytest.raises(RuntimeError, match="libcublas.so not found"):
        backend.loaded_library(str(maps), "cublasGemmEx", "libcublas.so", maps=str(maps))


def test_a_library_mapped_twice_is_not_guessed(tmp_path):
    """A binding that loads cuBLAS at run time (CuPy built with CUDA Python) names
    no dependency; with PyTorch's copy mapped as well, the first file in the
    address map may be the wrong one, whose functions must not get CuPy's
    handle: the capture then fails with this reason instead."""
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/torch/lib/libcublas.so.12\n"
        "7f01-7f02 r--p 00000000 08:01 1 /opt/torch/lib/libcublas.so.12\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/local/cuda/lib64/libcublasLt.so.12\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/local/cuda/lib64/libcublas.so.12\n")
    with pytest.raises(RuntimeError, match="2 copies of libcublas.so are loaded"):
        backend.loaded_library(str(maps), "cublasGemmEx", "libcublas.so", maps=str(maps))
