"""Softmax cross-entropy over class labels, summed over the minibatch.

The gradient is of the *summed* loss, as in Kaldi, so learning rates carry
Kaldi's meaning (per frame) and do not change with the minibatch size.
"""

from __future__ import annotations

from ..backend import get_array_module
from .kernels import softmax_xent_


class SoftmaxCrossEntropy:
    """Example::

        loss = SoftmaxCrossEntropy()
        total, correct = loss.forward(logits, labels)    # sums over rows
        dlogits = loss.backward()                        # d total / d logits
    """

    def __init__(self):
        self._grad = None

    def forward(self, logits, labels, *, need_grad: bool = True, into=None):
        """Return (summed cross-entropy, number of correct argmax predictions).

        Both are 0-d values of the logits' module, so no device sync is forced.
        With ``into`` (a float64 array of 2 on the logits' device) the two sums
        are added there instead and ``into`` is returned: a training loop keeps
        its running totals on the device and reads them once per log line.
        ``logits`` is overwritten (with the gradient when ``need_grad``).
        """
        xp = get_array_module(logits)
        sums = into if into is not None else xp.zeros(2, dtype=xp.float64)
        softmax_xent_(logits, labels, sums, need_grad=need_grad)
        self._grad = logits if need_grad else None
        if into is not None:
            return into
        return sums[0], sums[1]

    def backward(self):
        if self._grad is None:
            raise RuntimeError("SoftmaxCrossEntropy.backward: forward ran without need_grad")
        return self._grad


def log_softmax(logits):
    """Row-wise log posteriors (a new array)."""
    xp = get_array_module(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
