"""The collectives benchmark under `mpiexec -n 2`: a smoke test (the figures depend on
the machine and are not asserted, only their consistency)."""

import json

import pytest

from mpitrain.testing.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def _output(result):
    return f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


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
