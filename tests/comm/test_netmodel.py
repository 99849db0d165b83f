"""The network model's costs (comm/netmodel.py) against the formulas by hand."""

import pytest

from mpitrain.comm.netmodel import NetworkModel

NET = dict(latency_s=1e-3, bandwidth_bytes_per_s=1e6)


def test_ring_tree_and_auto_allreduce():
    ring = NetworkModel(**NET)
    tree = NetworkModel(**NET, allreduce_algorithm="tree")
    auto = NetworkModel(**NET, allreduce_algorithm="auto")
    # 8 ranks, 8000 bytes: ring 2*7/8*8e-3 + 14e-3 = 0.028; tree 3 * (1e-3 + 8e-3) = 0.027
    assert ring.allreduce_seconds(8000, 8) == pytest.approx(0.028)
    assert tree.allreduce_seconds(8000, 8) == pytest.approx(0.027)
    assert auto.allreduce_seconds(8000, 8) == pytest.approx(0.027)
    # large buffers: the ring wins
    assert auto.allreduce_seconds(8e6, 8) == pytest.approx(ring.allreduce_seconds(8e6, 8))
    assert ring.allreduce_seconds(8000, 1) == tree.allreduce_seconds(8000, 1) == 0.0


def test_point_to_point_bcast_allgather_and_barrier():
    net = NetworkModel(**NET)
    assert net.p2p_seconds(1000) == pytest.approx(0.002)
    # 4 ranks, 1000 bytes: binomial 2 * 0.002 = 0.004; scatter+allgather 5e-3 + 1.5e-3
    assert net.bcast_seconds(1000, 4) == pytest.approx(0.004)
    # 1e6 bytes: scatter + allgather (5 ms + 1.5 s) beats the tree's 2 * 1.001 s
    assert net.bcast_seconds(1e6, 4) == pytest.approx(0.005 + 1.5)
    assert net.allgather_seconds(4000, 4) == pytest.approx(3e-3 + 3e-3)
    assert net.barrier_seconds(5) == pytest.approx(3e-3)
    assert net.bcast_seconds(1000, 1) == net.allgather_seconds(10, 1) == 0.0


def test_bad_models_are_refused():
    with pytest.raises(ValueError, match="allreduce_algorithm"):
        NetworkModel(allreduce_algorithm="butterfly")
    with pytest.raises(ValueError):
        NetworkModel(bandwidth_bytes_per_s=0)
    assert NetworkModel(**NET).to_dict()["allreduce_algorithm"] == "ring"
