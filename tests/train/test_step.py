"""The GPU training step never waits on a host read: checked without a GPU.

The stand-in for CuPy (mpitrain.testing.standin_cupy) runs the device code
paths on host memory and counts every implicit or explicit read of a device
value; ``backend.host_read_counts`` counts the reads routed through the
backend.  In steady state a training step reads nothing back (NG-SGD only
queues asynchronous copies of its small Gram matrices, one per Fisher
update), and the trainer reads its running sums once per log line.
"""

import math

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.comm.single import SingleCommunicator
from mpitrain.config import OptimizerConfig, RunConfig
from mpitrain.nn.network import build_network
from mpitrain.optim.factory import build_optimizer
from mpitrain.parallel.registry import build_strategy
from mpitrain.testing import standin_cupy
from mpitrain.train.step import TrainingStep

MINIBATCH = 32


class _Chunk:
    def __init__(self, xp, rng, frames=400, feat_dim=6, classes=9):
        bounds = np.repeat([0, 150, 260], [150, 110, 140])
        ends = np.repeat([150, 260, 400], [150, 110, 140])
        self.feats = backend.to_device(
            rng.standard_normal((frames, feat_dim)).astype(np.float32), xp)
        self.labels = backend.to_device(rng.integers(0, classes, frames).astype(np.int32), xp)
        self.utt_start = backend.to_device(bounds.astype(np.int64), xp)
        self.utt_end = backend.to_device(ends.astype(np.int64), xp)


