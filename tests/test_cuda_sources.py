"""The hand-written CUDA kernels compile, checked without a GPU.

CuPy compiles them at run time on the GPU machine; here nvcc (when installed)
compiles the same sources for sm_90, so a syntax or type error is caught by
the CPU suite.  Elementwise kernel bodies are wrapped the way CuPy wraps
them: raw parameters become pointers, the others one element at index ``i``.
"""

import importlib
import re
import shutil
import subprocess

import pytest

from mpitrain import backend
from mpitrain.nn import kernels as nn_kernels
from mpitrain.optim import kernels as optim_kernels

splice_module = importlib.import_module("mpitrain.data.splice")  # the package exports a function of that name
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")

_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long",
          "bool": "bool"}


def _ctype(name: str) -> str:
    if name in _TYPES:
        return _TYPES[name]
    # one-letter placeholders: T is the float type, the others index types
    return "float" if name == "T" else "long long"


def elementwise_as_cuda(in_params: str, out_params: str, body: str, name: str) -> str:
    """A CUDA kernel with CuPy's ElementwiseKernel conventions around ``body``."""
    args, loads = [], []
    for params, is_out in ((in_params, False), (out_params, True)):
        for param in (p.strip() for p in params.split(",") if p.strip()):
            words = param.split()
            raw = words[0] == "raw"
            ctype, var = _ctype(words[-2]), words[-1]
            if raw:
                args.append(f"{'' if is_out else 'const '}{ctype}* {var}")
            elif is_out:
                args.append(f"{ctype}* {var}_array")
                loads.append(f"{ctype}& {var} = {var}_array[i];")
            else:
                args.append(f"const {ctype}* {var}_array")
                loads.append(f"const {ctype} {var} = {var}_array[i];")
    placeholders = sorted(set(re.findall(r"\b([A-Z])\b", in_params + out_params)))
    typedefs = "".join(f"typedef {_ctype(p)} {p};\n" for p in placeholders)
    return (f"{typedefs}extern \"C\" __global__ void {name}({', '.join(args)}, long long n)\n"
            "{\n    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
            "    if (i >= n) return;\n    " + "\n    ".join(loads) + "\n" + body
            + ";\n}\n")   # CuPy ends the body with a semicolon too


SOURCES = {
    "bf16": backend.BF16_SOURCE,
    "nn": nn_kernels.SOURCE,
    "optim_sgd": optim_kernels.SGD_SOURCE,
    "optim_sumsq": optim_kernels.SUMSQ_SOURCE,
    "relu_backward": elementwise_as_cuda(*nn_kernels._RELU_BACKWARD),
    "splice": elementwise_as_cuda(*splice_module._SPLICE_KERNEL),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_cuda_source_compiles(tmp_path, name):
    source = tmp_path / f"{name}.cu"
    source.write_text(SOURCES[name])
    result = subprocess.run([NVCC, "-arch=sm_90", "--std=c++14", "-Werror", "all-warnings",
                             "-c", str(source), "-o", str(tmp_path / f"{name}.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_wrapper_itself_rejects_bad_code(tmp_path):
    """The check can fail: a body with a type error does not compile."""
    source = tmp_path / "bad.cu"
    source.write_text(elementwise_as_cuda("T x", "T y", "y = x + undefined_name;", "bad"))
    result = subprocess.run([NVCC, "-arch=sm_90", "-c", str(source), "-o",
                             str(tmp_path / "bad.o")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
