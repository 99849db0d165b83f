"""BMUF (parallel/bmuf.py) on virtual ranks: the last, shorter block and a resume.

The spec's recursion (parallel-algorithms.md section 7): G = mean_i w_i - w0,
Delta = eta_b Delta + zeta G, w_g = w0 + Delta, next start w_g + eta_b Delta
(Nesterov).  A run that ends inside a block syncs once more, so the result is
w_g of that short block; a run resumed from a block boundary continues from
the saved start with the saved Delta and takes the same next block.
"""

import glob
import os
import shutil

import numpy as np

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.nn.model_file import load_model
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.bmuf import BlockMomentum

from ..helpers import train_in_process


def _net():
    net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=2)
    return net


def _offset(block, rank, n):
    return (np.random.default_rng([block, rank]).standard_normal(n) * 0.01).astype(np.float32)


def _reference(w0, blocks, size, eta, zeta=1.0):
    """(w_g, start, Delta) after the blocks, in float64, from the spec's formulas."""
    start, delta = np.float64(w0), np.zeros(len(w0))
    for b in range(blocks):
        mean = np.mean([start + _offset(b, r, len(w0)) for r in range(size)], axis=0)
        delta = eta * delta + zeta * (mean - start)
        w_g = start + delta
        start = w_g + eta * delta
    return w_g, start, delta


def test_a_run_ending_inside_a_block_syncs_once_more_and_keeps_w_g():
    size = 3

    def work(comm):
        net = _net()
        opt = SGD(net, momentum=0.9)
        bmuf = BlockMomentum(comm, every_steps=4)
        bmuf.setup(net, opt)
        w0 = net.params.copy()
        for b, step in enumerate((4, 8)):
            net.params[...] = bmuf.start + _offset(b, comm.rank, net.num_params)
            bmuf.after_update(net, opt, step)
        # two steps into the third block, the run ends
        net.params[...] = bmuf.start + _offset(2, comm.rank, net.num_params)
        opt.delta[...] = 1.0
        bmuf.finalize(net, opt, 10)
        return w0, net.params.copy(), bmuf.global_model.copy(), opt.delta.copy()

    results = VirtualCluster(size).run(work)
    w0 = results[0][0]
    w_g, _, _ = _reference(w0, 3, size, eta=1 - 1 / size)
    for _, final, global_model, momentum in results:
        np.testing.assert_allclose(final, w_g, rtol=1e-5, atol=2e-6)
        assert np.array_equal(final, global_model)
        assert np.array_equal(final, results[0][1])         # every rank holds it
        assert not momentum.any()                           # the sync reset it


def test_a_resume_from_a_block_boundary_takes_the_same_next_block():
    size = 2

    def work(comm):
        net = _net()
        opt = SGD(net)
        bmuf = BlockMomentum(comm, every_steps=3)
        bmuf.setup(net, opt)
        for b, step in enumerate((3, 6)):
            net.params[...] = bmuf.start + _offset(b, comm.rank, net.num_params)
            bmuf.after_update(net, opt, step)
        state = {k: np.array(v, copy=True) for k, v in bmuf.state_dict().items()}
        # straight on: the third block
        net.params[...] = bmuf.start + _offset(2, comm.rank, net.num_params)
        bmuf.after_update(net, opt, 9)
        straight = (net.params.copy(), bmuf.global_model.copy(), bmuf.delta.copy())
        # resumed: a new strategy from the checkpoint's state; the model the checkpoint
        # holds (w_g) is not where training continues
        net.params[...] = state["global_model"]
        again = BlockMomentum(comm, every_steps=3)
        again.bind(net)
        again.load_state_dict(state)
        again.resume(net)
        assert np.array_equal(net.params, state["start"])
        net.params[...] = again.start + _offset(2, comm.rank, net.num_params)
        again.after_update(net, opt, 9)
        return straight, (net.params.copy(), again.global_model.copy(), again.delta.copy())

    for straight, resumed in VirtualCluster(size).run(work):
        for a, b in zip(straight, resumed):
            assert np.array_equal(a, b)


def test_one_rank_resumed_from_a_middle_checkpoint_is_bit_exact(small_corpus, tmp_path):
    # on one rank a checkpoint was written at any step, also inside a block; its
    # model is w_g and a resumed run goes on from the block start, so the steps
    # since then were lost (a block momentum makes one rank's BMUF no plain SGD)
    settings = ["model.hidden_dim=16", "model.hidden_layers=1", "training.epochs=1",
                "parallel.method=bmuf", "parallel.average_every=8",
                "parallel.block_momentum=0.5", "training.checkpoint_interval=5",
                "training.keep_checkpoints=100", "training.max_steps=24"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_in_process(straight, small_corpus, settings)
    shutil.copytree(straight, split)
    checkpoints = sorted(glob.glob(str(split / "ckpt-*.h5")))
    for path in checkpoints[1:]:             # interrupted after the first checkpoint
        os.remove(path)
    os.remove(split / "final.h5")
    train_in_process(split, small_corpus, settings, resume=True)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params), np.abs(a.params - b.params).max()
