"""Affine layer y = x W^T + b, with the bias folded into the weight block.

The parameters of one layer are a single (out_dim, in_dim + 1) block
``[W | b]`` in the flat buffer, and the layer's input lives in a buffer with an
extra column of ones.  Then the forward pass, the weight-and-bias gradient and
the natural-gradient input rows (which Kaldi also forms as ``[x, 1]``) are each
one GEMM with no separate bias pass.

With preconditioners set (NG-SGD), the gradient block is formed from the
preconditioned input rows and output derivatives,
``g_in g_out Gh^T Xh``; the derivative passed back to the previous layer
still uses the raw output derivative.
"""

from __future__ import annotations

import math

from .. import backend
from ..backend import get_array_module
from .component import BufferCache, Component


class Affine(Component):
    """Fully connected layer.

    Example::

        layer = Affine(440, 1024)
        net = Network([layer, ReLU(1024), Affine(1024, 120)])   # binds buffers
    """

    kind = "affine"

    def __init__(self, in_dim: int, out_dim: int, *, init_scale: float = 1.0,
                 zero_init: bool = False):
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"Affine dims must be positive, got {in_dim}->{out_dim}")
        self.in_dim, self.out_dim = int(in_dim), int(out_dim)
        self.init_scale = float(init_scale)
        self.zero_init = bool(zero_init)
        # nnet2's max-change-per-sample: backward also sums ||x_i|| ||g_i|| over the
        # rows (preconditioned, times the gammas) into ``step_bound``
        self.track_step_bound = False
        self.step_bound = None
        self.block = None        # (out, in+1) view of the flat parameters
        self.grad_block = None   # same shape, view of the flat gradients
        self.preconditioner_in = None
        self.preconditioner_out = None
        self._buffers = BufferCache()
        self._xt = None

    # -- parameters ------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return self.out_dim * (self.in_dim + 1)

    def bind(self, params, grads) -> None:
        shape = (self.out_dim, self.in_dim + 1)
        self.block = params.reshape(shape)
        self.grad_block = grads.reshape(shape)

    @property
    def weight(self):
        return self.block[:, :self.in_dim]

    @property
    def bias(self):
        return self.block[:, self.in_dim]

    def init_params(self, rng, xp) -> None:
        if self.zero_init:
            self.block[...] = 0
            return
        std = self.init_scale / math.sqrt(self.in_dim)
        weights = rng.standard_normal((self.out_dim, self.in_dim)).astype("float32") * std
        self.block[:, :self.in_dim] = xp.asarray(weights)
        self.block[:, self.in_dim] = 0

    def set_preconditioners(self, prec_in, prec_out) -> None:
        """Use natural-gradient preconditioners (``None, None`` for plain SGD)."""
        self.preconditioner_in, self.preconditioner_out = prec_in, prec_out

    # -- computation -----------------------------------------------------------
    def input_view(self, batch: int, xp):
        """The (batch, in_dim) view the previous layer should write into."""
        xt = self._buffers.get("xt", (batch, self.in_dim + 1), xp, self.block.dtype)
        if self._xt is not xt:
            xt[:, self.in_dim] = 1  # the bias column, written once per buffer
            self._xt = xt
        return xt[:, :self.in_dim]

    def forward(self, x, *, out=None):
        xp = get_array_module(x)
        batch = x.shape[0]
        x_in = self.input_view(batch, xp)
        if not _same_view(x, x_in):
            x_in[...] = x
        if out is None:
            out = self._buffers.get("y", (batch, self.out_dim), xp, x.dtype)
        backend.gemm(self._xt, self.block, out, trans_b=True)
        return out

    def backward(self, dy, *, need_input_grad: bool = True):
        xp = get_array_module(dy)
        batch = dy.shape[0]
        dx = None
        if need_input_grad:
            dx = self._buffers.get("dx", (batch, self.in_dim), xp, dy.dtype)
            backend.gemm(dy, self.weight, dx)
        if self.preconditioner_in is None:
            backend.gemm(dy, self._xt, self.grad_block, trans_a=True)
            if self.track_step_bound:
                self.step_bound = _row_norm_products(self._xt, dy, xp)
        else:
            self._natural_gradient(dy, xp)
        return dx

    def _natural_gradient(self, dy, xp):
        # The input rows are still needed by the previous layer's backward,
        # so the preconditioner works on a copy; dy is ours to overwrite.
        rows = self._buffers.get("xt_ng", self._xt.shape, xp, self._xt.dtype)
        rows[...] = self._xt
        rows_hat, gamma_in = self.preconditioner_in.precondition(rows)
        dy_hat, gamma_out = self.preconditioner_out.precondition(dy)
        if backend.is_gpu_array(dy_hat) and backend.is_gpu_array(gamma_in) \
                and backend.is_gpu_array(gamma_out):
            # The gammas stay on the device: cuBLAS reads their product as alpha.
            alpha = self._buffers.get("gamma", (), xp, dy_hat.dtype)
            xp.multiply(gamma_in, gamma_out, out=alpha)
            backend.gemm(dy_hat, rows_hat, self.grad_block, trans_a=True, alpha=alpha)
            if self.track_step_bound:
                self.step_bound = _row_norm_products(rows_hat, dy_hat, xp) * alpha
            return
        dy_hat *= gamma_in * gamma_out
        backend.gemm(dy_hat, rows_hat, self.grad_block, trans_a=True)
        if self.track_step_bound:
            self.step_bound = _row_norm_products(rows_hat, dy_hat, xp)

    def spec(self) -> dict:
        return {"kind": self.kind, "in_dim": self.in_dim, "out_dim": self.out_dim,
                "init_scale": self.init_scale, "zero_init": self.zero_init}


def _row_norm_products(rows, dy, xp):
    """sum_i ||rows_i|| ||dy_i||: nnet2's bound on ||dy^T rows|| (a 0-d array on a
    device: nothing is read back)."""
    return xp.dot(xp.sqrt(xp.einsum("ij,ij->i", rows, rows)),
                  xp.sqrt(xp.einsum("ij,ij->i", dy, dy)))


def _same_view(a, b) -> bool:
    """True when ``a`` and ``b`` are the very same memory window."""
    if a.shape != b.shape or a.strides != b.strides:
        return False
    return _data_ptr(a) == _data_ptr(b)


def _data_ptr(a):
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # cupy
        return a.data.ptr
    return a.__array_interface__["data"][0]
