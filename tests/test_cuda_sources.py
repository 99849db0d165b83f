"""The package's CUDA sources compile, without a GPU.

CuPy compiles each ``backend.raw_module`` source, and each
``backend.elementwise_kernel`` body wrapped in its own code, with NVRTC on the
first use on a device, so a source that no longer compiles, or a kernel name
that is not in it, would first show on a GPU, where CI never runs.  These tests
compile every such source with the NVRTC library (``pip install
nvidia-cuda-nvrtc``, in the ``test`` extra) for the GPUs the program targets,
with the options CuPy is given, and link it to machine code with nvJitLink
(``nvidia-nvjitlink``) to check that no kernel spills registers and that each
fits the block size it is launched with.  Elementwise bodies are wrapped the way
CuPy wraps them: raw parameters become pointers, the others one element at index
``i``.  Skipped without the libraries.
"""

import ctypes
import glob
import importlib
import os
import re
import sys
from pathlib import Path

import pytest

from mpitrain import backend

PACKAGE = Path(backend.__file__).parent
#: A100 and H100/H200: the GPUs the program is measured on.
ARCHITECTURES = ("80", "90")
REGISTERS_PER_BLOCK = 65536
STATIC_SHARED_BYTES = 48 * 1024


def _library(stem: str):
    """A ctypes handle on the first lib<stem>.so* of an installed NVIDIA wheel."""
    for entry in sys.path:
        for found in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib",
                                                   f"lib{stem}.so*"))):
            if "builtins" not in found:
                return ctypes.CDLL(found)
    return None


NVRTC = _library("nvrtc")
NVJITLINK = _library("nvJitLink")
needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason="no NVRTC library (nvidia-cuda-nvrtc)")
needs_nvjitlink = pytest.mark.skipif(NVRTC is None or NVJITLINK is None,
                                     reason="no NVRTC/nvJitLink library")


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


def _sources() -> dict:
    """{name: CUDA source}: every ``raw_module`` source and every
    ``elementwise_kernel`` body, found at their call sites in the package, so that a
    new one is covered without a list to keep up to date here."""
    sources = {}
    raw_call = re.compile(r'raw_module\(\s*\w+,\s*"(\w+)",\s*(\w+)\s*\)')
    elementwise_call = re.compile(r'elementwise_kernel\(\s*\w+,\s*\*(\w+)\s*\)')
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        raw, elementwise = raw_call.findall(text), elementwise_call.findall(text)
        if not raw and not elementwise:
            continue
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = importlib.import_module(".".join(relative.parts))
        for name, constant in raw:
            if hasattr(module, constant):      # (not the example in a docstring)
                sources[name] = getattr(module, constant)
        for constant in elementwise:
            spec = getattr(module, constant, None)
            if spec is not None:
                sources[spec[3]] = elementwise_as_cuda(*spec)
    sources.update(_optimizer_elementwise_sources())
    return sources


def _optimizer_elementwise_sources() -> dict:
    """NG-SGD's elementwise kernels, which the optimizer builds from its own table."""
    from mpitrain.optim import kernels

    class Recorder:
        ElementwiseKernel = staticmethod(lambda *spec: spec)
        ReductionKernel = staticmethod(lambda *spec, **options: None)   # CuPy's own code

    sources = {}
    for name, build in kernels._BUILDERS.items():
        if name == "sqnorm":
            continue      # a raw_module source, found above
        spec = build(Recorder)
        if spec is not None:
            sources[spec[3]] = elementwise_as_cuda(*spec)
    return sources


def _called_kernel_names() -> set:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "testing" not in path.parts:
            names.update(re.findall(r'get_function\(\s*"(\w+)"\s*\)',
                                    path.read_text(encoding="utf-8")))
    return names


