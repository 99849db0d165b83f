"""scripts/gpu-check.sh without a GPU: what it runs, and that any failure fails it.

The interpreter and the launcher are stand-ins that log their arguments (and
fail where told), so the script's sequence is checked on any machine."""

from __future__ import annotations

import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stand_in(path, log, fail_on="", says=("@never@", "")):
    """A command that logs its arguments, fails on ``fail_on`` in them and prints
    ``says[1]`` when they hold ``says[0]``."""
    path.write_text(f"""#!/bin/sh
echo "$(basename "$0") $*" >> {log}
case "$*" in *{says[0]}*) echo "{says[1]}";; esac
case "$*" in *{fail_on or "@never@"}*) exit 1;; esac
exit 0
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _run(tmp_path, fail_on="", launch_fails_on="", launch_says=("@never@", "")):
    log = tmp_path / "calls.log"
    env = dict(os.environ, PYTHON=_stand_in(tmp_path / "python", log, fail_on),
               MPIEXEC=_stand_in(tmp_path / "mpiexec", log, launch_fails_on, launch_says),
               OUT=str(tmp_path / "out"),
               TESTS="0")
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-check.sh")], env=env,
                            capture_output=True, text=True, timeout=60)
    return result, log.read_text().splitlines()


def test_every_method_then_the_benchmarks_are_run(tmp_path):
    result, calls = _run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    trains = [c for c in calls if c.startswith("mpiexec") and " train " in c]
    assert all("--set device=gpu" in c for c in trains)
    assert [c.split("parallel.method=")[1].split()[0] for c in trains] == \
        ["model_averaging", "kaldi", "allreduce", "bmuf", "adpsgd", "adpsgd", "param_server"] \
        + ["model_averaging"] * 3
    extras = [" ".join(w for w in c.split() if "=" in w and not w.startswith(
        ("device=", "parallel.method=", "data.", "training.epochs="))) for c in trains]
    assert extras == [""] * 5 + ["parallel.asynchronous=true", "", "optimizer.name=ngsgd",
                                 "cuda_graph=true", "precision=bf16"]
    bench = [c for c in calls if c.startswith("mpiexec") and " bench " in c]
    assert len(bench) == 1 and "--set device=gpu" in bench[0] \
        and "--methods model_averaging --phases throughput" in bench[0]
    ngsgd = [c for c in calls if "mpitrain.bench.ngsgd_overhead" in c]
    assert len(ngsgd) == 2 and all("--delayed-updates --plan-threads 0,4" in c for c in ngsgd)
    assert "--cuda-graph" in ngsgd[1] and "--cuda-graph" not in ngsgd[0]
    assert any("mpitrain.bench.throughput --device gpu" in c for c in calls)


def test_a_failing_benchmark_fails_the_check_and_is_named(tmp_path):
    result, _ = _run(tmp_path, fail_on="--cuda-graph")
    assert result.returncode == 1
    assert "NG-SGD overhead benchmark with CUDA graphs" in result.stdout


def test_a_method_that_fails_fails_the_check_and_is_named(tmp_path):
    result, calls = _run(tmp_path, launch_fails_on="parallel.asynchronous=true")
    assert result.returncode == 1
    assert "  - adpsgd-asynchronous failed" in result.stdout.splitlines()
    # the methods after it still run
    assert any("optimizer.name=ngsgd" in c for c in calls)


def test_a_cuda_graph_run_that_fell_back_to_eager_steps_fails_the_check(tmp_path):
    """A capture that fails turns graphs off with one line and the run still learns:
    that line fails the check, naming why (a CuPy or CUDA that refuses the capture)."""
    line = "cuda_graph: off for this run (capture failed: NotImplementedError: no)"
    result, _ = _run(tmp_path, launch_says=("cuda_graph=true", line))
    assert result.returncode == 1
    assert f"  - model_averaging-cuda-graph ran without CUDA graphs: {line}" \
        in result.stdout.splitlines()
    # the same line from another run is not the graphs' business
    result, _ = _run(tmp_path, launch_says=("precision=bf16", line))
    assert result.returncode == 0, result.stdout
