"""Decentralized parallel SGD on a ring with pairwise model mixing (ADPSGD: Zhang,
Cui et al., "A highly efficient distributed deep learning system for automatic
speech recognition", Interspeech 2019; Cui, Zhang et al., "Asynchronous
decentralized distributed training of acoustic models", TASLP 2021; after Lian
et al.'s AD-PSGD, arXiv 1710.06952), run as lock-step pairs.

Every step, rank i computes its gradient on its weights w_i^k while it
exchanges them with one partner j, the rank beside it on a ring (a
non-blocking Isend/Irecv of a copy, in flight during the whole step), then
adds the mix to its own step::

    w_i^{k+1} = (w_i^k + w_j^k) / 2 - lr g_i(w_i^k)

In matrix form W_{k+1} = W_k T_k - lr G(W_k), T_k doubly stochastic with 1/2
at each pair: each mix keeps the mean of the models over the ranks, and each
rank's step is its own gradient's (not its pair's mean of two).  In the code
the optimizer steps first and the mix is added after the exchange completes,
w_i <- w_i - lr g_i + (w_j^k - w_i^k) / 2; the pair's two corrections are
exact negatives.

Delay-by-one (``delay_by_one``): the gradient is applied one step late, so
that a step's computing and the exchange need not meet before its end::

    w_i^{k+1} = (w_i^k + w_j^k) / 2 - lr g_i(w_i^{k-1})

the gradient of step k is held (``held``) and the optimizer applies the
one held from step k-1 (none on the first step of a run).  With nnet2's
max-change-per-sample the step applied is bounded by the rows that gave it:
each affine layer's ``step_bound`` is held with the gradient.

Pairs at iteration k (the k-th step, from 1): the ranks stand on a ring (in
rank order for ``fixed_ring``; in an order drawn from ``seed`` and k for
``random_ring``, the same on every rank without communication); ring places
(p, p+1) pair for p = k mod 2, k mod 2 + 2, ..., so the even places pair
with their right neighbour on even iterations and their left one on odd
iterations.  With an odd number of ranks the ring is not closed: one rank
(the last place or the first) sits the iteration out.  Every rank computes
the same matching, so each exchange meets exactly its partner's: no deadlock
and no wait for anyone but the partner.  The final model is the average of
all ranks' models (one Allreduce at the end).

Symbols in the code: w_i is ``net.params``, j is :meth:`RingMixing.partner`,
k is the step count ``iteration``; the exchanged copy of w_i^k is ``sent``,
w_j^k is ``received``, g_i is ``net.grads``.
"""

from __future__ import annotations

import numpy as np

from ..state_fields import count, flag, float32_buffer
from .base import Strategy

