"""The training loop (train/trainer.py), end to end through `mpitrain train`.

On one rank, in this process: the quickstart configuration learns far above
the majority baseline and `--resume` continues bit-exactly (marked slow), and
on the stand-in device the trainer reads device values only at log lines.

On several ranks under real `mpiexec -n 2` and `-n 4` launches (marked mpi):
uneven shards finish, a rank whose shard is unreadable ends the job at once,
the quickstart learns as well as on one rank, every method runs to the end,
and `--resume` continues bit-exactly.

The machine running the tests may have two cores: models are tiny except in
the accuracy tests, and the corpus (``small_corpus``, tests/conftest.py) is
about 0.15 h of synthetic speech.
"""

import glob
import math
import os
import shutil
import time

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.cli import main
from mpitrain.comm.single import SingleCommunicator
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model
from mpitrain.testing import standin_cupy
from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi
from mpitrain.train.step import TrainingStep

from ..helpers import (QUICKSTART, WORKERS, mpi_output, records, train_in_process,
                       train_on_ranks, train_straight_and_resumed)

# a tiny model for the runs that only have to finish (or fail) correctly
TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]


# ------------------------------------------------------------------ one rank

@pytest.fixture(scope="module")
def small_corpus_for_reads(tmp_path_factory):
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("reads_corpus")
    synthesize(str(out), hours=0.02, speakers=4, shards=1, seed=3, dev_hours=0.005,
               dev_speakers=1)
    return str(out / "train"), str(out / "dev")


def test_a_finished_run_leaves_no_fisher_planning_threads(tmp_path, small_corpus):
    """NG-SGD's plan threads end with the run (each trainer left its pool's
    threads waiting: a benchmark's sweep of runs in one process piled them up)."""
    import threading
    before = set(threading.enumerate())
    train_in_process(tmp_path / "run", small_corpus, TINY + [
        "optimizer.name=ngsgd", "optimizer.ngsgd.plan_threads=2",
        "training.max_steps=6", "training.checkpoint_interval=0"])
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left


@pytest.mark.parametrize("regularized", [False, True], ids=["plain", "dropout-l2"])
def test_trainer_reads_once_per_log_line(tmp_path, small_corpus_for_reads, regularized):
    """The whole trainer on the stand-in device: reads happen only at log lines,
    evaluations and checkpoints, never inside a step (dropout masks and the L2
    term included)."""
    from mpitrain.config import load_config
    from mpitrain.train import trainer as trainer_module

    train, dev = small_corpus_for_reads
    extra = ["model.dropout_schedule=0,0.3@0.5,0.1", "optimizer.l2_regularize=1e-4",
             "optimizer.l2_regularize_output=1e-3"] if regularized else []
    cfg = load_config(None, [f"data.train={train}", f"data.dev={dev}", "device=gpu",
                             "data.chunk_frames=5000", "training.minibatch=64",
                             "training.epochs=1", "training.log_interval=10",
                             "training.checkpoint_interval=0", "model.hidden_layers=2",
                             "model.hidden_dim=32", "optimizer.name=ngsgd"] + extra)
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


@pytest.mark.slow
def test_quickstart_learns_far_above_majority_baseline(small_corpus, tmp_path):
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.epochs=4"])
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()          # about 0.03 on this corpus
    final = records(run, "eval")[-1]
    # 120 classes: chance is 0.008, the majority class about 0.03
    assert majority < 0.06
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40
    evals = records(run, "eval")
    assert evals[-1]["dev_xent"] < evals[0]["dev_xent"]
    # the final model, read back, scores the same held-out accuracy
    assert main(["eval", str(run / "final.h5"), os.path.join(small_corpus, "dev")]) == 0
    assert os.path.exists(run / "config.yaml")