def _ptx(source: str, name: str, architecture: str) -> str:
    """PTX of ``source`` compiled as CuPy does; AssertionError with NVRTC's log when it
    fails or warns."""
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), source.encode(),
                                    f"{name}.cu".encode(), 0, None, None) == 0
    try:
        options = [o.encode() for o in backend.RAW_MODULE_OPTIONS] + \
            [f"--gpu-architecture=compute_{architecture}".encode()]
        status = NVRTC.nvrtcCompileProgram(program, len(options),
                                           (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        NVRTC.nvrtcGetProgramLog(program, log)
        log = log.value.decode(errors="replace").strip()
        assert status == 0 and "warning" not in log, f"{name} (compute_{architecture}):\n{log}"
        NVRTC.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetPTX(program, ptx)
        return ptx.value.decode()
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(program))


def _machine_code_report(ptx: str, name: str, architecture: str) -> str:
    """ptxas's report (registers, spills, shared memory per kernel) of linking ``ptx``
    for sm_<architecture>."""
    handle = ctypes.c_void_p()
    options = (ctypes.c_char_p * 2)(f"-arch=sm_{architecture}".encode(), b"-verbose")
    assert NVJITLINK.nvJitLinkCreate(ctypes.byref(handle), 2, options) == 0
    try:
        data = ptx.encode()
        ptx_input = 2     # NVJITLINK_INPUT_PTX
        assert NVJITLINK.nvJitLinkAddData(handle, ptx_input, data, ctypes.c_size_t(len(data)),
                                          name.encode()) == 0
        status = NVJITLINK.nvJitLinkComplete(handle)
        logs = []
        for kind in ("Info", "Error"):
            size = ctypes.c_size_t()
            getattr(NVJITLINK, f"nvJitLinkGet{kind}LogSize")(handle, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            getattr(NVJITLINK, f"nvJitLinkGet{kind}Log")(handle, log)
            logs.append(log.value.decode(errors="replace"))
        assert status == 0, f"{name} (sm_{architecture}):\n{logs[1]}"
        return logs[0]
    finally:
        NVJITLINK.nvJitLinkDestroy(ctypes.byref(handle))


def test_every_source_is_found():
    # the discovery above must see the sources the package has (a renamed call
    # would otherwise leave a source out of every test here)
    assert {"nn", "optim_sumsq", "optim_sgd", "bf16", "mpitrain_relu_backward",
            "mpitrain_splice", "mpitrain_ng_gamma"} <= set(_sources())


@needs_nvrtc
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_source_compiles_without_warnings_and_defines_the_kernels_called(architecture):
    entries = set()
    for name, source in _sources().items():
        ptx = _ptx(source, name, architecture)
        entries.update(re.findall(r"\.entry\s+(\w+)", ptx))
    missing = _called_kernel_names() - entries
    assert not missing, f"get_function names no compiled kernel: {sorted(missing)}"


@needs_nvjitlink
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_no_kernel_spills_and_each_fits_its_block(architecture):
    for name, source in _sources().items():
        report = _machine_code_report(_ptx(source, name, architecture), name, architecture)
        kernels = re.findall(r"Function properties for '?(\w+)'?:?\s*\n.*?(\d+) bytes spill "
                             r"stores, (\d+) bytes spill loads\s*\n.*?Used (\d+) registers"
                             r"(?:.*?(\d+) bytes smem)?", report)
        assert kernels, f"{name}: no kernel in ptxas's report:\n{report}"
        threads = int(re.search(r"#define THREADS (\d+)", source).group(1)) \
            if "#define THREADS" in source else 1024
        for kernel, stores, loads, registers, shared in kernels:
            assert (int(stores), int(loads)) == (0, 0), f"{kernel} spills registers"
            assert int(registers) * threads <= REGISTERS_PER_BLOCK, \
                f"{kernel}: {registers} registers x {threads} threads do not fit a block"
            assert int(shared or 0) <= STATIC_SHARED_BYTES, kernel


@needs_nvrtc
def test_the_last_block_of_the_sum_of_squares_reads_the_partials_past_its_cache():
    # the other blocks write their partial sums on other SMs; the last block must
    # fence and read them with loads that bypass its own SM's L1 (not coherent)
    ptx = _ptx(_sources()["optim_sumsq"], "optim_sumsq", "90")
    last_block = ptx[ptx.index("atom.global.add.u32"):]
    assert "membar.gl" in last_block or "fence" in last_block
    assert re.search(r"ld\.(volatile|relaxed|acquire|global\.cg)[\w.]*f64", last_block)


@needs_nvrtc
def test_the_compile_check_can_fail():
    with pytest.raises(AssertionError, match="undefined_name"):
        _ptx(elementwise_as_cuda("T x", "T y", "y = x + undefined_name", "bad"), "bad", "90")
    with pytest.raises(AssertionError, match="warning"):
        _ptx('extern "C" __global__ void k(float* x) { int unused = 1; x[0] = 0; }',
             "warns", "90")
