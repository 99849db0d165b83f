"""Checkpoints by the clock (``training.checkpoint_minutes``, train/checkpoint_clock.py).

In this process: the clock's own rule, and runs on virtual ranks, whose
simulated clock makes the steps where checkpoints fall known: lock-step
methods write them at averaging points a set number of minutes apart, the
parameter server at its updates; none without the setting.
"""

import os

import pytest

from mpitrain.cli import main
from mpitrain.train.checkpoint_clock import CheckpointClock

from ..helpers import QUICKSTART, small_overrides


class _Clock:
    size = 2

    def __init__(self, rank=0):
        self.rank, self.now = rank, 100.0

    def wtime(self):
        return self.now


def test_only_rank_0s_clock_speaks_and_a_checkpoint_starts_it_again():
    comm = _Clock()
    clock = CheckpointClock(comm, minutes=2)
    comm.now += 119.0
    assert not clock.due() and clock.flag() == 0.0
    comm.now += 1.0
    assert clock.due() and clock.flag() == 1.0
    other = _Clock(rank=1)
    late = CheckpointClock(other, minutes=2)
    other.now += 1000.0
    assert late.due() and late.flag() == 0.0       # only rank 0's clock decides
    clock.hear(0.0)
    assert not clock.agreed
    clock.hear(1.0)
    assert clock.agreed
    clock.written()
    assert not clock.agreed and not clock.due()
    assert not CheckpointClock(comm, minutes=0).due()
    comm.size = 1                                   # one rank: its own clock is the word
    comm.now += 120.0
    assert clock.agreed


def _checkpoint_steps(run_dir):
    return sorted(int(name[5:13]) for name in os.listdir(run_dir) if name.startswith("ckpt-"))


def _virtual(run_dir, corpus, ranks, settings):
    # 100 ms per simulated step: 0.05 minutes (3 s) is about 30 steps
    argv = ["train", QUICKSTART, "--virtual", str(ranks), "--run-dir", str(run_dir),
            "--compute-ms", "100"]
    for item in small_overrides(corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=100",
            "training.checkpoint_interval=0", "training.keep_checkpoints=100",
            "data.dev="] + list(settings):
        argv += ["--set", item]
    return main(argv)


@pytest.mark.parametrize("log_interval", [5, 1000], ids=["log-lines", "polls"])
def test_lock_step_ranks_checkpoint_together_every_few_minutes(small_corpus, tmp_path,
                                                               log_interval):
    # rank 0's clock is heard in the log line's sums, or in the stop poll when
    # log lines are far apart; the checkpoint waits for an averaging point
    run = tmp_path / "run"
    assert _virtual(run, small_corpus, 2, [f"training.log_interval={log_interval}",
                                           "parallel.average_every=8",
                                           "training.checkpoint_minutes=0.05"]) == 0
    steps = _checkpoint_steps(run)
    middle = steps[:-1]
    assert steps[-1] == 100 and 2 <= len(middle) <= 3, steps
    assert all(step % 8 == 0 for step in middle), steps
    # each about 3 s (30 steps) after the last, and heard within a log line or a poll
    assert all(30 <= b - a <= 30 + 8 + min(log_interval, 20)
               for a, b in zip([0] + middle, middle)), steps


def test_without_minutes_only_the_steps_decide(small_corpus, tmp_path):
    run = tmp_path / "run"
    assert _virtual(run, small_corpus, 2, ["training.log_interval=5"]) == 0
    assert _checkpoint_steps(run) == [100]


def test_the_parameter_server_checkpoints_by_its_own_clock(small_corpus, tmp_path):
    run = tmp_path / "run"
    assert _virtual(run, small_corpus, 3, ["parallel.method=param_server",
                                           "training.log_interval=5",
                                           "training.checkpoint_minutes=0.05"]) == 0
    steps = _checkpoint_steps(run)
    assert len(steps) >= 3 and steps[-1] == max(steps), steps


def test_pretraining_checkpoints_by_the_clock_at_its_averaging_points(small_corpus, tmp_path):
    # one rank, a clock that is always due: a checkpoint at every averaging point
    # (1000 frames of 100: every 10 steps), besides the layers' ends
    run = tmp_path / "run"
    argv = ["pretrain", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + [
            "model.hidden_layers=1", "model.hidden_dim=16", "pretrain.epochs_gaussian=0.1",
            "pretrain.average_every_frames=1000", "training.checkpoint_interval=0",
            "training.keep_checkpoints=1000", "training.checkpoint_minutes=1e-9"]:
        argv += ["--set", item]
    assert main(argv) == 0
    steps = _checkpoint_steps(run)
    assert len(steps) > 3 and all(step % 10 == 0 for step in steps[:-1]), steps