def test_bf16_products_are_emulated_on_the_cpu_and_learn(small_corpus, tmp_path, capsys):
    """``precision: bf16`` on the CPU rounds every product's operands: the run says so,
    learns, and ends with other weights than the same run in fp32."""
    common = ["model.hidden_dim=64", "model.hidden_layers=2", "training.max_steps=60",
              "training.epochs=1"]
    train_in_process(tmp_path / "fp32", small_corpus, common)
    capsys.readouterr()
    try:
        train_in_process(tmp_path / "bf16", small_corpus, common + ["precision=bf16"])
    finally:
        backend.set_precision(np, "fp32")
    out = capsys.readouterr()
    assert "device cpu (bf16 products emulated)" in out.out + out.err
    assert records(tmp_path / "bf16", "start")[0]["precision"] == "bf16"
    fp32, _ = load_model(tmp_path / "fp32" / "final.h5")
    bf16, _ = load_model(tmp_path / "bf16" / "final.h5")
    assert not np.array_equal(fp32.params, bf16.params)
    final = records(tmp_path / "bf16", "eval")[-1]
    assert final["dev_acc"] > 0.05, final        # it trained (chance is 1/120)
    # as well as fp32, within what 60 steps on different trajectories can differ
    assert abs(final["dev_acc"] - records(tmp_path / "fp32", "eval")[-1]["dev_acc"]) < 0.05
    assert backend.precision() == "fp32"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,steps", [
    (["optimizer.momentum=0.5"], 60),          # momentum: optimizer state must be restored
    (["optimizer.name=ngsgd"], 40),            # NG-SGD: preconditioner state too
    # a Fisher update started at step 18 and still pending at the split (step 20)
    (["optimizer.name=ngsgd", "optimizer.ngsgd.delayed_updates=true"], 40),
], ids=["sgd-momentum", "ngsgd", "ngsgd-delayed"])
def test_resume_is_bit_exact(small_corpus, tmp_path, optimizer, steps):
    common = ["training.checkpoint_interval=10", "model.hidden_dim=64", "model.hidden_layers=2",
              "training.epochs=1"] + optimizer
    half = steps // 2
    straight, split = train_straight_and_resumed(tmp_path, small_corpus, common, steps=steps)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params)
    # and the second run really continued from the midpoint rather than starting over
    assert [r["step"] for r in records(split, "start")] == [0, half]


# ------------------------------------------------------- several ranks: corpora

def write_uneven_copy(src_dir, out_dir, fractions):
    """Re-shard a corpus so shard i holds about ``fractions[i]`` of the frames.

    The utterances, class counts and CMVN statistics are those of the source;
    only the cut into shards changes.
    """
    from mpitrain.data.corpus import ShardInfo, load_manifest, shard_name, write_manifest
    from mpitrain.data.shards import ShardBuilder, ShardReader
    src = load_manifest(src_dir)
    os.makedirs(out_dir)
    bounds = np.cumsum(fractions) * src.num_frames
    builders = [ShardBuilder(os.path.join(out_dir, shard_name(i)), feat_dim=src.feat_dim)
                for i in range(len(fractions))]
    written, current = 0, 0
    for i in range(len(src.shards)):
        with ShardReader(src.shard_path(i)) as shard:
            feats, labels, offsets = shard.read(0, shard.num_utterances)
            for u, utt_id in enumerate(shard.utt_ids):
                while current < len(builders) - 1 and written >= bounds[current]:
                    current += 1
                lo, hi = offsets[u], offsets[u + 1]
                builders[current].add(utt_id, feats[lo:hi], labels[lo:hi])
                written += hi - lo
    for builder in builders:
        builder.close()
    src.shards = [ShardInfo(os.path.basename(b.path), b.num_frames, b.num_utterances)
                  for b in builders]
    src.directory = os.path.abspath(out_dir)
    write_manifest(src)
    return src


@pytest.fixture(scope="module")
def uneven_corpus(small_corpus, tmp_path_factory):
    """The same speech with shards of 80%, 12%, 5% and 3% of the frames."""
    out = tmp_path_factory.mktemp("uneven")
    write_uneven_copy(os.path.join(small_corpus, "train"), str(out / "train"),
                      [0.80, 0.12, 0.05, 0.03])
    shutil.copytree(os.path.join(small_corpus, "dev"), out / "dev")
    return str(out)


