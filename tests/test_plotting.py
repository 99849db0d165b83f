"""Training-curve plots: reading metrics files and drawing PNGs from them."""

import json
import os
import math
import re

import numpy as np
import pytest

from mpitrain.cli import main as cli_main
from mpitrain.plotting import plot_runs, read_metrics, run_label

from .helpers import write_run


def _png_pixels(path):
    from matplotlib.image import imread
    return imread(path)


def test_read_metrics_groups_records_by_type(tmp_path):
    write_run(tmp_path / "run", acc_at_end=0.8, steps=4)
    records = read_metrics(tmp_path / "run")
    assert [len(records[k]) for k in ("start", "train", "eval", "end")] == [1, 4, 4, 1]
    assert [r["frames"] for r in records["eval"]] == [2560, 5120, 7680, 10240]
    assert records["end"][0]["dev_acc"] == pytest.approx(0.78)
    # the metrics file itself is accepted too
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")["eval"] == records["eval"]


def test_plot_two_runs_writes_a_nonblank_png(tmp_path):
    write_run(tmp_path / "sgd", acc_at_end=0.6)
    write_run(tmp_path / "ngsgd", acc_at_end=0.8)
    out = plot_runs([tmp_path / "sgd", tmp_path / "ngsgd"], tmp_path / "figs" / "curves.png",
                    title="two runs", dpi=50)
    assert out == str(tmp_path / "figs" / "curves.png")
    pixels = _png_pixels(out)
    height, width = pixels.shape[:2]
    # figsize 11 x 4.2 inches at 50 dpi
    assert (width, height) == (550, 210)
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05, "the image is blank"
    # the two default colours (C0 blue, C1 orange) are drawn
    blue, orange = np.array([0.12, 0.47, 0.71]), np.array([1.0, 0.5, 0.05])
    for colour in (blue, orange):
        assert (np.abs(rgb - colour).max(axis=-1) < 0.08).sum() > 20


def test_plot_against_time_with_labels(tmp_path):
    write_run(tmp_path / "a", acc_at_end=0.7)
    out = plot_runs([tmp_path / "a"], tmp_path / "a.png", x="time", labels=["A"],
                    train=False, dpi=40)
    assert _png_pixels(out).shape[:2] == (168, 440)


def test_missing_metrics_file_names_it(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match=r"nothing[/\\]metrics\.jsonl"):
        read_metrics(tmp_path / "nothing")


def test_garbled_metrics_line_names_file_and_line(tmp_path):
    write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"type": "eval", "frames": 1\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 7: expected one JSON object"):
        read_metrics(tmp_path / "run")


def test_a_last_line_cut_short_is_left_out(tmp_path):
    # a run writing its next line now, or one killed while it wrote
    write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    whole = read_metrics(tmp_path / "run")
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"type": "train", "step": 3, "xe')
    assert read_metrics(tmp_path / "run") == whole
    assert cli_main(["plot", str(tmp_path / "run")]) == 0


def test_record_without_type_is_rejected(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(ValueError, match=r"line 1: field 'type'"):
        read_metrics(tmp_path / "run")


@pytest.mark.parametrize("line,message", [
    ('{"type": "eval", "step": Infinity, "frames": 10, "dev_acc": 0.5}',
     "line 7: field 'step': expected a finite number, got inf"),
    ('{"type": "eval", "step": NaN, "frames": 10, "dev_acc": 0.5}',
     "line 7: field 'step': expected a finite number, got nan"),
    ('{"type": "train", "step": 3, "frames": -Infinity}',
     "line 7: field 'frames': expected a finite number, got -inf"),
    ('{"type": "eval", "x": ' + "[" * 100000 + "]" * 100000 + "}",
     "line 7: expected one JSON object, got values nested too deep to read"),
    # integers beyond a float: an OverflowError traceback on the clock's addition, and
    # past 4300 digits Python's "Exceeds the limit ... for integer string conversion"
    ('{"type": "train", "step": 3, "frames": 30, "seconds": 1' + "0" * 400 + "}",
     "line 7: field 'seconds': expected a finite number, got inf"),
    ('{"type": "train", "step": 1' + "0" * 5000 + ', "frames": 30}',
     "line 7: field 'step': expected a finite number, got inf"),
])
def test_a_record_that_cannot_stand_on_the_timeline_is_named(tmp_path, capsys, line, message):
    """``status`` and ``plot`` stopped with an OverflowError, a NaN conversion or a
    recursion error, naming no file."""
    write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        read_metrics(tmp_path / "run")
    for command in (["status", str(tmp_path / "run")], ["plot", str(tmp_path / "run")]):
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "metrics.jsonl: " + message in err, err


def test_a_metrics_file_that_is_not_utf8_is_named(tmp_path, capsys):
    # the message was the codec's alone, naming no file
    write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    with open(tmp_path / "run" / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"type": "train", "step": 3, "x": "\xc7\xff"}\n')
    assert cli_main(["status", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl: not UTF-8 text" in err, err


def test_a_run_directory_named_in_latin1_is_plotted_under_its_escaped_name(tmp_path):
    # the label held the name's raw bytes, which Matplotlib refused: an internal error
    run = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"run-\xe9"))
    try:
        write_run(run, acc_at_end=0.7, steps=2)
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    assert cli_main(["plot", run, "--out", str(tmp_path / "p.png")]) == 0
    assert plot_runs([run], tmp_path / "q.png", title=run, dpi=30)


def test_a_measured_value_that_is_nan_is_kept(tmp_path):
    # a held-out loss can be NaN (a diverged model): it is data, not a broken file
    write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"type": "eval", "step": 3, "frames": 30, "time": 4.0, "dev_xent": NaN, '
                 '"dev_acc": 0.1}\n')
    assert math.isnan(read_metrics(tmp_path / "run")["eval"][-1]["dev_xent"])


