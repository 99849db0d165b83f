"""Compiling and launching CUDA C on the CPU through tests/cuda_on_cpu.h.

Shared by the tests that run the package's kernels without a GPU
(test_cuda_kernels_on_cpu: the raw kernels; test_cupy_kernels_on_cpu: the
elementwise and reduction kernels, wrapped as CuPy wraps them): building a
program into a shared library once per content, launching one of its
``launch_<name>`` entry points with buffers copied between canaries,
rerunning a test file under AddressSanitizer; and the package's raw kernel
sources as one program, with a RawModule whose kernels run in it
(:class:`EmulatedModule`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn import kernels as nn_kernels
from mpitrain.optim import kernels as optim_kernels
from mpitrain.testing import standin_cupy

HERE = Path(__file__).parent
HEADER = HERE / "cuda_on_cpu.h"
#: set (to "address") in the subprocesses that rerun a test file under the sanitizers
SANITIZE_ENV = "MPITRAIN_KERNELS_SANITIZE"
#: where those subprocesses find (or build) the libraries, so that each is built once
BUILD_DIR_ENV = "MPITRAIN_KERNELS_BUILD_DIR"
COMPILER = shutil.which(os.environ.get("CXX", "g++"))


def build(program: str, directory: Path, sanitize: str, *, stem: str = "kernels",
          optimize: str = "-O1") -> ctypes.CDLL:
    """``program`` (C++ that includes headers of this directory) compiled into a shared
    library in ``directory``, or the one already built there from the same text
    (``optimize``: -O0 compiles many small kernels several times faster, under the
    sanitizers most of all)."""
    flags = ["-std=c++20", optimize, "-g", "-fPIC", "-shared", "-Wall", "-Wno-sign-compare",
             f"-I{HERE}"]
    if sanitize:
        flags += [f"-fsanitize={sanitize},undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer"]
    headers = "".join(path.read_text() for path in sorted(HERE.glob("*.h")))
    digest = hashlib.sha256((program + headers + " ".join(flags)).encode())
    library = directory / f"{stem}_{digest.hexdigest()[:16]}.so"
    if not library.exists():
        source = directory / f"{stem}_{digest.hexdigest()[:16]}.cpp"
        source.write_text(program)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run([COMPILER, *flags, str(source), "-o", str(partial)],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
        partial.rename(library)
    return ctypes.CDLL(str(library))


def build_dir(tmp_path_factory) -> Path:
    """The directory of the libraries, one for the session (so that a library two
    test files use is built once), or the one a sanitized rerun is given."""
    given = os.environ.get(BUILD_DIR_ENV)
    if given:
        return Path(given)
    directory = tmp_path_factory.getbasetemp() / "cuda_on_cpu"
    directory.mkdir(exist_ok=True)
    return directory


def extent(array) -> int:
    """Bytes from an array's first element to the end of its last (its data pointer on)."""
    if array.size == 0:
        return 0
    assert all(s >= 0 for s in array.strides), "a negative stride"
    return int(sum((n - 1) * s for n, s in zip(array.shape, array.strides))) + array.itemsize


def launch(function, grid: int, block: int, arguments) -> str:
    """Calls a ``launch_<name>`` entry point (cuda_on_cpu::run's signature) with
    ``arguments``: an array is a buffer (its data pointer, a copy between canaries
    for the kernel), ``bytes`` a value passed as it is.  Returns "" or what the
    emulation reported."""
    slots, sizes, keep = [], [], []
    for argument in arguments:
        if isinstance(argument, bytes):
            cell = ctypes.create_string_buffer(argument, len(argument))
            sizes.append(-1)
        else:
            address = (argument.data.ptr if isinstance(argument, standin_cupy.DeviceArray)
                       else argument.__array_interface__["data"][0])
            cell = ctypes.c_void_p(address)
            sizes.append(extent(argument))
        keep.append(cell)
        slots.append(ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p))
    function.restype = ctypes.c_char_p
    error = function(ctypes.c_uint(grid), ctypes.c_uint(block),
                     (ctypes.c_void_p * len(slots))(*slots),
                     (ctypes.c_longlong * len(sizes))(*sizes), ctypes.c_int(len(slots)))
    return (error or b"").decode()


def run_sanitized(test_file: str, build_dir: Path, keyword: str) -> subprocess.CompletedProcess:
    """The tests of ``test_file`` selected by ``keyword``, in a Python whose allocations
    go through AddressSanitizer, on libraries built with the sanitizers."""
    runtime = subprocess.run([COMPILER, "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(runtime):
        pytest.skip(f"no AddressSanitizer runtime for {COMPILER}")
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0",
               **{SANITIZE_ENV: "address", BUILD_DIR_ENV: str(build_dir)})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "-k", keyword, test_file], cwd=HERE.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def sanitizing() -> str:
    """The sanitizer this process runs under ("" outside the sanitized reruns)."""
    return os.environ.get(SANITIZE_ENV, "")


