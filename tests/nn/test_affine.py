"""Affine layers: a float64 central-difference check of the gradients."""

import numpy as np

from mpitrain.nn.affine import Affine

from .gradcheck import check_component


def test_affine_gradients():
    x = np.random.default_rng(1).standard_normal((5, 4))
    check_component(Affine(4, 3), x)


def test_natural_gradient_step_is_the_worked_example_of_the_spec():
    """natural-gradient.md, section 6's affine example (I = O = 2, ranks 1, P = 4,
    lr 0.1, first call): the layer preconditions its rows [x, 1] and the output
    derivatives, so -lr times its gradient block is [Delta_W | Delta_b].  Kaldi's G
    is d objective / dY, the negative of the loss derivative the layer is given."""
    import pytest

    from mpitrain.optim.natural_gradient import OnlineNaturalGradient
    x = np.array([[1, 2], [0, 1], [-1, 0], [2, -1]], dtype=np.float64)
    g = np.array([[.5, -.5], [-1, 1], [.25, 0], [0, -.25]])
    layer = Affine(2, 2)
    params = np.array([0.3, -0.2, 0.1, 0.5, 0.4, -0.6])       # [W | b], any values
    layer.bind(params, np.zeros(6))
    layer.set_preconditioners(OnlineNaturalGradient(rank=1, update_period=4),
                              OnlineNaturalGradient(rank=1, update_period=4))
    layer.forward(x)
    dx = layer.backward(-g)
    # the derivative passed back uses the raw G (and W, which no step changed yet)
    np.testing.assert_allclose(dx, -g @ params.reshape(2, 3)[:, :2], rtol=1e-12)
    step = -0.1 * layer.grad_block
    assert step[:, :2] == pytest.approx(np.array([[0.0198211002, 0.0022418173],
                                                  [-0.1127451805, 0.0322482362]]), abs=1e-9)
    assert step[:, 2] == pytest.approx([-0.0257558527, 0.0302293728], abs=1e-9)
