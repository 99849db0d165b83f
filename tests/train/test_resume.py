"""The state a roll back returns to before the first checkpoint (train/resume.py).

On the CPU the optimizer's and the strategies' state_dict() hand out their live
buffers; the start-of-run snapshot must hold copies, or a roll back to "the
initial model" keeps the momentum (and BMUF's block start) of the diverging
run.
"""

import io
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.comm.single import SingleCommunicator
from mpitrain.config import load_config
from mpitrain.train.trainer import Trainer

from ..helpers import (QUICKSTART, resume_without_a_checkpoint_is_advised, small_overrides,
                       train_in_process)


@pytest.mark.parametrize("method", ["model_averaging", "bmuf"])
def test_a_roll_back_before_any_checkpoint_restores_the_start_exactly(small_corpus, tmp_path,
                                                                      method):
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", f"parallel.method={method}",
        "parallel.average_every=4", "optimizer.momentum=0.9", "training.max_steps=10",
        "training.checkpoint_interval=0", "training.eval_interval=0"])
    trainer = Trainer(cfg, comm=SingleCommunicator(), run_dir=str(tmp_path / "run"),
                      stream=io.StringIO())
    start = {"params": trainer.net.params.copy(), "momentum": trainer.optimizer.delta.copy(),
             **{k: np.array(v, copy=True) for k, v in trainer.strategy.state_dict().items()}}
    training_step = trainer._new_training_step()
    for step in range(6):                   # mid-block: momentum and block start moved
        training_step.run(step, 0.01, trainer.stream.next_batch)
    trainer.step = 6
    assert not np.array_equal(trainer.optimizer.delta, start["momentum"])
    trainer._roll_back("a test")
    assert trainer.step == 0
    assert np.array_equal(trainer.net.params, start["params"])
    assert np.array_equal(trainer.optimizer.delta, start["momentum"])
    for key, value in trainer.strategy.state_dict().items():
        assert np.array_equal(value, start[key]), key


def _rolled_back_search(corpus, tmp_path):
    """(config, trainer) of a search-schedule run just rolled back once."""
    cfg = load_config(QUICKSTART, small_overrides(corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "optimizer.schedule=search",
        "training.max_steps=10", "training.checkpoint_interval=0", "training.eval_interval=0"])
    trainer = Trainer(cfg, comm=SingleCommunicator(), run_dir=str(tmp_path / "run"),
                      stream=io.StringIO())
    trainer._roll_back("a test")
    return cfg, trainer


def test_a_roll_back_holds_the_search_back_from_a_higher_rate(small_corpus, tmp_path):
    # the roll back halves the rate scale; the next search must not double it back
    cfg, trainer = _rolled_back_search(small_corpus, tmp_path)
    assert trainer.guard.lr_scale == 0.5 and trainer.schedule.held_back
    tried = []
    trainer.schedule.search(0, lambda rate: tried.append(rate) or (1.0, 128))
    base = cfg.optimizer.initial_learning_rate
    assert tried == [0.5 * base, base]        # no factor 2
    assert not trainer.schedule.held_back
    trainer.close()


@pytest.mark.mpi
def test_resume_with_another_model_size_is_one_line_from_rank_0(small_corpus, tmp_path):
    # the checkpoint was loaded into the network before the settings were compared:
    # a changed model size was the loader's mismatch, printed by every rank with an
    # MPI abort; now the changed key is named once, and with --accept-changes (a model
    # size cannot change) the mismatch is one line from rank 0, no abort
    from ..helpers import mpi_output, train_on_ranks
    tiny = ["model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=8",
            "training.checkpoint_interval=4", "training.eval_interval=0"]
    run = tmp_path / "run"
    result = train_on_ranks(2, run, small_corpus, tiny, timeout=90)
    assert result.returncode == 0, mpi_output(result)
    before = sorted(os.listdir(run))
    wider = tiny + ["model.hidden_dim=24", "training.max_steps=12"]
    result = train_on_ranks(2, run, small_corpus, wider, resume=True, timeout=90)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, mpi_output(result)
    assert lines[0].startswith("mpitrain train: error: ") and \
        "model.hidden_dim: 16 -> 24" in lines[0], mpi_output(result)
    from mpitrain.testing.mpirun import run_mpi
    args = ["-m", "mpitrain", "train", QUICKSTART, "--run-dir", str(run), "--resume",
            "--accept-changes"]
    for item in small_overrides(small_corpus) + wider:
        args += ["--set", item]
    result = run_mpi(2, args, timeout=90)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, mpi_output(result)
    assert lines[0].startswith("mpitrain train: error: ") and \
        "is not the one the config builds" in lines[0], mpi_output(result)
    assert lines[0].endswith("; a resumed run keeps its network: restore the model settings, "
                             "or train in a new run directory"), lines[0]
    assert sorted(os.listdir(run)) == before


