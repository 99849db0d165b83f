"""Averaged CD-1 training of an RBM under ``mpiexec -n N`` (tests/train/test_pretrain.py).

Every rank builds the same RBM and trains it with
:class:`~mpitrain.nn.rbm.ContrastiveDivergence`, averaged by the supervised
:class:`~mpitrain.parallel.model_averaging.ModelAveraging` strategy.  Rank 0
also trains one-rank references in this process, so the checks are:

- same data and samples on every rank, K = 1: the averaged RBM equals the
  one-rank RBM bit for bit (the mean of equal buffers is the buffer);
- rank-own data, K = 1: equals one rank training on the ranks' minibatches
  stacked (CD-1's statistics are means over the minibatch, linear in them);
- rank-own data, K = 3, an uneven last block: all ranks hold the same RBM
  after ``finalize``.

Rank 0 prints "ok <check>" per check; a failed assertion aborts the job.
"""

import sys

import numpy as np

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.single import SingleCommunicator
from mpitrain.nn.rbm import RBM, ContrastiveDivergence
from mpitrain.parallel.model_averaging import ModelAveraging

expected_size = int(sys.argv[1])
comm = create_communicator("auto")
install_abort_hook(comm)
rank, size = comm.rank, comm.size
assert size == expected_size, (size, expected_size)
VISIBLE, HIDDEN, BATCH, STEPS = 12, 8, 16, 9


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def batch(step, r):
    """Rank r's minibatch and hidden-unit uniforms at ``step`` (any rank can compute any)."""
    rng = np.random.default_rng([5, r, step])
    v = rng.standard_normal((BATCH, VISIBLE)).astype(np.float32)
    return v, rng.random((BATCH, HIDDEN), dtype=np.float32)


def train(communicator, every, data_of, steps=STEPS):
    rbm = RBM(VISIBLE, HIDDEN, visible="gaussian")
    rbm.init_params(seed=3)
    cd = ContrastiveDivergence(rbm, weight_decay=0.001)
    strategy = ModelAveraging(communicator, every_steps=every)
    strategy.setup(rbm, cd)
    for step in range(steps):
        v, u = data_of(step)
        cd.step(v, u, learning_rate=0.05, momentum=0.5)
        strategy.after_update(rbm, cd, step + 1)
    strategy.finalize(rbm, cd, steps)
    return rbm.params.copy()


def gather(buf):
    copies = [buf] if rank == 0 else None
    if rank != 0:
        comm.send(np.ascontiguousarray(buf), dest=0, tag=31)
        return None
    for source in range(1, size):
        other = np.empty_like(buf)
        comm.recv(other, source=source, tag=31)
        copies.append(other)
    return copies


# same data everywhere, K = 1: bit for bit the one-rank RBM
averaged = train(comm, 1, lambda step: batch(step, 0))
if rank == 0:
    alone = train(SingleCommunicator(), 1, lambda step: batch(step, 0))
    assert np.array_equal(averaged, alone), np.abs(averaged - alone).max()
ok("same_data_equals_one_rank")

# own data, K = 1: one rank on the stacked minibatches
averaged = train(comm, 1, lambda step: batch(step, rank))
copies = gather(averaged)
if rank == 0:
    def stacked(step):
        parts = [batch(step, r) for r in range(size)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    alone = train(SingleCommunicator(), 1, stacked)
    for r, other in enumerate(copies):
        assert np.array_equal(other, copies[0]), f"rank {r} differs"
    assert np.allclose(averaged, alone, rtol=1e-4, atol=1e-5), np.abs(averaged - alone).max()
ok("k1_equals_stacked_minibatch")

# own data, K = 3 with a last block of 2 steps: in sync after finalize
averaged = train(comm, 3, lambda step: batch(step, rank), steps=8)
copies = gather(averaged)
if rank == 0:
    for r, other in enumerate(copies):
        assert np.array_equal(other, copies[0]), f"rank {r} differs after finalize"
ok("in_sync_after_finalize")
