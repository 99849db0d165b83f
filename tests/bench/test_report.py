"""The bench report's files: the measurements are written whatever the plots do."""

import json
import os

from ..helpers import REPO, without_module

REPORT = REPO / "docs" / "data" / "virtual-scaling" / "late" / "bmuf05-n16.bench.json"


def test_a_report_without_matplotlib_keeps_its_measurements(tmp_path, monkeypatch):
    from mpitrain.bench.report import write_report
    report = json.loads(REPORT.read_text())
    without_module(monkeypatch, "matplotlib")
    paths = write_report(report, str(tmp_path / "out"))
    assert sorted(paths) == ["json", "markdown"]
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["accuracy"] == report["accuracy"]
    assert "matplotlib is not installed" in (tmp_path / "out" / "bench.md").read_text()


def _thr(ranks, fps):
    return {"method": "model_averaging", "ranks": ranks, "frames_per_sec": fps,
            "frames_per_sec_per_rank": fps / ranks, "step_seconds": 0.002,
            "comm_fraction": 0.0, "compute_seconds_per_step": 0.002, "num_params": 1000,
            "sync_period": 8}


def _acc(ranks, frames, seconds, interpolated=True):
    return {"method": "model_averaging", "ranks": ranks, "target_accuracy": 0.3,
            "reached": True, "stopped_by": "target", "frames_to_target": frames,
            "seconds_to_target": seconds, "interpolated": interpolated, "points": []}


def _report(accuracy):
    from mpitrain.bench.options import BenchOptions
    from mpitrain.bench.report import build_report
    sizes = tuple(a["ranks"] for a in accuracy)
    return build_report([_thr(n, 1000.0 * n) for n in sizes], accuracy, sizes=sizes,
                        methods=("model_averaging",), environment={}, config={},
                        options=BenchOptions(sizes=sizes, target_accuracy=0.3,
                                             project_to=(16,)))


def test_a_target_reached_at_the_first_evaluation_gives_bounds_not_figures():
    from mpitrain.bench.report import summary_markdown
    # 2 ranks reached it at their first evaluation: 4096 frames is an upper bound
    report = _report([_acc(1, 10000.0, 0.5), _acc(2, 4096.0, 0.2, interpolated=False),
                      _acc(4, 20000.0, 0.25)])
    by = {s["ranks"]: s for s in report["speedups"]}
    assert by[1]["target_bound"] is None and by[1]["time_to_target_speedup"] == 1.0
    assert by[2]["target_bound"] == "at least"           # the true time on 2 is shorter
    assert by[2]["time_to_target_speedup"] == 0.5 / 0.2
    assert by[4]["target_bound"] is None
    # the bound is not fitted as if it were a crossing
    assert report["projections"]["model_averaging"]["fitted_sizes"] == [1, 4]
    text = summary_markdown(report)
    assert "| <= 4,096 | <= 0.200 | >= 2.50 | >= 2.44 |" in text
    assert "upper bounds" in text
    # seconds keep enough digits to check a ratio by hand
    assert "| 10,000 | 0.500 | 1.00 | 1.00 |" in text


def test_a_target_reached_at_the_first_evaluation_everywhere_is_undetermined():
    from mpitrain.bench.report import summary_markdown
    report = _report([_acc(1, 4096.0, 0.4, interpolated=False),
                      _acc(2, 4096.0, 0.2, interpolated=False)])
    by = {s["ranks"]: s for s in report["speedups"]}
    assert by[1]["time_to_target_speedup"] == 1.0
    assert by[2]["target_bound"] == "undetermined"
    assert by[2]["time_to_target_speedup"] is None and by[2]["statistical_efficiency"] is None
    proj = report["projections"]["model_averaging"]
    assert proj["frames_exponent"] is None and proj["rows"][-1]["time_to_target_speedup"] is None
    assert "| <= 4,096 | <= 0.200 | — (bounds only) | — (bounds only) |" in summary_markdown(report)


def test_bounded_speedups_are_drawn_apart_from_the_measured_curve(tmp_path):
    from mpitrain.bench.report import plot_speedup
    report = _report([_acc(1, 10000.0, 0.5), _acc(2, 4096.0, 0.2, interpolated=False)])
    report.update(sizes=[1, 2], paper_points=[])
    plot_speedup(report, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0


def test_an_earlier_benchmark_in_out_is_refused_and_cleared_only_with_overwrite(tmp_path):
    from mpitrain.bench.report import clear_earlier_bench, out_dir_problem
    out = tmp_path / "out"
    assert out_dir_problem(str(out), overwrite=False) is None       # not there yet
    out.mkdir()
    assert out_dir_problem(str(out), overwrite=False) is None       # empty (sbatch's mkdir)
    # an interrupted benchmark: runs, no report yet
    for name in ("throughput-bmuf-n1", "accuracy-model_averaging-n2", "throughput-kaldi-n4-r2"):
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "metrics.jsonl").write_text("{}\n")
    problem = out_dir_problem(str(out), overwrite=False)
    assert problem == (f"{out}: holds an earlier benchmark (3 run(s) in runs/); replace it "
                       "with --overwrite, or choose another --out")
    (out / "bench.json").write_text("{}")
    assert "(bench.json, 3 run(s) in runs/)" in out_dir_problem(str(out), overwrite=False)
    assert out_dir_problem(str(out), overwrite=True) is None
    # what the benchmark did not write stays
    (out / "runs" / "my-run").mkdir()
    (out / "notes.txt").write_text("mine")
    assert len(clear_earlier_bench(str(out))) == 4
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "runs"]
    assert [p.name for p in (out / "runs").iterdir()] == ["my-run"]
    assert out_dir_problem(str(out), overwrite=False) is None


