"""Checks of ADPSGD's pairwise mixing (mpitrain/parallel/adpsgd.py) under ``mpiexec -n N``.

Usage: adpsgd_worker.py NRANKS

Run by tests/parallel/test_adpsgd.py.  Each rank's start and its gradient at
each step are known functions of (seed, rank, step), so every expected value
is computed here in float64 from the spec's rule, independently of the
strategy: w_i <- (w_i + w_j) / 2 - lr g_i(w_i) (the rank's own gradient, on
the weights before the mix), and with delay-by-one w_i <- (w_i + w_j) / 2 -
lr g_i of the step before.  For each topology, with and without delay-by-one,
over several iterations: every rank holds the rule's weights, the mean of the
models over the ranks moves by the mean step only, and every rank computed
the same pairing.  Rank 0 prints one "ok <check>" line per check; a failed
assertion aborts the job (abort hook) with the traceback on stderr.
"""

import sys

import numpy as np

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.adpsgd import RingMixing, ring_pairs

expected_size = int(sys.argv[1])
comm = create_communicator("auto")
install_abort_hook(comm)
rank, size = comm.rank, comm.size
assert size == expected_size, (size, expected_size)
ITERATIONS = 6


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def small_net():
    net = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=16)
    net.init_params(seed=3)
    return net


def content(seed, r, n):
    return np.random.default_rng([seed, r]).standard_normal(n).astype(np.float32)


def gather_all(buf):
    """Every rank's ``buf``, on every rank (rank order)."""
    return [np.asarray(x, dtype=np.float32) for x in comm.allgather_obj(buf.tolist())]


def check_mixing(topology, delay_by_one, seed=5, lr=0.25):
    net = small_net()
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0)
    strategy = RingMixing(comm, topology=topology, delay_by_one=delay_by_one, seed=seed)
    strategy.setup(net, opt)        # every rank starts from rank 0's model
    n = net.num_params
    models = [np.float64(m) for m in gather_all(net.params)]        # the reference, float64
    held = [np.zeros(n) for _ in range(size)]
    for k in range(1, 1 + ITERATIONS):
        pairs = ring_pairs(topology, size, k, seed)
        # every rank computed the same pairing, without communicating
        everyone = comm.allgather_obj([list(p) for p in pairs])
        assert all(theirs == everyone[0] for theirs in everyone), everyone
        seen = [r for p in pairs for r in p]
        assert len(seen) == len(set(seen)) == 2 * (size // 2), pairs
        grads = [np.float64(content(1000 + k, r, n)) for r in range(size)]
        net.grads[...] = content(1000 + k, rank, n)
        strategy.reduce_gradients(net)
        opt.step(lr)
        strategy.after_update(net, opt, k)
        applied = held if delay_by_one else grads
        mixed = list(models)
        for a, b in pairs:
            mixed[a] = mixed[b] = (models[a] + models[b]) / 2
        mean_step = lr * np.mean(applied, axis=0)
        mean_before = np.mean(models, axis=0)
        models = [mixed[r] - lr * applied[r] for r in range(size)]
        held = grads
        np.testing.assert_allclose(net.params, models[rank], rtol=1e-5, atol=1e-5)
        # the mix keeps the mean: it moves by the mean step only
        after = gather_all(net.params)
        np.testing.assert_allclose(np.mean(after, axis=0, dtype=np.float64),
                                   mean_before - mean_step, rtol=1e-5, atol=1e-5)
    if size > 1:
        assert strategy.num_mixes >= 1
    expected_mean = np.mean(models, axis=0)
    strategy.finalize(net, opt, ITERATIONS)
    np.testing.assert_allclose(net.params, expected_mean, rtol=1e-5, atol=1e-5)
    # a checkpoint after the end keeps this rank's own model, not the average
    own = strategy.rank_state_dict()
    np.testing.assert_allclose(own["params"], models[rank], rtol=1e-5, atol=1e-5)
    if delay_by_one:      # and the gradient its next step would have applied
        np.testing.assert_allclose(own["held_gradient"], held[rank], rtol=1e-6)
    ok(f"{topology}{' delay_by_one' if delay_by_one else ''} follows the rule")


def check_a_pair_does_not_share_its_gradients():
    """Two ranks: the lock-step rule is not synchronous SGD (each rank's step is its
    own gradient's, so the pair's models differ by the difference of their steps)."""
    net = small_net()
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0)
    strategy = RingMixing(comm, topology="fixed_ring")
    strategy.setup(net, opt)
    partner = strategy.partner(1)
    net.grads[...] = content(400, rank, net.num_params)
    strategy.reduce_gradients(net)
    opt.step(0.5)
    strategy.after_update(net, opt, 1)
    if partner is not None:
        theirs = np.asarray(comm.allgather_obj(net.params.tolist())[partner], np.float32)
        np.testing.assert_allclose(
            np.float64(net.params) - theirs,
            0.5 * (np.float64(content(400, partner, net.num_params))
                   - content(400, rank, net.num_params)), rtol=1e-4, atol=1e-5)
    else:
        comm.allgather_obj(net.params.tolist())
    strategy.finalize(net, opt, 1)
    ok("each rank steps by its own gradient")


for topology in ("fixed_ring", "random_ring"):
    for delay in (False, True):
        check_mixing(topology, delay)
check_a_pair_does_not_share_its_gradients()
comm.barrier()
if rank == 0:
    print(f"all adpsgd checks passed on {size} ranks", flush=True)
