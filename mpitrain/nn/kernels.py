"""Fused GPU kernels for the layers and the loss, with plain array fallbacks.

A training step on the GPU is bound by how many kernels the host launches,
not by arithmetic, once its matrix products are fast: every elementwise pass
written as array expressions costs a launch (and often a temporary).  These
kernels do each chain in one pass:

- ``softmax_xent_``: softmax, cross-entropy, argmax accuracy and the logits'
  gradient of one minibatch in one kernel (one block per row), plus one tiny
  kernel that adds the minibatch's sums to a device accumulator in a fixed
  order, so sums are reproducible and nothing is read back to the host;
- ``relu_backward``: ``dy * (y > 0)`` in one pass.

CuPy is never imported here: kernels are compiled from the array module that
:func:`mpitrain.backend.get_array_module` returns, when
:func:`mpitrain.backend.fused_kernels` allows it; otherwise (NumPy, or fused
kernels switched off) the same results come from array expressions.

Example::

    sums = xp.zeros(2, dtype=xp.float64)              # [cross-entropy, correct]
    softmax_xent_(logits, labels, sums, need_grad=True)   # logits -> d loss / d logits
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend

#: log(1e-30): a label's log posterior is floored here, so one bad row cannot make the sum inf.
LOG_FLOOR = math.log(1e-30)

THREADS = 256   # per block; a power of two for the tree reductions

SOURCE = r"""
#define THREADS 256

// One block per row of x (n x c, row-major).  Leaves d(sum of losses)/dx in x
// when need_grad, and the row's loss and correctness in row_loss/row_correct.
extern "C" __global__ void mpitrain_softmax_xent(
        float* x, const int* labels, const int n, const int c, const int need_grad,
        const float log_floor, float* row_loss, int* row_correct)
{
    __shared__ float s_val[THREADS];
    __shared__ int s_arg[THREADS];
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    if (row >= n) return;
    float* xr = x + (size_t)row * c;

    // max and first argmax (ties go to the lower index, as numpy's argmax)
    float best = -__int_as_float(0x7f800000);   // -inf (NVRTC has no INFINITY macro)
    int arg = c;
    for (int j = tid; j < c; j += THREADS) {
        const float v = xr[j];
        if (v > best || arg == c) { best = v; arg = j; }
    }
    s_val[tid] = best;
    s_arg[tid] = arg;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            const float v = s_val[tid + s];
            const int a = s_arg[tid + s];
            if (v > s_val[tid] || (v == s_val[tid] && a < s_arg[tid])) {
                s_val[tid] = v;
                s_arg[tid] = a;
            }
        }
        __syncthreads();
    }
    const float m = s_val[0];
    const int argmax = s_arg[0];
    __syncthreads();

    float sum = 0.0f;
    for (int j = tid; j < c; j += THREADS) sum += expf(xr[j] - m);
    s_val[tid] = sum;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_val[tid] += s_val[tid + s];
        __syncthreads();
    }
    const float total = s_val[0];
    const int label = labels[row];
    const float z = xr[label] - m;     // read by every thread before anyone writes x
    __syncthreads();

    if (tid == 0) {
        row_loss[row] = logf(total) - fmaxf(z, log_floor);
        row_correct[row] = (argmax == label) ? 1 : 0;
    }
    if (need_grad) {
        const float inv = 1.0f / total;
        for (int j = tid; j < c; j += THREADS) {
            const float p = expf(xr[j] - m) * inv;
            xr[j] = (j == label) ? p - 1.0f : p;
        }
    }
}

