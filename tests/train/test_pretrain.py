"""RBM pretraining (train/pretrain.py) through `mpitrain pretrain`, and `train` from its
stack (`model.init_from`, train/pretrained_init.py).

In this process: the stack initialises a sigmoid network that learns; resuming
from a checkpoint inside the first layer gives the same stack bit for bit; a
diverging Gaussian layer and a stack that does not fit the model each stop
with one line naming the key; on the stand-in device it reads once per log
line and gives the CPU's stack.  Under `mpiexec -n 2` (marked mpi): averaged
CD-1 stays in sync and equals one rank where the math says so
(tests/workers/rbm_worker.py), and the command runs on two ranks.
"""

import json
import os
import shutil

import h5py
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.nn.model_file import load_model
from mpitrain.nn.rbm_file import load_rbm_stack
from mpitrain.testing.mpirun import run_mpi
from mpitrain.train.pretrain import momentum_at

from ..helpers import (QUICKSTART, WORKERS, resume_without_a_checkpoint_is_advised,
                       small_overrides)

TINY = ["model.hidden_layers=2", "model.hidden_dim=32", "pretrain.epochs_gaussian=0.25",
        "pretrain.epochs_per_layer=0.25", "pretrain.average_every_frames=1000"]


def _argv(command, run_dir, corpus, extra=()):
    argv = [command, QUICKSTART, "--run-dir", str(run_dir)]
    for item in small_overrides(corpus) + TINY + list(extra):
        argv += ["--set", item]
    return argv


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def test_momentum_rises_in_forty_equal_steps():
    ramp = dict(initial=0.5, final=0.9, ramp_frames=40_000)
    assert momentum_at(0, **ramp) == 0.5
    assert momentum_at(999, **ramp) == 0.5
    assert momentum_at(1000, **ramp) == pytest.approx(0.51)
    assert momentum_at(10 ** 9, **ramp) == pytest.approx(0.9)


def test_pretraining_without_a_hidden_layer_names_the_config_and_key(small_corpus, tmp_path,
                                                                     capsys):
    run = tmp_path / "pre"
    assert main(_argv("pretrain", run, small_corpus, ["model.hidden_layers=0"])) == 2
    assert capsys.readouterr().err == (f"mpitrain pretrain: error: {QUICKSTART}: "
                                       "model.hidden_layers: pretraining needs at least one "
                                       "hidden layer, got 0\n")
    assert not run.exists()


def test_pretrained_stack_initialises_train_which_learns(small_corpus, tmp_path):
    pre = tmp_path / "pre"
    assert main(_argv("pretrain", pre, small_corpus)) == 0
    stack = load_rbm_stack(str(pre / "pretrain.h5"))
    assert [r.hidden_dim for r in stack.rbms] == [32, 32]
    assert [r.visible for r in stack.rbms] == ["gaussian", "bernoulli"]
    for layer in (1, 2):
        errors = [r["recon_mse"] for r in _records(pre, "pretrain") if r["layer"] == layer]
        assert errors[-1] < errors[0], (layer, errors)
    run = tmp_path / "train"
    assert main(_argv("train", run, small_corpus, [
        "model.nonlinearity=sigmoid", f"model.init_from={pre / 'pretrain.h5'}",
        "training.epochs=1", "optimizer.initial_learning_rate=0.02",
        "optimizer.final_learning_rate=0.005"])) == 0
    net, _ = load_model(str(run / "final.h5"))
    end, = _records(run, "end")
    assert end["dev_acc"] > 0.1                  # chance is 1/120
    # it started from the stack: training moved the first layer, but not far from it
    first, pretrained = net.affine_layers()[0].block.ravel(), stack.rbms[0].block.ravel()
    assert np.corrcoef(first, pretrained)[0, 1] > 0.5
    # a resume takes the model from the checkpoint: the stack may have moved away
    os.rename(pre / "pretrain.h5", pre / "moved.h5")
    assert main(_argv("train", run, small_corpus, [
        "model.nonlinearity=sigmoid", f"model.init_from={pre / 'pretrain.h5'}",
        "training.epochs=1", "optimizer.initial_learning_rate=0.02",
        "optimizer.final_learning_rate=0.005"]) + ["--resume"]) == 0


def test_pretraining_resumes_from_a_checkpoint_bit_exactly(small_corpus, tmp_path):
    whole = tmp_path / "whole"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", whole, small_corpus, extra)) == 0
    names = sorted(p for p in os.listdir(whole) if p.startswith("ckpt-"))
    assert "ckpt-00000040.h5" in names
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    os.remove(cut / "pretrain.h5")
    for name in names:
        if name > "ckpt-00000040.h5":
            os.remove(cut / name)
    assert main(_argv("pretrain", cut, small_corpus, extra) + ["--resume"]) == 0
    a, b = load_rbm_stack(str(whole / "pretrain.h5")), load_rbm_stack(str(cut / "pretrain.h5"))
    for x, y in zip(a.rbms, b.rbms):
        np.testing.assert_array_equal(x.params, y.params)


def _cut_at_40(small_corpus, tmp_path):
    run = tmp_path / "run"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 0
    os.remove(run / "pretrain.h5")
    for name in os.listdir(run):
        if name.startswith("ckpt-") and name > "ckpt-00000040.h5":
            os.remove(run / name)
    return run, extra


