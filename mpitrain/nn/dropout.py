"""Dropout on the outputs of hidden layers, with Kaldi's dropout schedule.

The rule, for a hidden layer's output h and proportion p (training only)::

    m_i = 1 with probability 1 - p, else 0;   h_i <- h_i m_i / (1 - p)
    backward:  dL/dh_i <- dL/dh_i m_i / (1 - p)

Evaluation uses h unchanged: the 1/(1 - p) keeps its expectation, so a saved
model carries no dropout at all.  The proportion follows a piecewise-linear
schedule over the fraction of training done, written as Kaldi's
``--trainer.dropout-schedule``: ``"0,0.2@0.5,0"`` is 0 at the start, 0.2 half
way, 0 at the end.

Masks come from a counter-based hash of (seed, rank, step, layer, element),
not from a random generator's state: nothing to checkpoint, a resumed run
draws the masks the uninterrupted run would have drawn, and NumPy and CuPy
draw the same masks.
"""

from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from ..words import shown

_MASK32 = 0xFFFFFFFF
# odd constant spreading neighbouring element indices over the 32 bits
_GOLDEN = np.uint32(0x9E3779B9)


def parse_dropout_schedule(text: str) -> list:
    """``"0,0.2@0.5,0"`` -> [(0.0, 0.0), (0.5, 0.2), (1.0, 0.0)] (fraction, proportion).

    Kaldi's form: comma-separated ``value[@fraction]``; the first point is at
    fraction 0 and the last at 1, points without a fraction in between are
    spaced evenly, and fractions must not decrease.  A single value is a
    constant proportion.  Raises ValueError on anything else.
    """
    pieces = [p.strip() for p in str(text).split(",")]
    if not pieces or any(not p for p in pieces):
        raise ValueError(f"expected comma-separated value[@fraction] pieces, e.g. "
                         f"'0,0.2@0.5,0', got {shown(text)}")
    values, fractions = [], []
    for piece in pieces:
        value, _, at = piece.partition("@")
        try:
            v = float(value)
            f = float(at) if at else None
        except ValueError:
            raise ValueError(f"{shown(piece)} in {shown(text)} is not value[@fraction]") from None
        if not 0.0 <= v < 1.0:
            raise ValueError(f"dropout proportion {v:g} in {shown(text)} is not in [0, 1)")
        if f is not None and not 0.0 <= f <= 1.0:
            raise ValueError(f"fraction {f:g} in {shown(text)} is not in [0, 1]")
        values.append(v)
        fractions.append(f)
    if len(values) == 1:
        return [(0.0, values[0]), (1.0, values[0])]
    if fractions[0] not in (None, 0.0) or fractions[-1] not in (None, 1.0):
        raise ValueError(f"{shown(text)}: the first point is at fraction 0 and the last at 1")
    fractions[0], fractions[-1] = 0.0, 1.0
    # points without a fraction are spaced evenly between their neighbours
    i = 0
    while i < len(fractions):
        if fractions[i] is None:
            j = i
            while fractions[j] is None:
                j += 1
            lo, hi = fractions[i - 1], fractions[j]
            for k in range(i, j):
                fractions[k] = lo + (hi - lo) * (k - i + 1) / (j - i + 1)
            i = j
        i += 1
    if any(b < a for a, b in zip(fractions, fractions[1:])):
        raise ValueError(f"{shown(text)}: fractions must not decrease")
    return list(zip(fractions, values))


class DropoutSchedule:
    """The dropout proportion at each point of training.

    Example::

        schedule = DropoutSchedule("0,0.2@0.5,0")
        schedule.proportion(0.25)     # 0.1
    """

    def __init__(self, text: str):
        self.text = str(text)
        self.points = parse_dropout_schedule(text)

    @property
    def active(self) -> bool:
        return any(v > 0 for _, v in self.points)

    @property
    def rises(self) -> bool:
        """Whether the proportion goes up at some point after the start."""
        return self.last_rise_end > 0.0

    @property
    def last_rise_end(self) -> float:
        """The fraction of training after which the proportion never rises again."""
        ends = [f1 for (_, v0), (f1, v1) in zip(self.points, self.points[1:]) if v1 > v0]
        return max(ends, default=0.0)

    def proportion(self, fraction: float) -> float:
        """The proportion at ``fraction`` (0: start, 1: end) of training."""
        f = min(max(float(fraction), 0.0), 1.0)
        pts = self.points
        for (f0, v0), (f1, v1) in zip(pts, pts[1:]):
            if f <= f1:
                if f1 == f0:
                    return v0
                # kept between the ends: rounding took '0,0.2@0.6,0' to -2.8e-17
                # at the end of training, which the masks refuse
                v = v0 + (v1 - v0) * (f - f0) / (f1 - f0)
                return min(max(v, min(v0, v1)), max(v0, v1))
        return pts[-1][1]


