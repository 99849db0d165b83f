"""Kaldi-style averaging (parallel/kaldi_averaging.py): the learning rate is set
once per iteration from the data processed before it, as Kaldi's train_dnn.py
does, not over the steps.

Kaldi's effective rate at iteration i is
lr_0 (lr_F / lr_0) ** (p_i / A), p_i the archives processed before it (each
iteration processes J_i), A those of the plan, and lr_F on the last
iteration; so with a job ramp the data fraction grows slower than the steps
at first.  Without a ramp it is the steps' at each iteration's start.
"""

import json
import math
import os
import warnings

import pytest

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.config import load_config
from mpitrain.parallel.kaldi_averaging import KaldiAveraging
from mpitrain.train.virtual import ComputeModel, train_virtual

from ..helpers import QUICKSTART, small_overrides


def _strategies(size, **kwargs):
    return VirtualCluster(size).run(lambda comm: KaldiAveraging(comm, **kwargs))


def test_data_fraction_counts_each_iterations_jobs():
    kaldi = _strategies(4, every_steps=5, total_steps=18, jobs_initial=1, jobs_final=4)[0]
    assert kaldi.jobs == [1, 2, 3, 3]            # iterations of 5, 5, 5 and 3 steps
    total = 1 * 5 + 2 * 5 + 3 * 5 + 3 * 3
    # constant within an iteration: the data trained before it
    assert [kaldi.data_fraction(s) for s in range(5)] == [0.0] * 5
    assert [kaldi.data_fraction(s) for s in range(5, 10)] == [5 / total] * 5
    assert [kaldi.data_fraction(s) for s in range(10, 15)] == [(5 + 10) / total] * 5
    assert [kaldi.data_fraction(s) for s in range(15, 18)] == [(5 + 10 + 15) / total] * 3
    # the rate: the same, but the last iteration at the final rate (the dropout
    # schedule keeps the data's fraction there, as Kaldi's)
    assert [kaldi.rate_fraction(s) for s in range(15)] == \
        [kaldi.data_fraction(s) for s in range(15)]
    assert [kaldi.rate_fraction(s) for s in range(15, 18)] == [1.0] * 3
    # behind the steps while few jobs train
    assert kaldi.data_fraction(9) < 5 / 18


def test_an_unset_initial_job_count_is_the_final_one():
    # parallel.num_jobs_initial 0 is num_jobs_final's count (the table said "all":
    # a ramp down from every rank); with both unset every rank trains throughout
    assert _strategies(4, every_steps=5, total_steps=20, jobs_final=2)[0].jobs == [2] * 4
    assert _strategies(4, every_steps=5, total_steps=20)[0].jobs == [4] * 4
    from mpitrain.config import reference_markdown
    row, = [line for line in reference_markdown().splitlines()
            if line.startswith("| `parallel.num_jobs_initial`")]
    assert "0: num_jobs_final's" in row, row


def test_the_rate_is_kaldis_at_every_step():
    """lr_eff(i) = lr0 exp((p_i / A) ln(lr1 / lr0)), lr1 on the last iteration, times
    J_i, computed from the spec's formula, not from data_fraction."""
    from mpitrain.optim.schedule import PlannedExponential
    kaldi = _strategies(4, every_steps=5, total_steps=20, jobs_initial=1, jobs_final=4)[0]
    schedule = PlannedExponential(0.004, 0.0004, planned_steps=20,
                                  progress=kaldi.rate_fraction)
    jobs, p, total = kaldi.jobs, [0], sum(j * 5 for j in kaldi.jobs)
    for j in jobs:
        p.append(p[-1] + j * 5)
    for step in range(20):
        i = step // 5
        eff = 0.0004 if i == len(jobs) - 1 else \
            0.004 * math.exp(p[i] / total * math.log(0.0004 / 0.004))
        assert math.isclose(kaldi.learning_rate(schedule.rate(step), step), jobs[i] * eff,
                            rel_tol=1e-12), step