def test_plot_rejects_bad_arguments(tmp_path):
    write_run(tmp_path / "a", acc_at_end=0.7)
    with pytest.raises(ValueError, match="x: expected one of frames, time"):
        plot_runs([tmp_path / "a"], tmp_path / "a.png", x="steps")
    with pytest.raises(ValueError, match="labels: expected 1 labels"):
        plot_runs([tmp_path / "a"], tmp_path / "a.png", labels=["x", "y"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"type": "start", "time": 0}\n')
    with pytest.raises(ValueError, match="no eval or train records"):
        plot_runs([tmp_path / "empty"], tmp_path / "e.png")
    assert not (tmp_path / "a.png").exists()


def test_run_label_is_the_directory_name(tmp_path):
    assert run_label("out/sgd-lr0.004-1r/") == "sgd-lr0.004-1r"
    assert run_label("out/ng/metrics.jsonl") == "ng"


def test_cli_plot_writes_png_and_reports_bad_runs(tmp_path, capsys):
    write_run(tmp_path / "r1", acc_at_end=0.6)
    write_run(tmp_path / "r2", acc_at_end=0.7)
    out = tmp_path / "both.png"
    assert cli_main(["plot", str(tmp_path / "r1"), str(tmp_path / "r2"),
                     "--out", str(out), "--x", "time"]) == 0
    assert _png_pixels(out).shape[0] > 100
    # one run and no --out: the PNG goes into the run directory
    assert cli_main(["plot", str(tmp_path / "r1")]) == 0
    assert (tmp_path / "r1" / "curves.png").exists()
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_plot_of_a_benchmarks_report_points_to_its_runs(tmp_path, capsys):
    # `status` of a bench --out says it is a report whose runs are under runs/;
    # `plot` said only that it holds no metrics.jsonl
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text("{}")
    (bench / "bench.md").write_text("")
    assert cli_main(["plot", str(bench)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.endswith(f"{bench}: a benchmark's report (bench.md, bench.json), not a run; "
                        f"its runs: {bench / 'runs' / '*'}"), err


def test_a_resumed_or_rolled_back_run_reads_as_one_timeline(tmp_path):
    lines = [
        {"type": "start", "time": 0.0, "step": 0},
        {"type": "train", "time": 1.0, "step": 10, "seconds": 1.0, "frames": 10},
        {"type": "train", "time": 2.0, "step": 20, "seconds": 2.0, "frames": 20},
        {"type": "eval", "time": 2.1, "step": 20, "frames": 20, "dev_acc": 0.3},
        # killed; resumed from the checkpoint at step 10: its clocks start again
        {"type": "start", "time": 0.0, "step": 10},
        {"type": "train", "time": 0.5, "step": 20, "seconds": 0.5, "frames": 20},
        {"type": "train", "time": 1.0, "step": 30, "seconds": 1.0, "frames": 30},
        # a roll back to step 20 in the same process
        {"type": "rollback", "time": 1.2, "step": 20},
        {"type": "train", "time": 1.5, "step": 30, "seconds": 1.5, "frames": 30},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records["train"]] == [10, 20, 30]
    assert [r["seconds"] for r in records["train"]] == [1.0, 1.5, 2.5]
    assert [r["time"] for r in records["train"]] == [1.0, 1.5, 2.5]
    assert records["eval"] == []              # the abandoned stretch's evaluation


def test_a_run_resumed_on_more_ranks_keeps_the_training_it_continues(tmp_path):
    """Resumed on 2 ranks from step 40 of 1, the run goes on at step 20: its start
    records the frames it continues from, and only what came after those is an
    abandoned stretch (steps 20-40 of the one-rank part were dropped, and the
    clock went on from step 20's)."""
    lines = [
        {"type": "start", "time": 0.0, "step": 0, "frames": 0},
        {"type": "train", "time": 1.0, "step": 20, "seconds": 1.0, "frames": 20},
        {"type": "train", "time": 2.0, "step": 40, "seconds": 2.0, "frames": 40},
        {"type": "train", "time": 3.0, "step": 60, "seconds": 3.0, "frames": 60},
        # killed; resumed on two ranks from the checkpoint at step 40 (40 frames)
        {"type": "start", "time": 0.0, "step": 20, "frames": 40},
        {"type": "train", "time": 0.5, "step": 30, "seconds": 0.5, "frames": 60},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(str(tmp_path))
    assert [r["frames"] for r in records["train"]] == [20, 40, 60]
    assert [r["seconds"] for r in records["train"]] == [1.0, 2.0, 2.5]
    # each start stands where its part begins on the run's clock
    assert [r["seconds"] for r in records["start"]] == [0.0, 2.0]


def test_without_matplotlib_plotting_is_one_clear_error(tmp_path, monkeypatch):
    from .helpers import without_module
    write_run(tmp_path / "run", acc_at_end=0.8)
    without_module(monkeypatch, "matplotlib")
    with pytest.raises(ValueError, match="plotting needs matplotlib: pip install matplotlib"):
        plot_runs([tmp_path / "run"], tmp_path / "c.png")


def test_a_home_that_cannot_be_written_gives_no_matplotlib_warnings(tmp_path):
    # a compute node's HOME may be read-only or missing: Matplotlib printed two
    # warning lines about its cache directory (as root, a path under a file is the
    # one place that can never be written)
    import os
    import subprocess
    import sys
    write_run(tmp_path / "r1", acc_at_end=0.6)
    (tmp_path / "file").write_text("")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "file" / "home")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    done = subprocess.run([sys.executable, "-m", "mpitrain", "plot", str(tmp_path / "r1")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "r1" / "curves.png").exists()
    assert os.listdir(tmp_path / "tmp") == []          # its directory is removed at exit


def test_runs_of_a_sweep_are_labelled_with_the_settings_they_differ_in(tmp_path):
    from mpitrain.plotting import labels_with_settings
    from mpitrain.train.run_dir import NEUTRAL_SETTINGS
    for name, lr, log in (("lr-0", 0.008, 50), ("lr-1", 0.002, 100), ("other", 0.002, 50)):
        write_run(tmp_path / name, acc_at_end=0.7)
        (tmp_path / name / "config.yaml").write_text(
            f"optimizer:\n  initial_learning_rate: {lr}\ntraining:\n  log_interval: {log}\n"
            f"data:\n  train: /somewhere/{name}\n")
    (tmp_path / "other" / "config.yaml").unlink()          # a run without its config
    runs = [tmp_path / "lr-0", tmp_path / "lr-1", tmp_path / "other"]
    assert labels_with_settings(runs, ignore=NEUTRAL_SETTINGS) == [
        "lr-0 (optimizer.initial_learning_rate=0.008)",
        "lr-1 (optimizer.initial_learning_rate=0.002)", "other"]
    # the logging interval does not change what is trained; the corpus path is a place
    assert labels_with_settings(runs[:1], ignore=NEUTRAL_SETTINGS) == ["lr-0"]
    assert cli_main(["plot", *map(str, runs), "--out", str(tmp_path / "sweep.png")]) == 0
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_settings_no_run_of_a_sweep_uses_are_not_named(tmp_path):
    # SGD runs saved under other NG-SGD defaults differ only in settings none uses
    from mpitrain.plotting import labels_with_settings
    from mpitrain.train.run_dir import NEUTRAL_SETTINGS, unused_settings
    for name, optimizer, reset in (("a", "sgd", "true"), ("b", "sgd", "false"),
                                   ("c", "ngsgd", "false")):
        write_run(tmp_path / name, acc_at_end=0.7)
        (tmp_path / name / "config.yaml").write_text(
            f"optimizer:\n  name: {optimizer}\n  ngsgd:\n    reset_on_average: {reset}\n")
    sgd_runs = [tmp_path / "a", tmp_path / "b"]
    assert labels_with_settings(sgd_runs, ignore=NEUTRAL_SETTINGS,
                                unused=unused_settings) == ["a", "b"]
    assert labels_with_settings(sgd_runs, ignore=NEUTRAL_SETTINGS) == [
        "a (optimizer.ngsgd.reset_on_average=True)", "b (optimizer.ngsgd.reset_on_average=False)"]
    # with an NG-SGD run among them the NG-SGD settings count again
    assert labels_with_settings([tmp_path / "a", tmp_path / "c"], ignore=NEUTRAL_SETTINGS,
                                unused=unused_settings) == [
        "a (optimizer.name=sgd, optimizer.ngsgd.reset_on_average=True)",
        "c (optimizer.name=ngsgd, optimizer.ngsgd.reset_on_average=False)"]


def test_long_labels_go_under_the_panels_and_tell_the_runs_apart_first(tmp_path):
    """Seven runs differing in several settings (methods compared): their labels
    ran off the figure and over the curves from inside the panel.  They go under
    both panels, the figure taller, each label within it; the setting that tells
    the most runs apart is named first."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mpitrain.plotting import labels_with_settings, place_legend
    runs = []
    for i, method in enumerate(["allreduce", "bmuf", "kaldi", "adpsgd", "adpsgd"]):
        run = tmp_path / f"run-{i}"
        write_run(run, acc_at_end=0.5 + 0.05 * i)
        (run / "config.yaml").write_text(
            f"parallel:\n  method: {method}\n  delay_by_one: {i == 4}\n"
            f"optimizer:\n  initial_learning_rate: {0.004 if i < 3 else 0.002}\n"
            f"  final_learning_rate: {0.0004 if i < 3 else 0.0002}\n"
            f"training:\n  seed: {1 if i else 2}\n")
        runs.append(run)
    labels = labels_with_settings(runs)
    assert labels[0] == ("run-0 (parallel.method=allreduce, optimizer.final_learning_rate=0.0004"
                         ", optimizer.initial_learning_rate=0.004, +2)")
    out = plot_runs(runs, tmp_path / "methods.png", labels=labels, dpi=50)
    height, width = _png_pixels(out).shape[:2]
    assert width == 550 and height > 210 + 5 * 8          # taller by the legend's lines

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for i, label in enumerate(labels):
        left.plot([0, 1], [i, i + 1], label=label)
    assert place_legend(fig, left) == "below"
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    box = fig.bbox
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1 and box.y0 <= legend.y0
    for ax in (left, right):
        assert legend.y1 <= ax.get_window_extent(renderer).y0     # under the panels
    short = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(short)
    ax, _ = short.subplots(1, 2)
    ax.plot([0, 1], [0, 1], label="sgd")
    assert place_legend(short, ax) == "inside"
    assert tuple(short.get_size_inches()) == (11, 4.2)


def test_plot_under_a_file_is_one_line_naming_it(tmp_path, capsys):
    write_run(tmp_path / "r1", acc_at_end=0.6)
    (tmp_path / "notes").write_text("x")
    out = tmp_path / "notes" / "curves.png"
    assert cli_main(["plot", str(tmp_path / "r1"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    # (it said "[Errno 17] File exists: '.../notes'")
    assert err == f"mpitrain plot: error: cannot write {out}: {tmp_path / 'notes'} is not " \
                  "a directory\n"


def test_plot_into_a_directory_is_one_line_saying_so(tmp_path, capsys):
    # (the rename at the end said "cannot write DIR: Is a directory", and of
    # "DIR/" "Not a directory")
    write_run(tmp_path / "r1", acc_at_end=0.6)
    for out in (str(tmp_path), str(tmp_path / "new") + "/"):
        assert cli_main(["plot", str(tmp_path / "r1"), "--out", out]) == 2
        err = capsys.readouterr().err
        assert err == (f"mpitrain plot: error: --out {out}: names a directory; name the PNG "
                       f"file to write, e.g. {os.path.join(out, 'curves.png')}\n")
    assert not (tmp_path / "new").exists()
    # the default RUN_DIR/curves.png taken by a directory
    (tmp_path / "r1" / "curves.png").mkdir()
    assert cli_main(["plot", str(tmp_path / "r1")]) == 2
    assert capsys.readouterr().err == (f"mpitrain plot: error: {tmp_path / 'r1' / 'curves.png'}: "
                                       "is a directory; name the PNG file to write with --out\n")
    assert sorted(os.listdir(tmp_path / "r1")) == ["curves.png", "metrics.jsonl"]


def test_a_backend_matplotlib_does_not_know_leaves_plot_drawing(tmp_path):
    # (MPLBACKEND=nonsense failed matplotlib's import: plot ended on its long list
    # of backends, a bench lost its pictures after measuring)
    import subprocess
    import sys
    write_run(tmp_path / "r1", acc_at_end=0.6)
    out = tmp_path / "curves.png"
    env = dict(os.environ, MPLBACKEND="nonsense")
    result = subprocess.run([sys.executable, "-m", "mpitrain", "plot", str(tmp_path / "r1"),
                             "--out", str(out)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_pretraining_run_says_what_it_is(tmp_path, capsys):
    # (it said only "no eval or train records to plot")
    run = tmp_path / "pre"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps({"type": "start", "time": 0.0, "mode": "pretrain", "layers": [440, 64]})
        + "\n" + json.dumps({"type": "pretrain", "time": 1.0, "layer": 1, "step": 10,
                             "recon_mse": 0.5}) + "\n")
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a pretraining run (mpitrain pretrain)" in err, err


def test_a_run_with_nothing_to_draw_yet_is_left_out_of_the_others_plot(tmp_path, capsys):
    # (one job of a sweep that had only just started made `plot runs/*` fail whole)
    write_run(tmp_path / "done", acc_at_end=0.7)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "metrics.jsonl").write_text('{"type": "start", "time": 0}\n')
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(tmp_path / "done"), str(tmp_path / "new"),
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"mpitrain plot: warning: {tmp_path / 'new' / 'metrics.jsonl'}: "
                            "no eval or train records to plot; left out of the plot\n")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # with nothing to draw in any run it is still an error, and nothing is written
    assert cli_main(["plot", str(tmp_path / "new"), "--out", str(tmp_path / "n.png")]) == 2
    assert "error: " in capsys.readouterr().err and not (tmp_path / "n.png").exists()


def test_more_than_ten_runs_are_each_drawn_in_a_style_of_their_own(tmp_path, monkeypatch):
    # (the eleventh run's curves were drawn as the first's: the same colour and marker)
    from matplotlib.axes import Axes
    drawn = []
    plot = Axes.plot

    def record(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("linestyle", "-"),
                      kwargs.get("color"), kwargs.get("marker")))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    runs = []
    for i in range(23):
        write_run(tmp_path / f"r{i}", acc_at_end=0.5 + i / 100, steps=2)
        runs.append(tmp_path / f"r{i}")
    # the last runs without held-out records: their training curves carry the legend
    for run in runs[-2:]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text(
            "".join(f"{line}\n" for line in lines if '"eval"' not in line))
    plot_runs(runs, tmp_path / "many.png", dpi=20)
    held_out = {(c, m) for label, style, c, m in drawn if style == "-"}
    training = {(c, m) for label, style, c, m in drawn if style == "--"}
    assert len(held_out) == 21 and len(training) == 23, (held_out, training)


@pytest.mark.parametrize("command", ["status", "plot"])
def test_a_name_that_is_no_run_directory_is_said_in_its_own_words(tmp_path, capsys, command):
    # (`status runs/*` over a log file beside the runs named "runs/x.log/metrics.jsonl",
    # a path that cannot exist)
    (tmp_path / "x.log").write_text("log\n")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    expected = {"x.log": "is a file, not a run directory (which holds metrics.jsonl)",
                "absent": "no such run directory",
                "gone": f"a symbolic link to {tmp_path / 'nowhere'}, which does not exist"}
    for name, words in expected.items():
        assert cli_main([command, str(tmp_path / name), "--out", str(tmp_path / "p.png")]
                        if command == "plot" else [command, str(tmp_path / name)]) == 2
        assert capsys.readouterr().err == \
            f"mpitrain {command}: error: {tmp_path / name}: {words}\n"
