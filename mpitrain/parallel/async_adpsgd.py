"""Asynchronous decentralized parallel SGD (AD-PSGD: Lian et al., arXiv 1710.06952;
for speech: Zhang, Cui et al., Interspeech 2019; Cui, Zhang et al., TASLP 2021):
every rank steps at its own pace and averages its model with one partner at a
time, waiting for nobody else.

The ranks are split in two, AD-PSGD's bipartite split: even ranks are active
(they ask for a mix), odd ranks passive (they answer).  So no two ranks ever
wait for each other, and a slow rank delays only the mixes it takes part in::

    active i, after each of its steps:
        if its request has been answered with m:   w_i <- w_i + (m - s)
        if no request is in flight:                s <- w_i; send s to partner j
    passive j, after each of its steps, for each request s that has arrived:
        w_j <- (w_j + s) / 2;  answer m = w_j

The two changes, (s - w_j)/2 on j and (w_j - s)/2 on i, are negatives of each
other, so every mix keeps the mean of the models over the ranks (up to float32
rounding: j stores the rounded mean, i adds a rounded difference).  The steps i took
while its request was in flight stay in w_i: its mix is as stale as the
steps it took meanwhile (AD-PSGD's bounded staleness), and its computing
never waits for the network.

Partners of an active rank: ``fixed_ring``, its passive ring neighbours
i + 1 and i - 1 in turn; ``random_ring``, a passive rank drawn from
(``seed``, i, its request count).  With an odd number of ranks the last
(even) rank's right neighbour is rank 0, also active: it mixes with its left
one only.

Every message of a mix also carries the sender's step counts of all ranks
(``counts``, a small host message sent just before the weights): each rank
keeps, per rank, the largest count it has heard of, so it knows a lower bound
of the steps the ranks took together without asking rank 0, which sees the
reports only between its own steps (train/async_ring.py stops stepping there
once that bound reaches the job's budget).  The mixes bring a far rank's counts
a mix per hop later, and none to a rank whose request waits on a slow partner,
so the counts also go straight to every rank (``spread_counts``: rank 0's after
each of its turns, every rank's near the end); at the end each rank sends a last
one and takes every rank's (``end_news``), so that none is left in flight.

Quiet points (a checkpoint, the end): :meth:`AsyncRingMixing.quiesce`.  An
active rank waits for the answer it has in flight, then tells every passive
rank it is done (``BYE``); a passive rank answers requests until every
active rank's ``BYE`` is in.  Then nothing is in flight and the ranks may meet
in a collective.

Symbols in the code: w is ``net.params``, s is ``sent``, m is ``answer``;
``requests`` counts an active rank's requests, ``mixes`` the mixes a rank
completed.
"""

from __future__ import annotations

import numpy as np

from ..state_fields import COUNT_MAX, count
from .adpsgd import TOPOLOGIES, restore_own_model
from .base import Strategy

