"""The trainer with each ``optimizer.schedule`` (train/trainer.py, optim/schedule.py):
``--resume`` continues bit-exactly, config mistakes are one line naming the key, newbob
stops the run on its own, and each schedule learns far above chance (slow)."""


import numpy as np
import pytest

from mpitrain.config import ConfigError, load_config
from mpitrain.nn.model_file import load_model

from ..helpers import QUICKSTART, records, train_in_process, train_straight_and_resumed

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.minibatch=128"]

SCHEDULES = {
    "hand": ["optimizer.schedule=hand", "optimizer.hand_factor=0.99"],
    # with memory, so the adapt statistics are part of what resume restores
    "adapt": ["optimizer.schedule=adapt", "optimizer.adapt_decay=0.9",
              "optimizer.momentum=0.5"],
    "search": ["optimizer.schedule=search", "optimizer.search_chunk_frames=4000",
               "optimizer.momentum=0.5"],
    # minibatches of 1024 frames: 52 steps per epoch, so epoch ends at 52 and 104
    "newbob": ["optimizer.schedule=newbob", "optimizer.newbob_start_halving=0.5",
               "training.minibatch=1024", "training.epochs=10"],
}


@pytest.mark.parametrize("schedule", [
    "adapt", "hand", "search",
    pytest.param("newbob", marks=pytest.mark.slow),     # 150 steps of 1024 frames, 3 runs
])
def test_resume_is_bit_exact(small_corpus, tmp_path, schedule):
    common = TINY + SCHEDULES[schedule] + ["training.checkpoint_interval=25",
                                           "training.log_interval=25"]
    steps, half = (150, 75) if schedule == "newbob" else (100, 50)
    straight, split = train_straight_and_resumed(tmp_path, small_corpus, common, steps=steps,
                                                 half=half)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert [r["step"] for r in records(split, "start")] == [0, half]
    if schedule == "newbob":
        per_epoch = records(straight, "start")[0]["planned_steps"] // 10
        decided = [(d["step"], d["rate"]) for d in records(straight, "schedule")]
        assert decided == [(per_epoch * (e + 1), 0.004 / 2 ** e) for e in range(len(decided))]
        assert len(decided) == 2 and decided[0][0] < half < decided[1][0]
        assert decided[1:] == [(d["step"], d["rate"]) for d in records(split, "schedule")
                               if d["step"] > half]
    assert np.array_equal(a.params, b.params)
    after = [(r["step"], r["lr"], r["xent"]) for r in records(straight, "train")
             if r["step"] > half]
    assert after == [(r["step"], r["lr"], r["xent"]) for r in records(split, "train")
                     if r["step"] > half]
    if schedule == "search":
        assert len(records(straight, "search")) >= 3
        assert [r["chosen"] for r in records(straight, "search") if r["step"] >= half] == \
            [r["chosen"] for r in records(split, "search") if r["step"] >= half]


def test_hand_logs_the_rate_r0_times_f_to_the_n(small_corpus, tmp_path):
    train_in_process(tmp_path / "run", small_corpus, TINY + SCHEDULES["hand"] + [
        "optimizer.initial_learning_rate=0.004", "training.max_steps=40",
        "training.log_interval=10", "training.checkpoint_interval=0"])
    for record in records(tmp_path / "run", "train"):
        # the logged rate is that of the window's last step, step - 1
        assert record["lr"] == pytest.approx(0.004 * 0.99 ** (record["step"] - 1), rel=1e-12)


def test_newbob_halves_and_stops_the_run(small_corpus, tmp_path):
    # thresholds that halve at the second epoch end and stop at the third (no epoch
    # gains 50% accuracy)
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + ["training.minibatch=1024",
        "optimizer.schedule=newbob", "optimizer.newbob_start_halving=1.0",
        "optimizer.newbob_stop=0.5", "training.epochs=20", "training.log_interval=50",
        "training.checkpoint_interval=0", "optimizer.initial_learning_rate=0.004"])
    decisions = records(run, "schedule")
    assert [d["rate"] for d in decisions] == [0.004, 0.002, 0.002]
    assert [d["stopped"] for d in decisions] == [False, False, True]
    end = records(run, "end")[0]
    per_epoch = records(run, "start")[0]["planned_steps"] // 20
    assert end["steps"] == 3 * per_epoch


@pytest.mark.parametrize("setting,key", [
    ("optimizer.schedule=cosine", "optimizer.schedule"),
    ("optimizer.hand_factor=1.5", "optimizer.hand_factor"),
    ("optimizer.adapt_decay=1", "optimizer.adapt_decay"),
    ("optimizer.search_factors=[]", "optimizer.search_factors"),
    ("optimizer.search_factors=[0.5, -1]", "optimizer.search_factors"),
    ("optimizer.search_trial_fraction=0", "optimizer.search_trial_fraction"),
    ("optimizer.newbob_stop=-0.1", "optimizer.newbob_stop"),
    # 0 in float32: a parameter without gradient got 0 / 0 and every step was skipped
    ("optimizer.adapt_k=1e-300", "optimizer.adapt_k"),
])
def test_config_errors_are_one_line_naming_the_key(setting, key):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [setting])
    assert key in str(info.value) and "\n" not in str(info.value)


def test_search_factors_that_all_raise_the_rate_are_refused():
    # the rate rose at every chunk until the run diverged, roll backs or not
    with pytest.raises(ConfigError, match="optimizer.search_factors: needs a factor of at "
                                          "most 1") as info:
        load_config(QUICKSTART, ["optimizer.schedule=search", "optimizer.search_factors=[4]"])
    assert "\n" not in str(info.value)
    load_config(QUICKSTART, ["optimizer.schedule=search", "optimizer.search_factors=[0.5]"])
    load_config(QUICKSTART, ["optimizer.search_factors=[4]"])        # unused by exponential


def test_newbob_without_held_out_data_is_refused():
    with pytest.raises(ConfigError, match="optimizer.schedule: newbob .* data.dev"):
        load_config(QUICKSTART, ["optimizer.schedule=newbob", "data.dev="])
    cfg = load_config(QUICKSTART, ["optimizer.search_factors=[0.25, 1, 4]"])
    assert cfg.optimizer.search_factors == (0.25, 1.0, 4.0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,settings", [
    ("hand", ["optimizer.initial_learning_rate=0.004", "optimizer.hand_factor=0.999"]),
    ("adapt", ["optimizer.initial_learning_rate=0.008"]),
    ("search", ["optimizer.initial_learning_rate=0.004",
                "optimizer.search_chunk_frames=40000"]),
    ("newbob", ["optimizer.initial_learning_rate=0.004"]),
])
def test_each_schedule_learns_far_above_chance(small_corpus, tmp_path, schedule, settings):
    run = tmp_path / "run"
    train_in_process(run, small_corpus, [
        "model.hidden_dim=128", "model.hidden_layers=2", f"optimizer.schedule={schedule}",
        "training.epochs=2", "training.checkpoint_interval=0"] + settings)
    final = records(run, "eval")[-1]
    assert final["dev_acc"] > 0.30, final            # 120 classes: chance is 0.008
