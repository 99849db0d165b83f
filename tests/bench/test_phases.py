"""The benchmark's phases: crossing interpolation, throughput windows, evaluation
intervals (and the default rank counts of its options)."""

import pytest

from mpitrain.bench.options import default_sizes
from mpitrain.bench.phases import eval_interval_per_rank, first_crossing, throughput_from_windows

from ..helpers import QUICKSTART


def test_first_crossing_interpolates_linearly():
    points = [{"frames": 1000, "seconds": 2.0, "dev_acc": 0.30, "step": 4},
              {"frames": 2000, "seconds": 4.0, "dev_acc": 0.40, "step": 8},
              {"frames": 3000, "seconds": 7.0, "dev_acc": 0.60, "step": 12},
              {"frames": 4000, "seconds": 9.0, "dev_acc": 0.70, "step": 16}]
    # 0.55 lies 3/4 of the way from 0.40 to 0.60: 2000 + 0.75 * 1000, 4.0 + 0.75 * 3.0
    hit = first_crossing(points, 0.55)
    assert hit["frames"] == pytest.approx(2750) and hit["seconds"] == pytest.approx(6.25)
    assert hit["interpolated"] and hit["eval_step"] == 12
    # already reached at the first evaluation: its own figures, not interpolated
    hit = first_crossing(points, 0.25)
    assert (hit["frames"], hit["seconds"], hit["interpolated"]) == (1000, 2.0, False)
    assert first_crossing(points, 0.9) is None
    # the first crossing counts even when accuracy dips later
    dip = points[:3] + [{"frames": 4000, "seconds": 9.0, "dev_acc": 0.5}]
    assert first_crossing(dip, 0.55)["frames"] == pytest.approx(2750)


def test_throughput_windows_drop_the_warmup():
    windows = [  # cumulative steps, seconds and comm; frames per window; the first is warm-up
        {"steps": 5, "frames": 1280, "seconds": 12.8, "comm": 0.9},
        {"steps": 10, "frames": 1280, "seconds": 13.8, "comm": 1.15},
        {"steps": 20, "frames": 2560, "seconds": 15.8, "comm": 2.15}]
    # 3840 frames in 3 s, 1.25 s of it in the communicator
    got = throughput_from_windows(windows, ranks=2)
    assert got["frames_per_sec"] == pytest.approx(3840 / 3)
    assert got["frames_per_sec_per_rank"] == pytest.approx(3840 / 3 / 2)
    assert got["comm_fraction"] == pytest.approx(1.25 / 3)
    assert got["step_seconds"] == pytest.approx(3 / 15)
    assert got["compute_seconds_per_step"] == pytest.approx(3 / 15 * (1 - 1.25 / 3))
    # the ranks' mean time in the communicator, when given, is the one counted
    assert throughput_from_windows(windows, ranks=2, comm_seconds=1.5)["comm_fraction"] == \
        pytest.approx(0.5)
    # the sums' own cost is neither training time nor the method's communication
    got = throughput_from_windows(windows, ranks=2, overhead_seconds=0.5)
    assert got["frames_per_sec"] == pytest.approx(3840 / 2.5)
    assert got["comm_fraction"] == pytest.approx(0.75 / 2.5)
    with pytest.raises(ValueError, match="two progress records"):
        throughput_from_windows(windows[:1], ranks=1)


def test_eval_interval_and_sizes():
    # 20000 frames over 2 ranks = 10000 per rank, rounded up to blocks of 8 x 256 = 2048
    assert eval_interval_per_rank(20000, ranks=2, minibatch=256, sync_period=8) == 5 * 2048
    assert eval_interval_per_rank(1, ranks=4, minibatch=128, sync_period=1) == 128
    assert default_sizes(1) == (1,) and default_sizes(4) == (1, 2, 4)
    assert default_sizes(6) == (1, 2, 4, 6)


def test_a_kaldi_job_ramp_is_capped_at_each_group_size():
    from mpitrain.bench.phases import jobs_within
    from mpitrain.config import load_config
    cfg = load_config(QUICKSTART, ["parallel.num_jobs_initial=4", "parallel.num_jobs_final=16"])
    assert jobs_within(cfg, 1) == {"parallel__num_jobs_initial": 1,
                                   "parallel__num_jobs_final": 1}
    assert jobs_within(cfg, 8) == {"parallel__num_jobs_final": 8}
    assert jobs_within(cfg, 16) == {}
    assert jobs_within(load_config(QUICKSTART), 1) == {}       # 0: all ranks, left alone


def test_budget_reason_names_the_cap_that_ended_the_run():
    from mpitrain.bench.phases import budget_reason
    caps = {"--max-steps": 10, "--max-frames": 4}
    assert budget_reason(4, caps) == "--max-frames"
    assert budget_reason(3, caps) == "epochs"       # ended by the epochs before any cap
    assert budget_reason(7, {}) == "epochs"