def test_a_checkpoint_skipped_on_resume_is_said_in_one_line(small_corpus, tmp_path, capsys):
    # HDF5's reason for an unreadable file holds a line break: the skip note came out
    # as two lines ("... time = <date>" then ", filename = ...")
    from mpitrain.cli import main
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                 "training.checkpoint_interval=4",
                                                 "training.eval_interval=0"]:
        argv += ["--set", item]
    assert main(argv + ["--set", "training.max_steps=8"]) == 0
    (run / "ckpt-00000009.h5").write_bytes(b"not HDF5")   # no file HDF5 can open
    capsys.readouterr()
    assert main(argv + ["--set", "training.max_steps=12", "--resume"]) == 0
    out = capsys.readouterr().out.splitlines()
    skipped = [i for i, line in enumerate(out) if line.startswith("resume: skipped")]
    assert len(skipped) == 1 and "ckpt-00000009.h5" in out[skipped[0]], out
    assert out[skipped[0] + 1].startswith("resumed from "), out


def test_resume_without_a_checkpoint_names_the_way_to_start(small_corpus, tmp_path, capsys):
    # a run stopped (Ctrl-C) before its first checkpoint leaves config.yaml and
    # metrics.jsonl: --resume said only that no checkpoint was there, and a start
    # without --resume refuses the directory, so the line names --overwrite
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run), "--resume"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16"]:
        argv += ["--set", item]
    run.mkdir()
    resume_without_a_checkpoint_is_advised(
        main, argv, run, capsys,
        "no checkpoint (ckpt-*.h5) to continue from; start the run without --resume")
    # a finished run whose checkpoints were removed: --overwrite alone would delete
    # its final.h5, so the line says what that does
    (run / "final.h5").write_bytes(b"")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("the run has finished (final.h5 is written): nothing to continue; "
                        "--overwrite trains it again, replacing final.h5, or give another "
                        "--run-dir"), err
    assert (run / "final.h5").exists()


def _write_corpus(corpus, hours: float, seed: int) -> None:
    """A small synthetic corpus at ``corpus``, written over what is there."""
    from mpitrain.data.synthetic import synthesize
    synthesize(str(corpus), hours=hours, speakers=4, shards=2, seed=seed,
               dev_hours=0.005, dev_speakers=2, overwrite=True)


def _small_run_argv(corpus, run, extra=()) -> list:
    """``train`` of a tiny model on ``corpus`` into ``run``, checkpoints every 4 steps."""
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(str(corpus)) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                "training.checkpoint_interval=4",
                                                "training.eval_interval=0", *extra]:
        argv += ["--set", item]
    return argv


