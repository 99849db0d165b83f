"""Blockwise model-update filtering (Chen & Huo, "Scalable training of deep
learning machines by incremental block training with intra-block parallel
optimization and blockwise model-update filtering", ICASSP 2016), with
Nesterov look-ahead by default.

Each rank trains K local minibatches from the block's start point w0; then,
with one Allreduce of the parameters::

    G = mean_i(w_i) - w0;   Delta = eta_b Delta + zeta G;   w_g = w0 + Delta

and the next block starts from w_g (classic) or from w_g + eta_b Delta
(Nesterov).  Defaults: eta_b = 1 - 1/N, zeta = 1, local momentum cleared after
each sync (as CNTK does).  The saved and final model is w_g.

Symbols in the code: K is ``every_steps``, w0 is ``start``, Delta is
``delta``, w_g is ``global_model``, eta_b is ``block_momentum``, zeta is
``block_lr``.
"""

from __future__ import annotations

from ..state_fields import float32_buffer
from .base import Strategy, every_steps_from


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: bmuf``."""
    par = cfg.parallel
    return BlockMomentum(comm, every_steps=every_steps_from(cfg),
                         block_momentum=None if par.block_momentum < 0 else par.block_momentum,
                         block_lr=par.block_lr, nesterov=par.nesterov)


class BlockMomentum(Strategy):
    """Example::

        strategy = BlockMomentum(comm, every_steps=16)      # eta_b = 1 - 1/N
    """

    name = "bmuf"

    def __init__(self, comm, *, every_steps: int = 16, block_momentum: float | None = None,
                 block_lr: float = 1.0, nesterov: bool = True):
        super().__init__(comm)
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = int(every_steps)
        self.block_momentum = 1.0 - 1.0 / comm.size if block_momentum is None \
            else float(block_momentum)
        if not 0.0 <= self.block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {self.block_momentum}")
        self.block_lr = float(block_lr)
        self.nesterov = bool(nesterov)
        self.sync_period = self.every_steps
        self.start = self.delta = self.global_model = None

    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self._allocate(net)
        self.start[...] = net.params
        self.global_model[...] = net.params

    def _allocate(self, net) -> None:
        xp = self._xp = net.xp
        self.start = xp.empty_like(net.params)
        self.delta = xp.zeros_like(net.params)
        self.global_model = xp.empty_like(net.params)

    def after_update(self, net, optimizer, step: int) -> None:
        if step % self.every_steps == 0:
            self.sync(net, optimizer)

    def sync(self, net, optimizer) -> None:
        params = net.params
        self.comm.allreduce_(params, op="mean")
        params -= self.start                               # G
        self.delta *= self.block_momentum
        if self.block_lr != 1.0:
            params *= self.block_lr
        self.delta += params                               # Delta = eta Delta + zeta G
        self.global_model[...] = self.start
        self.global_model += self.delta                    # w_g = w0 + Delta
        params[...] = self.global_model
        if self.nesterov:
            params += self.block_momentum * self.delta
        self.start[...] = params
        optimizer.clear_momentum()
        optimizer.after_average()

    def finalize(self, net, optimizer, step: int = 0) -> None:
        if step % self.every_steps:
            self.sync(net, optimizer)
        net.params[...] = self.global_model

    def can_checkpoint(self, step: int) -> bool:
        # a checkpoint holds the block's state (w_g, the block start, Delta) and a
        # resumed run continues from the block start: only block ends, one rank too
        return step % self.every_steps == 0

    def result_params(self):
        # the ranks train from the look-ahead point; the model is w_g
        return self.global_model

    def state_dict(self) -> dict:
        from ..backend import to_host
        return {"start": to_host(self.start), "delta": to_host(self.delta),
                "global_model": to_host(self.global_model)}

    def load_state_dict(self, state: dict) -> None:
        """Every buffer checked (the model's shape, finite in float32) before any is set."""
        shape = tuple(self.start.shape)
        saved = {}
        for key in ("start", "delta", "global_model"):
            if key not in state:
                raise ValueError(f"checkpoint group 'strategy' lacks BMUF state '{key}'")
            saved[key] = float32_buffer(state[key], shape,
                                        f"checkpoint group 'strategy': field '{key}' (BMUF)")
        for key, value in saved.items():
            getattr(self, key)[...] = self._xp.asarray(value)

    def resume(self, net) -> None:
        # A checkpoint's model is w_g; training continues from the block start.
        net.params[...] = self.start

    def bind(self, net) -> None:
        """Allocate the block buffers without broadcasting (used on resume)."""
        self._allocate(net)