def test_accuracy_runs_keep_no_models_and_name_the_budget(small_corpus, tmp_path):
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "bmuf,bmuf",
            "--phases", "accuracy", "--target-accuracy", "0.95", "--max-frames", "3000",
            "--eval-frames", "1024", "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    # a method named twice is measured once
    assert report["methods"] == ["bmuf"] and len(report["accuracy"]) == 1
    (row,) = report["accuracy"]
    assert not row["reached"] and row["stopped_by"] == "--max-frames"
    assert row["frames"] == 3072          # 3000 frames, rounded up to whole minibatches
    assert "not reached (--max-frames)" in (out / "bench.md").read_text()
    # the benchmark keeps each run's metrics and log, no models
    assert sorted(p.name for p in (out / "runs" / "accuracy-bmuf-n1").iterdir()
                  if not p.name.startswith(".")) == ["config.yaml", "metrics.jsonl", "train.log"]


def test_kaldi_throughput_is_measured_with_every_rank_of_the_group_active(small_corpus, tmp_path):
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2", "--methods", "kaldi", "--phases",
            "throughput", "--steps", "8", "--warmup-steps", "4", "--compute-ms", "1",
            "--out", str(out), "--dpi", "30"]
    # a job ramp from one rank: over the throughput run's 12 steps it would never move
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "parallel.num_jobs_initial=1",
            "parallel.num_jobs_final=2", "parallel.average_every_frames=1024"]:
        argv += ["--set", item]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    fps = {r["ranks"]: r["frames_per_sec"] for r in report["throughput"]}
    assert fps[2] / fps[1] == pytest.approx(2, rel=0.02)


@pytest.mark.parametrize("setting", ["optimizer.schedule=newbob",
                                     "training.early_stop.patience=2"])
def test_a_config_that_decides_on_held_out_results_is_benchmarked(small_corpus, tmp_path,
                                                                   setting):
    """The throughput phase runs without a held-out set; newbob and early stopping,
    which need one, made it refuse such a config (jobs/configs/speech.yaml among
    them) with 'set data.dev', which was set."""
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2", "--methods", "model_averaging",
            "--phases", "throughput", "--steps", "4", "--warmup-steps", "2",
            "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                 setting]:
        argv += ["--set", item]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    assert sorted(r["ranks"] for r in report["throughput"]) == [1, 2]


def test_a_run_ended_by_max_seconds_is_named_by_its_flag_as_the_other_budgets(small_corpus,
                                                                              tmp_path):
    # it said "max_seconds" where the other budgets say "--max-steps", "--max-frames"
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "bmuf", "--phases", "accuracy",
            "--target-accuracy", "0.95", "--max-seconds", "0.001", "--eval-frames", "1024",
            "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    assert main(argv) == 0
    (row,) = json.loads((out / "bench.json").read_text())["accuracy"]
    assert not row["reached"] and row["stopped_by"] == "--max-seconds"
    assert "not reached (--max-seconds)" in (out / "bench.md").read_text()


def test_a_run_ended_by_early_stopping_says_so_not_epochs(small_corpus, tmp_path):
    # the config's early stopping ends a time-to-accuracy run before its epochs
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "model_averaging",
            "--phases", "accuracy", "--target-accuracy", "0.999", "--eval-frames", "1024",
            "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "training.early_stop.patience=1",
            "training.early_stop.min_delta=1.0"]:
        argv += ["--set", item]
    assert main(argv) == 0
    (row,) = json.loads((out / "bench.json").read_text())["accuracy"]
    assert not row["reached"] and row["stopped_by"] == "early stopping"
    assert "not reached (early stopping)" in (out / "bench.md").read_text()


def test_a_method_that_diverges_is_a_result_and_the_others_are_measured(small_corpus,
                                                                         tmp_path, capsys):
    # (the divergence ended the whole benchmark: the methods after it and the report
    # of the size were lost)
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "bmuf,model_averaging",
            "--phases", "accuracy", "--target-accuracy", "0.95", "--max-frames", "6000",
            "--eval-frames", "1024", "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "parallel.block_lr=1e6",
            "training.log_interval=4", "training.max_divergence_events=0",
            "training.max_rollbacks=0"]:
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    rows = {row["method"]: row for row in json.loads((out / "bench.json").read_text())["accuracy"]}
    assert rows["bmuf"]["stopped_by"] == "divergence" and not rows["bmuf"]["reached"]
    assert rows["model_averaging"]["stopped_by"] == "--max-frames"
    assert "bmuf" in capsys.readouterr().out


