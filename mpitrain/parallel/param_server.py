"""Asynchronous parameter server with averaged SGD (You & Xu, ISCSLP 2014; after
You, Wang & Xu, ICASSP 2014).

Rank 0 (the server) holds the model theta and its average theta_bar; ranks
1..N-1 (the clients) each loop over their own share of the data::

    client c:  theta_c <- pull()                  the server's current weights
               g <- gradient of a minibatch at theta_c
               push(g)

    server:    on a push from any client c (whichever arrives first):
               theta <- theta - lr_t g            the optimizer's step (max-change too)
               t <- t + 1
               theta_bar <- (1 - eta) theta_bar + eta theta          exponential, or
               theta_bar <- theta_bar + (theta - theta_bar) / (t - t0 + 1)   uniform
               send theta to c (unless that was c's last minibatch)

The gradient from c was taken at the version the server sent c last, so it is
``staleness`` = t - version_sent[c] updates old (0 with one client, about
N - 2 with N - 1 clients taking turns).  The average is exponential
(eta = ``parallel.average_eta``, 0.01 in the paper) until, at a held-out
evaluation, theta_bar scores a lower cross-entropy than theta; from that
update t0 on it is the uniform (Polyak) average, theta_bar at t0 counting as
its first sample.  theta_bar is what is evaluated and saved (``final.h5``).

Message protocol (raw buffers, never pickle): a push is a float64 header
``[kind, loss_sum, correct, frames, position]`` (tag ``HEADER_TAG``; position:
the minibatch's index in the client's own sequence) followed, unless
kind is ``DONE``, by the flat float32 gradient (``GRADIENT_TAG``); weights go
back with ``WEIGHTS_TAG``.  The server waits with ``iprobe(ANY_SOURCE)`` on
the header, so it never blocks on one client, then receives that client's
gradient (same source: MPI keeps one sender's messages in order).  kind
``LAST`` says no weights are wanted back; ``DONE`` (a client with no
minibatch at all) carries no gradient.  Serving ends once every client has
sent ``LAST`` or ``DONE``: then nothing is in flight.

Symbols in the code: theta is ``net.params`` on the server, theta_bar is
:attr:`ModelAverage.average`, t is ``ParameterServer.updates``, t0 is
``ModelAverage.switched_at``, eta is ``ModelAverage.eta``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Strategy

#: Message tags of the protocol (apart from ADPSGD's and the checkpoint gather's).
HEADER_TAG, GRADIENT_TAG, WEIGHTS_TAG = 7500, 7501, 7502
#: Header kinds: a gradient (weights wanted back), the client's last gradient, no data.
GRADIENT, LAST, DONE = 1, 2, 3
HEADER_SIZE = 5
#: Average modes.
EXPONENTIAL, UNIFORM = "exponential", "uniform"


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: param_server``."""
    return ParameterServer(comm, average_eta=cfg.parallel.average_eta)


def data_share(rank: int, size: int):
    """(share, shares): rank 0 serves and trains on no data (share None); client
    ``rank`` trains on part ``rank - 1`` of ``size - 1``.

    Example::

        data_share(0, 3), data_share(2, 3)     # (None, 2), (1, 2)
    """
    if size < 2:
        raise ValueError("parallel.method: param_server needs at least 2 ranks (a server "
                         "and a client); run with mpiexec -n 2 or more")
    return (None if rank == 0 else rank - 1), size - 1


