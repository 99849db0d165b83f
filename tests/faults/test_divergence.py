"""Divergence is handled, never hidden (train/divergence.py, train/trainer.py).

A learning rate that blows up ends the run with one line and exit status 2
after the configured roll backs, and no final model; a burst of non-finite
minibatches is skipped, counted, and rolled back from with the learning rate
halved, and the run then finishes; a few bad minibatches are only skipped and
counted; on two ranks a burst on one rank makes every rank roll back at the
same step.  Non-finite inputs are injected by tests/workers/nan_burst_worker.py.
"""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.nn.model_file import load_model
from mpitrain.testing.mpirun import run_mpi

from ..helpers import QUICKSTART, WORKERS, small_overrides

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.log_interval=5",
        "training.max_steps=60", "training.eval_interval=0"]


def _burst_worker():
    spec = importlib.util.spec_from_file_location("nan_burst_worker",
                                                  WORKERS / "nan_burst_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def nan_burst():
    """``nan_burst(first, count)``: NaN inputs for those minibatches of this process."""
    from mpitrain.train import step as step_module
    original = step_module.splice_batch_
    yield lambda first, count: _burst_worker().install({0}, first, count)
    step_module.splice_batch_ = original


def _train(run_dir, corpus, settings):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir)]
    for item in small_overrides(corpus) + TINY + list(settings):
        argv += ["--set", item]
    return main(argv)


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def test_a_diverging_learning_rate_stops_with_one_line_and_no_model(small_corpus, tmp_path,
                                                                     capsys):
    run = tmp_path / "run"
    code = _train(run, small_corpus, [
        "optimizer.initial_learning_rate=1e4", "optimizer.final_learning_rate=1e4",
        "optimizer.max_change=0", "optimizer.max_change_per_layer=0",
        "optimizer.max_change_output=0", "training.max_divergence_events=2",
        "training.max_rollbacks=2", "training.checkpoint_interval=10"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mpitrain train: error: ") and err.count("\n") == 1, err
    assert str(run) in err and "training diverged" in err and "initial_learning_rate" in err
    assert not (run / "final.h5").exists()
    assert [r["lr_scale"] for r in _records(run, "rollback")] == [0.5, 0.25]


def test_a_burst_of_bad_minibatches_rolls_back_with_half_the_rate_and_finishes(
        small_corpus, tmp_path, capsys, nan_burst):
    nan_burst(12, 8)
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.checkpoint_interval=10",
                                      "training.max_divergence_events=3"]) == 0
    out = capsys.readouterr().out
    assert "divergence: 3 skipped" in out          # the window that saw the start
    rollback, = _records(run, "rollback")
    assert rollback["step"] == 10 and rollback["lr_scale"] == 0.5 and rollback["rollbacks"] == 1
    end, = _records(run, "end")
    assert end["skipped_minibatches"] == 8 and end["rollbacks"] == 1 and end["steps"] == 60
    assert "rolled back to ckpt-00000010.h5" in out
    net, _ = load_model(str(run / "final.h5"))
    assert np.all(np.isfinite(net.params))
    # the learning rate after the roll back is half the schedule's
    lrs = {r["step"]: r["lr"] for r in _records(run, "train")}
    assert lrs[25] < 0.6 * lrs[5]


def test_before_the_first_checkpoint_a_roll_back_returns_to_the_initial_model(
        small_corpus, tmp_path, capsys, nan_burst):
    nan_burst(3, 6)
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.checkpoint_interval=0",
                                      "training.max_divergence_events=2"]) == 0
    assert "rolled back to the initial model (step 0)" in capsys.readouterr().out
    rollback, = _records(run, "rollback")
    assert rollback["step"] == 0


def test_the_time_left_after_a_roll_back_counts_the_abandoned_steps(small_corpus, tmp_path,
                                                                   capsys, nan_burst):
    # one virtual rank at 100 ms a step (simulated): the time left is exact
    nan_burst(40, 6)
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run), "--virtual", "1", "--compute-ms", "100"]
    for item in small_overrides(small_corpus) + TINY + [
            "training.checkpoint_interval=0", "training.max_divergence_events=2"]:
        argv += ["--set", item]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rolled back to the initial model (step 0)" in out
    after = out.split("rolled back to the initial model")[1]
    first = next(line for line in after.splitlines() if line.startswith("step 5/60 "))
    # 55 steps of 100 ms left (it divided all the time since the start by the 5
    # steps since the roll back: 0m54s)
    assert "ETA 0m05s" in first, first
    # and `status` of the run as it stood then, from the count in the train record
    from mpitrain.train.status import run_status
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    at = max(i for i, line in enumerate(lines)
             if '"type": "train"' in line and '"step": 5,' in line)
    assert json.loads(lines[at])["steps_trained"] > 5
    (tmp_path / "then").mkdir()
    (tmp_path / "then" / "metrics.jsonl").write_text("".join(lines[:at + 1]))
    assert run_status(tmp_path / "then")[1].endswith(", about 0m05s left"), \
        run_status(tmp_path / "then")


def test_a_few_bad_minibatches_are_skipped_and_counted_only(small_corpus, tmp_path, capsys,
                                                            nan_burst):
    nan_burst(7, 2)
    run = tmp_path / "run"
    assert _train(run, small_corpus, []) == 0
    out = capsys.readouterr().out
    assert "divergence: 2 skipped" in out and "2 minibatch(es) skipped as non-finite" in out
    assert _records(run, "rollback") == []
    assert [r["skipped"] for r in _records(run, "train")][:3] == [0, 2, 0]
    end, = _records(run, "end")
    assert end["skipped_minibatches"] == 2 and end["rollbacks"] == 0


