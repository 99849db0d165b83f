"""ADPSGD (parallel/adpsgd.py): the ring pairings, one rank, and real launches.

In this process: each iteration's pairs are a matching of the ranks, the
fixed ring alternates right and left partners, the random ring is a pure
function of (seed, iteration) that changes with either, and on one rank the
strategy changes nothing.  Under real ``mpiexec -n 2, 3, 4`` (marked mpi;
tests/workers/adpsgd_worker.py): mixing keeps the mean of the models over the
ranks for both topologies, with and without delay-by-one, and every rank
computes the same pairing.  End to end on the small corpus on 2 ranks: every
variant trains to the end (mpi) and learns far above chance (mpi, slow); a
job with a 2x slow rank on uneven shards finishes.
"""

import os

import numpy as np
import pytest

from mpitrain.comm.single import SingleCommunicator
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.adpsgd import RingMixing, partner_of, ring_order, ring_pairs
from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi

from ..helpers import QUICKSTART, WORKERS, mpi_output, records, train_on_ranks

TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]
VARIANTS = {"fixed_ring": ["parallel.topology=fixed_ring"],
            "random_ring": ["parallel.topology=random_ring"],
            "delay_by_one": ["parallel.delay_by_one=true"]}


# ---------------------------------------------------------------- pairings

@pytest.mark.parametrize("topology", ["fixed_ring", "random_ring"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_pairs_are_a_matching(topology, size):
    for iteration in range(1, 40):
        pairs = ring_pairs(topology, size, iteration, seed=3)
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks)) == 2 * (size // 2)
        assert all(0 <= r < size for r in ranks)
        for a, b in pairs:
            assert partner_of(a, topology, size, iteration, 3) == b
            assert partner_of(b, topology, size, iteration, 3) == a


def test_fixed_ring_alternates_right_and_left_partners():
    assert ring_pairs("fixed_ring", 4, 2) == [(0, 1), (2, 3)]
    assert ring_pairs("fixed_ring", 4, 3) == [(1, 2), (3, 0)]
    # odd: the ring is not closed, the last or the first rank sits out
    assert ring_pairs("fixed_ring", 3, 2) == [(0, 1)]
    assert ring_pairs("fixed_ring", 3, 3) == [(1, 2)]
    assert ring_pairs("fixed_ring", 5, 3) == [(1, 2), (3, 4)]
    assert ring_pairs("fixed_ring", 1, 1) == []
    assert partner_of(0, "fixed_ring", 1, 1) is None
    # even ranks pair with their right neighbour, then with their left one
    assert [partner_of(2, "fixed_ring", 6, k) for k in (2, 3)] == [3, 1]


def test_random_ring_is_shared_and_changes_with_seed_and_iteration():
    # a pure function of (seed, iteration): what every rank computes alike
    assert ring_order("random_ring", 8, 5, seed=1) == ring_order("random_ring", 8, 5, seed=1)
    assert sorted(ring_order("random_ring", 8, 5, seed=1)) == list(range(8))
    by_seed = {tuple(ring_pairs("random_ring", 8, 5, seed)) for seed in range(6)}
    assert len(by_seed) > 1
    by_iteration = {tuple(ring_order("random_ring", 8, k, seed=1)) for k in range(6)}
    assert len(by_iteration) > 1
    # over many iterations each rank meets many partners, not just two neighbours
    met = {partner_of(0, "random_ring", 8, k, 1) for k in range(1, 60)}
    assert len(met - {None}) >= 5


def test_config_offers_exactly_the_topologies():
    import dataclasses
    from mpitrain.config import ParallelConfig
    from mpitrain.parallel.adpsgd import TOPOLOGIES
    field = {f.name: f for f in dataclasses.fields(ParallelConfig)}["topology"]
    assert field.metadata["choices"] == TOPOLOGIES


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="topology"):
        RingMixing(SingleCommunicator(), topology="star")


def _one_rank_ring(delay_by_one):
    """(net, optimizer, strategy) of a one-rank ring, set up."""
    net = build_network(feat_dim=4, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=8)
    net.init_params(seed=1)
    opt = SGD(net)
    strategy = RingMixing(SingleCommunicator(), delay_by_one=delay_by_one)
    strategy.setup(net, opt)
    return net, opt, strategy