def test_without_a_ramp_the_fraction_is_the_steps_at_each_iterations_start():
    for kaldi in _strategies(3, every_steps=4, total_steps=30):
        assert kaldi.jobs == [3] * 8
        assert all(kaldi.data_fraction(s) == s // 4 * 4 / 30 for s in range(28))
        assert all(kaldi.rate_fraction(s) == 1.0 for s in range(28, 31))


def test_a_ramped_runs_rate_decays_over_the_data_processed(small_corpus, tmp_path, capsys):
    # the dropout schedule runs over the data too: its rise ends (and early stopping
    # starts counting) where the data fraction reaches 0.5, past half the steps
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.dropout_schedule=0,0.2@0.5,0", "training.early_stop.patience=100",
        "model.hidden_dim=16", "model.hidden_layers=1", "parallel.method=kaldi",
        "parallel.average_every=2", "parallel.num_jobs_initial=1", "training.epochs=1",
        "training.log_interval=1", "training.eval_interval=0",
        "training.checkpoint_interval=0", "optimizer.initial_learning_rate=0.004",
        "optimizer.final_learning_rate=0.0004"])
    run_dir = str(tmp_path / "run")
    with warnings.catch_warnings():
        # an idle rank's log window takes no simulated time: no warning for it
        warnings.simplefilter("error", RuntimeWarning)
        train_virtual(cfg, size=4, run_dir=run_dir, compute=ComputeModel(step_seconds=0.001))
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    planned = next(r for r in records if r["type"] == "start")["planned_steps"]
    trains = [r for r in records if r["type"] == "train"]
    assert len(trains) == planned >= 8
    kaldi = _strategies(4, every_steps=2, total_steps=planned, jobs_initial=1)[0]
    assert kaldi.jobs[0] == 1 and kaldi.jobs[-1] == 4
    ramp_visible = False
    for record in trains:
        step = record["step"] - 1                 # the 0-based step the record ends
        jobs = kaldi.jobs[min(step // 2, len(kaldi.jobs) - 1)]
        fraction = kaldi.rate_fraction(step)
        expected = jobs * 0.004 * math.exp(fraction * math.log(0.1))
        assert math.isclose(record["lr"], expected, rel_tol=1e-9), (record, expected)
        by_steps = jobs * 0.004 * math.exp(step / planned * math.log(0.1))
        ramp_visible |= not math.isclose(record["lr"], by_steps, rel_tol=1e-6)
    assert ramp_visible
    rise_end = next(s for s in range(planned + 1) if kaldi.data_fraction(s) >= 0.5)
    assert rise_end > math.ceil(planned / 2)
    assert f"early_stop: counts held-out evaluations from step {rise_end} on" \
        in capsys.readouterr().out


def test_a_run_ending_inside_an_iteration_averages_that_iterations_jobs():
    import numpy as np
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD

    def work(comm):
        net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                            hidden_layers=1, hidden_dim=8)
        net.init_params(seed=1)
        kaldi = KaldiAveraging(comm, every_steps=4, total_steps=12, jobs_initial=1,
                               jobs_final=4)
        kaldi.setup(net, SGD(net))
        # two steps into iteration 1 (jobs [1, 2, 3]: 2 ranks train), the run ends
        assert kaldi.num_jobs(5) == 2
        net.params[...] = comm.rank + 1.0 if kaldi.is_active(5) else 1e3
        kaldi.finalize(net, SGD(net), 6)
        return net.params.copy()

    for params in VirtualCluster(4).run(work):
        assert np.array_equal(params, np.full_like(params, 1.5))     # (1 + 2) / 2


def test_every_average_starts_each_ranks_momentum_afresh():
    """Each Kaldi job builds a new trainer whose momentum is zero (nnet3's
    NnetTrainer zeroes its delta): kept across averages, a rank's momentum
    pushed the average's model its own way at once."""
    import numpy as np
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD

    def work(comm):
        net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                            hidden_layers=1, hidden_dim=8)
        net.init_params(seed=1)
        opt = SGD(net, momentum=0.5)
        kaldi = KaldiAveraging(comm, every_steps=2, total_steps=6)
        kaldi.setup(net, opt)
        seen = []
        for step in range(1, 5):
            net.grads[...] = np.random.default_rng([comm.rank, step]).standard_normal(
                net.num_params).astype(np.float32)
            opt.step(0.01)
            kaldi.after_update(net, opt, step)
            seen.append(bool(np.any(opt.momentum_buffer())))
        return seen

    for seen in VirtualCluster(2).run(work):
        assert seen == [True, False, True, False]      # zero right after each average


def test_the_first_iteration_takes_the_whole_model_max_change_over_sqrt_2():
    """Kaldi's train_dnn.py divides max-param-change by sqrt(2) on iteration 0; the
    training step hands the factor to the optimizer, whose global clip follows."""
    import numpy as np
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD
    from mpitrain.train.step import TrainingStep
    kaldi = _strategies(2, every_steps=4, total_steps=12)[0]
    assert [kaldi.max_change_factor(s) for s in range(12)] == \
        [2 ** -0.5] * 4 + [1.0] * 8
    assert KaldiAveraging(SingleCommunicator(), every_steps=4,
                          total_steps=4).max_change_factor(0) == 1.0    # one iteration only
    net = build_network(feat_dim=3, num_classes=4, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=1)
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0.01)
    one = KaldiAveraging(SingleCommunicator(), every_steps=1, total_steps=3)
    step = TrainingStep(net, opt, one, minibatch=8, left_context=0, right_context=0)
    rng = np.random.default_rng(0)

    class Chunk:
        feats = rng.standard_normal((8, 3)).astype(np.float32) * 5
        labels = rng.integers(0, 4, 8)
        utt_start = np.zeros(8, dtype=np.int64)
        utt_end = np.full(8, 8, dtype=np.int64)

    moved = []
    for n in range(2):
        before = net.params.copy()
        step.run(n, 10.0, lambda: (Chunk, np.arange(8)))
        moved.append(float(np.linalg.norm(np.float64(net.params) - before)))
    assert moved[0] == pytest.approx(0.01 / 2 ** 0.5, rel=1e-4)
    assert moved[1] == pytest.approx(0.01, rel=1e-4)


def test_the_job_count_never_passes_the_ranks_asked_for():
    # Kaldi's rounding to multiples of jobs_step made 3 jobs 4 on 3 ranks: 3 models
    # summed and divided by 4 at each average, at 4 times the rate
    kaldi = _strategies(3, every_steps=5, total_steps=20, jobs_initial=3, jobs_final=3,
                        jobs_step=2)[0]
    assert kaldi.jobs == [3] * 4
    assert kaldi.learning_rate(1.0) == 3.0
    down = _strategies(3, every_steps=5, total_steps=30, jobs_initial=3, jobs_final=1,
                       jobs_step=2)[0]
    assert down.jobs == [3, 2, 2, 2, 2, 1]
