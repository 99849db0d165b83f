"""The bench report's files: the measurements are written whatever the plots do."""

import json

from ..helpers import REPO, without_module

REPORT = REPO / "docs" / "data" / "virtual-scaling" / "late" / "bmuf05-n16.bench.json"


def test_a_report_without_matplotlib_keeps_its_measurements(tmp_path, monkeypatch):
    from mpitrain.bench.report import write_report
    report = json.loads(REPORT.read_text())
    without_module(monkeypatch, "matplotlib")
    paths = write_report(report, str(tmp_path / "out"))
    assert sorted(paths) == ["json", "markdown"]
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["accuracy"] == report["accuracy"]
    assert "matplotlib is not installed" in (tmp_path / "out" / "bench.md").read_text()
