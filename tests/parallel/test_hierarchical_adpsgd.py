"""Hierarchical ADPSGD (parallel/hierarchical_adpsgd.py): gradient Allreduce
inside a node, lock-step pairwise mixing across nodes.

In this process: nodes from host names or blocks of ranks; on virtual ranks,
one step from a common start gives every rank of a node its node's averaged
gradient step, and the mix of two nodes gives both their mean (a node sitting
the step out keeps its own); a virtual run learns, and a resumed run equals
the run straight through bit for bit; the settings it cannot take are
refused.  Under real ``mpiexec -n 4`` (two nodes of two ranks): a run trains
to the end.
"""

import numpy as np
import pytest

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.config import ConfigError, load_config
from mpitrain.nn.model_file import load_model
from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.adpsgd import ring_pairs
from mpitrain.parallel.hierarchical_adpsgd import NodeRingMixing, node_of_ranks
from mpitrain.train.virtual import ComputeModel, train_virtual

from ..helpers import QUICKSTART, mpi_output, records, small_overrides, train_on_ranks

TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]
NUM_PARAMS = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                           hidden_layers=1, hidden_dim=16).num_params
HIER = ["parallel.method=adpsgd", "parallel.hierarchical=true", "parallel.ranks_per_node=2"]


def test_nodes_come_from_host_names_or_blocks_of_ranks():
    assert node_of_ranks(["a", "a", "b", "b"]) == [0, 0, 1, 1]
    assert node_of_ranks(["b", "a", "b", "a"]) == [0, 1, 0, 1]
    assert node_of_ranks(["h"] * 6, ranks_per_node=4) == [0, 0, 0, 0, 1, 1]
    assert node_of_ranks(["h"] * 3) == [0, 0, 0]