def local_steps(manifest, plan, minibatch, chunk_frames):
    """Complete minibatches per epoch on each rank of a sharding plan."""
    from mpitrain.data.batcher import plan_chunks
    return [sum(c.frames // minibatch for c in plan_chunks(manifest, slices, chunk_frames))
            for slices in plan]


# ------------------------------------------------- several ranks: uneven shards

@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_uneven_shards_finish_without_hanging(uneven_corpus, tmp_path, nranks):
    from mpitrain.data.corpus import load_manifest
    from mpitrain.data.sharding import plan_shards
    from mpitrain.train.setup import balanced_plan
    manifest = load_manifest(os.path.join(uneven_corpus, "train"))
    whole = local_steps(manifest, plan_shards(manifest.shards, nranks, split=False), 256, 20000)
    assert max(whole) >= 3 * min(whole) > 0, whole       # whole shards: really uneven
    per_rank = local_steps(manifest, balanced_plan(manifest, nranks), 256, 20000)
    epochs = 2
    run = tmp_path / "run"
    try:
        result = train_on_ranks(nranks, run, uneven_corpus, TINY + [
            "training.epochs=2", "parallel.average_every=4", "training.log_interval=4",
            "training.eval_interval=1024", "training.checkpoint_interval=4"], timeout=150)
    except MpiTimeoutError as exc:
        pytest.fail(f"training on uneven shards hung: {exc}")
    assert result.returncode == 0, mpi_output(result)
    end = records(run, "end")[-1]
    # every rank takes as many steps as the rank with the least data ...
    assert end["steps"] == epochs * min(per_rank), (end, per_rank)
    assert end["frames"] == end["steps"] * 256 * nranks
    # ... and cutting shards into utterance ranges keeps that from wasting most of the data
    assert end["frames"] >= 0.85 * epochs * manifest.num_frames, (end, manifest.num_frames)
    assert len(records(run, "eval")) >= 2
    assert (run / "final.h5").exists()


# ------------------------------------------------- several ranks: failing ranks

def _rank_one_shards(train_dir, nranks=2):
    """Shard files only rank 1 opens (the corpus must split into whole shards)."""
    from mpitrain.data.corpus import load_manifest
    from mpitrain.train.setup import balanced_plan
    manifest = load_manifest(train_dir)
    plan = balanced_plan(manifest, nranks)
    whole = all(s.start_utt == 0 and s.end_utt == manifest.shards[s.shard_index].utterances
                for slices in plan for s in slices)
    assert whole, f"the test corpus no longer splits into whole shards per rank: {plan}"
    return [manifest.shard_path(s.shard_index) for s in plan[1]]


def _assert_quick_failure(result, elapsed, timeout, *texts):
    """``texts`` must all be in the job's output; a tuple among them: any one of its."""
    assert result.returncode != 0, mpi_output(result)
    text = result.stdout + result.stderr
    for expected in texts:
        alternatives = expected if isinstance(expected, tuple) else (expected,)
        assert any(a in text for a in alternatives), mpi_output(result)
    assert elapsed < timeout / 3, f"the failing job took {elapsed:.1f} s to end"


@pytest.mark.mpi
def test_unreadable_shard_on_one_rank_ends_the_job(small_corpus, tmp_path):
    # rank 1 finds the damage when it checks its part before step 1; all ranks
    # learn of it in the same collective and end together, rank 0 saying why
    data = tmp_path / "data"
    shutil.copytree(small_corpus, data)
    bad = _rank_one_shards(str(data / "train"))[0]
    os.truncate(bad, os.path.getsize(bad) // 2)
    timeout, start = 90, time.monotonic()
    try:
        result = train_on_ranks(2, tmp_path / "run", str(data), TINY, timeout=timeout)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung instead of aborting: {exc}")
    _assert_quick_failure(result, time.monotonic() - start, timeout,
                          "mpitrain train: error:", os.path.basename(bad), "cannot open as HDF5")
    assert result.stderr.count("\n") == 1, mpi_output(result)       # one line, from rank 0
    assert not (tmp_path / "run").exists()                       # nothing was written



@pytest.mark.mpi
def test_a_damaged_shard_ends_a_parameter_server_job_too(small_corpus, tmp_path):
    """3 clients over 4 shards: planning reads the shards to split them by utterance.
    The server, which trains on no share, did not plan, so it waited in the
    collective the failing clients never reached: the job hung without a word."""
    data = tmp_path / "data"
    shutil.copytree(small_corpus, data)
    bad = sorted(glob.glob(str(data / "train" / "shard-*.h5")))[2]
    os.truncate(bad, os.path.getsize(bad) // 2)
    timeout, start = 90, time.monotonic()
    try:
        result = train_on_ranks(4, tmp_path / "run", str(data),
                                TINY + ["parallel.method=param_server"], timeout=timeout)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung instead of ending: {exc}")
    _assert_quick_failure(result, time.monotonic() - start, timeout,
                          "mpitrain train: error:", os.path.basename(bad), "cannot open as HDF5")
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["train", "dev"])
def test_a_corpus_no_rank_finds_is_one_line_from_rank_0(small_corpus, tmp_path, which):
    # every rank reads the same corpus.yaml: a wrong data.train or data.dev is one
    # line, from rank 0, and no abort (it was one line and an MPI abort per rank)
    missing = str(tmp_path / "nowhere")
    result = train_on_ranks(2, tmp_path / "run", small_corpus,
                            TINY + [f"data.{which}={missing}"], timeout=90)
    assert result.returncode == 2, mpi_output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, mpi_output(result)
    assert lines[0].startswith("mpitrain train: error: ") and "nowhere" in lines[0] \
        and "corpus.yaml: not found" in lines[0], mpi_output(result)
    assert not (tmp_path / "run").exists()


def _train_from_two_directories(first, others, run_dir, timeout=90, *, corpus="data",
                                settings=(), flags=()):
    # data.train and data.dev relative: each rank finds them from its own directory
    args = [str(WORKERS / "working_directory_worker.py"), str(first), str(others), "--",
            "train", QUICKSTART, "--run-dir", str(run_dir), *flags]
    for setting in TINY + [f"data.train={corpus}/train", f"data.dev={corpus}/dev",
                           "data.chunk_frames=20000", *settings]:
        args += ["--set", setting]
    return run_mpi(2, args, timeout=timeout)


@pytest.mark.mpi
def test_ranks_that_read_different_corpora_stop_before_training(small_corpus, tmp_path):
    # rank 1 starts in another directory, where the relative data.train names
    # another corpus: each rank trained on its own data, and nothing was said
    first, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(small_corpus, first / "data")
    assert main(["synth", str(other / "data"), "--hours", "0.05", "--dev-hours", "0.02",
                 "--shards", "2", "--seed", "2"]) == 0
    result = _train_from_two_directories(first, other, tmp_path / "run")
    assert result.returncode == 2, mpi_output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, mpi_output(result)                     # from rank 0, no abort
    assert lines[0].startswith(f"mpitrain train: error: {QUICKSTART}: data.train: "
                               "data/train: rank 1 reads another corpus than rank 0 ("), \
        mpi_output(result)
    assert f"rank 1 runs in {other}, rank 0 in {first}" in lines[0], mpi_output(result)
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_a_relative_corpus_one_rank_cannot_find_names_the_working_directories(
        small_corpus, tmp_path):
    first, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(small_corpus, first / "data")
    other.mkdir()
    result = _train_from_two_directories(first, other, tmp_path / "run")
    assert result.returncode != 0, mpi_output(result)
    assert "mpitrain train: rank 1: error: data/train/corpus.yaml: not found" in \
        result.stderr, mpi_output(result)
    assert f"(a relative path: rank 1 runs in {other}, rank 0 in {first}; give absolute " \
        "paths or start every rank in one directory)" in result.stderr, mpi_output(result)
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_a_relative_run_directory_is_rank_0s_on_every_rank(small_corpus, tmp_path):
    # rank 1 starts in another directory: it looked for the checkpoints under its own
    # directory (`rank 1: error: run/ckpt-...: checkpoint not found` on --resume)
    first, other = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    other.mkdir()
    settings = ["training.checkpoint_interval=8", "training.max_steps=8"]
    result = _train_from_two_directories(first, other, "run", corpus=small_corpus,
                                         settings=settings)
    assert result.returncode == 0, mpi_output(result)
    result = _train_from_two_directories(first, other, "run", corpus=small_corpus,
                                         settings=settings[:1] + ["training.max_steps=16"],
                                         flags=["--resume"])
    assert result.returncode == 0, mpi_output(result)
    assert "resumed from run/ckpt-00000008.h5 at step 8" in result.stdout, mpi_output(result)
    assert records(first / "run", "end")[-1]["steps"] == 16
    assert not (other / "run").exists()


@pytest.mark.mpi
def test_too_few_ranks_for_the_parameter_servers_is_one_line_from_rank_0(small_corpus,
                                                                         tmp_path):
    # every rank knows the rank count: one line from rank 0 and no abort
    result = train_on_ranks(2, tmp_path / "run", small_corpus,
                            TINY + ["parallel.method=param_server", "parallel.servers=2"],
                            timeout=90)
    assert result.returncode == 2, mpi_output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpitrain train: error: {QUICKSTART}: "
                                                   "parallel.method: param_server with 2 "
                                                   "server rank(s) needs at least 3 ranks"), \
        mpi_output(result)
    assert not (tmp_path / "run").exists()

#: What a rank says of a shard truncated under it, by when its prefetch thread (which
#: runs beside the step that truncates) read: opened after the truncation, no HDF5 file
#: there; opened before, the frames cut off, or the file changed since it began.
TRUNCATED_SHARD = ("cannot open as HDF5", "cannot read utterances",
                   "the shard changed while this run read it")


@pytest.mark.mpi
def test_shard_going_bad_mid_training_ends_the_job(small_corpus, tmp_path):
    # rank 1's shards are truncated after 3 minibatches; with 2000-frame chunks a
    # later chunk read fails while rank 0 trains on towards its next average
    data = tmp_path / "data"
    shutil.copytree(small_corpus, data)
    _rank_one_shards(str(data / "train"))
    run = tmp_path / "run"
    args = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in TINY + [f"data.train={data / 'train'}", f"data.dev={data / 'dev'}",
                        "data.chunk_frames=2000", "training.log_interval=2",
                        "parallel.average_every=4"]:
        args += ["--set", item]
    timeout, start = 90, time.monotonic()
    try:
        result = run_mpi(2, [str(WORKERS / "train_truncate_worker.py"), "1", "3", "--", *args],
                         timeout=timeout)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung instead of aborting: {exc}")
    _assert_quick_failure(result, time.monotonic() - start, timeout,
                          "truncated its shards after 3 minibatches",
                          "rank 1: error:", TRUNCATED_SHARD)
    # it got into training before failing, and never finished
    assert [r["step"] for r in records(run, "train")][:1] == [2], mpi_output(result)
    assert not (run / "final.h5").exists()


# ---------------------------------------------------- several ranks: end to end

@pytest.mark.mpi
@pytest.mark.slow
def test_quickstart_on_two_ranks_learns(small_corpus, tmp_path):
    from mpitrain.data.corpus import load_manifest
    run = tmp_path / "run"
    result = train_on_ranks(2, run, small_corpus, ["training.epochs=2"], timeout=240)
    assert result.returncode == 0, mpi_output(result)
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()
    evals = records(run, "eval")
    final = evals[-1]
    # the bar of test_quickstart_learns_far_above_majority_baseline
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40, (final, majority)
    assert evals[-1]["dev_xent"] < evals[0]["dev_xent"]
    assert final["dev_frames"] == dev.num_frames         # both ranks' halves counted
    assert records(run, "start")[0]["ranks"] == 2


def kaldi_frames(steps, planned_steps, every, jobs_initial, jobs_final, minibatch):
    """Frames trained in ``steps`` steps under Kaldi's job ramp (train_dnn.py's
    formula), which spans the planned run, not a max_steps cap."""
    iters = -(-planned_steps // every)
    frames = 0
    for step in range(steps):
        i = min(step // every, iters - 1)
        frames += minibatch * int(0.5 + jobs_initial + (jobs_final - jobs_initial) * i / iters)
    return frames


@pytest.mark.mpi
@pytest.mark.parametrize("method,extra", [
    ("model_averaging", []), ("allreduce", []), ("kaldi", []), ("bmuf", []),
    # 0.01 MiB buckets: several overlapped reductions per step
    ("allreduce", ["parallel.overlap=true", "parallel.bucket_mb=0.01"]),
], ids=["model_averaging", "allreduce", "kaldi", "bmuf", "allreduce-overlap"])
def test_every_method_trains_two_ranks_to_the_end(small_corpus, tmp_path, method, extra):
    from mpitrain.nn.model_file import load_model
    from mpitrain.train.checkpoint import list_checkpoints, load_checkpoint
    run = tmp_path / "run"
    steps = 24
    result = train_on_ranks(2, run, small_corpus, TINY + extra + [
        f"parallel.method={method}", "parallel.average_every=4", "parallel.num_jobs_initial=1",
        f"training.max_steps={steps}", "training.log_interval=4",
        "training.checkpoint_interval=8"])
    assert result.returncode == 0, mpi_output(result)
    start = records(run, "start")[0]
    assert start["strategy"] == method and start["ranks"] == 2
    end = records(run, "end")[-1]
    assert end["steps"] == steps
    if method == "kaldi":       # one job for the first iterations, then two
        planned = start["planned_steps"]
        assert planned > steps
        assert end["frames"] == kaldi_frames(steps, planned, 4, 1, 2, 256) < steps * 2 * 256
    else:
        assert end["frames"] == steps * 2 * 256
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"], train
    net, _ = load_model(run / "final.h5")
    assert np.isfinite(net.params).all()
    last = load_checkpoint(list_checkpoints(run)[-1])
    assert last.step == steps and last.num_ranks == 2
    assert np.array_equal(last.net.params, net.params)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["model_averaging", "allreduce", "bmuf"])
def test_resume_on_two_ranks_is_bit_exact(small_corpus, tmp_path, method):
    # 32 is a multiple of average_every, so the split run stops at a point where
    # the ranks agree and finalize() has nothing left to average; momentum makes
    # each rank's own optimizer state part of what must be restored
    common = TINY + ["optimizer.momentum=0.5", f"parallel.method={method}",
                     "parallel.average_every=8", "training.checkpoint_interval=8",
                     "training.epochs=1", "training.log_interval=8"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run_dir, extra, resume in ((straight, ["training.max_steps=64"], False),
                                   (split, ["training.max_steps=32"], False),
                                   (split, ["training.max_steps=64"], True)):
        result = train_on_ranks(2, run_dir, small_corpus, common + extra, resume=resume)
        assert result.returncode == 0, mpi_output(result)
    from mpitrain.nn.model_file import load_model
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert [r["step"] for r in records(split, "start")] == [0, 32]
    assert np.array_equal(a.params, b.params), np.abs(a.params - b.params).max()
    # the logged training loss after the resume point matches too (both ranks' data)
    after = [r["xent"] for r in records(straight, "train") if r["step"] > 32]
    resumed = [r["xent"] for r in records(split, "train") if r["step"] > 32]
    assert after == resumed


@pytest.mark.parametrize("stop", ["early_stop", "on_eval"])
def test_a_run_stopped_at_an_evaluation_evaluates_its_last_step_once(small_corpus, tmp_path,
                                                                     monkeypatch, stop):
    """The evaluation that stops the run is the final model's: it is not made, logged
    or counted by model selection a second time."""
    from mpitrain.train.trainer import Trainer
    calls = []
    real_evaluate = Trainer.evaluate

    def counted(self, *args, **kwargs):
        calls.append(self.step)
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", counted)
    settings = TINY + ["training.eval_interval=1000", "training.epochs=3"]
    if stop == "early_stop":        # no evaluation gains 50 points: stops at the second
        settings += ["training.early_stop.patience=1", "training.early_stop.min_delta=0.5"]
    else:                           # a caller's stop (bench mode's): at the second
        monkeypatch.setattr(Trainer, "on_eval", lambda self, result: len(calls) >= 2)
    run = tmp_path / "run"
    train_in_process(run, small_corpus, settings)
    evals, end = records(run, "eval"), records(run, "end")[0]
    assert end["steps"] < records(run, "start")[0]["total_steps"]       # it did stop early
    assert calls == [e["step"] for e in evals] and len(calls) == 2
    assert [r["step"] for r in records(run, "selection")] == calls
    assert (end["dev_acc"], end["dev_xent"]) == (evals[-1]["dev_acc"], evals[-1]["dev_xent"])
    assert evals[-1]["step"] == end["steps"]


@pytest.mark.parametrize("how", ["moved", "removed"])
def test_a_run_directory_moved_or_removed_mid_run_stops_the_run(small_corpus, tmp_path,
                                                                 monkeypatch, capsys, how):
    # the next checkpoint made a new directory of the old name holding checkpoints,
    # best.h5 and final.h5 but no config.yaml, metrics.jsonl or lock, and the run
    # ended with status 0 (a removed run's log was written into a deleted file)
    from mpitrain.train import trainer as trainer_module
    run = tmp_path / "run"
    real_write = trainer_module.Trainer._write_checkpoint

    def write_then_lose_the_directory(self, states):
        real_write(self, states)
        if run.exists():
            if how == "moved":
                run.rename(tmp_path / "moved")
            else:
                shutil.rmtree(run)

    monkeypatch.setattr(trainer_module.Trainer, "_write_checkpoint",
                        write_then_lose_the_directory)
    _stops_on_losing_its_run_directory(small_corpus, run, capsys)


def _stops_on_losing_its_run_directory(corpus, run, capsys, *, extra=(), virtual=()):
    """A 12-step run checkpointing every 4 steps, whose directory goes away after its
    first checkpoint, stops at the next one with the one-line error."""
    argv = ["train", QUICKSTART, "--run-dir", str(run), *virtual]
    for item in TINY + ["training.max_steps=12", "training.checkpoint_interval=4",
                        f"data.train={corpus}/train", f"data.dev={corpus}/dev",
                        "data.chunk_frames=20000", *extra]:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mpitrain train: error: {run}: the run "
                                               "directory (or its .lock) was removed"), err
    assert not run.exists()


def test_a_run_directory_moved_mid_run_stops_a_parameter_server_run(small_corpus, tmp_path,
                                                                     monkeypatch, capsys):
    # the server writes its checkpoints by itself, and did not look: it went on
    # to the end making a new directory of the old name holding checkpoints alone,
    # and failed only at best.h5 or final.h5
    from mpitrain.train import serving
    run = tmp_path / "run"
    real_save = serving.save_checkpoint

    def save_then_move_the_directory(*args, **kwargs):
        real_save(*args, **kwargs)
        if run.exists():
            run.rename(tmp_path / "moved")

    monkeypatch.setattr(serving, "save_checkpoint", save_then_move_the_directory)
    _stops_on_losing_its_run_directory(
        small_corpus, run, capsys, virtual=("--virtual", "2"),
        extra=("parallel.method=param_server", "training.eval_interval=1000000"))
    assert [p.name for p in (tmp_path / "moved").glob("ckpt-*.h5")] == ["ckpt-00000004.h5"]


def test_nnet2s_max_change_per_sample_alone_trains_and_learns(small_corpus, tmp_path):
    """Su & Chen's clipping (nnet2's max-change-per-sample, nnet3's max-change off),
    end to end: the run learns (slowly at this rate: the bound clips most steps of
    a ReLU network, docs/benchmarks.md)."""
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.epochs=1", "model.hidden_dim=64",
                                         "optimizer.max_change_per_sample=0.075",
                                         "optimizer.max_change_per_layer=0",
                                         "optimizer.max_change_output=0",
                                         "optimizer.max_change=0"])
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    final = records(run, "eval")[-1]
    assert final["dev_acc"] > counts.max() / counts.sum(), final
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"] - 0.5, (train[0], train[-1])


