"""The Strategy interface: the hooks the trainer calls around each step.

A strategy talks to other ranks only through a
:class:`~mpitrain.comm.base.Communicator` and touches only the network's flat
buffers, so the trainer, the layers and the optimizers never see MPI.
"""

from __future__ import annotations


class Strategy:
    """Base class; on one rank every hook is a no-op.

    Hooks, in the order the trainer calls them:

    - ``setup(net, optimizer)``: before the first step (broadcast rank 0's model).
    - ``learning_rate(lr)``: the rate to use this step, given the schedule's.
    - ``reduce_gradients(net)``: after backward, before the optimizer step.
    - ``after_update(net, optimizer, step)``: after the step (periodic averaging).
    - ``finalize(net, optimizer)``: at the end; all ranks must agree on the model.

    Example::

        strategy = Strategy(comm)
        strategy.setup(net, opt)
    """

    name = "local"

    def __init__(self, comm):
        self.comm = comm

    def setup(self, net, optimizer) -> None:
        if self.comm.size > 1:
            self.comm.bcast_(net.params, root=0)

    def learning_rate(self, lr: float) -> float:
        return lr

    def reduce_gradients(self, net) -> None:
        pass

    def after_update(self, net, optimizer, step: int) -> None:
        pass

    def finalize(self, net, optimizer) -> None:
        pass

    def state_dict(self) -> dict:
        """State to checkpoint (identical on every rank)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
