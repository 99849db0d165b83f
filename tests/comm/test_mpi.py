"""MpiCommunicator under real `mpiexec -n 2` and `-n 4` launches.

Each launch costs about a second, so one worker script runs all buffer and
object checks per rank count; the abort behaviour gets its own short launches.
"""

import json
import os
import time
from pathlib import Path

import pytest

from mpitrain import backend
from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi

pytestmark = pytest.mark.mpi

WORKERS = Path(__file__).resolve().parents[1] / "workers"
CHECKS = ["identity", "allreduce_", "allreduce_ in pieces", "bcast_", "sendrecv ring", "isend/irecv",
          "send/recv/iprobe", "iallreduce_", "split", "dup", "allreduce_scalar",
          "objects", "comm_time", "wtime"]


def _output(result):
    return f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


@pytest.mark.parametrize("nranks", [2, 4])
def test_comm_worker_all_checks(nranks):
    result = run_mpi(nranks, [str(WORKERS / "comm_worker.py"), str(nranks)], timeout=120)
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == CHECKS, _output(result)
    assert f"all checks passed on {nranks} ranks" in result.stdout


def test_device_routes_with_a_stand_in_device():
    # Route choice, pinned staging (with reuse) and the CUDA-aware path, GPU-free.
    result = run_mpi(2, [str(WORKERS / "device_route_worker.py")], timeout=120)
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == ["host-staged route", "point to point before setup",
                      "forced route refused", "cuda-aware route", "forced host-staged"]


# (scenario of nccl_setup_worker.py, what rank 0 reports); the worker checks
# the reason and the reduced values, see its SCENARIOS.
NCCL_SCENARIOS = [
    ("cupy13-tuple", "nccl"),
    ("cupy14-bytes", "nccl"),
    ("tuple-id-bytes-init", "nccl"),
    ("unsigned-id-signed-init", "nccl"),
    ("init-fails-on-one-rank", "host-staged"),
    ("init-hangs-on-one-rank", "host-staged"),
    ("unique-id-fails", "host-staged"),
    ("nccl-unavailable", "host-staged"),
    ("nccl-missing-on-one-rank", "host-staged"),
    ("shared-gpu", "host-staged"),
    ("shared-gpu-without-pci", "host-staged"),
    ("same-id-distinct-pci", "nccl"),
    ("forced-nccl-works", "nccl"),
    ("forced-nccl-init-fails", "RuntimeError on every rank"),
    ("forced-nccl-shared-gpu", "RuntimeError on every rank"),
]


@pytest.mark.parametrize("scenario,outcome", NCCL_SCENARIOS, ids=[s for s, _ in NCCL_SCENARIOS])
def test_nccl_setup_with_a_stand_in_binding(scenario, outcome, tmp_path):
    # NCCL set-up against each CuPy API variant and failure, GPU-free; a rank
    # left waiting in NCCL's init would show up as a timeout here.
    try:
        result = run_mpi(2, [str(WORKERS / "nccl_setup_worker.py"), scenario, str(tmp_path)],
                         timeout=90)
    except MpiTimeoutError as exc:
        pytest.fail(f"NCCL set-up hung: {exc}")
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == [f"{scenario}: {outcome}"], _output(result)
    assert f"nccl_setup_worker: {scenario} passed" in result.stdout, _output(result)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["auto", "host-staged"])
def test_comm_worker_device_buffers(transport):
    if not backend.gpu_available():
        if os.environ.get("MPITRAIN_TEST_GPU") == "1":
            pytest.fail("MPITRAIN_TEST_GPU=1 but no CUDA device is usable")
        pytest.skip("needs cupy and a CUDA device")
    result = run_mpi(2, [str(WORKERS / "comm_worker.py"), "2", "--xp", "cupy",
                         "--transport", transport], timeout=180)
    assert result.returncode == 0, _output(result)
    assert "all checks passed on 2 ranks (cupy)" in result.stdout, _output(result)


@pytest.mark.parametrize("mode,message", [
    ("hook", "deliberate failure on rank 1 (hook)"),
    ("context", "deliberate failure on rank 1 (context)"),
    ("exit", "exiting with status 3"),
])
def test_failing_rank_aborts_the_job(mode, message):
    timeout = 60
    start = time.monotonic()
    try:
        result = run_mpi(2, [str(WORKERS / "abort_worker.py"), mode], timeout=timeout)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung instead of aborting: {exc}")
    elapsed = time.monotonic() - start
    assert result.returncode != 0, _output(result)
    assert message in result.stdout + result.stderr, _output(result)
    assert "[rank 1/2]" in result.stderr, _output(result)
    assert "passed a barrier" not in result.stdout, _output(result)
    assert elapsed < timeout / 3, f"abort took {elapsed:.1f} s"


def test_hung_job_is_killed_with_a_clear_error():
    start = time.monotonic()
    with pytest.raises(MpiTimeoutError, match=r"did not finish within 3 s"):
        run_mpi(2, ["-c", "import time; time.sleep(60)"], timeout=3)
    assert time.monotonic() - start < 20


def test_worker_skip_code_becomes_pytest_skip():
    code = ("from mpitrain.testing.mpirun import skip_worker; "
            "skip_worker('nothing to do here')")
    with pytest.raises(pytest.skip.Exception, match="nothing to do here"):
        run_mpi(2, ["-c", code], timeout=60)


def test_collectives_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "rows.json"
    result = run_mpi(2, ["-m", "mpitrain.bench.collectives", "--sizes", "0.01,0.1",
                         "--repeats", "3", "--skip", "1", "--json", str(out)], timeout=120)
    assert result.returncode == 0, _output(result)
    assert "sum/bare" in result.stdout and "2 ranks" in result.stdout
    rows = json.loads(out.read_text())
    assert [round(r["mb"], 2) for r in rows] == [0.01, 0.1]
    for row in rows:
        assert row["bare_ms"] > 0 and row["ours_sum_ms"] > 0
        assert abs(row["ratio_sum"] - row["ours_sum_ms"] / row["bare_ms"]) < 1e-9
