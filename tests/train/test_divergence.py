"""The divergence rule (train/divergence.py): events, explosions, roll backs, the stop."""

import math
import re

import pytest

from mpitrain.train.divergence import EVENT, OK, ROLL_BACK, DivergenceGuard, Diverged

from ..helpers import records, train_straight_and_resumed


def _guard(**kw):
    args = dict(factor=3.0, max_events=4, max_rollbacks=2, lr_factor=0.5)
    args.update(kw)
    return DivergenceGuard(**args)


def test_falling_objective_is_never_an_event():
    guard = _guard()
    for xent in (4.8, 4.0, 3.1, 2.5, 2.4, 2.6, 2.2):
        assert guard.observe(xent=xent, skipped=0) == OK
    assert guard.events == 0 and guard.last_window_good


def test_skipped_minibatches_count_and_a_nan_window_counts_once():
    guard = _guard()
    guard.observe(xent=3.0, skipped=0)
    # the window's loss is NaN because of the skipped minibatches: not a second event
    assert guard.observe(xent=math.nan, skipped=2) == EVENT
    assert guard.events == 2 and guard.skipped_total == 2 and guard.exploded_total == 0
    assert not guard.last_window_good
    # a non-finite window without skipped steps is one event
    assert guard.observe(xent=math.inf, skipped=0) == EVENT
    assert guard.events == 3 and guard.exploded_total == 1


def test_explosion_over_the_factor_of_the_running_mean():
    guard = _guard(factor=3.0)
    guard.observe(xent=2.0, skipped=0)
    assert guard.observe(xent=5.9, skipped=0) == OK            # under 3 x 2.0
    mean = guard.running_mean
    assert guard.observe(xent=3.0 * mean + 0.01, skipped=0) == EVENT
    assert guard.running_mean == mean        # an exploding window does not move the mean
    assert guard.exploded_total == 1


def test_factor_zero_turns_the_explosion_test_off():
    guard = _guard(factor=0.0)
    guard.observe(xent=1.0, skipped=0)
    assert guard.observe(xent=100.0, skipped=0) == OK


def test_more_events_than_allowed_roll_back_and_checkpoints_reset_the_count():
    guard = _guard(max_events=4)
    assert guard.observe(xent=math.nan, skipped=3) == EVENT
    guard.checkpoint_written()
    assert guard.events == 0
    assert guard.observe(xent=math.nan, skipped=4) == EVENT      # 4 is allowed
    assert guard.observe(xent=math.nan, skipped=1) == ROLL_BACK  # the fifth is not


def test_roll_backs_halve_the_rate_then_stop():
    guard = _guard(max_rollbacks=2, lr_factor=0.5)
    guard.roll_back()
    guard.roll_back()
    assert guard.lr_scale == 0.25 and guard.rollbacks == 2 and guard.events == 0
    with pytest.raises(Diverged, match="optimizer.initial_learning_rate"):
        guard.roll_back()


def test_state_round_trip_and_bad_state_refused():
    guard = _guard()
    guard.observe(xent=math.nan, skipped=3)
    guard.roll_back()
    other = _guard()
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == guard.state_dict() == {
        "rollbacks": 1, "lr_scale": 0.5, "skipped_total": 3, "exploded_total": 0}
    guard.observe(xent=2.5, skipped=0)             # a good window: the mean is kept too
    other.load_state_dict(guard.state_dict())
    assert other.running_mean == guard.running_mean == 2.5
    other.load_state_dict({})                      # checkpoints written before the guard
    assert other.running_mean is None
    assert other.lr_scale == 1.0 and other.rollbacks == 0
    with pytest.raises(ValueError, match="trainer"):
        other.load_state_dict({"lr_scale": float("nan")})
    with pytest.raises(ValueError, match="running_mean"):
        other.load_state_dict({"running_mean": float("inf")})
    # a crafted count of 2.5 was taken as 2; a huge value was echoed whole
    with pytest.raises(ValueError, match=r"field 'rollbacks': expected an int in \[0, \d+\], "
                                         "got 2.5"):
        other.load_state_dict({"rollbacks": 2.5})
    with pytest.raises(ValueError, match=r"got '1{60}'\.\.\. \(100000 characters\)$"):
        other.load_state_dict({"skipped_total": "1" * 100000})


