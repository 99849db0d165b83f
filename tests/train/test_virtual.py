"""Training on virtual ranks (train/virtual.py) against real `mpiexec -n N` runs.

The same configuration and seed trained on N virtual ranks in this process
and on N MPI ranks (N = 2, 4) must give the same final model bit for bit, for
every synchronous method: the virtual communicator sums in MPICH's order
(comm/virtual.py).  The progress records agree too.  A 32-rank virtual run
of a tiny model finishes in seconds and learns; the clock carries the
simulated step and network times.
"""

import json
import os
import socket

import numpy as np
import pytest

from mpitrain.comm.netmodel import NetworkModel
from mpitrain.config import load_config
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model
from mpitrain.testing.mpirun import run_mpi
from mpitrain.train.virtual import ComputeModel, measure_step_seconds, train_virtual

from ..helpers import QUICKSTART, WORKERS, drain_queued_steps_at_the_read, small_overrides

METHODS = ["model_averaging", "allreduce", "bmuf", "kaldi"]
# a tiny model, several averages and a last short block (30 % 4), a checkpoint on the way
SETTINGS = ["model.hidden_dim=32", "model.hidden_layers=2", "training.max_steps=30",
            "parallel.average_every=4", "training.log_interval=10",
            "training.checkpoint_interval=12", "parallel.num_jobs_initial=1"]


def _output(result):
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def _settings(corpus, method=None):
    extra = [f"parallel.method={method}"] if method else []
    return small_overrides(corpus) + SETTINGS + extra


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_virtual_ranks_equal_mpiexec_bit_for_bit(nranks, small_corpus, tmp_path):
    real_dir, virtual_dir = tmp_path / "mpi", tmp_path / "virtual"
    result = run_mpi(nranks, [str(WORKERS / "train_methods_worker.py"), QUICKSTART,
                              str(real_dir), ",".join(METHODS)] + _settings(small_corpus),
                     timeout=300)
    assert result.returncode == 0, _output(result)
    for method in METHODS:
        cfg = load_config(QUICKSTART, _settings(small_corpus, method))
        train_virtual(cfg, size=nranks, run_dir=str(virtual_dir / method),
                      compute=ComputeModel(step_seconds=0.001))
        real, _ = load_model(real_dir / method / "final.h5")
        virtual, _ = load_model(virtual_dir / method / "final.h5")
        assert _records(real_dir / method, "start")[0]["ranks"] == nranks
        assert _records(virtual_dir / method, "start")[0]["ranks"] == nranks
        assert np.array_equal(real.params, virtual.params), method
        for kind, keys in (("train", ("step", "frames", "xent", "acc")),
                           ("eval", ("dev_xent", "dev_acc"))):
            real_rows = [[r[k] for k in keys] for r in _records(real_dir / method, kind)]
            virtual_rows = [[r[k] for k in keys] for r in _records(virtual_dir / method, kind)]
            assert real_rows == virtual_rows, (method, kind)
        checkpoints = sorted(p for p in os.listdir(virtual_dir / method) if p.startswith("ckpt"))
        assert checkpoints == sorted(p for p in os.listdir(real_dir / method)
                                     if p.startswith("ckpt")), method


def test_thirty_two_virtual_ranks_learn_in_ci_time(small_corpus, tmp_path):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=64", "model.hidden_layers=2", "training.minibatch=64",
        "training.epochs=3", "parallel.average_every=4", "training.log_interval=20",
        "training.checkpoint_interval=0", "optimizer.initial_learning_rate=0.01"])
    compute = ComputeModel(step_seconds=0.002)
    network = NetworkModel(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)
    result = train_virtual(cfg, size=32, run_dir=str(tmp_path / "v32"), network=network,
                           compute=compute)
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()
    assert result["dev_acc"] > majority + 0.10, result          # chance is 1/120
    # every step cost 2 ms of simulated compute, plus the averages' network time
    steps = result["steps"]
    assert result["seconds"] >= steps * 0.002
    train = _records(tmp_path / "v32", "train")
    assert all(0 < r["comm_fraction"] < 0.5 for r in train)


def test_measured_step_time_is_positive_and_small(small_corpus):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=32", "model.hidden_layers=2"])
    seconds = measure_step_seconds(cfg, feat_dim=40, num_classes=120, steps=5, warmup=2)
    assert 0 < seconds < 0.5


