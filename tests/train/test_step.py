"""The training step (train/step.py) never waits on a host read, and computes on the
device what it computes on the host.

Without a GPU: the stand-in for CuPy (mpitrain.testing.standin_cupy) runs the
device code paths on host memory and counts every implicit or explicit read of
a device value; ``backend.host_read_counts`` counts the reads routed through
the backend.  In steady state a training step reads nothing back (NG-SGD only
queues asynchronous copies of its small Gram matrices, one per Fisher update).

On a GPU (marked gpu; skipped without CuPy and a CUDA device, a failure with
MPITRAIN_TEST_GPU=1): training gives the CPU's results to float32 tolerance,
steady-state steps never synchronise, and CUDA-graph replay trains like eager
steps.
"""

import math

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.comm.single import SingleCommunicator
from mpitrain.config import OptimizerConfig, RunConfig
from mpitrain.data.splice import splice, splice_indices
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
    config = OptimizerConfig(name=optimizer.split("-")[0], momentum=momentum,
                             initial_learning_rate=0.01)
    config.ngsgd.delayed_updates = optimizer.endswith("-delayed")
    opt = build_optimizer(config, net)
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


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("sgd", 0.5), ("ngsgd", 0.0),
                                                ("ngsgd-delayed", 0.0)])
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
        loss_sum, correct, frames, _ = step.take_sums()
        assert backend.host_read_counts()["blocking"] == after["blocking"] + 1
        assert frames == (warmup + steps) * MINIBATCH and loss_sum > 0 and correct >= 0


def test_plan_threads_read_nothing_back_and_wait_on_the_ranks_device(monkeypatch):
    """With optimizer.ngsgd.plan_threads, steady-state steps still read nothing
    back on the training thread, and the worker threads that wait for the Gram
    matrices use the rank's device (device 1 here), not device 0."""
    import threading

    from mpitrain.optim import natural_gradient as pc
    devices = []
    real = pc._plan_update

    def spy(*args, **kwargs):
        # by thread: a plan of another test's pool may still be running
        devices.append((threading.current_thread(), backend._cupy.cuda.runtime.getDevice()))
        return real(*args, **kwargs)

    monkeypatch.setattr(pc, "_plan_update", spy)
    with standin_cupy.installed() as cp:
        cp.cuda.Device(1).use()
        try:
            net, opt, step, next_batch = _stepper(cp, "ngsgd", 0.0)
            opt.joint_updates.threads = 2
            for n in range(15):
                step.run(n, 0.01, next_batch)
            before = backend.host_read_counts()
            standin_cupy.reset_counts()
            for n in range(15, 35):
                step.run(n, 0.01, next_batch)
            assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}
            assert backend.host_read_counts()["blocking"] == before["blocking"]
        finally:
            cp.cuda.Device(0).use()
    workers = set(opt.joint_updates._pool._threads)
    opt.joint_updates.close()
    mine = [device for thread, device in devices if thread in workers]
    assert len(mine) >= 20 and set(mine) == {1}


@pytest.mark.parametrize("device", ["host", "standin"])
@pytest.mark.parametrize("optimizer", ["sgd", "ngsgd"])
@pytest.mark.parametrize("first", [12, 3], ids=["steady", "start-up"])
def test_non_finite_steps_are_skipped_and_counted_in_the_one_log_read(device, optimizer,
                                                                     first):
    """A minibatch whose inputs are NaN leaves the parameters alone, and the log
    line's single read carries the count of skipped steps (device or host).  Four
    in a row include an NG-SGD Fisher update (every 4th call in the steady state,
    every call in the start-up phase): it is left out, the estimate stays finite."""
    import contextlib
    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        net, opt, step, next_batch = _run(xp, optimizer, 0.0, first)
        step.take_sums()
        before = backend.to_host(net.params).copy()

        forward_backward = net.forward_backward

        def on_nan_inputs(x, labels, *, into=None):
            x[...] = np.nan                 # what splicing NaN features would leave
            return forward_backward(x, labels, into=into)

        net.forward_backward = on_nan_inputs
        for n in range(first, first + 4):
            step.run(n, 0.01, next_batch)
        net.forward_backward = forward_backward
        reads = backend.host_read_counts()["blocking"]
        _, _, frames, skipped = step.take_sums()
        # one read of the device per log line (the host has nothing to read)
        assert backend.host_read_counts()["blocking"] == reads + (device == "standin")
        assert skipped == 4 and frames == 4 * MINIBATCH
        np.testing.assert_array_equal(backend.to_host(net.params), before)
        for n in range(first + 4, first + 7):             # sound steps are not counted
            step.run(n, 0.01, next_batch)
        assert step.take_sums()[3] == 0
        after = backend.to_host(net.params)
        assert np.all(np.isfinite(after)) and not np.array_equal(after, before)
        if optimizer == "ngsgd":
            sides = opt.preconditioners.values()
            assert sum(p.dropped_updates for p in sides) > 0
            assert all(np.all(np.isfinite(p.state_dict()["W"])) for p in sides)


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


# ------------------------------------------------------------------ on a GPU

