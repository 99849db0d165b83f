"""The communicator interface every data-parallel strategy talks to.

Methods are named after the MPI calls they wrap.  A trailing underscore means
the call works in place on one flat contiguous buffer (numpy or cupy); an
``_obj`` suffix means small JSON-able Python objects (never pickle).

Example::

    comm = create_communicator()             # from mpitrain.comm
    comm.allreduce_(net.flat_params, op="mean")
    steps = comm.allreduce_scalar(local_steps, op="min")
"""

from __future__ import annotations

import json
import numbers
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Optional

import numpy as np

from .. import backend

#: Reduction names accepted by the buffer and scalar reductions.
REDUCE_OPS = ("mean", "sum", "max", "min")

#: Wildcards for ``recv``/``irecv``/``probe`` (translated to MPI's own values).
ANY_SOURCE = -1
ANY_TAG = -1
#: Seconds a polling loop sleeps when nothing came (:meth:`Communicator.idle`).
IDLE_SECONDS = 0.0002

#: Device transports named by ``Communicator.transport``; "local": device
#: buffers on a single rank, which never leave the GPU.
TRANSPORTS = ("host", "local", "nccl", "cuda-aware-mpi", "host-staged")


def check_op(op: str, *, where: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"{where}: op must be one of {', '.join(map(repr, REDUCE_OPS))}, "
                         f"got {op!r}")
    return op


def check_buffer(buf, *, where: str, writable: bool = True) -> None:
    """Reject what MPI would misread: non-contiguous views, read-only arrays, mean on ints."""
    flags = getattr(buf, "flags", None)
    if flags is None or not hasattr(buf, "dtype"):
        raise TypeError(f"{where}: expected a numpy or cupy array, got {type(buf).__name__}")
    if not flags.c_contiguous:
        raise ValueError(f"{where}: buffer must be C-contiguous (one flat buffer, "
                         f"not a strided view); got shape {tuple(buf.shape)}")
    # cupy arrays have no writeable flag; numpy's is meaningful.
    if writable and getattr(flags, "writeable", True) is False:
        raise ValueError(f"{where}: buffer is read-only; an in-place operation needs "
                         f"a writable array")


def check_mean_dtype(buf, op: str, *, where: str) -> None:
    if op == "mean" and buf.dtype.kind not in "fc":
        raise ValueError(f"{where}: op='mean' needs a floating-point buffer, "
                         f"got dtype {buf.dtype}")


def scalar_dtype(value, *, where: str):
    """int64 for integers (bools included), float64 for other real numbers."""
    if isinstance(value, numbers.Integral):
        return np.int64
    if isinstance(value, numbers.Real):
        return np.float64
    raise TypeError(f"{where}: expected an int or float, got {type(value).__name__}")


def scalar_result(reduced, value, op: str):
    """Give a reduced scalar the caller's type back: int stays int, 'mean' is float."""
    if op == "mean" or not isinstance(value, numbers.Integral):
        return float(reduced)
    return int(reduced)


def scale_(buf, factor: float) -> None:
    """In-place multiply that keeps the buffer's dtype (numpy and cupy alike)."""
    buf *= buf.dtype.type(factor)


# ---------------------------------------------------------------- JSON objects

def _json_default(obj):
    # numpy scalars and small arrays turn up in metrics; send them as plain values.
    if isinstance(obj, np.generic):
        return obj.item()
    # A device array is refused by its device, not by its type: CuPy's is no
    # numpy.ndarray, but a CPU stand-in's may be one, and would be read here unseen.
    if isinstance(obj, np.ndarray) and not backend.is_gpu_array(obj):
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} cannot be sent between ranks "
                    f"(only JSON-able values: dict, list, str, int, float, bool, None)")


def encode_obj(obj: Any) -> np.ndarray:
    """JSON-encode ``obj`` to a uint8 array (the wire format of the ``*_obj`` calls).

    Example::

        decode_obj(encode_obj({"loss": 1.5}))   # {'loss': 1.5}
    """
    data = json.dumps(obj, default=_json_default, separators=(",", ":")).encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode_obj(data) -> Any:
    """Inverse of :func:`encode_obj`; tuples come back as lists, dict keys as str."""
    return json.loads(np.asarray(data, dtype=np.uint8).tobytes().decode("utf-8"))


def json_copy(obj: Any) -> Any:
    """What a receiving rank would see: the same value after a JSON round trip."""
    return decode_obj(encode_obj(obj))


