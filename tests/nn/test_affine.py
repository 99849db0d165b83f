"""Affine layers: a float64 central-difference check of the gradients."""

import numpy as np

from mpitrain.nn.affine import Affine

from .gradcheck import check_component


def test_affine_gradients():
    x = np.random.default_rng(1).standard_normal((5, 4))
    check_component(Affine(4, 3), x)
