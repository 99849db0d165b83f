"""Keeping the best held-out model and early stopping (train/selection.py, the trainer,
eval/export/convert on a run directory)."""

import math
import os

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.config import ConfigError, load_config
from mpitrain.h5io import open_h5_for_reading
from mpitrain.nn.model_file import load_model
from mpitrain.nn.model_file import model_in_run_dir
from mpitrain.train.selection import ModelSelection

from ..helpers import QUICKSTART, records, train_in_process, train_straight_and_resumed

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.minibatch=128"]


# ------------------------------------------------------------------ the rule

@pytest.mark.parametrize("select_by, figures, best_steps", [
    ("acc", [0.5, 0.6, 0.55, 0.7], [0, 1, 1, 3]),
    ("xent", [2.0, 1.5, 1.7, 1.4], [0, 1, 1, 3]),
])
def test_the_best_is_the_highest_accuracy_or_lowest_xent(select_by, figures, best_steps):
    selection = ModelSelection(select_by=select_by)
    key = "dev_acc" if select_by == "acc" else "dev_xent"
    for step, (value, best) in enumerate(zip(figures, best_steps)):
        verdict = selection.observe({key: value}, step=step)
        assert verdict.improved == (best == step)
        assert selection.best_step == best and not verdict.stop


def test_patience_counts_evaluations_without_a_gain_of_min_delta():
    selection = ModelSelection(select_by="acc", patience=2, min_delta=0.01)
    verdicts = [selection.observe({"dev_acc": a}, step=i)
                for i, a in enumerate([0.50, 0.505, 0.508, 0.52, 0.521, 0.522])]
    # 0.505 and 0.508 are new bests but not gains over 0.50 of more than 0.01
    assert [v.improved for v in verdicts] == [True, True, True, True, True, True]
    assert [v.since_gain for v in verdicts] == [0, 1, 2, 0, 1, 2]
    assert [v.stop for v in verdicts] == [False, False, True, False, False, True]
    assert ModelSelection(patience=0).observe({"dev_acc": 0.1}, step=0).stop is False


def test_a_non_finite_figure_is_never_the_best():
    selection = ModelSelection(select_by="xent", patience=1)
    selection.observe({"dev_xent": 1.0}, step=1)
    verdict = selection.observe({"dev_xent": math.nan}, step=2)
    assert not verdict.improved and verdict.stop and selection.best_step == 1
    # selecting by accuracy: a finite accuracy beside a NaN loss (a held-out set that
    # overflows the model) is not the best either (best.h5 refuses NaN attributes)
    by_acc = ModelSelection(select_by="acc")
    by_acc.observe({"dev_acc": 0.1, "dev_xent": 4.0}, step=1)
    assert not by_acc.observe({"dev_acc": 0.5, "dev_xent": math.nan}, step=2).improved
    assert by_acc.best_step == 1


def test_state_round_trips_with_finite_numbers_only():
    fresh = ModelSelection(select_by="acc", patience=3)
    assert all(math.isfinite(v) for v in fresh.state_dict().values())
    restored = ModelSelection(select_by="acc", patience=3)
    restored.load_state_dict(fresh.state_dict())
    assert restored.observe({"dev_acc": 0.1}, step=5).improved
    restored.observe({"dev_acc": 0.05}, step=6)
    again = ModelSelection(select_by="acc", patience=3)
    again.load_state_dict(restored.state_dict())
    assert (again.best_value, again.best_step, again.since_gain) == (0.1, 5, 1)


def test_figures_over_another_number_of_held_out_frames_start_the_selection_afresh():
    selection = ModelSelection(select_by="acc", patience=2)
    selection.observe({"dev_acc": 0.9, "dev_frames": 1000}, step=1)     # a small subset
    restored = ModelSelection(select_by="acc", patience=2)
    restored.load_state_dict(selection.state_dict())
    # the whole held-out set: 0.6 is not worse than 0.9 over other frames
    verdict = restored.observe({"dev_acc": 0.6, "dev_frames": 5000}, step=2)
    assert verdict.improved and verdict.restarted_from_frames == 1000
    assert (restored.best_step, restored.since_gain) == (2, 0)
    assert not restored.observe({"dev_acc": 0.6, "dev_frames": 5000}, step=3)\
        .restarted_from_frames


