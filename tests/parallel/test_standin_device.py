"""The newer parallel methods on the stand-in GPU device (mpitrain/testing/standin_cupy.py).

Asynchronous ADPSGD, the parameter server split over two servers and
hierarchical ADPSGD train on 4 virtual ranks with ``device: gpu``, where the
stand-in refuses host arrays mixed into device arithmetic: their exchange
buffers, slices and node reductions stay on the device.  The loss sums, a read of
the device, are taken every log_interval steps, not every step.  It runs no
GPU; it catches the host/device mix-ups a CPU run cannot.

Every method (with SGD and momentum, and with NG-SGD's delayed updates planned
on threads) also trains on virtual ranks on the stand-in with no device read
inside a step, to the CPU run's model.
"""

import contextlib

import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.nn.model_file import load_model
from mpitrain.testing import standin_cupy
from mpitrain.train.step import TrainingStep
from mpitrain.train.virtual import ComputeModel, train_virtual

from ..helpers import records

METHODS = {
    "adpsgd-asynchronous": ["parallel.method=adpsgd", "parallel.asynchronous=true"],
    "param_server-2-servers": ["parallel.method=param_server", "parallel.servers=2"],
    "adpsgd-hierarchical": ["parallel.method=adpsgd", "parallel.hierarchical=true",
                            "parallel.ranks_per_node=2"],
}


