"""Asynchronous parameter server with averaged SGD (You & Xu, ISCSLP 2014; after
You, Wang & Xu, ICASSP 2014).

Rank 0 (the server) holds the model theta and its average theta_bar; ranks
1..N-1 (the clients) each loop over their own share of the data::

    client c:  theta_c <- pull()                  the server's current weights
               g <- gradient of a minibatch at theta_c
               push(g)

    server:    on a push from any client c (whichever arrives first):
               theta <- theta - lr_t / (1 + tau) g    the optimizer's step (max-change too)
               t <- t + 1
               theta_bar <- (1 - eta) theta_bar + eta theta          exponential, or
               theta_bar <- theta_bar + (theta - theta_bar) / (t - t0 + 1)   uniform
               send theta to c (unless that was c's last minibatch)

The gradient from c was taken at the version the server sent c last, so it is
``staleness`` tau = t - version_sent[c] updates old (0 with one client, about
N - 2 with N - 1 clients taking turns).  Its rate is divided by 1 + tau
(``parallel.damp_staleness``; Zhang, Gupta, Lian & Liu's staleness-aware rate,
arXiv 1511.05950, divides by tau): C clients taking turns then move the model
about as far per round as one client does per step, where the undamped rate
made the model hover near chance at the one-rank rate (docs/benchmarks.md).
The average is exponential
(eta = ``parallel.average_eta``, 0.01 in the paper) until, at a held-out
evaluation, theta_bar scores a lower cross-entropy than theta; from that
update t0 on it is the uniform (Polyak) average, theta_bar at t0 counting as
its first sample.  Beyond the paper: should theta score lower than the
uniform average at a later evaluation, the average starts again from theta
there (a switch while both models were near chance left the uniform average
carrying the early models for the rest of the run).  At the end, theta_bar
and theta are both evaluated on the held-out set and the better (by
``training.select_by``; a tie keeps theta_bar) is saved (``final.h5``): an
average that never turned uniform can lag far behind theta (a tiny eta).

Message protocol (raw buffers, never pickle): a push is a float64 header
``[kind, loss_sum, correct, frames, position, stop]`` (tag ``HEADER_TAG``;
position: the minibatch's index in the client's own sequence; stop: non-zero
when a signal asked the client to stop, train/stop.py) followed, unless
kind is ``DONE``, by the flat float32 gradient (``GRADIENT_TAG``); weights go
back with ``WEIGHTS_TAG``.  The server waits with ``iprobe(ANY_SOURCE)`` on
the header, so it never blocks on one client, then receives that client's
gradient (same source: MPI keeps one sender's messages in order).  kind
``LAST`` says no weights are wanted back; ``DONE`` (a client with no
minibatch at all) carries no gradient.  Serving ends once every client has
sent ``LAST`` or ``DONE``: then nothing is in flight.

Several servers (``parallel.servers`` S > 1): ranks 0..S-1 serve, ranks S..N-1
are clients, and the model is cut into S contiguous slices at layer boundaries
(:func:`split_by_layers`, about equal parameter counts).  Server k owns slice
k: a client pushes slice k of its gradient to server k and pulls slice k of
theta from it, so each server's link carries 8P/S bytes per update.  Each
server applies, averages and counts its own slice and computes nothing outside
it: its optimizer is restricted to the slice
(:meth:`~mpitrain.optim.base.Optimizer.restrict_to`: the step, momentum, L2 and
``adapt`` memory of the slice's layers only) and so is its average
(``ModelAverage(span=...)``), so a server does its slice's share of the
update's work (about 1/S).  Max-change, per layer, needs nothing of the other
slices; the whole-model max-change counts the slice's layers only, as it did
when a server stepped the whole buffer with a zero gradient outside its slice
(that step, bit for bit, in the slice).  NG-SGD preconditions on the clients.
Server 0 still logs, evaluates and checkpoints: before it does, it asks every
other server for its slices of theta and theta_bar (``CONTROL_TAG``, kind
``SNAPSHOT``), tells them when the average turns uniform (``SWITCH``) or
starts again (``RESTART``), and,
once its own serving is done, lets them go (``END``).  Another server that a
signal asked to stop tells server 0 once (``STOP_TAG``, the signal's code),
since only server 0 can write the checkpoint and end the job.

Symbols in the code: theta is ``net.params`` on the server, theta_bar is
:attr:`ModelAverage.average`, t is ``ParameterServer.updates``, t0 is
``ModelAverage.switched_at``, eta is ``ModelAverage.eta``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..state_fields import COUNT_MAX, count, float32_buffer, int_array
from ..words import shown
from .base import Strategy

#: Message tags of the protocol (apart from ADPSGD's and the checkpoint gather's).
HEADER_TAG, GRADIENT_TAG, WEIGHTS_TAG = 7500, 7501, 7502
#: Server 0's requests to the other servers, and their slices back.
CONTROL_TAG, SLICE_TAG = 7503, 7504
#: Another server's word to server 0 that a signal asked it to stop.
STOP_TAG = 7505
#: Header kinds: a gradient (weights wanted back), the client's last gradient, no data.
GRADIENT, LAST, DONE = 1, 2, 3
#: Control kinds: send your slices; the average turns uniform; serving is over;
#: send your slices of the optimizer's state.
SNAPSHOT, SWITCH, END, OPTIMIZER, RESTART = 1, 2, 3, 4, 5
HEADER_SIZE = 6
#: Average modes.
EXPONENTIAL, UNIFORM = "exponential", "uniform"


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: param_server``."""
    return ParameterServer(comm, average_eta=cfg.parallel.average_eta,
                           servers=cfg.parallel.servers,
                           damp_staleness=cfg.parallel.damp_staleness)


