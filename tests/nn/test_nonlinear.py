"""Nonlinear layers: float64 central-difference gradient checks, p-norm groups, RMS."""

import numpy as np
import pytest

from mpitrain.nn.nonlinear import Normalize, PNorm, ReLU, Sigmoid

from .gradcheck import check_component


def test_relu_gradients():
    # keep inputs away from the kink at 0, where the derivative is undefined
    x = np.random.default_rng(2).standard_normal((6, 7))
    x[np.abs(x) < 1e-3] = 0.5
    check_component(ReLU(7), x)


def test_sigmoid_gradients():
    check_component(Sigmoid(5), np.random.default_rng(3).standard_normal((4, 5)))


@pytest.mark.parametrize("p", [2.0, 3.0, 30.0])
def test_pnorm_gradients(p):
    check_component(PNorm(12, 4, p=p), np.random.default_rng(4).standard_normal((3, 12)))


def test_pnorm_groups_are_contiguous():
    x = np.arange(12, dtype=np.float64).reshape(1, 12)
    y = PNorm(12, 3, p=2.0).forward(x)
    expected = [np.sqrt((x[0, g * 4:(g + 1) * 4] ** 2).sum()) for g in range(3)]
    np.testing.assert_allclose(y[0], expected)


def test_pnorm_of_a_large_p_neither_overflows_nor_vanishes_in_float32():
    """|x|^100 is inf for x = 3 and 0 for x = 0.3 in float32: the norm came out inf
    (training NaN from the first step) or 0.  It is now taken relative to the
    group's largest |x|."""
    layer = PNorm(8, 2, p=100.0)
    x = np.array([[3.0] * 4 + [0.3] * 4, [0.0] * 4 + [-2.0, 1.0, 0.0, 0.5]], np.float32)
    y = layer.forward(x)
    want = [[3.0 * 4 ** 0.01, 0.3 * 4 ** 0.01], [0.0, 2.0 * (1 + 0.5 ** 100 + 0.25 ** 100) ** 0.01]]
    np.testing.assert_allclose(y, want, rtol=1e-6)
    dx = layer.backward(np.ones((2, 2), np.float32))
    assert np.isfinite(dx).all()
    # d y / d x_i = sign(x_i) (|x_i| / y)^(p - 1): the largest entries carry it
    np.testing.assert_allclose(dx[1], [0, 0, 0, 0, -1.0, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(dx[0, :4], [(1 / 4 ** 0.01) ** 99] * 4, rtol=1e-5)


def test_normalize_gradients_and_rms():
    x = np.random.default_rng(5).standard_normal((4, 6)) * 3
    check_component(Normalize(6, target_rms=1.0), x)
    y = Normalize(6, target_rms=2.0).forward(x)
    np.testing.assert_allclose(np.sqrt((y ** 2).mean(axis=1)), 2.0)
