"""A run continues on another number of ranks (N -> M).

The data is re-planned over the new ranks, the same fraction of the schedule
counts as done, rules that depend on the rank count are re-applied (they are
computed from the job's size when the strategy is built), per-rank optimizer
state starts afresh and the log says so; the run then reaches the accuracy
of an uninterrupted one.
"""

import json
import os

import numpy as np
import pytest

from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model

from ..helpers import records, train_on_ranks

TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]

pytestmark = pytest.mark.mpi


def _train(nranks, run_dir, corpus, settings, *, resume=False, timeout=180):
    result = train_on_ranks(nranks, run_dir, corpus, ["training.log_interval=10", *settings],
                            resume=resume, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-4000:]
    return result


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)])
def test_resume_on_another_number_of_ranks_continues_the_schedule(small_corpus, tmp_path,
                                                                  before, after):
    run = tmp_path / "run"
    common = TINY + ["training.epochs=1", "training.checkpoint_interval=8",
                     "parallel.average_every=4"]
    _train(before, run, small_corpus, common + ["training.max_steps=40"])
    first = records(run, "start")[0]
    result = _train(after, run, small_corpus, common, resume=True)
    assert "optimizer state (momentum, natural-gradient statistics) starts afresh" in \
        result.stdout
    change, = records(run, "rank_change")
    assert (change["from_ranks"], change["to_ranks"], change["from_step"]) == \
        (before, after, 40)
    second = records(run, "start")[1]
    assert second["ranks"] == after
    # the same fraction of the planned run is done on the new ranks
    assert change["to_step"] == round(40 * second["planned_steps"] / first["planned_steps"])
    assert second["step"] == change["to_step"]
    end = records(run, "end")[-1]
    assert end["steps"] == second["total_steps"]
    with open(run / "metrics.jsonl") as fh:
        everything = list(map(json.loads, fh))
    second_start = [i for i, r in enumerate(everything) if r["type"] == "start"][1]
    train = [r for r in everything[second_start:] if r["type"] == "train"]
    # frames carried over: the first line after the resume counts on from 40 x before
    assert train and train[0]["frames"] > 40 * before * 256
    net, _ = load_model(run / "final.h5")
    assert np.isfinite(net.params).all()


@pytest.mark.slow
def test_two_to_four_ranks_reaches_the_accuracy_bar(small_corpus, tmp_path):
    run = tmp_path / "run"
    _train(2, run, small_corpus, ["training.epochs=2", "training.max_steps=200",
                                  "training.log_interval=50"], timeout=300)
    _train(4, run, small_corpus, ["training.epochs=2", "training.log_interval=50"],
           resume=True, timeout=300)
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()
    final = records(run, "eval")[-1]
    # the bar of an uninterrupted run (tests/train/test_trainer.py)
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40, (final, majority)


@pytest.mark.parametrize("method", [["parallel.method=param_server"],
                                    ["parallel.method=adpsgd", "parallel.asynchronous=true"]],
                         ids=["param_server", "async_adpsgd"])
def test_methods_whose_ranks_take_their_own_steps_resume_on_another_number(small_corpus,
                                                                           tmp_path, method):
    run = tmp_path / "run"
    common = TINY + method + ["training.epochs=1", "training.checkpoint_interval=8"]
    _train(3, run, small_corpus, common + ["training.max_steps=24"])
    first_end = records(run, "end")[-1]
    _train(2, run, small_corpus, common, resume=True)
    change, = records(run, "rank_change")
    assert (change["from_ranks"], change["to_ranks"]) == (3, 2)
    end = records(run, "end")[-1]
    with open(run / "metrics.jsonl") as fh:
        everything = list(map(json.loads, fh))
    second_start = [i for i, r in enumerate(everything) if r["type"] == "start"][1]
    train = [r for r in everything[second_start:] if r["type"] == "train"]
    # the resumed run goes on from where the first stopped: it does not start over
    assert train and train[0]["frames"] > first_end["frames"] // 2, (train[0], first_end)
    assert end["frames"] < 3 * first_end["frames"] + 2 * 256 * 60, (end, first_end)
    net, _ = load_model(run / "final.h5")
    assert np.isfinite(net.params).all()


@pytest.mark.parametrize("change", [
    ["training.minibatch=512"],          # the saved positions lay past the new chunks' ends
    ["training.minibatch=128"],          # they were read as positions of smaller batches
    ["parallel.method=adpsgd", "parallel.asynchronous=true"],   # it started from step 0
    # the saved position named a chunk of the old seed's order: refused as out of range
    # for the rank's data, or read as a place in another chunk
    ["training.seed=3"],
], ids=["larger-minibatch", "smaller-minibatch", "to-async-adpsgd", "another-seed"])
def test_accepted_changes_that_split_the_data_otherwise_re_plan_it(small_corpus, tmp_path,
                                                                   change):
    """--resume --accept-changes with settings that step through the data otherwise:
    the data is re-planned and the same fraction of the schedule counts as done, as
    on another number of ranks."""
    from mpitrain.testing.mpirun import run_mpi
    from ..helpers import QUICKSTART, small_overrides
    run = tmp_path / "run"
    common = TINY + ["training.epochs=1", "training.checkpoint_interval=8",
                     "parallel.average_every=4"]
    _train(2, run, small_corpus, common + ["training.max_steps=24"])
    first = records(run, "start")[0]
    args = ["-m", "mpitrain", "train", QUICKSTART, "--run-dir", str(run), "--resume",
            "--accept-changes"]
    for item in small_overrides(small_corpus) + ["training.log_interval=10"] + common + change:
        args += ["--set", item]
    result = run_mpi(2, args, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-4000:]
    assert "changed: data re-planned over 2 ranks, step 24 of" in result.stdout, result.stdout
    change_record, = records(run, "rank_change")
    second = records(run, "start")[1]
    assert change_record["to_step"] == round(24 * second["planned_steps"]
                                             / first["planned_steps"])
    with open(run / "metrics.jsonl") as fh:
        everything = list(map(json.loads, fh))
    second_start = [i for i, r in enumerate(everything) if r["type"] == "start"][1]
    train = [r for r in everything[second_start:] if r["type"] == "train"]
    # it goes on from the fraction done, neither over again nor back
    assert train and train[0]["step"] > change_record["to_step"], (train[0], change_record)
    assert records(run, "end")[-1]["steps"] >= second["total_steps"] - 2
