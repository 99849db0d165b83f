"""Checkpoints of a real training run: rotated, complete, no temporary files left."""

import os

import pytest

from mpitrain.train.checkpoint import list_checkpoints, load_checkpoint

from ..helpers import train_in_process


@pytest.mark.slow
def test_checkpoints_are_rotated_and_complete(small_corpus, tmp_path):
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.checkpoint_interval=5",
                                         "training.keep_checkpoints=2", "training.max_steps=23",
                                         "model.hidden_dim=32", "training.plot=true"])
    # training.plot draws the run's curves as a PNG next to the model
    with open(run / "curves.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    found = list_checkpoints(run)
    assert [os.path.basename(p) for p in found] == ["ckpt-00000020.h5", "ckpt-00000023.h5"]
    ckpt = load_checkpoint(found[-1])
    assert ckpt.step == 23 and ckpt.num_ranks == 1
    assert ckpt.rank_state(0)["reader"]["batch_pos"] >= 0
    assert not [f for f in os.listdir(run) if ".tmp" in f]
