"""Bad data is found before training, on every rank, with one line naming file and record.

Each case damages a copy of the small corpus and runs ``mpitrain train``: the
exit status is 2, stderr is one line naming the shard and what is wrong, and no
run directory is written.  (The checks themselves are tested in
tests/data/test_validate.py and tests/data/test_check.py.)
"""

import os
import shutil

import h5py
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.corpus import load_manifest

from ..helpers import QUICKSTART, mpi_output, train_on_ranks

TINY = ["model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=5"]


@pytest.fixture
def corpus(small_corpus, tmp_path):
    copy = tmp_path / "corpus"
    shutil.copytree(small_corpus, copy)
    return copy


def _train(corpus, run_dir, extra=(), flags=()):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir), *flags]
    for item in [f"data.train={corpus / 'train'}", f"data.dev={corpus / 'dev'}",
                 "data.chunk_frames=20000"] + TINY + list(extra):
        argv += ["--set", item]
    return main(argv)


def _shard(corpus, split="train", index=0):
    return load_manifest(str(corpus / split)).shard_path(index)


def _refused(corpus, tmp_path, capsys, *parts):
    run = tmp_path / "run"
    assert _train(corpus, run) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain train: error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err
    assert not run.exists()
    return err


def test_nan_features_are_refused_naming_shard_utterance_and_frame(corpus, tmp_path, capsys):
    path = _shard(corpus)
    with h5py.File(path, "r+") as f:
        f["feats"][7, 3] = np.nan
        utt = f["utt_ids"].asstr()[0]
    _refused(corpus, tmp_path, capsys, path, "NaN", "frame 7", utt)


def test_labels_out_of_range_are_refused_before_any_checkpoint(corpus, tmp_path, capsys):
    path = _shard(corpus, index=1)
    with h5py.File(path, "r+") as f:
        f["labels"][11] = 5000
    _refused(corpus, tmp_path, capsys, path, "labels", "5000", "frame 11")


def test_bad_held_out_data_is_refused_too(corpus, tmp_path, capsys):
    path = _shard(corpus, split="dev")
    with h5py.File(path, "r+") as f:
        f["feats"][0, 0] = np.inf
    _refused(corpus, tmp_path, capsys, path, "inf")


def test_features_of_the_wrong_dimension(corpus, tmp_path, capsys):
    path = _shard(corpus)
    with h5py.File(path, "r+") as f:
        feats = f["feats"][()]
        del f["feats"]
        f.create_dataset("feats", data=feats[:, :-1])
    _refused(corpus, tmp_path, capsys, path, "feats", "columns", "feat_dim")


def test_a_missing_dataset(corpus, tmp_path, capsys):
    path = _shard(corpus)
    with h5py.File(path, "r+") as f:
        del f["labels"]
    _refused(corpus, tmp_path, capsys, path, "labels")


def test_features_stored_as_integers(corpus, tmp_path, capsys):
    path = _shard(corpus)
    with h5py.File(path, "r+") as f:
        feats = f["feats"][()]
        del f["feats"]
        f.create_dataset("feats", data=feats.astype(np.int16))
    _refused(corpus, tmp_path, capsys, path, "feats", "int16")


def test_a_shard_damaged_on_disk(corpus, tmp_path, capsys):
    path = _shard(corpus)
    with open(path, "r+b") as fh:
        fh.write(b"\0" * 512)            # the superblock and the root group are gone
    _refused(corpus, tmp_path, capsys, os.path.basename(path))


def test_a_missing_shard_file(corpus, tmp_path, capsys):
    path = _shard(corpus, index=2)
    os.remove(path)
    _refused(corpus, tmp_path, capsys, os.path.basename(path))


@pytest.mark.parametrize("command", [["train"], ["train", "--virtual", "2"], ["pretrain"],
                                     ["bench"], ["bench", "--virtual", "1,2"]],
                         ids=["train", "virtual", "pretrain", "bench", "bench-virtual"])
def test_no_training_corpus_given(corpus, tmp_path, capsys, command):
    run = tmp_path / "run"
    where = "--out" if command[0] == "bench" else "--run-dir"
    assert main([*command, QUICKSTART, where, str(run), "--set", "data.train="]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain {command[0]}: error: {QUICKSTART}: data.train: no "
                          "training corpus given"), err
    assert err.count("\n") == 1 and not run.exists()


