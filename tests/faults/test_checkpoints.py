"""A damaged newest checkpoint never spoils a resume, and no temporary survives a restart.

Each case trains a tiny model to step 20 (checkpoints at 10 and 20), damages
what is on disk, and resumes through ``mpitrain train --resume``.
"""

import h5py
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.h5io import write_checksums
from mpitrain.nn.model_file import load_model
from mpitrain.train.checkpoint import checkpoint_path

from ..helpers import QUICKSTART, records, small_overrides

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.log_interval=5",
        "training.checkpoint_interval=10"]


def _train(run_dir, corpus, steps, resume=False, extra=()):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir)] + (["--resume"] if resume else [])
    for item in small_overrides(corpus) + TINY + [f"training.max_steps={steps}", *extra]:
        argv += ["--set", item]
    return main(argv)


@pytest.fixture
def run(small_corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(run_dir, small_corpus, 20) == 0
    capsys.readouterr()
    return run_dir


def _flip_param_bytes(path):
    with h5py.File(path, "r") as f:
        offset = f["model/params"].id.get_offset()
    assert offset is not None
    with open(path, "r+b") as fh:
        fh.seek(offset + 40)
        byte = fh.read(1)
        fh.seek(offset + 40)
        fh.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["bits", "truncated", "nan"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(run, small_corpus, capsys,
                                                                damage):
    newest = checkpoint_path(run, 20)
    if damage == "bits":
        _flip_param_bytes(newest)
    elif damage == "truncated":
        with open(newest, "r+b") as fh:
            fh.truncate(2048)
    else:
        with h5py.File(newest, "r+") as f:
            f["model/params"][3] = np.nan
    assert _train(run, small_corpus, 30, resume=True) == 0
    out = capsys.readouterr().out
    assert "resume: skipped ckpt-00000020.h5" in out
    assert f"resumed from {checkpoint_path(run, 10)} at step 10" in out
    net, _ = load_model(run / "final.h5")
    assert np.isfinite(net.params).all()


def test_no_good_checkpoint_is_one_line_and_changes_nothing(run, small_corpus, capsys):
    for step in (10, 20):
        _flip_param_bytes(checkpoint_path(run, step))
    metrics = (run / "metrics.jsonl").read_bytes()
    assert _train(run, small_corpus, 30, resume=True) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain train: error: ") and err.count("\n") == 1, err
    assert "no checkpoint verifies" in err and "ckpt-00000010.h5" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_temporaries_of_an_interrupted_write_are_removed_on_restart(run, small_corpus, capsys):
    stale = run / ".ckpt-00000030.h5.tmp-999999"
    stale.write_bytes(b"half a checkpoint")
    mine = run / "notes.tmp"
    mine.write_text("not ours")
    assert _train(run, small_corpus, 30, resume=True) == 0
    assert "removed 1 temporary file(s) left by an interrupted write" in capsys.readouterr().out
    assert not stale.exists() and mine.exists()
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]


def _forge(path, edit):
    """Change a checkpoint as a crafted file would, its checksum recomputed to match."""
    with h5py.File(path, "r+") as f:
        edit(f)
        del f.attrs["checksum"]
        write_checksums(f, str(path), what="checkpoint")


@pytest.fixture
def ngsgd_run(small_corpus, tmp_path, capsys):
    run_dir = tmp_path / "ngsgd"
    assert _train(run_dir, small_corpus, 20, extra=NGSGD) == 0
    capsys.readouterr()
    return run_dir


NGSGD = ["optimizer.name=ngsgd", "optimizer.momentum=0.5"]
_SIDE = "ranks/00000/optimizer/preconditioners/layer0_in"


@pytest.mark.parametrize("edit,named", [
    # (each was taken, and training went on: outputs overflowing to NaN at the first
    # Fisher update, or a momentum of infinity in the float32 buffer)
    (lambda f: f[_SIDE].attrs.__setitem__("rho", 1e300),
     "preconditioner 'layer0_in': OnlineNaturalGradient state: field 'rho': expected a "
     "finite number in (0, 3.40282e+38], got 1e+300"),
    (lambda f: f[_SIDE].attrs.__setitem__("rho", -0.5),
     "preconditioner 'layer0_in': OnlineNaturalGradient state: field 'rho'"),
    (lambda f: f[_SIDE].attrs.__setitem__("t", 2.5),
     "preconditioner 'layer0_in': OnlineNaturalGradient state: field 't': expected an int"),
    (lambda f: f["ranks/00000/optimizer/delta"].__setitem__(
        slice(None), np.full(f["ranks/00000/optimizer/delta"].shape, -1e300)),
     "field 'delta' (momentum): expected finite floats"),
    (lambda f: f["ranks/00000/optimizer"].attrs.__setitem__("num_steps", "12"),
     "field 'num_steps': expected an int in [0,"),
])
def test_a_forged_optimizer_state_is_refused_on_resume_naming_file_and_field(
        ngsgd_run, small_corpus, capsys, edit, named):
    newest = checkpoint_path(ngsgd_run, 20)
    if "delta" in named:
        # (stored as float32: a float64 dataset holds what float32 cannot)
        with h5py.File(newest, "r+") as f:
            shape = f["ranks/00000/optimizer/delta"].shape
            del f["ranks/00000/optimizer/delta"]
            f["ranks/00000/optimizer/delta"] = np.zeros(shape, np.float64)
    _forge(newest, edit)
    metrics = (ngsgd_run / "metrics.jsonl").read_bytes()
    assert _train(ngsgd_run, small_corpus, 30, resume=True, extra=NGSGD) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain train: error: {newest}: ") and err.count("\n") == 1, err
    assert named in err
    assert (ngsgd_run / "metrics.jsonl").read_bytes() == metrics
    assert not (ngsgd_run / "ckpt-00000030.h5").exists()


def test_a_checkpoint_whose_step_is_not_its_name_is_skipped(run, small_corpus, capsys):
    # (a copy of step 10's checkpoint under step 20's name was resumed as step 10,
    # its name keeping it first in the order)
    with open(checkpoint_path(run, 10), "rb") as old, \
            open(checkpoint_path(run, 20), "wb") as newest:
        newest.write(old.read())
    assert _train(run, small_corpus, 30, resume=True) == 0
    out = capsys.readouterr().out
    assert "resume: skipped ckpt-00000020.h5: " in out
    assert "ckpt-00000020.h5: checkpoint attribute 'step' is 10, but the file's name says " \
        "step 20" in out
    assert f"resumed from {checkpoint_path(run, 10)} at step 10" in out


_TRAINER = "trainer"
_READER = "ranks/00000/reader"


def _set_attr(group, key, value):
    return lambda f: f[group].attrs.__setitem__(key, value)


@pytest.mark.parametrize("edit,named", [
    # (each was taken by int() or float(): a best step below -1, an accuracy
    # of 1.5 no evaluation gives, counts cut short, a reader epochs ahead of the step)
    (_set_attr(_TRAINER, "selection_best_step", -2),
     "the model selection: field 'best_step': expected an int in [-1,"),
    (_set_attr(_TRAINER, "selection_best_value", 1.5),
     "the model selection: field 'best_value': expected a finite number in [0, 1], got 1.5"),
    (_set_attr(_TRAINER, "selection_since_gain", 2.5),
     "the model selection: field 'since_gain': expected an int in [0,"),
    (_set_attr(_TRAINER, "selection_held_out_frames", -3),
     "the model selection: field 'held_out_frames': expected an int in [0,"),
    (_set_attr(_TRAINER, "selection_by_xent", 2),
     "the model selection: field 'by_xent': expected 0 or 1, got 2"),
    (_set_attr(_TRAINER, "planned_steps", 2.5),
     "the trainer's state: field 'planned_steps': expected an int in [1,"),
    (_set_attr(_TRAINER, "steps_per_epoch", 0),
     "the trainer's state: field 'steps_per_epoch': expected an int in [1,"),
    (_set_attr(_TRAINER, "complete_at", -1),
     "the trainer's state: field 'complete_at': expected an int in [0,"),
    (_set_attr(_TRAINER, "stopped_early", 2),
     "the trainer's state: field 'stopped_early': expected 0 or 1, got 2"),
    (_set_attr(_TRAINER, "complete_at", 20.5),
     "the trainer's state: field 'complete_at': expected an int in [0,"),
    (_set_attr(_READER, "epoch", 100),
     "ranks/00000/reader: field 'epoch': epoch 100 and"),
    # text, and an epoch whose product with the steps would pass int64
    (_set_attr(_READER, "epoch", "x"),
     "field 'ranks/00000/reader/epoch': expected a non-negative int, got 'x'"),
    (_set_attr(_READER, "epoch", np.int64(2 ** 62)), "ranks/00000/reader: field 'epoch'"),
])
def test_a_forged_trainer_field_is_refused_on_resume_naming_file_and_field(
        run, small_corpus, capsys, edit, named):
    newest = checkpoint_path(run, 20)
    _forge(newest, edit)
    metrics = (run / "metrics.jsonl").read_bytes()
    assert _train(run, small_corpus, 30, resume=True) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain train: error: {newest}: ") and err.count("\n") == 1, err
    assert named in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert not (run / "ckpt-00000030.h5").exists()


def test_a_forged_bmuf_buffer_is_refused_on_resume(small_corpus, tmp_path, capsys):
    # (a float64 block start of 1e300 passed the file's finite check and became
    # infinity in the float32 model the resumed run trained from)
    run_dir, bmuf = tmp_path / "bmuf", ["parallel.method=bmuf", "parallel.average_every=5"]
    assert _train(run_dir, small_corpus, 20, extra=bmuf) == 0
    newest = checkpoint_path(run_dir, 20)
    capsys.readouterr()

    def edit(f):
        shape = f["strategy/start"].shape
        del f["strategy/start"]
        f["strategy/start"] = np.full(shape, 1e300)
    _forge(newest, edit)
    assert _train(run_dir, small_corpus, 30, resume=True, extra=bmuf) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain train: error: {newest}: ") and err.count("\n") == 1, err
    assert "field 'start' (BMUF): expected finite floats in [-3.40282e+38, 3.40282e+38]" in err
    assert not (run_dir / "ckpt-00000030.h5").exists()


ASYNC = ["parallel.method=adpsgd", "parallel.asynchronous=true"]


def _train_virtual(run_dir, corpus, steps, resume=False):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir), "--virtual", "2"] + \
        (["--resume"] if resume else [])
    for item in small_overrides(corpus) + TINY + ASYNC + [f"training.max_steps={steps}"]:
        argv += ["--set", item]
    return main(argv)


