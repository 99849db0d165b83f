"""The learning-rate schedules (optim/schedule.py, search.py, newbob.py, factory.py):
each follows its rule on scripted inputs, and its state continues it exactly."""

import math

import pytest

from mpitrain.config import OptimizerConfig
from mpitrain.optim.factory import build_schedule
from mpitrain.optim.newbob import NewbobSchedule
from mpitrain.optim.schedule import (ConstantSchedule, ExponentialSchedule, HandSchedule,
                                     PlannedExponential)
from mpitrain.optim.search import SearchSchedule


def test_exponential_schedule():
    s = ExponentialSchedule(0.01, 0.001)
    assert s(0) == pytest.approx(0.01)
    assert s(0.5) == pytest.approx(0.01 * 0.1 ** 0.5)
    assert s(1) == pytest.approx(0.001)
    assert s(2) == pytest.approx(0.001)


def test_planned_exponential_is_the_old_rule_bit_for_bit():
    curve, sched = ExponentialSchedule(0.004, 0.0004), PlannedExponential(0.004, 0.0004,
                                                                          planned_steps=417)
    assert all(sched.rate(n) == curve(n / 417) for n in range(0, 500, 7))


def test_hand_rate_after_n_steps_is_r0_times_f_to_the_n():
    sched = HandSchedule(0.008, factor=0.999)
    for n in (0, 1, 10, 1000):
        assert sched.rate(n) == pytest.approx(0.008 * 0.999 ** n, rel=1e-12)
    assert sched.state_dict() == {}          # the step count alone continues it


def test_adapt_rate_is_constant_gamma():
    assert ConstantSchedule(0.008).rate(0) == ConstantSchedule(0.008).rate(10 ** 6) == 0.008


def _scripted_trial(objectives_by_factor, calls):
    def trial(rate):
        calls.append(rate)
        return objectives_by_factor[len(calls) - 1], 256
    return trial


def test_search_picks_the_factor_with_the_best_objective():
    sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=100, trial_steps=3)
    assert sched.search_due(0) and not sched.search_due(50)
    calls = []
    found = sched.search(0, _scripted_trial([2.0, 1.5, 1.7], calls))
    assert calls == [0.004, 0.008, 0.016]
    assert found["chosen"] == sched.rate(0) == sched.rate(99) == 0.008
    assert not sched.search_due(0) and sched.search_due(100)
    calls = []
    sched.search(100, _scripted_trial([1.0, 1.5, 1.7], calls))
    assert calls == [0.004, 0.008, 0.016] and sched.rate(100) == 0.004
    assert sched.trial_frames == 6 * 256 and sched.searches == 2


def test_search_never_picks_a_non_finite_trial():
    sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=10, trial_steps=1)
    sched.search(0, _scripted_trial([3.0, math.nan, math.inf], []))
    assert sched.rate(0) == 0.004
    sched.search(10, _scripted_trial([math.inf] * 3, []))
    assert sched.rate(10) == 0.002           # all diverged: the smallest rate


def test_search_state_continues_it():
    a = SearchSchedule(0.008, factors=(0.5, 2.0), chunk_steps=10, trial_steps=1)
    a.search(0, _scripted_trial([1.0, 2.0], []))
    b = SearchSchedule(0.008, factors=(0.5, 2.0), chunk_steps=10, trial_steps=1)
    b.load_state_dict(a.state_dict())
    assert b.rate(5) == a.rate(5) == 0.004 and not b.search_due(0) and b.search_due(10)
    assert b.trial_frames == a.trial_frames


def test_newbob_halves_then_stops_on_a_scripted_sequence():
    sched = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    assert sched.uses_epoch_eval
    steps = [(2.000, 0.500),          # epoch 1: the baseline only
             (1.800, 0.550),          # 10% better: keep the rate
             (1.795, 0.560),          # 0.28% < 0.5%: start halving
             (1.790, 0.5650),         # halving: acc gain 0.5% >= 0.1%: halve again
             (1.789, 0.5655)]         # acc gain 0.05% < 0.1%: stop
    rates = []
    for xent, acc in steps:
        decision = sched.end_epoch(xent, acc)
        rates.append(sched.rate(0))
        assert decision["rate"] == sched.rate(0)
    assert rates == [0.004, 0.004, 0.002, 0.001, 0.001]
    assert sched.halving and sched.stopped