class PeerLost(RuntimeError):
    """A message to or from ``peer`` failed inside MPI: that rank ended (killed,
    its node lost) or the link to it broke mid-message.

    Example::

        raise PeerLost("comm: rank 2 is gone ...", peer=2)
    """

    def __init__(self, message: str, *, peer: int):
        super().__init__(message)
        self.peer = peer


# --------------------------------------------------------------------- requests

class Request(ABC):
    """Handle of a non-blocking operation.

    ``wait()`` blocks until it is done, ``test()`` polls (and completes it
    when done).  After completion ``source`` and ``tag`` say what was received.

    Example::

        req = comm.iallreduce_(grads, op="mean")
        ...                       # compute while the reduction runs
        req.wait()
    """

    source: Optional[int] = None
    tag: Optional[int] = None

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation has finished."""

    @abstractmethod
    def test(self) -> bool:
        """True when finished; never blocks."""

    @property
    def done(self) -> bool:
        return self.test()


class CompletedRequest(Request):
    """A request that finished when it was created (size-1 and local cases).

    Example::

        req = CompletedRequest(source=0, tag=0)
        req.test()    # True
    """

    def __init__(self, *, source: Optional[int] = None, tag: Optional[int] = None):
        self.source = source
        self.tag = tag

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class CallbackRequest(Request):
    """A request built from a poll and a blocking wait, with a completion step.

    ``on_complete`` runs exactly once, after the transfer finished (e.g. scale
    by 1/size for a mean, or copy a staging buffer back to the device).
    Time spent in ``wait``/``test`` counts as communication time.

    Example::

        req = CallbackRequest(test_fn=mpi_req.Test, wait_fn=mpi_req.Wait,
                              on_complete=lambda: scale_(buf, 0.5), comm=comm)
    """

    def __init__(self, *, test_fn: Callable[[], bool], wait_fn: Callable[[], Any],
                 on_complete: Optional[Callable[[], None]] = None,
                 comm: Optional["Communicator"] = None, status=None):
        self._test_fn = test_fn
        self._wait_fn = wait_fn
        self._on_complete = on_complete
        self._comm = comm
        self._status = status    # filled by the transfer; has Get_source()/Get_tag()
        self._finished = False

    def _finish(self) -> None:
        self._finished = True
        if self._status is not None:
            self.source, self.tag = self._status.Get_source(), self._status.Get_tag()
        if self._on_complete is not None:
            callback, self._on_complete = self._on_complete, None
            callback()

    def wait(self) -> None:
        if self._finished:
            return
        start = time.perf_counter()
        try:
            self._wait_fn()
            self._finish()
        finally:
            self._add_time(start)

    def test(self) -> bool:
        if self._finished:
            return True
        start = time.perf_counter()
        try:
            if self._test_fn():
                self._finish()
        finally:
            self._add_time(start)
        return self._finished

    def _add_time(self, start: float) -> None:
        if self._comm is not None:
            self._comm._comm_time += time.perf_counter() - start


# ----------------------------------------------------------------- communicator

class Communicator(ABC):
    """A group of ranks and the operations data-parallel training needs.

    Buffer calls (``allreduce_``, ``bcast_``, ``sendrecv``, ``isend``,
    ``irecv``, ``iallreduce_``) take one C-contiguous numpy or cupy array and
    work in place.  Every collective must be called by all ranks of the
    group, in the same order, or the job hangs.

    Example::

        comm = create_communicator()
        comm.bcast_(net.flat_params, root=0)           # identical start
        comm.allreduce_(net.flat_params, op="mean")    # model averaging
        if comm.rank == 0:
            print(f"communication: {comm.comm_time:.2f} s on {comm.transport}")
    """

    #: Short name for logs: "mpi", "single".
    name: str = "abstract"

    def __init__(self) -> None:
        self._comm_time = 0.0

    # ---- identity
    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """Rank among the processes on this node (picks the GPU)."""

    @property
    @abstractmethod
    def local_size(self) -> int: ...

    @property
    def device_rank(self) -> int:
        """Rank among the processes on this node that see the same GPUs (the same
        ``CUDA_VISIBLE_DEVICES``); :func:`mpitrain.backend.select` takes GPU
        ``device_rank mod visible GPUs``, so ranks that see different GPUs
        (``srun --gpu-bind=closest``) do not pick the same one."""
        return self.local_rank

    @property
    def thread_multiple(self) -> bool:
        """True when several threads may call into this communicator at once."""
        return True

    @property
    def transport(self) -> str:
        """How device buffers travel: 'host', 'local', 'nccl', 'cuda-aware-mpi' or 'host-staged'."""
        return "host"

    @property
    def transport_reason(self) -> str:
        """Why :attr:`transport` was chosen, in one line ('' when there was no choice).

        Example::

            print(f"transport {comm.transport} ({comm.transport_reason})")
        """
        return ""

    def setup_device_transport(self, xp, *, prefer: Optional[str] = None) -> str:
        """Collective: choose how ``xp``'s buffers travel; returns :attr:`transport`.

        ``prefer`` overrides the communicator's ``device_transport`` setting.
        Here (no device routes) it only returns the transport.

        Example::

            name = comm.setup_device_transport(xp)
        """
        return self.transport

    # ---- timing
    @property
    def comm_time(self) -> float:
        """Seconds spent inside communication calls since :meth:`reset_comm_time`."""
        return self._comm_time

    def reset_comm_time(self) -> None:
        self._comm_time = 0.0

    @contextmanager
    def _timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._comm_time += time.perf_counter() - start

    @abstractmethod
    def wtime(self) -> float:
        """Seconds on a monotonic clock (durations only: the system clock may step;
        a virtual rank's clock is simulated)."""

    # ---- buffer collectives
    @abstractmethod
    def allreduce_(self, buf, op: str = "mean"):
        """Reduce ``buf`` over all ranks in place and return it.

        ``op`` is 'mean', 'sum', 'max' or 'min'; 'mean' is a sum scaled by 1/size.
        """

    @abstractmethod
    def iallreduce_(self, buf, op: str = "mean") -> Request:
        """Start an in-place reduction; ``buf`` holds the result after ``wait()``."""

    @abstractmethod
    def bcast_(self, buf, root: int = 0):
        """Copy ``root``'s buffer into every rank's ``buf`` and return it."""

    # ---- point to point
    @abstractmethod
    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Send ``sendbuf`` to ``dest`` while receiving into ``recvbuf`` from ``source``."""

    @abstractmethod
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""

    @abstractmethod
    def recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple:
        """Blocking receive into ``buf``; returns ``(source, tag)`` of the message."""

    @abstractmethod
    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf``; do not modify it before the request is done."""

    @abstractmethod
    def irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving into ``buf``; ``request.source`` is set on completion."""

    @abstractmethod
    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Optional[tuple]:
        """``(source, tag)`` of a pending message, or None when none is waiting."""

    def idle(self, seconds: float = IDLE_SECONDS) -> None:
        """Nothing to do until a message comes (a polling loop's pause): here a sleep
        of ``seconds`` that leaves a shared core to the other ranks; on virtual
        ranks, until the next message for this rank arrives on the simulated clock
        (a loop that polls without calling this would spin there forever)."""
        time.sleep(seconds)

    def waitall(self, requests: Iterable[Request]) -> None:
        """Wait for every request (in order; each completion step runs once)."""
        for request in requests:
            request.wait()

    # ---- small host values
    @abstractmethod
    def allreduce_scalar(self, value, op: str = "sum"):
        """Reduce one number over the ranks; int in, int out; float in, float out.

        'mean' always returns a float.
        """

    @abstractmethod
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Root's JSON-able ``obj`` on every rank."""

    @abstractmethod
    def allgather_obj(self, obj: Any) -> list:
        """List of every rank's JSON-able ``obj``, indexed by rank."""

    @abstractmethod
    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list]:
        """List of every rank's ``obj`` on ``root``; None elsewhere."""

    # ---- groups and control
    @abstractmethod
    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Sub-communicator of the ranks sharing ``color`` (ordered by ``key``).

        A rank passing ``color=None`` takes part in the call but gets None.
        """

    @abstractmethod
    def dup(self) -> "Communicator":
        """A separate communicator over the same ranks (e.g. for a comm thread)."""

    def free(self) -> None:
        """Release resources of a split/dup communicator; the world one stays."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def abort(self, code: int = 1, message: str = "") -> None:
        """End the whole job now with exit status ``code``, printing ``message``."""

    # ---- helpers for subclasses
    def _check_peer(self, peer: int, *, where: str, wildcard: bool = False) -> None:
        if wildcard and peer == ANY_SOURCE:
            return
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"{where}: rank must be in [0, {self.size}), got {peer!r}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
                f"transport={self.transport!r})")
