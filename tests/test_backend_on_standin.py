"""The backend's GPU paths without a GPU, on the CuPy stand-in
(mpitrain/testing/standin_cupy.py): the cuBLAS call of backend.gemm, host reads
under CuPy's unified memory, and what the device's compute capability and
cuBLAS version allow."""

import sys
import types
import weakref

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.testing import standin_cupy


@pytest.fixture
def cublas_path(monkeypatch):
    """The stand-in with backend.gemm on its cuBLAS path (the fused-kernel path),
    calling the stand-in's cuBLAS binding."""
    with standin_cupy.installed() as cp:
        monkeypatch.setattr(backend, "fused_kernels", lambda xp: xp is cp)
        libs = types.ModuleType("cupy_backends.cuda.libs")
        libs.cublas = cp.cuda.cublas
        for name in ("cupy_backends", "cupy_backends.cuda"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
        monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", cp.cuda.cublas)
        yield cp


def test_gemm_on_the_standin_cublas_matches_numpy(cublas_path):
    cp = cublas_path
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((4, 7)).astype(np.float32)
    c = rng.standard_normal((5, 6)).astype(np.float32)
    out = cp.asarray(c)
    backend.gemm(cp.asarray(a), cp.asarray(b), out[:, :4], trans_b=True, alpha=0.5, beta=2.0)
    assert standin_cupy.CUBLAS_CALLS == [{"alpha": 0.5, "beta": 2.0}]
    want = 0.5 * a @ b.T + 2.0 * c[:, :4]
    np.testing.assert_allclose(backend.to_host(out)[:, :4], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(backend.to_host(out)[:, 4:], c[:, 4:])


def test_a_gemms_host_scalars_outlive_the_call_when_the_cache_is_emptied(cublas_path,
                                                                          monkeypatch):
    """The cache of host scalars is emptied when it grows past 64 values; looking up
    beta could empty it and free alpha's cell before cuBLAS read it."""
    cp = cublas_path
    dropped = []

    class Watched(dict):
        def clear(self):
            dropped.extend((weakref.ref(cell), value) for value, cell in self.items())
            super().clear()

    full = Watched((float(v), np.array([v], dtype=np.float32)) for v in range(100, 164))
    monkeypatch.setattr(backend, "_host_scalars", full)
    gemm_ex = cp.cuda.cublas.gemmEx

    def checked(*args):
        freed = [value for ref, value in dropped if ref() is None]
        assert 0.5 not in freed and 0.25 not in freed, \
            "a scalar cuBLAS is about to read was freed"
        return gemm_ex(*args)

    monkeypatch.setattr(cp.cuda.cublas, "gemmEx", checked)
    a = cp.asarray(np.eye(3, dtype=np.float32))
    out = cp.asarray(np.ones((3, 3), dtype=np.float32))
    backend.gemm(a, a, out, alpha=0.5, beta=0.25)     # alpha fills it, beta empties it
    assert 0.5 in [value for _, value in dropped], "the case is not exercised"
    assert standin_cupy.CUBLAS_CALLS == [{"alpha": 0.5, "beta": 0.25}]
    np.testing.assert_allclose(backend.to_host(out), 0.5 * np.eye(3) + 0.25)


def test_a_blocking_read_under_unified_memory_waits_and_copies():
    """Under CUPY_ENABLE_UMP=1 (CuPy 13+) ``get()`` returns a view of the device
    memory without waiting: to_host must still give the values after the queued
    work, in memory of its own."""
    with standin_cupy.installed() as cp, standin_cupy.deferred_copies(), \
            standin_cupy.unified_memory():
        x = cp.zeros(4, dtype=cp.float32)
        standin_cupy.queue_device_work(lambda: x.fill(7.0))     # a kernel still running
        host = backend.to_host(x)
        np.testing.assert_array_equal(host, np.full(4, 7.0, dtype=np.float32))
        x.fill(1.0)                                              # later device work
        np.testing.assert_array_equal(host, np.full(4, 7.0, dtype=np.float32))


@pytest.mark.parametrize("precision, older, newer", [("bf16", "75", "80"), ("tf32", "70", "90")])
def test_reduced_precision_is_refused_on_a_gpu_before_compute_capability_8(
        monkeypatch, precision, older, newer):
    """cuBLAS's bf16 GEMMs need bf16 tensor cores (8.0): before them cuBLAS may refuse
    the product at the first step (NOT_SUPPORTED).  Nor are there TF32 tensor cores:
    cuBLAS and CuPy's matmul would compute in fp32 while the run said tf32."""
    with standin_cupy.installed() as cp:
        monkeypatch.setitem(standin_cupy.DEVICE, "compute_capability", older)
        with pytest.raises(backend.UnsupportedSetting) as refused:
            backend.select_for_run("gpu", 0, precision=precision, fused_kernels=True)
        assert str(refused.value) == (
            f"precision: {precision} needs a GPU of compute capability 8.0 or newer "
            f"({precision} tensor cores); stand-in device has {older[0]}.{older[1]}: use "
            "fp32 there")
        assert backend.precision() == "fp32"
        backend.select_for_run("gpu", 0, precision="fp32", fused_kernels=True)
        monkeypatch.setitem(standin_cupy.DEVICE, "compute_capability", newer)
        backend.select_for_run("gpu", 0, precision=precision, fused_kernels=True)
        assert backend.precision() == precision
        backend.set_precision(cp, "fp32")