def data_share(rank: int, size: int, *, servers: int = 1):
    """(share, shares): a server (rank < ``servers``) trains on no data (share None);
    client ``rank`` trains on part ``rank - servers`` of ``size - servers``.

    Example::

        data_share(0, 3), data_share(2, 3)      # (None, 2), (1, 2)
        data_share(1, 4, servers=2)             # (None, 2)
    """
    if size <= servers:
        raise ValueError(f"parallel.method: param_server with {servers} server rank(s) "
                         f"needs at least {servers + 1} ranks (a client too); run with "
                         f"mpiexec -n {servers + 1} or more, or lower parallel.servers")
    return (None if rank < servers else rank - servers), size - servers


def split_by_layers(sizes, parts: int) -> list:
    """Cut a flat buffer made of consecutive pieces of ``sizes`` into ``parts``
    contiguous (start, stop) slices at piece boundaries, each close to an equal
    share of the total.

    Example::

        split_by_layers([10, 10, 10, 10], 2)     # [(0, 20), (20, 40)]
    """
    sizes = [int(n) for n in sizes if int(n) > 0]
    if not 1 <= parts <= len(sizes):
        raise ValueError(f"parallel.servers: {parts} server(s) for a model of "
                         f"{len(sizes)} parameter layer(s); at most one server per layer")
    total, bounds, start = sum(sizes), [], 0
    ends = np.cumsum(sizes)
    for k in range(1, parts):
        target = total * k / parts
        # the boundary nearest the target that leaves every later part a layer
        choices = [i for i in range(len(sizes) - (parts - k)) if ends[i] > start]
        best = min(choices, key=lambda i: abs(ends[i] - target))
        bounds.append((start, int(ends[best])))
        start = int(ends[best])
    bounds.append((start, total))
    return bounds


def param_sized_entries(state: dict, size: int) -> list:
    """(dict, key) of every array of ``size`` elements in an optimizer's state (a
    per-parameter buffer: momentum, accumulators), nested dicts included, in
    sorted key order (the same on every rank for the same optimizer).

    Example::

        param_sized_entries({"delta": np.zeros(10), "num_steps": 3}, 10)   # [(state, "delta")]
    """
    found = []
    for key in sorted(state):
        value = state[key]
        if isinstance(value, dict):
            found += param_sized_entries(value, size)
        elif getattr(value, "shape", None) == (size,):
            found.append((state, key))
    return found