#: NumPy types of the C scalar types the kernels take
SCALAR_TYPES = {"int": np.int32, "long long": np.int64, "float": np.float32,
            "double": np.float64, "unsigned int": np.uint32, "unsigned short": np.uint16}


def kernel_signatures(source: str) -> dict:
    """{kernel name: [(C type without const, is pointer), ...]} of a CUDA source."""
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
        types = []
        for param in params.split(","):
            words = param.replace("*", " * ").replace("const", " ").split()[:-1]
            pointer = "*" in words
            types.append((" ".join(w for w in words if w != "*"), pointer))
        found[name] = types
    return found


#: every raw_module source of the package, compiled into one library
RAW_SOURCES = {"nn": nn_kernels.SOURCE, "optim_sumsq": optim_kernels.SUMSQ_SOURCE,
           "optim_sgd": optim_kernels.SGD_SOURCE, "bf16": backend.BF16_SOURCE}

#: kernels with the faults the emulation must report, compiled with the package's
FAULTY_SOURCE = r"""
#define THREADS 256
// reads a neighbour's shared slot with no barrier after the writes
extern "C" __global__ void faulty_race(float* out)
{
    __shared__ float s[THREADS];
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 1) % THREADS];
}
// half of the block waits at one barrier, half at another
extern "C" __global__ void faulty_divergent_barrier(float* out)
{
    if (threadIdx.x < THREADS / 2)
        __syncthreads();
    else
        __syncthreads();
    out[threadIdx.x] = 1.0f;
}
// half of the block returns before a barrier
extern "C" __global__ void faulty_barrier_after_return(float* out)
{
    if (threadIdx.x < THREADS / 2) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
// no bound: the last block writes past the end
extern "C" __global__ void faulty_unbounded_write(float* out, const int n)
{
    out[blockIdx.x * THREADS + threadIdx.x] = (float)n;
}
// reads the element after the last (seen by AddressSanitizer only)
extern "C" __global__ void faulty_read_past_the_end(const float* x, const int n, float* out)
{
    if (blockIdx.x * THREADS + threadIdx.x == n) out[0] = x[n];
}
"""


def _wrapper(name: str, signature) -> str:
    """C++ that launches kernel ``name`` with its arguments read from ``void** a``."""
    unpacked = ", ".join(f"*({ctype}{'*' if pointer else ''}*)a[{i}]"
                         for i, (ctype, pointer) in enumerate(signature))
    return (f'extern "C" const char* launch_{name}(unsigned int grid, unsigned int threads, '
            "void** args, const long long* bytes, int count)\n{\n"
            "    return cuda_on_cpu::run(grid, threads, args, bytes, count, "
            f"[](void** a) {{ {name}({unpacked}); }});\n}}\n")


def raw_program() -> str:
    """The package's raw kernels and the faulty ones, each with its launcher."""
    parts = [f'#include "{HEADER.name}"\n']
    for source_name, source in {**RAW_SOURCES, "faulty": FAULTY_SOURCE}.items():
        # (#line: a fault is reported at the line of the package's own source)
        parts += ["#undef THREADS\n", f'#line 1 "{source_name}"\n', source]
        parts += [_wrapper(kernel, signature) for kernel, signature in kernel_signatures(source).items()]
    return "".join(parts)


def _scalar(value) -> np.generic:
    """A scalar argument as CuPy passes it: a NumPy scalar as it is, a Python int or
    float as an int64 or a double."""
    if isinstance(value, np.generic):
        return value
    return {int: np.int64, float: np.float64}[type(value)](value)


class EmulatedModule:
    """A RawModule whose kernels run in the emulation, recording each launch."""

    def __init__(self, lib, source: str, launches: list):
        self.lib, self.signatures, self.launches = lib, kernel_signatures(source), launches

    def get_function(self, name: str):
        assert name in self.signatures, f"{name} is not in the source it is taken from"
        signature = self.signatures[name]

        def run(grid, block, args):
            self.launches.append((name, tuple(grid), tuple(block)))
            assert len(grid) == len(block) == 1, f"{name}: only 1-D launches are emulated"
            assert len(args) == len(signature), f"{name}: {len(args)} arguments"
            arguments = []
            for i, ((ctype, pointer), arg) in enumerate(zip(signature, args)):
                want = np.dtype(SCALAR_TYPES[ctype])
                if pointer:
                    assert isinstance(arg, standin_cupy.DeviceArray) and arg.dtype == want, \
                        f"{name} argument {i}: not a {want} device array"
                    arguments.append(arg)
                else:
                    value = _scalar(arg)
                    assert value.dtype == want, f"{name} argument {i}: a {value.dtype}, not {want}"
                    arguments.append(value.tobytes())
            error = launch(getattr(self.lib, f"launch_{name}"), grid[0], block[0],
                                          arguments)
            assert not error, f"{name}: {error}"
        return run