@pytest.mark.parametrize("change,named", [
    ("model.hidden_dim=16", "model.hidden_dim was 32, now 16"),
    ("data.left_context=1", "data.left_context was "),
])
def test_accept_changes_cannot_reshape_the_rbms_trained_so_far(small_corpus, tmp_path, capsys,
                                                             change, named):
    """A width or context changed on --resume --accept-changes ended in numpy's
    broadcast or matmul error on every rank, and MPI's abort."""
    run, extra = _cut_at_40(small_corpus, tmp_path)
    capsys.readouterr()
    code = main(_argv("pretrain", run, small_corpus, extra + [change])
                + ["--resume", "--accept-changes"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "ckpt-00000040.h5: --resume cannot change the shape" in err and named in err, err
    assert not (run / "pretrain.h5").exists()


@pytest.mark.parametrize("change", [
    "pretrain.minibatch=400",       # the saved batch lay past the new chunk's batches
    "pretrain.minibatch=50",        # it was read as a place among smaller batches
    "data.chunk_frames=5000",
    "training.seed=3",              # the seed orders the chunks
])
def test_accepted_changes_that_split_the_data_otherwise_re_plan_the_pretraining(
        small_corpus, tmp_path, capsys, change):
    """pretrain --resume --accept-changes with settings that step through the data
    otherwise: the same fraction of the layer counts as done, as on another number
    of ranks (the saved reader position failed as out of range for the rank's data,
    naming no file, or was read as another place)."""
    run, extra = _cut_at_40(small_corpus, tmp_path)
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, extra + [change])
                + ["--resume", "--accept-changes"]) == 0, capsys.readouterr().err
    assert "changed: data re-planned, the same fraction of the layer counts as done" \
        in capsys.readouterr().out
    assert (run / "pretrain.h5").exists()


def test_a_pretraining_checkpoint_whose_reader_position_does_not_exist_is_named(
        small_corpus, tmp_path, capsys):
    import h5py

    from mpitrain.h5io import write_checksums
    run, extra = _cut_at_40(small_corpus, tmp_path)
    ckpt = str(run / "ckpt-00000040.h5")
    with h5py.File(ckpt, "r+") as f:
        f["ranks/00000/reader"].attrs["chunk_pos"] = 10 ** 6
        write_checksums(f, ckpt, what="checkpoint")
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and \
        f"{ckpt}: ranks/00000/reader: field 'chunk_pos': 1000000 is out of range" in err, err


def test_a_resume_of_an_ended_pretraining_leaves_its_stack(small_corpus, tmp_path, capsys):
    """As train leaves an ended run's model: it retrained nothing but rewrote
    pretrain.h5 and wrote an end record of NaN reconstruction error."""
    run = tmp_path / "run"
    assert main(_argv("pretrain", run, small_corpus)) == 0
    stack = run / "pretrain.h5"
    before = (stack.read_bytes(), os.stat(stack).st_mtime_ns, len(_records(run, "end")))
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus) + ["--resume"]) == 0
    assert "resume: the pretraining had ended" in capsys.readouterr().out
    assert (stack.read_bytes(), os.stat(stack).st_mtime_ns, len(_records(run, "end"))) \
        == before
    # a lost or damaged stack is written again from the last checkpoint, and its end
    # recorded (a damaged one was left in place)
    os.remove(stack)
    assert main(_argv("pretrain", run, small_corpus) + ["--resume"]) == 0
    assert stack.read_bytes() == before[0]
    assert _records(run, "end")[-1]["stack_written_on_resume"] is True
    damaged = bytearray(before[0])
    damaged[len(damaged) // 2:len(damaged) // 2 + 64] = b"\xff" * 64
    stack.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus) + ["--resume"]) == 0
    assert "resume: wrote" in capsys.readouterr().out
    assert stack.read_bytes() == before[0]


def test_changes_accepted_on_an_ended_pretraining_are_kept_by_its_checkpoint(
        small_corpus, tmp_path, capsys):
    """--resume --accept-changes of an ended pretraining rewrote config.yaml but left
    the checkpoint's settings, so the same --resume without --accept-changes was
    refused as a change; the checkpoint now holds them, as train's final one does,
    and its stack and reader positions are kept (a layer added later trains as
    it would have without the detour)."""
    run, more = tmp_path / "run", tmp_path / "more"
    assert main(_argv("pretrain", run, small_corpus)) == 0
    shutil.copytree(run, more)
    stack = (run / "pretrain.h5").read_bytes()
    names = sorted(p for p in os.listdir(run) if p.startswith("ckpt-"))
    changed = ["pretrain.learning_rate_gaussian=0.005"]     # (the first layer's alone)
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, changed)
                + ["--resume", "--accept-changes"]) == 0, capsys.readouterr().err
    assert f"{names[-1]} now holds them" in capsys.readouterr().out
    assert main(_argv("pretrain", run, small_corpus, changed) + ["--resume"]) == 0, \
        capsys.readouterr().err
    assert (run / "pretrain.h5").read_bytes() == stack
    assert sorted(p for p in os.listdir(run) if p.startswith("ckpt-")) == names
    third = ["model.hidden_layers=3"]
    for where, extra in ((run, changed + third), (more, third)):
        assert main(_argv("pretrain", where, small_corpus, extra)
                    + ["--resume", "--accept-changes"]) == 0, capsys.readouterr().err
    a, b = load_rbm_stack(str(run / "pretrain.h5")), load_rbm_stack(str(more / "pretrain.h5"))
    assert len(a.rbms) == 3
    for x, y in zip(a.rbms, b.rbms):
        np.testing.assert_array_equal(x.params, y.params)


