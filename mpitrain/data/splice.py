"""Context splicing and CMVN on whatever device the frames live on.

Frames stay unspliced in memory (T, D); a minibatch is spliced on the fly by
gathering rows ``i-left .. i+right`` of each chosen frame, clipped to its own
utterance so that context never leaks across utterances (edge frames are
repeated instead).  Every function uses the array module of its inputs, so
the same code runs on NumPy and CuPy.

Example::

    start, end = frame_utterance_bounds(offsets)             # per-frame utterance bounds
    batch = xp.asarray([3, 17, 42])
    idx = splice_indices(batch, start[batch], end[batch], 5, 5)   # (3, 11)
    x = splice(feats, idx)                                    # (3, 11 * D)
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..backend import get_array_module


def context_offsets(left: int, right: int, xp=np, dtype=np.int64):
    """The offsets ``-left .. right`` as a 1-D array.

    Example::

        context_offsets(2, 1)     # array([-2, -1, 0, 1])
    """
    if left < 0 or right < 0:
        raise ValueError(f"context must be non-negative, got left={left}, right={right}")
    return xp.arange(-left, right + 1, dtype=dtype)


def frame_utterance_bounds(offsets):
    """Per-frame (start, end) of the utterance each frame belongs to.

    ``offsets`` (U+1,) are utterance frame offsets of a chunk (``offsets[0]``
    may be non-zero; frames ``offsets[0]:offsets[-1]`` are covered and
    frame ``t`` of the result is frame ``offsets[0] + t``).  Returns two int64
    arrays of length ``offsets[-1] - offsets[0]``.

    Example::

        frame_utterance_bounds(np.array([0, 2, 5]))
        # (array([0, 0, 2, 2, 2]), array([2, 2, 5, 5, 5]))
    """
    xp = get_array_module(offsets)
    offsets = xp.asarray(offsets, dtype=xp.int64)
    frames = xp.arange(int(offsets[0]), int(offsets[-1]), dtype=xp.int64)
    # Utterance index of each frame: the last offset at or before it.
    utt = xp.searchsorted(offsets, frames, side="right") - 1
    return offsets[utt], offsets[utt + 1]


def splice_indices(frame_idx, utt_start, utt_end, left: int, right: int, *, out=None):
    """Row indices (B, left+1+right) of the spliced context of each frame.

    Row ``b`` is ``clip(frame_idx[b] + o, utt_start[b], utt_end[b] - 1)`` for
    ``o = -left .. right``.  ``utt_start``/``utt_end`` may be arrays (B,) or
    scalars.  ``out`` (B, C) of an integer dtype is filled in place.

    Example::

        splice_indices(np.array([0, 4]), np.array([0, 0]), np.array([5, 5]), 1, 1)
        # [[0, 0, 1], [3, 4, 4]]
    """
    xp = get_array_module(frame_idx)
    frame_idx = xp.asarray(frame_idx)
    dtype = frame_idx.dtype if frame_idx.dtype.kind in "iu" else xp.int64
    offs = context_offsets(left, right, xp, dtype)
    start = xp.asarray(utt_start)
    last = xp.asarray(utt_end) - 1
    if start.ndim:
        start = start[:, None]
    if last.ndim:
        last = last[:, None]
    if out is None:
        out = frame_idx[:, None] + offs[None, :]
    else:
        xp.add(frame_idx[:, None], offs[None, :], out=out)
    # Two one-sided clips: xp.clip with array bounds and out= is not uniform across backends.
    xp.maximum(out, start, out=out)
    xp.minimum(out, last, out=out)
    return out


def splice(feats, idx, *, out=None):
    """Gather spliced inputs: ``feats[idx].reshape(B, C * D)``.

    ``out`` (B, C*D), C-contiguous and of ``feats``' dtype, is filled in
    place without a temporary.

    Example::

        x = splice(feats, idx)                 # (B, C * D)
        splice(feats, idx, out=buffer)         # reuses buffer
    """
    xp = get_array_module(feats)
    batch, width = idx.shape
    dim = feats.shape[1]
    if out is None:
        return xp.take(feats, idx, axis=0).reshape(batch, width * dim)
    if out.shape != (batch, width * dim) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous with shape {(batch, width * dim)}, "
                         f"got {out.shape}")
    view = out.reshape(batch, width, dim)
    if xp is np:
        # mode="raise" would gather into a hidden temporary first; the indices
        # come from splice_indices and are in range, so "clip" changes nothing.
        np.take(feats, idx, axis=0, out=view, mode="clip")
    else:
        xp.take(feats, idx, axis=0, out=view)
    return out


_SPLICE_KERNEL = (
    "raw T feats, raw I frames, raw J utt_start, raw J utt_end, int32 dim, int32 width, "
    "int32 left",
    "T out",
    """
    const long long per_row = (long long)width * dim;
    const long long row = i / per_row;
    const int rest = (int)(i - row * per_row);
    const int c = rest / dim;
    const int d = rest - c * dim;
    const long long f = (long long)frames[row];
    const long long lo = (long long)utt_start[f];
    const long long hi = (long long)utt_end[f] - 1;
    long long t = f + c - left;
    t = t < lo ? lo : (t > hi ? hi : t);
    out = feats[t * dim + d];
    """,
    "mpitrain_splice")


def splice_batch_(feats, frame_idx, utt_start, utt_end, left: int, right: int, *, out, ctx=None):
    """Splice the frames ``frame_idx`` of a chunk into ``out`` (B, C * D).

    ``utt_start``/``utt_end`` are the chunk's per-frame utterance bounds (all
    frames, not just the chosen ones).  On the GPU this is one kernel that may
    write into a strided view (such as a layer's input buffer); elsewhere it is
    :func:`splice_indices` into ``ctx`` (B, C) then :func:`splice`, and ``out``
    must be C-contiguous.

    Example::

        splice_batch_(chunk.feats, idx, chunk.utt_start, chunk.utt_end, 5, 5,
                      out=buffer, ctx=np.empty((len(idx), 11), np.int64))
    """
    xp = get_array_module(feats)
    width = left + 1 + right
    dim = feats.shape[1]
    if out.shape != (frame_idx.shape[0], width * dim):
        raise ValueError(f"out must have shape {(frame_idx.shape[0], width * dim)}, got {out.shape}")
    if backend.fused_kernels(xp) and feats.flags.c_contiguous:
        backend.elementwise_kernel(xp, *_SPLICE_KERNEL)(
            feats, frame_idx, utt_start, utt_end, np.int32(dim), np.int32(width),
            np.int32(left), out)
        return out
    ctx = splice_indices(frame_idx, utt_start[frame_idx], utt_end[frame_idx], left, right,
                         out=ctx)
    return splice(feats, ctx, out=out)


def cmvn_coefficients(mean, var, *, var_floor: float = 1e-10, xp=np, dtype=np.float32):
    """(shift, scale) such that ``(x + shift) * scale`` has zero mean and unit variance.

    Example::

        shift, scale = cmvn_coefficients(manifest.cmvn_mean, manifest.cmvn_var)
    """
    mean = np.asarray(mean, dtype=np.float64)
    var = np.maximum(np.asarray(var, dtype=np.float64), var_floor)
    shift = xp.asarray(-mean, dtype=dtype)
    scale = xp.asarray(1.0 / np.sqrt(var), dtype=dtype)
    return shift, scale


def apply_cmvn(feats, shift, scale, *, out=None):
    """``(feats + shift) * scale``, in place when ``out is feats``.

    Example::

        apply_cmvn(feats, shift, scale, out=feats)
    """
    xp = get_array_module(feats)
    out = xp.add(feats, shift, out=out)
    xp.multiply(out, scale, out=out)
    return out
