"""Kaldi's final combination (train/combine.py): weights on the simplex, never worse
on the held-out frames than the best single model, and a `combine` record in the
log, on one rank and (marked mpi) on two ranks that end between averages, so that
their own models are candidates too."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.comm.single import SingleCommunicator
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model
from mpitrain.testing.mpirun import run_mpi
from mpitrain.train.combine import FinalCombination, project_to_simplex
from mpitrain.train.evaluate import evaluate_chunks, load_eval_chunks

from ..helpers import QUICKSTART, small_overrides, train_in_process

TINY = ["model.hidden_layers=1", "model.hidden_dim=24", "training.epochs=1",
        "training.combine=true", "training.combine_every=40"]


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def test_projection_onto_the_simplex():
    np.testing.assert_allclose(project_to_simplex([0.8, 0.6]), [0.6, 0.4])
    np.testing.assert_allclose(project_to_simplex([2.0, -1.0, 0.0]), [1.0, 0.0, 0.0])
    p = project_to_simplex(np.random.default_rng(0).standard_normal(7))
    assert p.min() >= 0 and p.sum() == pytest.approx(1.0)


def test_snapshots_are_the_last_models_at_sync_points_spaced_by_combine_every():
    cfg = SimpleNamespace(training=SimpleNamespace(combine_models=3, combine_every=4,
                                                   combine_frames=100))
    combination = FinalCombination(cfg, SingleCommunicator(), sync_period=2, total_steps=20)
    net = SimpleNamespace(params=np.zeros(2, dtype=np.float32))
    for step in range(1, 21):
        net.params[...] = step
        combination.observe(step, net)
    # sync points 2, 4, ...; kept at least 4 steps apart: 2, 6, 10, 14, 18; the last 3
    assert [s for s, _ in combination.snapshots] == [10, 14, 18]
    assert [float(p[0]) for _, p in combination.snapshots] == [10.0, 14.0, 18.0]
    assert float(combination.own_last[0]) == 20.0


@pytest.fixture(scope="module")
def combined_run(small_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("combine") / "run"
    train_in_process(run, small_corpus, TINY)
    return run


def test_training_with_combine_logs_a_combine_record_and_never_loses(combined_run):
    found, = _records(combined_run, "combine")
    assert len(found["models"]) == len(found["weights"]) >= 2
    assert min(found["weights"]) >= 0 and sum(found["weights"]) == pytest.approx(1, abs=1e-5)
    assert found["combined_xent"] <= found["best_single_xent"]
    assert found["gain_xent"] >= 0 and found["frames"] == 5000
    assert found["frames_from"] == "data.dev"


def test_without_a_held_out_set_the_combination_names_its_training_frames(small_corpus,
                                                                          tmp_path, capsys):
    # the weights are fit on training frames then: the line called them held-out
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + ["data.dev=", "training.max_steps=40"])
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("combine:")]
    assert "5000 training (no data.dev) frames" in line and "held-out" not in line
    assert _records(run, "combine")[0]["frames_from"] == "data.train"


def test_combination_is_never_worse_than_the_best_single_model(combined_run, small_corpus):
    """Candidates theta* +- delta: their mean (theta*) beats both; the search finds it."""
    net, _ = load_model(str(combined_run / "final.h5"))
    trained = np.array(net.params, copy=True)
    delta = np.random.default_rng(1).standard_normal(net.num_params).astype(np.float32) * 0.05
    cfg = SimpleNamespace(training=SimpleNamespace(combine_models=5, combine_every=0,
                                                   combine_frames=3000))
    combination = FinalCombination(cfg, SingleCommunicator(), sync_period=1, total_steps=2)
    net.params[...] = trained + delta
    combination.observe(1, net)
    net.params[...] = trained - 0.5 * delta
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    found = combination.combine(net, dev)
    assert found["models"] == ["step 1", "final"]
    assert found["combined_xent"] < found["best_single_xent"]
    assert found["weights"][0] == pytest.approx(1 / 3, abs=0.1)
    # the network holds the combination, and it scores what was reported
    total, correct, frames = evaluate_chunks(net, load_eval_chunks(dev, net, max_frames=3000))
    assert total / frames == pytest.approx(found["combined_xent"], rel=1e-6)
    # one candidate better than the other: never worse than it
    net.params[...] = trained
    combination.snapshots = [(1, (trained + 4 * delta).astype(np.float32))]
    found = combination.combine(net, dev)
    assert found["best_single"] == "final"
    assert found["combined_xent"] <= found["best_single_xent"]


def test_the_weights_gradient_is_the_held_out_gradient_dotted_with_each_model(small_corpus):
    """dL/dalpha_m = grad L(theta(alpha)) . theta_m, L the cross-entropy per frame:
    against central differences of L itself (a scale or sign slip would still let
    the line search end no worse than the best single model)."""
    from mpitrain.nn.network import build_network
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    net = build_network(feat_dim=dev.feat_dim, num_classes=dev.num_classes, left_context=2,
                        right_context=2, hidden_layers=1, hidden_dim=16)
    net.init_params(seed=1)
    net.set_cmvn(np.array(dev.cmvn_mean), np.array(dev.cmvn_var))
    rng = np.random.default_rng(0)
    models = [(net.params + 0.3 * rng.standard_normal(net.num_params)).astype(np.float32)
              for _ in range(3)]
    cfg = SimpleNamespace(training=SimpleNamespace(combine_models=5, combine_every=0,
                                                   combine_frames=2000))
    combination = FinalCombination(cfg, SingleCommunicator(), sync_period=1, total_steps=2)
    chunks = load_eval_chunks(dev, net, max_frames=2000)
    alpha, h = np.array([0.5, 0.3, 0.2]), 1e-3
    _, _, grad, _ = combination._objective(net, chunks, models, alpha, gradient=True)
    for m in range(3):
        step = h * np.eye(3)[m]
        up, _, _, _ = combination._objective(net, chunks, models, alpha + step, gradient=False)
        down, _, _, _ = combination._objective(net, chunks, models, alpha - step,
                                               gradient=False)
        assert grad[m] == pytest.approx((up - down) / (2 * h), rel=2e-3)


def test_with_bmuf_the_combination_is_evaluated_kept_and_checkpointed(small_corpus, tmp_path):
    """BMUF's model is w_g, not the point the ranks train from: the combination went
    to final.h5 only, while the last evaluation, best.h5 and the final checkpoint
    held w_g from before it (eval RUN_DIR read that one)."""
    from mpitrain.train.checkpoint import list_checkpoints, load_checkpoint
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + [
        "parallel.method=bmuf", "parallel.block_momentum=0.9", "training.combine_every=0",
        "training.combine_frames=100000", "training.max_steps=60"])
    found, = _records(run, "combine")
    assert found["weights"][-1] < 0.999          # the combination is not w_g itself
    final, _ = load_model(str(run / "final.h5"))
    best, _ = load_model(str(run / "best.h5"))
    last = load_checkpoint(list_checkpoints(str(run))[-1])
    assert np.array_equal(final.params, best.params)
    assert np.array_equal(final.params, last.net.params)
    assert _records(run, "eval")[-1]["dev_xent"] == pytest.approx(found["combined_xent"],
                                                                   rel=1e-6)


@pytest.mark.mpi
def test_combine_on_two_ranks_with_models_that_differ(mpiexec, small_corpus, tmp_path):
    run = tmp_path / "run"
    args = ["-m", "mpitrain", "train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + TINY + ["parallel.average_every=16"]:
        args += ["--set", item]
    result = run_mpi(2, args, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found, = _records(run, "combine")
    assert _records(run, "end")[0]["steps"] % 16      # the run ended between averages
    assert {"rank 0", "rank 1", "final"} <= set(found["models"])
    assert found["combined_xent"] <= found["best_single_xent"]