def test_resume_onto_a_corpus_written_again_is_refused_naming_it(tmp_path, capsys):
    # `prepare --overwrite` into the corpus directory of a stopped run, then --resume:
    # the plan of the new corpus was shorter, the run "ended" at once and wrote
    # final.h5, trained on the old corpus alone
    from mpitrain.cli import main
    corpus, run = tmp_path / "corpus", tmp_path / "run"

    def write(hours, seed):
        _write_corpus(corpus, hours, seed)
    write(0.02, 1)
    argv = _small_run_argv(corpus, run)
    assert main(argv + ["--set", "training.max_steps=8"]) == 0
    write(0.01, 2)
    capsys.readouterr()
    assert main(argv + ["--set", "training.max_steps=12", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.train: the corpus was written again since the checkpoint (" \
        in err[0] and "--accept-changes" in err[0], err
    # the same corpus written again alike is no change
    write(0.02, 1)
    assert main(argv + ["--set", "training.max_steps=12", "--resume"]) == 0


def test_an_accepted_other_training_corpus_re_plans_the_data(tmp_path, capsys):
    """--resume --accept-changes onto another training corpus (other shards and
    sizes): the saved reader positions were places in the old corpus's chunks, and
    the step count one of the old plan; the data is re-planned and the same
    fraction of the schedule counts as done (it went on at the old step in the new
    plan: a smaller corpus "ended" at once, a larger one trained most of it again)."""
    from mpitrain.cli import main

    from ..helpers import records
    corpus, run = tmp_path / "corpus", tmp_path / "run"

    def write(hours, seed):
        _write_corpus(corpus, hours, seed)
    write(0.02, 1)
    argv = _small_run_argv(corpus, run, ["training.minibatch=64", "training.epochs=1"])
    assert main(argv + ["--set", "training.max_steps=80"]) == 0
    old_plan = records(run, "start")[0]["planned_steps"]
    write(0.01, 2)
    capsys.readouterr()
    assert main(argv + ["--resume", "--accept-changes"]) == 0
    new_plan = records(run, "start")[1]["planned_steps"]
    to_step = round(80 * new_plan / old_plan)
    assert new_plan < 80 < old_plan
    assert (f"resume: the training corpus changed: data re-planned over 1 rank, step 80 of "
            f"{old_plan} becomes {to_step} of {new_plan}") in capsys.readouterr().out
    assert records(run, "rank_change")[0]["to_step"] == to_step
    assert records(run, "end")[-1]["steps"] == new_plan


def test_a_log_window_cut_by_a_checkpoint_reads_the_same_after_resume(small_corpus, tmp_path):
    # a checkpoint inside a log window (log every 3 steps, checkpoints every 5): the
    # resumed run's first window held only the steps since the checkpoint, so its
    # train record, and the divergence guard's judgement of it, differed
    import shutil

    from mpitrain.cli import main

    from ..helpers import records
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = small_overrides(small_corpus, **{"training.log_interval": 3}) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.checkpoint_interval=5",
        "training.eval_interval=0", "training.max_steps=12", "optimizer.momentum=0.5"]

    def train(run_dir, *extra):
        argv = ["train", QUICKSTART, "--run-dir", str(run_dir), *extra]
        for item in common:
            argv += ["--set", item]
        assert main(argv) == 0
    train(straight)
    shutil.copytree(straight, split)
    for path in split.iterdir():
        if path.name in ("final.h5", "best.h5") or (path.name.startswith("ckpt-")
                                                    and path.name != "ckpt-00000005.h5"):
            path.unlink()
    train(split, "--resume")
    assert [r["step"] for r in records(split, "start")] == [0, 5]
    fields = ("step", "epoch", "frames", "xent", "acc", "lr", "skipped")
    expected = [{k: r[k] for k in fields} for r in records(straight, "train") if r["step"] > 5]
    resumed = [{k: r[k] for k in fields} for r in records(split, "train")][-len(expected):]
    assert resumed == expected


def test_the_search_line_after_a_roll_back_gives_the_rates_the_steps_take(small_corpus,
                                                                          tmp_path):
    # (it gave the rates before the roll back's scale: 0.025 where the steps took 0.0125)
    cfg, trainer = _rolled_back_search(small_corpus, tmp_path)
    trainer._search_rate()
    # (the log opens when the run starts: its lines wait until then)
    line = next(x for x in trainer._pending_lines if x.startswith("search at step"))
    chosen = trainer.schedule.rate(trainer.step) * trainer.guard.lr_scale
    assert f"rate {chosen:.3g} " in line and "x0.5 after roll backs" in line, line
    base = cfg.optimizer.initial_learning_rate
    assert f"{0.5 * base:.3g}: " in line and f"{0.25 * base:.3g}: " in line, line
    trainer.close()


def test_a_checkpoint_written_after_the_resume_chose_its_own_is_not_trained_past(small_corpus,
                                                                                 tmp_path):
    # the checkpoint is chosen before the run directory's lock is this run's: a job
    # still running there could write newer ones meanwhile, which this run trained
    # past again from the older one and then rotated away
    import shutil
    from mpitrain.train.errors import TrainingError
    tiny = small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.checkpoint_interval=4",
        "training.eval_interval=0"]
    run = tmp_path / "run"
    first = Trainer(load_config(QUICKSTART, tiny + ["training.max_steps=8"]),
                    comm=SingleCommunicator(), run_dir=str(run), stream=io.StringIO())
    first.run()
    first.close()
    trainer = Trainer(load_config(QUICKSTART, tiny + ["training.max_steps=16"]),
                      comm=SingleCommunicator(), run_dir=str(run), resume=True,
                      stream=io.StringIO())
    newest = sorted(name for name in os.listdir(run) if name.startswith("ckpt-"))[-1]
    shutil.copy(run / newest, run / "ckpt-00000012.h5")        # the other job's
    with pytest.raises(TrainingError, match="ckpt-00000012.h5 was written by another job"):
        trainer.run()
    trainer.close()
    assert (run / "ckpt-00000012.h5").exists()


def test_accepted_ngsgd_ranks_start_the_estimates_afresh(small_corpus, tmp_path, capsys):
    """--resume --accept-changes of optimizer.ngsgd.rank_in/rank_out: the saved
    estimates (of the old ranks) were loaded and kept their ranks while the log
    said the change was applied; now the optimizer state starts afresh at the new
    ranks, and the log says so."""
    tiny = ["optimizer.name=ngsgd", "model.hidden_dim=16", "model.hidden_layers=1",
            "training.checkpoint_interval=4", "training.eval_interval=0"]
    run = tmp_path / "run"
    train_in_process(run, small_corpus, tiny + ["training.max_steps=4"])
    capsys.readouterr()
    argv = ["train", QUICKSTART, "--run-dir", str(run), "--resume", "--accept-changes"]
    for item in small_overrides(small_corpus) + tiny + [
            "training.max_steps=8", "optimizer.ngsgd.rank_in=3", "optimizer.ngsgd.rank_out=5"]:
        argv += ["--set", item]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resume: the optimizer state starts afresh" in out and "has rank 20" in out, out
    with h5py.File(run / "ckpt-00000008.h5", "r") as f:
        saved = f["ranks/00000/optimizer/preconditioners"]
        assert saved["layer0_in/W"].shape[0] == 3 and saved["layer0_out/W"].shape[0] == 5


def _train_16_steps_best_past_8(run, corpus, extra=()):
    """`train` 16 steps of a small model, checkpoints every 8, evaluations every 4:
    the argv (``extra`` settings last) and its best.h5 selected past step 8."""
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                           "training.checkpoint_interval=8",
                                           "training.eval_interval=1024",
                                           "training.max_steps=16"] + list(extra):
        argv += ["--set", item]
    assert main(argv) == 0
    return argv


