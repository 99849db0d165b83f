"""The package's raw CUDA kernels compute what their NumPy twins compute, on the CPU.

On a machine without a GPU the kernels are only compiled (test_cuda_sources)
and their launch arguments checked (test_kernel_launch_args); the stand-in
CuPy runs NumPy expressions in their place.  Here the very source strings of
the package (``nn.kernels.SOURCE``, ``optim.kernels.SUMSQ_SOURCE`` and
``SGD_SOURCE``, ``backend.BF16_SOURCE``) are compiled with g++ against a small
emulation of CUDA C (tests/cuda_on_cpu.h) and run.  The package's own
launching functions run on the stand-in with ``backend.raw_module`` replaced
by one whose kernels record each launch and run it at once in the emulation,
with the grid, block and arguments the Python code chose (scalars converted
as CuPy converts them), so a wrong grid or size in the launch code shows as
well as a wrong index or bound in a kernel.  Results are compared with the
NumPy path of the same function and with direct formulas.

What a launch proves: each block's threads run phase by phase between
barriers, in ascending and then in descending order (threads and blocks), and
must give the same bits, so a missing ``__syncthreads()`` or a result that
depends on which block finishes last shows; ``__shared__`` memory starts as
garbage in every block; a barrier reached by part of a block, or at two
places, is reported; every buffer is a copy between canary bytes, so a write
past either end fails.  Rerun in a subprocess with AddressSanitizer and UBSan
(their runtime preloaded), a read past a buffer or undefined behaviour fails
too.  The tests at the end show that each of these checks can fail.

What it cannot show: warps and their timing (a block's threads run one after
another, never at once: only races that change a result in one of the two
orders show), the GPU's weak memory model beyond what ``__threadfence`` and
atomics order (the emulation is sequential, so a missing fence or a cached
read of another block's write goes unseen: test_cuda_sources checks the PTX
for those), the GPU's own ``expf``/``logf`` (a few ulp from the CPU's) and
its fused multiply-adds, and 2-D or 3-D launches (none here).  Skipped without
g++.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn import kernels as nn_kernels
from mpitrain.optim import kernels as optim_kernels
from mpitrain.testing import standin_cupy

from . import cuda_emulation
from .cuda_emulation import SANITIZE_ENV


COMPILER = cuda_emulation.COMPILER

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++)")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return cuda_emulation.build_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def library(build_dir):
    return cuda_emulation.build(cuda_emulation.raw_program(), build_dir, cuda_emulation.sanitizing())


@pytest.fixture
def launches(library, monkeypatch):
    """Within the stand-in, the package's raw kernels run in the emulation; the list
    of (kernel, grid, block) launched."""
    recorded: list = []
    monkeypatch.setattr(backend, "fused_kernels", lambda xp: xp is not np)
    monkeypatch.setattr(optim_kernels, "_KERNELS", {})

    def raw_module(xp, name, source):
        assert cuda_emulation.RAW_SOURCES.get(name) == source, f"{name}: a source this test did not compile"
        return cuda_emulation.EmulatedModule(library, source, recorded)
    monkeypatch.setattr(backend, "raw_module", raw_module)
    return recorded


# -- the sum of squares -----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (255,), (256,), (1025,), (3, 343), (5 * 1024 + 7,),
                                   # more blocks than the most launched, and than THREADS
                                   # partials for the last block to add: a grid-stride loop
                                   pytest.param((700_001,), id="large")])
def test_the_sum_of_squares(launches, shape):
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    # the float32 of a float64 sum: half an ulp, plus the float64 summation's own
    # order-dependent error (~1e-16 relative here)
    expected = np.float32(np.dot(values.reshape(-1).astype(np.float64), values.reshape(-1)))
    with standin_cupy.installed() as cp:
        result = backend.to_host(optim_kernels.sqnorm(cp.asarray(values)))
    blocks = min(optim_kernels.SUMSQ_MAX_BLOCKS, -(-values.size // 1024))
    assert launches == [("mpitrain_sumsq", (blocks,), (256,))]
    np.testing.assert_allclose(result, expected, rtol=2e-7)


def test_the_sum_of_squares_leaves_its_block_counter_at_zero(launches):
    # each launch's last block must reset the counter, or the next launch finds no
    # last block and writes nothing
    rng = np.random.default_rng(1)
    with standin_cupy.installed() as cp:
        for size in (5000, 1, 3000):
            values = rng.standard_normal(size).astype(np.float32)
            out = cp.full((), np.nan, dtype=cp.float32)
            optim_kernels.sqnorm(cp.asarray(values), out)
            np.testing.assert_allclose(backend.to_host(out), np.dot(values, values), rtol=2e-6)


# -- softmax and cross-entropy ------------------------------------------------------------

def _logits(rng, n, c):
    logits = (3 * rng.standard_normal((n, c))).astype(np.float32)
    labels = rng.integers(0, c, n)
    if c > 1:
        # ties for the best class, far apart (other threads): the lower index wins
        logits[0, [c - 1, c // 2, 1]] = 50.0
    if n > 1:
        # a label far below the best: its log posterior is floored at LOG_FLOOR
        logits[1] = 0.0
        logits[1, labels[1]] = -1e4
    return logits, labels


@pytest.mark.parametrize("n, c, need_grad", [
    (1, 1, True), (1, 1000, True), (3, 5, True), (3, 5, False), (4, 256, True),
    (5, 257, False), (2, 1025, True),
    # more rows than threads in the one block that adds them
    pytest.param(257, 3, True, id="large")])
def test_softmax_cross_entropy(launches, n, c, need_grad):
    logits, labels = _logits(np.random.default_rng(n * c), n, c)
    sums_before = np.array([1.5, 2.0])          # added to, not overwritten
    # reference: the same function on NumPy (array expressions), and the formulas in float64
    want_grad, want_sums = logits.copy(), sums_before.copy()
    nn_kernels.softmax_xent_(want_grad, labels, want_sums, need_grad=need_grad)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_total = np.log(np.exp(shifted).sum(axis=1))
    picked = np.maximum(shifted[np.arange(n), labels], nn_kernels.LOG_FLOOR)
    with standin_cupy.installed() as cp:
        device_logits = cp.asarray(logits)
        sums = cp.asarray(sums_before)
        nn_kernels.softmax_xent_(device_logits, cp.asarray(labels), sums, need_grad=need_grad)
        got_grad, got_sums = backend.to_host(device_logits), backend.to_host(sums)
    assert launches == [("mpitrain_softmax_xent", (n,), (256,)),
                        ("mpitrain_add_row_sums", (1,), (256,))]
    # per row a few float32 roundings of terms up to |log c| + 100: 1e-5 relative
    # covers them and the sum; the count of correct rows is exact
    np.testing.assert_allclose(got_sums[0], sums_before[0] + (log_total - picked).sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-5)
    assert got_sums[1] == want_sums[1] == sums_before[1] + (logits.argmax(axis=1) == labels).sum()
    if need_grad:
        # probabilities within float32 rounding of exp and of the row's sum; the NumPy
        # path flushes those below 1e-30 to 0, the kernel does not: absolute 1e-7
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7)


# -- the bf16 copy of a matrix product's operand -------------------------------------------

@pytest.mark.parametrize("rows, cols, ld", [(1, 1, 1), (5, 11, 13), (37, 299, 300), (3, 8, 8)])
def test_the_bf16_operand_copy(launches, monkeypatch, rows, cols, ld):
    monkeypatch.setattr(backend, "_bf16_scratch", {})
    bits = np.random.default_rng(rows).integers(0, 2 ** 32, (rows, ld), dtype=np.uint64)
    bits = bits.astype(np.uint32)
    # infinities, NaNs (one whose top half alone would read as an infinity), the
    # smallest subnormal, ties to even up and down, and the largest float (to inf)
    special = [0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x00000001, 0x3F808000,
               0x3F818000, 0x3F80C000, 0x7F7FFFFF]
    bits.reshape(-1)[:min(len(special), bits.size)] = special[:bits.size]
    matrix = bits.view(np.float32)
    with standin_cupy.installed() as cp:
        ptr, padded = backend._bf16_operand(cp.asarray(matrix)[:, :cols], ld, "a")
        scratch = next(b for b in backend._bf16_scratch.values() if b.data.ptr == ptr)
        got = backend.to_host(scratch)[:rows * padded].reshape(rows, padded)[:, :cols]
    assert launches == [("mpitrain_to_bf16", (-(-rows * cols // 256),), (256,))]
    want = backend.round_to_bf16(matrix[:, :cols]).view(np.uint32) >> 16
    nan = np.isnan(matrix[:, :cols])
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7FFF) > 0x7F80).all()        # still NaN as bf16, and quiet:
    assert (got[nan] & 0x40).all()


# -- SGD with max-change -------------------------------------------------------------------

LAYOUTS = {
    # several blocks in one layer (16384 elements each), a short tail layer
    "two_layers": ([(0, 40000), (40000, 40030)], [0.75, 0.0]),
    "one_weight": ([(0, 1)], [0.005]),
    # an empty layer, one of exactly a block, one a block and an element
    "many_layers": ([(0, 5), (5, 5), (5, 300), (300, 16684), (16684, 33069), (33069, 33070)],
                    [0.01, 1.0, 0.0, 0.2, 0.3, 0.5]),
}


def _max_change_steps(xp, offsets, limits, grads_per_step, *, lr, momentum, max_change,
                      active=None):
    """Params, delta and the state's buffers after steps from fixed starting params."""
    size = offsets[-1][1]
    params = xp.asarray(np.random.default_rng(7).standard_normal(size).astype(np.float32))
    delta = xp.zeros(size, dtype=xp.float32) if momentum else None
    state = optim_kernels.MaxChangeState(xp, offsets, limits)
    if active is not None:
        state.restrict(active)
    for grads in grads_per_step:
        # (a copy: the step uses the gradient as scratch)
        optim_kernels.max_change_step_(params, xp.asarray(grads.copy()), delta, lr=lr,
                                       momentum=momentum, max_change=max_change, state=state)
    found = {"params": params, "delta": delta, "scales": state.scales, "norms": state.norms,
             "finite": state.finite, "skipped": state.skipped}
    return {k: None if v is None else backend.to_host(v) for k, v in found.items()}