def _train(xp, optimizer_name, steps=6):
    net = build_network(feat_dim=8, num_classes=12, left_context=2, right_context=2,
                        hidden_layers=2, hidden_dim=48, xp=xp)
    net.init_params(seed=3)
    opt = build_optimizer(OptimizerConfig(name=optimizer_name, momentum=0.5), net)
    rng = np.random.default_rng(0)
    feats = xp.asarray(rng.standard_normal((400, 8)).astype(np.float32))
    start = xp.asarray(np.repeat([0, 100, 250], [100, 150, 150]))
    end = xp.asarray(np.repeat([100, 250, 400], [100, 150, 150]))
    losses = []
    for step in range(steps):
        idx = xp.asarray(rng.permutation(400)[:64])
        ctx = splice_indices(idx, start[idx], end[idx], 2, 2)
        labels = xp.asarray(rng.integers(0, 12, 64))
        loss, _ = net.forward_backward(splice(feats, ctx), labels)
        opt.step(0.01)
        losses.append(float(loss))
    return backend.to_host(net.params), losses


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer_name", ["sgd", "ngsgd"])
def test_gpu_training_matches_cpu(cp, optimizer_name):
    cpu_params, cpu_losses = _train(np, optimizer_name)
    gpu_params, gpu_losses = _train(cp, optimizer_name)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    np.testing.assert_allclose(gpu_params, cpu_params, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer,delayed,plan_threads", [
    ("sgd", False, 0), ("ngsgd", False, 0), ("ngsgd", False, 2), ("ngsgd", True, 0),
    ("ngsgd", True, 2)])
def test_steady_state_steps_never_wait_for_the_gpu(cp, optimizer, delayed, plan_threads):
    """On the real device: no read through the backend and no CuPy-detected
    synchronisation during 24 steady-state steps of the trainer's step (on the
    training thread: with plan threads, those wait for the Gram matrices)."""
    import warnings

    import cupyx

    from mpitrain.bench.throughput import MODELS, MpitrainSteps, synthetic_chunk

    model = MODELS["quick"]
    chunk, perm = synthetic_chunk(model, 20_000)
    steps = MpitrainSteps(model, chunk, perm, xp=cp, optimizer=optimizer,
                          ngsgd_delayed_updates=delayed, plan_threads=plan_threads)
    for _ in range(16):                      # buffers, kernels, NG-SGD's first updates
        steps.step()
    before = backend.host_read_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cupyx.allow_synchronize(False):
            for _ in range(24):
                steps.step()
    after = backend.host_read_counts()
    assert after["blocking"] == before["blocking"]
    if optimizer == "sgd":
        assert after["async"] == before["async"]
    loss_sum, correct, frames, _ = steps.training_step.take_sums()
    assert frames == 40 * model.minibatch and np.isfinite(loss_sum)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer,delayed,plan_threads", [
    ("sgd", False, 0), ("ngsgd", False, 0), ("ngsgd", False, 2), ("ngsgd", True, 0),
    ("ngsgd", True, 2)])
def test_cuda_graph_replay_trains_like_eager_steps(cp, optimizer, delayed, plan_threads):
    """With cuda_graph the steps replayed from a graph give the eager steps'
    parameters: the same kernels on the same data, so equal to float32 rounding
    of cuBLAS's algorithm choice (rtol 1e-5).  The graphed run plans its Fisher
    updates on ``plan_threads`` worker threads, the eager one on its own."""
    from mpitrain.bench.throughput import MODELS, MpitrainSteps, synthetic_chunk

    model = MODELS["quick"]
    chunk, perm = synthetic_chunk(model, 20_000)
    options = dict(xp=cp, optimizer=optimizer, ngsgd_delayed_updates=delayed)
    eager = MpitrainSteps(model, chunk, perm, **options)
    graphed = MpitrainSteps(model, chunk, perm, cuda_graph=True, plan_threads=plan_threads,
                            **options)
    for _ in range(40):
        eager.step()
        graphed.step()
    graph = graphed.training_step.graph
    assert graph.enabled, graph.why_not
    # SGD: every step after two eager ones.  NG-SGD: from t = 12 on, the two of
    # every four calls that neither start nor finish a Fisher update (14 of 40);
    # with delayed updates the three that start none (21 of 40).
    assert graph.replays >= {"sgd": 38, "ngsgd": 21 if delayed else 14}[optimizer]
    np.testing.assert_allclose(backend.to_host(graphed.net.params),
                               backend.to_host(eager.net.params), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graphed.training_step.take_sums()[:2],
                               eager.training_step.take_sums()[:2], rtol=1e-5)
    assert graphed.optimizer.num_steps == eager.optimizer.num_steps == 40


def test_cuda_graph_asked_for_and_not_used_is_said(small_corpus, tmp_path, capsys):
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, small_overrides
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus) + ["cuda_graph=true", "training.max_steps=4",
                                                 "model.hidden_dim=16"]:
        argv += ["--set", item]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("cuda_graph: not used: it replays steps on a GPU (device: cpu)") == 1


@pytest.mark.parametrize("version,enabled", [(120104, False), (11605, False), (120200, True)])
def test_cuda_graph_is_off_with_a_cublas_that_grows_a_workspace_per_capture(
        monkeypatch, version, enabled):
    """cuBLAS before 12.2 allocates a new workspace for every capture, and a run
    captures each new chunk anew: graphs stay off there, saying why."""
    with standin_cupy.installed() as cp:
        monkeypatch.setattr(backend, "fused_kernels", lambda xp: xp is cp)
        monkeypatch.setattr(backend, "use_own_stream", lambda xp: object())
        monkeypatch.setitem(standin_cupy.DEVICE, "cublas_version", version)
        net, opt, _, _ = _stepper(cp, "sgd", 0.0)
        strategy = build_strategy(RunConfig(), SingleCommunicator(), total_steps=100)
        strategy.setup(net, opt)
        step = TrainingStep(net, opt, strategy, minibatch=MINIBATCH, left_context=2,
                            right_context=2, cuda_graph=True)
    assert step.graph.enabled is enabled
    if not enabled:
        release = "12.1" if version > 100000 else "11.6"
        assert step.graph.why_not == (
            f"cuBLAS {release} allocates a new workspace for every capture (fixed in 12.2), "
            "and each new chunk of data is captured anew: GPU memory would grow all run")
