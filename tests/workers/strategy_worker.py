"""Checks of the data-parallel strategies under ``mpiexec -n N``.

Usage: strategy_worker.py NRANKS

Run by tests/parallel/test_strategies.py.  Every expected value is computed
here, independently of the strategy under test: each rank's buffer content is
a known function of (seed, rank), and the buffers are also brought to rank 0
with plain point-to-point messages, so the reference mean, the BMUF update and
the Kaldi average are evaluated in float64 numpy from the spec's formulas.
Rank 0 prints one "ok <check>" line per check; a failed assertion aborts the
whole job (abort hook) with the traceback on stderr.
"""

import sys

import numpy as np

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.gradient_allreduce import GradientAllreduce
from mpitrain.parallel.model_averaging import ModelAveraging
from mpitrain.parallel.bmuf import BlockMomentum
from mpitrain.parallel.kaldi_averaging import KaldiAveraging

expected_size = int(sys.argv[1])
comm = create_communicator("auto")
install_abort_hook(comm)
rank, size = comm.rank, comm.size
assert size == expected_size, (size, expected_size)

FEAT_DIM, CONTEXT, CLASSES = 6, 1, 7          # input 6 * (1 + 1 + 1) = 18
NO_MAX_CHANGE = dict(max_change_per_layer=0.0, max_change_output=0.0, max_change=0.0)


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def small_net(seed=3):
    net = build_network(feat_dim=FEAT_DIM, num_classes=CLASSES, left_context=CONTEXT,
                        right_context=CONTEXT, hidden_layers=2, hidden_dim=32)
    net.init_params(seed=seed)
    # the output layer starts at zero; give it values so every layer's gradient is non-trivial
    net.params[...] += np.random.default_rng([seed, 99]).standard_normal(
        net.num_params).astype(np.float32) * 0.05
    return net


def content(seed, r, n, dtype=np.float32):
    """Rank r's deterministic buffer: every rank can compute every rank's."""
    return np.random.default_rng([seed, r]).standard_normal(n).astype(dtype)


def gather_on_root(buf):
    """Every rank's copy of ``buf`` on rank 0 (a list), by point-to-point messages only."""
    if rank != 0:
        comm.send(np.ascontiguousarray(buf), dest=0, tag=17)
        return None
    copies = [np.array(buf, copy=True)]
    for source in range(1, size):
        other = np.empty_like(buf)
        got, _ = comm.recv(other, source=source, tag=17)
        assert got == source, (got, source)
        copies.append(other)
    return copies


def assert_same_on_all_ranks(buf, what):
    copies = gather_on_root(buf)
    if rank == 0:
        for r, other in enumerate(copies):
            assert np.array_equal(other, copies[0]), \
                f"{what}: rank {r} differs from rank 0 by {np.abs(other - copies[0]).max()}"