def _compare_max_change(launches, layout, grads_per_step, **options):
    offsets, limits = LAYOUTS[layout]
    with np.errstate(invalid="ignore"):        # (the NumPy path's 0 * NaN, discarded)
        want = _max_change_steps(np, offsets, limits, grads_per_step, **options)
    with standin_cupy.installed() as cp:
        got = _max_change_steps(cp, offsets, limits, grads_per_step, **options)
    names = ["mpitrain_sgd_delta_sumsq", "mpitrain_sgd_scales", "mpitrain_sgd_apply"]
    assert [name for name, _, _ in launches] == names * len(grads_per_step)
    # -lr g and momentum's sums are the same float32 operations on both paths; the
    # norms are float64 sums in another order (n eps64 < 1e-11 relative); scales are
    # float64 formulas rounded to float32 (an ulp apart at most); params + s d
    # differs by an ulp of the larger term
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-11)
    np.testing.assert_allclose(got["scales"], want["scales"], rtol=3e-7)
    np.testing.assert_allclose(got["params"], want["params"], rtol=3e-7, atol=1e-9)
    if want["delta"] is not None:
        np.testing.assert_allclose(got["delta"], want["delta"], rtol=3e-7, atol=1e-12)
    assert got["finite"] == want["finite"] and got["skipped"] == want["skipped"]
    return got