class ModelAverage:
    """theta_bar: the exponential running average, then the uniform (Polyak) one.

    Example::

        avg = ModelAverage(net.params, eta=0.01)     # span=slice(a, b): that part only
        avg.update(net.params)          # after each server update
        avg.switch_to_uniform(updates=500)
    """

    def __init__(self, params, *, eta: float = 0.01, span: slice = slice(None)):
        if not 0.0 < eta <= 1.0:
            raise ValueError(f"average_eta must be in (0, 1], got {eta}")
        self.eta = float(eta)
        self.span = span                # the part :meth:`update` averages (a server's slice)
        self.average = params.copy()
        self._diff = params[span].copy()    # scratch: theta - theta_bar
        self.mode = EXPONENTIAL
        self.samples = 0                # uniform mode: samples in the average (t - t0 + 1)
        self.switched_at = None         # t0

    def update(self, params) -> None:
        """theta_bar follows theta in :attr:`span`; the rest stays as it is."""
        diff, average = self._diff, self.average[self.span]
        diff[...] = params[self.span]
        diff -= average
        if self.mode == EXPONENTIAL:
            # (1 - eta) theta_bar + eta theta, as theta_bar + eta (theta - theta_bar)
            diff *= diff.dtype.type(self.eta)
        else:
            self.samples += 1
            diff *= diff.dtype.type(1.0 / self.samples)
        average += diff

    def switch_to_uniform(self, *, updates: int) -> None:
        """From now on the uniform average; the current one is its first sample."""
        if self.mode == UNIFORM:
            return
        self.mode, self.samples, self.switched_at = UNIFORM, 1, int(updates)

    def restart_uniform(self, params, *, updates: int) -> None:
        """The uniform average starts again from ``params`` (theta) at update ``updates``,
        in :attr:`span`: the models it carried are dropped."""
        self.average[self.span] = params[self.span]
        self.mode, self.samples, self.switched_at = UNIFORM, 1, int(updates)

    def state_dict(self) -> dict:
        from ..backend import to_host
        return {"average": to_host(self.average).copy(), "average_mode": self.mode,
                "average_samples": int(self.samples),
                "average_switched_at": -1 if self.switched_at is None else int(self.switched_at)}

    def load_state_dict(self, state: dict, *, updates: int = COUNT_MAX) -> None:
        mode, average, samples, switched = checked_average(state, self.average.shape,
                                                           updates=updates)
        xp = _array_module(self.average)
        self.average[...] = xp.asarray(average)
        self.mode, self.samples = mode, samples
        self.switched_at = None if switched < 0 else switched