@pytest.mark.parametrize("delay_by_one", [False, True])
def test_one_rank_changes_nothing(delay_by_one):
    net, opt, strategy = _one_rank_ring(delay_by_one)
    before = net.params.copy()
    for step in range(1, 5):
        strategy.after_update(net, opt, step)
    strategy.finalize(net, opt, 4)
    assert np.array_equal(net.params, before)
    assert strategy.num_mixes == 0
    assert strategy.state_dict() == {"iteration": 4}
    assert np.array_equal(strategy.rank_state_dict()["params"], before)


# ------------------------------------------------------------ real launches

@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_mixing_keeps_the_mean_on_real_ranks(nranks):
    result = run_mpi(nranks, [str(WORKERS / "adpsgd_worker.py"), str(nranks)], timeout=120)
    assert result.returncode == 0, mpi_output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == ["fixed_ring follows the rule", "fixed_ring delay_by_one follows the rule",
                      "random_ring follows the rule",
                      "random_ring delay_by_one follows the rule",
                      "each rank steps by its own gradient"], mpi_output(result)


@pytest.mark.mpi
def test_the_exchange_waits_for_device_writes_on_every_route():
    """A stand-in device whose writes run only at a stream synchronisation: the
    weights sent, received and mixed must be the NumPy run's, bit for bit, over
    host staging and over CUDA-aware MPI (which reads device memory directly)."""
    result = run_mpi(2, [str(WORKERS / "adpsgd_lazy_device_worker.py")], timeout=120)
    assert result.returncode == 0, mpi_output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == ["host-staged", "cuda-aware-mpi", "host-staged delay_by_one",
                      "cuda-aware-mpi delay_by_one"], mpi_output(result)


def _train(nranks, run_dir, corpus, settings, *, timeout=120):
    return train_on_ranks(nranks, run_dir, corpus, ["parallel.method=adpsgd", *settings],
                          timeout=timeout)


@pytest.mark.mpi
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_trains_three_ranks_to_the_end(small_corpus, tmp_path, variant):
    # three ranks: one sits out every iteration
    run = tmp_path / "run"
    result = _train(3, run, small_corpus, TINY + VARIANTS[variant] + [
        "training.max_steps=24", "training.log_interval=4", "training.checkpoint_interval=8"])
    assert result.returncode == 0, mpi_output(result)
    assert records(run, "start")[0]["strategy"] == "adpsgd"
    end = records(run, "end")[-1]
    assert end["steps"] == 24 and end["frames"] == 24 * 3 * 256
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"], train
    assert (run / "final.h5").exists()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_learns_far_above_chance_on_two_ranks(small_corpus, tmp_path, variant):
    from mpitrain.data.corpus import load_manifest
    run = tmp_path / "run"
    result = _train(2, run, small_corpus, VARIANTS[variant] + ["training.epochs=2"],
                    timeout=240)
    assert result.returncode == 0, mpi_output(result)
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()
    final = records(run, "eval")[-1]
    # the bar of tests/train/test_trainer.py's two-rank quickstart (chance: 1/120)
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40, (final, majority)


@pytest.mark.mpi
@pytest.mark.parametrize("variant", ["fixed_ring", "delay_by_one"])
def test_slow_rank_on_uneven_shards_finishes(small_corpus, tmp_path_factory, tmp_path, variant):
    from ..train.test_trainer import write_uneven_copy
    import shutil
    corpus = tmp_path_factory.mktemp("uneven")
    write_uneven_copy(os.path.join(small_corpus, "train"), str(corpus / "train"),
                      [0.80, 0.12, 0.05, 0.03])
    shutil.copytree(os.path.join(small_corpus, "dev"), corpus / "dev")
    run = tmp_path / "run"
    try:
        result = _train(3, run, str(corpus), TINY + VARIANTS[variant] + [
            "training.epochs=1", "training.log_interval=8", "training.checkpoint_interval=16",
            "parallel.straggler.ranks=[1]", "parallel.straggler.slowdown=2.0",
            "parallel.straggler.jitter=0.5"], timeout=150)
    except MpiTimeoutError as exc:
        pytest.fail(f"ADPSGD with a slow rank on uneven shards hung: {exc}")
    assert result.returncode == 0, mpi_output(result)
    end = records(run, "end")[-1]
    assert end["steps"] > 0 and (run / "final.h5").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("nranks,variant", [(3, "fixed_ring"), (2, "delay_by_one"),
                                            (3, "random_ring_delay_by_one")])
