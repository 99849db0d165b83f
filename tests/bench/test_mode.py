"""Benchmark mode: ``mpiexec -n 2 python -m mpitrain bench`` on a tiny corpus, and
the pure pieces it is built from (crossing interpolation, throughput windows)."""

import json
import math

import numpy as np
import pytest

from mpitrain.bench import options as bench_options
from mpitrain.bench.options import BenchOptions, default_sizes
from mpitrain.bench.phases import eval_interval_per_rank, first_crossing, throughput_from_records
from mpitrain.bench.projection import NetworkModel, project_speedups
from mpitrain.parallel import registry
from mpitrain.testing.mpirun import run_mpi

TINY_CONFIG = """\
data:
  train: {corpus}/train
  dev: {corpus}/dev
  chunk_frames: 5000
model:
  hidden_layers: 2
  hidden_dim: 48
optimizer:
  initial_learning_rate: 0.004
  final_learning_rate: 0.001
training:
  epochs: 2
  minibatch: 128
  log_interval: 1000
parallel:
  average_every: 4
"""
METHODS = ["model_averaging", "allreduce"]
TARGET = 0.12


def _output(result):
    return f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    from mpitrain.data.synthetic import synthesize
    root = tmp_path_factory.mktemp("bench")
    synthesize(str(root / "corpus"), hours=0.05, speakers=8, shards=2, seed=3,
               dev_hours=0.01, dev_speakers=2)
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG.format(corpus=root / "corpus"))
    out = root / "out"
    result = run_mpi(2, ["-m", "mpitrain", "bench", str(config), "--methods", ",".join(METHODS),
                         "--target-accuracy", str(TARGET), "--out", str(out), "--steps", "6",
                         "--warmup-steps", "3", "--repeats", "2", "--project-to", "16,32",
                         "--max-seconds", "30",
                         "--latency-us", "10", "--bandwidth-gbit", "8"], timeout=90)
    return result, out


@pytest.mark.mpi
def test_bench_writes_json_with_every_measurement(bench_run):
    result, out = bench_run
    assert result.returncode == 0, _output(result)
    with open(out / "bench.json") as fh:
        report = json.load(fh)
    assert report["sizes"] == [1, 2] and report["methods"] == METHODS
    env = report["environment"]
    assert env["ranks"] == 2 and env["hosts"] and env["cpu_count"] >= 1
    assert env["mpi"]["library_version"] and env["mpi"]["standard"]
    assert env["versions"]["numpy"] == np.__version__
    assert isinstance(env["blas"], list) and env["blas"]
    # throughput: every method at every size, a split of each step into compute and comm
    assert sorted((r["method"], r["ranks"]) for r in report["throughput"]) == \
        sorted((m, n) for m in METHODS for n in (1, 2))
    for row in report["throughput"]:
        assert row["frames_per_sec"] > 0 and 0 <= row["comm_fraction"] <= 1
        assert row["frames_per_sec_per_rank"] == pytest.approx(row["frames_per_sec"]
                                                               / row["ranks"])
        assert row["compute_seconds_per_step"] + row["comm_seconds_per_step"] == \
            pytest.approx(row["step_seconds"])
        # two runs each; the one kept is the lower median (of two: the slower)
        assert len(row["repeat_frames_per_sec"]) == 2
        assert row["frames_per_sec"] == min(row["repeat_frames_per_sec"])
    # time to accuracy: evaluation points, and the crossing recomputed from them
    assert len(report["accuracy"]) == 4
    for row in report["accuracy"]:
        assert row["points"], row
        crossing = first_crossing(row["points"], TARGET)
        assert row["reached"] == (crossing is not None)
        if crossing:
            assert row["frames_to_target"] == pytest.approx(crossing["frames"])
            assert row["stopped_by"] == "target"
    # speedups follow from the rows
    by = {(r["method"], r["ranks"]): r for r in report["throughput"]}
    for s in report["speedups"]:
        expected = by[s["method"], s["ranks"]]["frames_per_sec"] / \
            by[s["method"], 1]["frames_per_sec"]
        assert s["throughput_speedup"] == pytest.approx(expected)
    # the projection uses the stated network model and the measured one-rank step
    net = NetworkModel(**report["network_model"])
    assert net.latency_s == pytest.approx(10e-6) and net.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert any("2(N-1)/N" in a for a in report["assumptions"])
    for method in METHODS:
        proj = report["projections"][method]
        assert proj["compute_seconds_per_step"] == \
            by[method, 1]["compute_seconds_per_step"]
        rows = project_speedups([1, 2, 16, 32], compute_seconds=proj["compute_seconds_per_step"],
                                nbytes=proj["bytes_per_allreduce"],
                                sync_every=proj["sync_every_steps"], network=net,
                                frames_exponent=proj["frames_exponent"])
        assert [r["throughput_speedup"] for r in proj["rows"]] == \
            pytest.approx([r["throughput_speedup"] for r in rows])
    assert report["projections"]["allreduce"]["sync_every_steps"] == 1
    assert report["projections"]["model_averaging"]["sync_every_steps"] == 4


