"""Array kernels of the optimizers, on NumPy or CuPy: NG-SGD's preconditioner
pieces and SGD's max-change step.

Every function takes arrays of one array module and does the same math on
all: NumPy expressions on the host; on the GPU small CUDA kernels (a
one-launch sum of squares, an elementwise gamma, a row-scaled add, the
three-kernel max-change step) that never wait for the host; and the same
array expressions on a device module that cannot compile kernels (or with
``fused_kernels: false``).  CuPy is never imported here: the kernels are
built lazily from the array module that :func:`mpitrain.backend.get_array_module`
returns for the arrays at hand, and cached.

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


def _compiles(xp) -> bool:
    """Whether this module's fused kernels may be used (CuPy with kernels allowed)."""
    return backend.fused_kernels(xp)


def _kernel(xp, name: str):
    """The CuPy kernel ``name`` built from module ``xp``, compiled once."""
    key = (xp.__name__, name)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _BUILDERS[name](xp)
        _KERNELS[key] = kernel
    return kernel


SUMSQ_SOURCE = r"""
#define THREADS 256

// Sum of squares of n floats in one launch over many blocks: each block writes
// its partial sum; the last block to finish adds the partials in block order,
// so the result does not depend on scheduling.  counter must start at 0 and
// is left at 0.
extern "C" __global__ void mpitrain_sumsq(
        const float* x, const long long n, double* partial, unsigned int* counter,
        float* out)
{
    __shared__ double s_sum[THREADS];
    __shared__ bool s_last;
    const int tid = threadIdx.x;
    double acc = 0.0;
    for (long long i = blockIdx.x * (long long)THREADS + tid; i < n;
         i += (long long)gridDim.x * THREADS) {
        const double v = (double)x[i];
        acc += v * v;
    }
    s_sum[tid] = acc;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_sum[tid] += s_sum[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        partial[blockIdx.x] = s_sum[0];
        __threadfence();
        s_last = (atomicAdd(counter, 1u) == gridDim.x - 1);
    }
    __syncthreads();
    if (!s_last) return;
    // The other blocks' partials are read only after their fence and count: the
    // fence here orders these reads after the count for every thread of the block
    // (not only thread 0), and volatile loads skip the SM's L1, which is not
    // coherent with the writes of other SMs.
    __threadfence();
    const volatile double* done = partial;
    double total = 0.0;
    for (int b = tid; b < gridDim.x; b += THREADS) total += done[b];   // fixed split
    s_sum[tid] = total;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_sum[tid] += s_sum[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        *out = (float)s_sum[0];
        *counter = 0u;
    }
}
"""

SUMSQ_MAX_BLOCKS = 264   # two per SM on an H100: enough to stream at full bandwidth


class _SumsqScratch:
    def __init__(self, xp):
        self.partial = xp.zeros(SUMSQ_MAX_BLOCKS, dtype=xp.float64)
        self.counter = xp.zeros(1, dtype=xp.uint32)


