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


def test_each_side_gets_kaldis_rank_capped_at_half_its_dimension():
    """In: min(rank_in, (I + 1) div 2), out: min(rank_out, (O + 1) div 2), I and O
    the layer's dimensions (odd ones here, where (I + 1) div 2 and I div 2 differ)."""
    net = build_network(feat_dim=1, num_classes=7, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=9)
    # layer 0: 3 -> 9, layer 1: 9 -> 7
    for rank_in, rank_out, expected in ((20, 20, [2, 5, 5, 4]), (1, 3, [1, 3, 1, 3])):
        opt = NaturalGradientSGD(net, rank_in=rank_in, rank_out=rank_out)
        assert [opt.preconditioners[key].rank for key in
                ("layer0_in", "layer0_out", "layer1_in", "layer1_out")] == expected


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


def test_state_with_text_or_negative_counts_is_refused_naming_the_field():
    """A crafted checkpoint (its checksum made to match) with text where the rank
    or the step count belongs, or a negative count: the field is named (it said
    "invalid literal for int() with base 10: 'x'", or took -1 steps)."""
    _, opt = _trained()
    state = opt.state_dict()
    fresh = _trained(steps=0)[1]
    saved = state["preconditioners"]["layer1_in"]
    bad = dict(state, preconditioners=dict(state["preconditioners"],
                                           layer1_in=dict(saved, rank="x")))
    with pytest.raises(ValueError, match="preconditioner 'layer1_in': field 'rank': expected "
                                         "an int in .*, got 'x'"):
        fresh.load_state_dict(bad)
    for value in ("x", -1):
        with pytest.raises(ValueError, match="field 'num_steps': expected an int in \\[0, "):
            fresh.load_state_dict(dict(state, num_steps=value))
    fresh.load_state_dict(state)                      # the sound state: accepted


def test_state_of_another_rank_is_refused():
    """Saved estimates of another rank were taken as they were, so a changed
    rank_in or rank_out (``--resume --accept-changes``) was ignored until the
    next reset; now such a state is refused, naming the preconditioner."""
    net, opt = _trained()
    state = opt.state_dict()
    smaller = NaturalGradientSGD(net, rank_in=4, rank_out=12, update_period=2)
    with pytest.raises(ValueError, match="preconditioner 'layer0_in' has rank 8; the "
                                         "settings give it rank 4"):
        smaller.load_state_dict(state)
    # refused as a whole: no side is left loaded (layer0_in comes before the first
    # side whose rank differs)
    other_out = NaturalGradientSGD(net, rank_in=8, rank_out=6, update_period=2)
    with pytest.raises(ValueError, match="'layer0_out' has rank 12"):
        other_out.load_state_dict(state)
    assert all(p.t == 0 and not p.initialized for p in other_out.preconditioners.values())
    same = NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=2)
    same.load_state_dict(state)
    assert same.preconditioners["layer0_in"].W.shape[0] == 8



def test_a_side_that_fails_to_load_leaves_the_momentum_fresh():
    # (the momentum was loaded before the sides: a damaged side's refusal, which a
    # resume with changed settings takes as "starts afresh", kept the old momentum)
    net, _ = _trained(steps=0)
    opt = NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=2, momentum=0.5)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
        net.forward_backward(x, rng.integers(0, net.num_classes, 32))
        opt.step(0.01)
    state = opt.state_dict()
    assert np.any(state["delta"] != 0)
    side = dict(state["preconditioners"]["layer1_out"])
    side["pending_gram"], side["pending_rows"] = np.zeros((3, 3)), 1     # damaged
    state["preconditioners"] = dict(state["preconditioners"], layer1_out=side)
    fresh = NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=2, momentum=0.5)
    with pytest.raises(ValueError, match="pending_gram"):
        fresh.load_state_dict(state)
    assert not np.any(fresh.delta) and all(p.t == 0 for p in fresh.preconditioners.values())

@pytest.mark.parametrize("reset", [None, False, True])
def test_estimates_are_kept_across_averages_unless_asked(reset):
    """By default the Fisher estimates survive a model average (averages a few
    minibatches apart would keep every step in the costly start-up phase);
    ``reset_on_average=True`` starts them afresh, as each Kaldi job does.  The
    config's default is the optimizer's."""
    from mpitrain.config import NgsgdConfig, OptimizerConfig
    from mpitrain.optim.factory import build_optimizer
    net, _ = _trained(steps=0)
    cfg = OptimizerConfig(name="ngsgd", ngsgd=NgsgdConfig() if reset is None
                          else NgsgdConfig(reset_on_average=reset))
    opt = build_optimizer(cfg, net)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
        net.forward_backward(x, rng.integers(0, net.num_classes, 32))
        opt.step(0.01)
    before = {k: p.t for k, p in opt.preconditioners.items()}
    opt.after_average()
    after = {k: p.t for k, p in opt.preconditioners.items()}
    if reset:
        assert set(after.values()) == {0}
        assert not any(p.initialized for p in opt.preconditioners.values())
    else:
        assert after == before and set(after.values()) == {3}
    assert NaturalGradientSGD(net).reset_on_average is NgsgdConfig().reset_on_average is False


def test_delayed_updates_reach_every_preconditioner():
    from mpitrain.config import NgsgdConfig, OptimizerConfig
    from mpitrain.optim.factory import build_optimizer
    net, _ = _trained(steps=0)
    for delayed in (False, True):
        opt = build_optimizer(OptimizerConfig(name="ngsgd",
                                              ngsgd=NgsgdConfig(delayed_updates=delayed)), net)
        assert [p.delayed_updates for p in opt.preconditioners.values()] == [delayed] * 6