@pytest.mark.parametrize("method", list(METHODS))
def test_trains_on_the_standin_device(small_corpus, tmp_path, method):
    cfg = load_config(None, [f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev",
                             "device=gpu", "data.chunk_frames=5000", "training.minibatch=64",
                             "training.max_steps=30", "training.log_interval=10",
                             "training.checkpoint_interval=10", "model.hidden_layers=2",
                             "model.hidden_dim=32"] + METHODS[method])
    run = tmp_path / "run"
    reads = []
    original = TrainingStep.take_sums

    def counted(self):
        reads.append(1)
        return original(self)

    TrainingStep.take_sums = counted
    try:
        with standin_cupy.installed():
            result = train_virtual(cfg, size=4, run_dir=str(run),
                                   compute=ComputeModel(step_seconds=0.002))
    finally:
        TrainingStep.take_sums = original
    assert result["steps"] >= 30 and (run / "final.h5").exists()
    if method == "adpsgd-asynchronous":
        # the loss sums (a read of the device) every log_interval steps of a rank,
        # not every step: at most 4 ranks x (their steps / 10 + the last one).  (A
        # parameter server's client sends them with every gradient it sends anyway.)
        most_steps = max(r["steps_max"] for r in records(run, "train"))
        assert len(reads) <= 4 * (most_steps // 10 + 2), (len(reads), most_steps)
    assert records(run, "start")[0]["device"] != "cpu"
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"], train
    assert list(run.glob("ckpt-*.h5"))


# Every method on virtual ranks, device: gpu on the stand-in against device: cpu.
EVERY_METHOD = {
    "model_averaging": (2, ["parallel.method=model_averaging", "parallel.average_every=4"]),
    "allreduce": (2, ["parallel.method=allreduce"]),
    "allreduce-overlap": (2, ["parallel.method=allreduce", "parallel.overlap=true",
                              "parallel.bucket_mb=0.01"]),
    "kaldi": (2, ["parallel.method=kaldi", "parallel.average_every=4"]),
    "bmuf": (2, ["parallel.method=bmuf", "parallel.average_every=4"]),
    "adpsgd": (2, ["parallel.method=adpsgd"]),
    "adpsgd-delay_by_one": (2, ["parallel.method=adpsgd", "parallel.delay_by_one=true"]),
    "adpsgd-random_ring": (4, ["parallel.method=adpsgd", "parallel.topology=random_ring"]),
    "adpsgd-hierarchical": (4, ["parallel.method=adpsgd", "parallel.hierarchical=true",
                                "parallel.ranks_per_node=2"]),
    "adpsgd-asynchronous": (2, ["parallel.method=adpsgd", "parallel.asynchronous=true"]),
    "param_server": (3, ["parallel.method=param_server"]),
}
OPTIMIZERS = {"sgd-momentum": ["optimizer.name=sgd", "optimizer.momentum=0.5"],
              "ngsgd-delayed": ["optimizer.name=ngsgd", "optimizer.ngsgd.delayed_updates=true",
                                "optimizer.ngsgd.plan_threads=2"]}


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("tiny_corpus")
    synthesize(str(out), hours=0.03, speakers=6, shards=2, seed=3, dev_hours=0.005,
               dev_speakers=1)
    return str(out)


def _train_counting_reads(monkeypatch, corpus, run_dir, device, method, optimizer):
    """Train on virtual ranks; the device reads inside each step (and each update a
    parameter server applies), and those between a client's pushes."""
    import threading

    from mpitrain.parallel.param_server import ParameterServer
    size, settings = EVERY_METHOD[method]
    cfg = load_config(None, [f"data.train={corpus}/train", f"data.dev={corpus}/dev",
                             f"device={device}", "data.chunk_frames=3000",
                             "training.minibatch=32", "training.max_steps=24",
                             "training.log_interval=8", "training.checkpoint_interval=0",
                             "model.hidden_layers=2", "model.hidden_dim=24"]
                      + settings + OPTIMIZERS[optimizer])
    local = threading.local()
    step_reads, client_reads = [], []

    class ThreadReads(dict):
        """The stand-in's count of device reads (blocking ones: backend.to_host
        and implicit conversions), also by thread: a rank waiting in a collective
        lets another rank run (and read at its log line)."""
        def __setitem__(self, key, value):
            local.reads = getattr(local, "reads", 0) + max(value - self.get(key, 0), 0)
            super().__setitem__(key, value)

    monkeypatch.setattr(standin_cupy, "READS", ThreadReads(standin_cupy.READS))

    def reads_now():
        return getattr(local, "reads", 0)

    def counted(original, into):
        def method_(self, *args, **kwargs):
            before = reads_now()
            try:
                return original(self, *args, **kwargs)
            finally:
                into.append(reads_now() - before)
        return method_

    def counted_push(self, *args, **kwargs):
        # a client's reads since its last push: its step and its loss sums
        if getattr(local, "since", None) is not None:
            client_reads.append(reads_now() - local.since)
        try:
            return original_push(self, *args, **kwargs)
        finally:
            local.since = reads_now()

    original_run, original_apply = TrainingStep.run, ParameterServer.apply
    original_push = ParameterServer.push
    TrainingStep.run = counted(original_run, step_reads)
    ParameterServer.apply = counted(original_apply, step_reads)
    ParameterServer.push = counted_push
    try:
        context = standin_cupy.installed() if device == "gpu" else contextlib.nullcontext()
        with context:
            train_virtual(cfg, size=size, run_dir=str(run_dir),
                          compute=ComputeModel(step_seconds=0.002))
    finally:
        TrainingStep.run, ParameterServer.apply = original_run, original_apply
        ParameterServer.push = original_push
    return step_reads, client_reads


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("method", list(EVERY_METHOD))
def test_every_method_steps_without_reads_and_trains_as_on_the_cpu(monkeypatch, tiny_corpus,
                                                                   tmp_path, method, optimizer):
    """No step reads the device (a parameter server's client reads its loss sums
    once per push, which waits for the gradient anyway), and the final model is
    the CPU run's: bit for bit with SGD, where the arithmetic is the same; with
    NG-SGD to float32 rounding (its preconditioned rows are the same, but its
    gamma factors are float32 device scalars there, float64 host numbers on the
    CPU).  Asynchronous ADPSGD is not compared: the device
    run's start-up agreement changes which rank goes first at equal simulated
    times, so its mixes fall on other steps."""
    steps, clients = _train_counting_reads(monkeypatch, tiny_corpus, tmp_path / "gpu", "gpu",
                                           method, optimizer)
    assert steps and sum(steps) == 0, steps
    if method == "param_server":
        assert clients and set(clients) == {1}, clients
    if method == "adpsgd-asynchronous":
        return
    _train_counting_reads(monkeypatch, tiny_corpus, tmp_path / "cpu", "cpu", method, optimizer)
    gpu, _ = load_model(str(tmp_path / "gpu" / "final.h5"))
    cpu, _ = load_model(str(tmp_path / "cpu" / "final.h5"))
    if optimizer.startswith("sgd"):
        np.testing.assert_array_equal(gpu.params, cpu.params)
    else:
        np.testing.assert_allclose(gpu.params, cpu.params, rtol=0, atol=1e-5)