def test_figures_over_another_held_out_set_of_as_many_frames_start_afresh():
    # data.dev naming another corpus (or its corpus written again) under
    # training.eval_max_frames: as many frames, so the figures were compared
    selection = ModelSelection(select_by="acc", held_out_set=11)
    selection.observe({"dev_acc": 0.9, "dev_frames": 2000}, step=1)
    same = ModelSelection(select_by="acc", held_out_set=11)
    same.load_state_dict(selection.state_dict())
    assert not same.observe({"dev_acc": 0.6, "dev_frames": 2000}, step=2).improved
    other = ModelSelection(select_by="acc", held_out_set=12)
    other.load_state_dict(selection.state_dict())
    verdict = other.observe({"dev_acc": 0.6, "dev_frames": 2000}, step=2)
    assert verdict.improved and verdict.other_set and verdict.restarted_from_frames == 2000
    assert not other.observe({"dev_acc": 0.5, "dev_frames": 2000}, step=3).restarted_from_frames
    # a checkpoint from before the set was stored: compared by frames alone
    old = {k: v for k, v in selection.state_dict().items() if k != "held_out_set"}
    other = ModelSelection(select_by="acc", held_out_set=12)
    other.load_state_dict(old)
    assert not other.observe({"dev_acc": 0.6, "dev_frames": 2000}, step=2).improved


def test_resume_with_another_held_out_corpus_selects_afresh(small_corpus, tmp_path, capsys):
    # best.h5 stayed the model chosen on the old held-out set, whose figures the new
    # set's were compared with
    from mpitrain.train.selection import held_out_identity
    from mpitrain.data.corpus import load_manifest
    dev, other = f"{small_corpus}/dev", f"{small_corpus}/train"
    assert held_out_identity(load_manifest(dev)) != held_out_identity(load_manifest(other))
    run = tmp_path / "run"
    settings = TINY + ["training.eval_interval=2560", "training.checkpoint_interval=20",
                       "training.log_interval=20", "training.eval_max_frames=500"]
    train_in_process(run, small_corpus, settings + ["training.max_steps=40"])
    capsys.readouterr()
    assert main(["train", QUICKSTART, "--run-dir", str(run), "--resume"]
                + [a for item in [f"data.train={small_corpus}/train", f"data.dev={other}",
                                  "data.chunk_frames=20000", "training.max_steps=60"]
                   + settings for a in ("--set", item)]) == 0
    assert "model selection starts afresh at step " in capsys.readouterr().out
    after = [r for r in records(run, "eval") if r["step"] > 40]
    best = max(after, key=lambda r: r["dev_acc"])
    with open_h5_for_reading(str(run / "best.h5"), "model") as f:
        assert int(f.attrs["selected_at_step"]) == best["step"]


def test_a_selection_by_the_other_figure_is_refused_on_loading():
    by_acc = ModelSelection(select_by="acc")
    by_acc.observe({"dev_acc": 0.62, "dev_xent": 1.2}, step=1)
    with pytest.raises(ValueError, match="by acc, now by xent"):
        ModelSelection(select_by="xent").load_state_dict(by_acc.state_dict())


def test_resume_with_another_select_by_selects_afresh_by_the_new_figure(small_corpus,
                                                                         tmp_path, capsys):
    # an accuracy kept as the best cross-entropy (0.2 nats) let no later model be the
    # best: best.h5 stayed the model selected by accuracy
    run = tmp_path / "run"
    settings = TINY + ["training.eval_interval=2560", "training.checkpoint_interval=20",
                       "training.log_interval=20"]
    train_in_process(run, small_corpus, settings + ["training.max_steps=40"])
    capsys.readouterr()
    assert main(["train", QUICKSTART, "--run-dir", str(run), "--resume", "--accept-changes"]
                + [a for item in [f"data.train={small_corpus}/train",
                                  f"data.dev={small_corpus}/dev", "data.chunk_frames=20000",
                                  "training.select_by=xent", "training.max_steps=80"]
                   + settings for a in ("--set", item)]) == 0
    assert "the model selection (best.h5, early stopping) starts afresh" in \
        capsys.readouterr().out
    after = [r for r in records(run, "eval") if r["step"] > 40]
    best = min(after, key=lambda r: r["dev_xent"])
    with open_h5_for_reading(str(run / "best.h5"), "model") as f:
        assert f.attrs["selected_by"] == "xent"
        assert int(f.attrs["selected_at_step"]) == best["step"]
    assert records(run, "end")[-1]["best_value"] == pytest.approx(best["dev_xent"])


