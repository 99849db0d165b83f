"""Checks of asynchronous ADPSGD's mixing (mpitrain/parallel/async_adpsgd.py) under
``mpiexec -n N``.

Usage: async_adpsgd_worker.py NRANKS

Run by tests/parallel/test_async_adpsgd.py.  Each rank starts from a known
model of (seed, rank), then "steps" (sleeps 1 + rank/2 ms, no gradient) and
mixes after each step, at its own pace, for each topology; then all quiesce.
Checked in float64 against the start: the mean of the models over the ranks
is kept, the models came closer together, every rank mixed, and the mixes of
the active ranks equal those of the passive ones (each mix has one of each).
Rank 0 prints one "ok <check>" line per topology; a failed assertion aborts the
job (abort hook) with the traceback on stderr.
"""

import sys
import time

import numpy as np

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.async_adpsgd import AsyncRingMixing, active_ranks

expected_size = int(sys.argv[1])
comm = create_communicator("auto")
install_abort_hook(comm)
rank, size = comm.rank, comm.size
assert size == expected_size, (size, expected_size)
STEPS = 30


def gather_all(buf):
    return np.array([np.asarray(x, dtype=np.float64) for x in comm.allgather_obj(buf.tolist())])


def check(topology):
    net = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=16)
    net.params[...] = np.random.default_rng([11, rank]).standard_normal(
        net.num_params).astype(np.float32)
    before = gather_all(net.params)
    ring = AsyncRingMixing(comm, topology=topology, seed=4)
    ring.bind(net)
    opt = SGD(net)
    for k in range(STEPS):
        time.sleep(0.001 * (1 + rank / 2))
        ring.after_update(net, opt, k + 1)
    ring.quiesce()
    after = gather_all(net.params)
    np.testing.assert_allclose(after.mean(axis=0), before.mean(axis=0), atol=2e-6)
    assert after.std(axis=0).mean() < 0.5 * before.std(axis=0).mean()
    mixes = comm.allgather_obj(ring.mixes)
    assert min(mixes) >= 3, mixes
    actives = sum(mixes[r] for r in active_ranks(size))
    assert actives == sum(mixes) - actives, mixes
    if rank == 0:
        print(f"ok {topology} keeps the mean", flush=True)


check("fixed_ring")
check("random_ring")