def test_fewer_layers_than_an_ended_pretraining_holds_are_refused_naming_the_stack(
        small_corpus, tmp_path, capsys):
    """--resume --accept-changes with a lower model.hidden_layers than the RBMs
    trained: it said the pretraining had ended, "raise model.hidden_layers to add
    layers", and kept the larger stack (config.yaml now asking for fewer); now one
    line that names the checkpoint holding the stack asked for, nothing rewritten."""
    run = tmp_path / "run"
    assert main(_argv("pretrain", run, small_corpus)) == 0
    steps = _records(run, "start")[0]["layer_steps"]
    kept = {p: (run / p).read_bytes() for p in os.listdir(run) if p != "metrics.jsonl"}
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, ["model.hidden_layers=1"])
                + ["--resume", "--accept-changes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--resume cannot drop RBMs trained so far: model.hidden_layers is 1, the " \
        f"checkpoint holds 2 (restore it; model.init_from={run / f'ckpt-{steps[0]:08d}.h5'} " \
        "is the stack of the first 1)" in err, err
    assert {p: (run / p).read_bytes() for p in os.listdir(run) if p != "metrics.jsonl"} \
        == kept


def test_pretraining_resumes_bit_exactly_from_its_corpus_moved_but_not_from_another(
        small_corpus, tmp_path, capsys):
    from mpitrain.data.synthetic import synthesize
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    first, second = tmp_path / "a" / "corpus", tmp_path / "b" / "corpus"
    shutil.copytree(small_corpus, first)
    assert main(_argv("pretrain", whole, str(first), extra)) == 0
    shutil.copytree(whole, cut)
    os.remove(cut / "pretrain.h5")
    for name in os.listdir(cut):
        if name.startswith("ckpt-") and name > "ckpt-00000040.h5":
            os.remove(cut / name)
    shutil.move(str(first), str(second))
    capsys.readouterr()
    assert main(_argv("pretrain", cut, str(second), extra) + ["--resume"]) == 0
    assert f"moved from {first / 'train'} to {second / 'train'}" in capsys.readouterr().out
    a, b = load_rbm_stack(str(whole / "pretrain.h5")), load_rbm_stack(str(cut / "pretrain.h5"))
    for x, y in zip(a.rbms, b.rbms):
        np.testing.assert_array_equal(x.params, y.params)
    # a corpus written again at the same place is another corpus: refused
    shutil.rmtree(second)
    synthesize(str(second), hours=0.15, speakers=20, shards=4, seed=8, dev_hours=0.03,
               dev_speakers=4)
    assert main(_argv("pretrain", cut, str(second), extra) + ["--resume"]) == 2
    assert "data.train: the corpus was written again since the checkpoint" \
        in capsys.readouterr().err


def test_a_stack_moved_with_its_runs_is_the_same_init_from_on_resume(small_corpus, tmp_path,
                                                                     capsys):
    """An experiment directory (pretraining and training runs) moved to other storage:
    model.init_from names the same stack at its new place, and the resume was refused
    as a changed model.init_from unless --accept-changes."""
    from mpitrain.nn.rbm_file import save_rbm_stack
    first, second = tmp_path / "scratch1" / "exp", tmp_path / "scratch2" / "exp"
    assert main(_argv("pretrain", first / "pre", small_corpus)) == 0

    def train(exp, steps, flags=()):
        return main(_argv("train", exp / "run", small_corpus, [
            "model.nonlinearity=sigmoid", f"model.init_from={exp / 'pre' / 'pretrain.h5'}",
            f"training.max_steps={steps}", "training.checkpoint_interval=10"]) + list(flags))
    assert train(first, 10) == 0
    shutil.move(str(first), str(second))
    capsys.readouterr()
    assert train(second, 20, ["--resume"]) == 0
    out = capsys.readouterr().out
    assert ("resume: model.init_from: the RBM stack this run started from (the same "
            f"checksum), moved from {first / 'pre' / 'pretrain.h5'} to "
            f"{second / 'pre' / 'pretrain.h5'}") in out, out
    # another stack at that place is another setting
    stack = load_rbm_stack(str(second / "pre" / "pretrain.h5"))
    stack.rbms[0].block[0, 0] += 1.0
    save_rbm_stack(str(second / "pre" / "pretrain.h5"), stack)
    shutil.move(str(second), str(first))
    assert train(first, 30, ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume with settings that change the result: model.init_from: " in err, err


def test_a_pretraining_dry_run_plans_and_writes_nothing(small_corpus, tmp_path, capsys):
    assert main(_argv("pretrain", tmp_path / "run", small_corpus) + ["--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mpitrain pretrain: 1 rank(s), 2 RBMs 440-32-32; "), out
    assert out[-1].startswith("dry run: ") and not (tmp_path / "run").exists()


def test_a_resumed_layer_judges_divergence_against_the_layers_first_window(
        small_corpus, tmp_path, capsys):
    """A resume inside a layer took its own first window as the yardstick: a layer
    whose error crept up (a factor of 1.02, a rate that learns nothing) stopped at
    step 160 against a window of 0.2079, where the run that never stopped went on to
    step 220 against the layer's first window, 0.2089."""
    run = tmp_path / "run"
    extra = ["pretrain.learning_rate=1e-30", "pretrain.divergence_factor=1.02",
             "pretrain.epochs_per_layer=1", "training.log_interval=20",
             "training.checkpoint_interval=60", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 2
    straight = capsys.readouterr().err.strip().splitlines()[-1]
    assert "layer 2 (Bernoulli-Bernoulli) diverged at step 220" in straight, straight
    # back to layer 2's step 60 (its first window judged at step 20)
    for name in os.listdir(run):
        if name.startswith("ckpt-") and name > "ckpt-00000195.h5":
            os.remove(run / name)
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == straight


def test_a_layer_saturated_by_a_large_rate_stops_as_diverged(small_corpus, tmp_path, capsys):
    """At 50 times the default rate a Bernoulli layer saturated: each hidden unit
    gave one probability on every frame, its error looked like any other layer's,
    and the run ended `done` with a stack a network could not learn from."""
    run = tmp_path / "run"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    code = main(_argv("pretrain", run, small_corpus, extra + ["pretrain.learning_rate=50"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "pretrain: layer 2 (Bernoulli-Bernoulli) diverged at step 40: each of its 32 " \
           "hidden units gives the same probability on every frame (standard deviation at " \
           "most " in err, err
    assert err.endswith("so the stack would pass nothing on; lower pretrain.learning_rate "
                        "(now 50)"), err
    assert not (run / "pretrain.h5").exists()
    # no checkpoint holds the saturated layer: at a lower rate the run goes on from
    # the one before and learns (it went on from the stuck one and was stopped again,
    # told to lower the default rate)
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume",
                                                               "--accept-changes"]) == 0
    errors = [r["recon_mse"] for r in _records(run, "layer")]
    assert errors[-1] < 0.1, errors


def test_a_diverging_gaussian_layer_stops_naming_its_rate(small_corpus, tmp_path, capsys):
    code = main(_argv("pretrain", tmp_path / "run", small_corpus,
                      ["pretrain.learning_rate_gaussian=50", "pretrain.momentum_initial=0.9"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "layer 1 (Gaussian-Bernoulli) diverged" in err
    assert "lower pretrain.learning_rate_gaussian" in err
    assert not (tmp_path / "run" / "pretrain.h5").exists()


def test_status_of_a_diverged_pretraining_says_it_failed(small_corpus, tmp_path, capsys):
    """Without an error record `status` said the run was cut off (a lost node) and
    that --resume continued it, as if it had not stopped on its own."""
    from mpitrain.train.status import run_status
    run = tmp_path / "run"
    code = main(_argv("pretrain", run, small_corpus, ["pretrain.learning_rate=1e8"]))
    assert code == 2 and "layer 2 (Bernoulli-Bernoulli) diverged" in capsys.readouterr().err
    first = run_status(run)[0]
    assert first.startswith(f"{run}: failed at layer 2, step "), first
    assert "lower pretrain.learning_rate (now 1e+08)" in first, first


@pytest.mark.parametrize("setting,named", [
    ("pretrain.learning_rate_gaussian=10", "lower pretrain.learning_rate_gaussian (now 10)"),
    ("pretrain.weight_decay=300", "or pretrain.weight_decay (now 300)"),
])
def test_divergence_between_log_lines_is_said_at_the_checkpoint(small_corpus, tmp_path, capsys,
                                                               setting, named):
    """With checkpoints closer together than log lines, a diverged RBM reached the
    checkpoint first, which refused to store NaN: the error named a dataset of the
    file, not the divergence or the setting to lower."""
    code = main(_argv("pretrain", tmp_path / "run", small_corpus,
                      [setting, "training.log_interval=1000", "training.checkpoint_interval=4"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ") diverged at step " in err and named in err, err
    assert not list((tmp_path / "run").glob(".ckpt-*"))


def test_a_stack_that_does_not_fit_the_model_is_one_line_naming_the_key(
        small_corpus, tmp_path, capsys):
    pre = tmp_path / "pre"
    assert main(_argv("pretrain", pre, small_corpus, ["pretrain.epochs_gaussian=0.02",
                                                      "pretrain.epochs_per_layer=0.02"])) == 0
    capsys.readouterr()
    code = main(_argv("train", tmp_path / "run", small_corpus, [
        "model.nonlinearity=sigmoid", "model.hidden_dim=48",
        f"model.init_from={pre / 'pretrain.h5'}"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.init_from" in err and "model.hidden_dim" in err
    code = main(_argv("train", tmp_path / "run2", small_corpus, [
        "model.nonlinearity=sigmoid", f"model.init_from={tmp_path / 'missing.h5'}"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.init_from" in err and "not found" in err
    code = main(_argv("train", tmp_path / "run3", small_corpus, [
        "model.nonlinearity=sigmoid", f"model.init_from={pre}"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith("is a directory; name the RBM stack file in it (the pretraining run's "
                        "pretrain.h5)"), err


def test_a_damaged_newest_checkpoint_is_skipped_on_resume(small_corpus, tmp_path):
    run = tmp_path / "run"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 0
    os.remove(run / "pretrain.h5")
    newest = sorted(p for p in os.listdir(run) if p.startswith("ckpt-"))[-1]
    with h5py.File(run / newest, "r+") as f:
        f["stack/layer_000"][0] += 1.0
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume"]) == 0
    assert (run / "pretrain.h5").exists()


def test_pretrain_resume_without_a_checkpoint_names_the_way_to_start(small_corpus, tmp_path,
                                                                    capsys):
    # a pretraining stopped before its first checkpoint leaves config.yaml and
    # metrics.jsonl, which a start without --resume refuses ("continue it with
    # --resume"); --resume said no checkpoint "verifies", with none there
    run = tmp_path / "run"
    run.mkdir()
    resume_without_a_checkpoint_is_advised(
        main, _argv("pretrain", run, small_corpus) + ["--resume"], run, capsys,
        "no pretraining checkpoint (ckpt-*.h5) to continue from; start the run without "
        "--resume")


@pytest.mark.mpi
def test_averaged_cd1_on_two_ranks_stays_in_sync_and_matches_one_rank(mpiexec):
    result = run_mpi(2, [str(WORKERS / "rbm_worker.py"), "2"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for check in ("same_data_equals_one_rank", "k1_equals_stacked_minibatch",
                  "in_sync_after_finalize"):
        assert f"ok {check}" in result.stdout


@pytest.mark.mpi
def test_pretrain_command_on_two_ranks(mpiexec, small_corpus, tmp_path):
    run = tmp_path / "run"
    args = ["-m", "mpitrain"] + _argv("pretrain", run, small_corpus)
    result = run_mpi(2, args, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(load_rbm_stack(str(run / "pretrain.h5")).rbms) == 2
    assert _records(run, "start")[0]["ranks"] == 2


def test_pretraining_takes_the_precision_setting_as_train_does(small_corpus, tmp_path, capsys):
    code = main(_argv("pretrain", tmp_path / "pre", small_corpus, ["precision=tf32"]))
    err = capsys.readouterr().err
    assert code == 2 and "precision: tf32 needs device: gpu" in err, err


def test_pretraining_refuses_a_directory_in_use(small_corpus, tmp_path, capsys):
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "pre"
    run.mkdir()
    holder = RunDirLock(str(run))
    assert holder.acquire() is None
    try:
        assert main(_argv("pretrain", run, small_corpus)) == 2
        assert "another run is using this directory" in capsys.readouterr().err
    finally:
        holder.release()


def test_accept_changes_on_a_new_pretraining_says_there_is_nothing_to_compare(
        small_corpus, tmp_path, capsys):
    # (as train: dropped without a word before)
    from mpitrain.train.run_dir import ACCEPT_CHANGES_NEW_RUN
    run = tmp_path / "pre"
    for flags in (["--dry-run"], []):
        assert main(_argv("pretrain", run, small_corpus) + ["--accept-changes"] + flags) == 0
        assert capsys.readouterr().out.count(ACCEPT_CHANGES_NEW_RUN) == 1, flags


def test_a_resume_with_changed_settings_into_a_directory_in_use_says_it_is_in_use(
        small_corpus, tmp_path, capsys):
    # (it was refused for the settings first, and for the lock once they were accepted)
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "pre"
    assert main(_argv("pretrain", run, small_corpus)) == 0
    holder = RunDirLock(str(run))
    assert holder.acquire() is None
    capsys.readouterr()
    try:
        assert main(_argv("pretrain", run, small_corpus, ["pretrain.learning_rate=0.5"])
                    + ["--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{run}: another run is using this directory " \
            f"(pid {os.getpid()} on " in err, err
    finally:
        holder.release()


def test_a_checkpoint_written_after_the_resume_chose_its_own_is_not_trained_past(
        small_corpus, tmp_path, monkeypatch, capsys):
    # the checkpoint is chosen before the lock is this job's: a job still pretraining
    # there could write newer ones meanwhile, which the resume pretrained past again
    # from the older one and rotated away (as train's resume did; it refuses)
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "pre"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 0
    names = sorted(p for p in os.listdir(run) if p.startswith("ckpt-"))
    newer = {name: (run / name).read_bytes() for name in names if name > "ckpt-00000040.h5"}
    for name in newer:
        os.remove(run / name)
    os.remove(run / "pretrain.h5")
    # (a directory without .lock: one with it is locked before the checkpoint is chosen)
    os.remove(run / ".lock")
    real = RunDirLock.acquire

    def the_other_job_wrote_meanwhile(self):
        for name, data in newer.items():
            (run / name).write_bytes(data)
        return real(self)

    monkeypatch.setattr(RunDirLock, "acquire", the_other_job_wrote_meanwhile)
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written by another job after this one chose" in err[0], err
    assert all((run / name).read_bytes() == data for name, data in newer.items())


@pytest.mark.mpi
def test_a_directory_in_use_is_one_line_from_rank_0_on_two_ranks(mpiexec, small_corpus,
                                                                 tmp_path):
    """Rank 0 alone found the lock taken: it printed 'rank 0: error' and aborted the
    job (MPI's abort line after it) while the other rank went on to train."""
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "pre"
    run.mkdir()
    holder = RunDirLock(str(run))
    assert holder.acquire() is None
    try:
        result = run_mpi(2, ["-m", "mpitrain"] + _argv("pretrain", run, small_corpus),
                         timeout=180)
    finally:
        holder.release()
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("mpitrain pretrain: error: ") and "another run is using" in err, err


def test_a_run_directory_moved_away_stops_pretraining(small_corpus, tmp_path, monkeypatch,
                                                       capsys):
    # the next checkpoint made a new directory of the old name, without the config,
    # the log and the lock
    from mpitrain.train import pretrain as pretrain_module
    run = tmp_path / "run"
    real = pretrain_module.Pretrainer._train_layer

    def train_then_move(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if run.exists():
            run.rename(tmp_path / "moved")
        return result

    monkeypatch.setattr(pretrain_module.Pretrainer, "_train_layer", train_then_move)
    assert main(_argv("pretrain", run, small_corpus)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mpitrain pretrain: error: {run}: the run "
                                               "directory (or its .lock) was removed"), err
    assert not run.exists() and (tmp_path / "moved" / "config.yaml").exists()


def test_train_resume_in_a_pretraining_directory_points_to_its_stack(small_corpus, tmp_path,
                                                                     capsys):
    # (each checkpoint was listed as "not an mpitrain checkpoint", with no word of what
    # the directory holds)
    pre = tmp_path / "pre"
    assert main(_argv("pretrain", pre, small_corpus, ["training.checkpoint_interval=40"])) == 0
    assert any(name.startswith("ckpt-") for name in os.listdir(pre))
    capsys.readouterr()
    assert main(_argv("train", pre, small_corpus) + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a pretraining run's directory" in err, err
    assert f"--set model.init_from={pre}/pretrain.h5" in err, err


def test_pretrain_resume_in_a_train_run_directory_says_what_it_holds(small_corpus, tmp_path,
                                                                     capsys):
    # (each of the model's checkpoints was listed as "not an mpitrain pretraining
    # checkpoint", with no word of what the directory holds)
    run = tmp_path / "run"
    assert main(_argv("train", run, small_corpus, ["training.max_steps=20",
                                                   "training.checkpoint_interval=10"])) == 0
    before = sorted(os.listdir(run))
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus) + ["--resume"]) == 2
    assert capsys.readouterr().err == (f"mpitrain pretrain: error: {run}: a train run's "
                                       "directory (its checkpoints are a model's); pretrain "
                                       "in a run directory of its own\n")
    assert sorted(os.listdir(run)) == before


def test_a_gaussian_layer_exploded_in_its_first_window_stops_there(small_corpus, tmp_path,
                                                                   capsys):
    """The first window was the yardstick even when it had exploded already (10^10
    here at rate 0.5 before the guard, 279 at rate 5 with it): the run went on until
    a later window grew tenfold beyond it."""
    code = main(_argv("pretrain", tmp_path / "run", small_corpus,
                      ["pretrain.learning_rate_gaussian=5", "training.log_interval=20"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "layer 1 (Gaussian-Bernoulli) diverged at step 20: " in err, err
    assert "; the features' variance is 1)" in err, err


def test_a_wide_gaussian_layer_is_judged_against_its_untrained_error(small_corpus, tmp_path,
                                                                      capsys):
    """4,096 hidden units reconstruct, as initialised, with an error of about 75 (they
    sum that many random weights): the yardstick was capped at 1, the features'
    variance, so the first window stopped the layer as exploded at any rate, 1e-6
    included, telling to lower it.  (The guard scales such a layer down on its
    first minibatch: a first window of one minibatch of 1,000 frames shows it.)"""
    wide = ["model.hidden_layers=1", "model.hidden_dim=4096", "data.left_context=0",
            "data.right_context=0", "pretrain.epochs_gaussian=0.05",
            "training.log_interval=10", "data.dev="]
    code = main(_argv("pretrain", tmp_path / "slow", small_corpus, wide + [
        "pretrain.learning_rate_gaussian=1e-6", "pretrain.minibatch=1000",
        "pretrain.average_every_frames=1000", "pretrain.epochs_gaussian=0.1",
        "training.log_interval=1"]))
    assert code == 0, capsys.readouterr().err
    errors = [r["recon_mse"] for r in _records(tmp_path / "slow", "pretrain")]
    assert errors[0] > 10, errors          # above what the old yardstick allowed
    # a rate that does explode (the guard notwithstanding) is still stopped at its
    # first window
    code = main(_argv("pretrain", tmp_path / "fast", small_corpus,
                      wide + ["pretrain.learning_rate_gaussian=1"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "layer 1 (Gaussian-Bernoulli) diverged at step 10: " in err, err
    assert "; the features' variance is 1, the untrained layer's error " in err, err


def test_windows_of_a_few_frames_are_judged_pooled(small_corpus, tmp_path, capsys):
    """With minibatch 1 and log_interval 1 one frame was the yardstick, and a frame
    of twenty times its error stopped a healthy layer at step 36 as diverged."""
    code = main(_argv("pretrain", tmp_path / "run", small_corpus, [
        "model.hidden_layers=1", "model.hidden_dim=1", "pretrain.minibatch=1",
        "training.log_interval=1", "pretrain.epochs_gaussian=0.05", "data.dev=",
        "data.left_context=0", "data.right_context=0", "training.seed=2"]))
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "pretrain.h5").exists()


def test_a_small_divergence_factor_is_named_when_it_stops_the_run(small_corpus, tmp_path,
                                                                   capsys):
    """A factor of 1 stopped a layer whose error had not moved, telling only to lower
    a rate of 1e-30."""
    code = main(_argv("pretrain", tmp_path / "run", small_corpus, [
        "pretrain.divergence_factor=1", "pretrain.learning_rate_gaussian=1e-30"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "lower pretrain.learning_rate_gaussian (now 1e-30); or raise " \
           "pretrain.divergence_factor (1: a window above that many times the first counts " \
           "as exploding)" in err, err
    # a large factor is not named
    code = main(_argv("pretrain", tmp_path / "big", small_corpus, [
        "pretrain.learning_rate_gaussian=50", "pretrain.momentum_initial=0.9"]))
    err = capsys.readouterr().err
    assert code == 2 and "diverged" in err and "divergence_factor" not in err, err


def test_the_divergence_factors_help_names_the_gaussian_layers_yardstick():
    # the reference table said "times the layer's first window's" alone, where the
    # Gaussian layer's yardstick is that window or 1, whichever is less
    import dataclasses
    from mpitrain.config import PretrainConfig
    (field,) = [f for f in dataclasses.fields(PretrainConfig) if f.name == "divergence_factor"]
    assert "the Gaussian layer's at most 1" in field.metadata["help"]


@pytest.mark.parametrize("craft,named", [
    ("momentum", "'ranks/00000/momentum/delta' has shape () and dtype float32; expected "),
    ("reader", "field 'ranks/00000/reader/epoch': expected a non-negative int, got -1"),
    ("position", "field 'ranks/00000/reader/steps_in_epoch' is missing"),
    ("config", "the stored config: config: expected a mapping, got 1"),
    ("config_text", ".h5: the stored config: not valid YAML at line 1"),
    ("judging", "checkpoint attributes 'window_first', 'pool_error', 'pool_frames': "
                "expected an error >= 0, a finite sum >= 0 and frames in [0, 1000), "
                "got -1.0, "),
    ("rate_factor", "'ranks/00000/momentum/rate_factor' is 1.5; expected a number in (0, 1]"),
    # (each was taken: a float64 of 1e300 is infinite in the float32 layer or momentum,
    # and a layer or step past the stack's or the plan's)
    ("momentum_huge", "field 'ranks/00000/momentum/delta': expected finite floats in "
                      "[-3.40282e+38, 3.40282e+38]"),
    ("stack_huge", "dataset 'layer_000' holds 1e+300 at index 0; expected finite floats "
                   "within float32's range"),
    ("layer", "checkpoint attribute 'layer' is 7, but the stack holds"),
    ("layer_step", "checkpoint attribute 'layer_step' is 100001, past the layer's"),
])
def test_a_crafted_pretraining_checkpoint_is_one_line_naming_file_and_field(
        small_corpus, tmp_path, capsys, craft, named):
    """A checkpoint whose checksum holds but whose rank state or config does not fit:
    the lines named neither file nor field ('momentum buffer has shape ()', 'config:
    expected a mapping'), and the first came after config.yaml was written."""
    from mpitrain.h5io import write_checksums
    run = tmp_path / "run"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 0
    names = sorted(p for p in os.listdir(run) if p.startswith("ckpt-"))
    for name in names[1:] + ["pretrain.h5"]:
        os.remove(run / name)
    path = run / names[0]
    with h5py.File(path, "r+") as f:
        assert f.attrs["layer_step"] > 0 and "momentum" in f["ranks/00000"]
        if craft == "momentum":
            del f["ranks/00000/momentum/delta"]
            f["ranks/00000/momentum/delta"] = np.float32(1.0)
        elif craft == "reader":
            f["ranks/00000/reader"].attrs["epoch"] = -1
        elif craft == "position":
            del f["ranks/00000/reader"].attrs["steps_in_epoch"]
        elif craft == "judging":
            f.attrs["window_first"] = -1.0
        elif craft == "rate_factor":
            f["ranks/00000/momentum"].attrs["rate_factor"] = 1.5
        elif craft in ("momentum_huge", "stack_huge"):
            name = "ranks/00000/momentum/delta" if craft == "momentum_huge" \
                else "stack/layer_000"
            huge = np.full(f[name].shape, 1e300)
            del f[name]
            f[name] = huge
        elif craft in ("layer", "layer_step"):
            f.attrs[craft] = 7 if craft == "layer" else 100001
        elif craft == "config_text":
            f.attrs["config"] = "training: [1"
        else:
            f.attrs["config"] = "1"
        del f.attrs["checksum"]
        write_checksums(f, str(path), what="checkpoint")
    config = (run / "config.yaml").read_bytes()
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, extra) + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and named in err, err
    assert (run / "config.yaml").read_bytes() == config


def test_momentum_averaging_changed_on_resume_is_judged_with_any_parallel_method(
        small_corpus, tmp_path, capsys):
    """Pretraining averages as model_averaging does whatever parallel.method says,
    so parallel.average_momentum changes its result with a config written for
    another method too (such a change was taken on --resume without a word)."""
    run = tmp_path / "run"
    extra = ["training.checkpoint_interval=40", "training.keep_checkpoints=100",
             "parallel.method=allreduce"]
    assert main(_argv("pretrain", run, small_corpus, extra)) == 0
    os.remove(run / "pretrain.h5")
    capsys.readouterr()
    code = main(_argv("pretrain", run, small_corpus, extra + ["parallel.average_momentum=true"])
                + ["--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "parallel.average_momentum: False -> True" in err, err


def test_a_re_planned_pretraining_given_more_epochs_keeps_the_data_done(small_corpus,
                                                                        tmp_path, capsys):
    """pretrain --resume --accept-changes that re-plans the data and lengthens the
    layer: the passes over the data already made count as done, not the same
    fraction of the longer layer (which skipped data never trained on)."""
    run, extra = _cut_at_40(small_corpus, tmp_path)     # 40 of 135 steps of 100 frames
    with h5py.File(run / "ckpt-00000040.h5", "r") as f:
        done = int(f.attrs["frames_seen"])
    capsys.readouterr()
    assert main(_argv("pretrain", run, small_corpus, extra + [
        "pretrain.minibatch=50", "pretrain.epochs_gaussian=0.5"])
        + ["--resume", "--accept-changes"]) == 0, capsys.readouterr().err
    # 40 steps of 100 frames done are about 80 of 50 frames (the same fraction of the
    # longer layer said about 160): the layer trains the rest of its steps from there
    steps = max(r["step"] for r in _records(run, "pretrain") if r["layer"] == 1)
    layer, = [r for r in _records(run, "layer") if r["layer"] == 1][-1:]
    assert layer["frames"] == done + (steps - round(40 * 0.5 * steps / 135)) * 50, \
        (layer, done, steps)


GUARDED = ["model.hidden_layers=1", "model.hidden_dim=2048", "data.dev=",
           "pretrain.epochs_gaussian=0.3", "training.log_interval=10"]


def test_the_recipes_wide_gaussian_layer_is_guarded_against_explosion(small_corpus, tmp_path,
                                                                      capsys):
    """2,048 units at rate 0.01 (the recipe's): the reconstruction of the untrained
    layer is several times as spread as the features, and without Kaldi's guard
    the first window exploded to 10^9 and stopped the run.  The guard scales it
    down, cuts the rate by 0.9 and says so in that window's line and record."""
    run = tmp_path / "run"
    code = main(_argv("pretrain", run, small_corpus, GUARDED))
    out, err = capsys.readouterr()
    assert code == 0, err
    records = _records(run, "pretrain")
    errors = [r["recon_mse"] for r in records]
    fired = [r["guard_fired"] for r in records]
    assert fired[0] >= 1 and errors[-1] < 0.5 * errors[0] and max(errors[1:]) < 1, records
    assert records[-1]["lr_factor"] == pytest.approx(0.9 ** sum(fired))
    assert records[-1]["lr"] == pytest.approx(0.01 * 0.5 * 0.9 ** sum(fired))
    lines = [line for line in out.splitlines() if "scaled down" in line]
    assert len(lines) == sum(1 for n in fired if n), out
    assert f"scaled down {fired[0]}x (reconstruction over twice the data's spread)" in lines[0]


def test_the_rate_is_set_afresh_at_each_step_of_the_momentum_ramp(small_corpus, tmp_path,
                                                                  monkeypatch):
    """As Kaldi sets the rate (with the momentum) anew every momentum_ramp_frames / 40
    frames per rank, past the ramp's end too: here every 500 frames, 5 minibatches;
    without a ramp, never."""
    from mpitrain.nn.rbm import ContrastiveDivergence
    resets = []
    monkeypatch.setattr(ContrastiveDivergence, "reset_rate_factor",
                        lambda cd: resets.append(cd.rbm.visible))
    run = tmp_path / "run"
    assert main(_argv("pretrain", run, small_corpus, [
        "pretrain.momentum_ramp_frames=20000", "pretrain.epochs_gaussian=1"])) == 0
    steps = _records(run, "start")[0]["layer_steps"]
    assert steps[0] > 205          # past the ramp's 40 steps of 5 minibatches
    assert resets == ["gaussian"] * ((steps[0] - 1) // 5) + ["bernoulli"] * ((steps[1] - 1) // 5)
    resets.clear()
    assert main(_argv("pretrain", tmp_path / "flat", small_corpus, [
        "pretrain.momentum_ramp_frames=0"])) == 0
    assert resets == []


def test_pretraining_resumes_bit_exactly_with_the_guards_rate_factor(small_corpus, tmp_path):
    """Each rank's cut of the rate is in the checkpoint: a resume from it goes on
    at the cut rate, as the run that never stopped; a checkpoint written before
    the guard (no rate_factor) resumes at the full rate."""
    from mpitrain.h5io import write_checksums
    extra = GUARDED + ["pretrain.epochs_gaussian=0.15", "training.checkpoint_interval=20",
                       "training.keep_checkpoints=100", "pretrain.average_every_frames=1000"]
    whole = tmp_path / "whole"
    assert main(_argv("pretrain", whole, small_corpus, extra)) == 0
    with h5py.File(whole / "ckpt-00000020.h5", "r") as f:
        assert f["ranks/00000/momentum"].attrs["rate_factor"] < 1
    cuts = {}
    for name in ("cut", "old"):
        cut = cuts[name] = tmp_path / name
        shutil.copytree(whole, cut)
        os.remove(cut / "pretrain.h5")
        for ckpt in os.listdir(cut):
            if ckpt.startswith("ckpt-") and ckpt > "ckpt-00000020.h5":
                os.remove(cut / ckpt)
        if name == "old":
            path = cut / "ckpt-00000020.h5"
            with h5py.File(path, "r+") as f:
                del f["ranks/00000/momentum"].attrs["rate_factor"]
                del f.attrs["checksum"]
                write_checksums(f, str(path), what="checkpoint")
        assert main(_argv("pretrain", cut, small_corpus, extra) + ["--resume"]) == 0
    a = load_rbm_stack(str(whole / "pretrain.h5"))
    b = load_rbm_stack(str(cuts["cut"] / "pretrain.h5"))
    np.testing.assert_array_equal(a.rbms[0].params, b.rbms[0].params)
    with open(cuts["old"] / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    starts = [i for i, r in enumerate(records) if r["type"] == "start"]
    resumed = [r for r in records[starts[-1]:] if r["type"] == "pretrain"]
    assert resumed[0]["step"] == 30 and resumed[0]["lr_factor"] == 1.0, resumed


@pytest.mark.mpi
def test_each_rank_keeps_its_guards_rate_factor_and_resumes_bit_exactly(mpiexec, small_corpus,
                                                                      tmp_path):
    """On two ranks each rank's cut of the rate is its own state in the checkpoint,
    and a resume on two ranks gives the stack of the run that never stopped."""
    extra = GUARDED + ["pretrain.epochs_gaussian=0.3", "training.checkpoint_interval=20",
                       "training.keep_checkpoints=100", "pretrain.average_every_frames=1000"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run, more in ((whole, []), (cut, ["--resume"])):
        if run == cut:
            shutil.copytree(whole, cut)
            for name in os.listdir(cut):
                if name == "pretrain.h5" or name.startswith("ckpt-") \
                        and name > "ckpt-00000020.h5":
                    os.remove(cut / name)
        result = run_mpi(2, ["-m", "mpitrain"] + _argv("pretrain", run, small_corpus, extra)
                         + more, timeout=180)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with h5py.File(whole / "ckpt-00000020.h5", "r") as f:
        factors = [f[f"ranks/{r:05d}/momentum"].attrs["rate_factor"] for r in range(2)]
    assert all(0 < x < 1 for x in factors), factors
    a, b = (load_rbm_stack(str(run / "pretrain.h5")) for run in (whole, cut))
    np.testing.assert_array_equal(a.rbms[0].params, b.rbms[0].params)


def test_each_layers_last_checkpoint_is_kept_out_of_the_rotation(small_corpus, tmp_path):
    """training.keep_checkpoints counts the checkpoints inside layers: the one at
    each layer's end stays (model.init_from takes it: the stack up to that layer)
    where it was removed two checkpoints later."""
    run = tmp_path / "run"
    assert main(_argv("pretrain", run, small_corpus, [
        "training.checkpoint_interval=40", "training.keep_checkpoints=2"])) == 0
    steps = _records(run, "start")[0]["layer_steps"]
    ends = [f"ckpt-{steps[0]:08d}.h5", f"ckpt-{sum(steps):08d}.h5"]
    names = sorted(p for p in os.listdir(run) if p.startswith("ckpt-"))
    assert len(names) == 3 and names[0] == ends[0] and names[-1] == ends[1], names
    assert names[1] > ends[0]                  # the newest inside the last layer
    stack = load_rbm_stack(str(run / ends[0]))
    assert len(stack.rbms) == 1


def test_pretraining_on_the_standin_device_reads_at_log_lines_and_matches_the_cpu(
        small_corpus, tmp_path):
    """`pretrain` with ``device: gpu`` on the stand-in (mpitrain/testing/standin_cupy.py):
    the CD-1 loop reads the device once per log line (its error, the guard's
    catches and rate factor in one read), and the stack is the CPU run's bit for
    bit (the same arithmetic, the uniforms drawn on the host)."""
    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    from mpitrain.train.pretrain import Pretrainer
    extra = ["training.checkpoint_interval=0", "training.log_interval=10"]
    assert main(_argv("pretrain", tmp_path / "cpu", small_corpus, extra)) == 0
    reads = []
    original = Pretrainer._train_layer

    def counted(self, started):
        before = backend.host_read_counts()["blocking"] + standin_cupy.READS["implicit"]
        try:
            return original(self, started)
        finally:
            reads.append(backend.host_read_counts()["blocking"]
                         + standin_cupy.READS["implicit"] - before)

    Pretrainer._train_layer = counted
    try:
        with standin_cupy.installed():
            assert main(_argv("pretrain", tmp_path / "gpu", small_corpus,
                              extra + ["device=gpu"])) == 0
    finally:
        Pretrainer._train_layer = original
    windows = [r["layer"] for r in _records(tmp_path / "gpu", "pretrain")]
    assert reads == [windows.count(1), windows.count(2)] and min(reads) > 1, (reads, windows)
    a = load_rbm_stack(str(tmp_path / "cpu" / "pretrain.h5"))
    b = load_rbm_stack(str(tmp_path / "gpu" / "pretrain.h5"))
    for x, y in zip(a.rbms, b.rbms):
        np.testing.assert_array_equal(x.params, y.params)


def test_a_signal_between_log_lines_says_a_diverged_layer_as_such(small_corpus, tmp_path,
                                                                  capsys, monkeypatch):
    """A stop signal inside a layer whose RBM had diverged since the last log line
    wrote its checkpoint unjudged, which refused to store NaN: the one line named a
    dataset of the file, not the divergence or the rate to lower."""
    import signal

    from mpitrain.train.pretrain import Pretrainer
    from mpitrain.train.stop import requested
    splice = Pretrainer._splice

    def signalled_in_layer_2(self, *args):
        if self.layer == 1 and self.layer_step == 30:
            requested(signal.SIGTERM)
        return splice(self, *args)

    monkeypatch.setattr(Pretrainer, "_splice", signalled_in_layer_2)
    run = tmp_path / "run"
    code = main(_argv("pretrain", run, small_corpus,
                      ["pretrain.learning_rate=1e30", "training.log_interval=1000",
                       "training.checkpoint_interval=0"]))
    requested.clear()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith("layer 2 (Bernoulli-Bernoulli) diverged at step 31: reconstruction "
                        "error is not finite; lower pretrain.learning_rate (now 1e+30)"), err
    # (only the first layer's end is checkpointed, and nothing is left half-written)
    assert sorted(p.name for p in run.glob("*ckpt-*")) == ["ckpt-00000135.h5"]