def test_resume_is_bit_exact(small_corpus, tmp_path, nranks, variant):
    # every rank's own model is in the checkpoint; the split run's last checkpoint
    # is written after the final average, and still holds each rank's model before it
    # (2 ranks on a fixed ring without delay agree after every mix: not a test of this)
    settings = {"fixed_ring": VARIANTS["fixed_ring"], "delay_by_one": VARIANTS["delay_by_one"],
                "random_ring_delay_by_one": ["parallel.topology=random_ring",
                                             "parallel.delay_by_one=true"]}[variant]
    common = TINY + settings + ["optimizer.momentum=0.5", "training.checkpoint_interval=8",
                                "training.epochs=1", "training.log_interval=8"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run_dir, extra, resume in ((straight, ["training.max_steps=40"], False),
                                   (split, ["training.max_steps=24"], False),
                                   (split, ["training.max_steps=40"], True)):
        args = common + extra
        result = _train(nranks, run_dir, small_corpus, args) if not resume else \
            _resume(nranks, run_dir, small_corpus, args)
        assert result.returncode == 0, mpi_output(result)
    from mpitrain.nn.model_file import load_model
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert [r["step"] for r in records(split, "start")] == [0, 24]
    assert np.array_equal(a.params, b.params), np.abs(a.params - b.params).max()
    # 24: a multiple of log_interval, so the log windows after it match
    after = [r["xent"] for r in records(straight, "train") if r["step"] > 24]
    resumed = [r["xent"] for r in records(split, "train") if r["step"] > 24]
    assert after == resumed and after


def _resume(nranks, run_dir, corpus, settings):
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000, "parallel.method": "adpsgd"}
    values.update(item.split("=", 1) for item in settings)
    args = ["-m", "mpitrain", "train", QUICKSTART, "--run-dir", str(run_dir), "--resume"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return run_mpi(nranks, args, timeout=120)


@pytest.mark.mpi
def test_a_delay_by_one_run_that_diverges_stops_with_one_line(small_corpus, tmp_path):
    # the stop came between steps with the delayed exchange in flight; it was never
    # completed, and MPICH said so on every rank at exit ("Builtin communicator ...
    # has pending 2 references")
    result = train_on_ranks(2, tmp_path / "run", small_corpus, TINY + [
        "parallel.method=adpsgd", "parallel.delay_by_one=true",
        "optimizer.initial_learning_rate=0.5", "training.divergence_factor=1.0",
        "training.max_divergence_events=0", "training.max_rollbacks=0",
        "training.log_interval=1", "training.max_steps=40"], timeout=120)
    assert result.returncode == 2, mpi_output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training diverged" in lines[0], mpi_output(result)


def test_delay_by_one_checkpoints_the_held_gradient_and_a_non_finite_one_as_a_skip():
    """The gradient held for the next step is part of a rank's state (a resumed run
    applies it, as the uninterrupted one does); a checkpoint holds finite floats only,
    so a held NaN gradient (a minibatch the next step skips) is stored as a flag and
    comes back as NaN: the resumed step is skipped too."""
    net, _, strategy = _one_rank_ring(True)
    first = np.arange(net.num_params, dtype=np.float32)
    net.grads[...] = first
    strategy.reduce_gradients(net)
    assert not net.grads.any()                  # the first step applies none
    second = -first
    net.grads[...] = second
    strategy.reduce_gradients(net)
    assert np.array_equal(net.grads, first)     # the gradient of the step before
    state = strategy.rank_state_dict()
    assert np.array_equal(state["held_gradient"], second)
    other = RingMixing(SingleCommunicator(), delay_by_one=True)
    other.setup(net, SGD(net))
    other.load_rank_state_dict(state)
    net.grads[...] = 0
    other.reduce_gradients(net)
    assert np.array_equal(net.grads, second)
    net.grads[...] = np.nan
    other.reduce_gradients(net)                 # a non-finite minibatch's, now held
    state = other.rank_state_dict()
    assert "held_gradient" not in state and state["held_gradient_finite"] == 0
    third = RingMixing(SingleCommunicator(), delay_by_one=True)
    third.setup(net, SGD(net))
    third.load_rank_state_dict(state)
    third.reduce_gradients(net)
    assert np.isnan(net.grads).all()
    # a roll back to the initial model restores the strategy's state and no rank
    # state: nothing is held, as at the start (it applied the diverged run's last one)
    third.reduce_gradients(net)
    third.load_state_dict({"iteration": 0})
    net.grads[...] = 1
    third.reduce_gradients(net)
    assert not net.grads.any()
    # a checkpoint of a run without delay-by-one holds none: nothing is held
    fourth = RingMixing(SingleCommunicator(), delay_by_one=True)
    fourth.setup(net, SGD(net))
    fourth.load_rank_state_dict({"params": net.params.copy()})
    net.grads[...] = 1
    fourth.reduce_gradients(net)
    assert not net.grads.any()


def _affine_gradient_and_bound(block, x, labels):
    """The summed cross-entropy's gradient [dW | db] of one affine layer (softmax
    output) and nnet2's bound tau = sum_i ||[x_i, 1]|| ||dy_i||, in float64."""
    rows = np.hstack([np.float64(x), np.ones((len(x), 1))])
    logits = rows @ np.float64(block).T
    dy = np.exp(logits - logits.max(axis=1, keepdims=True))
    dy /= dy.sum(axis=1, keepdims=True)
    dy[np.arange(len(x)), labels] -= 1
    tau = float(np.linalg.norm(rows, axis=1) @ np.linalg.norm(dy, axis=1))
    return (dy.T @ rows).reshape(-1), tau


@pytest.mark.parametrize("device", ["host", "standin"])
def test_delay_by_one_bounds_the_held_gradient_by_its_own_rows(device):
    """nnet2's max-change-per-sample scales a layer's step by min(1, m B / (lr tau)),
    tau from the rows that gave that step.  Delay-by-one applies at step k the
    gradient of step k-1, so its tau is step k-1's (held with it, and checkpointed),
    not that of the minibatch step k just computed."""
    import contextlib

    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    batch, m, lr = 8, 0.05, 0.1
    rng = np.random.default_rng(3)
    x1 = rng.standard_normal((batch, 3)).astype(np.float32) * 20    # clipped
    x2 = rng.standard_normal((batch, 3)).astype(np.float32) * 0.01  # would not be
    l1, l2 = rng.integers(0, 5, batch), rng.integers(0, 5, batch)
    start = rng.standard_normal(23).astype(np.float32) * 0.3

    def ring(xp):
        net = build_network(feat_dim=3, num_classes=5, left_context=0, right_context=0,
                            hidden_layers=0, hidden_dim=4, xp=xp)
        net.params[...] = backend.to_device(start[:net.num_params], xp)
        opt = SGD(net, minibatch=batch, max_change_per_sample=m, max_change_per_layer=0,
                  max_change_output=0, max_change=0)
        strategy = RingMixing(SingleCommunicator(), delay_by_one=True)
        strategy.setup(net, opt)
        return net, opt, strategy

    def step(net, opt, strategy, x, labels, k):
        xp = net.xp
        net.forward_backward(backend.to_device(x, xp), backend.to_device(labels, xp))
        strategy.reduce_gradients(net)
        opt.step(lr)
        strategy.after_update(net, opt, k)

    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        net, opt, strategy = ring(xp)
        block = backend.to_host(net.param_slices[0][0].block)
        g1, tau1 = _affine_gradient_and_bound(block, x1, l1)
        assert lr * tau1 > m * batch * 2        # the first minibatch's step is clipped
        step(net, opt, strategy, x1, l1, 1)
        first = np.float64(backend.to_host(net.params))
        assert np.array_equal(first, np.float64(start[:net.num_params]))   # applies nothing
        state = strategy.rank_state_dict()
        step(net, opt, strategy, x2, l2, 2)
        expected = first - lr * min(1.0, m * batch / (lr * tau1)) * g1
        np.testing.assert_allclose(backend.to_host(net.params), expected, rtol=1e-5,
                                   atol=1e-7)
        # a run resumed after the first step bounds the held gradient alike
        net2, opt2, strategy2 = ring(xp)
        strategy2.load_rank_state_dict(state)
        step(net2, opt2, strategy2, x2, l2, 2)
        np.testing.assert_array_equal(backend.to_host(net2.params), backend.to_host(net.params))
