"""Shim for tools that still run ``setup.py``; the metadata is in pyproject.toml.

It adds two things pyproject.toml cannot say for every setuptools:

- the license: an SPDX expression (``license_expression``) for setuptools
  77 and later, the older ``license`` field before, so installing with
  setuptools 61-76 (``pip install --no-build-isolation .``) works too;
- the example configurations: ``jobs/configs/*.yaml`` are copied into the
  package as ``mpitrain/configs/`` (``mpitrain init`` reads them there).

Example::

    pip install .                           # the usual way
    pip install --no-build-isolation .      # with the environment's setuptools
"""

import glob
import os

import setuptools
from setuptools import setup
from setuptools.command.build_py import build_py

LICENSE = "Apache-2.0"
EXAMPLES = os.path.join("jobs", "configs")


class BuildWithExamples(build_py):
    """build_py that also ships the example configurations as package data."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "mpitrain", "configs")
        self.mkpath(target)
        for path in sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))):
            self.copy_file(path, os.path.join(target, os.path.basename(path)))


def _license_metadata():
    major = int(setuptools.__version__.split(".")[0])
    if major >= 77:
        return {"license_expression": LICENSE}
    return {"license": LICENSE}


setup(cmdclass={"build_py": BuildWithExamples}, **_license_metadata())