def test_a_best_model_written_after_the_checkpoint_stays_the_best(small_corpus, tmp_path,
                                                                  capsys):
    # a run killed after it wrote best.h5 past its newest checkpoint: the resumed
    # run said the checkpoint's best (step <= 8) while best.h5 held a later model
    run = tmp_path / "run"
    argv = _train_16_steps_best_past_8(run, small_corpus)

    def selected(path):
        with h5py.File(path, "r") as f:
            return int(f.attrs["selected_at_step"]), float(f.attrs["selected_dev_acc"])
    step, acc = selected(run / "best.h5")
    assert step > 8, step               # (the model learns: a later evaluation is best)
    for name in ("ckpt-00000016.h5", "final.h5"):   # cut off between steps 8 and 16
        os.remove(run / name)
    capsys.readouterr()
    # (a rate that changes nothing: the resumed evaluations cannot beat the later one)
    assert main(argv + ["--resume", "--accept-changes",
                        "--set", "optimizer.initial_learning_rate=1e-20",
                        "--set", "optimizer.final_learning_rate=1e-20"]) == 0
    out = capsys.readouterr().out
    assert (f"resume: best.h5 holds the model selected at step {step} (held-out acc {acc:.4f}), "
            "past the checkpoint; it stays the best so far") in out, out
    assert selected(run / "best.h5") == (step, acc)
    assert f"best {run}/best.h5 (held-out acc {acc:.4f} at step {step})" in out, out
    end = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
    assert end["type"] == "end" and end["best_step"] == step, end