// One block: sums[0] += sum(row_loss), sums[1] += sum(row_correct), in a fixed order.
extern "C" __global__ void mpitrain_add_row_sums(
        const float* row_loss, const int* row_correct, const int n, double* sums)
{
    __shared__ double s_loss[THREADS];
    __shared__ double s_correct[THREADS];
    const int tid = threadIdx.x;
    double loss = 0.0, correct = 0.0;
    for (int i = tid; i < n; i += THREADS) {
        loss += (double)row_loss[i];
        correct += (double)row_correct[i];
    }
    s_loss[tid] = loss;
    s_correct[tid] = correct;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            s_loss[tid] += s_loss[tid + s];
            s_correct[tid] += s_correct[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0) {
        sums[0] += s_loss[0];
        sums[1] += s_correct[0];
    }
}
"""

_RELU_BACKWARD = ("T dy, T y", "T dx", "dx = y > (T)0 ? dy : (T)0", "mpitrain_relu_backward")


def _module(xp):
    return backend.raw_module(xp, "nn", SOURCE)


class _RowScratch:
    """Per-row loss and correctness buffers, reused for one minibatch size."""

    def __init__(self):
        self._arrays = {}

    def get(self, xp, n):
        key = (xp.__name__, n)
        if key not in self._arrays:
            self._arrays[key] = (xp.empty(n, dtype=xp.float32), xp.empty(n, dtype=xp.int32))
        return self._arrays[key]


_scratch = _RowScratch()


def softmax_xent_(logits, labels, sums, *, need_grad: bool = True):
    """Add the minibatch's summed cross-entropy and correct count to ``sums``.

    ``logits`` (N, C) float32 is overwritten: with the gradient of the summed
    loss w.r.t. the logits when ``need_grad``, else with scratch values.
    ``sums`` is a float64 array (2,) on the logits' device; it is only added to.

    Example::

        sums = np.zeros(2)
        softmax_xent_(np.zeros((4, 3), np.float32), np.array([0, 1, 2, 0]), sums)
        # sums[0] == 4 * log(3)
    """
    xp = backend.get_array_module(logits)
    n, c = logits.shape
    if n == 0:
        return sums
    if backend.fused_kernels(xp) and logits.flags.c_contiguous and logits.dtype == np.float32:
        if labels.dtype != np.int32 or not labels.flags.c_contiguous:
            labels = xp.ascontiguousarray(labels, dtype=xp.int32)
        row_loss, row_correct = _scratch.get(xp, n)
        module = _module(xp)
        module.get_function("mpitrain_softmax_xent")(
            (n,), (THREADS,), (logits, labels, np.int32(n), np.int32(c),
                               np.int32(1 if need_grad else 0), np.float32(LOG_FLOOR),
                               row_loss, row_correct))
        module.get_function("mpitrain_add_row_sums")(
            (1,), (THREADS,), (row_loss, row_correct, np.int32(n), sums))
        return sums
    total, correct, probs = _softmax_xent_expressions(xp, logits, labels, need_grad)
    sums[0] += total
    sums[1] += correct
    return sums


def _softmax_xent_expressions(xp, logits, labels, need_grad):
    rows = xp.arange(logits.shape[0])
    correct = (xp.argmax(logits, axis=1) == labels).sum()
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, labels]          # the label's shifted logit
    # Classes e^-69 (1e-30) below the best get probability 0, not a subnormal
    # float: a confident model otherwise fills the gradient with subnormals,
    # which make the CPU's backward products several times slower.  Such
    # terms cannot change a row sum of at least 1 in float32.
    xp.copyto(logits, np.float32(-np.inf), where=logits < np.float32(LOG_FLOOR))
    xp.exp(logits, out=logits)
    row_sums = logits.sum(axis=1, keepdims=True)
    total = (xp.log(row_sums[:, 0]) - xp.maximum(picked, LOG_FLOOR)).sum()
    if need_grad:
        logits /= row_sums
        logits[rows, labels] -= 1
    return total, correct, logits


def relu_backward(dy, y, out, mask):
    """``out = dy * (y > 0)``: one kernel on the GPU; elsewhere through the
    bool scratch ``mask`` (shape of ``dy``), so no float temporary is made.

    Example::

        relu_backward(dy, y, dx, np.empty(dy.shape, bool))
    """
    xp = backend.get_array_module(dy)
    if backend.fused_kernels(xp):
        return backend.elementwise_kernel(xp, *_RELU_BACKWARD)(dy, y, out)
    xp.greater(y, 0, out=mask)
    return xp.multiply(dy, mask, out=out)