def test_train_virtual_on_the_command_line_reports_simulated_time(small_corpus, tmp_path):
    """`mpitrain train --virtual 4` with a slow rank: the run's seconds are the
    straggler's compute plus the averages' network time, by hand."""
    from mpitrain.cli import main
    from mpitrain.nn.network import build_network

    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--virtual", "4", "--run-dir", str(run),
            "--compute-ms", "10", "--slowdown", "3=2", "--bandwidth-gbit", "1",
            "--latency-us", "5"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=32", "model.hidden_layers=2", "training.max_steps=8",
            "parallel.average_every=4", "training.log_interval=100", "data.dev=",
            "training.checkpoint_interval=0"]:
        argv += ["--set", item]
    assert main(argv) == 0
    net = build_network(feat_dim=40, num_classes=120, left_context=5, right_context=5,
                        hidden_layers=2, hidden_dim=32)
    average = NetworkModel(latency_s=5e-6, bandwidth_bytes_per_s=1e9 / 8).allreduce_seconds(
        4 * net.num_params, 4)
    # two blocks of 4 steps; rank 3 takes 20 ms a step, the others wait for it
    expected = 2 * (4 * 0.020 + average)
    end = _records(run, "end")[0]
    # the rest: a few small collectives (log sums, checks, the last checkpoint's gather)
    assert expected <= end["seconds"] <= expected + 1e-3
    train = _records(run, "train")[-1]
    # per block ranks 0-2 wait 40 ms, rank 3 none, and all four spend one average
    share = (3 * 0.040 + 4 * average) / 4 / (0.080 + average)
    assert train["comm_fraction"] == pytest.approx(share, rel=0.02)
    virtual = _records(run, "virtual")[0]
    assert virtual["ranks"] == 4 and virtual["compute"]["slowdown"] == {"3": 2.0}
    assert virtual["simulated_seconds"] == end["seconds"]
    # written after `end`, on the run's clock (its own log's restarted at 0.0)
    assert virtual["time"] >= end["time"] > 0


@pytest.mark.parametrize("method", ["model_averaging", "kaldi", "bmuf"])
def test_a_slow_rank_paces_the_progress_records_of_methods_that_average_less_often(
        small_corpus, tmp_path, method):
    """Every rank takes the same steps, so 2 ranks with rank 1 3x slow train at rank
    1's pace.  Averaging every 4 steps with a progress line every 2, rank 0 (which
    writes the records) waits for rank 1 at the progress sum between averages: a
    window that ended before that sum read 2 steps of 2 ms, 3x the group's pace."""
    from mpitrain.cli import main
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--virtual", "2", "--run-dir", str(run),
            "--compute-ms", "2", "--slowdown", "1=3"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=16",
            f"parallel.method={method}", "parallel.average_every=4",
            "training.log_interval=2", "data.dev=", "training.checkpoint_interval=0"] + (
            ["parallel.num_jobs_initial=2", "parallel.num_jobs_final=2"]
            if method == "kaldi" else []):
        argv += ["--set", item]
    assert main(argv) == 0
    train = _records(run, "train")
    assert [r["step"] for r in train] == list(range(2, 17, 2))
    for record in train:
        # 2 steps of rank 1's 6 ms, 256 frames a step on each rank, and a little
        # network time: never more than the slow rank's pace
        assert record["frames_per_sec"] <= 2 * 2 * 256 / 0.012 * (1 + 1e-9), record
        assert record["frames_per_sec"] >= 2 * 2 * 256 / 0.0125, record
        # rank 0 computes 4 ms and rank 1 12 ms of the window; the rest is waiting
        window = 2 * 2 * 256 / record["frames_per_sec"]
        assert record["comm_fraction"] == pytest.approx(1 - 0.008 / window, rel=1e-6), record
        # rank 0 waited for rank 1, at the average or at this sum: a window between
        # averages, where no rank had communicated before the sum, named no rank
        assert record["slowest_rank"] == 1, record
        assert record["slowest_host"] == socket.gethostname(), record
    # the records' seconds are the group's: a window ends where the ranks summed it
    assert train[-1]["seconds"] == pytest.approx(_records(run, "end")[0]["seconds"], abs=1e-3)


def test_a_device_drained_at_the_progress_read_is_computing_in_the_records(small_corpus,
                                                                            tmp_path,
                                                                            monkeypatch):
    # on a GPU a window's steps are queued, and the read of its sums waits for them:
    # that wait is the steps' compute, not communication
    from mpitrain.train.trainer import Trainer
    # 2 steps of 2 ms still queued at the read
    drain_queued_steps_at_the_read(monkeypatch, Trainer, 0.004)
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=8",
        "parallel.average_every=100", "training.log_interval=2", "data.dev=",
        "training.checkpoint_interval=0"])
    run = tmp_path / "run"
    train_virtual(cfg, size=2, run_dir=str(run), compute=ComputeModel(step_seconds=0.002))
    for record in _records(run, "train"):
        # 2 steps of 2 ms and the 4 ms read; only the sums' latency is communication
        assert record["frames_per_sec"] == pytest.approx(2 * 2 * 256 / 0.008, rel=0.01), record
        assert record["comm_fraction"] < 0.01, record