def test_a_checkpoint_written_before_a_later_best_step_resumes(small_corpus, tmp_path, capsys):
    # a run killed after it wrote best.h5 past its newest checkpoint, resumed and ended
    # (training.max_steps) before that best step: its final checkpoint holds a best
    # step ahead of its own (as one written after a roll back does), and the next
    # --resume refused it as forged
    run = tmp_path / "run"
    argv = _train_16_steps_best_past_8(run, small_corpus)
    with h5py.File(run / "best.h5", "r") as f:
        best = int(f.attrs["selected_at_step"])
    assert best > 10, best              # (the model learns: a later evaluation is best)
    for name in ("ckpt-00000016.h5", "final.h5"):   # cut off between steps 8 and 16
        os.remove(run / name)
    assert main(argv + ["--resume", "--set", "training.max_steps=10"]) == 0
    with h5py.File(run / "ckpt-00000010.h5", "r") as f:
        assert int(f["trainer"].attrs["selection_best_step"]) == best
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"resumed from {run}/ckpt-00000010.h5 at step 10" in out, out


@pytest.mark.parametrize("damage", ["removed", "another run's"])
def test_a_best_model_lost_or_replaced_before_the_resume_is_said_and_written_anew(
        small_corpus, tmp_path, capsys, damage):
    # best.h5 removed (or another run's copied over it) between a kill and the resume:
    # the run ended naming "best RUN/best.h5 (held-out acc X at step S)", a file that
    # was not there (or another run's model, of other layers, kept as this run's best)
    run = tmp_path / "run"
    argv = _train_16_steps_best_past_8(run, small_corpus)
    for name in ("ckpt-00000016.h5", "final.h5", "best.h5"):     # cut off past step 8
        os.remove(run / name)
    if damage == "another run's":
        _train_16_steps_best_past_8(tmp_path / "other", small_corpus, ["model.hidden_dim=24"])
        shutil.copy(tmp_path / "other" / "best.h5", run / "best.h5")
        why = "is not a model of this run (its components differs), another run's file"
    else:
        why = "is missing"
    capsys.readouterr()
    # (a rate that changes nothing: the resumed evaluations only tie the checkpoint's best)
    assert main(argv + ["--resume", "--accept-changes",
                        "--set", "optimizer.initial_learning_rate=1e-20",
                        "--set", "optimizer.final_learning_rate=1e-20"]) == 0
    out = capsys.readouterr().out
    assert f"resume: {run}/best.h5 {why}; the model selected before (held-out acc " in out, out
    with h5py.File(run / "best.h5", "r") as f:
        step = int(f.attrs["selected_at_step"])
        assert '"out_dim": 16' in str(f.attrs["components"])
    assert step > 8, step
    assert f"at step {step})" in out.strip().splitlines()[-1], out


def test_an_accepted_l2_that_would_zero_the_weights_is_refused_naming_it(small_corpus,
                                                                          tmp_path, capsys):
    # --resume --accept-changes --set optimizer.l2_regularize=1e30 went on, each step
    # clipped by max-change, wearing the resumed model down to zero
    run = tmp_path / "run"
    argv = _small_run_argv(small_corpus, run)
    assert main(argv + ["--set", "training.max_steps=4"]) == 0
    before = sorted(os.listdir(run))
    capsys.readouterr()
    assert main(argv + ["--set", "training.max_steps=8", "--set",
                        "optimizer.l2_regularize=1e30", "--resume", "--accept-changes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{QUICKSTART}: optimizer.l2_regularize: 1e+30 shrinks the " \
        "weights by 2 x 0.004 (optimizer.initial_learning_rate, the largest rate)" in err[0], err
    assert sorted(os.listdir(run)) == before


def test_a_reader_epoch_whose_minibatches_pass_int64_is_still_past_the_step():
    # epoch x steps per epoch in int64 wrapped below the step (2**62 x 210 is 2**63
    # mod 2**64, a negative int64), so a reader far past it was let through
    from mpitrain.train.resume import check_reader_against_own_steps, check_reader_against_step
    reader = {"epoch": np.int64(2 ** 62), "steps_in_epoch": np.int64(20)}
    with pytest.raises(ValueError, match=r"field 'epoch': epoch 4611686018427387904 and 20 "
                                         r"steps into it \(210 steps an epoch\) is past"):
        check_reader_against_step(reader, 210, 20)
    with pytest.raises(ValueError, match=r"is not the rank's own 20 steps"):
        check_reader_against_own_steps(reader, np.int64(20), 210)