def test_newbob_does_not_stop_before_it_halves():
    # QuickNet: the accuracy test only ends a run that is already halving, so an
    # epoch with a small accuracy gain but a large cross-entropy gain goes on
    sched = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    sched.end_epoch(2.0, 0.5)
    decision = sched.end_epoch(1.8, 0.5001)         # xent 10% better, acc +0.01%
    assert not decision["stopped"] and not sched.stopped and not sched.halving
    assert sched.rate(0) == 0.004


def test_newbob_state_continues_it():
    a = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    a.end_epoch(2.0, 0.5)
    a.end_epoch(1.999, 0.51)
    b = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    b.load_state_dict(a.state_dict())
    assert (b.rate(0), b.halving, b.last_xent) == (a.rate(0), True, 1.999)
    a.end_epoch(1.998, 0.5101)
    b.end_epoch(1.998, 0.5101)
    assert a.state_dict() == b.state_dict() and b.stopped


def test_factory_builds_each_schedule_and_cuts_search_chunks_in_steps():
    def cfg(name, **kw):
        return OptimizerConfig(schedule=name, initial_learning_rate=0.008, **kw)
    names = {n: build_schedule(cfg(n), planned_steps=100, frames_per_step=512).name
             for n in ("exponential", "hand", "adapt", "search", "newbob")}
    assert names == {n: n for n in names}
    search = build_schedule(cfg("search", search_chunk_frames=360_000), planned_steps=10_000,
                            frames_per_step=512)
    assert search.chunk_steps == 703 and search.trial_steps == 21     # 360000 / 512, 3%


def test_a_run_shorter_than_a_search_chunk_is_one_chunk():
    # 70 planned steps of 256 frames: an hour's chunk would be 1406 steps, and each
    # trial (3% of it, or all of it) would train past the end of the run many times
    # over; the chunk is the run, and a trial a share of what the run trains
    def search(fraction):
        cfg = OptimizerConfig(schedule="search", initial_learning_rate=0.008,
                              search_chunk_frames=360_000, search_trial_fraction=fraction)
        return build_schedule(cfg, planned_steps=70, frames_per_step=256)
    assert (search(0.03).chunk_steps, search(0.03).trial_steps) == (70, 2)
    assert (search(1.0).chunk_steps, search(1.0).trial_steps) == (70, 70)
    assert search(0.5).search_due(0) and not search(0.5).search_due(69)


def test_search_trials_are_long_enough_to_tell_the_rates_apart():
    # each trial minibatch is scored before its update, so the first one's score
    # never depends on the trial rate: a one-minibatch trial ties every factor and
    # the search always took the first (halving the rate chunk after chunk)
    cfg = OptimizerConfig(schedule="search", initial_learning_rate=0.008,
                          search_chunk_frames=360_000)
    # an hour of frames over 32 ranks of 256-frame minibatches: 44 steps a chunk
    search = build_schedule(cfg, planned_steps=100, frames_per_step=32 * 256)
    assert search.chunk_steps == 44 and search.trial_steps == 2


def test_after_a_roll_back_the_next_search_tries_no_higher_rate():
    # a short trial does not see a divergence: factor 2 would undo the roll back's cut
    sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=10, trial_steps=2)
    sched.after_roll_back()
    restored = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=10, trial_steps=2)
    restored.load_state_dict(sched.state_dict())
    for s in (sched, restored):
        calls = []
        s.search(0, _scripted_trial([2.0, 1.0], calls))
        assert calls == [0.004, 0.008] and s.rate(0) == 0.008
        calls = []
        s.search(10, _scripted_trial([3.0, 2.0, 1.0], calls))       # then as before
        assert calls == [0.004, 0.008, 0.016] and s.rate(10) == 0.016
    only_up = SearchSchedule(0.008, factors=(2.0, 4.0), chunk_steps=10, trial_steps=2)
    only_up.after_roll_back()
    calls = []
    only_up.search(0, _scripted_trial([1.0], calls))
    assert calls == [0.016]                  # the smallest factor when none is <= 1