class ModelAverage:
    """theta_bar: the exponential running average, then the uniform (Polyak) one.

    Example::

        avg = ModelAverage(net.params, eta=0.01)
        avg.update(net.params)          # after each server update
        avg.switch_to_uniform(updates=500)
    """

    def __init__(self, params, *, eta: float = 0.01):
        if not 0.0 < eta <= 1.0:
            raise ValueError(f"average_eta must be in (0, 1], got {eta}")
        self.eta = float(eta)
        self.average = params.copy()
        self._diff = params.copy()      # scratch: theta - theta_bar
        self.mode = EXPONENTIAL
        self.samples = 0                # uniform mode: samples in the average (t - t0 + 1)
        self.switched_at = None         # t0

    def update(self, params) -> None:
        diff = self._diff
        diff[...] = params
        diff -= self.average
        if self.mode == EXPONENTIAL:
            # (1 - eta) theta_bar + eta theta, as theta_bar + eta (theta - theta_bar)
            diff *= diff.dtype.type(self.eta)
        else:
            self.samples += 1
            diff *= diff.dtype.type(1.0 / self.samples)
        self.average += diff

    def switch_to_uniform(self, *, updates: int) -> None:
        """From now on the uniform average; the current one is its first sample."""
        if self.mode == UNIFORM:
            return
        self.mode, self.samples, self.switched_at = UNIFORM, 1, int(updates)

    def state_dict(self) -> dict:
        from ..backend import to_host
        return {"average": to_host(self.average).copy(), "average_mode": self.mode,
                "average_samples": int(self.samples),
                "average_switched_at": -1 if self.switched_at is None else int(self.switched_at)}

    def load_state_dict(self, state: dict) -> None:
        mode = state.get("average_mode", EXPONENTIAL)
        if mode not in (EXPONENTIAL, UNIFORM):
            raise ValueError(f"checkpoint group 'strategy': 'average_mode' must be "
                             f"{EXPONENTIAL!r} or {UNIFORM!r}, got {mode!r}")
        average = np.asarray(state["average"])
        if average.shape != self.average.shape:
            raise ValueError(f"checkpoint group 'strategy': 'average' has shape "
                             f"{average.shape}, expected {self.average.shape}")
        xp = _array_module(self.average)
        self.average[...] = xp.asarray(average)
        self.mode = mode
        self.samples = int(state.get("average_samples", 0))
        switched = int(state.get("average_switched_at", -1))
        self.switched_at = None if switched < 0 else switched


def _array_module(array):
    from ..backend import get_array_module
    return get_array_module(array)


@dataclass
class Push:
    """What one client sent: its rank, the header's kind and sums, the minibatch's
    index in its sequence, and how many server updates old the weights its
    gradient was taken at were.

    Example::

        push = ps.receive_push(net)
        push.source, push.staleness      # (2, 1)
    """

    source: int
    kind: int
    loss_sum: float
    correct: float
    frames: int
    position: int
    staleness: int


