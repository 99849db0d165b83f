"""The GPU for GPU tests: skip without one, fail when MPITRAIN_TEST_GPU=1 demands one.

Example::

    cupy = gpu_required()       # inside a test or fixture
"""

from __future__ import annotations

import os

GPU_REQUIRED_ENV = "MPITRAIN_TEST_GPU"


def gpu_required():
    """The CuPy module with a device selected, or a pytest skip (a failure when required)."""
    import pytest

    from .. import backend
    if not backend.gpu_available():
        if os.environ.get(GPU_REQUIRED_ENV) == "1":
            pytest.fail(f"{GPU_REQUIRED_ENV}=1 but CuPy with a usable CUDA device is missing")
        pytest.skip("CuPy with a usable CUDA device is not available")
    return backend.select("gpu")
