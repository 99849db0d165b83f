"""Benchmark mode on virtual ranks (bench/virtual.py), through `mpitrain bench --virtual`.

The report has the real-rank mode's files and tables; every row is marked
simulated and says how many frames each rank saw and how many syncs it took;
the report states the compute and network assumptions; simulated throughput
follows the compute and network models.
"""

import json
import os

import pytest

from mpitrain.cli import main

from ..helpers import QUICKSTART, drain_queued_steps_at_the_read, small_overrides


def _throughput_bench(corpus, out, sizes, methods, *options, sets=(), steps=8,
                      model=("model.hidden_dim=16", "model.hidden_layers=1")):
    """``bench --virtual SIZES --methods METHODS --phases throughput`` of the quickstart
    config on ``corpus``, steps of 2 ms; ``options`` more flags, ``sets`` more
    ``--set`` values; main's status."""
    argv = ["bench", QUICKSTART, "--virtual", sizes, "--methods", methods,
            "--phases", "throughput", "--steps", str(steps), "--warmup-steps", "2",
            "--compute-ms", "2", *options, "--out", str(out), "--dpi", "30"]
    for item in small_overrides(corpus) + list(model) + list(sets):
        argv += ["--set", item]
    return main(argv)


def test_bench_virtual_writes_the_report_with_simulated_points(small_corpus, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2,4", "--methods", "model_averaging,allreduce",
            "--steps", "16", "--warmup-steps", "4", "--target-accuracy", "0.08",
            "--compute-ms", "2", "--out", str(out), "--dpi", "40"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=32", "model.hidden_layers=2", "training.epochs=1",
            "parallel.average_every=4"]:
        argv += ["--set", item]
    assert main(argv) == 0
    # the console shows the projection, labelled, as a benchmark on real ranks does
    printed = capsys.readouterr().out
    assert printed.count("projection model:") == 1, printed
    for method in ("model_averaging", "allreduce"):
        assert f"projected (not measured), {method} at N=128:" in printed, printed
    report = json.loads((out / "bench.json").read_text())
    assert report["sizes"] == [1, 2, 4]
    rows = report["throughput"] + report["accuracy"]
    assert len(report["throughput"]) == 6 and all(r["simulated"] for r in rows)
    for row in report["throughput"]:
        assert row["frames_per_rank"] == 20 * 256
        expected_syncs = 0 if row["ranks"] == 1 else (
            20 if row["method"] == "allreduce" else 5)
        assert row["syncs"] == expected_syncs, row
        # 2 ms a step; the communication share is what the network model adds
        assert row["compute_seconds_per_step"] == pytest.approx(0.002, rel=1e-6)
        assert row["frames_per_sec_per_rank"] <= 256 / 0.002 * (1 + 1e-9)
    assert report["virtual"]["compute"]["step_seconds"] == 0.002
    assert report["virtual"]["network"]["bandwidth_bytes_per_s"] == 12.5e9
    assert any("2 ms per step" in a for a in report["virtual"]["assumptions"])
    for row in report["accuracy"]:
        assert row["frames_per_rank"] == pytest.approx(row["frames"] / row["ranks"])
    speedups = {(s["method"], s["ranks"]): s for s in report["speedups"]}
    assert speedups[("model_averaging", 4)]["throughput_speedup"] == pytest.approx(4, rel=0.05)
    text = (out / "bench.md").read_text()
    assert "## Simulated points (virtual ranks)" in text and "frames per rank" in text
    # its steps and frames count the warm-up, its seconds do not: the table says so
    assert "a throughput run's warm-up included" in text
    assert os.path.getsize(out / "bench-speedup.png") > 1000


def test_bench_virtual_accuracy_only_with_linear_rates(small_corpus, tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2", "--methods", "allreduce",
            "--phases", "accuracy", "--lr-scale", "linear", "--target-accuracy", "0.08",
            "--compute-ms", "2", "--out", str(out), "--dpi", "40"]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=32", "model.hidden_layers=2", "training.epochs=1",
            "optimizer.initial_learning_rate=0.003"]:
        argv += ["--set", item]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["throughput"] == [] and report["options"]["lr_scale"] == "linear"
    rates = {r["ranks"]: r["initial_learning_rate"] for r in report["accuracy"]}
    assert rates == {1: pytest.approx(0.003), 2: pytest.approx(0.006)}
    # no throughput rows: the report says there is no projection, not an empty table
    assert "None: the projection needs the throughput phase." in (out / "bench.md").read_text()