def _add_to_attr(group, key, change):
    return lambda f: f[group].attrs.__setitem__(key, int(f[group].attrs[key]) + change)


def _both(*edits):
    def edit(f):
        for one in edits:
            one(f)
    return edit


_OWN0, _OWN1 = "ranks/00000/strategy", "ranks/00001/strategy"


@pytest.mark.parametrize("edit,named", [
    # (a rank's own steps were taken as they stood: a count of a million ended the job
    # at once, at "step 500010" of 40, its checkpoint named so)
    (_add_to_attr(_OWN1, "own_steps", 80),
     "ranks/00001/reader: field 'epoch': epoch 0 and "),
    # the reader moved with it: the ranks' steps no longer make the checkpoint's step
    (_both(_add_to_attr(_OWN0, "own_steps", 4), _add_to_attr(_READER, "steps_in_epoch", 4)),
     "field 'ranks/*/strategy/own_steps': the ranks' own steps ["),
    # rank 0 is active (one request a step at most, each answered by a quiet point),
    # rank 1 passive (no request)
    (_add_to_attr(_OWN0, "requests", 1000), "field 'requests': expected an int in [0, "),
    (_add_to_attr(_OWN1, "requests", 1), "field 'requests': expected an int in [0, 0]"),
    (_add_to_attr(_OWN0, "mixes", 1), "field 'mixes': expected an int in [0, "),
])
def test_a_forged_asynchronous_adpsgd_count_is_refused_on_resume(small_corpus, tmp_path,
                                                                 capsys, edit, named):
    run_dir = tmp_path / "async"
    assert _train_virtual(run_dir, small_corpus, 20) == 0
    newest = checkpoint_path(run_dir, 20)
    # (a legitimate file resumes: the ranks' own steps make its step)
    (run_dir / "final.h5").unlink()
    capsys.readouterr()
    _forge(newest, edit)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    assert _train_virtual(run_dir, small_corpus, 40, resume=True) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain train: error: {newest}: ") and err.count("\n") == 1, err
    assert named in err, err
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert not list(run_dir.glob("ckpt-0000004*.h5"))


def test_an_asynchronous_adpsgd_checkpoint_resumes_across_rank_counts(small_corpus, tmp_path):
    # the extremes the checks must take: a re-plan seeks each rank's reader to its own
    # steps, and the next checkpoint's step is the mean of the ranks' again
    run_dir = tmp_path / "async"
    assert _train_virtual(run_dir, small_corpus, 20) == 0
    (run_dir / "final.h5").unlink()
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir), "--resume", "--virtual", "3"]
    for item in small_overrides(small_corpus) + TINY + ASYNC + ["training.max_steps=30"]:
        argv += ["--set", item]
    assert main(argv) == 0
    (run_dir / "final.h5").unlink()
    # (step 30 of 3 ranks is step 45 of 2)
    assert _train_virtual(run_dir, small_corpus, 60, resume=True) == 0
    (run_dir / "final.h5").unlink()
    assert _train_virtual(run_dir, small_corpus, 70, resume=True) == 0
    changes = [(r["from_ranks"], r["to_ranks"]) for r in records(run_dir, "rank_change")]
    assert changes == [(2, 3), (3, 2)] and len(records(run_dir, "start")) == 4