@pytest.mark.mpi
def test_a_directory_in_use_is_one_line_from_rank_0_on_two_ranks(small_corpus, tmp_path):
    # rank 0 alone found the lock taken: it printed "rank 0: error" and aborted the
    # job, MPI's abort line after it
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "run"
    run.mkdir()
    holder = RunDirLock(str(run))
    assert holder.acquire() is None
    try:
        result = train_on_ranks(2, run, small_corpus, TINY + ["training.max_steps=4"],
                                timeout=120)
    finally:
        holder.release()
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, mpi_output(result)
    assert err.startswith("mpitrain train: error: ") and "another run is using" in err, err


def test_more_blas_threads_than_cores_is_said_at_the_start(small_corpus, tmp_path,
                                                           monkeypatch):
    # (1024 BLAS threads on 2 cores made a small model's step a thousand times slower,
    # and nothing said why)
    import mpitrain.train.trainer as trainer
    from mpitrain.config import load_config
    from mpitrain.train.virtual import plan_virtual
    from ..helpers import small_overrides
    monkeypatch.setattr(trainer, "available_cores", lambda: 2, raising=False)
    said = {}
    for threads in (0, 2, 3, 1024):
        cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", f"blas_threads={threads}"])
        lines = plan_virtual(cfg, size=1, run_dir=str(tmp_path / "run"))
        said[threads] = [line for line in lines if line.startswith("threads: ")]
    assert said[0] == said[2] == []
    assert said[3] == ["threads: blas_threads 3 is more than the 2 core(s) this process may "
                       "use: its BLAS threads wait on each other and a step may take many "
                       "times longer; 0 gives each rank its share of the cores"]
    assert len(said[1024]) == 1 and "blas_threads 1024 is more than the 2 core(s)" \
        in said[1024][0]