def _gradients(layout, steps, scale=1.0, seed=3):
    size = LAYOUTS[layout][0][-1][1]
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(size)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("max_change", [0.0, 2.0])
def test_the_max_change_step(launches, layout, momentum, max_change):
    got = _compare_max_change(launches, layout, _gradients(layout, 2, scale=30.0), lr=0.01,
                              momentum=momentum, max_change=max_change)
    assert got["finite"] == 1 and got["skipped"] == 0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_max_change_step_without_any_limit(launches, momentum):
    offsets, _ = LAYOUTS["many_layers"]
    LAYOUTS["unlimited"] = (offsets, [0.0] * len(offsets))
    try:
        got = _compare_max_change(launches, "unlimited", _gradients("unlimited", 2), lr=0.01,
                                  momentum=momentum, max_change=0.0)
    finally:
        del LAYOUTS["unlimited"]
    np.testing.assert_allclose(got["scales"], 1.0 - momentum, rtol=1e-7)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_max_change_step_of_some_layers(launches, momentum):
    got = _compare_max_change(launches, "many_layers", _gradients("many_layers", 2), lr=0.01,
                              momentum=momentum, max_change=2.0, active=[2, 3, 4])
    assert got["norms"][[0, 1, 5]].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_non_finite_gradient_skips_the_step(launches, bad, momentum):
    steps = _gradients("many_layers", 3)
    steps[1][16684 + 5] = bad                 # the second step, in a layer's second block
    got = _compare_max_change(launches, "many_layers", steps, lr=0.01, momentum=momentum,
                              max_change=2.0)
    assert got["skipped"] == 1 and got["finite"] == 1