def _fmix32(h: int) -> int:
    """MurmurHash3's finaliser on a Python int (the per-step key)."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h


def dropout_key(seed: int, rank: int, step: int, layer: int) -> int:
    """A 32-bit key for one layer's mask at one step of one rank."""
    h = _fmix32(int(seed) * 0x27D4EB2F + 0x165667B1)
    for part in (rank, step, layer):
        h = _fmix32(h ^ _fmix32(int(part) + 0x9E3779B9))
    return h


class DropoutMasks:
    """Per-layer masks ``m / (1 - p)`` for one minibatch, in reused buffers.

    Example::

        masks = DropoutMasks(seed=1, rank=0)
        masks.draw(step=10, proportion=0.2)
        h = masks.apply(layer=0, h)          # in the forward pass
        dh = masks.apply(layer=0, dh)        # in the backward pass
    """

    def __init__(self, *, seed: int, rank: int = 0):
        self.seed, self.rank = int(seed), int(rank)
        self.step, self.proportion = 0, 0.0
        self._buffers = {}      # layer -> (uint32 scratch, float mask, key it holds)

    def draw(self, *, step: int, proportion: float) -> None:
        """Masks for ``step`` at ``proportion`` (each layer's is made when first used)."""
        if not 0.0 <= proportion < 1.0:
            raise ValueError(f"dropout proportion must be in [0, 1), got {proportion}")
        self.step, self.proportion = int(step), float(proportion)

    @property
    def active(self) -> bool:
        return self.proportion > 0.0

    def mask(self, layer: int, shape, xp, dtype):
        """The mask of hidden layer ``layer`` at the current step (``shape`` rows x dims)."""
        key = (self.step, self.proportion)
        held = self._buffers.get(layer)
        if held is None or held.mask.shape != tuple(shape) or held.mask.dtype != np.dtype(dtype):
            held = self._buffers[layer] = _MaskBuffers(shape, xp, dtype)
        if held.made_for != key:
            held.bits_for(dropout_key(self.seed, self.rank, self.step, layer))
            threshold = np.uint32(min(int(self.proportion * 2.0 ** 32), _MASK32))
            xp.greater_equal(held.bits, threshold, out=held.keep)
            # a NumPy scalar, not a 0-d array: CuPy takes the one, not the other
            xp.multiply(held.keep, np.dtype(dtype).type(1.0 / (1.0 - self.proportion)),
                        out=held.mask)
            held.made_for = key
        return held.mask

    def apply(self, layer: int, h):
        """``h * mask`` in place (forward on the output, backward on its derivative)."""
        xp = get_array_module(h)
        h *= self.mask(layer, h.shape, xp, h.dtype)
        return h


class _MaskBuffers:
    """One layer's reused buffers: hashed bits, keep flags, the float mask."""

    def __init__(self, shape, xp, dtype):
        size = int(np.prod(shape))
        self.xp = xp
        # element index * an odd constant: the per-element half of the hash input
        self.spread = xp.arange(size, dtype=np.uint32).reshape(shape)
        self.spread *= _GOLDEN
        self.bits = xp.empty(shape, dtype=np.uint32)
        self.shifted = xp.empty(shape, dtype=np.uint32)
        self.keep = xp.empty(shape, dtype=bool)
        self.mask = xp.empty(shape, dtype=dtype)
        self.made_for = None

    def bits_for(self, key: int):
        """32 hashed bits per element of (key, element index) into ``bits``."""
        xp, bits, shifted = self.xp, self.bits, self.shifted
        xp.add(self.spread, np.uint32(key), out=bits)
        # MurmurHash3's finaliser, in uint32 (products wrap modulo 2^32)
        for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
            xp.right_shift(bits, np.uint32(shift), out=shifted)
            xp.bitwise_xor(bits, shifted, out=bits)
            if factor is not None:
                xp.multiply(bits, np.uint32(factor), out=bits)
        return bits