class ParameterServer(Strategy):
    """The server's and the clients' side of the protocol (module docstring).

    The serving loop itself (when to log, evaluate, checkpoint) is the
    trainer's: :mod:`mpitrain.train.serving`.

    Example::

        ps = ParameterServer(comm, average_eta=0.01)
        ps.setup(net, optimizer)
        if ps.is_server:
            ps.send_weights(net, client)        # to every client, then
            push = ps.receive_push(net)         # the gradient is in net.grads
            ps.apply(net, optimizer, lr, push)
        else:
            ps.pull(net); ...; ps.push(net, loss_sum=..., correct=..., frames=256,
                                       position=k, last=False)
    """

    name = "param_server"

    def __init__(self, comm, *, average_eta: float = 0.01):
        super().__init__(comm)
        data_share(comm.rank, comm.size)            # refuses a job without clients
        if not 0.0 < average_eta <= 1.0:
            raise ValueError(f"average_eta must be in (0, 1], got {average_eta}")
        self.average_eta = float(average_eta)
        self.is_server = comm.rank == 0
        self.clients = list(range(1, comm.size))
        self.updates = 0                            # t: gradients applied
        # minibatches each client has had applied (the data position on resume)
        self.client_steps = [0] * len(self.clients)
        self.sent_version = {c: 0 for c in self.clients}
        self.average = None
        self.current = None      # theta once finalize put theta_bar into the network
        self._saved_client_steps = None
        self._header = np.zeros(HEADER_SIZE, dtype=np.float64)

    # -- life cycle ----------------------------------------------------------------
    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)

    def bind(self, net) -> None:
        if self.is_server and self.average is None:
            self.average = ModelAverage(net.params, eta=self.average_eta)

    def resume(self, net) -> None:
        if self.is_server and self.current is not None:
            net.params[...] = self.current
            self.current = None

    def finalize(self, net, optimizer, step: int = 0) -> None:
        """Every rank (all done serving) gets theta_bar; the server keeps theta."""
        if self.is_server:
            self.current = net.params.copy()
            net.params[...] = self.average.average
        self.comm.bcast_(net.params, root=0)

    # -- the server's side ---------------------------------------------------------
    def send_weights(self, net, client: int) -> None:
        """theta to ``client``, remembering the version it now computes on."""
        self.comm.send(net.params, client, tag=WEIGHTS_TAG)
        self.sent_version[client] = self.updates

    def receive_push(self, net) -> Push:
        """The next push from whichever client it comes; its gradient (if any) into
        ``net.grads``."""
        comm = self.comm
        while True:
            found = comm.iprobe(tag=HEADER_TAG)
            if found is not None:
                break
            comm.idle()     # on a shared core, leaves the CPU to the clients
        source = found[0]
        comm.recv(self._header, source, tag=HEADER_TAG)
        kind, loss_sum, correct, frames, position = (float(x) for x in self._header)
        kind = int(kind)
        if kind not in (GRADIENT, LAST, DONE):
            raise RuntimeError(f"param_server: rank {source} sent an unknown header kind "
                               f"{kind}")
        if kind != DONE:
            comm.recv(net.grads, source, tag=GRADIENT_TAG)
        return Push(source=source, kind=kind, loss_sum=loss_sum, correct=correct,
                    frames=int(frames), position=int(position),
                    staleness=self.updates - self.sent_version[source])

    def apply(self, net, optimizer, lr: float, push: Push) -> None:
        """theta <- theta - lr g (the optimizer's step), t += 1, the average follows."""
        optimizer.step(lr)
        self.updates += 1
        self.client_steps[push.source - 1] = push.position + 1
        self.average.update(net.params)

    # -- a client's side -----------------------------------------------------------
    def pull(self, net) -> None:
        """The server's current weights into ``net.params``."""
        self.comm.recv(net.params, 0, tag=WEIGHTS_TAG)

    def push(self, net, *, loss_sum: float, correct: float, frames: int, position: int,
             last: bool) -> None:
        """The gradient in ``net.grads`` of this client's minibatch number ``position``
        and its sums, to the server."""
        self._header[:] = (LAST if last else GRADIENT, loss_sum, correct, frames, position)
        self.comm.send(self._header, 0, tag=HEADER_TAG)
        self.comm.send(net.grads, 0, tag=GRADIENT_TAG)

    def resumed_client_steps(self):
        """This client's minibatches the server had applied at the checkpoint resumed
        from; None for a fresh run or a checkpoint of another number of ranks."""
        saved = self._saved_client_steps
        if saved is None or len(saved) != len(self.clients) or self.is_server:
            return None
        return saved[self.comm.rank - 1]

    def done_without_data(self) -> None:
        """Tell the server this client has no minibatch to train on."""
        self._header[:] = (DONE, 0.0, 0.0, 0, 0)
        self.comm.send(self._header, 0, tag=HEADER_TAG)

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The server's: theta (``current``), the average and its mode, the counters.
        Clients hold none of it: {}."""
        if not self.is_server:
            return {}
        from ..backend import to_host
        state = {"updates": int(self.updates),
                 "client_steps": np.asarray(self.client_steps, dtype=np.int64)}
        if self.current is not None:
            state["current"] = to_host(self.current).copy()
        state.update(self.average.state_dict())
        return state

    def server_state(self, net) -> dict:
        """:meth:`state_dict` with theta taken from the network (during serving)."""
        from ..backend import to_host
        state = self.state_dict()
        if "current" not in state:
            state["current"] = to_host(net.params).copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        updates = state.get("updates", 0)
        if not isinstance(updates, (int, np.integer)) or isinstance(updates, bool) \
                or updates < 0:
            raise ValueError(f"checkpoint group 'strategy': param_server 'updates' must be "
                             f"a non-negative int, got {updates!r}")
        self.updates = int(updates)
        steps = [int(s) for s in np.asarray(state.get("client_steps", []), dtype=np.int64)]
        self._saved_client_steps = steps
        self.client_steps = steps if len(steps) == len(self.clients) else \
            [0] * len(self.clients)
        if self.is_server:
            if self.average is None:
                raise RuntimeError("param_server: bind(net) must come before load_state_dict")
            self.average.load_state_dict(state)
            current = state.get("current")
            if current is not None:
                xp = _array_module(self.average.average)
                self.current = xp.asarray(np.asarray(current, dtype=np.float32))