def _stepper(xp, optimizer, momentum):
    net = build_network(feat_dim=6, num_classes=9, left_context=2, right_context=2,
                        hidden_layers=2, hidden_dim=24, xp=xp)
    net.init_params(seed=5)
    opt = build_optimizer(OptimizerConfig(name=optimizer, momentum=momentum,
                                          initial_learning_rate=0.01), net)
    strategy = build_strategy(RunConfig(), SingleCommunicator(), total_steps=100)
    strategy.setup(net, opt)
    step = TrainingStep(net, opt, strategy, minibatch=MINIBATCH, left_context=2,
                        right_context=2)
    chunk = _Chunk(xp, np.random.default_rng(0))
    orders = np.random.default_rng(1).permutation(400)

    def next_batch(position=[0]):
        lo = position[0] % (400 // MINIBATCH) * MINIBATCH
        position[0] += 1
        return chunk, backend.to_device(orders[lo:lo + MINIBATCH], xp)

    return net, opt, step, next_batch


def _run(xp, optimizer, momentum, steps):
    net, opt, step, next_batch = _stepper(xp, optimizer, momentum)
    for n in range(steps):
        step.run(n, 0.01, next_batch)
    return net, opt, step, next_batch


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("sgd", 0.5), ("ngsgd", 0.0)])
def test_steady_state_steps_read_nothing_back(optimizer, momentum):
    warmup, steps = 15, 20
    with standin_cupy.installed() as cp:
        net, opt, step, next_batch = _run(cp, optimizer, momentum, warmup)
        before = backend.host_read_counts()
        standin_cupy.reset_counts()
        for n in range(warmup, warmup + steps):
            step.run(n, 0.01, next_batch)
        after = backend.host_read_counts()
        assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}
        assert after["blocking"] == before["blocking"]
        fisher_copies = after["async"] - before["async"]
        if optimizer == "sgd":
            assert fisher_copies == 0
        else:
            # two small copies (Gram matrix, ||X||^2) per preconditioner and update
            preconditioners = len(opt.preconditioners)
            assert 0 < fisher_copies <= 2 * preconditioners * math.ceil(steps / 4)
        # the log line's read: one blocking read
        loss_sum, correct, frames = step.take_sums()
        assert backend.host_read_counts()["blocking"] == after["blocking"] + 1
        assert frames == (warmup + steps) * MINIBATCH and loss_sum > 0 and correct >= 0


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("sgd", 0.5), ("ngsgd", 0.0)])
def test_device_paths_compute_what_the_host_paths_compute(optimizer, momentum):
    """The device expressions (max-change, loss sums, NG-SGD) equal the NumPy code."""
    host_net, host_opt, host_step, _ = _run(np, optimizer, momentum, 25)
    with standin_cupy.installed() as cp:
        dev_net, dev_opt, dev_step, _ = _run(cp, optimizer, momentum, 25)
        dev_params = backend.to_host(dev_net.params)
        dev_sums = dev_step.take_sums()
        dev_scales = dev_opt.last_scales
    np.testing.assert_allclose(dev_params, host_net.params, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(dev_sums, host_step.take_sums(), rtol=1e-5)
    np.testing.assert_allclose(dev_scales, host_opt.last_scales, rtol=1e-5)
    assert dev_opt.num_steps == host_opt.num_steps == 25


def test_max_change_engages_and_nonfinite_steps_are_skipped_on_the_device():
    with standin_cupy.installed() as cp:
        net, opt, step, next_batch = _stepper(cp, "sgd", 0.5)
        step.run(0, 50.0, next_batch)                 # a huge rate: max-change must cap it
        scales = opt.last_scales
        # q = 1 - momentum = 0.5 where nothing is capped; the output layer is capped
        assert max(scales) <= 0.5 and 0 < min(scales) < 0.01
        before = backend.to_host(net.params).copy()
        net.grads[3] = np.float32("nan")
        opt.step(0.01)
        assert opt.num_skipped == 1 and opt.num_steps == 1
        np.testing.assert_array_equal(backend.to_host(net.params), before)
        assert not np.any(backend.to_host(opt.delta)), "momentum is cleared by a skipped step"


def test_trainer_reads_once_per_log_line(tmp_path, small_corpus_for_reads):
    """The whole trainer on the stand-in device: reads happen only at log lines,
    evaluations and checkpoints, never inside a step."""
    from mpitrain.config import load_config
    from mpitrain.train import trainer as trainer_module

    train, dev = small_corpus_for_reads
    cfg = load_config(None, [f"data.train={train}", f"data.dev={dev}", "device=gpu",
                             "data.chunk_frames=5000", "training.minibatch=64",
                             "training.epochs=1", "training.log_interval=10",
                             "training.checkpoint_interval=0", "model.hidden_layers=2",
                             "model.hidden_dim=32", "optimizer.name=ngsgd"])
    step_reads = []
    take_calls = []
    original_run, original_take = TrainingStep.run, TrainingStep.take_sums

    def counted_run(self, *args, **kwargs):
        before = (backend.host_read_counts()["blocking"], dict(standin_cupy.READS))
        result = original_run(self, *args, **kwargs)
        step_reads.append(backend.host_read_counts()["blocking"] - before[0]
                          + sum(standin_cupy.READS.values()) - sum(before[1].values()))
        return result

    def counted_take(self):
        take_calls.append(1)
        return original_take(self)

    with standin_cupy.installed():
        TrainingStep.run, TrainingStep.take_sums = counted_run, counted_take
        try:
            trainer = trainer_module.Trainer(cfg, run_dir=str(tmp_path / "run"),
                                             comm=SingleCommunicator())
            try:
                result = trainer.run()
            finally:
                trainer.close()
        finally:
            TrainingStep.run, TrainingStep.take_sums = original_run, original_take
    steps = result["steps"]
    assert len(step_reads) == steps and sum(step_reads) == 0
    assert len(take_calls) == math.ceil(steps / 10)
    assert result["dev_acc"] > 0.05          # it trained (chance is 1/num_classes)


@pytest.fixture(scope="module")
def small_corpus_for_reads(tmp_path_factory):
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("reads_corpus")
    synthesize(str(out), hours=0.02, speakers=4, shards=1, seed=3, dev_hours=0.005,
               dev_speakers=1)
    return str(out / "train"), str(out / "dev")