def test_a_resumed_run_judges_its_first_window_as_the_straight_run(small_corpus, tmp_path):
    # factor 1: a window above the running mean is an event.  Straight through, the
    # window of steps 5-8 rises above the mean of the first; resumed at step 4 the
    # mean was lost with the restart, the window passed, and the runs parted
    # (with fewer events allowed, one rolled back and the other did not)
    settings = ["model.hidden_dim=32", "model.hidden_layers=1", "training.epochs=1",
                "training.log_interval=4", "training.checkpoint_interval=8",
                "training.divergence_factor=1.0", "training.max_divergence_events=1000"]
    straight, split = train_straight_and_resumed(tmp_path, small_corpus, settings,
                                                 steps=16, half=4)
    windows = [r["xent"] for r in records(straight, "train")]
    assert windows[1] > windows[0]                # the window that is an event
    assert [r["xent"] for r in records(split, "train")][-4:] == windows
    assert records(split, "end")[-1]["exploded_windows"] \
        == records(straight, "end")[-1]["exploded_windows"] == 1


def test_the_advice_after_an_asynchronous_divergence_fits_the_run_directory(tmp_path):
    from mpitrain.train.divergence import restart_advice
    assert "no checkpoint was written yet: start again" in restart_advice(str(tmp_path))
    (tmp_path / "ckpt-00000010.h5").write_bytes(b"")
    assert "resume from the last checkpoint" in restart_advice(str(tmp_path))


# (NumPy's overflow warnings are the divergence itself; the CLI never shows them)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("method", ["adpsgd", "param_server"])
def test_an_asynchronous_divergence_names_the_settings_that_enlarge_the_step(
        small_corpus, tmp_path, method):
    # (it said to start again with a lower learning rate whatever had blown the step up)
    from mpitrain.config import load_config
    from mpitrain.train.virtual import ComputeModel, train_virtual
    from ..helpers import QUICKSTART, small_overrides
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=200",
        "training.log_interval=10", f"parallel.method={method}",
        "parallel.asynchronous=" + ("true" if method == "adpsgd" else "false"),
        # (a rate that blows the step up without max-change, and an L2 that shrinks
        # the weights by half of themselves a step: 2 x 1e3 x 1e-6 x 256)
        "optimizer.initial_learning_rate=1e3", "optimizer.max_change_per_layer=0",
        "optimizer.max_change_output=0", "optimizer.max_change=0",
        "optimizer.l2_regularize=1e-6", "training.divergence_factor=1.2"])
    with pytest.raises(Diverged) as caught:
        train_virtual(cfg, size=2, run_dir=str(tmp_path / "run"),
                      compute=ComputeModel(step_seconds=0.001))
    message = str(caught.value)
    assert "an asynchronous run cannot roll back" in message
    # the count is of skipped minibatches and exploding windows, as in the lock-step
    # methods' line (it said "windows": 47 of them after one log window)
    assert re.search(r": \d+ non-finite or exploding minibatches/windows since", message), \
        message
    assert "lower learning rate (--overwrite --set optimizer.initial_learning_rate=...), " \
           "or lower optimizer.l2_regularize (1e-06); or raise training.divergence_factor " \
           "(1.2" in message, message