def test_eval_of_a_run_names_the_held_out_frames_its_best_figure_was_over(small_corpus,
                                                                        tmp_path, capsys):
    # with training.eval_max_frames the logged figure is over part of the set, and eval
    # scores all of it: the two differed without a word on why
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + ["training.eval_max_frames=700",
                                                "training.max_steps=20"])
    capsys.readouterr()
    assert main(["eval", str(run), os.path.join(small_corpus, "dev")]) == 0
    out = capsys.readouterr()
    best = records(run, "end")[0]
    assert f"(best held-out acc {best['best_value']:.4f} over 700 frames at step 20)" \
        in out.out + out.err
    assert "frames 700 " not in out.out       # the whole set scored


def test_config_mistakes_are_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="training.early_stop.patience: .*data.dev"):
        load_config(QUICKSTART, ["data.dev=", "training.early_stop.patience=2"])
    with pytest.raises(ConfigError, match="training.select_by"):
        load_config(QUICKSTART, ["training.select_by=wer"])
    with pytest.raises(ConfigError, match="training.early_stop.patience: .*param_server"):
        load_config(QUICKSTART, ["parallel.method=param_server",
                                 "training.early_stop.patience=2"])


def test_better_compares_two_results_by_the_selection_figure():
    by_acc, by_xent = ModelSelection(select_by="acc"), ModelSelection(select_by="xent")
    a = {"dev_acc": 0.5, "dev_xent": 2.0}
    b = {"dev_acc": 0.4, "dev_xent": 1.5}
    assert by_acc.better(a, b) and not by_acc.better(b, a)
    assert by_xent.better(b, a) and not by_xent.better(a, b)
    assert not by_acc.better(a, dict(a))            # a tie is not better
    broken = {"dev_acc": 0.9, "dev_xent": float("nan")}
    assert not by_acc.better(broken, b) and by_acc.better(b, broken)


# ------------------------------------------------------------------ in the trainer

def test_best_h5_is_the_model_of_the_best_evaluation(small_corpus, tmp_path):
    run = tmp_path / "run"
    # evaluations every 2000 frames; a high rate late in training makes later
    # models worse, so the best is not simply the last
    train_in_process(run, small_corpus, TINY + ["training.eval_interval=2000",
                                                "training.max_steps=120"])
    evals = records(run, "eval")
    accs = [e["dev_acc"] for e in evals]
    best = max(range(len(accs)), key=lambda i: (accs[i], -i))
    with open_h5_for_reading(str(run / "best.h5"), "model") as f:
        assert f.attrs["selected_by"] == "acc"
        assert int(f.attrs["selected_at_step"]) == evals[best]["step"]
        assert float(f.attrs["selected_dev_acc"]) == pytest.approx(accs[best])
    end = records(run, "end")[0]
    assert (end["best_step"], end["best_value"], end["select_by"]) == (
        evals[best]["step"], pytest.approx(accs[best]), "acc")
    kept = records(run, "selection")
    assert [r["best"] for r in kept] == [accs[i] > max(accs[:i], default=-1)
                                         for i in range(len(accs))]
    # best.h5 is that model: evaluating it gives the recorded figure
    assert main(["eval", str(run / "best.h5"), os.path.join(small_corpus, "dev")]) == 0
    net, _ = load_model(run / "best.h5")
    final, _ = load_model(run / "final.h5")
    if evals[best]["step"] != evals[-1]["step"]:
        assert not np.array_equal(net.params, final.params)


def test_a_bad_dropout_schedule_is_one_line_before_anything_is_written(small_corpus,
                                                                     tmp_path, capsys):
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--set",
            f"data.train={small_corpus}/train", "--set", f"data.dev={small_corpus}/dev",
            "--set", "model.dropout_schedule=0,1.5,0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"{QUICKSTART}: model.dropout_schedule: dropout proportion 1.5" in err \
        and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_eval_export_and_convert_take_a_run_directory(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + ["training.max_steps=30"])
    capsys.readouterr()
    assert main(["eval", str(run), os.path.join(small_corpus, "dev")]) == 0
    out = capsys.readouterr().out
    assert f"using {run}/best.h5 (best held-out acc" in out and "frames" in out
    assert model_in_run_dir(str(run))[0] == str(run / "best.h5")
    os.remove(run / "best.h5")
    assert model_in_run_dir(str(run)) == (
        str(run / "final.h5"), f"using {run}/final.h5 (the run kept no best.h5: no held-out "
                               "set, or no finite held-out result)")
    assert main(["convert", str(run), "--to", "torch", str(tmp_path / "torch")]) == 0
    assert "final.h5" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", str(empty), os.path.join(small_corpus, "dev")]) == 2
    assert "without best.h5 or final.h5" in capsys.readouterr().err


