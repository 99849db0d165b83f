"""A virtual cluster: N ranks as N threads of one process, with a simulated clock.

Each virtual rank is a thread running the same code a real rank runs (the
trainer, its strategy, its optimizer), talking to the others through its own
:class:`VirtualCommunicator`.

Scheduling (one baton).  Exactly one rank runs at a time.  It runs until it
must wait inside the communicator (a collective that not every member has
reached, a receive with no matching message) or until it ends; the baton
then passes to the runnable rank with the earliest clock (ties: the next in
cyclic rank order).  So everything happens in an order fixed by the program
alone, in the order of simulated time as far as the ranks' clocks tell it,
and module-level caches (scratch buffers, pinned cells) are never shared by
two running ranks (a rank on a GPU hands over once its queued device work is
done, so that its stream's kernels do not run beside the next rank's).  If no
rank can run while some still wait, the job would hang under MPI; here every
rank raises :class:`VirtualClusterError` naming what each waits for.

Collectives.  The k-th collective call of every member of a group is one
rendezvous; the call kind, op, root and buffer size must agree (else every
rank raises instead of hanging).  The last member to arrive computes the
result from all members' buffers, which the others cannot touch while they
wait.  Sums follow MPICH's recursive-doubling order (:func:`mpich_order_sum`:
pairs (0,1), (2,3), ... first, then pairs of pairs; ranks past the largest
power of two folded into their left neighbour first).  That is the order the
MPICH 5 wheel uses on one node for every buffer size at 2 to 8 ranks
(measured), so a virtual run equals ``mpiexec -n N`` bit for bit; max and min
are exact in any order.  "mean" is the sum times the buffer's type's 1/N, as
:class:`~mpitrain.comm.mpi.MpiCommunicator` scales it.

Simulated clock.  Each rank has a clock in seconds.  ``advance(s)`` adds
compute time (the trainer's step, :mod:`mpitrain.train.virtual`).  A
collective sets every member's clock to max(arrival clocks) + its cost on the
network model (:class:`~mpitrain.comm.netmodel.NetworkModel`; None: free), so
a straggler makes everyone wait.  A message sent at t arrives at
t + latency + bytes/bandwidth; the sender spends bytes/bandwidth injecting it
and a receiver's clock becomes max(its own, the arrival).  A poll (``iprobe``,
a request's ``test``) never sees a message before its arrival, so a rank that
computes between polls goes on computing; a loop with nothing else to do calls
``idle()``, which moves the rank's clock to the next arrival.  ``wtime()`` is
the rank's clock and ``comm_time`` the simulated seconds it spent
communicating, waits included.

Example::

    cluster = VirtualCluster(4, network=NetworkModel())
    def work(comm):
        buf = numpy.full(3, comm.rank, dtype=numpy.float32)
        comm.advance(0.010 * (comm.rank + 1))     # rank 3 is slowest
        comm.allreduce_(buf, op="mean")
        return comm.wtime()
    cluster.run(work)          # [0.04 + cost] * 4; buf is 1.5 everywhere
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from .. import backend
from .base import (ANY_SOURCE, ANY_TAG, CompletedRequest, Communicator, Request,
                   check_buffer, check_mean_dtype, check_op, decode_obj, encode_obj,
                   scalar_dtype, scalar_result)

#: Elements reduced at a time: bounds the temporaries of a reduction over many ranks.
REDUCE_PIECE = 1 << 18
#: Seconds between the main thread's looks at signals while the ranks run.
HANDLER_WAKE_S = 0.2


class VirtualClusterError(RuntimeError):
    """A virtual rank failed, aborted, or the ranks' calls can never match;
    ``exit_status``: the status an abort asked for (None: not an abort)."""

    exit_status = None


def mpich_order_sum(values: list):
    """Sum ``values`` (one per rank, rank order) in MPICH's recursive-doubling order.

    With p the largest power of two <= N and r = N - p, ranks 2i and 2i+1 for
    i < r are added first; the p partial values are then added in pairs of
    neighbours, then pairs of pairs.  Returns a new value (inputs untouched).

    Example::

        mpich_order_sum([a0, a1, a2, a3])     # (a0 + a1) + (a2 + a3)
        mpich_order_sum([a0, a1, a2])         # (a0 + a1) + a2
    """
    return _tree_reduce(values, lambda a, b: a + b)


def _tree_reduce(values: list, combine: Callable):
    pof2 = 1
    while pof2 * 2 <= len(values):
        pof2 *= 2
    rem = len(values) - pof2
    level = [combine(values[2 * i], values[2 * i + 1]) for i in range(rem)] + list(values[2 * rem:])
    while len(level) > 1:
        level = [combine(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
    return level[0]


_COMBINE = {"sum": lambda a, b: a + b, "mean": lambda a, b: a + b,
            "max": np.maximum, "min": np.minimum}


def _reduce_buffers(buffers: list, op: str, size: int):
    """The reduction of equal flat buffers, piece by piece (pieces are independent)."""
    flats = [b.reshape(-1) for b in buffers]
    out = flats[0].copy()
    combine = _COMBINE[op]
    if op in ("max", "min"):
        xp = backend.get_array_module(out)
        combine = xp.maximum if op == "max" else xp.minimum
    for lo in range(0, out.size, REDUCE_PIECE):
        hi = lo + REDUCE_PIECE
        out[lo:hi] = _tree_reduce([f[lo:hi] for f in flats], combine)
    if op == "mean" and size > 1:
        out *= out.dtype.type(1.0 / size)
    return out


class _Rendezvous:
    """One collective call of a group: what each member brought, and when."""

    def __init__(self, kind: str, detail: tuple):
        self.kind, self.detail = kind, detail
        self.payloads: dict = {}
        self.arrivals: dict = {}
        self.results: Optional[list] = None


class _Group:
    """Members (world ranks, in group-rank order), their collective counters, mailboxes."""

    def __init__(self, members: list, name: str):
        self.members = list(members)
        self.name = name
        self.next_call = [0] * len(members)
        self.open: dict = {}
        self.mailboxes = [deque() for _ in members]   # (source, tag, data, arrival time)

    @property
    def size(self) -> int:
        return len(self.members)


class VirtualCluster:
    """N virtual ranks, their clocks and the baton; :meth:`run` starts them.

    ``network``: a :class:`~mpitrain.comm.netmodel.NetworkModel` (or anything
    with its methods) pricing each call; None: communication takes no time.

    Example::

        cluster = VirtualCluster(8)
        sums = cluster.run(lambda comm: comm.allreduce_scalar(comm.rank))   # [28] * 8
    """

    def __init__(self, size: int, *, network=None):
        if int(size) != size or size < 1:
            raise ValueError(f"VirtualCluster: size must be a positive int, got {size!r}")
        self.size = int(size)
        self.network = network
        self.clocks = [0.0] * self.size
        self.comm_seconds = [0.0] * self.size
        self._lock = threading.Lock()
        self._wake = [threading.Condition(self._lock) for _ in range(self.size)]
        self._done = threading.Condition(self._lock)      # a rank ended
        self._turn: Optional[int] = None
        self._runnable = [True] * self.size
        self._finished = [False] * self.size
        self._waiting_for = [""] * self.size
        # a rank that polled (for a message not there yet, or not yet arrived on its
        # clock) and let the others run: idle, nobody should wait for it
        self._polling = [False] * self.size
        # messages sent to each rank so far (an idle rank waits for a new one)
        self.sent_to = [0] * self.size
        # ranks whose arrays live on a GPU (setup_device_transport): see _hand_over
        self._on_device = [False] * self.size
        self._failure: Optional[BaseException] = None
        self._failed_rank: Optional[int] = None
        self._groups = 0
        self.world = self._new_group(list(range(self.size)), "world")

    def _new_group(self, members: list, name: str) -> _Group:
        self._groups += 1
        return _Group(members, name)

    def communicator(self, rank: int) -> "VirtualCommunicator":
        """The world communicator of virtual rank ``rank``."""
        return VirtualCommunicator(self, self.world, rank)

    # ---- running
    def run(self, target: Callable[["VirtualCommunicator"], Any]) -> list:
        """Run ``target(comm)`` on every virtual rank; the list of their results.

        The first exception of any rank is raised here once all threads ended
        (the others stop at their next communicator call).

        Example::

            results = VirtualCluster(2).run(lambda comm: comm.rank)    # [0, 1]
        """
        results: list = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(rank, target, results),
                                    name=f"virtual-rank-{rank}", daemon=True)
                   for rank in range(self.size)]
        for thread in threads:
            thread.start()
        with self._lock:
            self._give_turn(0)
        try:
            self._wait_for_ranks()
        except KeyboardInterrupt:
            # Ctrl-C reaches the main thread alone: every rank is interrupted too at its
            # next wait in the communicator and closes what it opened (rank 0's run
            # records it); left standing, the ranks were stopped wherever the
            # interpreter's end found them, which could hang it (in an HDF5 call)
            self._fail(None, KeyboardInterrupt())
            self._wait_for_ranks()
            raise
        for thread in threads:
            thread.join()
        if self._failure is not None:
            raise self._failure
        return results

    def _wait_for_ranks(self) -> None:
        # (not Thread.join: a join that Ctrl-C interrupts can take the thread it
        # waited for as ended while it still runs, Python 3.11)  A timed wait: Python
        # runs a signal's handler in this thread only, and an untimed wait that the
        # handler asks to restart (train/stop.py's) never returns to run it (a stop
        # signal went unseen until the run's end)
        with self._lock:
            while not all(self._finished):
                self._done.wait(HANDLER_WAKE_S)

    def _rank_main(self, rank: int, target, results: list) -> None:
        with self._lock:
            while self._turn != rank and self._failure is None:
                self._wake[rank].wait()
        try:
            if self._failure is None:
                results[rank] = target(self.communicator(rank))
                self._hand_over(rank)
        except VirtualClusterError as exc:
            self._fail(rank, exc)
        except BaseException as exc:     # the job's first error ends every rank
            self._fail(rank, exc)
        finally:
            with self._lock:
                self._finished[rank] = True
                self._runnable[rank] = False
                if self._turn == rank:
                    self._pass_baton(rank)
                self._done.notify()

    def _fail(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure, self._failed_rank = exc, rank
            for cond in self._wake:
                cond.notify()

    # ---- the baton (all called with the lock held)
    def _give_turn(self, rank: int) -> None:
        self._turn = rank
        self._wake[rank].notify()

    def _pass_baton(self, current: int, *, others_first: bool = False) -> None:
        """The baton to the runnable rank with the earliest clock (``others_first``:
        ``current`` only when no other rank can run)."""
        order = [(current + step) % self.size for step in range(1, self.size + 1)]
        ready = [r for r in order if self._runnable[r] and not self._finished[r]]
        if others_first and len(ready) > 1:
            ready = [r for r in ready if r != current]
            # a rank that is itself only polling would just pass the baton back:
            # ranks with work go first (two polling ranks would otherwise take
            # turns for ever while a rank with work waits)
            working = [r for r in ready if not self._polling[r]]
            ready = working or ready
        if ready:
            # min keeps the first of equal clocks: cyclic order breaks ties
            self._give_turn(min(ready, key=lambda r: self.clocks[r]))
            return
        self._turn = None
        if not all(self._finished) and self._failure is None:
            waits = "; ".join(f"rank {r}: {self._waiting_for[r]}" for r in range(self.size)
                              if not self._finished[r])
            self._failure = VirtualClusterError(
                f"virtual cluster: no rank can continue (this would hang under MPI): {waits}")
            for cond in self._wake:
                cond.notify()

    def _raise_if_failed(self, rank: int) -> None:
        if self._failure is not None:
            if isinstance(self._failure, KeyboardInterrupt):
                raise KeyboardInterrupt          # (each rank its own)
            if self._failed_rank in (rank, None):
                raise self._failure
            # (a bare MemoryError says nothing: its name then)
            reason = str(self._failure) or type(self._failure).__name__
            raise VirtualClusterError(f"virtual rank {rank}: stopped because rank "
                                      f"{self._failed_rank} failed: {reason}")

    def _hand_over(self, rank: int) -> None:
        """Before ``rank`` lets another rank run: its queued device work is done.
        The ranks share module-level device scratch and read each other's buffers
        in collectives, and with a stream of their own each (cuda_graph) the GPU
        would otherwise run two ranks' work at once."""
        if self._on_device[rank]:
            backend.synchronize()

    def _wait(self, rank: int, what: str) -> None:
        """Block ``rank`` until another rank makes it runnable and the baton comes back."""
        self._hand_over(rank)
        self._runnable[rank] = False
        self._waiting_for[rank] = what
        self._pass_baton(rank)
        while (self._turn != rank or not self._runnable[rank]) and self._failure is None:
            self._wake[rank].wait()
        self._waiting_for[rank] = ""
        self._raise_if_failed(rank)

    def _yield(self, rank: int) -> None:
        """Let the other runnable ranks go first (a poll that found nothing)."""
        self._hand_over(rank)
        self._polling[rank] = True
        try:
            self._pass_baton(rank, others_first=True)
            while self._turn != rank and self._failure is None:
                self._wake[rank].wait()
        finally:
            self._polling[rank] = False
        self._raise_if_failed(rank)

    def _make_runnable(self, rank: int) -> None:
        self._runnable[rank] = True

    def _runs_before(self, rank: int, arrival: float) -> bool:
        """Whether another rank that can run is still before ``arrival`` on its clock
        (and may yet send ``rank`` an earlier message): it should run first."""
        return any(r != rank and self._runnable[r] and not self._finished[r]
                   and not self._polling[r] and self.clocks[r] < arrival
                   for r in range(self.size))


