"""Training-curve plots: reading metrics files and drawing PNGs from them."""

import json
import os

import numpy as np
import pytest

from mpitrain.bench.convergence import frames_to_reach
from mpitrain.cli import main as cli_main
from mpitrain.plotting import plot_runs, read_metrics, run_label


def _write_run(run_dir, *, acc_at_end, steps=5):
    """A run directory with a metrics file like the trainer's: start, train, eval, end."""
    os.makedirs(run_dir, exist_ok=True)
    lines = [{"type": "start", "time": 0.0, "step": 0, "ranks": 1}]
    for i in range(1, steps + 1):
        acc = acc_at_end * i / steps
        lines.append({"type": "train", "time": 1.5 * i, "step": 10 * i, "frames": 2560 * i,
                      "xent": 3.0 - 2 * acc, "acc": acc})
        lines.append({"type": "eval", "time": 1.5 * i + 0.1, "step": 10 * i,
                      "frames": 2560 * i, "dev_xent": 3.2 - 2 * acc, "dev_acc": acc - 0.02,
                      "dev_frames": 1000})
    lines.append({"type": "end", "time": 9.0, "steps": 10 * steps, "frames": 2560 * steps,
                  "dev_acc": acc_at_end - 0.02, "dev_xent": 3.2 - 2 * acc_at_end})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(line) for line in lines) + "\n")


def _png_pixels(path):
    from matplotlib.image import imread
    return imread(path)


def test_read_metrics_groups_records_by_type(tmp_path):
    _write_run(tmp_path / "run", acc_at_end=0.8, steps=4)
    records = read_metrics(tmp_path / "run")
    assert [len(records[k]) for k in ("start", "train", "eval", "end")] == [1, 4, 4, 1]
    assert [r["frames"] for r in records["eval"]] == [2560, 5120, 7680, 10240]
    assert records["end"][0]["dev_acc"] == pytest.approx(0.78)
    # the metrics file itself is accepted too
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")["eval"] == records["eval"]


def test_plot_two_runs_writes_a_nonblank_png(tmp_path):
    _write_run(tmp_path / "sgd", acc_at_end=0.6)
    _write_run(tmp_path / "ngsgd", acc_at_end=0.8)
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
    _write_run(tmp_path / "a", acc_at_end=0.7)
    out = plot_runs([tmp_path / "a"], tmp_path / "a.png", x="time", labels=["A"],
                    train=False, dpi=40)
    assert _png_pixels(out).shape[:2] == (168, 440)


def test_missing_metrics_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing[/\\]metrics\.jsonl"):
        read_metrics(tmp_path / "nothing")


def test_garbled_metrics_line_names_file_and_line(tmp_path):
    _write_run(tmp_path / "run", acc_at_end=0.7, steps=2)
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"type": "eval", "frames": 1\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 7: expected one JSON object"):
        read_metrics(tmp_path / "run")


def test_record_without_type_is_rejected(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(ValueError, match=r"line 1: field 'type'"):
        read_metrics(tmp_path / "run")


def test_plot_rejects_bad_arguments(tmp_path):
    _write_run(tmp_path / "a", acc_at_end=0.7)
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
    _write_run(tmp_path / "r1", acc_at_end=0.6)
    _write_run(tmp_path / "r2", acc_at_end=0.7)
    out = tmp_path / "both.png"
    assert cli_main(["plot", str(tmp_path / "r1"), str(tmp_path / "r2"),
                     "--out", str(out), "--x", "time"]) == 0
    assert _png_pixels(out).shape[0] > 100
    # one run and no --out: the PNG goes into the run directory
    assert cli_main(["plot", str(tmp_path / "r1")]) == 0
    assert (tmp_path / "r1" / "curves.png").exists()
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_frames_to_reach_interpolates_between_evaluations():
    evals = [{"frames": 100, "dev_acc": 0.2}, {"frames": 200, "dev_acc": 0.6},
             {"frames": 300, "dev_acc": 0.5}, {"frames": 400, "dev_acc": 0.9}]
    assert frames_to_reach(evals, 0.4) == pytest.approx(150.0)
    assert frames_to_reach(evals, 0.1) == 100.0          # reached at the first point
    assert frames_to_reach(evals, 0.7) == pytest.approx(350.0)
    assert frames_to_reach(evals, 0.95) is None


def test_best_rates_and_table_of_summarized_runs(tmp_path):
    from mpitrain.bench.convergence import RunSpec, best_rates, markdown_table, summarize_run
    rows = []
    for opt, lr, acc in (("sgd", 0.002, 0.6), ("sgd", 0.004, 0.7), ("ngsgd", 0.004, 0.8)):
        spec = RunSpec(opt, lr, 1)
        _write_run(tmp_path / spec.name, acc_at_end=acc)
        rows.append(summarize_run(tmp_path / spec.name, spec, targets=(0.1, 0.5, 0.9)))
    assert best_rates(rows, ranks=1) == {"sgd": 0.004, "ngsgd": 0.004}
    assert best_rates(rows, ranks=4) == {}
    ng = rows[2]
    assert ng["final_dev_acc"] == pytest.approx(0.78)
    # eval accuracies 0.14, 0.30, 0.46, 0.62, 0.78 at 2560-frame steps
    assert ng["frames_to_acc"]["0.5"] == pytest.approx(7680 + 0.25 * 2560)
    assert ng["frames_to_acc"]["0.9"] is None
    for row in rows:
        row["best"] = row["lr"] == 0.004
    table = markdown_table(rows, (0.1, 0.5, 0.9)).splitlines()
    assert len(table) == 2 + 3
    assert table[4].startswith("| NG-SGD | 1 | 0.004 * | 0.7800 |")
    # 0.1 is reached by the first evaluation: only a bound is known
    assert "| <= 3k | 8k | not reached |" in table[4]
    with pytest.raises(ValueError, match="optimizer"):
        RunSpec("adam", 0.1, 1)