def test_a_run_without_best_h5_is_not_said_to_have_had_no_held_out_set(tmp_path):
    # a held-out set whose results were all non-finite keeps no best.h5 either
    (tmp_path / "final.h5").write_bytes(b"")
    why = model_in_run_dir(str(tmp_path))[1]
    assert why.endswith("(the run kept no best.h5: no held-out set, or no finite held-out "
                        "result)")


def test_early_stop_counts_from_the_end_of_the_dropout_rise(small_corpus, tmp_path, capsys):
    # the dropout proportion rises until half way: no evaluation before counts, so
    # an early stop impossible to avoid (a gain of 50 points) comes after half way
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + [
        "training.epochs=2", "training.eval_interval=1000", "training.early_stop.patience=1",
        "training.early_stop.min_delta=0.5", "model.dropout_schedule=0,0.3@0.5,0"])
    out = capsys.readouterr().out
    start = records(run, "start")[0]
    half = math.ceil(0.5 * start["planned_steps"])
    assert f"early_stop: counts held-out evaluations from step {half} on" in out
    evals = [e["step"] for e in records(run, "eval")]
    stop = records(run, "early_stop")[0]["step"]
    # the first evaluation from half way sets the reference, the next one stops
    assert stop == [s for s in evals if s >= half][1]
    assert all(r["since_gain"] == 0 for r in records(run, "selection") if r["step"] < half)


def test_evaluations_before_patience_from_step_keep_the_best_but_do_not_count():
    selection = ModelSelection(select_by="acc", patience=1, patience_from_step=10)
    verdicts = [selection.observe({"dev_acc": a}, step=s)
                for s, a in [(4, 0.6), (8, 0.5), (12, 0.55), (16, 0.54)]]
    assert [v.improved for v in verdicts] == [True, False, False, False]
    assert [v.stop for v in verdicts] == [False, False, False, True]
    assert selection.best_step == 4
    # the count starts afresh at step 12 (0.55 is the reference, not 0.6)
    assert verdicts[2].since_gain == 0 and verdicts[3].since_gain == 1


def test_early_stop_ends_the_run_and_keeps_the_best(small_corpus, tmp_path):
    run = tmp_path / "run"
    # no evaluation can gain 50 points: the run stops at the second evaluation
    train_in_process(run, small_corpus, TINY + [
        "training.eval_interval=1000", "training.early_stop.patience=1",
        "training.early_stop.min_delta=0.5", "training.epochs=3"])
    stop = records(run, "early_stop")
    assert len(stop) == 1

    start, end = records(run, "start")[0], records(run, "end")[0]
    assert end["steps"] == stop[0]["step"] < start["total_steps"]
    assert stop[0]["best_step"] in [e["step"] for e in records(run, "eval")]
    assert (run / "best.h5").exists() and (run / "final.h5").exists()


def test_resume_continues_the_selection(small_corpus, tmp_path):
    # evaluations every 20 steps: the split run's final one at step 40 is the
    # straight run's evaluation there, and is counted once
    straight, split = train_straight_and_resumed(tmp_path, small_corpus, TINY + [
        "training.eval_interval=2560", "training.checkpoint_interval=20",
        "training.log_interval=20"], steps=80)
    a, _ = load_model(straight / "best.h5")
    b, _ = load_model(split / "best.h5")
    assert np.array_equal(a.params, b.params)
    after = [(r["step"], r["best"], r["since_gain"]) for r in records(straight, "selection")
             if r["step"] > 40]
    assert [r[0] for r in after] == [60, 80]
    assert after == [(r["step"], r["best"], r["since_gain"])
                     for r in records(split, "selection") if r["step"] > 40]
    # one evaluation per step, the last included
    steps = [r["step"] for r in records(straight, "eval")]
    assert steps == sorted(set(steps))