@pytest.mark.parametrize("settings, shape", [
    ([], "440-3x512-120"),
    (["model.hidden_layers=0"], "440-120"),                  # (said 440-0x512-120)
    (["model.nonlinearity=pnorm", "model.pnorm_output_dim=128"], "440-3x512/128-120"),
])
def test_the_start_line_gives_the_model_shape_as_built(settings, shape):
    from mpitrain.config import load_config
    from mpitrain.train.trainer import model_shape
    cfg = load_config(QUICKSTART, settings)
    assert model_shape(cfg.model, 440, 120) == shape


@pytest.mark.parametrize("ranks, settings, slowdown", [
    (2, ["parallel.method=kaldi", "parallel.num_jobs_initial=1"], {}),
    (3, ["parallel.method=adpsgd", "parallel.hierarchical=true",
         "parallel.ranks_per_node=2"], {}),
    (2, ["parallel.straggler_policy=adapt"], {1: 4.0})],
    ids=["kaldi-ramp", "hierarchical-unequal-nodes", "straggler-adapt"])
def test_an_evaluation_between_averages_scores_the_model_the_method_would_keep(
        small_corpus, tmp_path, ranks, settings, slowdown):
    # between averages the ranks' plain mean was scored (and kept as best.h5): with
    # Kaldi's job ramp the idle ranks' models from the iteration's start counted as
    # jobs; unequal nodes weighed by their ranks; the adapt policy's quotas ignored
    from mpitrain.config import load_config
    from mpitrain.train.virtual import ComputeModel, train_virtual
    from ..helpers import small_overrides
    common = small_overrides(small_corpus) + settings + [
        "model.hidden_dim=32", "model.hidden_layers=1", "parallel.average_every=8",
        "training.minibatch=128", "training.eval_interval=256",
        "training.checkpoint_interval=0"]
    compute = ComputeModel(step_seconds=0.002, slowdown=slowdown)
    longer, stopped = tmp_path / "longer", tmp_path / "stopped"
    train_virtual(load_config(QUICKSTART, common + ["training.max_steps=16"]), size=ranks,
                  run_dir=str(longer), compute=compute)
    # the first evaluation between averages (past the first for the adapt policy,
    # whose quotas differ from the second period on), and a run that ends there
    first = 8 if slowdown else 0
    step = min(r["step"] for r in records(longer, "eval") if r["step"] % 8 and r["step"] > first)
    train_virtual(load_config(QUICKSTART, common + [f"training.max_steps={step}"]),
                  size=ranks, run_dir=str(stopped), compute=compute)
    between = [r for r in records(longer, "eval") if r["step"] == step]
    assert between[0]["dev_xent"] == records(stopped, "end")[0]["dev_xent"]