def test_an_out_that_is_a_file_is_refused(tmp_path):
    from mpitrain.bench.report import out_dir_problem
    (tmp_path / "f").write_text("")
    assert out_dir_problem(str(tmp_path / "f"), overwrite=True) == \
        f"{tmp_path / 'f'}: --out exists and is not a directory"
    # under a file: refused before measuring (a bare "Not a directory" came after it)
    assert out_dir_problem(str(tmp_path / "f" / "x" / "y"), overwrite=True) == \
        f"{tmp_path / 'f' / 'x' / 'y'}: --out cannot be made ({tmp_path / 'f'} is not a directory)"


def test_a_simulated_report_does_not_read_as_measured_on_the_machine():
    from mpitrain.bench.report import _notes, summary_markdown
    report = json.loads(REPORT.read_text())          # a `bench --virtual` report
    report["environment"]["load_average_at_start"] = [9.0, 9.0, 9.0]
    text = summary_markdown(report)
    head = text.split("## Throughput")[0]
    assert "virtual ranks simulated in one process" in head and "not measured" in head
    assert "## Throughput and time to target (simulated)" in text
    # the notes of a report are made when it is built: the machine's load is no concern
    notes = " ".join(_notes(report["environment"], None))
    assert "simulated clock" in notes
    assert "Busy machine" not in notes and "Idle ranks sleep" not in notes


def test_a_benchmark_stopped_while_plotting_keeps_a_report_listing_only_what_is_there(
        tmp_path, monkeypatch):
    # bench.json was written first, listing both plots, so a benchmark stopped while
    # drawing them left a complete-looking report naming files that were never written
    import pytest
    from mpitrain.bench import report as bench_report
    report = json.loads(REPORT.read_text())

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_report, "plot_accuracy", stopped)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        bench_report.write_report(report, str(out))
    written = json.loads((out / "bench.json").read_text())
    assert written["accuracy"] == report["accuracy"] and (out / "bench.md").exists()
    assert written["outputs"] == {"json": "bench.json", "markdown": "bench.md",
                                  "speedup_png": "bench-speedup.png"}
    assert all((out / name).exists() for name in written["outputs"].values())
    assert not (out / "bench-accuracy.png").exists()
    monkeypatch.undo()
    paths = bench_report.write_report(report, str(out))
    assert json.loads((out / "bench.json").read_text())["outputs"] == {
        k: os.path.basename(v) for k, v in paths.items()}
    assert "accuracy_png" in paths


def test_a_diverged_one_rank_throughput_leaves_speedups_and_projection_out(tmp_path):
    from mpitrain.bench.options import BenchOptions
    from mpitrain.bench.phases import THROUGHPUT_FIGURES
    from mpitrain.bench.report import build_report, summary_markdown, write_report
    diverged = dict(_thr(1, 1000.0), **dict.fromkeys(THROUGHPUT_FIGURES),
                    diverged="runs/throughput-model_averaging-n1: training diverged", steps=7)
    report = build_report([diverged, _thr(2, 2000.0)], [], sizes=(1, 2),
                          methods=("model_averaging",), environment={}, config={},
                          options=BenchOptions(sizes=(1, 2), project_to=(16,)))
    by = {s["ranks"]: s for s in report["speedups"]}
    assert by[1]["throughput_diverged"] and by[1]["throughput_speedup"] is None
    assert by[2]["throughput_speedup"] is None and "throughput_diverged" not in by[2]
    assert report["projections"] == {}
    assert "| model_averaging | 1 | diverged |" in summary_markdown(report)
    paths = write_report(report, str(tmp_path / "out"), dpi=30)
    assert os.path.exists(paths["speedup_png"])


def test_a_throughput_only_report_has_no_time_to_target_columns():
    """Without --target-accuracy the table was headed 'Throughput and time to target'
    with four columns of dashes."""
    from mpitrain.bench.report import summary_markdown
    report = _report([_acc(1, 1000, 1.0), _acc(2, 1000, 0.6)])
    report["environment"] = {"ranks": 2}
    assert "| frames to target |" in summary_markdown(report)
    report["accuracy"] = []
    text = summary_markdown(report)
    table = text.split("## Throughput\n\n")[1].split("\n\n")[0].splitlines()
    assert table[0] == ("| method | ranks | frames/s | per rank | step ms | comm | "
                        "throughput speedup |")
    assert all(line.count("|") == 8 for line in table), table
    assert "time to target" not in text.split("## Projection")[0]


def test_an_out_that_cannot_be_written_is_refused_before_measuring(small_corpus, tmp_path,
                                                                   capsys):
    # (the first run's directory failed after the checks and the header, with an OS
    # error naming no option; a file system that refuses even root, as /proc does)
    from mpitrain.bench.report import out_dir_problem
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, small_overrides
    out = "/proc/mpitrain-bench-out/b"
    assert out_dir_problem(out, overwrite=False).startswith(f"{out}: --out cannot be written (")
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "allreduce", "--phases",
            "throughput", "--steps", "2", "--warmup-steps", "1", "--compute-ms", "1",
            "--out", out]
    for item in small_overrides(small_corpus):
        argv += ["--set", item]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "bench (virtual ranks)" not in captured.out
    assert f"error: {out}: --out cannot be written (" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    # a directory that can be written is left as it was: nothing made, nothing left
    fresh = tmp_path / "a" / "b"
    assert out_dir_problem(str(fresh), overwrite=False) is None
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    assert out_dir_problem(str(tmp_path / "kept"), overwrite=False) is None
    assert os.listdir(tmp_path / "kept") == []
