"""The comparison with PyTorch DDP under `mpiexec -n 2`: a smoke test (the figures
depend on the machine and are not asserted, only that every row is there)."""

import json

import pytest

from mpitrain.testing.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def _output(result):
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


def test_ddp_comparison_runs_and_reports(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is a benchmark-only extra")
    out = tmp_path / "ddp.json"
    result = run_mpi(2, ["-m", "mpitrain.bench.ddp_compare", "--model", "tiny", "--rounds",
                         "2", "--steps", "8", "--skip", "1", "--json", str(out)], timeout=180)
    assert result.returncode == 0, _output(result)
    summary = json.loads(out.read_text())
    assert set(summary["ratios"]) == {"no communication", "allreduce", "model averaging"}
    names = [r["contender"] for r in summary["rows"]]
    assert "torch DDP" in names and "torch averager/8" in names
    assert all(r["fps"] > 0 for r in summary["rows"])
    assert "mpitrain / torch frames/s:" in result.stdout


def test_without_pytorch_it_says_so_in_one_line(tmp_path):
    try:
        import torch  # noqa: F401
        pytest.skip("PyTorch is installed: the refusal cannot be seen")
    except ImportError:
        pass
    result = run_mpi(2, ["-m", "mpitrain.bench.ddp_compare", "--model", "tiny", "--rounds",
                         "1"], timeout=120)
    assert result.returncode == 2, _output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PyTorch is not installed" in lines[0], _output(result)
