"""Training on the GPU gives the CPU's results to float32 tolerance.

Skips without CuPy and a CUDA device; MPITRAIN_TEST_GPU=1 makes that a failure.
"""

import os

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.data.splice import splice, splice_indices
from mpitrain.nn.network import build_network
from mpitrain.optim.factory import build_optimizer
from mpitrain.config import OptimizerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture
def cupy():
    if not backend.gpu_available():
        if os.environ.get("MPITRAIN_TEST_GPU") == "1":
            pytest.fail("MPITRAIN_TEST_GPU=1 but no usable CuPy/CUDA device")
        pytest.skip("cupy with a usable CUDA device is not available")
    return backend.select("gpu")


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


@pytest.mark.parametrize("optimizer_name", ["sgd", "ngsgd"])
def test_gpu_training_matches_cpu(cupy, optimizer_name):
    cpu_params, cpu_losses = _train(np, optimizer_name)
    gpu_params, gpu_losses = _train(cupy, optimizer_name)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    np.testing.assert_allclose(gpu_params, cpu_params, rtol=1e-3, atol=1e-5)


def test_gpu_device_selection_by_local_rank(cupy):
    count = cupy.cuda.runtime.getDeviceCount()
    backend.select("gpu", local_rank=count + 1)
    assert cupy.cuda.Device().id == 1 % count
    backend.select("gpu", local_rank=0)


@pytest.mark.parametrize("optimizer", ["sgd", "ngsgd"])
def test_steady_state_steps_never_wait_for_the_gpu(cupy, optimizer):
    """On the real device: no read through the backend and no CuPy-detected
    synchronisation during 24 steady-state steps of the trainer's step."""
    import warnings

    import cupyx

    from mpitrain.bench.throughput import MODELS, MpitrainSteps, synthetic_chunk

    model = MODELS["quick"]
    chunk, perm = synthetic_chunk(model, 20_000)
    steps = MpitrainSteps(model, chunk, perm, xp=cupy, optimizer=optimizer)
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
    loss_sum, correct, frames = steps.training_step.take_sums()
    assert frames == 40 * model.minibatch and np.isfinite(loss_sum)


@pytest.mark.parametrize("optimizer", ["sgd", "ngsgd"])
def test_cuda_graph_replay_trains_like_eager_steps(cupy, optimizer):
    """With cuda_graph the steps replayed from a graph give the eager steps'
    parameters: the same kernels on the same data, so equal to float32 rounding
    of cuBLAS's algorithm choice (rtol 1e-5)."""
    from mpitrain.bench.throughput import MODELS, MpitrainSteps, synthetic_chunk

    model = MODELS["quick"]
    chunk, perm = synthetic_chunk(model, 20_000)
    eager = MpitrainSteps(model, chunk, perm, xp=cupy, optimizer=optimizer)
    graphed = MpitrainSteps(model, chunk, perm, xp=cupy, optimizer=optimizer, cuda_graph=True)
    for _ in range(40):
        eager.step()
        graphed.step()
    graph = graphed.training_step.graph
    assert graph.enabled, graph.why_not
    # SGD: every step after two eager ones.  NG-SGD: from t = 12 on, the two of
    # every four calls that neither start nor finish a Fisher update (14 of 40).
    assert graph.replays >= (14 if optimizer == "ngsgd" else 38)
    np.testing.assert_allclose(backend.to_host(graphed.net.params),
                               backend.to_host(eager.net.params), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graphed.training_step.take_sums()[:2],
                               eager.training_step.take_sums()[:2], rtol=1e-5)
    assert graphed.optimizer.num_steps == eager.optimizer.num_steps == 40
