"""Compiling and launching CUDA C on the CPU through tests/cuda_on_cpu.h.

Shared by the tests that run the package's kernels without a GPU
(test_cuda_kernels_on_cpu: the raw kernels; test_cupy_kernels_on_cpu: the
elementwise and reduction kernels, wrapped as CuPy wraps them): building a
program into a shared library once per content, launching one of its
``launch_<name>`` entry points with buffers copied between canaries, and
rerunning a test file under AddressSanitizer.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
            cell = ctypes.c_void_p(argument.__array_interface__["data"][0])
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

