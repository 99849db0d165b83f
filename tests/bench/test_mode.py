"""Benchmark mode: ``mpiexec -n 2 python -m mpitrain bench`` on a tiny corpus writes
every measurement, the plots and the Markdown report (its pure pieces are tested
in test_phases.py, test_options.py and test_projection.py)."""

import json
import os

import numpy as np
import pytest

from mpitrain.bench.phases import first_crossing
from mpitrain.bench.projection import NetworkModel, project_speedups
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


def test_real_rank_bench_hands_on_each_finished_size_but_the_last(small_corpus, tmp_path,
                                                                  monkeypatch):
    # the real-rank loop, on two virtual ranks standing in for an mpiexec job (their
    # clock stands still without a compute model, so the measurement is a stand-in)
    from mpitrain.bench import mode
    from mpitrain.bench.mode import run_bench
    from mpitrain.bench.options import BenchOptions
    from mpitrain.comm.virtual import VirtualCluster
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART, small_overrides
    cfg = load_config(QUICKSTART, small_overrides(small_corpus)
                      + ["model.hidden_dim=32", "model.hidden_layers=2"])

    def measured(cfg, group, *, methods, options, out_dir):
        group.barrier()
        return [{"method": m, "ranks": group.size, "frames_per_sec": 1000.0 * group.size,
                 "frames_per_sec_per_rank": 1000.0, "step_seconds": 0.25, "comm_fraction": 0.0,
                 "compute_seconds_per_step": 0.25, "num_params": 1000, "sync_period": 8}
                for m in methods]
    monkeypatch.setattr(mode, "throughput_phase", measured)
    handed = []
    options = BenchOptions(sizes=(1, 2), methods=("model_averaging",), phases=("throughput",),
                           throughput_steps=4, warmup_steps=1)
    reports = VirtualCluster(2).run(lambda comm: run_bench(
        cfg, comm, out_dir=str(tmp_path), options=options, stream=open(os.devnull, "w"),
        on_size_done=handed.append))
    assert reports[1] is None and reports[0]["sizes"] == [1, 2] and "partial" not in reports[0]
    assert len(handed) == 1
    assert handed[0]["partial"] == {"sizes_measured": [1], "sizes_planned": [1, 2]}
    assert [r["ranks"] for r in handed[0]["throughput"]] == [1]


@pytest.mark.mpi
def test_a_corpus_one_rank_cannot_read_stops_every_rank_with_one_line(small_corpus, tmp_path):
    """Each rank reads the manifests; a rank whose node does not see the corpus left
    bench with status 2 and said nothing while the others went on to the first
    collective (the job hung or was killed by the launcher without a word)."""
    from ..helpers import QUICKSTART, WORKERS, small_overrides
    argv = [str(WORKERS / "unseen_corpus_worker.py"), "1", "--", "bench", QUICKSTART,
            "--sizes", "1,2", "--steps", "2", "--warmup-steps", "1", "--methods",
            "model_averaging", "--out", str(tmp_path / "bench")]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        argv += ["--set", item]
    result = run_mpi(2, argv, timeout=60, cwd=str(tmp_path))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors and errors[0].startswith(f"mpitrain bench: error: rank 1: {QUICKSTART}: "
                                           "data.train: "), result.stderr
    assert "not found on this node" in errors[0]
    assert not (tmp_path / "bench").exists()
