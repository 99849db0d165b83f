"""The package's elementwise and reduction kernels compute what their NumPy twins
compute, on the CPU.

Besides its raw CUDA sources (test_cuda_kernels_on_cpu), the package gives
CuPy kernel bodies that CuPy wraps in code of its own: ``backend.elementwise_kernel``
specs (ReLU's backward pass, splicing) and the optimizer's ``xp.ElementwiseKernel``
and ``xp.ReductionKernel`` (NG-SGD's gamma, row scaling and row dots).  On a
machine without a GPU the stand-in CuPy has neither class, so the package takes
its array expressions there, and these bodies were only compiled
(test_cuda_sources).  Here the stand-in is given both classes, test-local: a
call is resolved as CuPy resolves it (cupy/_core/_kernel.pyx, _reduction.pyx):
the number of arguments, the placeholder types (T...) bound to the dtypes of
the array arguments, which must match exactly (CuPy casts no array), scalars
converted to their parameter's type, non-raw arrays broadcast to the loop's
shape (an output must have it), raw arrays passed as they are, nothing launched
for an empty loop; and the launch CuPy makes (blocks of up to 128 threads, one
per 128 elements; a reduction's block of 512 threads and its stride over the
outputs).  The kernel is the package's own body or expressions, wrapped as CuPy
wraps them, compiled with g++ against tests/cuda_on_cpu.h and
tests/cupy_on_cpu.h (CuPy's CArray and CIndexer: a non-raw argument is read at
the multi-index of ``i`` in the loop's shape through its strides, so a
broadcast or a view is read as on a GPU; a raw one is indexed by the body,
element k in C order of its own shape), and run in the emulation: every
buffer between canaries, threads and blocks in both orders, shared memory
garbage, and once more under AddressSanitizer.  The package's own functions
run on the stand-in with their raw kernels emulated too
(test_cuda_kernels_on_cpu), and the results are compared with the array
expressions the stand-in runs in CI, and with direct formulas.

What it cannot show, besides what test_cuda_kernels_on_cpu says of the
emulation: CuPy's merging of contiguous dimensions (``reduce_dims``: the same
elements, fewer index operations) and its 32-bit index arithmetic (arrays here
are far from 2**31 bytes); a scalar argument is read through a reference, as an
array element is (CuPy passes it by value: a body cannot tell); the GPU's
fused multiply-adds (NVRTC contracts ``j += g * w``: an ulp); placeholder types
other than those in TYPE_CHOICES (a call that needs one fails, naming it).
Skipped without g++.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.data.splice import frame_utterance_bounds, splice_batch_
from mpitrain.nn import kernels as nn_kernels
from mpitrain.nn.nonlinear import ReLU
from mpitrain.optim import kernels as optim_kernels
from mpitrain.optim.natural_gradient import OnlineNaturalGradient, SimpleNaturalGradient
from mpitrain.testing import standin_cupy

from . import cuda_emulation

PACKAGE = Path(backend.__file__).parent
pytestmark = pytest.mark.skipif(cuda_emulation.COMPILER is None,
                                reason="no C++ compiler (g++)")

#: the dtypes each placeholder is compiled for (T: the float type; any other
#: letter: an index type); IndexT, a reduction's index type, is int32 (a
#: reduction of fewer than 2**31 elements per output)
TYPE_CHOICES = {"T": ("float32", "float64")}
INDEX_CHOICES = ("int32", "int64")
REDUCTION_BLOCK = 512          # CuPy's default reduction block on CUDA
ELEMENTWISE_BLOCK = 128        # ElementwiseKernel's default block_size
MAX_NDIM = 8                   # cupy_on_cpu::MAX_NDIM

_CTYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long",
           "uint32": "unsigned int", "uint16": "unsigned short", "bool": "bool"}


# -- kernel specs as CuPy parses them ------------------------------------------------------

class Param:
    """One parameter as CuPy's ParameterInfo reads ``[raw] type name``."""

    def __init__(self, text: str, is_const: bool):
        words = text.split()
        *keywords, kind, self.name = words
        assert set(keywords) <= {"raw"}, f"a keyword CuPy does not take: {text!r}"
        self.raw, self.is_const = "raw" in keywords, is_const
        # one letter: a placeholder bound at the call; else a dtype
        self.placeholder = kind if len(kind) == 1 else None
        self.dtype = None if self.placeholder else np.dtype(kind)
        self.ctype = kind if self.placeholder else _CTYPES[self.dtype.name]


def _params(text: str, is_const: bool) -> tuple:
    return tuple(Param(p, is_const) for p in text.split(",") if p.strip())


class Spec:
    """An ElementwiseKernel's or a ReductionKernel's arguments."""

    def __init__(self, kind, in_params, out_params, code, name, options):
        assert not options, f"{name}: options the emulation does not follow: {options}"
        self.kind, self.name, self.code = kind, name, code
        self.in_params, self.out_params = _params(in_params, True), _params(out_params, False)
        self.placeholders = sorted({p.placeholder for p in self.in_params + self.out_params
                                    if p.placeholder})

    @classmethod
    def elementwise(cls, in_params, out_params, operation, name="kernel", **options):
        return cls("elementwise", in_params, out_params, {"operation": operation}, name,
                   options)

    @classmethod
    def reduction(cls, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                  name="reduce_kernel", reduce_type=None, **options):
        spec = cls("reduction", in_params, out_params, {}, name, options)
        spec.code = {"map_expr": map_expr, "reduce_expr": reduce_expr,
                     "post_map_expr": post_map_expr, "identity": str(identity),
                     "reduce_type": reduce_type or spec.out_params[0].ctype}
        return spec

    def type_maps(self):
        """Every binding of the placeholders to TYPE_CHOICES' dtypes."""
        choices = [TYPE_CHOICES.get(p, INDEX_CHOICES) for p in self.placeholders]
        for combination in itertools.product(*choices):
            yield tuple(zip(self.placeholders, combination))