def test_a_bench_stopped_halfway_keeps_the_sizes_it_measured(small_corpus, tmp_path,
                                                             monkeypatch, capsys):
    # a time limit or Ctrl-C during the last size: the sizes before it stay on disk
    from mpitrain.comm.virtual import VirtualCluster
    run = VirtualCluster.run

    def stopped_at_size_4(cluster, rank_main):
        if cluster.size == 4:
            raise KeyboardInterrupt
        return run(cluster, rank_main)
    monkeypatch.setattr(VirtualCluster, "run", stopped_at_size_4)
    out = tmp_path / "bench"

    def bench(*options):
        return _throughput_bench(small_corpus, out, "1,2,4", "model_averaging", *options,
                                 model=("model.hidden_dim=32", "model.hidden_layers=2"))
    assert bench() == 130
    report = json.loads((out / "bench.json").read_text())
    assert report["partial"] == {"sizes_measured": [1, 2], "sizes_planned": [1, 2, 4]}
    assert sorted(r["ranks"] for r in report["throughput"]) == [1, 2]
    assert [s["throughput_speedup"] is not None for s in report["speedups"]] == [True, True]
    text = (out / "bench.md").read_text()
    assert "**Partial report**: sizes 1, 2 measured of 1, 2, 4" in text
    # no load average at an end that had not come (it said "at end None")
    assert "None" not in text.split("## Throughput")[0], text
    assert "partial report (sizes 1, 2)" in capsys.readouterr().out
    # the next bench into the same place keeps it unless told to replace it
    monkeypatch.setattr(VirtualCluster, "run", run)
    assert bench() == 2
    assert "holds an earlier benchmark" in capsys.readouterr().err
    assert bench("--overwrite") == 0
    report = json.loads((out / "bench.json").read_text())
    assert "partial" not in report and report["sizes"] == [1, 2, 4]
    assert "Partial" not in (out / "bench.md").read_text()