@pytest.mark.parametrize("regularization", [
    ["model.dropout=0.2"],
    ["model.dropout_schedule=0,0.3@0.5,0", "optimizer.l2_regularize=1e-4",
     "optimizer.l2_regularize_output=1e-3", "optimizer.name=ngsgd"],
], ids=["dropout", "schedule-l2-ngsgd"])
def test_regularized_resume_is_bit_exact(small_corpus, tmp_path, regularization):
    """Dropout masks come from the step, not from a generator's state: a resumed run
    draws the masks the uninterrupted one drew."""
    settings = TINY + regularization + ["training.checkpoint_interval=25",
                                        "training.log_interval=25"]
    straight, split = train_straight_and_resumed(tmp_path, small_corpus, settings, steps=100)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params)
    # and it learned: above chance (1/120) by far
    assert records(straight, "end")[0]["dev_acc"] > 0.1


@pytest.mark.mpi
def test_two_ranks_evaluate_and_keep_their_average_between_averages(mpiexec, small_corpus,
                                                                    tmp_path):
    """Evaluations fall between model averages: the ranks' models differ there, so
    the model evaluated, and kept, is their average; best.h5 scores what was logged."""
    from mpitrain.data.corpus import load_manifest
    from mpitrain.train.evaluate import evaluate_chunks, load_eval_chunks
    from ..helpers import mpi_output, train_on_ranks

    run = tmp_path / "run"
    # early stop at the second evaluation (no gain can reach 50 points): it and the
    # one before fall between averages
    result = train_on_ranks(2, run, small_corpus, TINY + [
        "parallel.average_every=7", "training.eval_interval=1000",
        "training.early_stop.patience=1", "training.early_stop.min_delta=0.5"])
    assert result.returncode == 0, mpi_output(result)
    # the final average is the model evaluated at the stop: evaluated once
    evals = {e["step"]: e for e in records(run, "eval")}
    assert len(evals) == len(records(run, "eval")) == 2 and all(step % 7 for step in evals)
    with open_h5_for_reading(str(run / "best.h5"), "model") as f:
        step = int(f.attrs["selected_at_step"])
    net, _ = load_model(run / "best.h5")
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    total, correct, frames = evaluate_chunks(net, load_eval_chunks(dev, net))
    assert frames == evals[step]["dev_frames"]
    assert correct / frames == pytest.approx(evals[step]["dev_acc"], abs=1e-9)
    assert total / frames == pytest.approx(evals[step]["dev_xent"], rel=1e-5)


def test_the_speech_recipe_trains_and_keeps_its_best_model(small_corpus, tmp_path):
    """jobs/configs/speech.yaml as shipped (made small): held-out control and
    regularization on, a best.h5 that eval finds in the run directory."""
    recipe = os.path.join(os.path.dirname(QUICKSTART), "speech.yaml")
    cfg = load_config(recipe)
    assert cfg.training.early_stop.patience > 0 and cfg.optimizer.l2_regularize > 0
    assert cfg.model.dropout_schedule and cfg.optimizer.name == "ngsgd"
    run = tmp_path / "run"
    argv = ["train", recipe, "--run-dir", str(run)]
    for item in [f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev",
                 "data.chunk_frames=20000", "training.epochs=2"] + TINY:
        argv += ["--set", item]
    assert main(argv) == 0
    assert len(records(run, "eval")) >= 2
    assert records(run, "end")[0]["dev_acc"] > 0.1
    assert model_in_run_dir(str(run))[0] == str(run / "best.h5")


def test_load_model_of_a_run_directory_is_its_best_model(small_corpus, tmp_path):
    import mpitrain
    run = tmp_path / "run"
    train_in_process(run, small_corpus, TINY + ["training.max_steps=20"])
    model = mpitrain.load_model(str(run))
    best, _ = load_model(run / "best.h5")
    assert np.array_equal(model.net.params, best.params)


@pytest.mark.parametrize("method", [["parallel.method=param_server"],
                                    ["parallel.method=adpsgd", "parallel.asynchronous=true"]],
                         ids=["param_server", "async_adpsgd"])
def test_each_selection_record_follows_its_evaluation(small_corpus, tmp_path, method):
    import json
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, small_overrides
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--virtual", "2", "--compute-ms", "1", "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + TINY + method + [
            "training.max_steps=40", "training.eval_interval=2560"]:
        argv += ["--set", item]
    assert main(argv) == 0
    kinds = [json.loads(line)["type"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    selections = [i for i, kind in enumerate(kinds) if kind == "selection"]
    assert selections
    assert all(kinds[i - 1] == "eval" for i in selections), kinds
