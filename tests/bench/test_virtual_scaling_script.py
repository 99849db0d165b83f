"""scripts/virtual_scaling.py reads one method's rows of a bench report."""

import json
import sys

import pytest

from ..helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import virtual_scaling  # noqa: E402

REPORT = REPO / "docs" / "data" / "virtual-scaling" / "late" / "bmuf05-n16.bench.json"


def test_a_run_of_one_method_is_read_as_it_is():
    run = virtual_scaling.load_run("bmuf", str(REPORT))
    assert run["method"] == "bmuf" and [r["ranks"] for r in run["rows"]] == [1, 16]


def test_a_run_of_several_methods_needs_one_named(tmp_path):
    report = json.loads(REPORT.read_text())
    report["methods"] = ["bmuf", "allreduce"]
    report["accuracy"] += [dict(row, method="allreduce", frames_to_target=1.0)
                           for row in report["accuracy"]]
    path = tmp_path / "two.json"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="measured bmuf, allreduce; name one"):
        virtual_scaling.load_run("two", str(path))
    run = virtual_scaling.load_run("two", f"{path}#allreduce")
    assert run["method"] == "allreduce"
    assert [r["frames_to_target"] for r in run["rows"]] == [1.0, 1.0]