def test_a_model_that_blows_up_within_its_first_window_is_judged(small_corpus, tmp_path,
                                                                   capsys):
    # BMUF's block step x 1e6 makes the objective explode (finite: about 42, then 68,
    # against ln 120 = 4.8) within the first log window; that window was the
    # reference of the running mean, so nothing counted and the run saved the model
    run = tmp_path / "run"
    code = _train(run, small_corpus, [
        "parallel.method=bmuf", "parallel.block_lr=1e6", "training.log_interval=20",
        "training.max_divergence_events=1", "training.max_rollbacks=1"])
    err = capsys.readouterr().err
    first = _records(run, "train")[0]
    assert first["skipped"] == 0 and first["xent"] > 3 * math.log(120)
    assert code == 2 and "training diverged" in err and err.count("\n") == 1, err
    assert not (run / "final.h5").exists()


@pytest.mark.mpi
def test_a_burst_on_one_rank_rolls_every_rank_back_at_the_same_step(mpiexec, small_corpus,
                                                                    tmp_path):
    run = tmp_path / "run"
    args = [str(WORKERS / "nan_burst_worker.py"), "1", "12", "8", "--", "train", QUICKSTART,
            "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + TINY + [
            "training.checkpoint_interval=10", "training.max_divergence_events=3",
            "parallel.average_every=2"]:
        args += ["--set", item]
    result = run_mpi(2, args, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rollback, = _records(run, "rollback")
    assert rollback["step"] == 10 and rollback["lr_scale"] == 0.5
    end, = _records(run, "end")
    assert end["skipped_minibatches"] == 8 and end["rollbacks"] == 1


def test_a_checkpoint_inside_a_window_that_went_bad_is_not_written(small_corpus, tmp_path,
                                                                  capsys, nan_burst):
    """A checkpoint between log lines looked at the last window alone: written at
    step 15 after the trouble began at 12, it was the model the roll back went to."""
    nan_burst(12, 8)
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.log_interval=10",
                                      "training.checkpoint_interval=5",
                                      "training.max_divergence_events=3"]) == 0
    out = capsys.readouterr().out
    assert "step 15: checkpoint not written (the model is diverging" in out, out
    assert "rolled back to ckpt-00000010.h5" in out, out
    rollback, = _records(run, "rollback")
    assert rollback["step"] == 10


@pytest.mark.parametrize("method,first,bad_step", [
    (["parallel.method=param_server"], 12, 15),
    (["parallel.method=adpsgd", "parallel.asynchronous=true"], 22, 16),
], ids=["param_server", "async_adpsgd"])
def test_an_asynchronous_checkpoint_inside_a_window_that_went_bad_is_not_written(
        small_corpus, tmp_path, capsys, monkeypatch, nan_burst, method, first, bad_step):
    """The asynchronous methods' checkpoints looked at the last whole window alone:
    one written after the trouble began, before the next log line, was the model a
    resume went on from (the lock-step loop also judges the window's part so far)."""
    from mpitrain.config import load_config
    from mpitrain.train import serving
    from mpitrain.train import step as step_module
    from mpitrain.train.virtual import ComputeModel, train_virtual
    # NaN inputs for minibatches first..first+7, counted over all (virtual) ranks
    nan_burst(first, 8)
    monkeypatch.setattr(serving, "splice_batch_", step_module.splice_batch_)
    run = tmp_path / "run"
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + method + [
        "training.log_interval=10", "training.checkpoint_interval=5",
        "training.max_divergence_events=100", "training.max_steps=40", "data.dev="])
    train_virtual(cfg, size=2, run_dir=str(run), compute=ComputeModel(step_seconds=0.002))
    out = capsys.readouterr().out
    written = [r["step"] for r in _records(run, "checkpoint")]
    assert f"step {bad_step}: checkpoint not written (the model is diverging" in out, out
    assert bad_step not in written and bad_step - 5 in written, written
    # the bad windows were logged, and the run finished
    assert any(r["skipped"] for r in _records(run, "train"))
    assert (run / "final.h5").exists()


def test_a_stop_inside_a_window_that_went_bad_writes_no_checkpoint(small_corpus, tmp_path,
                                                                  capsys, nan_burst):
    """The checkpoint a signal stops at is one between log lines too: written at step
    15 after the trouble began at 12, it was the model --resume went on from and a
    roll back returned to."""
    import signal
    from mpitrain.train import step as step_module
    from mpitrain.train.stop import EXIT_STOPPED
    nan_burst(12, 8)
    poisoned, launches = step_module.splice_batch_, []

    def splice_then_signal(*args, **kwargs):
        launches.append(1)
        if len(launches) == 15:
            os.kill(os.getpid(), signal.SIGTERM)
        return poisoned(*args, **kwargs)
    step_module.splice_batch_ = splice_then_signal
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.log_interval=10",
                                      "training.checkpoint_interval=0"]) == EXIT_STOPPED
    out = capsys.readouterr().out
    assert "stopped at step 15 of 60 on SIGTERM" in out, out
    assert "no checkpoint written (the model is diverging or not finite)" in out, out
    assert not [name for name in os.listdir(run) if name.startswith("ckpt-")]