def test_a_final_model_of_the_priors_alone_is_named(small_corpus, tmp_path, capsys):
    """A setting that settles at the class priors (BMUF's block_lr far past 1, a rate
    too large) keeps a steady objective the divergence guard does not flag, and the
    run ended with status 0 and no word; a model that learned gets no such note."""
    train_in_process(tmp_path / "stalled", small_corpus,
                     TINY + ["training.max_steps=1", "training.minibatch=16"])
    out = capsys.readouterr().out
    [end] = records(tmp_path / "stalled", "end")
    warned = [line for line in out.splitlines() if "no better than always answering" in line]
    assert len(warned) == 1 and f"{end['dev_acc']:.4f}" in warned[0], out
    assert "optimizer.initial_learning_rate" in warned[0]
    # judged only on the whole held-out set, whose class counts the corpus holds
    train_in_process(tmp_path / "part", small_corpus, TINY + [
        "training.max_steps=1", "training.minibatch=16", "training.eval_max_frames=500"])
    assert "no better than always answering" not in capsys.readouterr().out
    train_in_process(tmp_path / "learned", small_corpus, TINY + ["training.max_steps=60"])
    out = capsys.readouterr().out
    counts = load_manifest(os.path.join(small_corpus, "dev")).class_counts
    assert records(tmp_path / "learned", "end")[0]["dev_acc"] > 2 * max(counts) / sum(counts)
    assert "no better than always answering" not in out
