"""Context splicing and CMVN, on NumPy and (through the ``xp`` fixture) CuPy,
and the fused GPU splice kernel (marked gpu) against NumPy."""

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.data.splice import (apply_cmvn, cmvn_coefficients, frame_utterance_bounds, splice,
                                  splice_batch_, splice_indices)


def reference_splice(feats, offsets, frames, left, right):
    """Frame by frame, with explicit loops: the definition."""
    rows = []
    for t in frames:
        u = max(k for k in range(len(offsets) - 1) if offsets[k] <= t)
        s, e = offsets[u], offsets[u + 1]
        rows.append(np.concatenate([feats[min(max(t + o, s), e - 1)]
                                    for o in range(-left, right + 1)]))
    return np.stack(rows)


def test_splice_matches_the_definition(xp):
    rng = np.random.default_rng(0)
    offsets = np.array([0, 1, 4, 12, 13, 30])          # includes 1-frame utterances
    feats = rng.normal(size=(30, 3)).astype(np.float32)
    frames = rng.permutation(30)[:17]
    expected = reference_splice(feats, offsets, frames, 5, 3)

    start, end = frame_utterance_bounds(xp.asarray(offsets))
    f = xp.asarray(frames)
    idx = splice_indices(f, start[f], end[f], 5, 3)
    assert idx.shape == (17, 9)
    got = splice(xp.asarray(feats), idx)
    np.testing.assert_array_equal(backend.to_host(got), expected)

    out = xp.full((17, 27), -1.0, dtype=xp.float32)
    idx_out = xp.zeros((17, 9), dtype=idx.dtype)
    assert splice_indices(f, start[f], end[f], 5, 3, out=idx_out) is idx_out
    assert splice(xp.asarray(feats), idx_out, out=out) is out
    np.testing.assert_array_equal(backend.to_host(out), expected)


def test_edges_repeat_within_the_utterance():
    idx = splice_indices(np.array([0, 4, 5, 9]), np.array([0, 0, 5, 5]), np.array([5, 5, 10, 10]),
                         2, 2)
    assert idx.tolist() == [[0, 0, 0, 1, 2], [2, 3, 4, 4, 4], [5, 5, 5, 6, 7], [7, 8, 9, 9, 9]]


def test_frame_utterance_bounds_of_a_chunk_not_starting_at_zero():
    start, end = frame_utterance_bounds(np.array([10, 12, 15]))
    assert start.tolist() == [10, 10, 12, 12, 12]
    assert end.tolist() == [12, 12, 15, 15, 15]


def test_splice_rejects_a_wrong_out_buffer():
    feats = np.zeros((4, 2), np.float32)
    idx = np.zeros((3, 3), np.int64)
    with pytest.raises(ValueError, match="shape"):
        splice(feats, idx, out=np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        splice(feats, idx, out=np.zeros((6, 3), np.float32).T)
    with pytest.raises(ValueError, match="non-negative"):
        splice_indices(np.arange(3), 0, 3, -1, 1)


def test_cmvn_gives_zero_mean_unit_variance(xp):
    rng = np.random.default_rng(1)
    feats = (rng.normal(size=(500, 4)) * [1, 2, 3, 4] + [5, -5, 0, 1]).astype(np.float32)
    shift, scale = cmvn_coefficients(feats.mean(0), feats.var(0), xp=xp)
    x = xp.asarray(feats)
    assert apply_cmvn(x, shift, scale, out=x) is x
    host = backend.to_host(x)
    np.testing.assert_allclose(host.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(host.var(0), 1, rtol=1e-4)
    # A constant dimension (variance 0) is floored instead of dividing by zero.
    _, scale = cmvn_coefficients([0.0], [0.0])
    assert np.isfinite(scale).all()


@pytest.mark.gpu
def test_splice_kernel_writes_a_layer_input_view(cp):
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((300, 7)).astype(np.float32)
    offsets = np.array([0, 40, 41, 190, 300])
    starts = np.repeat(offsets[:-1], np.diff(offsets))
    ends = np.repeat(offsets[1:], np.diff(offsets))
    idx = rng.permutation(300)[:64]
    want = splice(feats, splice_indices(idx, starts[idx], ends[idx], 3, 2))
    buffer = cp.full((64, 6 * 7 + 1), 5.0, dtype=cp.float32)   # an input with its bias column
    view = buffer[:, :42]
    splice_batch_(cp.asarray(feats), cp.asarray(idx), cp.asarray(starts), cp.asarray(ends),
                  3, 2, out=view)
    got = backend.to_host(buffer)
    np.testing.assert_array_equal(got[:, :42], want)
    assert (got[:, 42] == 5.0).all(), "the bias column is not touched"