@pytest.mark.parametrize("size", [4, 6])
def test_a_step_averages_gradients_in_a_node_and_mixes_nodes(size):
    """w_n <- (w_n + w_m) / 2 - lr g_n, g_n the mean of the node's gradients: the
    mix is of the weights the step started from; the step is the node's own."""
    lr, steps = 0.5, 3

    def gradient(rank, k):
        return np.random.default_rng([5, rank, k]).standard_normal(
            NUM_PARAMS).astype(np.float32)

    def work(comm):
        net = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                            hidden_layers=1, hidden_dim=16)
        net.init_params(seed=2)
        opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0)
        strategy = NodeRingMixing(comm, topology="fixed_ring", seed=1, ranks_per_node=2)
        strategy.setup(net, opt)
        start = net.params.copy()
        after = []
        for k in range(1, steps + 1):
            net.grads[...] = gradient(comm.rank, k)
            strategy.reduce_gradients(net)
            opt.step(lr)
            strategy.after_update(net, opt, k)
            after.append(net.params.copy())
        strategy.close()
        return start, after

    out = VirtualCluster(size).run(work)
    nodes = size // 2
    models = [np.float64(out[0][0])] * nodes
    for k in range(1, steps + 1):
        step = [lr * np.mean([np.float64(gradient(r, k)) for r in (2 * n, 2 * n + 1)], axis=0)
                for n in range(nodes)]
        mixed = list(models)
        # the ring of nodes: iteration 1 pairs places (1, 2), (3, 0), ... (with 3
        # nodes node 0 sits out), iteration 2 places (0, 1), ...
        for a, b in ring_pairs("fixed_ring", nodes, k, 1):
            mixed[a] = mixed[b] = (models[a] + models[b]) / 2
        models = [mixed[n] - step[n] for n in range(nodes)]
        for rank in range(size):
            np.testing.assert_allclose(out[rank][1][k - 1], models[rank // 2],
                                       rtol=1e-5, atol=1e-5)
            assert np.array_equal(out[rank][1][k - 1], out[rank ^ 1][1][k - 1])  # a node agrees
    # the nodes' models differ by their own steps: their gradients were not shared
    assert not np.allclose(models[0], models[1], atol=1e-3)


def _virtual(corpus, run_dir, size, extra=(), resume=False):
    cfg = load_config(QUICKSTART, small_overrides(corpus) + TINY + HIER + list(extra))
    return train_virtual(cfg, size=size, run_dir=str(run_dir), resume=resume,
                         compute=ComputeModel(step_seconds=0.002))


def test_learns_and_resumes_bit_exactly_on_virtual_ranks(small_corpus, tmp_path):
    common = ["training.log_interval=8", "training.checkpoint_interval=8",
              "optimizer.momentum=0.5", "parallel.topology=random_ring"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _virtual(small_corpus, straight, 6, common + ["training.max_steps=40"])
    _virtual(small_corpus, split, 6, common + ["training.max_steps=24"])
    _virtual(small_corpus, split, 6, common + ["training.max_steps=40"], resume=True)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert [r["step"] for r in records(split, "start")] == [0, 24]
    assert np.array_equal(a.params, b.params)
    train = records(straight, "train")
    assert train[-1]["xent"] < train[0]["xent"], train


def test_the_communicators_it_splits_off_are_freed_after_the_run(small_corpus, tmp_path,
                                                                 monkeypatch):
    """A process that builds many strategies (bench: every size, repeat and phase)
    must not keep every one's node and leader communicators (NCCL's on GPUs)."""
    from mpitrain.bench.phases import sync_period
    from mpitrain.comm.virtual import VirtualCommunicator
    made, freed = [], []
    split = VirtualCommunicator.split

    def splitting(self, color, key=0):
        sub = split(self, color, key)
        if sub is not None:
            made.append(sub)
        return sub
    monkeypatch.setattr(VirtualCommunicator, "split", splitting)
    monkeypatch.setattr(VirtualCommunicator, "free", lambda self: freed.append(self))
    _virtual(small_corpus, tmp_path / "run", 4, ["training.max_steps=8"])
    assert len(made) == 6 and sorted(map(id, freed)) == sorted(map(id, made))
    made.clear()
    freed.clear()
    cfg = load_config(QUICKSTART, small_overrides(small_corpus) + TINY + HIER)
    assert VirtualCluster(4).run(lambda comm: sync_period(cfg, comm, "adpsgd")) == [1] * 4
    assert len(made) == 6 and sorted(map(id, freed)) == sorted(map(id, made))

@pytest.mark.parametrize("setting,named", [
    (["parallel.method=model_averaging", "parallel.hierarchical=true"], "parallel.hierarchical"),
    (HIER + ["parallel.delay_by_one=true"], "parallel.delay_by_one"),
    (HIER + ["parallel.asynchronous=true"], "parallel.asynchronous"),
])
def test_what_it_cannot_do_is_refused_in_one_line(setting, named):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, setting)
    assert named in str(info.value) and "\n" not in str(info.value)


@pytest.mark.mpi
def test_two_nodes_of_two_real_ranks_train_to_the_end(small_corpus, tmp_path):
    run = tmp_path / "run"
    result = train_on_ranks(4, run, small_corpus, TINY + HIER + [
        "training.max_steps=24", "training.log_interval=8", "training.checkpoint_interval=8"],
        timeout=120)
    assert result.returncode == 0, mpi_output(result)
    end = records(run, "end")[-1]
    assert end["steps"] == 24 and end["frames"] == 24 * 4 * 256
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"], train


def test_the_final_model_is_the_mean_over_nodes_however_many_ranks_each_has():
    """Nodes {0, 1} and {2}: the mixing keeps the mean of the two nodes' models;
    the final Allreduce over ranks gave the node of two ranks twice the weight.
    The model scored by a held-out evaluation during training (average_models_)
    is that mean as well."""
    def work(comm):
        net = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                            hidden_layers=1, hidden_dim=16)
        net.init_params(seed=2)
        opt = SGD(net)
        strategy = NodeRingMixing(comm, topology="fixed_ring", seed=1, ranks_per_node=2)
        strategy.setup(net, opt)
        own = np.full_like(net.params, 1.0 if comm.rank < 2 else 4.0)   # the nodes' models
        evaluated = own.copy()
        strategy.average_models_(evaluated, 5)
        net.params[...] = own
        strategy.finalize(net, opt, 0)
        final = net.params.copy()
        strategy.close()
        return evaluated, final

    for evaluated, final in VirtualCluster(3).run(work):
        np.testing.assert_array_equal(evaluated, np.full_like(evaluated, 2.5))
        np.testing.assert_array_equal(final, np.full_like(final, 2.5))   # not (1+1+4)/3
