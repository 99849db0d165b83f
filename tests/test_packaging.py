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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel ``pip install --no-build-isolation .`` builds and installs."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")       # setuptools before 70.1 builds wheels with it
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                             "--no-build-isolation", "--no-index", "-w", str(out), REPO],
                            capture_output=True, text=True, timeout=300, cwd=out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out / next(p for p in os.listdir(out) if p.endswith(".whl"))


def test_wheel_built_without_isolation_ships_configs_license_and_version(wheel):
    assert wheel.name.startswith(f"mpitrain-{mpitrain.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "mpitrain/configs/quickstart.yaml" in names
        assert "mpitrain/starter.py" in names
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert re.search(r"^License(-Expression)?: Apache-2.0$", metadata, re.M), metadata
    assert any(n.endswith("LICENSE") for n in names)


def test_sdist_holds_the_tests_docs_scripts_and_jobs(tmp_path):
    """The sdist held the top-level test files alone (setuptools' default), which
    cannot run without tests/conftest.py and tests/helpers.py, and none of the docs,
    scripts and Slurm jobs the README names."""
    import shutil
    import tarfile
    pytest.importorskip("setuptools")
    # a clean copy: an earlier build's egg-info lists files the sdist then takes
    tree = tmp_path / "tree"
    outputs = {".git", ".venv", "build", "dist", "runs", "data", "corpus", "bench-out"}

    def ignore(folder, names):
        top = os.path.samefile(folder, REPO)
        return [n for n in names if n in ("__pycache__", ".pytest_cache")
                or n.endswith(".egg-info") or (top and n in outputs)]
    shutil.copytree(REPO, tree, ignore=ignore)
    result = subprocess.run([sys.executable, "-c", "import sys; from setuptools import "
                             "build_meta; build_meta.build_sdist(sys.argv[1])", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=tree)
    assert result.returncode == 0, result.stdout + result.stderr
    sdist = next(p for p in os.listdir(tmp_path) if p.endswith(".tar.gz"))
    with tarfile.open(tmp_path / sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    expected = ["tests/helpers.py", "docs/user-guide.md", "scripts/test.sh",
                "scripts/quickstart.sh", "jobs/slurm/train.sbatch", "jobs/configs/quickstart.yaml",
                "LICENSE", "setup.py"]
    for folder in ("tests", "docs"):
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".pytest_cache")]
            expected += [os.path.relpath(os.path.join(root, f), REPO) for f in files
                         if f.endswith((".py", ".md"))]
    assert not [name for name in expected if name not in names]


def test_an_installed_mpitrain_finds_its_examples_without_the_source_tree(wheel, tmp_path):
    """Installed, with no jobs/ beside the package: init writes every example, and
    bench.convergence starts from the shipped quickstart (it looked for
    site-packages/jobs/configs/quickstart.yaml, and its first run failed)."""
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                             "--target", str(target), str(wheel)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    env = dict(os.environ, PYTHONPATH=str(target))
    script = ("import os, sys, mpitrain\n"
              "from mpitrain.starter import example_configs\n"
              "from mpitrain.bench import convergence\n"
              "assert mpitrain.__file__.startswith(sys.argv[1]), mpitrain.__file__\n"
              "print(' '.join(example_configs()))\n"
              "path = convergence.base_config()\n"
              "assert path.startswith(sys.argv[1]) and os.path.isfile(path), path\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    result = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True,
                            text=True, timeout=120, cwd=work, env=env)
    assert result.returncode == 0, result.stderr
    examples = result.stdout.split()
    assert "quickstart" in examples and "speech" in examples
    for name in examples:
        done = subprocess.run([sys.executable, "-m", "mpitrain", "init", name, "--example",
                               name], capture_output=True, text=True, timeout=120, cwd=work,
                              env=env)
        assert done.returncode == 0, done.stderr
        assert (work / name / "mpitrain.yaml").is_file()
