"""Hierarchical ADPSGD (Zhang, Cui et al., Interspeech 2019): synchronous SGD
inside a node, ADPSGD's pairwise mixing across nodes.  The ranks of a node
act as one learner::

    inside node n, every step:   g_n <- mean of g_i over the node's ranks     one Allreduce on the node
                                 w_n <- w_n - lr g_n                          every rank of n alike
    across nodes, every step:    w_n <- w_n + (w_m - w_n) / 2                 the nodes' first ranks, paired
                                 w_n to every rank of n                       one Bcast on the node

so w_n <- (w_n + w_m) / 2 - lr g_n, lock-step ADPSGD's rule with the node as
the learner: the exchange of the weights the step starts from is in flight
while the node computes its step.  The fast links inside a node carry the
per-step gradient Allreduce; the slower links between nodes carry one model
exchange per step between two nodes only.  The pairs are lock-step ADPSGD's (:class:`~.adpsgd.RingMixing`,
fixed or random ring) over a communicator of the nodes' first ranks.

Nodes: the ranks sharing a host name (as the launcher placed them), or
blocks of ``ranks_per_node`` consecutive ranks when it is set (for virtual
ranks, tests, or a launcher whose host names do not tell).

Symbols in the code: g_i is ``net.grads``, w_n is ``net.params`` on every
rank of node n; ``node_comm`` is the node's communicator, ``ring`` the
mixing among the nodes' first ranks (None on the other ranks).
"""

from __future__ import annotations

import socket

from ..state_fields import count
from .adpsgd import RingMixing, restore_own_model
from .base import Strategy


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: adpsgd`` with ``parallel.hierarchical``."""
    par = cfg.parallel
    return NodeRingMixing(comm, topology=par.topology, seed=cfg.training.seed,
                          ranks_per_node=par.ranks_per_node)


def node_of_ranks(hosts: list, ranks_per_node: int = 0) -> list:
    """Each rank's node index: blocks of ``ranks_per_node`` consecutive ranks when
    it is > 0, else one node per host name (in order of first appearance).

    Example::

        node_of_ranks(["a", "a", "b", "b"])        # [0, 0, 1, 1]
        node_of_ranks(["a"] * 6, ranks_per_node=4) # [0, 0, 0, 0, 1, 1]
    """
    if ranks_per_node > 0:
        return [rank // ranks_per_node for rank in range(len(hosts))]
    order: dict = {}
    return [order.setdefault(host, len(order)) for host in hosts]


class NodeRingMixing(Strategy):
    """Gradient Allreduce inside each node, lock-step ADPSGD among nodes (module
    docstring).

    Example::

        strategy = NodeRingMixing(comm, topology="random_ring", seed=1, ranks_per_node=4)
        strategy.setup(net, optimizer)
    """

    name = "adpsgd"
    sync_period = 1
    reduces_gradients = True

    def __init__(self, comm, *, topology: str = "fixed_ring", seed: int = 0,
                 ranks_per_node: int = 0):
        super().__init__(comm)
        hosts = comm.allgather_obj(socket.gethostname())
        nodes = node_of_ranks(hosts, int(ranks_per_node))
        self.node, self.num_nodes = nodes[comm.rank], max(nodes) + 1
        self.node_comm = comm.split(self.node, key=comm.rank)
        first = self.node_comm.rank == 0
        self.leaders = comm.split(0 if first else None, key=self.node)
        # the mixing of the nodes' models, on their first ranks
        self.ring = RingMixing(self.leaders, topology=topology, seed=seed) \
            if first else None
        self.iteration = 0
        self.net = None
        self._final_local = None

    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)
        if self.ring is not None:
            self.ring.restart_exchange()

    def bind(self, net) -> None:
        self.net = net
        if self.ring is not None:
            self.ring.bind(net)

    def reduce_gradients(self, net) -> None:
        if self.node_comm.size > 1:
            self.node_comm.allreduce_(net.grads, op="mean")

    def after_update(self, net, optimizer, step: int) -> None:
        self.iteration = step
        if self.ring is not None:
            self.ring.after_update(net, optimizer, step)
        if self.node_comm.size > 1:
            self.node_comm.bcast_(net.params, root=0)

    def models_agree(self, step: int) -> bool:
        return self.num_nodes == 1

    def close(self) -> None:
        if self.ring is not None:       # the exchange in flight, as the partner does
            self.ring.drain()
        # the node and leader communicators (and their NCCL communicators on GPUs)
        for name in ("node_comm", "leaders"):
            sub = getattr(self, name)
            if sub is not None:
                sub.free()
                setattr(self, name, None)
        self.ring = None

    def finalize(self, net, optimizer, step: int = 0) -> None:
        if self.ring is not None:       # the exchange started for a step that will not run
            self.ring.drain()
        self._final_local = net.params.copy()
        # the mean over the nodes (the learners whose mean the mixing keeps), not
        # over the ranks: a node of more ranks would weigh more
        if self.leaders is not None and self.leaders.size > 1:
            self.leaders.allreduce_(net.params, op="mean")
        if self.node_comm.size > 1:
            self.node_comm.bcast_(net.params, root=0)

    def average_models_(self, params, step: int) -> None:
        # the mean over the nodes, as finalize takes it
        if self.leaders is not None and self.leaders.size > 1:
            self.leaders.allreduce_(params, op="mean")
        if self.node_comm.size > 1:
            self.node_comm.bcast_(params, root=0)

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"iteration": int(self.iteration)}

    def load_state_dict(self, state: dict) -> None:
        # (checked on every rank, a node's leader or not: all refuse a file alike)
        iteration = count(state, "iteration", "checkpoint group 'strategy' (ADPSGD)",
                          default=0)
        if self.ring is not None:
            self.ring.load_state_dict(state)
        self.iteration = iteration
        self._final_local = None

    def resume(self, net) -> None:
        if self.ring is not None:
            self.ring.restart_exchange()

    def rank_state_dict(self) -> dict:
        """This rank's own model (its node's; before the final average, once there
        was one)."""
        from ..backend import to_host
        local = self._final_local if self._final_local is not None else self.net.params
        return {"params": to_host(local).copy()}

    def load_rank_state_dict(self, state: dict) -> None:
        if restore_own_model(self.net, state) and self.ring is not None:
            self.ring.restart_exchange()
        self._final_local = None