def test_the_first_window_and_the_first_after_a_roll_back_are_judged_too():
    # seeded with the initial model's cross-entropy (ln C), a model that blows up
    # within its first window is an event instead of the reference for the rest
    guard = _guard(initial_xent=math.log(120))
    assert guard.running_mean == math.log(120)
    assert guard.observe(xent=60.0, skipped=0) == EVENT
    assert guard.observe(xent=4.0, skipped=0) == OK
    guard.roll_back()
    assert guard.running_mean == math.log(120)
    # a checkpoint written before any good window holds no running mean
    restored = _guard(initial_xent=math.log(120))
    restored.load_state_dict({"rollbacks": 0, "lr_scale": 1.0})
    assert restored.running_mean == math.log(120)
    assert _guard().running_mean is None           # without a seed: the first window


def test_a_rate_scale_that_would_underflow_stays_positive():
    # rollback_lr_factor 1e-300: the second roll back made the scale 0, which the
    # guard's own state refused ("checkpoint group 'trainer': expected lr_scale in
    # (0, 1]") and the run stopped naming no setting
    guard = _guard(lr_factor=1e-300, max_rollbacks=3)
    for _ in range(3):
        guard.roll_back()
        restored = _guard(lr_factor=1e-300, max_rollbacks=3)
        restored.load_state_dict(guard.state_dict())
        assert 0.0 < restored.lr_scale == guard.lr_scale <= 1e-300


def test_the_last_words_name_the_settings_that_enlarge_the_step():
    from mpitrain.config import load_config
    from mpitrain.train.divergence import divergence_advice
    plain = divergence_advice(load_config(None, []))
    assert plain == "lower optimizer.initial_learning_rate or the max-change values"
    advice = divergence_advice(load_config(None, [
        "optimizer.l2_regularize=0.1", "parallel.method=bmuf", "parallel.block_lr=1.05",
        "training.divergence_factor=1.1"]))
    # (it said to lower the rate whatever had blown the step up)
    assert "optimizer.l2_regularize (0.1)" in advice and "parallel.block_lr (1.05)" in advice
    assert "parallel.block_momentum (1 - 1/ranks)" in advice
    assert "raise training.divergence_factor (1.1" in advice
    # with every max-change limit off, lowering "the max-change values" did nothing
    off = divergence_advice(load_config(None, [
        "optimizer.max_change_per_layer=0", "optimizer.max_change_output=0",
        "optimizer.max_change=0"]))
    assert off.startswith("lower optimizer.initial_learning_rate, or turn max-change on "
                          "(optimizer.max_change_per_layer, max_change_output and "
                          "max_change are all 0: off)"), off
    assert divergence_advice(load_config(None, [
        "optimizer.max_change_per_layer=0", "optimizer.max_change_output=0",
        "optimizer.max_change=0", "optimizer.max_change_per_sample=0.075"])) == plain
    # a Kaldi-sized L2 (a shrink of 1e-4 a step) is not named
    assert "l2" not in divergence_advice(load_config(None, ["optimizer.l2_regularize=5e-5"]))
    guard = DivergenceGuard(factor=3.0, max_events=0, max_rollbacks=0, advice=advice)
    with pytest.raises(Diverged, match=r"optimizer\.l2_regularize \(0\.1\)"):
        guard.roll_back()


def test_an_l2_is_named_at_the_largest_rate_of_a_rising_schedule():
    # the shrink was taken at the initial rate: an exponential schedule rising
    # tenfold shrank the weights by a fifth of them a step at its end, unnamed
    from mpitrain.config import load_config
    from mpitrain.train.divergence import divergence_advice
    rising = ["optimizer.initial_learning_rate=0.002", "optimizer.final_learning_rate=0.02",
              "training.minibatch=256", "optimizer.l2_regularize_output=0.02"]
    # 2 x 0.02 x 0.02 x 256 = 0.2 of the weights a step at the end (0.02 at the start)
    assert "optimizer.l2_regularize_output (0.02)" in divergence_advice(
        load_config(None, rising))
    # the other schedules start at the initial rate and only lower it
    assert "l2" not in divergence_advice(load_config(None, rising + ["optimizer.schedule=hand"]))


