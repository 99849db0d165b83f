"""A parallel method's saved state, as a forged checkpoint (its checksum recomputed)
would hand it over: each field is checked against what the method can produce, and
a refused state sets nothing.

A float64 buffer of 1e300 passes the file's finite check but becomes infinity in
the float32 model; a count of 2.5 was cut to 2 by int(); a quota of 0 or beyond the
period stopped a rank training, or made it train every step of another's period.
"""

import numpy as np
import pytest

from mpitrain.comm.single import SingleCommunicator
from mpitrain.comm.virtual import VirtualCluster
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.adpsgd import RingMixing
from mpitrain.parallel.async_adpsgd import AsyncRingMixing
from mpitrain.parallel.bmuf import BlockMomentum
from mpitrain.parallel.hierarchical_adpsgd import NodeRingMixing
from mpitrain.parallel.model_averaging import ModelAveraging
from mpitrain.parallel.param_server import EXPONENTIAL, UNIFORM, ModelAverage, ParameterServer


def _net():
    net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=2)
    return net


def _huge(like):
    return np.full(like.shape, 1e300)


def _refused(load, named):
    with pytest.raises(ValueError) as err:
        load()
    assert named in str(err.value), str(err.value)


# ------------------------------------------------------------------------------ BMUF

@pytest.mark.parametrize("key", ["start", "delta", "global_model"])
@pytest.mark.parametrize("change,named", [
    (_huge, "expected finite floats in [-3.40282e+38, 3.40282e+38] (a float32 buffer), "
            "got 1e+300"),
    (lambda v: v[:5], "expected ("),
    (lambda v: v.astype(np.int64), "expected (67,) floats, got an array of shape (67,) and dtype int64"),
])
def test_bmuf_refuses_a_forged_buffer_and_sets_none(key, change, named):
    net = _net()
    bmuf = BlockMomentum(SingleCommunicator(), every_steps=3)
    bmuf.setup(net, SGD(net))
    state = {k: np.array(v) for k, v in bmuf.state_dict().items()}
    state[key] = change(state[key])
    again = BlockMomentum(SingleCommunicator(), every_steps=3)
    again.bind(net)
    for buffer in (again.start, again.delta, again.global_model):
        buffer[...] = 7.0
    _refused(lambda: again.load_state_dict(state), f"field '{key}' (BMUF): {named}")
    for buffer in (again.start, again.delta, again.global_model):
        assert (buffer == 7.0).all()


# -------------------------------------------------------------------- parameter server

def _uniform_average(updates=10, switched_at=6):
    avg = ModelAverage(np.ones(4, dtype=np.float32), eta=0.5)
    avg.switch_to_uniform(updates=switched_at)
    for _ in range(updates - switched_at):
        avg.update(np.zeros(4, dtype=np.float32))
    return avg


@pytest.mark.parametrize("change,named", [
    (lambda s: dict(s, average=_huge(s["average"])), "field 'average' (param_server): expected "
                                                     "finite floats"),
    (lambda s: dict(s, average=s["average"][:2]), "field 'average' (param_server): expected "
                                                  "(4,) floats"),
    (lambda s: dict(s, average_samples=2.5), "field 'average_samples': expected an int"),
    # uniform since update 6 of 10: at most 5 samples
    (lambda s: dict(s, average_samples=6), "field 'average_samples': expected an int in [1, 5]"),
    (lambda s: dict(s, average_samples=0), "field 'average_samples': expected an int in [1, 5]"),
    (lambda s: dict(s, average_switched_at=11), "field 'average_switched_at': expected an int "
                                                "in [0, 10]"),
    (lambda s: dict(s, average_switched_at=-1), "field 'average_switched_at'"),
    (lambda s: dict(s, average_mode=EXPONENTIAL), "field 'average_samples': expected an int "
                                                  "in [0, 0]"),
])
def test_the_running_average_refuses_what_the_server_cannot_reach(change, named):
    state = _uniform_average().state_dict()
    assert (state["average_samples"], state["average_switched_at"]) == (5, 6)
    other = ModelAverage(np.full(4, 3.0, dtype=np.float32), eta=0.5)
    _refused(lambda: other.load_state_dict(change(state), updates=10), named)
    assert (other.mode, other.samples, other.switched_at) == (EXPONENTIAL, 0, None)
    assert (other.average == 3.0).all()
    other.load_state_dict(state, updates=10)
    assert (other.mode, other.samples, other.switched_at) == (UNIFORM, 5, 6)


@pytest.mark.parametrize("change,named", [
    (lambda s: dict(s, updates=10.0), "field 'updates': expected an int"),
    (lambda s: dict(s, updates=4), "field 'average_switched_at': expected an int in [0, 4]"),
    (lambda s: dict(s, client_steps=np.array([3.5])), "field 'client_steps': expected a list "
                                                      "of ints in [0, "),
    (lambda s: dict(s, client_steps=np.array([-1])), "field 'client_steps'"),
    (lambda s: dict(s, current=_huge(s["current"])), "field 'current' (param_server): "
                                                     "expected finite floats"),
    (lambda s: dict(s, current=s["current"][:3]), "field 'current' (param_server): expected ("),
])
def test_the_server_state_is_refused_alike_on_server_and_client(change, named):
    def work(comm):
        net = _net()
        ps = ParameterServer(comm, average_eta=0.5)
        ps.bind(net)
        saved = {"updates": 10, "client_steps": np.array([10], dtype=np.int64),
                 "current": net.params.copy(),
                 **_uniform_average().state_dict()}
        saved["average"] = np.zeros(net.num_params, dtype=np.float32)
        fresh = ParameterServer(comm, average_eta=0.5)
        fresh.bind(net)
        try:
            fresh.load_state_dict(change(saved))
        except ValueError as exc:
            return str(exc), fresh.updates, fresh.client_steps, fresh.current
        return None, None, None, None

    for message, updates, steps, current in VirtualCluster(2).run(work):
        assert message is not None and named in message, message
        assert (updates, steps, current) == (0, [0], None)


