"""Search trials (train/search.py): a trial leaves the run's state untouched, and every
rank picks the same rate because the objectives are summed over ranks (on virtual
ranks, which equal mpiexec bit for bit: tests/train/test_virtual.py)."""

import os

import numpy as np

from mpitrain.comm.single import SingleCommunicator
from mpitrain.comm.virtual import VirtualCluster
from mpitrain.config import load_config
from mpitrain.optim.search import SearchSchedule
from mpitrain.train.search import RateTrials
from mpitrain.train.trainer import Trainer
from mpitrain.train.virtual import ComputeModel, run_virtual_trainers

from ..helpers import QUICKSTART, small_overrides

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.minibatch=128",
        "optimizer.schedule=search"]


def _trials(trainer):
    cfg = trainer.cfg
    return RateTrials(trainer.net, trainer.optimizer, trainer.strategy, trainer.stream,
                      trainer.comm, minibatch=cfg.training.minibatch,
                      left_context=cfg.data.left_context, right_context=cfg.data.right_context)


def test_a_trial_leaves_weights_optimizer_and_reader_untouched(small_corpus, tmp_path):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + [
        "optimizer.momentum=0.5", "optimizer.name=ngsgd"])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), comm=SingleCommunicator())
    try:
        trainer.stream.next_batch()               # mid-chunk, with a chunk loaded
        trainer.optimizer.delta[...] = 0.25       # momentum the trial must give back
        params = trainer.net.params.copy()
        reader = dict(trainer.stream.state_dict())
        objective, frames = _trials(trainer).run(0.004, steps=5, step=1)
        assert np.isfinite(objective) and objective > 0 and frames == 5 * 128
        np.testing.assert_array_equal(trainer.net.params, params)
        assert np.all(trainer.optimizer.delta == 0.25)
        assert trainer.optimizer.num_steps == 0
        assert all(p.t == 0 for p in trainer.optimizer.preconditioners.values())
        assert trainer.stream.state_dict() == reader
        # the reader gives the minibatch it would have given without the trial
        _, idx = trainer.stream.next_batch()
    finally:
        trainer.close()
    fresh = Trainer(cfg, run_dir=str(tmp_path / "fresh"), comm=SingleCommunicator())
    try:
        fresh.stream.next_batch()
        _, expected = fresh.stream.next_batch()
    finally:
        fresh.close()
    np.testing.assert_array_equal(idx, expected)


def test_a_trial_starts_no_gradient_reduction_of_an_overlapping_allreduce(small_corpus,
                                                                          tmp_path):
    # allreduce with overlap reduces gradients from a hook called during backward:
    # trial steps called it too, so a trial's gradients were reduced over the ranks
    # and its requests, left pending into the next real step, wrote into the
    # gradients there (the run then differed from its resumed continuation)
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + [
        "parallel.method=allreduce", "parallel.overlap=true"])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), comm=SingleCommunicator())
    try:
        calls = []

        def hook(offset):
            calls.append(offset)
        trainer.net.grad_ready_hook = hook        # (one rank sets none: stand in for it)
        objective, _ = _trials(trainer).run(0.004, steps=3, step=1)
        assert np.isfinite(objective) and calls == []
        assert trainer.net.grad_ready_hook is hook
    finally:
        trainer.close()


def test_ranks_choose_by_the_summed_objective_not_their_own():
    # rank 0 alone would pick factor 0.5, rank 1 alone factor 2; summed: factor 1
    own = {0: [1.0, 2.0, 9.0], 1: [9.0, 2.0, 1.0]}

    def work(comm):
        sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=10, trial_steps=1)
        calls = []

        def trial(rate):
            sums = np.array([own[comm.rank][len(calls)], 1.0])
            calls.append(rate)
            comm.allreduce_(sums, op="sum")
            return sums[0] / sums[1], int(sums[1])

        sched.search(0, trial)
        return sched.rate(0)

    assert VirtualCluster(2).run(work) == [0.008, 0.008]


def test_two_ranks_agree_on_every_search(small_corpus, tmp_path):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + [
        "optimizer.search_chunk_frames=10000", "training.max_steps=60",
        "training.log_interval=20", "training.checkpoint_interval=0"])
    pairs = run_virtual_trainers(cfg, size=2, run_dir=str(tmp_path / "run"),
                                 compute=ComputeModel(step_seconds=0.001))
    states = [trainer.schedule.state_dict() for trainer, _ in pairs]
    assert states[0] == states[1]
    assert states[0]["searches"] == 2                   # steps 0 and 39 (10000 / 256)
    # trial frames over both ranks: 2 searches x 3 factors x 2 steps (the least a trial
    # takes) x 128 frames x 2 ranks
    assert pairs[0][1]["trial_frames"] == 2 * 3 * 2 * 128 * 2
    with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as fh:
        assert fh.read().count('"type": "search"') == 2


class _JobsAveraging:
    """A strategy that trains at 4 times the rate with the L2 term scaled by 1/4
    (as Kaldi's averaging of 4 jobs)."""

    def learning_rate(self, lr, step=0):
        return 4 * lr

    def l2_factor(self, step=0):
        return 0.25

    def max_change_factor(self, step=0):
        return 2 ** -0.5       # (Kaldi's first iteration)


def test_a_trial_scales_the_l2_term_as_the_real_steps_at_its_rate(small_corpus, tmp_path):
    # a trial at the strategy's rate (J lr) must shrink the weights as real steps
    # there do: with the L2 term scaled by the strategy's 1/J, not by 1; and it
    # clips the whole model's change as they do (Kaldi's first iteration: M/sqrt(2))
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + [
        "optimizer.l2_regularize=0.001"])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), comm=SingleCommunicator())
    try:
        optimizer = trainer.optimizer
        seen = []
        step = optimizer.step

        def recording_step(lr):
            seen.append((lr, optimizer.l2_factor, optimizer.max_change_factor))
            return step(lr)

        optimizer.step = recording_step
        cfg_ = trainer.cfg
        trials = RateTrials(trainer.net, optimizer, _JobsAveraging(), trainer.stream,
                            trainer.comm, minibatch=cfg_.training.minibatch,
                            left_context=cfg_.data.left_context,
                            right_context=cfg_.data.right_context)
        trials.run(0.001, steps=2, step=0)
    finally:
        trainer.close()
    assert seen and all(lr == 0.004 and factor == 0.25 and clip == 2 ** -0.5
                        for lr, factor, clip in seen), seen


def test_the_trainer_gives_search_the_rate_where_the_l2_zeroes_the_weights(small_corpus,
                                                                          tmp_path):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + [
        "optimizer.l2_regularize=0.1"])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), comm=SingleCommunicator())
    try:
        # 2 lr x 0.1 x 128 frames reaches 1 at lr 1 / 25.6
        assert trainer.schedule.rate_limit == 1 / 25.6
    finally:
        trainer.close()