class _VirtualRecv(Request):
    """A posted receive: completes when a matching message is in the mailbox."""

    def __init__(self, comm: "VirtualCommunicator", buf, source: int, tag: int):
        self._comm, self._buf, self._source, self._tag = comm, buf, source, tag
        self._done = False

    def test(self) -> bool:
        if not self._done:
            self._done = self._comm._take_message(self, block=False)
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._done = self._comm._take_message(self, block=True)


class VirtualCommunicator(Communicator):
    """One virtual rank's view of a group of its :class:`VirtualCluster`.

    Besides the :class:`~mpitrain.comm.base.Communicator` calls: ``advance``
    (add compute time to this rank's clock); ``wtime()`` and ``comm_time`` are
    simulated seconds.

    Example::

        def work(comm):
            comm.advance(0.002)                       # one step of 2 ms
            comm.allreduce_(params, op="mean")
            return comm.wtime(), comm.comm_time
        VirtualCluster(16, network=NetworkModel()).run(work)
    """

    name = "virtual"

    def __init__(self, cluster: VirtualCluster, group: _Group, rank: int):
        super().__init__()
        self.cluster, self._group, self._rank = cluster, group, int(rank)
        self._world_rank = group.members[self._rank]
        self._transport = "host"
        self._comm_base = cluster.comm_seconds[self._world_rank]
        # messages sent to this rank when it first polled since its last idle()
        self._polled_at = None

    # ---- identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    @property
    def world_rank(self) -> int:
        """This rank's number in the whole virtual cluster."""
        return self._world_rank

    @property
    def local_rank(self) -> int:
        # each virtual rank stands for a rank alone on its node (device 0 here)
        return 0

    @property
    def local_size(self) -> int:
        return 1

    @property
    def thread_multiple(self) -> bool:
        return False        # the baton belongs to the rank's own thread

    @property
    def transport(self) -> str:
        return self._transport

    def setup_device_transport(self, xp, *, prefer: Optional[str] = None) -> str:
        """'host' for numpy, 'local' for device arrays (they never leave the process).

        Example::

            comm.setup_device_transport(numpy)     # 'host'
        """
        self._transport = "host" if xp is np else "local"
        self.cluster._on_device[self._world_rank] = xp is not np
        return self._transport

    # ---- the simulated clock
    def wtime(self) -> float:
        return self.cluster.clocks[self._world_rank]

    def advance(self, seconds: float) -> None:
        """Add ``seconds`` of computing to this rank's clock.

        Example::

            comm.advance(0.002)
        """
        if not seconds >= 0:
            raise ValueError(f"advance: seconds must be >= 0, got {seconds!r}")
        self.cluster.clocks[self._world_rank] += float(seconds)

    @property
    def comm_time(self) -> float:
        return self.cluster.comm_seconds[self._world_rank] - self._comm_base

    def reset_comm_time(self) -> None:
        self._comm_base = self.cluster.comm_seconds[self._world_rank]

    def _cost(self, method: str, *args) -> float:
        network = self.cluster.network
        return 0.0 if network is None else float(getattr(network, method)(*args))

    # ---- the rendezvous
    def _collective(self, kind: str, detail: tuple, payload, finish: Callable):
        """Arrive at this group's next collective; ``finish(payloads)`` -> (results, cost)
        runs on the last member to arrive.  Returns this member's result."""
        cluster, group, me = self.cluster, self._group, self._rank
        with cluster._lock:
            cluster._raise_if_failed(self._world_rank)
            index = group.next_call[me]
            group.next_call[me] += 1
            rv = group.open.get(index)
            if rv is None:
                rv = group.open[index] = _Rendezvous(kind, detail)
            elif (rv.kind, rv.detail) != (kind, detail):
                error = VirtualClusterError(
                    f"virtual cluster: collective #{index} of group {group.name}: rank {me} "
                    f"calls {kind}{detail} but another rank called {rv.kind}{rv.detail} "
                    "(this would hang or corrupt data under MPI)")
                cluster._failure, cluster._failed_rank = error, self._world_rank
                for cond in cluster._wake:
                    cond.notify()
                raise error
            rv.payloads[me] = payload
            rv.arrivals[me] = cluster.clocks[self._world_rank]
            if len(rv.payloads) < group.size:
                # a message sent to this rank meanwhile wakes it too: wait on
                while rv.results is None:
                    cluster._wait(self._world_rank, f"{kind} (collective #{index} of "
                                                    f"group {group.name})")
            else:
                del group.open[index]
                rv.results, cost = finish([rv.payloads[m] for m in range(group.size)])
                end = max(rv.arrivals.values()) + cost
                for m, world_rank in enumerate(group.members):
                    cluster.comm_seconds[world_rank] += end - rv.arrivals[m]
                    cluster.clocks[world_rank] = end
                    cluster._make_runnable(world_rank)
            result = rv.results[me]
        if isinstance(result, Exception):
            raise result
        return result

    # ---- buffer collectives
    def allreduce_(self, buf, op: str = "mean"):
        check_op(op, where="allreduce_")
        check_buffer(buf, where="allreduce_")
        check_mean_dtype(buf, op, where="allreduce_")
        size = self.size

        def finish(buffers):
            total = _reduce_buffers(buffers, op, size)
            for other in buffers:
                other.reshape(-1)[...] = total
            return [None] * size, self._cost("allreduce_seconds", buf.nbytes, size)

        self._collective("allreduce_", (op, buf.size, buf.dtype.str), buf, finish)
        return buf

    def iallreduce_(self, buf, op: str = "mean") -> Request:
        # completes at the call: the rendezvous is where every rank starts it
        self.allreduce_(buf, op)
        return CompletedRequest()

    def bcast_(self, buf, root: int = 0):
        self._check_peer(root, where="bcast_")
        check_buffer(buf, where="bcast_")
        size = self.size

        def finish(buffers):
            source = buffers[root].reshape(-1)
            for rank, other in enumerate(buffers):
                if rank != root:
                    other.reshape(-1)[...] = source
            return [None] * size, self._cost("bcast_seconds", buf.nbytes, size)

        self._collective("bcast_", (root, buf.size, buf.dtype.str), buf, finish)
        return buf

    # ---- small host values
    def allreduce_scalar(self, value, op: str = "sum"):
        check_op(op, where="allreduce_scalar")
        cell = np.array([value], dtype=scalar_dtype(value, where="allreduce_scalar"))
        size = self.size

        def finish(cells):
            dtype = np.result_type(*cells)
            reduced = _tree_reduce([c.astype(dtype) for c in cells], _COMBINE[op])
            return [reduced] * size, self._cost("allreduce_seconds", 8, size)

        reduced = self._collective("allreduce_scalar", (op,), cell, finish)[0]
        if op == "mean":
            reduced = reduced / size
        return scalar_result(reduced, value, op)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root, where="bcast_obj")
        size = self.size

        def finish(objs):
            try:
                data = encode_obj(objs[root])
            except (TypeError, ValueError) as exc:
                error = ValueError(f"bcast_obj: rank {root} could not encode its object: {exc}")
                return [error] * size, 0.0
            return [data] * size, self._cost("bcast_seconds", 8 + data.size, size)

        return decode_obj(self._collective("bcast_obj", (root,), obj, finish))

    def _gather(self, kind: str, obj: Any, root: Optional[int]):
        size = self.size

        def finish(objs):
            encoded, failed = [], []
            for rank, item in enumerate(objs):
                try:
                    encoded.append(encode_obj(item))
                except (TypeError, ValueError):
                    encoded.append(None)
                    failed.append(rank)
            if failed:
                error = ValueError(f"{kind}: rank(s) {failed} could not encode their object")
                return [error] * size, 0.0
            total = sum(8 + e.size for e in encoded)
            return [encoded] * size, self._cost("allgather_seconds", total, size)

        encoded = self._collective(kind, (root,), obj, finish)
        if root is not None and self._rank != root:
            return None
        return [decode_obj(e) for e in encoded]

    def allgather_obj(self, obj: Any) -> list:
        return self._gather("allgather_obj", obj, None)

    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list]:
        self._check_peer(root, where="gather_obj")
        return self._gather("gather_obj", obj, root)

    def barrier(self) -> None:
        size = self.size
        self._collective("barrier", (), None,
                         lambda _: ([None] * size, self._cost("barrier_seconds", size)))

    # ---- groups
    def split(self, color: Optional[int], key: int = 0) -> Optional["VirtualCommunicator"]:
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split: color must be a non-negative int or None, got {color!r}")
        cluster, group, size = self.cluster, self._group, self.size

        def finish(entries):
            results = [None] * size
            for wanted in sorted({c for c, _ in entries if c is not None}):
                ranks = sorted((k, r) for r, (c, k) in enumerate(entries) if c == wanted)
                members = [group.members[r] for _, r in ranks]
                new = cluster._new_group(members, f"{group.name}/{wanted}")
                for index, (_, r) in enumerate(ranks):
                    results[r] = (new, index)
            return results, self._cost("allgather_seconds", 16 * size, size)

        mine = self._collective("split", (), (None if color is None else int(color), int(key)),
                                finish)
        if mine is None:
            return None
        twin = VirtualCommunicator(cluster, mine[0], mine[1])
        twin._transport = self._transport
        return twin

    def dup(self) -> "VirtualCommunicator":
        return self.split(0, self._rank)

    def abort(self, code: int = 1, message: str = "") -> None:
        error = VirtualClusterError(f"virtual rank {self._world_rank} aborted the job "
                                    f"(exit status {code}): {message}")
        error.exit_status = code
        self.cluster._fail(self._world_rank, error)
        raise error

    # ---- point to point
    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        self._check_peer(dest, where="isend")
        check_buffer(buf, where="isend", writable=False)
        cluster = self.cluster
        with cluster._lock:
            cluster._raise_if_failed(self._world_rank)
            now = cluster.clocks[self._world_rank]
            inject = 0.0 if cluster.network is None else \
                buf.nbytes / float(cluster.network.bandwidth_bytes_per_s)
            arrival = now + self._cost("p2p_seconds", buf.nbytes)
            cluster.clocks[self._world_rank] = now + inject
            cluster.comm_seconds[self._world_rank] += inject
            self._group.mailboxes[dest].append((self._rank, int(tag), buf.copy(), arrival))
            cluster.sent_to[self._group.members[dest]] += 1
            # a rank waiting in a receive looks again when it next runs
            cluster._make_runnable(self._group.members[dest])
        return CompletedRequest()

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.isend(buf, dest, tag)

    def irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        self._check_peer(source, where="irecv", wildcard=True)
        check_buffer(buf, where="irecv")
        return _VirtualRecv(self, buf, source, tag)

    def recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple:
        request = self.irecv(buf, source, tag)
        request.wait()
        return request.source, request.tag

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        self._check_peer(dest, where="sendrecv")
        self._check_peer(source, where="sendrecv", wildcard=True)
        check_buffer(recvbuf, where="sendrecv")
        self.isend(sendbuf, dest, tag)
        self.recv(recvbuf, source, tag)
        return recvbuf

    def _match(self, source: int, tag: int) -> Optional[int]:
        """The message a receive takes: from one source the oldest (MPI keeps one
        sender's order); from any source the first to arrive on the clock."""
        found = None
        for index, (sent_from, sent_tag, _, arrival) in enumerate(
                self._group.mailboxes[self._rank]):
            if source in (ANY_SOURCE, sent_from) and tag in (ANY_TAG, sent_tag):
                if source != ANY_SOURCE:
                    return index
                if found is None or arrival < self._group.mailboxes[self._rank][found][3]:
                    found = index
        return found

    def _deliverable(self, source: int, tag: int, *, block: bool) -> Optional[int]:
        """:meth:`_match`, unless the message arrives after this rank's clock: then
        None, after letting any rank still earlier on its clock run.  A blocking
        receive takes a later message when nobody else can run before it (the rank
        waits until it arrives); a poll (``block`` False) never sees a message
        before its arrival: the rank goes on with its own work meanwhile."""
        cluster, me = self.cluster, self._world_rank
        index = self._match(source, tag)
        if index is None:
            return None
        arrival = self._group.mailboxes[self._rank][index][3]
        if arrival > cluster.clocks[me]:
            if cluster._runs_before(me, arrival):
                cluster._yield(me)
                return None
            if not block:
                return None
        return index

    def _take_message(self, request: _VirtualRecv, *, block: bool) -> bool:
        cluster, me = self.cluster, self._world_rank
        with cluster._lock:
            if not block and self._polled_at is None:
                self._polled_at = cluster.sent_to[me]
            while True:
                cluster._raise_if_failed(me)
                if self._match(request._source, request._tag) is None:
                    if not block:
                        cluster._yield(me)      # a poll: let the senders run
                        return False
                else:
                    index = self._deliverable(request._source, request._tag, block=block)
                    if index is not None:
                        break
                    if not block:
                        return False
                    continue
                cluster._wait(me, f"recv(source={request._source}, tag={request._tag}) "
                                  f"in group {self._group.name}")
            mailbox = self._group.mailboxes[self._rank]
            source, tag, data, arrival = mailbox[index]
            del mailbox[index]
            if request._buf.size != data.size or request._buf.dtype != data.dtype:
                raise ValueError(f"recv: receive buffer ({request._buf.size} x "
                                 f"{request._buf.dtype}) does not match the message "
                                 f"({data.size} x {data.dtype})")
            request._buf.reshape(-1)[...] = data.reshape(-1)
            now = cluster.clocks[me]
            if arrival > now:
                cluster.comm_seconds[me] += arrival - now
                cluster.clocks[me] = arrival
        request.source, request.tag = source, tag
        return True

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Optional[tuple]:
        self._check_peer(source, where="iprobe", wildcard=True)
        cluster = self.cluster
        with cluster._lock:
            cluster._raise_if_failed(self._world_rank)
            if self._polled_at is None:
                self._polled_at = cluster.sent_to[self._world_rank]
            if self._match(source, tag) is None:
                cluster._yield(self._world_rank)
                return None
            index = self._deliverable(source, tag, block=False)
            if index is None:
                return None
            sent_from, sent_tag, _, _ = self._group.mailboxes[self._rank][index]
        return sent_from, sent_tag

    def idle(self, seconds: float = 0.0) -> None:
        """Nothing to do until a message comes: the rank sleeps until the next message
        in its mailbox arrives on the simulated clock (after every rank still earlier
        has run), or, when every message there has already arrived (the caller
        leaves them for later), until a new one is sent to it.  It returns at once
        when a message was sent to it since the first of its polls after its last
        idle (the caller may have polled for another tag since)."""
        cluster, me = self.cluster, self._world_rank
        with cluster._lock:
            # new: sent after the first of this rank's polls since it last idled began.
            # (Its last poll is not enough: a loop that polls for one tag, then for
            # another, slept through a message of the first kind sent meanwhile at its
            # own simulated time, as if it had seen it.)
            sent_before = self._polled_at if self._polled_at is not None \
                else cluster.sent_to[me]
            self._polled_at = None
            while True:
                cluster._raise_if_failed(me)
                if cluster.sent_to[me] != sent_before:
                    return          # (the caller polls again, at this time)
                now = cluster.clocks[me]
                later = [entry[3] for entry in self._group.mailboxes[self._rank]
                         if entry[3] > now]
                if not later:
                    cluster._wait(me, f"a message (idle) in group {self._group.name}")
                    continue
                arrival = min(later)
                if cluster._runs_before(me, arrival):
                    cluster._yield(me)
                    continue
                cluster.comm_seconds[me] += arrival - now
                cluster.clocks[me] = arrival
                return