def test_part_of_a_window_is_judged_without_counting():
    guard = _guard(initial_xent=4.8)
    assert guard.part_is_good(xent=None, skipped=0)            # no frames yet
    assert guard.part_is_good(xent=14.0, skipped=0)            # under 3 x 4.8
    assert not guard.part_is_good(xent=15.0, skipped=0)
    assert not guard.part_is_good(xent=math.nan, skipped=0)
    assert not guard.part_is_good(xent=2.0, skipped=1)
    assert guard.events == 0 and guard.exploded_total == 0 and guard.running_mean == 4.8
    assert _guard(factor=0.0, initial_xent=4.8).part_is_good(xent=1e9, skipped=0)
    # a part of a few frames is pooled as a log window of a few frames is
    assert guard.part_is_good(xent=15.0, skipped=0, frames=10)
    assert not guard.part_is_good(xent=15.0, skipped=0, frames=5000)


def test_windows_of_a_few_frames_are_judged_pooled():
    from mpitrain.train.divergence import MEAN_WEIGHT, MIN_JUDGED_FRAMES
    guard = _guard(max_events=0, initial_xent=math.log(120))
    # one frame per window: single frames swing far past 3x the mean in a run that learns
    swings = [0.05, 14.0, 0.4, 16.5, 1.0] * (2 * MIN_JUDGED_FRAMES // 5)
    assert all(guard.observe(xent=x, skipped=0, frames=1) == OK for x in swings)
    assert guard.exploded_total == 0
    # two pools of 1000 frames, each of the swings' mean, moved the running mean
    kept = (1 - MEAN_WEIGHT) ** 2
    assert guard.running_mean == pytest.approx(kept * math.log(120)
                                               + (1 - kept) * sum(swings[:5]) / 5)
    # a pool that has blown up is an event, and a non-finite window is one at once
    assert guard.observe(xent=50.0, skipped=0, frames=MIN_JUDGED_FRAMES - 1) == OK
    assert guard.observe(xent=50.0, skipped=0, frames=1) == ROLL_BACK
    guard = _guard(max_events=5)
    guard.observe(xent=3.0, skipped=0, frames=10)
    assert guard.observe(xent=math.nan, skipped=0, frames=10) == EVENT
    # a window large enough is judged alone, as before
    guard = _guard(initial_xent=2.0)
    assert guard.observe(xent=6.5, skipped=0, frames=MIN_JUDGED_FRAMES) == EVENT


def test_a_partly_filled_pool_is_checkpointed_and_restored():
    guard = _guard()
    guard.observe(xent=3.0, skipped=0, frames=10)
    state = guard.state_dict()
    assert state["pool_frames"] == 10 and state["pool_loss"] == 30.0
    other = _guard()
    other.load_state_dict(state)
    assert (other.pool_loss, other.pool_frames) == (30.0, 10)
    # a window judged whole leaves no pool in the checkpoint (the keys older runs wrote)
    assert "pool_frames" not in _guard().state_dict()
    with pytest.raises(ValueError, match="checkpoint group 'trainer'"):
        other.load_state_dict({**state, "pool_frames": -1})


def test_a_run_of_one_frame_minibatches_logged_every_step_is_not_diverging(small_corpus,
                                                                          tmp_path, capsys):
    # (one frame's cross-entropy over 3x the running mean was an event: with
    # minibatch 1 and log_interval 1 a run that learned rolled back and stopped as
    # diverged, telling to lower the rate)
    from ..helpers import train_in_process
    run = tmp_path / "run"
    train_in_process(run, small_corpus, [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.minibatch=1",
        "training.log_interval=1", "training.max_steps=3000", "data.dev=",
        "training.checkpoint_interval=0", "training.max_divergence_events=0",
        "training.max_rollbacks=0", "optimizer.initial_learning_rate=0.02"])
    end = records(run, "end")[-1]
    assert end["exploded_windows"] == 0 and end["rollbacks"] == 0
    assert "divergence" not in capsys.readouterr().out