def test_compute_model_jitter_is_seeded_and_keeps_the_mean():
    model = ComputeModel(step_seconds=0.01, slowdown={1: 3.0}, jitter=0.2, seed=5)
    first = [t for t, _ in zip(model.step_times(1), range(2000))]
    again = [t for t, _ in zip(model.step_times(1), range(2000))]
    other = [t for t, _ in zip(model.step_times(0), range(2000))]
    assert first == again and first != other
    assert np.mean(first) == pytest.approx(0.03, rel=0.03)
    assert np.mean(other) == pytest.approx(0.01, rel=0.03)
    assert next(ComputeModel(step_seconds=0.01).step_times(7)) == 0.01
    with pytest.raises(ValueError, match="slowdown"):
        ComputeModel(step_seconds=0.01, slowdown={2: 0.0})


def test_each_repeat_of_a_jittered_compute_model_draws_its_own_times():
    # a benchmark's repeats: the same seed and another repeat index give other times,
    # the same index the same ones; repeat 0 is the model's one stream
    model = ComputeModel(step_seconds=0.01, jitter=0.5, seed=5)
    draws = [[t for t, _ in zip(model.step_times(1, repeat=r), range(50))] for r in range(3)]
    assert draws[0] == [t for t, _ in zip(model.step_times(1), range(50))]
    assert draws[0] != draws[1] != draws[2] != draws[0]
    assert draws[2] == [t for t, _ in zip(model.step_times(1, repeat=2), range(50))]
    assert next(ComputeModel(step_seconds=0.01).step_times(1, repeat=3)) == 0.01


def test_step_time_options_out_of_range_are_refused_before_anything_runs(small_corpus,
                                                                           tmp_path, capsys):
    from mpitrain.cli import main
    base = ["train", QUICKSTART, "--virtual", "2", "--run-dir", str(tmp_path / "run")] + [
        arg for key in small_overrides(small_corpus) for arg in ("--set", key)]
    # --jitter 1e300 ended mid-run in an OverflowError traceback; --compute-ms -1 was
    # taken for 0 (measured) and --slowdown 1=inf for a factor
    for option, message in ((["--jitter", "1e300"], "--jitter: expected a number in [0, 10]"),
                            (["--compute-ms", "-1"], "--compute-ms: expected a step time"),
                            (["--slowdown", "1=inf"],
                             "--slowdown: expected a factor in (0, 1e+06] for rank 1, got 1=inf"),
                            # (1e308 ran, its simulated times 300 digits long)
                            (["--slowdown", "1=1e308"],
                             "--slowdown: expected a factor in (0, 1e+06] for rank 1, "
                             "got 1=1e+308"),
                            # (the last factor was taken without a word)
                            (["--slowdown", "0=2,0=3"],
                             "--slowdown: rank 0 is given twice, in '0=2,0=3'; give each rank "
                             "one factor")):
        for dry_run in ([], ["--dry-run"]):     # (a dry run said the plan held)
            assert main(base + option + dry_run) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and message in err, err
            assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="jitter"):
        ComputeModel(step_seconds=0.01, jitter=38.0)


def test_more_virtual_ranks_than_threads_can_hold_are_refused_at_once(small_corpus, tmp_path,
                                                                      capsys):
    from mpitrain.cli import main
    overrides = [arg for key in small_overrides(small_corpus) for arg in ("--set", key)]
    # (a thread per rank was started before any check: 99999999 ranks hung)
    assert main(["train", QUICKSTART, "--virtual", "99999999", "--dry-run", "--run-dir",
                 str(tmp_path / "run")] + overrides) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--virtual: expected a number of ranks in [1, 4096]" in err


def test_no_virtual_ranks_is_refused_not_trained_on_real_ranks(small_corpus, tmp_path, capsys):
    from mpitrain.cli import main
    overrides = [arg for key in small_overrides(small_corpus) for arg in ("--set", key)]
    # (--virtual 0 read as "not virtual" and trained on this one real rank)
    assert main(["train", QUICKSTART, "--virtual", "0", "--run-dir", str(tmp_path / "run")]
                + overrides) == 2
    err = capsys.readouterr().err
    assert err == ("mpitrain train: error: --virtual: expected a number of ranks in "
                   "[1, 4096] (each is a thread of this process with its own model), got 0\n")
    assert not (tmp_path / "run").exists()
    assert main(["bench", QUICKSTART, "--virtual", "1,99999999", "--out",
                 str(tmp_path / "bench")] + overrides) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--virtual: at most 4096 ranks" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "bench").exists()


