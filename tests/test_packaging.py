"""Packaging: a wheel built with the environment's setuptools (as ``pip install
--no-build-isolation .`` does) carries the license, the version and the
example configurations."""

import os
import re
import subprocess
import sys
import zipfile

import pytest

import mpitrain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(mpitrain.__file__)))


def test_license_file_matches_the_metadata():
    text = open(os.path.join(REPO, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0" in text
    setup_py = open(os.path.join(REPO, "setup.py")).read()
    assert 'LICENSE = "Apache-2.0"' in setup_py
    pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
    # setuptools < 77 refuses a license string in [project]: setup.py sets it
    assert not re.search(r"^license\s*=", pyproject, re.M)


def test_wheel_built_without_isolation_ships_configs_license_and_version(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")       # setuptools before 70.1 builds wheels with it
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                             "--no-build-isolation", "--no-index", "-w", str(tmp_path), REPO],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
    assert wheel.startswith(f"mpitrain-{mpitrain.__version__}-")
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = z.namelist()
        assert "mpitrain/configs/quickstart.yaml" in names
        assert "mpitrain/starter.py" in names
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert re.search(r"^License(-Expression)?: Apache-2.0$", metadata, re.M), metadata
    assert any(n.endswith("LICENSE") for n in names)
