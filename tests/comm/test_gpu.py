"""The device transports under `mpiexec -n 2`, GPU-free: route choice, pinned staging
and the CUDA-aware path with a stand-in device, and NCCL set-up against each CuPy
API variant and failure with a stand-in binding (tests/workers/fake_cupy.py)."""

import pytest

from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi

from ..helpers import WORKERS

pytestmark = pytest.mark.mpi


def _output(result):
    return f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def test_device_routes_with_a_stand_in_device():
    # Route choice, pinned staging (with reuse) and the CUDA-aware path, GPU-free.
    result = run_mpi(2, [str(WORKERS / "device_route_worker.py")], timeout=120)
    assert result.returncode == 0, _output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == ["device arrays are no host memory", "host-staged route",
                      "point to point before setup", "forced route refused",
                      "cuda-aware route", "forced host-staged"]


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


# (scenario of gpu_placement_worker.py, the physical GPU of ranks 0..3)
PLACEMENTS = [
    ("closest-cyclic", [0, 2, 1, 3]),       # not 0 3 0 3: local rank mod 2 per socket's list
    ("closest-block", [0, 1, 2, 3]),
    ("one-per-task", [0, 1, 2, 3]),
    ("all-visible", [0, 1, 2, 3]),
    ("more-ranks-than-gpus", [0, 1, 0, 1]),
]


@pytest.mark.parametrize("scenario,gpus", PLACEMENTS, ids=[s for s, _ in PLACEMENTS])
def test_each_rank_takes_its_own_gpu_of_those_it_sees(scenario, gpus):
    # Ranks seeing different GPU lists (srun --gpu-bind=closest, tasks alternating
    # sockets) are numbered apart; ranks sharing a GPU are named whatever the route.
    result = run_mpi(4, [str(WORKERS / "gpu_placement_worker.py"), scenario], timeout=120)
    assert result.returncode == 0, _output(result)
    lines = result.stdout.splitlines()
    assert f"placement {' '.join(map(str, gpus))}" in lines, _output(result)
    reasons = [line for line in lines if line.startswith("reason ")]
    assert len(reasons) == 2, _output(result)
    for line in reasons:
        if len(set(gpus)) < len(gpus):
            assert "ranks 0 and 2 share GPU 0" in line, _output(result)
        else:
            assert "share" not in line, _output(result)


def test_a_forced_route_that_cannot_be_used_stops_every_rank_with_one_line(small_corpus,
                                                                          tmp_path):
    """Every rank finds the route unusable at the same point: rank 0 says so once,
    naming the config file, and every rank exits with status 2 (no abort)."""
    try:
        result = run_mpi(2, [str(WORKERS / "forced_route_worker.py"), small_corpus,
                             str(tmp_path / "run")], timeout=120)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung: {exc}")
    assert result.returncode == 2, _output(result)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, _output(result)
    assert errors[0].startswith("mpitrain train: error: ") and "quickstart.yaml: device " \
        "transport 'cuda-aware-mpi' was requested (device_transport) but cannot be used: " \
        "CUDA-aware MPI " in errors[0], _output(result)
    assert "MPI_Abort" not in result.stderr + result.stdout, _output(result)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