def _build_sqnorm(xp):
    module = backend.raw_module(xp, "optim_sumsq", SUMSQ_SOURCE)
    function = module.get_function("mpitrain_sumsq")
    scratch = _SumsqScratch(xp)

    def sqnorm_kernel(x, out=None):
        # One kernel over all the blocks of the GPU (a ReductionKernel reduces a
        # whole matrix to one value with a single block, at a fraction of the
        # memory bandwidth); accumulated in double.
        if not x.flags.c_contiguous or x.dtype != np.float32:
            flat = x.astype(np.float64).reshape(-1)
            result = xp.dot(flat, flat).astype(x.dtype)
            if out is None:
                return result
            out[...] = result
            return out
        n = x.size
        if out is None:
            out = xp.empty((), dtype=xp.float32)
        blocks = max(1, min(SUMSQ_MAX_BLOCKS, (n + 4 * 256 - 1) // (4 * 256)))
        function((blocks,), (256,), (x, np.int64(n), scratch.partial, scratch.counter, out))
        return out

    return sqnorm_kernel


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


def sqnorm(x, out=None):
    """Squared Frobenius norm: a Python float on NumPy, a 0-d device array on CuPy
    (written into ``out``, a 0-d float32 device array, when given).

    Example::

        sqnorm(np.ones((2, 3), np.float32))   # 6.0
    """
    xp = backend.get_array_module(x)
    flat = x.reshape(-1)
    if _is_numpy(xp):
        return float(np.dot(flat, flat))
    if _compiles(xp):
        return _kernel(xp, "sqnorm")(x, out)
    result = xp.dot(flat, flat)
    if out is None:
        return result
    out[...] = result
    return out


def row_dots(x, y):
    """Per-row inner products ``sum_j x_ij y_ij`` as a length-N array.

    Example::

        row_dots(x, x)   # squared row norms
    """
    xp = backend.get_array_module(x, y)
    if _compiles(xp):
        return _kernel(xp, "row_dots")(x, y, axis=1)
    return xp.einsum("ij,ij->i", x, y)


def gamma(x_sq, xhat_sq, out=None):
    """``sqrt(x_sq / xhat_sq)``, or 1 when either is zero, in the norms' own form
    (on a device written into ``out`` when given).

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
    if _compiles(xp):
        if out is None:
            return _kernel(xp, "gamma")(x_sq, xhat_sq)
        return _kernel(xp, "gamma")(x_sq, xhat_sq, out)
    both = (x_sq > 0) & (xhat_sq > 0)
    ratio = x_sq.astype(xp.float64) / xp.where(both, xhat_sq, 1).astype(xp.float64)
    result = xp.where(both, xp.sqrt(ratio), 1.0).astype(x_sq.dtype)
    if out is None:
        return result
    out[...] = result
    return out


def subtract_product_(x, h, w, tmp):
    """``x -= h @ w`` in place, using ``tmp`` (shape of ``x``) as scratch.

    On the GPU this is one GEMM with beta = 1 and ``tmp`` is not touched.

    Example::

        subtract_product_(x, x @ w.T, w, np.empty_like(x))   # x (I - w^T w)
    """
    xp = backend.get_array_module(x)
    if backend.fused_kernels(xp):
        return backend.gemm(h, w, x, alpha=-1.0, beta=1.0)
    xp.matmul(h, w, out=tmp)
    xp.subtract(x, tmp, out=x)
    return x


def add_scaled_rows_(j, g, w):
    """``j += g * w`` in place, ``g`` a column (r, 1) scaling the rows of ``w``.

    Example::

        add_scaled_rows_(j, np.ones((2, 1)), w)   # j += w
    """
    xp = backend.get_array_module(j)
    if not _compiles(xp):
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
    if not _compiles(xp):
        x *= v
        return x
    _kernel(xp, "scale_rows")(v, x)
    return x


# -- SGD with max-change, on the device ------------------------------------------------
# The step is three kernels over the flat buffers whatever the number of layers:
# (1) delta = [delta +] (-lr) g (stored only with momentum) with per-block partial
# sums of squares, every block
# inside one layer; (2) one block adds the partials of each layer in a fixed
# order, so the norms are reproducible, and turns them into per-layer scales
# (0 for every layer when a norm is not finite: the step is skipped and counted);
# (3) params += scale * delta, and momentum decays delta.  Nothing is read back.

SGD_SOURCE = r"""
#define THREADS 256

// The rate is read from device memory (-lr at neg_lr[0]) so that a captured
// CUDA graph of the step follows the schedule.
extern "C" __global__ void mpitrain_sgd_delta_sumsq(
        float* delta, const float* grads, const float* neg_lr_cell, const int accumulate,
        const long long* begin, const long long* end, double* partial)
{
    __shared__ double s_sum[THREADS];
    const float neg_lr = neg_lr_cell[0];
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    double acc = 0.0;
    for (long long j = begin[b] + tid; j < end[b]; j += THREADS) {
        const float g = grads[j] * neg_lr;
        const float d = accumulate ? delta[j] + g : g;
        if (accumulate) delta[j] = d;       // without momentum (3) recomputes d: no write
        acc += (double)d * (double)d;
    }
    s_sum[tid] = acc;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_sum[tid] += s_sum[tid + s];
        __syncthreads();
    }
    if (tid == 0) partial[b] = s_sum[0];
}

// One block of THREADS threads; num_layers <= THREADS.
extern "C" __global__ void mpitrain_sgd_scales(
        const double* partial, const int* first_block, const int num_layers,
        const double* limits, const double q, const double max_change,
        float* scales, double* norms, int* finite_out, long long* skipped)
{
    __shared__ double s_norm[THREADS];
    const int tid = threadIdx.x;
    if (tid < num_layers) {
        double sq = 0.0;
        for (int b = first_block[tid]; b < first_block[tid + 1]; ++b) sq += partial[b];
        s_norm[tid] = sqrt(sq);
        norms[tid] = s_norm[tid];
    }
    __syncthreads();
    if (tid != 0) return;
    int finite = 1;
    double total_sq = 0.0;
    for (int l = 0; l < num_layers; ++l) {
        const double n = s_norm[l];
        if (!isfinite(n)) finite = 0;
        double k = 1.0;
        if (limits[l] > 0.0 && n * q > limits[l]) k = limits[l] / (n * q);
        s_norm[l] = k;                       // the norm is no longer needed: keep k
        total_sq += (k * n) * (k * n);
    }
    const double total = q * sqrt(total_sq);
    double factor = q;
    if (max_change > 0.0 && total > max_change) factor = q * max_change / total;
    for (int l = 0; l < num_layers; ++l) scales[l] = finite ? (float)(factor * s_norm[l]) : 0.0f;
    finite_out[0] = finite;
    if (!finite) skipped[0] += 1;
}

extern "C" __global__ void mpitrain_sgd_apply(
        float* params, float* delta, const float* grads, const float* neg_lr_cell,
        const float* scales, const int* finite, const int* block_layer,
        const long long* begin, const long long* end, const float momentum,
        const int has_momentum)
{
    const float neg_lr = neg_lr_cell[0];
    const int b = blockIdx.x;
    const float s = scales[block_layer[b]];
    const int ok = finite[0];
    for (long long j = begin[b] + threadIdx.x; j < end[b]; j += THREADS) {
        const float d = has_momentum ? delta[j] : grads[j] * neg_lr;
        // a skipped step leaves the parameters alone and clears momentum (d may be NaN)
        if (ok) params[j] = params[j] + s * d;
        if (has_momentum) delta[j] = ok ? d * momentum : 0.0f;
    }
}
"""

SGD_THREADS = 256
SGD_BLOCK_ELEMENTS = 16384   # elements per block of kernels (1) and (3)


class MaxChangeState:
    """Device buffers of the max-change step for one flat parameter layout.

    ``offsets``: the (begin, end) of each layer's parameters in the flat buffer;
    ``limits``: each layer's max-change (0: none).  Holds the per-layer scales of
    the last step, its finiteness flag and the count of skipped steps, all on
    the device.

    Example::

        state = MaxChangeState(cupy, [(0, 100), (100, 130)], [0.75, 1.5])
    """

    def __init__(self, xp, offsets, limits):
        if len(offsets) > SGD_THREADS:
            raise ValueError(f"max-change on the device handles at most {SGD_THREADS} layers, "
                             f"got {len(offsets)}")
        self.xp = xp
        self.offsets = [(int(a), int(b)) for a, b in offsets]
        self.num_layers = len(self.offsets)
        self.limits = xp.asarray(np.asarray(limits, dtype=np.float64))
        self.scales = xp.ones(self.num_layers, dtype=xp.float32)
        self.norms = xp.zeros(self.num_layers, dtype=xp.float64)
        self.finite = xp.ones(1, dtype=xp.int32)
        self.skipped = xp.zeros(1, dtype=xp.int64)
        self.neg_lr = xp.zeros(1, dtype=xp.float32)   # -lr, set before each step
        self.active = list(range(self.num_layers))     # the layers a step changes
        self._blocks = None

    def restrict(self, layers) -> None:
        """Step only ``layers`` (a run of consecutive layers, each whole); the others
        are not read, count as unchanged (norm 0) and keep their parameters."""
        self.active = sorted(int(i) for i in layers)
        self._blocks = None

    @property
    def span(self) -> tuple:
        """(begin, end) in the flat buffer of the layers a step changes."""
        return self.offsets[self.active[0]][0], self.offsets[self.active[-1]][1]

    def blocks(self):
        """(block_layer, begin, end, first_block, partial) for kernels (1)-(3); a
        layer outside :attr:`active` has no block (an empty run: norm 0)."""
        if self._blocks is None:
            layer_of, begins, ends, first = [], [], [], [0]
            active = set(self.active)
            for layer, (lo, hi) in enumerate(self.offsets):
                for start in range(lo, hi, SGD_BLOCK_ELEMENTS) if layer in active else ():
                    layer_of.append(layer)
                    begins.append(start)
                    ends.append(min(start + SGD_BLOCK_ELEMENTS, hi))
                first.append(len(begins))
            xp = self.xp
            self._blocks = (xp.asarray(np.asarray(layer_of, dtype=np.int32)),
                            xp.asarray(np.asarray(begins, dtype=np.int64)),
                            xp.asarray(np.asarray(ends, dtype=np.int64)),
                            xp.asarray(np.asarray(first, dtype=np.int32)),
                            xp.zeros(len(begins), dtype=xp.float64))
        return self._blocks


def max_change_step_(params, grads, delta, *, lr: float, momentum: float, max_change: float,
                     state: MaxChangeState) -> None:
    """One SGD step with Kaldi's max-change on device buffers, without host reads.

    ``delta`` is the momentum buffer, or None (then ``grads`` is the scratch
    for ``-lr g``).  Per layer c the scale is ``q k_c`` (``q = 1 - momentum``),
    shrunk further when the whole-model change exceeds ``max_change``; a
    non-finite norm skips the step (scales 0, momentum cleared, counted).

    Example::

        max_change_step_(net.params, net.grads, None, lr=0.002, momentum=0.0,
                         max_change=2.0, state=MaxChangeState(xp, offsets, limits))
    """
    xp = state.xp
    q = 1.0 - momentum
    if backend.fused_kernels(xp):
        module = backend.raw_module(xp, "optim_sgd", SGD_SOURCE)
        block_layer, begin, end, first_block, partial = state.blocks()
        blocks = (int(partial.size),)
        # without momentum delta is not stored: (3) recomputes -lr g from grads
        target = grads if delta is None else delta
        neg_lr = state.neg_lr
        if lr is not None:          # None: a captured graph, whose rate is set outside
            neg_lr.fill(-lr)
        module.get_function("mpitrain_sgd_delta_sumsq")(
            blocks, (SGD_THREADS,), (target, grads, neg_lr,
                                     np.int32(delta is not None), begin, end, partial))
        module.get_function("mpitrain_sgd_scales")(
            (1,), (SGD_THREADS,), (partial, first_block, np.int32(state.num_layers),
                                   state.limits, np.float64(q), np.float64(max_change),
                                   state.scales, state.norms, state.finite, state.skipped))
        module.get_function("mpitrain_sgd_apply")(
            blocks, (SGD_THREADS,), (params, target, grads, neg_lr, state.scales, state.finite,
                                     block_layer, begin, end, np.float32(momentum),
                                     np.int32(delta is not None)))
        return
    _max_change_expressions_(params, grads, delta, lr, momentum, max_change, state, q)


def _max_change_expressions_(params, grads, delta, lr, momentum, max_change, state, q):
    """The same step with array expressions: no host reads, a launch per layer."""
    xp = state.xp
    begin, end = state.span
    grads[begin:end] *= np.float32(-lr)
    if delta is not None:
        delta[begin:end] += grads[begin:end]
    change = grads if delta is None else delta
    active = set(state.active)
    # squares summed in float64, as kernel (1) sums them: float32's overflow from a
    # norm of ~1.8e19 on would skip a finite change that max-change clips
    sq = xp.stack([_sumsq64(change[lo:hi], xp) if i in active
                   else xp.zeros((), dtype=xp.float64)
                   for i, (lo, hi) in enumerate(state.offsets)])
    norms = xp.sqrt(sq)
    finite = xp.all(xp.isfinite(norms))
    safe = xp.where(xp.isfinite(norms), norms, 0.0)
    limits = state.limits
    capped = (limits > 0) & (safe * q > limits)
    k = xp.where(capped, limits / xp.maximum(safe * q, 1e-300), 1.0)
    total = q * xp.sqrt(xp.sum((k * safe) ** 2))
    shrink = xp.where((max_change > 0) & (total > max_change),
                      max_change / xp.maximum(total, 1e-300), 1.0)
    state.scales[...] = xp.where(finite, q * k * shrink, 0.0).astype(xp.float32)
    state.norms[...] = norms
    state.finite[...] = finite
    state.skipped += (~finite).astype(xp.int64)
    for i in state.active:
        lo, hi = state.offsets[i]
        # grads is free now (or is the change itself): it holds scale * change
        block = xp.multiply(change[lo:hi], state.scales[i], out=grads[lo:hi])
        # a skipped step must not add 0 * NaN
        params[lo:hi] += xp.where(finite, block, np.float32(0.0))
    if delta is not None:
        delta[begin:end] = xp.where(finite, delta[begin:end] * np.float32(momentum),
                                    np.float32(0.0))


def _sumsq64(x, xp):
    """sum(x^2) of a float32 vector in float64 (a 0-d device array)."""
    x64 = x.astype(xp.float64)
    return xp.dot(x64, x64)