def test_search_tries_no_rate_at_which_the_l2_term_zeroes_the_weights():
    # a model worn to chance by a strong L2 scores alike at every rate: the choice was
    # noise, and it climbed 0.004 -> 0.032, where 2 lr l2 B was 1.6 of the weights
    sched = SearchSchedule(0.004, factors=(0.5, 1.0, 4.0), chunk_steps=10, trial_steps=2,
                           rate_limit=0.01)
    calls = []
    sched.search(0, _scripted_trial([3.0, 2.0], calls))
    assert calls == [0.002, 0.004] and sched.rate(0) == 0.004
    free = SearchSchedule(0.004, factors=(0.5, 1.0, 4.0), chunk_steps=10, trial_steps=2)
    calls = []
    free.search(0, _scripted_trial([3.0, 2.0, 1.0], calls))
    assert calls == [0.002, 0.004, 0.016] and free.rate(0) == 0.016


def test_the_rate_where_the_l2_zeroes_the_weights_reaches_search():
    from mpitrain.config import l2_rate_limit, load_config
    cfg = load_config(None, ["optimizer.schedule=search", "training.minibatch=256",
                             "optimizer.l2_regularize=0.01", "optimizer.l2_regularize_output=0.1"])
    assert l2_rate_limit(cfg) == pytest.approx(1 / (2 * 0.1 * 256))
    assert l2_rate_limit(load_config(None, [])) == math.inf
    sched = build_schedule(cfg.optimizer, planned_steps=100, frames_per_step=256,
                           rate_limit=l2_rate_limit(cfg))
    assert sched.rate_limit == pytest.approx(1 / 51.2)


@pytest.mark.parametrize("change,named", [
    # (a forged checkpoint, checksum recomputed: each went on at a rate or with a
    # figure the schedule never reaches)
    ({"rate": 1e300}, "field 'rate': expected a finite number in (0, 0.004]"),
    ({"rate": 0.004 / 2 ** 5, "epochs": 2}, "is below the initial rate 0.004 halved once"),
    ({"rate": "0.004"}, "field 'rate': expected a finite number"),
    ({"last_acc": 7.0}, "field 'last_acc': expected a finite number in [0, 1]"),
    ({"last_xent": -1.0}, "field 'last_xent': expected a finite number in [0,"),
    ({"epochs": -3}, "field 'epochs': expected an int in [0,"),
    ({"halving": 2}, "field 'halving': expected 0 or 1, got 2"),
])
def test_newbob_refuses_a_saved_state_it_cannot_reach(change, named):
    from mpitrain.optim.newbob import NewbobSchedule
    sched = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    sched.end_epoch(2.0, 0.5)
    with pytest.raises(ValueError) as err:
        sched.load_state_dict(dict(sched.state_dict(), **change))
    assert named in str(err.value) and "newbob schedule state" in str(err.value)
    assert sched.rate(0) == 0.004 and sched.epochs == 1


@pytest.mark.parametrize("change,named", [
    ({"rate": 1e30, "searches": 3}, "field 'rate': 1e+30 is not the initial rate 0.008 "
                                   "times 3 of the factors [0.5, 1.0, 2.0]"),
    ({"rate": 1e300}, "field 'rate': expected a finite number in (0, 3.40282e+38]"),
    ({"rate": 0.008 * 16, "searches": 3}, "is not the initial rate"),
    ({"rate": -0.1}, "field 'rate': expected a finite number in (0,"),
    ({"searches": 1.5}, "field 'searches': expected an int"),
    ({"searched_at": -7}, "field 'searched_at': expected an int in [-1,"),
    ({"trial_frames": "many"}, "field 'trial_frames': expected an int in [0,"),
])
def test_search_refuses_a_saved_state_it_cannot_reach(change, named):
    from mpitrain.optim.search import SearchSchedule
    sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=10, trial_steps=2)
    sched.load_state_dict(dict(sched.state_dict(), rate=0.008 * 8, searches=3))  # reachable
    with pytest.raises(ValueError) as err:
        sched.load_state_dict(dict(sched.state_dict(), **change))
    assert named in str(err.value) and "search schedule state" in str(err.value)