class _SpecRecorder:
    """An array module whose kernel classes give back their arguments, as a Spec."""
    __name__ = "spec_recorder"
    ElementwiseKernel = staticmethod(Spec.elementwise)
    ReductionKernel = staticmethod(Spec.reduction)


def package_kernels() -> dict:
    """{name: Spec} of every elementwise and reduction kernel of the package: the
    ``backend.elementwise_kernel`` specs at their call sites, and those the optimizer
    builds through its table."""
    found = {}
    call = re.compile(r"elementwise_kernel\(\s*\w+,\s*\*(\w+)\s*\)")
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.parts:
            continue
        constants = call.findall(path.read_text(encoding="utf-8"))
        if constants:
            module = importlib.import_module(
                ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
            for constant in constants:
                spec = Spec.elementwise(*getattr(module, constant))
                found[spec.name] = spec
    for name, build in optim_kernels._BUILDERS.items():
        if name != "sqnorm":          # a raw kernel (test_cuda_kernels_on_cpu)
            spec = build(_SpecRecorder)
            found[spec.name] = spec
    return found


KERNELS = package_kernels()

#: kernels with faults the emulation must report, compiled with the package's
FAULTY_KERNELS = {spec.name: spec for spec in [
    # writes the element after its own: the last one lands past the end
    Spec.elementwise("T x", "raw T y", "y[i + 1] = x", "faulty_shifted_write"),
    # every element added into one cell: the sum depends on the order
    Spec.elementwise("T x", "raw T total", "total[0] += x", "faulty_shared_sum"),
]}


# -- C++ for each kernel, as CuPy generates it ------------------------------------------

def _symbol(spec: Spec, type_map) -> str:
    return "__".join([spec.name] + [f"{p}_{dtype}" for p, dtype in type_map])


def _typedefs(type_map) -> str:
    return "".join(f"typedef {_CTYPES[dtype]} {p};\n" for p, dtype in type_map)


def _kernel_params(spec: Spec) -> list:
    """The kernel's array parameters: a raw one under its own name, a non-raw one as
    ``_raw_<name>`` (read into ``name`` at each index)."""
    return [f"{'const ' if p.is_const else ''}CArray<{p.ctype}> {'' if p.raw else '_raw_'}{p.name}"
            for p in spec.in_params + spec.out_params]


def _constructed(spec: Spec) -> list:
    """C++ that builds each array parameter from its two slots (pointer, Layout)."""
    return [f"CArray<{p.ctype}>(*({p.ctype}**)a[{2 * k}], "
            f"*(const cupy_on_cpu::Layout*)a[{2 * k + 1}])"
            for k, p in enumerate(spec.in_params + spec.out_params)]


def _launcher(symbol: str, name: str, arguments: list) -> str:
    """The entry point that runs kernel ``name`` (in the same namespace) with its
    arguments built from the slots of ``void** a``."""
    return (f'extern "C" const char* launch_{symbol}(unsigned int grid, unsigned int threads, '
            "void** args, const long long* bytes, int count)\n{\n"
            "    return cuda_on_cpu::run(grid, threads, args, bytes, count, [](void** a) {\n"
            f"        {name}({', '.join(arguments)});\n    }});\n}}\n")


def elementwise_source(spec: Spec, type_map) -> str:
    """The kernel CuPy generates for an ElementwiseKernel call (each array argument a
    CArray, a CIndexer over the loop's shape last), and its launcher."""
    symbol = _symbol(spec, type_map)
    loads = [f"{'const ' if p.is_const else ''}{p.ctype} &{p.name} = _raw_{p.name}[_ind.get()];"
             for p in spec.in_params + spec.out_params if not p.raw]
    slots = 2 * len(spec.in_params + spec.out_params)
    return (f"namespace {symbol} {{\n{_typedefs(type_map)}"
            f"__global__ void {spec.name}({', '.join(_kernel_params(spec) + ['CIndexer _ind'])})\n"
            "{\n    CUPY_FOR(i, _ind.size()) {\n        _ind.set(i);\n        "
            + "\n        ".join(loads) + f'\n#line 1 "{spec.name}"\n'
            + spec.code["operation"] + ';\n#line 1 "emulation"\n    }\n}\n'
            + _launcher(symbol, spec.name, _constructed(spec) + [
                f"CIndexer(*(const cupy_on_cpu::Layout*)a[{slots}])"]) + "}\n")


def reduction_source(spec: Spec, type_map) -> str:
    """The kernel CuPy generates for a ReductionKernel call: each thread maps and
    reduces a strided run of one output's inputs, a block of REDUCTION_BLOCK threads
    reduces them in shared memory (``_block_stride`` outputs at a time), and
    ``post_map_expr`` writes the output; and its launcher."""
    symbol = _symbol(spec, type_map)
    code = spec.code
    loads = [f"const {p.ctype} {p.name} = _raw_{p.name}[_in_ind.get()];"
             for p in spec.in_params if not p.raw]
    stores = [f"{p.ctype} &{p.name} = _raw_{p.name}[_out_ind.get()];"
              for p in spec.out_params if not p.raw]
    slots = 2 * len(spec.in_params + spec.out_params)
    params = _kernel_params(spec) + ["CIndexer _in_ind", "CIndexer _out_ind",
                                     "const int _block_stride"]
    body = f"""
    __shared__ _type_reduce _sdata[{REDUCTION_BLOCK}];
    const unsigned int _tid = threadIdx.x;
    const int _stride_log = __popc(_block_stride - 1);
    const IndexT _J_offset = _tid >> _stride_log;
    const ptrdiff_t _j_offset = (ptrdiff_t)_J_offset * _out_ind.size();
    const IndexT _J_stride = {REDUCTION_BLOCK} >> _stride_log;
    const ptrdiff_t _j_stride = (ptrdiff_t)_J_stride * _out_ind.size();
    for (ptrdiff_t _i_base = (ptrdiff_t)blockIdx.x * _block_stride; _i_base < _out_ind.size();
         _i_base += (ptrdiff_t)gridDim.x * _block_stride) {{
        _type_reduce _s = _type_reduce({code["identity"]});
        const ptrdiff_t _i = _i_base + (_tid & (_block_stride - 1));
        IndexT _J = _J_offset;
        for (ptrdiff_t _j = _i + _j_offset; _j < _in_ind.size();
             _j += _j_stride, _J += _J_stride) {{
            _in_ind.set(_j);
            {" ".join(loads)}
            _type_reduce _a = static_cast<_type_reduce>({code["map_expr"]});
            _s = REDUCE(_s, _a);
        }}
        _sdata[_tid] = _s;
        __syncthreads();
        for (unsigned int _block = {REDUCTION_BLOCK} / 2; _block >= (unsigned int)_block_stride;
             _block >>= 1) {{
            if (_tid < _block) {{
                _type_reduce _a = _sdata[_tid], _b = _sdata[_tid + _block];
                _sdata[_tid] = REDUCE(_a, _b);
            }}
            __syncthreads();
        }}
        if (_tid < (unsigned int)_block_stride) _s = _sdata[_tid];
        if (_tid < (unsigned int)_block_stride && _i < _out_ind.size()) {{
            _out_ind.set(_i);
            {" ".join(stores)}
            POST_MAP(_s);
        }}
    }}
"""
    return (f"namespace {symbol} {{\n{_typedefs(type_map)}"
            f"typedef {code['reduce_type']} _type_reduce;\n"
            f"#define REDUCE(a, b) ({code['reduce_expr']})\n"
            f"#define POST_MAP(a) ({code['post_map_expr']})\n"
            f"__global__ void {spec.name}({', '.join(params)})\n{{{body}}}\n"
            "#undef REDUCE\n#undef POST_MAP\n"
            + _launcher(symbol, spec.name, _constructed(spec) + [
                f"CIndexer(*(const cupy_on_cpu::Layout*)a[{slots}])",
                f"CIndexer(*(const cupy_on_cpu::Layout*)a[{slots + 1}])",
                f"*(const int*)a[{slots + 2}]"]) + "}\n")


def program() -> str:
    parts = ['#include "cupy_on_cpu.h"\n#line 1 "emulation"\n']
    for spec in {**KERNELS, **FAULTY_KERNELS}.values():
        for type_map in spec.type_maps():
            if spec.kind == "elementwise":
                parts.append(elementwise_source(spec, type_map))
            else:
                # IndexT: int32, CuPy's choice below 2**31 inputs per output
                parts.append(reduction_source(spec, type_map + (("IndexT", "int32"),)))
    return "".join(parts)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return cuda_emulation.build_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def libraries(build_dir):
    sanitize = cuda_emulation.sanitizing()
    return (cuda_emulation.build(program(), build_dir, sanitize, stem="cupy_kernels",
                                 optimize="-O0"),
            cuda_emulation.build(cuda_emulation.raw_program(), build_dir, sanitize))


# -- CuPy's call, on the stand-in --------------------------------------------------------

def _layout(shape, strides) -> bytes:
    assert len(shape) <= MAX_NDIM, f"{len(shape)} dimensions"
    pad = [0] * (MAX_NDIM - len(shape))
    return np.array([len(shape), *shape, *pad, *strides, *pad], dtype=np.int64).tobytes()


def _plain(array) -> np.ndarray:
    return array.view(np.ndarray)


def _is_array(value) -> bool:
    if isinstance(value, np.ndarray) and not isinstance(value, standin_cupy.DeviceArray):
        raise TypeError(f"Unsupported type {type(value)} (a host array given to a kernel)")
    return isinstance(value, standin_cupy.DeviceArray)


def decide_types(in_params, out_params, in_args, out_args):
    """(in dtypes, out dtypes, type map) as CuPy decides them: outputs first, then
    the input arrays, each bound to its placeholder or checked against its dtype
    (scalars bind nothing)."""
    bound = {}
    for params, args in ((out_params, out_args), (in_params, in_args)):
        for p, a in zip(params, args):
            if not _is_array(a):
                if params is out_params:
                    raise TypeError("Output arguments must be cupy.ndarray")
                continue
            want = p.dtype if p.dtype is not None else bound.setdefault(p.placeholder, a.dtype)
            if a.dtype != want:
                raise TypeError(f"Type is mismatched. {p.name} {a.dtype} {want}")
    try:
        in_types = [p.dtype if p.dtype is not None else bound[p.placeholder] for p in in_params]
        out_types = [p.dtype if p.dtype is not None else bound[p.placeholder]
                     for p in out_params]
    except KeyError as unbound:
        raise TypeError(f"placeholder {unbound} is bound to no array") from None
    return in_types, out_types, tuple(sorted((k, v.name) for k, v in bound.items()))


class Emulation:
    """The stand-in's ElementwiseKernel, ReductionKernel and raw modules, running
    the kernels in the emulation (within :meth:`on`); ``calls`` lists each launch
    as (kernel, type map, loop shape, grid, block)."""

    def __init__(self, libraries, monkeypatch):
        self.library, self.raw_library = libraries
        self.monkeypatch = monkeypatch
        self.calls: list = []
        self.raw_launches: list = []

    @contextlib.contextmanager
    def on(self):
        """Within: the package's fused-kernel paths, their kernels emulated."""
        emulation = self
        with self.monkeypatch.context() as mp:
            mp.setattr(backend, "fused_kernels", lambda xp: xp is standin_cupy.module)
            mp.setattr(backend, "_compiled", {})
            mp.setattr(optim_kernels, "_KERNELS", {})

            def raw_module(xp, name, source):
                assert cuda_emulation.RAW_SOURCES.get(name) == source, f"{name}: a source this test did not compile"
                return cuda_emulation.EmulatedModule(emulation.raw_library, source, emulation.raw_launches)
            mp.setattr(backend, "raw_module", raw_module)
            mp.setattr(standin_cupy.module, "ElementwiseKernel",
                       lambda *a, **k: EmulatedKernel(emulation, Spec.elementwise(*a, **k)),
                       raising=False)
            mp.setattr(standin_cupy.module, "ReductionKernel",
                       lambda *a, **k: EmulatedKernel(emulation, Spec.reduction(*a, **k)),
                       raising=False)
            # backend.gemm's cuBLAS path, on the stand-in's binding
            libs = types.ModuleType("cupy_backends.cuda.libs")
            libs.cublas = standin_cupy.module.cuda.cublas
            for name in ("cupy_backends", "cupy_backends.cuda"):
                mp.setitem(sys.modules, name, types.ModuleType(name))
            mp.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
            yield

    def launch(self, spec, type_map, shape, grid, block, arguments):
        symbol = _symbol(spec, type_map)
        self.calls.append((spec.name, type_map, tuple(shape), grid, block))
        function = getattr(self.library, f"launch_{symbol}", None)
        assert function is not None, (f"{spec.name}: no emulation compiled for {type_map} "
                                      "(add the dtype to TYPE_CHOICES)")
        error = cuda_emulation.launch(function, grid, block, arguments)
        assert not error, f"{spec.name}: {error}"


class EmulatedKernel:
    """A CuPy ElementwiseKernel or ReductionKernel of the stand-in."""

    def __init__(self, emulation: Emulation, spec: Spec):
        if spec.kind == "elementwise":
            names = [p.name for p in spec.in_params + spec.out_params]
            if "i" in names:
                raise ValueError("Can not use 'i' as a parameter name")
        self.emulation, self.spec = emulation, spec

    def __call__(self, *args, **kwargs):
        spec = self.spec
        nin, nout = len(spec.in_params), len(spec.out_params)
        if len(args) not in (nin, nin + nout):
            raise TypeError(f"Wrong number of arguments for {spec.name!r}. It must be either "
                            f"{nin} or {nin + nout} (with outputs), but given {len(args)}.")
        if spec.kind == "elementwise":
            return self._elementwise(list(args[:nin]), list(args[nin:]), **kwargs)
        return self._reduction(list(args[:nin]), list(args[nin:]), **kwargs)

    def _elementwise(self, in_args, out_args, size=-1, block_size=ELEMENTWISE_BLOCK,
                     stream=None):
        spec = self.spec
        params = spec.in_params + spec.out_params
        shapes = [a.shape for p, a in zip(params, in_args + out_args)
                  if not p.raw and _is_array(a)]
        if size != -1:
            if shapes:
                raise ValueError("Specified 'size' can be used only if all of the ndarray "
                                 "are 'raw'.")
            shape = (size,)
        elif not shapes:
            raise ValueError("Loop size is undecided.")
        else:
            shape = np.broadcast_shapes(*shapes)
        in_types, out_types, type_map = decide_types(spec.in_params, spec.out_params,
                                                     in_args, out_args)
        if out_args:
            for p, a in zip(spec.out_params, out_args):
                if not p.raw and a.shape != shape:
                    raise ValueError("Out shape is mismatched")
        else:
            if any(p.raw for p in spec.out_params) and size == -1:
                raise ValueError("Output array size is Undecided")
            out_args = [standin_cupy.module.empty(shape, dtype=t) for t in out_types]
        result = out_args[0] if len(spec.out_params) == 1 else tuple(out_args)
        n = math.prod(shape)
        if n == 0:
            return result
        arguments = []
        for p, a, t in zip(params, in_args + out_args, in_types + out_types):
            if not _is_array(a):
                # converted to the parameter's type (CuPy: CScalar.apply_dtype)
                value = np.array(a, dtype=t)
                arguments += [value, _layout(shape, [0] * len(shape))]
            elif p.raw:
                arguments += [a, _layout(a.shape, a.strides)]
            else:
                view = np.broadcast_to(_plain(a), shape)
                arguments += [a, _layout(view.shape, view.strides)]
        arguments.append(_layout(shape, [0] * len(shape)))
        grid = -(-n // block_size)
        self.emulation.launch(spec, type_map, shape, grid, min(block_size, n), arguments)
        return result

    def _reduction(self, in_args, out_args, out=None, axis=None, keepdims=False, stream=None):
        spec = self.spec
        if out is not None:
            assert not out_args, "cannot specify 'out' as both a positional and keyword argument"
            out_args = [out]
        assert all(_is_array(a) and not p.raw for p, a in zip(spec.in_params, in_args)), \
            f"{spec.name}: scalar or raw inputs of a reduction are not emulated"
        broad = np.broadcast_shapes(*(a.shape for a in in_args))
        in_types, out_types, type_map = decide_types(spec.in_params, spec.out_params,
                                                     in_args, out_args)
        ndim = len(broad)
        axes = range(ndim) if axis is None else \
            (axis if isinstance(axis, (tuple, list)) else (axis,))
        reduce_axis = tuple(sorted(int(a) % ndim for a in axes))
        out_axis = tuple(d for d in range(ndim) if d not in reduce_axis)
        if len(in_args) == 1 and len(out_axis) <= 1 and not in_args[0].flags.c_contiguous:
            strides = in_args[0].strides
            reduce_axis = tuple(sorted(reduce_axis, key=lambda d: -abs(strides[d])))
            out_axis = tuple(sorted(out_axis, key=lambda d: -abs(strides[d])))
        out_shape = tuple(1 if d in reduce_axis else broad[d] for d in range(ndim)) \
            if keepdims else tuple(broad[d] for d in out_axis)
        if out_args:
            for a in out_args:
                if a.shape != out_shape:
                    raise ValueError("Out shape is mismatched")
        else:
            out_args = [standin_cupy.module.empty(out_shape, dtype=t) for t in out_types]
        result = out_args[0]
        if result.size == 0:
            return result
        if spec.code["identity"] == "" and 0 in broad:
            raise ValueError(f"zero-size array to reduction operation {spec.name} which has "
                             "no identity")
        in_size, out_size = math.prod(broad), math.prod(out_shape)
        assert in_size // out_size <= 0x7fffffff, "an int64 IndexT: not compiled"
        permutation = reduce_axis + out_axis
        views = [np.broadcast_to(_plain(a), broad).transpose(permutation) for a in in_args]
        in_shape = views[0].shape
        block, stride, blocks = _block_specs(in_size, out_size,
                                             _contiguous_size(views, out_shape))
        arguments = []
        for a, view in zip(in_args, views):
            arguments += [a, _layout(view.shape, view.strides)]
        for a in out_args:
            arguments += [a, _layout(a.shape, a.strides)]
        arguments += [_layout(in_shape, [0] * len(in_shape)),
                      _layout(out_shape, [0] * len(out_shape)), np.int32(stride).tobytes()]
        self.emulation.launch(spec, type_map + (("IndexT", "int32"),), in_shape, blocks, block,
                              arguments)
        return result


def _contiguous_size(views, out_shape) -> int:
    """How many outputs lie contiguous in the most contiguous input (CuPy's
    _get_contiguous_size, over the inputs permuted reduced axes first)."""
    size = 1
    for view in views:
        run = 1
        for j in range(len(out_shape)):
            if view.strides[view.ndim - j - 1] != run * view.itemsize:
                break
            run *= out_shape[len(out_shape) - j - 1]
        size = max(size, run)
    return size


def _block_specs(in_size: int, out_size: int, contiguous_size: int):
    """(block size, outputs a block reduces at once, blocks): CuPy's _get_block_specs."""
    reduce_block = max(1, in_size // out_size)
    stride = max(min(contiguous_size, 32), REDUCTION_BLOCK // reduce_block)
    stride = 1 << (stride // 2).bit_length()          # the power of two <= stride
    return REDUCTION_BLOCK, stride, -(-out_size // stride)


@pytest.fixture
def emulation(libraries, monkeypatch):
    return Emulation(libraries, monkeypatch)


# -- the emulation covers the package's kernels ---------------------------------------------

def test_every_elementwise_and_reduction_kernel_is_emulated():
    # each class named in the package (less backend.elementwise_kernel's own call)
    # and each call of backend.elementwise_kernel is one kernel found above
    texts = [p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")
             if "testing" not in p.parts]
    made = sum(len(re.findall(r"\.(?:Elementwise|Reduction)Kernel\(", t)) for t in texts) - 1
    called = sum(len(re.findall(r"elementwise_kernel\(\s*\w+,\s*\*\w+\s*\)", t)) for t in texts)
    assert len(KERNELS) == made + called, sorted(KERNELS)
    assert {"mpitrain_relu_backward", "mpitrain_splice", "mpitrain_ng_gamma",
            "mpitrain_ng_add_scaled_rows", "mpitrain_ng_scale_rows",
            "mpitrain_ng_row_dots"} <= set(KERNELS)


def test_the_block_specs_are_cupys():
    # a row of 10 per output: 51 outputs would fit a block, 32 (a power of two) do
    assert _block_specs(3000, 300, 1) == (512, 32, 10)
    assert _block_specs(700, 1, 1) == (512, 1, 1)               # one long row
    assert _block_specs(600, 600, 1) == (512, 512, 2)           # one element per output
    assert _block_specs(5 * 513, 5, 1) == (512, 1, 5)


def _names(calls) -> list:
    return [call[0] for call in calls]


# -- ReLU's backward pass -------------------------------------------------------------------

def _relu_backward(cp, x, dy):
    relu = ReLU(x.shape[1])
    relu.forward(cp.asarray(x))
    return backend.to_host(relu.backward(cp.asarray(dy)))


@pytest.mark.parametrize("shape", [(1, 1), (1, 129), (3, 5), (128, 1), (13, 257),
                                   pytest.param((301, 257), id="large")])
def test_relu_backward(emulation, shape):
    rng = np.random.default_rng(shape[0] * shape[1])
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::7] = 0.0                   # y = 0: no gradient
    dy = rng.standard_normal(shape).astype(np.float32)
    active = np.flatnonzero(x.reshape(-1) > 0)
    # non-finite gradients where the unit is active pass through on both paths
    dy.reshape(-1)[active[:3]] = [np.nan, np.inf, -np.inf][:len(active[:3])]
    with standin_cupy.installed() as cp:
        want = _relu_backward(cp, x, dy)
        with emulation.on():
            got = _relu_backward(cp, x, dy)
    n = x.size
    assert emulation.calls == [("mpitrain_relu_backward", (("T", "float32"),), shape,
                                -(-n // 128), min(128, n))]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.where(x > 0, dy, 0))


@pytest.mark.xfail(strict=True, reason="the kernel selects dy where y > 0, the array "
                   "expressions multiply dy by (y > 0): where y <= 0 a NaN or infinite dy "
                   "gives 0 on the GPU and NaN on the host")
def test_relu_backward_of_a_non_finite_gradient_where_the_unit_is_off(emulation):
    x = np.array([[-1.0, 0.0, 2.0]], dtype=np.float32)
    dy = np.array([[np.nan, np.inf, 1.0]], dtype=np.float32)
    with standin_cupy.installed() as cp:
        with np.errstate(invalid="ignore"):
            want = _relu_backward(cp, x, dy)
        with emulation.on():
            got = _relu_backward(cp, x, dy)
    np.testing.assert_array_equal(got, want)


# -- splicing -------------------------------------------------------------------------------

SPLICES = {
    # one frame, no context, one feature
    "one_frame": dict(lengths=[1], batch=[0], left=0, right=0, dim=1),
    # utterances of one frame among longer ones: every context row is clipped
    "short_utterances": dict(lengths=[1, 9, 1, 1, 30], batch="all", left=5, right=5, dim=13),
    # a batch that is no multiple of a block, frames chosen more than once
    "uneven_batch": dict(lengths=[50, 70, 17], batch=129, left=2, right=3, dim=40),
    # 32-bit frame indices and utterance bounds
    "int32_indices": dict(lengths=[20, 21], batch=33, left=1, right=4, dim=7,
                          index_dtype=np.int32),
    # the frame indices a strided view (every other one of a buffer)
    "strided_indices": dict(lengths=[11, 12, 13], batch=25, left=3, right=0, dim=5,
                            strided_indices=True),
}


def _splice_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(case["lengths"])])
    frames = int(offsets[-1])
    feats = rng.standard_normal((frames, case["dim"])).astype(np.float32)
    start, end = frame_utterance_bounds(offsets)
    batch = case["batch"]
    idx = np.arange(frames) if batch == "all" else \
        np.array(batch) if isinstance(batch, list) else rng.integers(0, frames, batch)
    dtype = case.get("index_dtype", np.int64)
    return feats, idx.astype(dtype), start.astype(dtype), end.astype(dtype)


def _spliced(feats, idx, start, end, left, right):
    """Row b: the feature rows clip(idx[b] + o, start, end - 1), o = -left..right."""
    rows = np.clip(idx[:, None] + np.arange(-left, right + 1)[None, :],
                   start[idx][:, None], end[idx][:, None] - 1)
    return feats[rows].reshape(len(idx), -1)


def _splice_on(cp, case, feats, idx, start, end, out):
    frame_idx = cp.asarray(idx)
    if case.get("strided_indices"):
        spaced = cp.zeros(2 * len(idx), dtype=idx.dtype)
        spaced[::2] = frame_idx
        frame_idx = spaced[::2]
    width = case["left"] + 1 + case["right"]
    ctx = cp.empty((len(idx), width), dtype=cp.int64)
    splice_batch_(cp.asarray(feats), frame_idx, cp.asarray(start), cp.asarray(end),
                         case["left"], case["right"], out=out, ctx=ctx)


@pytest.mark.parametrize("name", sorted(SPLICES))
def test_splicing(emulation, name):
    case = SPLICES[name]
    feats, idx, start, end = _splice_inputs(case)
    width = (case["left"] + 1 + case["right"]) * case["dim"]
    expected = _spliced(feats, idx, start, end, case["left"], case["right"])
    with standin_cupy.installed() as cp:
        out = cp.full((len(idx), width), np.nan, dtype=cp.float32)
        _splice_on(cp, case, feats, idx, start, end, out)
        want = backend.to_host(out)
        with emulation.on():
            # as the training step splices: into the first layer's input buffer, a
            # view whose rows are one element longer (the bias column, 1)
            buffer = cp.full((len(idx), width + 1), 1.0, dtype=cp.float32)
            _splice_on(cp, case, feats, idx, start, end, buffer[:, :width])
            got = backend.to_host(buffer)
    types_ = (("I", np.dtype(idx.dtype).name), ("J", np.dtype(start.dtype).name),
              ("T", "float32"))
    n = len(idx) * width
    assert emulation.calls == [("mpitrain_splice", types_, (len(idx), width),
                                -(-n // 128), min(128, n))]
    np.testing.assert_array_equal(want, expected)
    np.testing.assert_array_equal(got[:, :width], expected)
    np.testing.assert_array_equal(got[:, width], 1.0)


def test_splicing_a_strided_feature_matrix_takes_the_array_expressions(emulation):
    case = SPLICES["uneven_batch"]
    feats, idx, start, end = _splice_inputs(case)
    wide = np.zeros((feats.shape[0], 2 * feats.shape[1]), dtype=np.float32)
    wide[:, ::2] = feats
    width = (case["left"] + 1 + case["right"]) * case["dim"]
    with standin_cupy.installed() as cp, emulation.on():
        out = cp.empty((len(idx), width), dtype=cp.float32)
        splice_batch_(cp.asarray(wide)[:, ::2], cp.asarray(idx), cp.asarray(start),
                             cp.asarray(end), case["left"], case["right"], out=out,
                             ctx=cp.empty((len(idx), width // case["dim"]), dtype=cp.int64))
        got = backend.to_host(out)
    assert emulation.calls == []
    np.testing.assert_array_equal(got, _spliced(feats, idx, start, end, case["left"],
                                                case["right"]))


# -- NG-SGD's kernels, direct -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gamma(emulation, dtype):
    pairs = [(4.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0), (2.0, 3.0), (1e30, 1e-30),
             (np.nan, 1.0), (np.inf, 1.0), (1.0, np.inf), (-1.0, 2.0)]
    with standin_cupy.installed() as cp:
        def run():
            found = []
            for x_sq, xhat_sq in pairs:
                cells = cp.asarray(np.array([x_sq, xhat_sq, -7.0], dtype=dtype))
                # a new 0-d array, and into the third cell as the preconditioner asks;
                # (cells[k, ...]: a 0-d view, as CuPy's cells[k] is; the stand-in's
                # cells[k] is a copy)
                x_cell, xhat_cell, out_cell = (cells[k, ...] for k in range(3))
                fresh = optim_kernels.gamma(x_cell, xhat_cell)
                optim_kernels.gamma(x_cell, xhat_cell, out_cell)
                found.append((backend.to_host(fresh), backend.to_host(cells)))
            return found
        with np.errstate(invalid="ignore", over="ignore"):
            want = run()
        with emulation.on():
            got = run()
    assert _names(emulation.calls) == ["mpitrain_ng_gamma"] * 2 * len(pairs)
    assert {call[2] for call in emulation.calls} == {()}
    for (fresh, cells), (want_fresh, want_cells) in zip(got, want):
        assert fresh.shape == () and fresh.dtype == dtype
        np.testing.assert_array_equal(fresh, want_fresh)
        np.testing.assert_array_equal(cells, want_cells)
        np.testing.assert_array_equal(cells[2], fresh)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (4, 129), (2, 300),
                                        pytest.param(130, 300, id="large")])
def test_add_scaled_rows(emulation, rows, cols):
    rng = np.random.default_rng(rows * cols)
    j0 = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    # g as the preconditioner passes it: the last column of a (rows, rows + 1) matrix
    small = rng.standard_normal((rows, rows + 1)).astype(np.float32)
    with standin_cupy.installed() as cp:
        def run():
            j = cp.asarray(j0)
            optim_kernels.add_scaled_rows_(j, cp.asarray(small)[:, rows:], cp.asarray(w))
            return backend.to_host(j)
        want = run()
        with emulation.on():
            got = run()
    assert emulation.calls == [("mpitrain_ng_add_scaled_rows", (("T", "float32"),),
                                (rows, cols), -(-rows * cols // 128), min(128, rows * cols))]
    # the same float32 product and sum (NVRTC would fuse them: an ulp)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, j0 + small[:, rows:] * w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 1), (3, 7), (130, 3)])
def test_scale_rows(emulation, dtype, rows, cols):
    rng = np.random.default_rng(rows + cols)
    x0 = rng.standard_normal((rows, cols)).astype(dtype)
    v = rng.standard_normal((rows, 1)).astype(dtype)
    with standin_cupy.installed() as cp:
        def run():
            x = cp.asarray(x0)
            optim_kernels.scale_rows_(x, cp.asarray(v))
            return backend.to_host(x)
        want = run()
        with emulation.on():
            got = run()
    assert _names(emulation.calls) == ["mpitrain_ng_scale_rows"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, x0 * v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols, strided", [
    (1, 1, False), (1, 700, False), (300, 1, False), (5, 3, False), (37, 513, False),
    (600, 2, False), (9, 40, True), pytest.param(1025, 37, False, id="large")])
def test_row_dots(emulation, dtype, rows, cols, strided):
    rng = np.random.default_rng(rows * cols)
    x = rng.standard_normal((rows, 2 * cols if strided else cols)).astype(dtype)
    y = rng.standard_normal(x.shape).astype(dtype)
    with standin_cupy.installed() as cp:
        def run():
            dx, dy = cp.asarray(x), cp.asarray(y)
            if strided:                  # (the package passes contiguous rows)
                dx, dy = dx[:, ::2], dy[:, ::2]
            return backend.to_host(optim_kernels.row_dots(dx, dy))
        want = run()
        with emulation.on():
            got = run()
    if strided:
        x, y = x[:, ::2], y[:, ::2]
    assert [call[:3] for call in emulation.calls] == [
        ("mpitrain_ng_row_dots", (("T", np.dtype(dtype).name), ("IndexT", "int32")),
         (cols, rows))]
    assert emulation.calls[0][3:] == (_block_specs(rows * cols, rows, 1)[2], 512)
    # each product rounded to the dtype, summed in float64, rounded once
    products = (x * y).astype(np.float64)
    exact = products.sum(axis=1)
    # (one rounding to the dtype, and float64 sums in another order)
    bound = np.finfo(dtype).eps * np.abs(exact) + \
        cols * np.finfo(np.float64).eps * np.abs(products).sum(axis=1)
    assert got.shape == (rows,) and got.dtype == dtype
    assert np.all(np.abs(got - exact) <= bound)
    # the array expressions sum in the dtype itself
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=cols * np.finfo(dtype).eps * np.abs(products).sum(axis=1).max())


# -- NG-SGD's preconditioners, whole ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, dim, rank", [(1, 5, 2), (7, 10, 3), (33, 17, 4),
                                             pytest.param(130, 257, 20, id="large")])
def test_the_online_natural_gradient(emulation, dtype, rows, dim, rank):
    rng = np.random.default_rng(dim)
    batches = [rng.standard_normal((rows, dim)).astype(dtype) for _ in range(6)]
    with standin_cupy.installed() as cp:
        def run():
            ng = OnlineNaturalGradient(rank=rank, update_period=2)
            found = []
            for batch in batches:
                x, gamma = ng.precondition(cp.asarray(batch))
                found.append((backend.to_host(x), float(backend.to_host(gamma))))
            return found
        want = run()
        with emulation.on():
            got = run()
    assert set(_names(emulation.calls)) == {"mpitrain_ng_gamma", "mpitrain_ng_add_scaled_rows"}
    if dtype == np.float64:
        # products and sums of squares by array expressions on both paths: the
        # kernels' float64 arithmetic is the expressions'
        assert emulation.raw_launches == []
        for (x, gamma), (want_x, want_gamma) in zip(got, want):
            np.testing.assert_array_equal(x, want_x)
            assert gamma == want_gamma
        return
    assert {name for name, _, _ in emulation.raw_launches} == {"mpitrain_sumsq"}
    # cuBLAS's products (float64 sums) for NumPy's float32 ones, and float64 sums of
    # squares: close, not equal; each update of W from a rank-deficient J (fewer
    # rows than the rank) magnifies the difference
    scale = max(np.abs(batch).max() for batch in batches)
    for (x, gamma), (want_x, want_gamma) in zip(got, want):
        np.testing.assert_allclose(x, want_x, rtol=0, atol=(1e-3 if rows <= rank else 1e-5) * scale)
        assert gamma == pytest.approx(want_gamma, rel=1e-3 if rows <= rank else 1e-5)


@pytest.mark.parametrize("rows, dim", [(9, 4), (4, 9), (2, 2), (65, 130)])
def test_the_simple_natural_gradient(emulation, rows, dim):
    x0 = np.random.default_rng(rows * dim).standard_normal((rows, dim)).astype(np.float32)
    with standin_cupy.installed() as cp:
        def run():
            xhat, gamma = SimpleNaturalGradient(alpha=4.0).precondition(cp.asarray(x0))
            return backend.to_host(xhat), gamma
        want, _ = run()
        with emulation.on():
            got, gamma = run()
    assert _names(emulation.calls) == ["mpitrain_ng_row_dots"] * 2 + ["mpitrain_ng_scale_rows"]
    assert {call[1][0] for call in emulation.calls} == {("T", "float64")}
    assert gamma == 1.0 and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


# -- what CuPy refuses, refused --------------------------------------------------------------

def test_calls_are_checked_as_cupy_checks_them(emulation):
    with standin_cupy.installed() as cp, emulation.on():
        relu = standin_cupy.module.ElementwiseKernel(*nn_kernels._RELU_BACKWARD)
        x32, x64 = cp.ones((2, 3), dtype=cp.float32), cp.ones((2, 3), dtype=cp.float64)
        with pytest.raises(TypeError, match="Type is mismatched"):
            relu(x32, x64)                       # T bound twice, to two dtypes
        with pytest.raises(TypeError, match="Type is mismatched"):
            relu(x32, x32, cp.empty((2, 3), dtype=cp.float64))
        with pytest.raises(ValueError, match="Out shape is mismatched"):
            relu(x32, x32, cp.empty((1, 3), dtype=cp.float32))   # (it broadcasts)
        with pytest.raises(ValueError, match="shape mismatch"):
            relu(x32, x32, cp.empty((3, 2), dtype=cp.float32))
        with pytest.raises(TypeError, match="Wrong number of arguments"):
            relu(x32)
        with pytest.raises(TypeError, match="host array"):
            relu(x32, np.ones((2, 3), dtype=np.float32))
        # a row broadcast against a column; nothing launched for an empty loop
        got = relu(cp.full((1, 3), 2.0, dtype=cp.float32),
                   cp.asarray(np.array([[1.0], [-1.0]], dtype=np.float32)))
        np.testing.assert_array_equal(backend.to_host(got), [[2, 2, 2], [0, 0, 0]])
        assert relu(x32[:0], x32[:0]).shape == (0, 3)
    assert [call[2] for call in emulation.calls] == [(2, 3)]


# -- the checks themselves can fail -----------------------------------------------------------

@pytest.mark.skipif(bool(cuda_emulation.sanitizing()),
                    reason="(its write out of bounds would stop the sanitized run)")
def test_the_emulation_reports_a_write_out_of_bounds_and_a_race(emulation):
    with standin_cupy.installed() as cp, emulation.on():
        # 1e8 and 299 ones: 1e8 in ascending order (each 1 lost), 1e8 + 296 in descending
        x = cp.asarray(np.array([1e8] + [1.0] * 299, dtype=np.float32))
        shifted = EmulatedKernel(emulation, FAULTY_KERNELS["faulty_shifted_write"])
        with pytest.raises(AssertionError, match="a write outside argument 2"):
            shifted(x, cp.zeros(300, dtype=cp.float32))
        total = EmulatedKernel(emulation, FAULTY_KERNELS["faulty_shared_sum"])
        with pytest.raises(AssertionError, match="differs when threads and blocks run"):
            total(x, cp.zeros(1, dtype=cp.float32))


@pytest.mark.skipif(bool(cuda_emulation.sanitizing()), reason="(the sanitized run itself)")
def test_the_kernels_under_address_sanitizer(build_dir):
    run = cuda_emulation.run_sanitized(__file__, build_dir, "not large and not sanitiz")
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