def test_records_carry_the_simulated_training_seconds(small_corpus, tmp_path):
    """train and eval records hold `seconds`, the communicator's clock since training
    began: on virtual ranks the simulated one, which `plot --x seconds` draws."""
    from mpitrain.cli import main
    cfg = load_config(QUICKSTART, _settings(small_corpus) + ["training.eval_interval=2000"])
    run = tmp_path / "v2"
    train_virtual(cfg, size=2, run_dir=str(run), compute=ComputeModel(step_seconds=0.01))
    train, evals = _records(run, "train"), _records(run, "eval")
    assert evals and train
    # 30 steps of 10 ms, communication free: 10 ms per step on the clock
    for record in train:
        assert record["seconds"] == pytest.approx(0.01 * record["step"], rel=1e-6)
    assert [e["seconds"] for e in evals] == sorted(e["seconds"] for e in evals)
    assert evals[-1]["seconds"] == pytest.approx(0.3, rel=1e-6)
    assert main(["plot", str(run), "--x", "seconds", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_bmuf_evaluates_keeps_and_checkpoints_the_global_model(small_corpus, tmp_path):
    """The ranks train from the Nesterov look-ahead point; the job's model is w_g:
    checkpoints, held-out figures and best.h5 are of w_g."""
    import h5py
    from mpitrain.cli import main
    from mpitrain.train.evaluate import evaluate_chunks, load_eval_chunks
    from ..helpers import QUICKSTART, records, small_overrides
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--virtual", "2", "--compute-ms", "1", "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=32", "model.hidden_layers=2", "parallel.method=bmuf",
            "parallel.average_every=4", "training.max_steps=42",
            "training.checkpoint_interval=8", "training.keep_checkpoints=10",
            "training.eval_interval=4096"]:
        argv += ["--set", item]
    assert main(argv) == 0
    with h5py.File(run / "ckpt-00000016.h5", "r") as f:
        model, start = f["model/params"][...], f["strategy/start"][...]
        global_model = f["strategy/global_model"][...]
    assert np.array_equal(model, global_model)
    assert not np.array_equal(model, start)          # the look-ahead point differs
    # the held-out figure at step 16 is that of the checkpoint's model
    net, _ = load_model(run / "ckpt-00000016.h5")
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    total, _, frames = evaluate_chunks(net, load_eval_chunks(dev, net))
    at_16 = [r for r in records(run, "eval") if r["step"] == 16]
    assert at_16 and at_16[0]["dev_xent"] == pytest.approx(total / frames, rel=1e-6)


def test_a_run_that_had_ended_is_judged_by_the_fraction_of_its_plan(small_corpus, tmp_path,
                                                                    capsys):
    """On the same ranks a resume of an ended run trains nothing; on more ranks the
    same max_steps is a larger part of a shorter plan, so it goes on."""
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, records, small_overrides
    run = tmp_path / "run"

    def train(ranks, *flags):
        argv = ["train", QUICKSTART, "--virtual", str(ranks), "--compute-ms", "1",
                "--run-dir", str(run), *flags]
        for item in small_overrides(small_corpus) + ["model.hidden_dim=16",
                                                     "training.max_steps=20"]:
            argv += ["--set", item]
        return main(argv)

    assert train(2) == 0
    capsys.readouterr()
    assert train(2, "--resume") == 0
    assert "the run had ended at step 20" in capsys.readouterr().out
    assert len(records(run, "end")) == 1
    assert train(4, "--resume") == 0
    assert "the run had ended" not in capsys.readouterr().out
    change, = records(run, "rank_change")
    assert change["to_step"] < 20 and records(run, "end")[-1]["steps"] == 20
    # back on one rank the same max_steps lies before that end on the longer plan:
    # nothing to train, and the message says where the end lies on this plan
    capsys.readouterr()
    assert train(1, "--resume") == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "the run had ended at step 20 of" in line]
    assert said and "of this job's" in said[0] and "(it would end at step 20)" in said[0], out


def test_the_share_of_frames_left_out_of_each_epoch_is_said(tmp_path, capsys):
    from mpitrain.cli import main
    from mpitrain.data.synthetic import synthesize
    from ..helpers import QUICKSTART
    synthesize(str(tmp_path / "c"), hours=0.02, speakers=3, shards=1, dev_hours=0.005,
               dev_speakers=1)
    argv = ["train", QUICKSTART, "--virtual", "3", "--compute-ms", "1",
            "--run-dir", str(tmp_path / "run")]
    for item in [f"data.train={tmp_path / 'c' / 'train'}", f"data.dev={tmp_path / 'c' / 'dev'}",
                 "training.max_steps=2", "model.hidden_dim=16"]:
        argv += ["--set", item]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert len(said) == 1 and "of the training frames are left out of each epoch" in said[0]


