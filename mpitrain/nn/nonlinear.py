"""Parameter-free layers: ReLU, sigmoid, p-norm and Kaldi's normalize.

Each keeps what its backward pass needs (its output, or its input for p-norm)
and writes into reused buffers.
"""

from __future__ import annotations

from ..backend import get_array_module
from .component import BufferCache, Component
from .kernels import relu_backward

# the p-norm's scale floor: a group of zeros gives 0 (any positive scale does)
TINY = 1e-30
# the largest float32
FLOAT32_MAX = 3.4028234663852886e38


class _Elementwise(Component):
    def __init__(self, dim: int):
        if dim < 1:
            raise ValueError(f"{type(self).__name__} dim must be positive, got {dim}")
        self.in_dim = self.out_dim = int(dim)
        self._buffers = BufferCache()
        self._y = None

    def _out(self, x, out, name="y"):
        if out is None:
            out = self._buffers.get(name, (x.shape[0], self.out_dim), get_array_module(x),
                                    x.dtype)
        return out


class ReLU(_Elementwise):
    """max(x, 0).

    Example::

        ReLU(1024).forward(x)
    """

    kind = "relu"

    def forward(self, x, *, out=None):
        xp = get_array_module(x)
        self._y = xp.maximum(x, 0, out=self._out(x, out))
        return self._y

    def backward(self, dy, *, need_input_grad: bool = True):
        xp = get_array_module(dy)
        dx = self._buffers.get("dx", dy.shape, xp, dy.dtype)
        # dy * (y > 0) without a float temporary: the mask is bool.
        mask = self._buffers.get("mask", dy.shape, xp, dtype="bool")
        return relu_backward(dy, self._y, dx, mask)


class Sigmoid(_Elementwise):
    """1 / (1 + exp(-x)).

    Example::

        Sigmoid(1024).forward(x)
    """

    kind = "sigmoid"

    def forward(self, x, *, out=None):
        xp = get_array_module(x)
        y = self._out(x, out)
        xp.negative(x, out=y)
        xp.exp(y, out=y)
        y += 1
        xp.reciprocal(y, out=y)
        self._y = y
        return y

    def backward(self, dy, *, need_input_grad: bool = True):
        xp = get_array_module(dy)
        dx = self._buffers.get("dx", dy.shape, xp, dy.dtype)
        xp.subtract(1, self._y, out=dx)   # 1 - y
        dx *= self._y                     # y (1 - y)
        dx *= dy
        return dx


class PNorm(Component):
    """Kaldi's p-norm: y_j = (sum over group j of |x_i|^p)^(1/p).

    Groups are contiguous blocks of ``group_size`` inputs.

    Example::

        PNorm(3000, 300, p=2.0)      # group size 10
    """

    kind = "pnorm"

    def __init__(self, in_dim: int, out_dim: int, *, p: float = 2.0):
        if in_dim < 1 or out_dim < 1 or in_dim % out_dim:
            raise ValueError(f"PNorm in_dim {in_dim} must be a positive multiple of out_dim {out_dim}")
        if p < 1:
            raise ValueError(f"PNorm p must be >= 1, got {p}")
        self.in_dim, self.out_dim, self.p = int(in_dim), int(out_dim), float(p)
        self.group = self.in_dim // self.out_dim
        self._buffers = BufferCache()
        self._x = self._y = None

    def forward(self, x, *, out=None):
        xp = get_array_module(x)
        n = x.shape[0]
        self._x = x
        grouped = x.reshape(n, self.out_dim, self.group) if x.flags.c_contiguous \
            else xp.ascontiguousarray(x).reshape(n, self.out_dim, self.group)
        if out is None:
            out = self._buffers.get("y", (n, self.out_dim), xp, x.dtype)
        if self.p == 2.0:
            out[...] = xp.sqrt(xp.einsum("ngk,ngk->ng", grouped, grouped))
        else:
            # y = s (sum (|x|/s)^p)^(1/p) with s the group's largest |x|: |x|^p alone
            # overflows (or vanishes) in float32 for large p (p = 100 on 3.0 gave inf)
            magnitude = xp.abs(grouped)
            scale = xp.maximum(magnitude.max(axis=2, keepdims=True), TINY)
            out[...] = scale[:, :, 0] * ((magnitude / scale) ** self.p).sum(axis=2) \
                ** (1.0 / self.p)
        self._y = out
        return out

    def backward(self, dy, *, need_input_grad: bool = True):
        xp = get_array_module(dy)
        n = dy.shape[0]
        x = self._x.reshape(n, self.out_dim, self.group)
        y = self._y[:, :, None]
        safe_y = xp.where(y > 0, y, 1)
        if self.p == 2.0:
            local = x / safe_y
        else:
            # sign(x) (|x| / y)^(p-1): |x| <= y, so no power overflows
            local = xp.sign(x) * (xp.abs(x) / safe_y) ** (self.p - 1)
        local = xp.where(y > 0, local, 0)
        dx = self._buffers.get("dx", (n, self.in_dim), xp, dy.dtype)
        dx.reshape(n, self.out_dim, self.group)[...] = local * dy[:, :, None]
        return dx

    def spec(self) -> dict:
        return {**super().spec(), "p": self.p}


class Normalize(_Elementwise):
    """Kaldi's normalize layer: rescale each row to RMS ``target_rms``.

    y = f x with f = max(2^-66, |x|^2 / (D m^2))^(-1/2).

    Example::

        Normalize(300)
    """

    kind = "normalize"
    FLOOR = 2.0 ** -66

    def __init__(self, dim: int, *, target_rms: float = 1.0):
        super().__init__(dim)
        # The rows it gives are float32: a larger target cannot be reached, and its
        # square overflows the forward pass's arithmetic.
        if not 0 < target_rms <= FLOAT32_MAX:
            raise ValueError(f"Normalize target_rms must be in (0, {FLOAT32_MAX:.4g}] (a "
                             f"float32), got {target_rms}")
        self.target_rms = float(target_rms)

    def forward(self, x, *, out=None):
        xp = get_array_module(x)
        self._x = x
        power = (x * x).sum(axis=1, keepdims=True) / (self.in_dim * self.target_rms ** 2)
        self._floored = power < self.FLOOR
        self._f = xp.maximum(power, self.FLOOR) ** -0.5
        y = self._out(x, out)
        xp.multiply(x, self._f, out=y)
        return y

    def backward(self, dy, *, need_input_grad: bool = True):
        xp = get_array_module(dy)
        f, x = self._f, self._x
        dot = (dy * x).sum(axis=1, keepdims=True)
        coef = xp.where(self._floored, 0, f ** 3 / (self.in_dim * self.target_rms ** 2))
        dx = self._buffers.get("dx", dy.shape, xp, dy.dtype)
        xp.multiply(dy, f, out=dx)
        dx -= coef * dot * x
        return dx

    def spec(self) -> dict:
        return {**super().spec(), "target_rms": self.target_rms}