def test_a_huge_finite_gradient_is_clipped_not_skipped(launches):
    # its squares overflow float32 (1e40), not the float64 sums
    got = _compare_max_change(launches, "two_layers", _gradients("two_layers", 1, scale=1e22),
                              lr=0.01, momentum=0.0, max_change=2.0)
    assert got["finite"] == 1 and 0 < got["scales"].max() < 1e-19


# -- the checks themselves can fail ----------------------------------------------------------

@pytest.mark.skipif(bool(os.environ.get(SANITIZE_ENV)),
                    reason="(its write out of bounds would stop the sanitized run)")
def test_the_emulation_reports_races_divergent_barriers_and_writes_out_of_bounds(library):
    module = cuda_emulation.EmulatedModule(library, cuda_emulation.FAULTY_SOURCE, [])
    with standin_cupy.installed() as cp:
        out = cp.zeros(300, dtype=cp.float32)
        for kernel, grid, args, message in [
                ("faulty_race", 1, (out,), "argument 0 differs .* other order"),
                ("faulty_divergent_barrier", 1, (out,), r"__syncthreads\(\) at lines 14 and 16"),
                ("faulty_barrier_after_return", 2, (out,), "after another thread of the block"),
                ("faulty_unbounded_write", 2, (out, np.int32(300)), "a write outside argument 0"),
                # a Python int goes as an int64, not as the int the kernel takes
                ("faulty_unbounded_write", 2, (out, 300), "argument 1: a int64, not int32")]:
            with pytest.raises(AssertionError, match=message):
                module.get_function(kernel)((grid,), (256,), args)


def _run_sanitized(build_dir, keyword: str):
    """This file's tests selected by ``keyword``, under AddressSanitizer."""
    return cuda_emulation.run_sanitized(__file__, build_dir, keyword)


@pytest.mark.skipif(bool(os.environ.get(SANITIZE_ENV)), reason="(the sanitized run itself)")
def test_the_kernels_under_address_sanitizer(build_dir):
    # the large grids add nothing that the small ones do not check for bounds
    run = _run_sanitized(build_dir, "not large and not sanitiz")
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.skipif(bool(os.environ.get(SANITIZE_ENV)), reason="(the sanitized run itself)")
def test_address_sanitizer_catches_a_read_past_a_buffer(build_dir):
    run = _run_sanitized(build_dir, "sanitized_only")
    report = run.stdout + run.stderr
    assert run.returncode != 0 and "AddressSanitizer" in report, report[-4000:]
    assert "faulty_read_past_the_end" in report, report[-4000:]


@pytest.mark.skipif(not os.environ.get(SANITIZE_ENV), reason="run by the test above")
def test_sanitized_only_a_read_past_a_buffer(library):
    module = cuda_emulation.EmulatedModule(library, cuda_emulation.FAULTY_SOURCE, [])
    with standin_cupy.installed() as cp:
        module.get_function("faulty_read_past_the_end")(
            (2,), (256,), (cp.ones(300, dtype=cp.float32), np.int32(300),
                           cp.zeros(1, dtype=cp.float32)))