@pytest.mark.mpi
def test_bench_writes_plots_and_markdown(bench_run):
    import matplotlib.image as mpimg
    result, out = bench_run
    assert result.returncode == 0, _output(result)
    for name in ("bench-speedup.png", "bench-accuracy.png"):
        with open(out / name, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n", name
        image = mpimg.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400, image.shape
        assert float(image[..., :3].std()) > 0.05, f"{name} looks blank"
    text = (out / "bench.md").read_text()
    assert "| method | ranks | frames/s" in text
    for method in METHODS:
        assert f"| {method} | 2 |" in text
    assert "## Assumptions of the projection" in text and "N=32" in text
    # rank 0 alone reports
    assert result.stdout.count("projection model:") == 1, _output(result)


# -- the pure pieces ----------------------------------------------------------------------

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
    records = [  # cumulative frames; the first window is warm-up
        {"step": 5, "frames": 1280, "frames_per_sec": 100.0, "comm_fraction": 0.9},
        {"step": 10, "frames": 2560, "frames_per_sec": 1280.0, "comm_fraction": 0.25},
        {"step": 20, "frames": 5120, "frames_per_sec": 1280.0, "comm_fraction": 0.5}]
    # windows: 1280 frames in 1 s (0.25 s comm), 2560 frames in 2 s (1 s comm)
    got = throughput_from_records(records, ranks=2)
    assert got["frames_per_sec"] == pytest.approx(3840 / 3)
    assert got["frames_per_sec_per_rank"] == pytest.approx(3840 / 3 / 2)
    assert got["comm_fraction"] == pytest.approx(1.25 / 3)
    assert got["step_seconds"] == pytest.approx(3 / 15)
    assert got["compute_seconds_per_step"] == pytest.approx(3 / 15 * (1 - 1.25 / 3))
    with pytest.raises(ValueError, match="two progress records"):
        throughput_from_records(records[:1], ranks=1)


def test_eval_interval_and_sizes():
    # 20000 frames over 2 ranks = 10000 per rank, rounded up to blocks of 8 x 256 = 2048
    assert eval_interval_per_rank(20000, ranks=2, minibatch=256, sync_period=8) == 5 * 2048
    assert eval_interval_per_rank(1, ranks=4, minibatch=128, sync_period=1) == 128
    assert default_sizes(1) == (1,) and default_sizes(4) == (1, 2, 4)
    assert default_sizes(6) == (1, 2, 4, 6)


def test_methods_come_from_the_strategy_registry(monkeypatch):
    assert BenchOptions().resolve(2) == ((1, 2), tuple(registry.METHODS))
    monkeypatch.setitem(registry.METHODS, "ring_mix", registry.METHODS["model_averaging"])
    assert "ring_mix" in BenchOptions().resolve(2)[1]
    assert BenchOptions(methods=("ring_mix",)).methods == ("ring_mix",)
    assert bench_options.METHODS is registry.METHODS


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="--sizes: must include 1"):
        BenchOptions(sizes=(2, 4))
    with pytest.raises(ValueError, match="--methods: unknown nope"):
        BenchOptions(methods=("nope",))
    with pytest.raises(ValueError, match="--target-accuracy"):
        BenchOptions(target_accuracy=1.5)
    with pytest.raises(ValueError, match="--sizes: 4 ranks asked for, but the job has 2"):
        BenchOptions(sizes=(1, 4)).resolve(2)
    assert not math.isnan(BenchOptions().network.latency_s)