def test_a_share_left_out_that_rounds_to_all_does_not_say_100_percent(tmp_path, capsys):
    # one rank holds a 60,000-frame utterance, the other 120 frames: 224 frames of
    # 60,120 are trained on, and the line said "100% ... are left out (224 of 60,120)"
    from mpitrain.cli import main
    from mpitrain.data.writer import CorpusWriter
    rng = np.random.default_rng(0)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=4, num_classes=3, num_shards=1) as writer:
        for i, frames in enumerate([60_000, 30, 30, 30, 30]):
            writer.add(f"u{i}", rng.standard_normal((frames, 4)).astype(np.float32),
                       rng.integers(0, 3, frames))
    argv = ["train", QUICKSTART, "--virtual", "2", "--compute-ms", "1",
            "--run-dir", str(tmp_path / "run")]
    for item in [f"data.train={tmp_path / 'c'}", "data.dev=", "training.minibatch=16",
                 "training.max_steps=2", "model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert len(said) == 1 and said[0].startswith(
        "data: 99% of the training frames are left out of each epoch (only 224 of 60,120 "
        "are trained on)"), said


@pytest.mark.parametrize("method,ranks", [
    (["parallel.method=adpsgd", "parallel.asynchronous=true"], 2),
    (["parallel.method=param_server"], 3)])
def test_frames_left_out_by_ranks_that_take_their_own_steps_are_said(tmp_path, capsys, method,
                                                                     ranks):
    # each rank's whole minibatches per chunk: utterances of 549 and 339 frames in
    # minibatches of 256 train on 768 of 888 frames (the note was the lock-step
    # methods' alone)
    from mpitrain.cli import main
    from mpitrain.data.synthetic import synthesize
    from ..helpers import QUICKSTART
    synthesize(str(tmp_path / "c"), hours=0.002, speakers=1, shards=1, dev_hours=0.00001,
               dev_speakers=1)
    capsys.readouterr()
    argv = ["train", QUICKSTART, "--virtual", str(ranks), "--dry-run",
            "--run-dir", str(tmp_path / "run")]
    for item in [f"data.train={tmp_path / 'c' / 'train'}", "data.dev=",
                 "training.minibatch=256", "model.hidden_dim=16", *method]:
        argv += ["--set", item]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert len(said) == 1 and said[0].startswith(
        "data: 13% of the training frames are left out of each epoch (only 768 of 888 "
        "are trained on): each rank trains whole minibatches of its share"), said


