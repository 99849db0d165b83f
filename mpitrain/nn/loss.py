"""Softmax cross-entropy over class labels, summed over the minibatch.

The gradient is of the *summed* loss, as in Kaldi, so learning rates carry
Kaldi's meaning (per frame) and do not change with the minibatch size.
"""

from __future__ import annotations

from .affine import _xp


class SoftmaxCrossEntropy:
    """Example::

        loss = SoftmaxCrossEntropy()
        total, correct = loss.forward(logits, labels)    # sums over rows
        dlogits = loss.backward()                        # d total / d logits
    """

    def __init__(self):
        self._probs = None
        self._labels = None

    def forward(self, logits, labels, *, need_grad: bool = True):
        """Return (summed cross-entropy, number of correct argmax predictions).

        Both are 0-d arrays of the logits' module, so no device sync is forced.
        ``logits`` is overwritten with the posteriors when ``need_grad``.
        """
        xp = _xp(logits)
        n = logits.shape[0]
        rows = xp.arange(n)
        correct = (xp.argmax(logits, axis=1) == labels).sum()
        probs = logits
        probs -= probs.max(axis=1, keepdims=True)
        xp.exp(probs, out=probs)
        sums = probs.sum(axis=1, keepdims=True)
        picked = probs[rows, labels]
        total = (xp.log(sums[:, 0]) - xp.log(xp.maximum(picked, 1e-30))).sum()
        if need_grad:
            probs /= sums
            self._probs, self._labels, self._rows = probs, labels, rows
        return total, correct

    def backward(self):
        grad = self._probs
        grad[self._rows, self._labels] -= 1
        return grad


def log_softmax(logits):
    """Row-wise log posteriors (a new array)."""
    xp = _xp(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