def test_a_throughput_run_that_diverges_is_a_result_and_the_benchmark_goes_on(small_corpus,
                                                                           tmp_path, capsys):
    # (a divergence in the throughput phase ended the whole benchmark; only the
    # time-to-accuracy phase took one as a result)
    import json
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = tmp_path / "bench"
    # without max-change, a rate of 0.001 trains on one rank; scaled linearly to
    # 0.004 on four it blows up within the measured steps
    argv = ["bench", QUICKSTART, "--virtual", "1,4", "--methods", "allreduce",
            "--phases", "throughput,accuracy", "--steps", "12", "--warmup-steps", "4",
            "--target-accuracy", "0.95", "--max-frames", "4096", "--eval-frames", "2048",
            "--lr-scale", "linear", "--compute-ms", "1", "--out", str(out), "--dpi", "30"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "optimizer.max_change=0",
            "optimizer.max_change_per_layer=0", "optimizer.max_change_output=0",
            "optimizer.initial_learning_rate=0.001", "optimizer.final_learning_rate=0.001",
            "training.max_divergence_events=0", "training.max_rollbacks=0"]:
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    one, four = sorted(report["throughput"], key=lambda r: r["ranks"])
    assert one["frames_per_sec"] > 0 and "diverged" not in one
    assert "training diverged" in four["diverged"] and four["frames_per_sec"] is None
    assert four["steps"] < 16
    assert "n=4 allreduce" in printed and "throughput not measured: diverged" in printed
    speedups = {s["ranks"]: s for s in report["speedups"]}
    assert speedups[4]["throughput_diverged"] and speedups[4]["throughput_speedup"] is None
    assert speedups[1]["throughput_speedup"] == 1.0
    assert "| allreduce | 4 | diverged |" in (out / "bench.md").read_text()
    assert (out / "bench-speedup.png").exists()
    # the benchmark went on: the time-to-accuracy phase of both sizes
    assert sorted(r["ranks"] for r in report["accuracy"]) == [1, 4]
    assert report["projections"]["allreduce"]


def test_a_benchmark_into_a_directory_named_in_latin1_logs_its_runs(small_corpus, tmp_path):
    # each run's train.log took text only: the run's last line, naming its directory,
    # ended the benchmark
    import os
    from mpitrain.cli import main
    from ..helpers import small_overrides
    out = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"bench-\xe9"))
    try:
        os.mkdir(out)
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    argv = ["bench", QUICKSTART, "--virtual", "1", "--methods", "model_averaging",
            "--phases", "throughput", "--steps", "3", "--warmup-steps", "1",
            "--out", out, "--overwrite", "--dpi", "30"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    assert main(argv) == 0
    log = os.path.join(out, "runs", "throughput-model_averaging-n1", "train.log")
    assert os.fsencode(out) in open(log, "rb").read()


def test_time_to_target_leaves_out_the_writing_of_best_h5(small_corpus, tmp_path, monkeypatch):
    """Training seconds stop at each held-out evaluation until every rank goes on:
    rank 0's best.h5, written at nearly every evaluation of an improving run, was
    counted as training (about 5% of the quickstart model's time to target)."""
    import mpitrain.train.trainer as trainer_module
    from mpitrain.bench.options import BenchOptions
    from mpitrain.bench.phases import time_to_accuracy
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.config import load_config
    from ..helpers import small_overrides

    class Clock(SingleCommunicator):
        """Wall time, plus what the model files are said to have taken."""
        offset = 0.0

        def wtime(self):
            return super().wtime() + self.offset

    comm = Clock()
    save = trainer_module.save_best_model

    def slow_save(*args, **kwargs):
        comm.offset += 100.0        # a best.h5 that takes 100 s to write
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_best_model", slow_save)
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1"])
    row = time_to_accuracy(cfg, comm, method="model_averaging", run_dir=str(tmp_path / "a"),
                           options=BenchOptions(target_accuracy=0.99, max_steps=24,
                                                eval_frames=2048),
                           sync_period=1, steps_per_epoch_1=1000)
    points = row["points"]
    assert len(points) == 3 and comm.offset >= 200     # best.h5 written at each one
    assert all(p["seconds"] < 100 for p in points)
    assert row["training_seconds"] < 100 and row["outside_seconds"] >= 200


def test_each_repeat_on_real_ranks_with_a_straggler_jitter_is_its_own_draw(small_corpus,
                                                                         tmp_path,
                                                                         monkeypatch):
    # parallel.straggler's jitter was drawn from the seed and the rank alone, so every
    # repeat of a throughput run slept the same: each repeat draws its own, from the
    # repeat's index too, and the same command gives the same repeats
    import itertools
    from types import SimpleNamespace
    from mpitrain.cli import main
    from mpitrain.parallel import straggler as straggler_module
    from ..helpers import small_overrides
    steps = 4           # --warmup-steps + --steps of each run
    slept = []
    # each step computes 1 s on this clock; the sleep is recorded, not slept
    clock = itertools.count()
    monkeypatch.setattr(straggler_module, "time", SimpleNamespace(
        perf_counter=lambda: float(next(clock)), sleep=slept.append))

    def repeats(out):
        slept.clear()
        argv = ["bench", QUICKSTART, "--sizes", "1", "--methods", "model_averaging",
                "--phases", "throughput", "--steps", "2", "--warmup-steps", "2",
                "--repeats", "3", "--out", str(out), "--dpi", "30"]
        for item in small_overrides(small_corpus) + [
                "model.hidden_dim=16", "model.hidden_layers=1",
                "parallel.straggler.ranks=[0]", "parallel.straggler.jitter=0.5"]:
            argv += ["--set", item]
        assert main(argv) == 0
        assert len(slept) == 3 * steps, slept
        return [slept[k * steps:(k + 1) * steps] for k in range(3)]

    first = repeats(tmp_path / "a")
    assert first[0] != first[1] and first[1] != first[2] and first[0] != first[2], first
    assert repeats(tmp_path / "b") == first