_SIGNALLED_AT_A_BATCH = """
import os, signal, sys
from mpitrain.data.batcher import MinibatchStream
from mpitrain.cli import main
taken, after = [0], int(sys.argv[1])
next_batch = MinibatchStream.next_batch
def signalled(self):
    taken[0] += 1                   # (every virtual rank's minibatches, counted together)
    if taken[0] == after:
        os.kill(os.getpid(), signal.SIGTERM)
    return next_batch(self)
MinibatchStream.next_batch = signalled
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("method", [["parallel.method=model_averaging",
                                      "parallel.average_every=8"],
                                     ["parallel.method=param_server"]],
                         ids=["model_averaging", "param_server"])
def test_a_stop_signal_stops_a_virtual_run_with_a_checkpoint_to_resume(small_corpus, tmp_path,
                                                                       method):
    # virtual ranks took no stop signal: SIGTERM ended the process at once, the
    # steps since the last periodic checkpoint lost (and, kept for the run, the
    # signal went unseen: the main thread's wait never ran its handler)
    import subprocess
    import sys
    from mpitrain.cli import main
    from mpitrain.train.stop import EXIT_STOPPED
    from ..helpers import REPO, records
    common = ["--virtual", "2", "--compute-ms", "1"]
    for item in small_overrides(small_corpus) + method + [
            "model.hidden_dim=32", "model.hidden_layers=2", "training.max_steps=400",
            "training.log_interval=4", "training.checkpoint_interval=1000"]:
        common += ["--set", item]
    straight, split = tmp_path / "straight", tmp_path / "split"
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_AT_A_BATCH, "20", "train",
                           QUICKSTART, "--run-dir", str(split), *common],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == EXIT_STOPPED, (done.returncode, done.stdout, done.stderr)
    [stop] = records(split, "stop")
    assert stop["signal"] == "SIGTERM" and 0 < stop["step"] < 400, stop
    assert f"stopped at step {stop['step']} of " in done.stdout, done.stdout
    assert (split / f"ckpt-{stop['step']:08d}.h5").exists()
    assert not (split / "final.h5").exists()
    assert main(["train", QUICKSTART, "--run-dir", str(split), "--resume", *common]) == 0
    assert records(split, "start")[1]["step"] == stop["step"]
    assert main(["train", QUICKSTART, "--run-dir", str(straight), *common]) == 0
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params), np.abs(a.params - b.params).max()


def test_a_re_planned_resume_past_max_steps_keeps_its_place_in_the_schedule(small_corpus,
                                                                            tmp_path, capsys):
    """Step 24 at minibatch 256 is step 48 at 128; with max_steps 30 the resume set the
    step to 30, and the checkpoint said 30: a later resume redid steps 30-48 at the
    higher rates of that part of the schedule."""
    from ..helpers import records
    run = tmp_path / "run"

    def train(*settings, resume=False):
        return _train_re_planned(run, small_corpus, ["parallel.average_every=4"],
                                 settings, resume)

    assert train("training.max_steps=24") == 0
    assert train("training.max_steps=30", "training.minibatch=128", resume=True) == 0
    change, = records(run, "rank_change")
    assert change["to_step"] == 48, change
    assert records(run, "checkpoint")[-1]["step"] == 48
    capsys.readouterr()
    assert train("training.max_steps=60", "training.minibatch=128", resume=True) == 0
    assert records(run, "start")[-1]["step"] == 48
    assert records(run, "end")[-1]["steps"] == 60


def test_more_epochs_on_another_number_of_ranks_train_on_from_the_data_done(small_corpus,
                                                                             tmp_path):
    """An ended run given more epochs (--accept-changes) on another number of ranks:
    the same fraction of the new, longer plan counted as done, so the run resumed at
    its end and trained nothing; the passes over the data already done are kept."""
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, records, small_overrides
    run = tmp_path / "run"

    def train(ranks, epochs, *flags):
        argv = ["train", QUICKSTART, "--virtual", str(ranks), "--compute-ms", "1",
                "--run-dir", str(run), *flags]
        for item in small_overrides(small_corpus) + ["model.hidden_dim=16",
                                                     "training.checkpoint_interval=0",
                                                     f"training.epochs={epochs}"]:
            argv += ["--set", item]
        return main(argv)

    assert train(2, 1) == 0
    first = records(run, "start")[0]
    assert train(1, 2, "--resume", "--accept-changes") == 0
    second = records(run, "start")[1]
    change, = records(run, "rank_change")
    # one epoch of two was trained: half of the new plan, in the new plan's steps
    assert change["from_step"] == first["planned_steps"]
    assert change["to_step"] == round(second["planned_steps"] / 2), (change, second)
    assert records(run, "end")[-1]["steps"] == second["total_steps"]
    assert records(run, "train")[-1]["step"] > change["to_step"]


def test_ctrl_c_interrupts_every_virtual_rank_and_rank_0_records_it(small_corpus, tmp_path,
                                                                    monkeypatch):
    # Ctrl-C reaches the main thread alone: it returned while the ranks' threads
    # stood where they were, the interpreter's end could hang on them (one run in
    # three, in an HDF5 call), and the run's records did not say it was interrupted
    import signal
    import threading
    from mpitrain.train.status import run_status
    from mpitrain.comm.virtual import VirtualCluster
    from mpitrain.train.step import TrainingStep
    real = TrainingStep.run

    def run(self, step, lr, next_batch):
        if step == 10 and self.strategy.comm.rank == 0:
            os.kill(os.getpid(), signal.SIGINT)        # Ctrl-C
        return real(self, step, lr, next_batch)

    monkeypatch.setattr(TrainingStep, "run", run)
    clusters = []
    real_init = VirtualCluster.__init__

    def kept(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        clusters.append(self)

    monkeypatch.setattr(VirtualCluster, "__init__", kept)
    cfg = load_config(QUICKSTART, _settings(small_corpus))
    run_dir = tmp_path / "v2"
    try:
        with pytest.raises(KeyboardInterrupt):
            train_virtual(cfg, size=2, run_dir=str(run_dir),
                          compute=ComputeModel(step_seconds=0.01))
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("virtual-rank-") and t.is_alive()]
    finally:
        for cluster in clusters:        # (ranks left waiting would hang this process's end)
            cluster._fail(None, RuntimeError("ended by the test"))
    errors = _records(run_dir, "error")
    assert errors and errors[-1]["error"] == "KeyboardInterrupt", \
        (run_dir / "metrics.jsonl").read_text()[-1500:]
    assert run_status(run_dir)[0].startswith(f"{run_dir}: interrupted (SIGINT, Ctrl-C) at step")


def test_allreduce_buckets_under_a_byte_reduce_each_layer_as_it_finishes(small_corpus,
                                                                          tmp_path):
    # any parallel.bucket_mb > 0 is valid: 1e-9 MiB (a thousandth of a byte) was
    # rounded down to 0 bytes and refused as "bucket_bytes must be >= 1, got 0"
    finals = []
    for bucket_mb in ("1e-9", "25"):
        cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=2", "training.max_steps=6",
            "training.checkpoint_interval=0", "data.dev=", "parallel.method=allreduce",
            "parallel.overlap=true", f"parallel.bucket_mb={bucket_mb}"])
        run = tmp_path / bucket_mb
        train_virtual(cfg, size=2, run_dir=str(run), compute=ComputeModel(step_seconds=0.001))
        finals.append(load_model(run / "final.h5")[0].params)
    # the buckets change how the gradient travels, not its average
    assert np.array_equal(finals[0], finals[1])


def test_the_step_time_is_measured_after_the_checks(small_corpus, tmp_path, monkeypatch,
                                                      capsys):
    # a setting the virtual ranks refuse, or a bench --out that holds a benchmark, was
    # said only after the step time was measured: minutes for a large model
    import mpitrain.train.virtual as virtual
    from mpitrain.cli import main
    measured = []

    def measure(cfg, **kwargs):
        measured.append(cfg.model.hidden_dim)
        return 0.004
    monkeypatch.setattr(virtual, "measure_step_seconds", measure)
    data = []
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        data += ["--set", item]
    run = tmp_path / "run"
    assert main(["train", QUICKSTART, "--virtual", "2", "--run-dir", str(run), *data,
                 "--set", "parallel.straggler.ranks=[2]"]) == 2
    assert "parallel.straggler.ranks: rank 2" in capsys.readouterr().err
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text("{}")
    assert main(["bench", QUICKSTART, "--virtual", "1,2", "--out", str(out), *data,
                 "--phases", "throughput"]) == 2
    assert "holds an earlier benchmark" in capsys.readouterr().err
    assert measured == []
    # a run measures once, and its record carries the step time measured
    assert main(["train", QUICKSTART, "--virtual", "2", "--run-dir", str(run), *data,
                 "--set", "training.max_steps=4", "--set", "data.dev="]) == 0
    assert measured == [16]
    record = _records(run, "virtual")[0]
    assert record["compute"]["step_seconds"] == 0.004
    assert record["simulated_seconds"] >= 4 * 0.004


def test_a_slow_rank_of_the_config_is_refused_on_virtual_ranks(small_corpus, tmp_path,
                                                             capsys, monkeypatch):
    """parallel.straggler's sleep passed on the wall clock, not the simulated one:
    the run trained and reported exactly as without a slow rank (a bench showed
    2 ranks at twice the throughput of one), only slower to finish.  It is refused
    before anything is measured or written, naming --slowdown with its ranks."""
    import mpitrain.train.virtual as virtual
    from mpitrain.cli import main
    measured = []
    monkeypatch.setattr(virtual, "measure_step_seconds",
                        lambda cfg, **kwargs: measured.append(1) or 0.004)
    data = []
    for item in small_overrides(small_corpus) + ["parallel.straggler.ranks=[0, 1]",
                                                 "parallel.straggler.slowdown=3"]:
        data += ["--set", item]
    run, out = tmp_path / "run", tmp_path / "bench"
    for argv in (["train", QUICKSTART, "--virtual", "2", "--run-dir", str(run)],
                 ["train", QUICKSTART, "--virtual", "2", "--run-dir", str(run), "--dry-run"],
                 ["bench", QUICKSTART, "--virtual", "1,2", "--out", str(out)]):
        assert main(argv + data) == 2
        err = capsys.readouterr().err
        assert f"{QUICKSTART}: parallel.straggler.ranks: virtual ranks keep a simulated " \
               "clock" in err and "--slowdown 0=3,1=3 " in err, err
        assert err.count("\n") == 1
    assert measured == [] and not run.exists() and not out.exists()


def test_an_asynchronous_ring_re_planned_past_max_steps_keeps_its_place(small_corpus, tmp_path,
                                                                        capsys):
    """As in the lock-step methods: each rank's own steps were capped at max_steps 30,
    so the checkpoint said step 31 where the re-plan had put the run at 48, and a
    later resume redid steps 31-48 at the higher rates of that part of the schedule."""
    from ..helpers import records
    run = tmp_path / "run"

    def train(*settings, resume=False):
        return _train_re_planned(run, small_corpus, ["parallel.method=adpsgd",
                                                     "parallel.asynchronous=true"],
                                 settings, resume)

    assert train("training.max_steps=24") == 0
    assert train("training.max_steps=30", "training.minibatch=128", resume=True) == 0
    change, = records(run, "rank_change")
    assert change["to_step"] == 48, change
    # (each rank takes a step before the end is called: the budget's overshoot)
    assert 48 <= records(run, "checkpoint")[-1]["step"] <= 50
    capsys.readouterr()
    assert train("training.max_steps=60", "training.minibatch=128", resume=True) == 0
    assert records(run, "start")[-1]["step"] >= 48
    capsys.readouterr()


def test_a_parameter_server_re_planned_on_resume_counts_its_clients_steps_in_the_new_plan(
        small_corpus, tmp_path):
    """Its clients went on from their saved counts in the old minibatch's steps: 24
    steps at 256 frames were taken for 24 at 128, so the run trained 24 steps again
    and went past training.max_steps (84 steps of 60)."""
    from ..helpers import records
    run = tmp_path / "run"

    def train(*settings, resume=False):
        return _train_re_planned(run, small_corpus, ["parallel.method=param_server"],
                                 settings, resume)

    assert train("training.max_steps=24") == 0
    assert train("training.max_steps=60", "training.minibatch=128", resume=True) == 0
    assert records(run, "rank_change")[-1]["to_step"] == 48
    end = records(run, "end")[-1]
    assert end["steps"] == 60, end


def _train_re_planned(run, corpus, method, settings, resume):
    """A small run on 2 virtual ranks of the ``method`` settings and ``settings``;
    ``resume``: with --accept-changes (the re-planning resumes above)."""
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, small_overrides
    argv = ["train", QUICKSTART, "--virtual", "2", "--compute-ms", "1",
            "--run-dir", str(run)] + (["--resume", "--accept-changes"] if resume else [])
    for item in small_overrides(corpus) + ["model.hidden_dim=16",
                                           "training.checkpoint_interval=8", *method,
                                           *settings]:
        argv += ["--set", item]
    return main(argv)


def test_shards_smaller_than_a_few_minibatches_are_advised_fewer_not_more(tmp_path, capsys):
    # a chunk never crosses shards: 12 shards of about 270 frames with minibatches of
    # 128 leave each shard's remainder out, and the note advised "more shards"
    from mpitrain.cli import main
    from mpitrain.data.synthetic import synthesize
    from ..helpers import QUICKSTART
    synthesize(str(tmp_path / "c"), hours=0.009, speakers=12, shards=12, dev_hours=0.002,
               dev_speakers=1)
    argv = ["train", QUICKSTART, "--virtual", "2", "--compute-ms", "1",
            "--run-dir", str(tmp_path / "run")]
    for item in [f"data.train={tmp_path / 'c' / 'train'}", "data.dev=",
                 "training.minibatch=128", "training.max_steps=2", "model.hidden_dim=16"]:
        argv += ["--set", item]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert len(said) == 1 and "fewer, larger shards (prepare --shards: 12 of " in said[0], said
    assert "more shards" not in said[0]


def test_a_parameter_server_run_that_had_ended_is_left_by_every_rank(tmp_path, capsys):
    # clients of 34 and 35 steps an epoch, capped at 34: the first client's plan was
    # all trained, the server's sum not, and that client alone went on training on
    # resume while the others had left (a hang under MPI)
    from mpitrain.cli import main
    from mpitrain.data.synthetic import synthesize
    from ..helpers import QUICKSTART, records
    synthesize(str(tmp_path / "c"), hours=0.05, speakers=6, shards=3, seed=7,
               dev_hours=0.01, dev_speakers=2)
    run = tmp_path / "run"

    def train(*flags):
        argv = ["train", QUICKSTART, "--virtual", "3", "--compute-ms", "1",
                "--run-dir", str(run), *flags]
        for item in [f"data.train={tmp_path / 'c' / 'train'}", f"data.dev={tmp_path / 'c' / 'dev'}",
                     "model.hidden_dim=16", "model.hidden_layers=1", "training.minibatch=256",
                     "data.chunk_frames=20000", "parallel.method=param_server",
                     "training.epochs=1", "training.max_steps=34"]:
            argv += ["--set", item]
        return main(argv)

    assert train("--dry-run") == 0
    assert "(34-35 steps/epoch of 256 frames each)" in capsys.readouterr().out
    assert train() == 0
    capsys.readouterr()
    assert train("--resume") == 0, capsys.readouterr().err
    assert "the run had ended at step 68" in capsys.readouterr().out
    assert len(records(run, "end")) == 1
