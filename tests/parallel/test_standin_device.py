"""The newer parallel methods on the stand-in GPU device (mpitrain/testing/standin_cupy.py).

Asynchronous ADPSGD, the parameter server split over two servers and
hierarchical ADPSGD train on 4 virtual ranks with ``device: gpu``, where the
stand-in refuses host arrays mixed into device arithmetic: their exchange
buffers, slices and node reductions stay on the device.  The loss sums, a read of
the device, are taken every log_interval steps, not every step.  It runs no
GPU; it catches the host/device mix-ups a CPU run cannot.
"""

import pytest

from mpitrain.config import load_config
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
