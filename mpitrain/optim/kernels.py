"""Array kernels for the natural-gradient preconditioner, on NumPy or CuPy.

Every function takes arrays of one array module and does the same math on
both: plain NumPy expressions on the host, and on the GPU small CuPy kernels
(a fused square-sum reduction, an elementwise gamma, a fused row-scaled add)
that keep the preconditioner free of host synchronisation except where the
host really needs a number.  CuPy is never imported here: the kernels are
built lazily from the array module that :func:`mpitrain.backend.get_array_module`
returns for the arrays at hand, and cached per module.

Example::

    xp = backend.get_array_module(x)
    x_sq = kernels.sqnorm(x)                 # float on NumPy, 0-d array on CuPy
    kernels.subtract_product_(x, h, w, tmp)  # x -= h @ w, tmp is scratch
    gamma = kernels.gamma(x_sq, kernels.sqnorm(x))
"""

from __future__ import annotations

import numpy as np

from .. import backend

_KERNELS: dict = {}


def _is_numpy(xp) -> bool:
    return xp is np


def _kernel(xp, name: str):
    """The CuPy kernel ``name`` built from module ``xp``, compiled once."""
    key = (xp.__name__, name)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _BUILDERS[name](xp)
        _KERNELS[key] = kernel
    return kernel


def _build_sqnorm(xp):
    # Accumulate in double: the sum runs over N*D squares of float32 values.
    return xp.ReductionKernel("T x", "T y", "x * x", "a + b", "y = (T)a", "0",
                              "mpitrain_ng_sqnorm", reduce_type="double")


def _build_row_dots(xp):
    return xp.ReductionKernel("T x, T y", "T z", "x * y", "a + b", "z = (T)a", "0",
                              "mpitrain_ng_row_dots", reduce_type="double")


def _build_gamma(xp):
    return xp.ElementwiseKernel(
        "T x_sq, T xhat_sq", "T g",
        "g = (x_sq > (T)0 && xhat_sq > (T)0) ? (T)sqrt((double)x_sq / (double)xhat_sq) : (T)1",
        "mpitrain_ng_gamma")


def _build_add_scaled_rows(xp):
    return xp.ElementwiseKernel("T g, T w", "T j", "j += g * w",
                                "mpitrain_ng_add_scaled_rows")


def _build_scale_rows(xp):
    return xp.ElementwiseKernel("T v", "T x", "x *= v", "mpitrain_ng_scale_rows")


_BUILDERS = {
    "sqnorm": _build_sqnorm,
    "row_dots": _build_row_dots,
    "gamma": _build_gamma,
    "add_scaled_rows": _build_add_scaled_rows,
    "scale_rows": _build_scale_rows,
}


def sqnorm(x):
    """Squared Frobenius norm: a Python float on NumPy, a 0-d device array on CuPy.

    Example::

        sqnorm(np.ones((2, 3), np.float32))   # 6.0
    """
    xp = backend.get_array_module(x)
    if _is_numpy(xp):
        flat = x.reshape(-1)
        return float(np.dot(flat, flat))
    return _kernel(xp, "sqnorm")(x)


def row_dots(x, y):
    """Per-row inner products ``sum_j x_ij y_ij`` as a length-N array.

    Example::

        row_dots(x, x)   # squared row norms
    """
    xp = backend.get_array_module(x, y)
    if _is_numpy(xp):
        return np.einsum("ij,ij->i", x, y)
    return _kernel(xp, "row_dots")(x, y, axis=1)


def gamma(x_sq, xhat_sq):
    """``sqrt(x_sq / xhat_sq)``, or 1 when either is zero, in the norms' own form.

    Takes what :func:`sqnorm` returned, so on CuPy the result stays a 0-d
    device array and nothing waits for the GPU.

    Example::

        gamma(4.0, 1.0)   # 2.0
    """
    if isinstance(x_sq, float) and isinstance(xhat_sq, float):
        if x_sq > 0.0 and xhat_sq > 0.0:
            return float(np.sqrt(x_sq / xhat_sq))
        return 1.0
    xp = backend.get_array_module(x_sq, xhat_sq)
    return _kernel(xp, "gamma")(x_sq, xhat_sq)


def subtract_product_(x, h, w, tmp):
    """``x -= h @ w`` in place, using ``tmp`` (shape of ``x``) as scratch.

    Example::

        subtract_product_(x, x @ w.T, w, np.empty_like(x))   # x (I - w^T w)
    """
    xp = backend.get_array_module(x)
    xp.matmul(h, w, out=tmp)
    xp.subtract(x, tmp, out=x)
    return x


def add_scaled_rows_(j, g, w):
    """``j += g * w`` in place, ``g`` a column (r, 1) scaling the rows of ``w``.

    Example::

        add_scaled_rows_(j, np.ones((2, 1)), w)   # j += w
    """
    xp = backend.get_array_module(j)
    if _is_numpy(xp):
        j += g * w
        return j
    _kernel(xp, "add_scaled_rows")(g, w, j)
    return j


def scale_rows_(x, v):
    """``x *= v`` in place, ``v`` a column (N, 1) of per-row factors.

    Example::

        scale_rows_(x, np.full((len(x), 1), 2.0))   # doubles x
    """
    xp = backend.get_array_module(x)
    if _is_numpy(xp):
        x *= v
        return x
    _kernel(xp, "scale_rows")(v, x)
    return x


def fetch_float64(*arrays) -> list:
    """Host float64 copies of small arrays (or scalars), in one transfer on CuPy.

    Example::

        gram, x_sq = fetch_float64(gram_dev, x_sq_dev)
    """
    if all(isinstance(a, (float, int)) or not backend.is_gpu_array(a) for a in arrays):
        return [np.asarray(a, dtype=np.float64) for a in arrays]
    xp = backend.get_array_module(*[a for a in arrays if backend.is_gpu_array(a)])
    parts = [xp.asarray(a, dtype=xp.float64).reshape(-1) for a in arrays]
    host = backend.to_host(xp.concatenate(parts))
    out, start = [], 0
    for a, part in zip(arrays, parts):
        shape = getattr(a, "shape", ())
        out.append(host[start:start + part.size].reshape(shape))
        start += part.size
    return out