def global_batch(step, rows, seed=11):
    """The same (x, labels) on every rank; rank r trains on its slice of it."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((rows, FEAT_DIM * (2 * CONTEXT + 1))).astype(np.float32)
    labels = rng.integers(0, CLASSES, rows).astype(np.int32)
    return x, labels


# --------------------------------------------------------------------- averaging

def check_model_averaging():
    net = small_net()
    opt = SGD(net, momentum=0.5)
    strategy = ModelAveraging(comm, every_steps=3, average_momentum=True)
    strategy.setup(net, opt)
    assert_same_on_all_ranks(net.params, "params after setup (broadcast)")
    n = net.num_params
    net.params[...] = content(1, rank, n)
    opt.delta[...] = content(2, rank, n)
    pre_params, pre_delta = gather_on_root(net.params), gather_on_root(opt.delta)
    if rank == 0:       # the buffers really were the known per-rank contents
        for r in range(size):
            assert np.array_equal(pre_params[r], content(1, r, n))
    # not a multiple of every_steps: nothing happens
    strategy.after_update(net, opt, 2)
    assert np.array_equal(net.params, content(1, rank, n))
    strategy.after_update(net, opt, 3)
    assert strategy.num_averages == 1
    expected = np.mean([content(1, r, n, np.float64) for r in range(size)], axis=0)
    np.testing.assert_allclose(net.params, expected, rtol=1e-6, atol=1e-6)
    expected_delta = np.mean([content(2, r, n, np.float64) for r in range(size)], axis=0)
    np.testing.assert_allclose(opt.delta, expected_delta, rtol=1e-6, atol=1e-6)
    if rank == 0:       # and it is the mean of the buffers as they were sent
        np.testing.assert_allclose(net.params, np.mean(np.float64(pre_params), axis=0),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(opt.delta, np.mean(np.float64(pre_delta), axis=0),
                                   rtol=1e-6, atol=1e-6)
    assert_same_on_all_ranks(net.params, "params after averaging")
    assert_same_on_all_ranks(opt.delta, "momentum after averaging")
    # finalize after a partial block (step 4: one step past the last average) averages once more
    net.params[...] = content(3, rank, n)
    strategy.finalize(net, opt, 4)
    expected = np.mean([content(3, r, n, np.float64) for r in range(size)], axis=0)
    np.testing.assert_allclose(net.params, expected, rtol=1e-6, atol=1e-6)
    assert_same_on_all_ranks(net.params, "params after finalize")
    ok("model averaging")


def bmuf_reference(w0, locals_, blocks, *, eta, zeta, nesterov):
    """The spec's block update (parallel-algorithms.md section 7) in float64.

    Returns (next start, w_g, Delta) after the given blocks; ``locals_[b]`` is
    the list of per-rank offsets added to the block's start point in block b.
    """
    start = np.float64(w0)
    delta = np.zeros_like(start)
    w_g = start
    for offsets in locals_[:blocks]:
        mean_w = np.mean([start + off for off in offsets], axis=0)
        g = mean_w - start
        delta = eta * delta + zeta * g
        w_g = start + delta
        start = w_g + eta * delta if nesterov else w_g
    return start, w_g, delta


def check_bmuf(nesterov):
    net = small_net()
    opt = SGD(net, momentum=0.9)
    zeta = 0.7
    strategy = BlockMomentum(comm, every_steps=4, block_lr=zeta, nesterov=nesterov)
    eta = 1.0 - 1.0 / size
    assert abs(strategy.block_momentum - eta) < 1e-12, strategy.block_momentum
    strategy.setup(net, opt)
    w0 = np.float64(net.params.copy())
    n = net.num_params
    offsets = [[content(10 + b, r, n, np.float64) * 0.01 for r in range(size)]
               for b in range(2)]
    for b in range(2):
        # local training moved this rank's model from the block start
        net.params[...] = (np.float64(strategy.start) + offsets[b][rank]).astype(np.float32)
        opt.delta[...] = 1.0
        strategy.after_update(net, opt, 4 * (b + 1))
        # reference from the float32 start the ranks actually used
        start, w_g, delta = bmuf_reference(w0, offsets, b + 1, eta=eta, zeta=zeta,
                                           nesterov=nesterov)
        np.testing.assert_allclose(strategy.delta, delta, rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(strategy.global_model, w_g, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(net.params, start, rtol=1e-5, atol=2e-6)
        assert np.array_equal(strategy.start, net.params)
        assert not opt.delta.any(), "local momentum must be reset after a block sync"
        assert_same_on_all_ranks(net.params, "BMUF block start")
        assert_same_on_all_ranks(strategy.global_model, "BMUF global model")
    strategy.finalize(net, opt, 8)
    assert np.array_equal(net.params, strategy.global_model), "final model must be w_g"
    ok(f"bmuf {'nesterov' if nesterov else 'classic'}")


def kaldi_jobs(num_iters, initial, final):
    # Kaldi's train_dnn.py: int(0.5 + initial + (final - initial) * iter / num_iters)
    return [int(0.5 + initial + (final - initial) * i / num_iters) for i in range(num_iters)]


def check_kaldi_idle_ranks():
    net = small_net()
    opt = SGD(net)
    every, iters = 5, 4
    strategy = KaldiAveraging(comm, every_steps=every, total_steps=every * iters,
                              jobs_initial=1, jobs_final=size)
    strategy.setup(net, opt)
    jobs = kaldi_jobs(iters, 1, size)
    assert strategy.jobs == jobs, (strategy.jobs, jobs)
    assert jobs[0] == 1 and jobs[-1] >= size - 1
    n = net.num_params
    for it, J in enumerate(jobs):
        first, last = it * every, (it + 1) * every - 1
        for step in (first, last):
            assert strategy.is_active(step) == (rank < J), (step, J)
            assert strategy.active_ranks(step) == J
            assert strategy.learning_rate(0.25, step) == 0.25 * J
        # active ranks trained; idle ranks hold something that must not count
        net.params[...] = content(20 + it, rank, n) if rank < J else np.float32(1e3)
        strategy.after_update(net, opt, last + 1)
        expected = np.mean([content(20 + it, r, n, np.float64) for r in range(J)], axis=0)
        np.testing.assert_allclose(net.params, expected, rtol=1e-6, atol=1e-6)
        assert_same_on_all_ranks(net.params, f"Kaldi average of iteration {it}")
    ok("kaldi idle ranks")


# --------------------------------------------------------------- equivalences

def check_allreduce_equals_big_batch(**options):
    """N ranks x minibatch B with gradient allreduce == 1 rank x minibatch N*B.

    The loss is summed over frames, so the N-rank mean of gradients is
    (1/N) x the gradient of the N*B batch.  Both runs take the same step only
    when the N-rank learning rate is N times the single-rank one; the
    momentum recursion and the max-change caps (applied to lr x gradient) then
    see identical deltas too.  ``options`` go to GradientAllreduce (overlap:
    bucketed non-blocking reductions started during backward).
    """
    B, steps, lr, momentum = 8, 5, 0.02, 0.5
    net = small_net()
    opt = SGD(net, momentum=momentum)
    strategy = GradientAllreduce(comm, **options)
    strategy.setup(net, opt)
    start = net.params.copy()
    if rank == 0:
        ref = small_net()
        ref_opt = SGD(ref, momentum=momentum)
        wrong = small_net()           # same lr as the ranks: must NOT match
        wrong_opt = SGD(wrong, momentum=momentum)
    for step in range(steps):
        x, labels = global_batch(step, size * B)
        mine = slice(rank * B, (rank + 1) * B)
        net.forward_backward(x[mine], labels[mine])
        strategy.reduce_gradients(net)
        opt.step(lr * size)
        strategy.after_update(net, opt, step + 1)
        if rank == 0:
            ref.forward_backward(x, labels)
            ref_opt.step(lr)
            wrong.forward_backward(x, labels)
            wrong_opt.step(lr * size)
    assert_same_on_all_ranks(net.params, "allreduce params")
    if rank == 0:
        moved = np.abs(np.float64(ref.params) - start).max()
        diff = np.abs(np.float64(net.params) - ref.params).max()
        assert moved > 1e-2, f"the reference barely trained (max change {moved})"
        assert diff <= 1e-4 * moved, f"allreduce differs from the big batch by {diff} ({moved})"
        if size > 1:
            off = np.abs(np.float64(net.params) - wrong.params).max()
            assert off > 100 * max(diff, 1e-7), \
                f"unscaled learning rate matched too ({off} vs {diff}): the check is blind"
    if options.get("overlap"):
        ok("allreduce with overlap equals one rank with N*B")
    else:
        ok("allreduce equals one rank with N*B")


def check_averaging_k1_equals_allreduce():
    """Model averaging every step with plain SGD == gradient allreduce.

    Averaging w - lr g_r over ranks gives w - lr mean(g_r) exactly as the
    allreduce does.  Max-change is off: it caps each rank's own lr g_r
    before the average, but the mean gradient after the allreduce, so with it
    on the two would differ whenever a cap binds.
    """
    B, steps, lr = 8, 5, 0.05
    a, b = small_net(), small_net()
    opt_a, opt_b = SGD(a, **NO_MAX_CHANGE), SGD(b, **NO_MAX_CHANGE)
    reduce_grads = GradientAllreduce(comm)
    average = ModelAveraging(comm, every_steps=1)
    reduce_grads.setup(a, opt_a)
    average.setup(b, opt_b)
    start = a.params.copy()
    for step in range(steps):
        x, labels = global_batch(step, size * B, seed=12)
        mine = slice(rank * B, (rank + 1) * B)
        a.forward_backward(x[mine], labels[mine])
        reduce_grads.reduce_gradients(a)
        opt_a.step(lr)
        reduce_grads.after_update(a, opt_a, step + 1)
        b.forward_backward(x[mine], labels[mine])
        average.reduce_gradients(b)
        opt_b.step(lr)
        if step == 0 and size > 1:   # before averaging the replicas really differ
            copies = gather_on_root(b.params)
            if rank == 0:
                assert not np.array_equal(copies[0], copies[1])
        average.after_update(b, opt_b, step + 1)
    assert average.num_averages == (steps if size > 1 else 0)
    assert_same_on_all_ranks(b.params, "model-averaged params")
    moved = np.abs(np.float64(a.params) - start).max()
    diff = np.abs(np.float64(a.params) - b.params).max()
    assert moved > 1e-2, f"barely trained (max change {moved})"
    assert diff <= 1e-4 * moved, f"K=1 averaging differs from allreduce by {diff} ({moved})"
    ok("model averaging K=1 equals allreduce")


check_model_averaging()
check_bmuf(nesterov=True)
check_bmuf(nesterov=False)
check_kaldi_idle_ranks()
check_allreduce_equals_big_batch()
# 2 KB buckets: the 18-32-32-7 model's gradients go in several pieces
check_allreduce_equals_big_batch(overlap=True, bucket_bytes=2048)
check_averaging_k1_equals_allreduce()
comm.barrier()
if rank == 0:
    print(f"all strategy checks passed on {size} ranks", flush=True)