def checked_average(state: dict, shape: tuple, *, updates: int) -> tuple:
    """(mode, average, samples, switched_at) of a saved state, checked against what
    the server can reach after ``updates`` updates: the average a float32 model
    of ``shape``; exponential, nothing sampled, never switched; or uniform
    since update t0 <= t, holding 1..t - t0 + 1 samples."""
    where = "checkpoint group 'strategy'"
    mode = state.get("average_mode", EXPONENTIAL)
    if mode not in (EXPONENTIAL, UNIFORM):
        raise ValueError(f"{where}: 'average_mode' must be "
                         f"{EXPONENTIAL!r} or {UNIFORM!r}, got {shown(mode)}")
    average = float32_buffer(state["average"], tuple(shape),
                             f"{where}: field 'average' (param_server)")
    if mode == EXPONENTIAL:
        samples = count(state, "average_samples", where, default=0, high=0)
        switched = count(state, "average_switched_at", where, default=-1, low=-1, high=-1)
    else:
        switched = count(state, "average_switched_at", where, high=updates)
        samples = count(state, "average_samples", where, low=1,
                        high=updates - switched + 1)
    return mode, average, samples, switched


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
    stop: int = 0


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

    def __init__(self, comm, *, average_eta: float = 0.01, servers: int = 1,
                 damp_staleness: bool = True):
        super().__init__(comm)
        self.damp_staleness = bool(damp_staleness)
        data_share(comm.rank, comm.size, servers=servers)    # refuses a job without clients
        if not 0.0 < average_eta <= 1.0:
            raise ValueError(f"average_eta must be in (0, 1], got {average_eta}")
        self.average_eta = float(average_eta)
        self.servers = list(range(int(servers)))
        self.is_server = comm.rank < len(self.servers)
        self.clients = list(range(len(self.servers), comm.size))
        self.slices = None          # (start, stop) of each server's slice of the model
        self.own = None             # this server's slice
        self._ended = False         # server 0 has said END
        self.optimizer = None       # a server's optimizer (set by its serving loop)
        self._stepping = None       # the optimizer restricted to this server's slice
        self.updates = 0                            # t: gradients applied
        # minibatches each client has had applied (the data position on resume)
        self.client_steps = [0] * len(self.clients)
        self.sent_version = {c: 0 for c in self.clients}
        self.average = None
        self._num_params = None     # the model's size, known once bound
        self.current = None      # theta once finalize put theta_bar into the network
        self._saved_client_steps = None
        self._header = np.zeros(HEADER_SIZE, dtype=np.float64)
        self._stop_told = False     # this server (not 0) has told server 0 of a signal
        self._stop_word = np.zeros(1, dtype=np.float64)

    # -- life cycle ----------------------------------------------------------------
    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)

    def bind(self, net) -> None:
        self._num_params = int(net.num_params)
        if self.slices is None:
            self.slices = split_by_layers([sl.stop - sl.start for _, sl in net.param_slices],
                                          len(self.servers))
            if self.is_server:
                self.own = slice(*self.slices[self.comm.rank])
        if self.is_server and self.average is None:
            self.average = ModelAverage(net.params, eta=self.average_eta, span=self.own)

    @property
    def split(self) -> bool:
        """Whether the model is split over several servers."""
        return len(self.servers) > 1

    def resume(self, net) -> None:
        if self.is_server and self.current is not None:
            net.params[...] = self.current
            self.current = None

    def finalize(self, net, optimizer, step: int = 0) -> None:
        """Every rank (all done serving) gets theta_bar; server 0 keeps theta (each
        server's slice of it)."""
        if self.is_server:
            self.current = net.params.copy()
            net.params[...] = self.average.average
        if not self.split:
            self.comm.bcast_(net.params, root=0)
            return
        for server, (start, stop) in enumerate(self.slices):
            self.comm.bcast_(net.params[start:stop], root=server)
            if server and self.comm.rank == 0:
                self.comm.recv(self.current[start:stop], server, tag=SLICE_TAG)
            elif server and self.comm.rank == server:
                self.comm.send(self.current[start:stop], 0, tag=SLICE_TAG)
        if self.comm.rank == 0:
            self.average.average[...] = net.params      # every server's slice of it

    def put_current(self, net) -> None:
        """Every rank, after :meth:`finalize`: theta, the model the servers trained, in
        place of theta_bar (collective; the end keeps it when it is the better)."""
        if self.comm.rank == 0:
            net.params[...] = self.current
        self.comm.bcast_(net.params, root=0)

    # -- the server's side ---------------------------------------------------------
    def send_weights(self, net, client: int) -> None:
        """theta (this server's slice) to ``client``, remembering the version it now
        computes on."""
        self.comm.send(net.params[self.own], client, tag=WEIGHTS_TAG)
        self.sent_version[client] = self.updates

    def receive_push(self, net) -> Push:
        """The next push from whichever client it comes; its gradient (if any) into
        ``net.grads`` (this server's slice; zeros elsewhere).  A server other than 0
        also answers server 0's requests meanwhile."""
        comm = self.comm
        while True:
            if self.obey_control(net):
                continue
            found = comm.iprobe(tag=HEADER_TAG)
            if found is not None:
                break
            comm.idle()     # on a shared core, leaves the CPU to the clients
        source = found[0]
        comm.recv(self._header, source, tag=HEADER_TAG)
        kind, loss_sum, correct, frames, position, stop = (float(x) for x in self._header)
        kind = int(kind)
        if kind not in (GRADIENT, LAST, DONE):
            raise RuntimeError(f"param_server: rank {source} sent an unknown header kind "
                               f"{kind}")
        if kind != DONE:
            comm.recv(net.grads[self.own], source, tag=GRADIENT_TAG)
        return Push(source=source, kind=kind, loss_sum=loss_sum, correct=correct,
                    frames=int(frames), position=int(position),
                    staleness=self.updates - self.sent_version[source], stop=int(stop))

    def apply(self, net, optimizer, lr: float, push: Push) -> None:
        """theta <- theta - lr / (1 + tau) g (the optimizer's step; ``lr`` undamped
        without ``damp_staleness``), t += 1, the average follows; of a split model,
        this server's slice only."""
        if self.split and self._stepping is not optimizer:
            optimizer.restrict_to(self.own.start, self.own.stop)
            self._stepping = optimizer
        optimizer.step(lr / (1 + push.staleness) if self.damp_staleness else lr)
        self.updates += 1
        self.client_steps[push.source - len(self.servers)] = push.position + 1
        self.average.update(net.params)

    # -- server 0 and the other servers (a split model) -------------------------------
    def obey_control(self, net) -> bool:
        """A server other than 0: carry out server 0's request if one came (True)."""
        if self.comm.rank == 0 or not self.split:
            return False
        if self.comm.iprobe(0, CONTROL_TAG) is None:
            return False
        self.comm.recv(self._header, 0, tag=CONTROL_TAG)
        kind = int(self._header[0])
        if kind == SNAPSHOT:
            self.comm.send(net.params[self.own], 0, tag=SLICE_TAG)
            self.comm.send(self.average.average[self.own], 0, tag=SLICE_TAG)
        elif kind == SWITCH:
            self.average.switch_to_uniform(updates=self.updates)
        elif kind == RESTART:
            self.average.restart_uniform(net.params, updates=self.updates)
        elif kind == END:
            self._ended = True
        elif kind == OPTIMIZER:
            state = self.optimizer.state_dict()
            for entry, key in param_sized_entries(state, net.num_params):
                self.comm.send(np.ascontiguousarray(entry[key][self.own]), 0, tag=SLICE_TAG)
        else:
            raise RuntimeError(f"param_server: server 0 sent an unknown control kind {kind}")
        return True

    def tell_stop(self, code: int) -> None:
        """A server other than 0 that a signal asked to stop (``code``: its
        :meth:`~mpitrain.train.stop.StopRequest.code`): tell server 0, once."""
        if self.comm.rank == 0 or self._stop_told or not code:
            return
        self._stop_told = True
        self.comm.send(np.array([code], dtype=np.float64), 0, tag=STOP_TAG)

    def stops_told(self) -> dict:
        """Server 0: {server rank: signal code} of the other servers' words that a
        signal asked them to stop, taken as they come (empty when none came)."""
        told = {}
        if self.comm.rank != 0 or not self.split:
            return told
        while True:
            found = self.comm.iprobe(tag=STOP_TAG)
            if found is None:
                return told
            self.comm.recv(self._stop_word, found[0], tag=STOP_TAG)
            told[found[0]] = int(self._stop_word[0])

    def serve_until_released(self, net) -> None:
        """A server other than 0, its own serving done: answer server 0 until END (which
        may have come already)."""
        while not self._ended:
            if not self.obey_control(net):
                self.comm.idle()

    def _tell_servers(self, kind: int, value: float = 0.0) -> None:
        self._header[:] = (kind, value, 0.0, 0.0, 0.0, 0.0)
        for server in self.servers[1:]:
            self.comm.send(self._header, server, tag=CONTROL_TAG)

    def collect_slices(self, net) -> None:
        """Server 0: every other server's current slices of theta and theta_bar into
        its own (before it evaluates or checkpoints the whole model)."""
        if not self.split:
            return
        self._tell_servers(SNAPSHOT)
        for server in self.servers[1:]:
            start, stop = self.slices[server]
            self.comm.recv(net.params[start:stop], server, tag=SLICE_TAG)
            self.comm.recv(self.average.average[start:stop], server, tag=SLICE_TAG)

    def whole_optimizer_state(self, optimizer, net) -> dict:
        """Server 0: the optimizer's state with every per-parameter buffer made of
        each server's own slice (for a checkpoint; the scalars are server 0's)."""
        state = optimizer.state_dict()
        if not self.split:
            return state
        entries = param_sized_entries(state, net.num_params)
        for entry, key in entries:
            entry[key] = np.array(entry[key])          # a copy: the live buffer stays
        self._tell_servers(OPTIMIZER)
        for server in self.servers[1:]:
            start, stop = self.slices[server]
            for entry, key in entries:
                self.comm.recv(entry[key][start:stop], server, tag=SLICE_TAG)
        return state

    def switch_to_uniform(self) -> None:
        """Server 0: the average turns uniform here and on every other server."""
        self.average.switch_to_uniform(updates=self.updates)
        if self.split:
            self._tell_servers(SWITCH, self.updates)

    def restart_average(self, net) -> None:
        """Server 0: the uniform average starts again from theta, on every server."""
        self.average.restart_uniform(net.params, updates=self.updates)
        if self.split:
            self._tell_servers(RESTART, self.updates)

    def release_servers(self) -> None:
        """Server 0, its serving done: the other servers may stop answering."""
        if self.split:
            self._tell_servers(END)

    # -- a client's side -----------------------------------------------------------
    def pull(self, net) -> None:
        """The servers' current weights into ``net.params`` (each server's slice)."""
        # every receive posted first: a server sending its slice never waits on
        # another server's slice (which could be waiting on server 0)
        self.comm.waitall([self.comm.irecv(net.params[start:stop], server, tag=WEIGHTS_TAG)
                           for server, (start, stop) in enumerate(self.slices)])

    def push(self, net, *, loss_sum: float, correct: float, frames: int, position: int,
             last: bool, stop: int = 0) -> None:
        """The gradient in ``net.grads`` of this client's minibatch number ``position``
        and its sums, to the servers (each its slice); ``stop``: non-zero when this
        client was asked to stop."""
        self._header[:] = (LAST if last else GRADIENT, loss_sum, correct, frames, position,
                           stop)
        for server, (begin, end) in enumerate(self.slices):
            self.comm.send(self._header, server, tag=HEADER_TAG)
            self.comm.send(net.grads[begin:end], server, tag=GRADIENT_TAG)

    def resumed_client_steps(self):
        """This client's minibatches server 0 had applied at the checkpoint resumed
        from; None for a fresh run or a checkpoint of another number of clients."""
        saved = self._saved_client_steps
        if saved is None or len(saved) != len(self.clients) or self.is_server:
            return None
        return saved[self.comm.rank - len(self.servers)]

    def re_plan_client_steps(self, factor: float) -> None:
        """The data was re-planned on resume (another minibatch or chunk size): the
        saved counts of each client's minibatches, in the old plan's steps, become
        the same fraction of the new plan's."""
        if self._saved_client_steps is not None:
            self._saved_client_steps = [int(round(s * factor))
                                        for s in self._saved_client_steps]
        self.client_steps = [int(round(s * factor)) for s in self.client_steps]

    def done_without_data(self) -> None:
        """Tell the server this client has no minibatch to train on."""
        self._header[:] = (DONE, 0.0, 0.0, 0, 0, 0)
        for server in self.servers:
            self.comm.send(self._header, server, tag=HEADER_TAG)

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
        if "average" not in state:
            # another method's state (BMUF, ADPSGD), met on --resume --accept-changes;
            # refused on every rank alike (the group is the same on all), before
            # anything is set, so that every rank starts the server afresh
            raise ValueError("checkpoint group 'strategy': no 'average': not a parameter "
                             f"server's state (it holds {', '.join(sorted(state))})")
        # every field checked before anything is set
        where = "checkpoint group 'strategy'"
        updates = count(state, "updates", where, default=0)
        steps = state.get("client_steps", np.zeros(0, np.int64))
        int_array(steps, f"{where}: field 'client_steps'")
        current = state.get("current")
        if self._num_params is None:
            raise RuntimeError("param_server: bind(net) must come before load_state_dict")
        # (on clients too, which keep none of it: every rank refuses a file alike)
        checked_average(state, (self._num_params,), updates=updates)
        if current is not None:
            current = float32_buffer(current, (self._num_params,),
                                     f"{where}: field 'current' (param_server)")
        self.updates = updates
        steps = [int(s) for s in steps]
        self._saved_client_steps = steps
        self.client_steps = steps if len(steps) == len(self.clients) else \
            [0] * len(self.clients)
        if self.is_server:
            self.average.load_state_dict(state, updates=updates)
            if current is not None:
                xp = _array_module(self.average.average)
                self.current = xp.asarray(current)