@pytest.mark.parametrize("virtual", [True, False])
@pytest.mark.parametrize("key", ["data.train", "data.dev"])
def test_a_corpus_that_cannot_be_read_is_refused_before_anything_is_written(
        small_corpus, tmp_path, capsys, monkeypatch, key, virtual):
    """A missing corpus was found by the first run, which had made its run directory
    and an empty train.log under --out (and a later bench there needed --overwrite)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--steps", "2", "--warmup-steps", "1", "--methods",
            "model_averaging", "--out", str(out)]
    argv += ["--virtual", "1", "--compute-ms", "1"] if virtual else ["--sizes", "1"]
    if key == "data.dev":
        argv += ["--target-accuracy", "0.5"]        # (the phase that reads it)
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                 f"{key}={tmp_path / 'missing'}"]:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"mpitrain bench: error: {QUICKSTART}: {key}: {tmp_path / 'missing'}/"
                   f"corpus.yaml: not found; expected a corpus directory ({tmp_path / 'missing'}"
                   ") holding corpus.yaml, as `mpitrain synth`, `prepare` or `merge` write\n"), err
    assert os.listdir(tmp_path) == []


def test_a_group_larger_than_the_corpus_can_feed_is_refused_before_measuring(small_corpus,
                                                                             tmp_path, capsys):
    """Size 1 was measured and a partial report written before size 64 found too few
    utterances; a rerun then needed --overwrite."""
    from mpitrain.data.corpus import load_manifest
    utterances = load_manifest(os.path.join(small_corpus, "train")).num_utterances
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", f"1,{utterances + 1}", "--steps", "2",
            "--warmup-steps", "1", "--compute-ms", "1", "--methods", "model_averaging",
            "--out", str(out)]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"has {utterances} utterance(s), fewer than the " \
        f"{utterances + 1} ranks of the largest group" in err, err
    assert not out.exists()


def test_a_held_out_corpus_a_throughput_benchmark_never_reads_is_not_refused(small_corpus,
                                                                             tmp_path, capsys):
    # the throughput runs train without data.dev: a config's data.dev that is not there
    # (the default data/synth/dev, with data.train set to another corpus) stopped a
    # benchmark without --target-accuracy that needed none
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--steps", "2", "--warmup-steps", "1", "--methods",
            "model_averaging", "--out", str(out), "--virtual", "1", "--compute-ms", "1"]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                 f"data.dev={tmp_path / 'missing'}"]:
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    assert (out / "bench.json").exists()


def test_a_group_that_leaves_a_rank_no_minibatch_is_refused_before_measuring(small_corpus,
                                                                            tmp_path, capsys):
    """Sizes 1 and 2 were measured and a partial report written before the group of 16
    found a rank without a complete minibatch of 4,000 frames (a share of about 3,400)."""
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2,16", "--steps", "2", "--warmup-steps", "1",
            "--compute-ms", "1", "--methods", "model_averaging", "--out", str(out)]
    for item in small_overrides(small_corpus) + [
            "model.hidden_dim=16", "model.hidden_layers=1", "training.minibatch=4000"]:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": a group of 16 ranks leaves rank " in err \
        and "no complete minibatch of 4000 frames" in err, err
    assert not out.exists()


def test_a_slow_rank_paces_the_measured_throughput_of_every_method(small_corpus, tmp_path):
    # every rank takes the same steps, so a group of 2 with one rank 3x slow runs at the
    # slow rank's pace whatever the method; a method that averages every 4 steps with
    # log lines every 2 hid the wait at each log line between averages (the window
    # ended before it) and came out 1.8x faster than the slow rank can step
    out = tmp_path / "bench"
    assert _throughput_bench(small_corpus, out, "1,2", "model_averaging,allreduce",
                             "--slowdown", "1=3", sets=["parallel.average_every=4"]) == 0
    report = json.loads((out / "bench.json").read_text())
    for row in report["throughput"]:
        if row["ranks"] == 2:
            assert row["step_seconds"] >= 0.006, row
            assert row["frames_per_sec"] <= 2 * 256 / 0.006, row
            # each rank computes its own steps: 2 ms and 6 ms, 4 ms on the mean
            assert row["compute_seconds_per_step"] == pytest.approx(0.004, rel=1e-6), row


def test_the_progress_sums_of_a_throughput_run_are_not_counted_as_the_methods(small_corpus,
                                                                             tmp_path):
    # the benchmark sums its progress every --warmup-steps steps; on many virtual ranks
    # with a slow link that sum's latency would read as the method's communication.
    # Averaging every 100 steps, the 10 measured steps hold no average: 4 ranks are 4x one
    out = tmp_path / "bench"
    assert _throughput_bench(small_corpus, out, "1,4", "model_averaging",
                             "--latency-us", "1000", sets=["parallel.average_every=100"]) == 0
    report = json.loads((out / "bench.json").read_text())
    four = [r for r in report["throughput"] if r["ranks"] == 4][0]
    assert four["comm_fraction"] == pytest.approx(0, abs=1e-9), four
    assert four["step_seconds"] == pytest.approx(0.002, rel=1e-9), four
    speedup = [s for s in report["speedups"] if s["ranks"] == 4][0]["throughput_speedup"]
    assert speedup == pytest.approx(4, rel=1e-9)


def test_a_device_drained_at_the_progress_read_counts_as_training_time(small_corpus, tmp_path,
                                                                      monkeypatch):
    # on a GPU the steps of a window are queued, and the read of its sums before they
    # are added up waits for them: that wait is the steps' compute.  It was timed as
    # the sum's own cost and taken out, and the rank came out faster than it steps
    from mpitrain.bench.phases import BenchTrainer
    # 2 steps of 2 ms still queued at the read
    drain_queued_steps_at_the_read(monkeypatch, BenchTrainer, 0.004)
    out = tmp_path / "bench"
    assert _throughput_bench(small_corpus, out, "1", "model_averaging",
                             sets=["parallel.average_every=100"]) == 0
    row = json.loads((out / "bench.json").read_text())["throughput"][0]
    assert row["step_seconds"] == pytest.approx(0.004, rel=1e-6), row


def test_each_repeat_on_jittered_virtual_ranks_is_its_own_draw(small_corpus, tmp_path):
    # with the jitter seed the same every repeat, the repeats were one run N times
    # (identical frames/s): each repeat draws its own step times, from the seed and
    # the repeat's index, so a second benchmark gives the same repeats again
    def repeats(out):
        assert _throughput_bench(small_corpus, out, "1,2", "model_averaging", "--repeats", "3",
                                 "--jitter", "0.5", sets=["parallel.average_every=4"]) == 0
        report = json.loads((out / "bench.json").read_text())
        return {r["ranks"]: r["repeat_frames_per_sec"] for r in report["throughput"]}

    first = repeats(tmp_path / "a")
    for size in (1, 2):
        # (the clock's rounding alone moves the last digits)
        rates = sorted(first[size])
        assert all(b / a - 1 > 1e-6 for a, b in zip(rates, rates[1:])), first
    assert repeats(tmp_path / "b") == first


def test_a_setting_of_the_methods_benchmarked_is_taken_whatever_the_configs_own_method(
        small_corpus, tmp_path, capsys):
    # the benchmark runs its --methods, not the config's parallel.method: ADPSGD's
    # hierarchical exchange on a model-averaging config was refused at the config
    # ("works with parallel.method adpsgd, not model_averaging") and said nothing of how
    def bench(out, methods):
        return _throughput_bench(small_corpus, out, "1,2", methods, steps=4, sets=[
            "parallel.hierarchical=true", "parallel.ranks_per_node=2"])

    assert bench(tmp_path / "a", "adpsgd") == 0
    report = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert [r["method"] for r in report["throughput"]] == ["adpsgd", "adpsgd"]
    assert report["config"]["parallel"]["hierarchical"] is True
    with open(tmp_path / "a" / "runs" / "throughput-adpsgd-n2" / "config.yaml") as fh:
        assert "hierarchical: true" in fh.read()
    capsys.readouterr()
    # a method among them that cannot take it: one line naming the ones that can
    assert bench(tmp_path / "b", "adpsgd,allreduce") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.hierarchical: true works with parallel.method " \
        "adpsgd, not allreduce" in err and "(--methods adpsgd)" in err, err
    # none that can: said of the method benchmarked, not of the config's own
    assert bench(tmp_path / "c", "allreduce") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "works with parallel.method adpsgd, not allreduce" in err \
        and "model_averaging" not in err, err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("own", [["parallel.method=param_server", "parallel.servers=2"],
                                 ["parallel.method=adpsgd", "parallel.hierarchical=true",
                                  "parallel.ranks_per_node=2"]])
def test_a_setting_of_the_configs_own_method_not_benchmarked_is_left_out_of_the_runs(
        small_corpus, tmp_path, capsys, own):
    # a config written for one method, benchmarked with others: that method's own
    # settings (the parameter server's servers) concern no run of the benchmark, and
    # were refused ("works with parallel.method param_server, not model_averaging")
    out = tmp_path / "bench"
    assert _throughput_bench(small_corpus, out, "1,2", "model_averaging", steps=2,
                             sets=own) == 0
    said = capsys.readouterr().out
    setting = own[1].split("=")[0]
    # said once
    assert said.count(f"{own[1]}: a setting of parallel.method {own[0].split('=')[1]}, "
                      "which the benchmark does not run (it runs model_averaging): left "
                      "out of its runs") == 1, said
    report = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in report["throughput"]] == ["model_averaging"] * 2
    # the runs, and the report's config, hold the setting's default
    from mpitrain.config import ParallelConfig, load_config
    key = setting.split(".")[1]
    run = load_config(str(out / "runs" / "throughput-model_averaging-n2" / "config.yaml"))
    assert getattr(run.parallel, key) == getattr(ParallelConfig(), key)
    assert report["config"]["parallel"][key] == getattr(ParallelConfig(), key)