# ------------------------------------------------------------------------------ ADPSGD

def _ring(strategy_class=RingMixing, **kwargs):
    net = build_network(feat_dim=4, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=1)
    strategy = strategy_class(SingleCommunicator(), **kwargs)
    strategy.setup(net, SGD(net))
    return net, strategy


@pytest.mark.parametrize("change,named", [
    (lambda s: dict(s, params=_huge(s["params"])), "field 'params' (the rank's own model): "
                                                   "expected finite floats"),
    (lambda s: dict(s, params=s["params"][:4]), "field 'params' (the rank's own model): "
                                                "expected ("),
    (lambda s: dict(s, held_gradient=_huge(s["held_gradient"])),
     "field 'held_gradient': expected finite floats"),
    (lambda s: dict(s, held_gradient=s["held_gradient"].astype(np.int32)),
     "field 'held_gradient': expected ("),
    (lambda s: dict(s, held_gradient_finite=2), "field 'held_gradient_finite': expected 0 or 1"),
])
def test_adpsgd_refuses_a_forged_own_model_or_held_gradient_and_sets_neither(change, named):
    net, strategy = _ring(delay_by_one=True)
    net.grads[...] = 0.5
    strategy.reduce_gradients(net)
    state = strategy.rank_state_dict()
    assert "held_gradient" in state
    before, held = net.params.copy(), strategy.held.copy()
    other = RingMixing(SingleCommunicator(), delay_by_one=True)
    other.setup(net, SGD(net))
    net.params[...] = 9.0
    _refused(lambda: other.load_rank_state_dict(change(state)),
             f"checkpoint rank state 'strategy': {named}")
    assert (net.params == 9.0).all() and not other.held.any()
    other.load_rank_state_dict(state)
    assert np.array_equal(net.params, before) and np.array_equal(other.held, held)


def test_adpsgd_refuses_held_step_bounds_below_zero_or_beyond_float32():
    net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=1)
    strategy = RingMixing(SingleCommunicator(), delay_by_one=True)
    strategy.setup(net, SGD(net))
    strategy.net.param_slices[0][0].track_step_bound = True
    params = net.params.copy()
    for bounds, named in ((np.array([-1.0]), "expected finite floats in [0,"),
                          (np.array([1e300]), "expected finite floats in [0, 3.40282e+38]"),
                          (np.array([1.0, 2.0]), "expected (1,) floats")):
        net.params[...] = 9.0
        _refused(lambda: strategy.load_rank_state_dict(
            {"params": params, "held_gradient": np.zeros(net.num_params),
             "held_step_bounds": bounds}), f"field 'held_step_bounds' (one per affine layer): "
                                          f"{named}")
        assert (net.params == 9.0).all()


@pytest.mark.parametrize("strategy_class", [RingMixing, NodeRingMixing])
@pytest.mark.parametrize("iteration", [2.5, -1, "3"])
def test_adpsgd_refuses_an_iteration_that_is_not_a_count(strategy_class, iteration):
    # (the hierarchical variant's int() cut 2.5 to 2)
    _, strategy = _ring(strategy_class)
    strategy.iteration = 4
    _refused(lambda: strategy.load_state_dict({"iteration": iteration}),
             "field 'iteration': expected an int in [0,")
    assert strategy.iteration == 4


def test_async_adpsgd_refuses_a_forged_own_model_and_keeps_its_counters():
    net, strategy = _ring(AsyncRingMixing)
    state = strategy.rank_state_dict()
    strategy.own_steps = 3
    net.params[...] = 9.0
    _refused(lambda: strategy.load_rank_state_dict(dict(state, own_steps=5,
                                                        params=_huge(state["params"]))),
             "field 'params' (the rank's own model): expected finite floats")
    assert (net.params == 9.0).all() and strategy.own_steps == 3


# ------------------------------------------------------- model averaging: straggler adapt

@pytest.mark.parametrize("change,named", [
    (lambda s: dict(s, quotas=np.array([8, 0])), "field 'quotas': expected a list of ints in [1, 8]"),
    (lambda s: dict(s, quotas=np.array([8, 9])), "field 'quotas': expected a list of ints in [1, 8]"),
    (lambda s: dict(s, quotas=np.array([8.0, 3.5])), "field 'quotas': expected a list of ints"),
    (lambda s: dict(s, step_seconds=np.array([0.01, -1.0])),
     "field 'step_seconds': expected finite floats in [0,"),
    (lambda s: dict(s, step_seconds=np.array([0.01, 1e300])), "field 'step_seconds'"),
    (lambda s: dict(s, step_seconds=np.array([0.01])), "field 'step_seconds': expected (2,)"),
])
def test_straggler_quotas_and_times_are_refused_beyond_what_adapt_produces(change, named):
    def work(comm):
        strategy = ModelAveraging(comm, every_steps=8, straggler_policy="adapt")
        strategy.quotas, strategy.step_seconds = [8, 3], [0.01, 0.027]
        state = strategy.state_dict()
        again = ModelAveraging(comm, every_steps=8, straggler_policy="adapt")
        try:
            again.load_state_dict(change(state))
        except ValueError as exc:
            return str(exc), again.quotas, again.step_seconds
        return None, None, None

    for message, quotas, seconds in VirtualCluster(2).run(work):
        assert message is not None and named in message, message
        assert quotas == [8, 8] and seconds == [0.0, 0.0]
