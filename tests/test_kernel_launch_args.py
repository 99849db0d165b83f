"""Every raw kernel launch passes arguments of its kernel's C types, without a GPU.

CuPy's RawKernel copies each argument by its own type, not the parameter's:
a device array becomes a pointer, a NumPy scalar its bytes, and a Python int
or float an int64 or a double (cupy/_core/_scalar.pyx, CScalar).  A Python
int for an ``int`` parameter, a float64 scalar for a ``float`` one or a float64
array for a ``float*`` one would launch and compute garbage, on a GPU only.
Here each launching function runs on the CuPy stand-in with its kernels
replaced by recorders, and every launch is checked against the signature in
the CUDA source it was compiled from.
"""

from __future__ import annotations


import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn import kernels as nn_kernels
from mpitrain.optim import kernels as optim_kernels
from mpitrain.testing import standin_cupy

from .cuda_emulation import SCALAR_TYPES, kernel_signatures

class _Recorder:
    """A RawModule whose functions record their launches instead of running."""

    def __init__(self, source: str, launches: list):
        self.signatures = kernel_signatures(source)
        self.launches = launches

    def get_function(self, name: str):
        assert name in self.signatures, f"{name} is not in the source it is taken from"

        def launch(grid, block, args):
            self.launches.append((name, self.signatures[name], grid, block, args))
        return launch


@pytest.fixture
def launches(monkeypatch):
    recorded: list = []
    sources = {}
    monkeypatch.setattr(backend, "fused_kernels", lambda xp: xp is not np)
    monkeypatch.setattr(optim_kernels, "_KERNELS", {})

    def raw_module(xp, name, source):
        return sources.setdefault(name, _Recorder(source, recorded))
    monkeypatch.setattr(backend, "raw_module", raw_module)
    return recorded


def _check(launches, names):
    assert [launch[0] for launch in launches] == names
    for name, signature, grid, block, args in launches:
        assert all(type(n) is int and n > 0 for n in tuple(grid) + tuple(block)), name
        assert len(args) == len(signature), f"{name}: {len(args)} arguments"
        for i, ((ctype, pointer), arg) in enumerate(zip(signature, args)):
            where = f"{name} argument {i} ({ctype}{'*' if pointer else ''})"
            if pointer:
                assert isinstance(arg, standin_cupy.DeviceArray), f"{where}: got {type(arg).__name__}"
                assert arg.dtype == SCALAR_TYPES[ctype], f"{where}: got a {arg.dtype} array"
                assert arg.flags.c_contiguous or arg.ndim == 2, where
            else:
                # (a Python int or float goes as int64 or double: right for those only)
                python = {"long long": int, "double": float}.get(ctype)
                assert type(arg) in (SCALAR_TYPES[ctype], python), \
                    f"{where}: got {type(arg).__name__}"


def test_the_sum_of_squares_launch(launches):
    with standin_cupy.installed() as cp:
        x = cp.ones((300, 7), dtype=cp.float32)
        optim_kernels.sqnorm(x)
        optim_kernels.sqnorm(x, cp.empty((), dtype=cp.float32))
    _check(launches, ["mpitrain_sumsq"] * 2)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_max_change_step_launches(launches, momentum):
    with standin_cupy.installed() as cp:
        state = optim_kernels.MaxChangeState(cp, [(0, 40000), (40000, 40030)], [0.75, 0.0])
        params = cp.zeros(40030, dtype=cp.float32)
        grads = cp.ones(40030, dtype=cp.float32)
        delta = cp.zeros(40030, dtype=cp.float32) if momentum else None
        optim_kernels.max_change_step_(params, grads, delta, lr=0.01, momentum=momentum,
                                       max_change=2.0, state=state)
    _check(launches, ["mpitrain_sgd_delta_sumsq", "mpitrain_sgd_scales", "mpitrain_sgd_apply"])


@pytest.mark.parametrize("labels_dtype", [np.int32, np.int64])
def test_the_softmax_cross_entropy_launches(launches, labels_dtype):
    with standin_cupy.installed() as cp:
        logits = cp.zeros((6, 5), dtype=cp.float32)
        labels = cp.asarray(np.arange(6, dtype=labels_dtype) % 5)
        nn_kernels.softmax_xent_(logits, labels, cp.zeros(2, dtype=cp.float64))
    _check(launches, ["mpitrain_softmax_xent", "mpitrain_add_row_sums"])


def test_the_bf16_operand_copy_launch(launches):
    with standin_cupy.installed() as cp:
        x = cp.ones((5, 13), dtype=cp.float32)
        backend._bf16_operand(x[:, :11], 13, "a")
    _check(launches, ["mpitrain_to_bf16"])


def test_a_wrong_argument_type_is_caught():
    """The check itself: a Python int, a float64 scalar and a float64 array in
    the places of an int, a float and a float* are each named."""
    signature = kernel_signatures('extern "C" __global__ void k(const float* x, const int n, '
                            'float scale)')["k"]
    assert signature == [("float", True), ("int", False), ("float", False)]
    with standin_cupy.installed() as cp:
        good = (cp.zeros(3, dtype=cp.float32), np.int32(3), np.float32(1.0))
        _check([("k", signature, (1,), (32,), good)], ["k"])
        for i, bad in ((1, 3), (2, np.float64(1.0)), (0, cp.zeros(3, dtype=cp.float64))):
            args = good[:i] + (bad,) + good[i + 1:]
            with pytest.raises(AssertionError, match=f"k argument {i}"):
                _check([("k", signature, (1,), (32,), args)], ["k"])