def test_held_out_corpus_of_another_shape(corpus, tmp_path, capsys):
    from ..data.corpora import write_corpus
    other = write_corpus(tmp_path / "other")
    run = tmp_path / "run"
    assert _train(corpus, run, [f"data.dev={other}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain train: error: ") and err.count("\n") == 1, err
    assert "corpus.yaml: feat_dim is 4, but the training corpus has 40" in err
    assert not run.exists()


def test_held_out_corpus_of_other_classes_says_how_to_prepare_it(corpus, tmp_path, capsys):
    # a test set prepared without --num-classes: the largest pdf it holds + 1 classes
    from mpitrain.data.writer import CorpusWriter
    from ..data.tiny_models import tiny_model
    train = load_manifest(str(corpus / "train"))
    rng = np.random.default_rng(0)
    with CorpusWriter(str(tmp_path / "fewer"), feat_dim=train.feat_dim,
                      num_classes=train.num_classes - 1, num_shards=1) as writer:
        writer.add("u1", rng.normal(size=(30, train.feat_dim)).astype(np.float32),
                   np.arange(30, dtype=np.int32) % (train.num_classes - 1))
    run = tmp_path / "run"
    assert _train(corpus, run, [f"data.dev={tmp_path / 'fewer'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not run.exists(), err
    assert err.rstrip().endswith(f"corpus.yaml: num_classes is {train.num_classes - 1}, but the "
                                 f"training corpus has {train.num_classes}; prepare it with "
                                 f"--num-classes {train.num_classes} (the number of pdfs)"), err
    model = tiny_model(str(tmp_path / "m.h5"), feat_dim=train.feat_dim,
                       num_classes=train.num_classes)
    assert main(["eval", model, str(tmp_path / "fewer")]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"expects {train.feat_dim} and {train.num_classes}; prepare it "
                                 f"with --num-classes {train.num_classes} (the number of pdfs)")
    # a model of fewer classes than the corpus: no preparing makes them fit, so no
    # such advice (it said 'prepare it with --num-classes 2' for a 120-class corpus)
    small = tiny_model(str(tmp_path / "small.h5"), feat_dim=train.feat_dim, num_classes=2)
    assert main(["eval", small, str(tmp_path / "fewer")]) == 2
    err = capsys.readouterr().err
    assert "expects" in err and "--num-classes" not in err, err


def test_a_minibatch_larger_than_a_ranks_data(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    largest = max(shard.frames for shard in load_manifest(str(corpus / "train")).shards)
    assert _train(corpus, run, [f"training.minibatch={largest + 1}"]) == 2
    err = capsys.readouterr().err
    assert f"no complete minibatch of {largest + 1} frames" in err and "training.minibatch" in err
    assert "minibatches never cross shards, and the largest shard holds" in err
    assert err.count("\n") == 1 and not run.exists()


def test_a_minibatch_larger_than_the_whole_corpus_does_not_ask_for_fewer_shards(corpus, tmp_path,
                                                                                 capsys):
    # fewer shards cannot help a corpus smaller than one minibatch
    run = tmp_path / "run"
    frames = load_manifest(str(corpus / "train")).num_frames
    assert _train(corpus, run, ["training.minibatch=10000000"]) == 2
    err = capsys.readouterr().err
    assert f"the whole corpus holds {frames} frames; lower training.minibatch" in err
    assert "fewer shards" not in err
    assert err.count("\n") == 1 and not run.exists()


@pytest.mark.mpi
def test_fewer_utterances_than_ranks_is_said_once_with_the_remedy(mpiexec, tmp_path):
    from mpitrain.data.synthetic import synthesize
    corpus = tmp_path / "one"
    synthesize(str(corpus), hours=0.00001, speakers=1, shards=1, dev_hours=0.00001,
               dev_speakers=1)
    run = tmp_path / "run"
    result = train_on_ranks(2, run, str(corpus))
    assert result.returncode == 2, mpi_output(result)
    lines = [line for line in result.stderr.splitlines() if "no complete minibatch" in line]
    assert len(lines) == 1, mpi_output(result)
    assert "the corpus has 1 utterance(s) for 2 ranks; use at most 1 rank" in lines[0]
    assert "1 ranks" not in lines[0]
    assert not run.exists()


def test_files_another_program_holds_locked_are_read_without_hdf5s_lock(corpus, tmp_path):
    # HDF5 fails an open it cannot lock: on a filesystem without locks (errno 38
    # or 524 on a parallel filesystem) every read failed.  mpitrain's files are
    # complete when they appear (written aside, then renamed), so its reads take
    # no lock; here another program's exclusive lock stands for the filesystem
    import fcntl
    from mpitrain.nn.model_file import load_model
    run = tmp_path / "run"
    assert _train(corpus, run) == 0
    held = [open(path, "rb") for path in sorted(
        [*(corpus / "train").glob("*.h5"), *(corpus / "dev").glob("*.h5"),
         *run.glob("*.h5")])]
    try:
        for fh in held:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        if os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() not in ("FALSE", "0", "NO"):
            with pytest.raises(OSError, match="unable to lock file"):
                h5py.File(held[0].name, "r")          # what HDF5 does by default
        assert main(["check", str(corpus / "train")]) == 0
        # the run resumed from its locked checkpoint, on locked shards
        argv = ["train", QUICKSTART, "--run-dir", str(run), "--resume"]
        for item in [f"data.train={corpus / 'train'}", f"data.dev={corpus / 'dev'}",
                     "data.chunk_frames=20000", "training.max_steps=10"] + TINY[:2]:
            argv += ["--set", item]
        assert main(argv) == 0
        assert main(["eval", str(run / "final.h5"), str(corpus / "dev")]) == 0
        net, _ = load_model(str(run / "final.h5"))
        assert np.isfinite(net.params).all()
    finally:
        for fh in held:
            fh.close()


@pytest.mark.parametrize("select_by", ["acc", "xent"])
def test_held_out_frames_that_overflow_the_model_are_said_not_scored_silently(corpus, tmp_path,
                                                                             capsys, select_by):
    """A finite feature value far outside the training range (3e38) makes the model's
    output NaN: `train` says so once and keeps no best model from it, `status` names
    no best.h5, and `eval` refuses to print a NaN score with exit status 0.  Selecting
    by accuracy, which stays finite, chose such a model and failed the run at the end
    writing its best.h5 (no final model either)."""
    from mpitrain.train.status import run_status
    dev = load_manifest(str(corpus / "dev"))
    for index in range(len(dev.shards)):
        with h5py.File(dev.shard_path(index), "r+") as f:
            f["feats"][::7, :] = 3e38           # in every evaluation's frames
    run = tmp_path / "run"
    assert _train(corpus, run, ["training.max_steps=12", "training.eval_interval=640",
                                f"training.select_by={select_by}"]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: the held-out loss at step ") == 1, out
    assert "some held-out frames overflow the model" in out
    assert not (run / "best.h5").exists() and (run / "final.h5").exists()
    assert "no best model yet (no finite held-out result)" in "\n".join(run_status(str(run)))
    assert main(["eval", str(run / "final.h5"), str(corpus / "dev")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model's output is not finite on some frames" in err


def test_a_run_that_ends_on_an_error_says_so_to_status(corpus, tmp_path, capsys,
                                                       monkeypatch):
    """A run that stopped on an error was shown as 'cut off: rank 0 ... is gone without
    an end record', the words for a lost node."""
    from mpitrain.train.status import run_status
    from mpitrain.train.trainer import Trainer
    saved = Trainer.save_checkpoint
    calls = []

    def failing_save(self):
        calls.append(self.step)
        if len(calls) == 2:
            raise OSError("cannot write the checkpoint: Input/output error")
        return saved(self)

    monkeypatch.setattr(Trainer, "save_checkpoint", failing_save)
    run = tmp_path / "run"
    assert _train(corpus, run, ["training.max_steps=40", "training.checkpoint_interval=4"]) == 2
    lines = run_status(str(run))
    assert lines[0] == f"{run}: failed at step 8: cannot write the checkpoint: Input/output " \
                       "error", lines
    assert any("newest checkpoint: ckpt-00000004.h5" in line for line in lines), lines


def test_running_out_of_memory_in_the_read_ahead_says_so_to_status(corpus, tmp_path,
                                                                   capsys, monkeypatch):
    """A MemoryError carries no message: the run's error record held an empty one,
    and status said 'failed at step S: ' and nothing more."""
    import mpitrain.data.batcher as batcher
    from mpitrain.train.status import run_status
    read, calls = batcher.read_chunk, []

    def failing_read(*args):
        calls.append(1)
        if len(calls) == 2:         # the chunk read ahead, in the read-ahead thread
            raise MemoryError()
        return read(*args)

    monkeypatch.setattr(batcher, "read_chunk", failing_read)
    run = tmp_path / "run"
    assert _train(corpus, run, ["data.chunk_frames=2000", "training.max_steps=40"]) == 2
    assert "error: out of memory" in capsys.readouterr().err
    line = run_status(str(run))[0]
    assert line.startswith(f"{run}: failed at step ") and line.endswith(": out of memory"), line


def test_a_final_model_written_on_resume_ends_the_run_for_status(corpus, tmp_path,
                                                                 monkeypatch):
    """final.h5 could not be written (a full disk) after the final checkpoint; --resume
    wrote it, but status still said the run had failed."""
    import mpitrain.train.trainer as trainer_module
    from mpitrain.train.status import run_status
    saved = trainer_module.save_model

    def failing_final(path, *args, **kwargs):
        if os.path.basename(str(path)) == "final.h5":
            raise OSError("No space left on device writing final.h5")
        return saved(path, *args, **kwargs)

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "save_model", failing_final)
        assert _train(corpus, run, ["training.max_steps=8"]) == 2
    assert run_status(str(run))[0].startswith(f"{run}: failed at step 8: No space left")
    assert _train(corpus, run, ["training.max_steps=8"], flags=["--resume"]) == 0
    assert (run / "final.h5").exists()
    lines = run_status(str(run))
    assert lines[0].startswith(f"{run}: ended: 8 steps in ?; "), lines
    # the end record written on resume says by which figure best.h5 was chosen
    assert "; best acc " in " ".join(lines), lines


def test_a_problem_of_a_file_several_ranks_read_is_counted_once(corpus, tmp_path, capsys):
    # the held-out shard is shared out over both ranks: each finds its dtype
    path = _shard(corpus, split="dev")
    with h5py.File(path, "r+") as f:
        feats = f["feats"][()]
        del f["feats"]
        f.create_dataset("feats", data=feats.astype(np.int16))
    assert len(load_manifest(str(corpus / "dev")).shards) == 1
    run = tmp_path / "run"
    assert _train(corpus, run, flags=["--virtual", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path in err and "int16" in err, err
    assert "more problem" not in err, err


@pytest.mark.parametrize("method,ranks,said", [
    # every rank trains its own steps: the others' rule, the others' words (it
    # said 'lower training.minibatch', which gives a rank no utterance)
    (["parallel.method=adpsgd", "parallel.asynchronous=true"], 3,
     "the corpus has 2 utterance(s) for 3 ranks; use at most 2 ranks"),
    # a parameter server's clients: those past the utterances trained nothing, and
    # the job went on without a word
    (["parallel.method=param_server"], 4,
     "the corpus has 2 utterance(s) for 3 client ranks; use at most 3 ranks "
     "(1 server and 2 clients)"),
    (["parallel.method=param_server", "parallel.servers=2"], 5,
     "the corpus has 2 utterance(s) for 3 client ranks; use at most 4 ranks "
     "(2 servers and 2 clients)")])
def test_fewer_utterances_than_ranks_that_take_their_own_steps(tmp_path, capsys, method,
                                                               ranks, said):
    from mpitrain.data.synthetic import synthesize
    corpus = tmp_path / "two"
    synthesize(str(corpus), hours=0.002, speakers=1, shards=1, dev_hours=0.00001,
               dev_speakers=1)
    assert load_manifest(str(corpus / "train")).num_utterances == 2
    run = tmp_path / "run"
    assert _train(corpus, run, ["training.minibatch=16", *method],
                  flags=["--virtual", str(ranks), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain train: error: ") and err.count("\n") == 1, err
    assert f"{corpus / 'train'}: rank " in err and "has no complete minibatch of 16 frames" in err
    assert said in err, err
    assert not run.exists()
