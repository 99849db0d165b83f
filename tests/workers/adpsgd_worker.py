"""Checks of ADPSGD's pairwise mixing (mpitrain/parallel/adpsgd.py) under ``mpiexec -n N``.

Usage: adpsgd_worker.py NRANKS

Run by tests/parallel/test_adpsgd.py.  Each rank's buffer is a known function
of (seed, rank), so every expected value is computed here in float64 from the
rule w_i, w_j <- (w_i + w_j) / 2, independently of the strategy.  For each
topology, with and without delay-by-one, over several iterations: the mean of
the models over the ranks is kept, partners hold the mean of their two models
(a rank sitting out keeps its own), and every rank computed the same pairing.
Rank 0 prints one "ok <check>" line per check; a failed assertion aborts the
job (abort hook) with the traceback on stderr.
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


def check_mixing(topology, delay_by_one, seed=5):
    net = small_net()
    opt = SGD(net)
    strategy = RingMixing(comm, topology=topology, delay_by_one=delay_by_one, seed=seed)
    strategy.setup(net, opt)
    n = net.num_params
    models = [np.float64(content(100, r, n)) for r in range(size)]   # the reference, float64
    net.params[...] = content(100, rank, n)
    if delay_by_one:
        # the exchange of the broadcast start is in flight: all copies equal, no change
        strategy.after_update(net, opt, 1)
        assert np.array_equal(net.params, content(100, rank, n))
        first = 2
    else:
        first = 1
    for k in range(first, first + ITERATIONS):
        pairs = ring_pairs(topology, size, k, seed)
        # every rank computed the same pairing, without communicating
        everyone = comm.allgather_obj([list(p) for p in pairs])
        assert all(theirs == everyone[0] for theirs in everyone), everyone
        seen = [r for p in pairs for r in p]
        assert len(seen) == len(set(seen)) == 2 * (size // 2), pairs
        mean_before = np.mean(gather_all(net.params), axis=0, dtype=np.float64)
        strategy.after_update(net, opt, k)
        for a, b in pairs:
            models[a] = models[b] = (models[a] + models[b]) / 2
        np.testing.assert_allclose(net.params, models[rank], rtol=1e-5, atol=1e-5)
        after = gather_all(net.params)
        np.testing.assert_allclose(np.mean(after, axis=0, dtype=np.float64), mean_before,
                                   rtol=1e-5, atol=1e-6)
        for a, b in pairs:
            if delay_by_one:     # w + (w_j - w)/2 on each side: equal up to rounding
                np.testing.assert_allclose(after[a], after[b], rtol=1e-6, atol=1e-6)
            else:                # (a + b)/2 is the same sum on both sides
                assert np.array_equal(after[a], after[b]), (a, b)
    if size > 1:
        assert strategy.num_mixes >= 1
    # the mixes drove every model towards the mean of the starting models
    start_mean = np.mean([content(100, r, n) for r in range(size)], axis=0, dtype=np.float64)
    strategy.finalize(net, opt, first + ITERATIONS - 1)
    np.testing.assert_allclose(net.params, start_mean, rtol=1e-5, atol=1e-5)
    # a checkpoint after the end keeps this rank's own model, not the average
    np.testing.assert_allclose(strategy.rank_state_dict()["params"], models[rank],
                               rtol=1e-5, atol=1e-5)
    ok(f"{topology}{' delay_by_one' if delay_by_one else ''} keeps the mean")


def check_delay_by_one_adds_the_step():
    """The step taken while the exchange is in flight stays on top of the mix."""
    net = small_net()
    opt = SGD(net)
    strategy = RingMixing(comm, topology="fixed_ring", delay_by_one=True)
    strategy.setup(net, opt)
    n = net.num_params
    net.params[...] = content(200, rank, n)
    strategy.after_update(net, opt, 1)          # starts the exchange for iteration 2
    step = content(300, rank, n) * np.float32(0.01)
    net.params += step                           # the local SGD step, meanwhile
    strategy.after_update(net, opt, 2)
    partner = strategy.partner(2)
    mine = np.float64(content(200, rank, n))
    mixed = mine if partner is None else (mine + content(200, partner, n)) / 2
    np.testing.assert_allclose(net.params, mixed + step, rtol=1e-5, atol=1e-6)
    strategy.finalize(net, opt, 2)
    ok("delay_by_one adds the mix to the step taken meanwhile")


for topology in ("fixed_ring", "random_ring"):
    for delay in (False, True):
        check_mixing(topology, delay)
check_delay_by_one_adds_the_step()
comm.barrier()
if rank == 0:
    print(f"all adpsgd checks passed on {size} ranks", flush=True)
