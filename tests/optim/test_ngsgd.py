"""NaturalGradientSGD: the optimizer that gives each affine layer its two
preconditioners (natural_gradient.py has the method's own tests)."""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain.nn.network import build_network
from mpitrain.optim.ngsgd import NaturalGradientSGD


def _trained(seed=3, steps=3):
    net = build_network(feat_dim=6, num_classes=9, left_context=2, right_context=2,
                        hidden_layers=2, hidden_dim=40)
    net.init_params(seed=seed)
    opt = NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=2)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
        net.forward_backward(x, rng.integers(0, net.num_classes, 32))
        opt.step(0.01)
    return net, opt


def test_state_of_a_preconditioner_for_another_dimension_is_refused():
    """A checkpoint whose W does not fit its layer (damaged, or another model's)
    is refused when loaded, naming the preconditioner, instead of failing in a
    matrix product at the next step."""
    _, opt = _trained()
    state = opt.state_dict()
    fresh = _trained(steps=0)[1]
    fresh.load_state_dict(state)                      # the same model: accepted
    saved = state["preconditioners"]["layer1_in"]
    wide = dict(saved, W=np.zeros((saved["W"].shape[0], saved["W"].shape[1] + 1), np.float32))
    bad = dict(state, preconditioners=dict(state["preconditioners"], layer1_in=wide))
    with pytest.raises(ValueError, match="preconditioner 'layer1_in' has W of shape"):
        fresh.load_state_dict(bad)