#: ``parallel.topology`` values.
TOPOLOGIES = ("fixed_ring", "random_ring")
#: Message tag of the weight exchange (apart from the checkpoint gather's).
MIX_TAG = 7400
# Kept apart from the other seeded streams (initialisation, shuffling).
_RING_STREAM = 0x41D
# The held gradient's step bounds were not saved (a checkpoint without them): the
# step that applies it keeps the bounds of the minibatch it just computed
_BOUNDS_UNKNOWN = "unknown"


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: adpsgd`` (lock-step; the asynchronous
    form, ``parallel.asynchronous``, is :mod:`.async_adpsgd`'s)."""
    par = cfg.parallel
    return RingMixing(comm, topology=par.topology, delay_by_one=par.delay_by_one,
                      seed=cfg.training.seed)


def ring_order(topology: str, size: int, iteration: int, seed: int = 0) -> list:
    """The ranks in ring order at ``iteration``.

    Example::

        ring_order("fixed_ring", 4, 7)          # [0, 1, 2, 3]
        ring_order("random_ring", 4, 7, seed=1) # a permutation, the same on every rank
    """
    if topology == "fixed_ring":
        return list(range(size))
    if topology == "random_ring":
        rng = np.random.default_rng([int(seed), _RING_STREAM, int(iteration)])
        return [int(r) for r in rng.permutation(size)]
    raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")


def ring_pairs(topology: str, size: int, iteration: int, seed: int = 0) -> list:
    """The pairs (a, b) that mix at ``iteration``; a rank in none sits it out.

    Example::

        ring_pairs("fixed_ring", 4, 2)   # [(0, 1), (2, 3)]
        ring_pairs("fixed_ring", 4, 3)   # [(1, 2), (3, 0)]
        ring_pairs("fixed_ring", 3, 3)   # [(1, 2)]   rank 0 sits out
    """
    order = ring_order(topology, size, iteration, seed)
    first = iteration % 2
    return [(order[p % size], order[(p + 1) % size])
            for p in range(first, first + 2 * (size // 2), 2)]


def partner_of(rank: int, topology: str, size: int, iteration: int, seed: int = 0):
    """``rank``'s partner at ``iteration``, or None when it sits the iteration out.

    Example::

        partner_of(0, "fixed_ring", 4, 2)   # 1
    """
    for a, b in ring_pairs(topology, size, iteration, seed):
        if rank == a:
            return b
        if rank == b:
            return a
    return None


class RingMixing(Strategy):
    """ADPSGD's pairwise mixing on a ring, lock-step (see the module docstring).

    Example::

        strategy = RingMixing(comm, topology="random_ring", delay_by_one=True, seed=1)
        strategy.setup(net, optimizer)
    """

    name = "adpsgd"
    # Each rank's model is its own: checkpoints store every rank's (rank_state_dict).
    sync_period = 1

    def __init__(self, comm, *, topology: str = "fixed_ring", delay_by_one: bool = False,
                 seed: int = 0):
        super().__init__(comm)
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, "
                             f"got {topology!r}")
        self.topology = topology
        self.delay_by_one = bool(delay_by_one)
        self.seed = int(seed)
        self.iteration = 0          # steps taken (mixes done)
        self.num_mixes = 0          # mixes this rank took part in
        self.net = None
        self.sent = self.received = self.held = self._fresh = None
        self._held_bounds = None    # the held gradient's per-layer step bounds (None: none)
        self._requests = []         # the exchange in flight
        self._final_local = None    # this rank's own model before the final average

    def partner(self, iteration: int):
        """This rank's partner at ``iteration`` (None: it sits the iteration out)."""
        return partner_of(self.comm.rank, self.topology, self.comm.size, iteration, self.seed)

    # -- life cycle ----------------------------------------------------------------
    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)
        self._start_exchange(self.iteration + 1)

    def bind(self, net) -> None:
        self.drain()
        if self.net is not net or self.received is None:
            xp = net.xp
            self.received = xp.empty_like(net.params)
            self.sent = xp.empty_like(net.params)
            self.held = xp.zeros_like(net.grads) if self.delay_by_one else None
            self._fresh = xp.empty_like(net.grads) if self.delay_by_one else None
            self._held_bounds = None
        self.net = net

    def reduce_gradients(self, net) -> None:
        if self.delay_by_one:
            # apply the gradient held from the last step, hold this one; copies into
            # buffers that stay put (a captured CUDA graph replays these addresses)
            fresh, held, grads = self._fresh, self.held, net.grads
            fresh[...] = grads
            grads[...] = held
            held[...] = fresh
            self._hold_step_bounds(net)

    def _hold_step_bounds(self, net) -> None:
        """nnet2's max-change-per-sample bounds a layer's step by the rows that gave it
        (the layer's ``step_bound``, from its backward): the step is the held
        gradient's, so its bound is held with it."""
        layers = bounded_layers(net)
        if not layers:
            return
        fresh = [layer.step_bound for layer in layers]
        if self._held_bounds != _BOUNDS_UNKNOWN:
            held = self._held_bounds or [None] * len(layers)   # none held: no bound
            for layer, bound in zip(layers, held):
                layer.step_bound = bound
        self._held_bounds = fresh

    def after_update(self, net, optimizer, step: int) -> None:
        self.iteration = step
        self._finish_exchange()
        self._start_exchange(step + 1)

    def models_agree(self, step: int) -> bool:
        return self.comm.size == 1      # each rank mixes with its partners only

    def finalize(self, net, optimizer, step: int = 0) -> None:
        # the exchange started for a step that will not run is dropped; the
        # result is the average of every rank's model
        self.drain()
        self._final_local = net.params.copy()
        if self.comm.size > 1:
            self.comm.allreduce_(net.params, op="mean")

    def close(self) -> None:
        # a run that stopped between steps (diverged on every rank at once) leaves
        # the exchange in flight: complete it, as the partner does
        self.drain()

    # -- the mix -------------------------------------------------------------------
    def _start_exchange(self, iteration: int) -> None:
        partner = self.partner(iteration)
        if partner is None:
            return
        self.sent[...] = self.net.params
        self._requests = [self.comm.irecv(self.received, partner, tag=MIX_TAG),
                          self.comm.isend(self.sent, partner, tag=MIX_TAG)]

    def _finish_exchange(self) -> None:
        if not self._requests:
            return
        self.drain()
        # the pair's two corrections are exact negatives, so the mean is kept
        self.received -= self.sent
        self.received *= self.received.dtype.type(0.5)
        self.net.params += self.received
        self.num_mixes += 1

    def drain(self) -> None:
        """Complete the exchange in flight (its data then unused unless the caller uses it)."""
        requests, self._requests = self._requests, []
        if requests:
            self.comm.waitall(requests)

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"iteration": int(self.iteration)}

    def load_state_dict(self, state: dict) -> None:
        iteration = count(state, "iteration", "checkpoint group 'strategy' (ADPSGD)", default=0)
        self.drain()
        self.iteration = iteration
        self._final_local = None
        if self.held is not None:
            # nothing held, as at the start, unless the rank's own state follows (a
            # roll back to the initial model restores no rank state)
            self.held[...] = 0
            self._held_bounds = None

    def resume(self, net) -> None:
        self.restart_exchange()

    def rank_state_dict(self) -> dict:
        """This rank's own model (before the final average, once there was one), and
        with delay-by-one the gradient it holds for its next step."""
        from ..backend import to_host
        local = self._final_local if self._final_local is not None else self.net.params
        state = {"params": to_host(local).copy()}
        if self.delay_by_one:
            held = to_host(self.held).copy()
            if np.isfinite(held).all():
                state["held_gradient"] = held
                bounds = self._held_bounds
                if isinstance(bounds, list) and bounds and all(b is not None for b in bounds):
                    bounds = np.array([float(to_host(b)) for b in bounds], dtype=np.float64)
                    if np.isfinite(bounds).all():
                        state["held_step_bounds"] = bounds
            else:
                # a checkpoint holds finite floats only; the step that applies a
                # non-finite gradient is skipped, as it will be after a resume
                state["held_gradient_finite"] = 0
        return state

    def load_rank_state_dict(self, state: dict) -> None:
        # every field checked before anything is set
        own = checked_own_model(self.net, state)
        if self.delay_by_one:
            state = state if isinstance(state, dict) else {}
            held = state.get("held_gradient")
            bounds = self._loaded_bounds(state.get("held_step_bounds"))
            finite = flag(state, "held_gradient_finite", _RANK_STATE, default=1)
            if finite and held is not None:
                held = float32_buffer(held, tuple(self.held.shape),
                                      f"{_RANK_STATE}: field 'held_gradient'")
        if own is not None:
            self.net.params[...] = self.net.xp.asarray(own)
        if self.delay_by_one:
            self._held_bounds = bounds
            if not finite:
                self.held[...] = np.nan
            elif held is None:          # (a run that did not delay: nothing held)
                self.held[...] = 0
                self._held_bounds = None
            else:
                self.held[...] = self.net.xp.asarray(held)
        if own is not None:
            self.restart_exchange()

    def _loaded_bounds(self, saved):
        """The held step bounds from a checkpoint's ``held_step_bounds`` (unknown when
        it has none: an older checkpoint, or nothing was bounded)."""
        layers = bounded_layers(self.net)
        if saved is None or not layers:
            return _BOUNDS_UNKNOWN
        # (a layer's bound is a product of row norms: >= 0)
        saved = float32_buffer(saved, (len(layers),),
                               f"{_RANK_STATE}: field 'held_step_bounds' (one per affine "
                               "layer)", low=0.0)
        xp = self.net.xp
        return [float(b) if xp is np else xp.asarray(b, dtype=self.net.params.dtype)
                for b in saved]

    def restart_exchange(self) -> None:
        """The exchange that was in flight at the checkpoint, started again from the
        restored weights (or the first one, from the start)."""
        self.drain()
        self._final_local = None
        self._start_exchange(self.iteration + 1)


#: How errors name a rank's part of a checkpoint's strategy state.
_RANK_STATE = "checkpoint rank state 'strategy'"


def bounded_layers(net) -> list:
    """The layers whose backward gives a ``step_bound`` (nnet2's max-change-per-sample
    is on); none for a bare pair of buffers."""
    return [layer for layer, _ in getattr(net, "param_slices", ())
            if getattr(layer, "track_step_bound", False)]


def checked_own_model(net, state):
    """A rank's own model from its checkpointed strategy state (``params``), checked
    (the model's shape, finite in float32); None when the state holds none."""
    params = state.get("params") if isinstance(state, dict) else None
    if params is None:
        return None
    return float32_buffer(params, tuple(net.params.shape),
                          f"{_RANK_STATE}: field 'params' (the rank's own model)")


def restore_own_model(net, state) -> bool:
    """Put a rank's own model from its checkpointed strategy state (``params``) into
    ``net``; False when the state holds none.  A wrong shape, type or value raises,
    and nothing is set.

    Example::

        restore_own_model(net, {"params": saved})      # True
    """
    params = checked_own_model(net, state)
    if params is None:
        return False
    net.params[...] = net.xp.asarray(params)
    return True
