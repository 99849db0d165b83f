"""The scaling benchmark under `mpiexec -n 2`: a smoke test (the figures depend on
the machine and are not asserted, only that every row is there)."""

import json

import pytest

from mpitrain.testing.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def _output(result):
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


def test_scaling_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "scaling.json"
    result = run_mpi(2, ["-m", "mpitrain.bench.scaling", "--model", "tiny", "--rounds", "2",
                         "--steps", "8", "--skip", "1", "--json", str(out)], timeout=120)
    assert result.returncode == 0, _output(result)
    assert "model averaging every 8 / no communication:" in result.stdout, _output(result)
    summary = json.loads(out.read_text())
    rows = {r["method"]: r for r in summary["rows"]}
    assert list(rows) == ["1 rank", "no communication", "model_averaging", "allreduce",
                          "kaldi", "bmuf"]
    assert rows["1 rank"]["ranks"] == 1 and rows["allreduce"]["ranks"] == 2
    assert rows["no communication"]["comm_fraction"] == 0.0
    assert rows["allreduce"]["comm_fraction"] > 0.0           # it did communicate
    assert summary["averaging_vs_no_comm"] == rows["model_averaging"]["vs_no_comm"]
    for row in rows.values():
        assert row["fps"] > 0 and row["rounds"] == 2