#: Message tags: a request carrying s, the answer carrying m, an active rank's BYE,
#: and the step counts that go just before a request and an answer.
REQUEST_TAG, ANSWER_TAG, BYE_TAG = 7410, 7411, 7412
REQUEST_COUNTS_TAG, ANSWER_COUNTS_TAG = 7413, 7414
#: A rank's step counts of every rank, sent to every rank (spread_counts).
NEWS_TAG = 7415
#: How errors name a rank's part of a checkpoint's strategy state.
_RANK_STATE = "checkpoint rank state 'strategy'"
# Kept apart from the other seeded streams (initialisation, shuffling, the lock-step ring).
_PARTNER_STREAM = 0xAD5


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: adpsgd`` with ``parallel.asynchronous``."""
    return AsyncRingMixing(comm, topology=cfg.parallel.topology, seed=cfg.training.seed)


def active_ranks(size: int) -> list:
    """The ranks that ask for mixes (the even ones; one rank alone mixes with nobody)."""
    return list(range(0, size, 2)) if size > 1 else []


def passive_ranks(size: int) -> list:
    """The ranks that answer (the odd ones)."""
    return list(range(1, size, 2))


def ring_partners(rank: int, size: int) -> list:
    """An active rank's passive ring neighbours, right one first.

    Example::

        ring_partners(0, 4), ring_partners(4, 5)    # [1, 3], [3]
    """
    neighbours = []
    for other in ((rank + 1) % size, (rank - 1) % size):
        if other % 2 == 1 and other != rank and other not in neighbours:
            neighbours.append(other)
    return neighbours


class AsyncRingMixing(Strategy):
    """AD-PSGD's asynchronous pairwise mixing (see the module docstring).  The
    training loop that goes with it is :mod:`mpitrain.train.async_ring`.

    Example::

        strategy = AsyncRingMixing(comm, topology="random_ring", seed=1)
        strategy.setup(net, optimizer)
        # after each step: strategy.after_update(net, optimizer, step)
        strategy.quiesce()          # before any collective
    """

    name = "adpsgd"
    sync_period = 1

    def __init__(self, comm, *, topology: str = "fixed_ring", seed: int = 0):
        super().__init__(comm)
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, "
                             f"got {topology!r}")
        self.topology, self.seed = topology, int(seed)
        size, rank = comm.size, comm.rank
        self.active = rank in active_ranks(size)
        self.passives = passive_ranks(size)
        self.num_actives = len(active_ranks(size))
        self.neighbours = ring_partners(rank, size) if self.active else []
        self.own_steps = 0          # steps this rank took
        self.requests = 0           # requests this (active) rank sent
        self.mixes = 0              # mixes this rank completed
        # every rank's steps, the most this rank has heard of (its own: exact)
        self.counts = np.zeros(size, dtype=np.int64)
        self._counts_in = np.zeros(size, dtype=np.int64)
        self._counts_out = np.zeros(size, dtype=np.int64)
        self._count_sends: list = []    # (buffer, send request) of a passive rank's counts
        # the counts spread to every rank: (buffer, its sends); the last element of a
        # message is 1 on a rank's last one
        self._news_sends: list = []
        self._news_in = np.zeros(size + 1, dtype=np.int64)
        self._news_over: set = set()    # the ranks whose last news has come
        self.net = None
        self.sent = self.answer = self.received = None
        self._in_flight = None      # the receives of the answer, the sends of the request
        self._answers: list = []    # (buffer, send request) of a passive rank's answers
        self._bye = np.zeros(1, dtype=np.int32)
        self._final_local = None
        self._quiet = True          # nothing in flight since the last quiesce (or start)

    def partner(self, request: int):
        """The passive rank an active rank's ``request``-th request goes to."""
        if not self.passives or (self.topology == "fixed_ring" and not self.neighbours):
            return None
        if self.topology == "fixed_ring":
            return self.neighbours[request % len(self.neighbours)]
        rng = np.random.default_rng([self.seed, _PARTNER_STREAM, self.comm.rank, int(request)])
        return self.passives[int(rng.integers(len(self.passives)))]

    # -- life cycle ----------------------------------------------------------------
    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)

    def bind(self, net) -> None:
        if self.net is not net or self.received is None:
            xp = net.xp
            self.received = xp.empty_like(net.params)
            self.sent = xp.empty_like(net.params)
            self.answer = xp.empty_like(net.params)
            self._answers = []
        self.net = net

    def after_update(self, net, optimizer, step: int) -> None:
        self.own_steps += 1
        self.counts[self.comm.rank] = self.own_steps
        if self.comm.size == 1:
            return
        self._quiet = False
        if self.active:
            if self._in_flight is not None:
                self._collect(block=False)
            if self._in_flight is None:
                self._request()
        else:
            self._answer_waiting()

    def serve(self) -> bool:
        """A rank that has stopped stepping and waits: answer the requests that have
        arrived (passive) or take the answer in flight (active), as after a step, so
        nobody waits for it.  True when something was done."""
        if self.comm.size == 1:
            return False
        # (a quiet point after this must be a full one: others may have stepped)
        self._quiet = False
        if self.active:
            if self._in_flight is None:
                return False
            self._collect(block=False)
            return self._in_flight is None
        return self._answer_waiting()

    def note_counts(self, counts) -> None:
        """Merge step counts heard of (``counts``: one per rank), keeping the larger."""
        np.maximum(self.counts, np.asarray(counts, dtype=np.int64), out=self.counts)

    def note_count(self, rank: int, steps: int) -> None:
        """Merge one rank's step count heard of."""
        self.counts[rank] = max(int(self.counts[rank]), int(steps))

    def known_steps(self) -> int:
        """The steps the ranks took together, as far as this rank knows (never more)."""
        return int(self.counts.sum())

    def spread_counts(self, *, last: bool = False) -> None:
        """Send every other rank the step counts this rank knows of (a host message
        of 8 bytes per rank and one more; ``last``: its last one, at the end)."""
        comm = self.comm
        if comm.size == 1:
            return
        buffer = self._free_news_buffer()
        buffer[:-1] = self.counts
        buffer[-1] = int(last)
        self._news_sends.append((buffer, [comm.isend(buffer, r, tag=NEWS_TAG)
                                          for r in range(comm.size) if r != comm.rank]))

    def take_news(self) -> None:
        """Merge the counts spread by the others that have arrived (until two polls
        in a row find none: MPI may move only some small messages per poll)."""
        comm = self.comm
        empty = 0
        while comm.size > 1 and empty < 2:
            found = comm.iprobe(tag=NEWS_TAG)
            if found is None:
                empty += 1
                continue
            empty = 0
            comm.recv(self._news_in, found[0], tag=NEWS_TAG)
            self.note_counts(self._news_in[:-1])
            if self._news_in[-1]:
                self._news_over.add(found[0])

    def end_news(self) -> None:
        """At the end, after :meth:`quiesce`: send every rank this rank's last counts
        and take every rank's up to its last one (a sender's messages come in order),
        so that none is left in flight."""
        comm = self.comm
        if comm.size == 1:
            return
        self.spread_counts(last=True)
        while True:
            self.take_news()
            if len(self._news_over) == comm.size - 1:
                break
            comm.idle()
        comm.waitall([r for _, sends in self._news_sends for r in sends])
        self._news_sends, self._news_over = [], set()

    def _free_news_buffer(self):
        for index, (_, sends) in enumerate(self._news_sends):
            if all(request.test() for request in sends):
                return self._news_sends.pop(index)[0]
        return np.empty(self.comm.size + 1, dtype=np.int64)

    def models_agree(self, step: int) -> bool:
        return self.comm.size == 1

    def quiesce(self) -> None:
        """Finish every exchange; returns when nothing of this rank's is in flight
        and (on a passive rank) every active rank has said BYE.  Every rank calls it
        before a collective."""
        comm = self.comm
        if comm.size == 1 or self._quiet:
            # every rank is quiet alike: none has stepped since the last quiet point
            return
        self._quiet = True
        if self.active:
            if self._in_flight is not None:
                self._collect(block=True)
            comm.waitall([comm.isend(self._bye, p, tag=BYE_TAG) for p in self.passives])
            return
        byes = 0
        while byes < self.num_actives:
            if comm.iprobe(tag=REQUEST_TAG) is not None:
                self._answer_waiting()
                continue
            found = comm.iprobe(tag=BYE_TAG)
            if found is not None:
                comm.recv(np.empty_like(self._bye), found[0], tag=BYE_TAG)
                byes += 1
                continue
            comm.idle()
        comm.waitall([request for _, request in self._answers + self._count_sends])

    def finalize(self, net, optimizer, step: int = 0) -> None:
        # the result is the average of every rank's model, as AD-PSGD outputs
        self.quiesce()
        self._final_local = net.params.copy()
        if self.comm.size > 1:
            self.comm.allreduce_(net.params, op="mean")

    # -- the mix -------------------------------------------------------------------
    def _request(self) -> None:
        partner = self.partner(self.requests)
        if partner is None:
            return
        comm = self.comm
        self.sent[...] = self.net.params
        self._counts_out[...] = self.counts
        # the counts go first: whoever has the weights can wait for them
        self._in_flight = (comm.irecv(self._counts_in, partner, tag=ANSWER_COUNTS_TAG),
                           comm.irecv(self.answer, partner, tag=ANSWER_TAG),
                           comm.isend(self._counts_out, partner, tag=REQUEST_COUNTS_TAG),
                           comm.isend(self.sent, partner, tag=REQUEST_TAG))
        self.requests += 1

    def _collect(self, *, block: bool) -> None:
        counts, receive, *sends = self._in_flight
        if block:
            receive.wait()
        elif not receive.test():
            return
        self.comm.waitall([counts] + sends)
        self._in_flight = None
        self.note_counts(self._counts_in)
        # w <- w + (m - s): the steps taken since s was sent stay
        self.answer -= self.sent
        self.net.params += self.answer
        self.mixes += 1

    def _answer_waiting(self) -> bool:
        """Mix with every request that has arrived, answering each.  True when there
        was one."""
        comm, params = self.comm, self.net.params
        answered = False
        while True:
            found = comm.iprobe(tag=REQUEST_TAG)
            if found is None:
                return answered
            source = found[0]
            comm.recv(self.received, source, tag=REQUEST_TAG)
            # (sent before the weights: it is here or on its way)
            comm.recv(self._counts_in, source, tag=REQUEST_COUNTS_TAG)
            self.note_counts(self._counts_in)
            params += self.received
            params *= params.dtype.type(0.5)
            counts = self._free_counts_buffer()
            counts[...] = self.counts
            self._count_sends.append(
                (counts, comm.isend(counts, source, tag=ANSWER_COUNTS_TAG)))
            buffer = self._free_answer_buffer()
            buffer[...] = params
            self._answers.append((buffer, comm.isend(buffer, source, tag=ANSWER_TAG)))
            self.mixes += 1
            answered = True

    def _free_answer_buffer(self):
        """A buffer no answer in flight still uses (answers go out without waiting,
        so a busy passive rank may hold a few)."""
        for index, (_, request) in enumerate(self._answers):
            if request.test():
                return self._answers.pop(index)[0]
        return self.net.xp.empty_like(self.net.params)

    def _free_counts_buffer(self):
        for index, (_, request) in enumerate(self._count_sends):
            if request.test():
                return self._count_sends.pop(index)[0]
        return np.empty_like(self.counts)

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def rank_state_dict(self) -> dict:
        """This rank's own model (before the final average, once there was one) and
        counters."""
        from ..backend import to_host
        local = self._final_local if self._final_local is not None else self.net.params
        return {"params": to_host(local).copy(), "own_steps": int(self.own_steps),
                "requests": int(self.requests), "mixes": int(self.mixes)}

    def load_rank_state_dict(self, state: dict) -> None:
        # every field checked before anything is set: a count of steps beyond what
        # the rank took ended the job at once, at a step of the forged count
        state = state if isinstance(state, dict) else {}
        own_steps = count(state, "own_steps", _RANK_STATE, default=0)
        # an active rank sends one request after a step at most, and a checkpoint
        # comes at a quiet point, where each has been answered (a mix); a passive
        # rank sends none
        requests = count(state, "requests", _RANK_STATE, default=0,
                         high=own_steps if self.active else 0)
        mixes = count(state, "mixes", _RANK_STATE, default=0,
                      high=requests if self.active else COUNT_MAX)
        if not restore_own_model(self.net, state):
            return
        self.own_steps, self.requests, self.mixes = own_steps, requests, mixes
        self._final_local = None
