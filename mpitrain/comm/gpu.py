"""How device (cupy) buffers reach MPI: NCCL, CUDA-aware MPI or pinned host staging.

The choice is made once, collectively, by :func:`choose_device_transport`:
NCCL when ``cupy.cuda.nccl`` works on every rank and no two ranks share a GPU,
else CUDA-aware MPI when the library says so and a small device Allreduce
proves it, else copies through reusable pinned host buffers.  Every step that
can fail on one rank is followed by an agreement of all ranks, so they all
take the same route (or all raise), and :attr:`DeviceTransport.reason` says
in one line why that route was taken.  NCCL serves the buffer collectives;
point to point calls always use an MPI path.  The GPU stream is synchronised
before any MPI call sees a device buffer (unsynchronised buffers give random
results).

cupy itself comes from :mod:`mpitrain.backend`; this module never imports it.

Example::

    choice = choose_device_transport(mpi_comm, cupy, prefer="auto")
    choice.name        # 'nccl', 'cuda-aware-mpi' or 'host-staged'
    choice.reason      # e.g. 'NCCL not used: ranks 0 and 1 share GPU 0 on host n1; ...'
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .. import backend
from .nccl_id import (ID_FORM_NAMES, NCCL_UNIQUE_ID_BYTES, forms_to_try,
                      unique_id_from_bytes, unique_id_to_bytes)

PREFERENCES = ("auto", "nccl", "cuda-aware-mpi", "host-staged")

#: "1" forces the CUDA-aware probe even when the library cannot be queried,
#: "0" skips it (staging is then used unless NCCL is available).
CUDA_AWARE_ENV = "MPITRAIN_CUDA_AWARE_MPI"

#: Seconds every rank waits for NCCL's communicator set-up before all of them
#: give NCCL up (a rank that never joins would otherwise block the others).
NCCL_INIT_TIMEOUT_ENV = "MPITRAIN_NCCL_INIT_TIMEOUT"
DEFAULT_NCCL_INIT_TIMEOUT_S = 120.0


_SAYS_YES, _SAYS_NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def cuda_aware_setting() -> tuple:
    """What MPITRAIN_CUDA_AWARE_MPI asks: ``(True, None)`` probe the device
    Allreduce, ``(None, None)`` ask the library (unset), ``(False, why)`` skip it
    (a value it cannot read is said, not taken for unset)."""
    setting = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if not setting:
        return None, None
    if setting.lower() in _SAYS_YES:
        return True, None
    if setting.lower() in _SAYS_NO:
        return False, f"disabled by {CUDA_AWARE_ENV}={setting}"
    return False, f"not tried: {CUDA_AWARE_ENV}={setting!r} is neither 1 (yes) nor 0 (no)"


# ------------------------------------------------------------------ MPI paths

class HostPath:
    """Host arrays go to MPI as they are."""

    name = "host"
    nonblocking_collectives = True

    def enter(self, buf, *, copy_in: bool):
        return buf, None

    def leave(self, buf, token, *, copy_out: bool) -> None:
        return None


class CudaAwarePath:
    """Device arrays go to MPI directly, after the stream has finished writing them.

    Point to point and blocking collectives only: Open MPI's CUDA support (4.x)
    does not take device memory in non-blocking collectives (MPI_Iallreduce),
    so those are staged through the host (``nonblocking_collectives``)."""

    name = "cuda-aware-mpi"
    nonblocking_collectives = False

    def enter(self, buf, *, copy_in: bool):
        backend.synchronize(backend.get_array_module(buf))
        return buf, None

    def leave(self, buf, token, *, copy_out: bool) -> None:
        return None


class PinnedStagingPath:
    """Device arrays are copied through pinned host buffers that are reused.

    Several buffers may be in flight at once (non-blocking calls), so the
    staging memory is a small free list rather than one buffer.
    """

    name = "host-staged"
    nonblocking_collectives = True

    def __init__(self, cupy):
        self._cupy = cupy
        self._free: list[np.ndarray] = []

    def _take(self, nbytes: int) -> np.ndarray:
        fitting = [i for i, block in enumerate(self._free) if block.nbytes >= nbytes]
        if fitting:
            # By position: list.remove would compare arrays element-wise.
            return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))
        memory = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(memory, dtype=np.uint8, count=max(nbytes, 1))

    def enter(self, buf, *, copy_in: bool):
        block = self._take(buf.nbytes)
        host = block[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
        if copy_in:
            backend.synchronize(self._cupy)
            buf.get(out=host)
            # CuPy 12's get() into page-locked memory on a stream other than the
            # legacy one (cuda_graph's) returns before the copy lands: wait for it.
            backend.synchronize(self._cupy)
        return host, block

    def leave(self, buf, token, *, copy_out: bool) -> None:
        if copy_out:
            host = token[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
            buf.set(host)
            # The block goes back to the free list: the copy must be over first.
            backend.synchronize(self._cupy)
        self._free.append(token)


HOST_PATH = HostPath()


# ------------------------------------------------------------ agreeing on failures

def _one_line(error) -> str:
    """An exception or a text as one short line, for a reason or an error message."""
    if isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    else:
        text = str(error)
    text = " ".join(text.split()) or "unknown error"
    return text if len(text) <= 200 else text[:197] + "..."


def _rank_list(ranks) -> str:
    """'rank 1', 'ranks 0 and 1', 'ranks 0, 2 and 5' (the first eight, then a count)."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} in all)"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _all_agree(mpi_comm, flag: bool) -> bool:
    value = np.array([1 if flag else 0], dtype=np.int64)
    mpi_comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
    return bool(value[0])


def _gather_bytes(mpi_comm, data: bytes) -> list[bytes]:
    """Collective: every rank's ``data`` on every rank (plain byte buffers, no pickle)."""
    size = mpi_comm.Get_size()
    mine = np.fromiter(data, dtype=np.uint8, count=len(data))
    lengths = np.empty(size, dtype=np.int64)
    mpi_comm.Allgather(np.array([len(data)], dtype=np.int64), lengths)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    received = np.empty(int(lengths.sum()), dtype=np.uint8)
    mpi_comm.Allgatherv([mine, MPI.BYTE], [received, lengths, offsets, MPI.BYTE])
    return [received[o:o + n].tobytes() for o, n in zip(offsets, lengths)]


def _failures(mpi_comm, error) -> dict[int, str]:
    """Collective: ``{rank: one-line error}`` of the ranks whose ``error`` is not None.

    The common case (nobody failed) costs one small Allreduce; the messages
    travel only when some rank failed, so every rank can give the same reason.
    """
    if _all_agree(mpi_comm, error is None):
        return {}
    # A leading flag byte tells "failed" from "fine" even for an empty message.
    mine = b"" if error is None else b"!" + _one_line(error).encode("utf-8", "replace")
    texts = _gather_bytes(mpi_comm, mine)
    return {rank: text[1:].decode("utf-8", "replace")
            for rank, text in enumerate(texts) if text}


def _describe(failures: dict[int, str], size: int, template: str) -> str:
    """One line from :func:`_failures`, e.g. ``template`` 'NCCL init failed{where}: {error}'.

    ``where`` is '' when every rank failed alike, else ' on rank 1' and so on;
    ranks that failed otherwise are named after it.
    """
    if not failures:
        return template.format(where="", error="reason unknown")
    first = min(failures)
    alike = [rank for rank in failures if failures[rank] == failures[first]]
    others = [rank for rank in failures if failures[rank] != failures[first]]
    where = "" if len(alike) == size else f" on {_rank_list(alike)}"
    text = template.format(where=where, error=failures[first])
    if others:
        text += f" ({_rank_list(others)}: {failures[min(others)]})"
    return text


# ----------------------------------------------------------------------- NCCL

def _load_nccl(cupy):
    """cupy's NCCL binding, or None when this CuPy build or machine has none."""
    return backend.nccl_module(cupy)


class NcclCollectives:
    """allreduce/bcast of device buffers with NCCL on the current stream.

    Calls block until the stream has finished them, like the MPI paths, so
    ``comm_time`` measures real communication.
    """

    name = "nccl"

    def __init__(self, nccl, nccl_comm, cupy):
        self._nccl = nccl
        self._comm = nccl_comm
        self._cupy = cupy
        self._ops = {"sum": nccl.NCCL_SUM, "mean": nccl.NCCL_SUM,
                     "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        self._dtypes = {np.dtype(np.float16): nccl.NCCL_FLOAT16,
                        np.dtype(np.float32): nccl.NCCL_FLOAT32,
                        np.dtype(np.float64): nccl.NCCL_FLOAT64,
                        np.dtype(np.int32): nccl.NCCL_INT32,
                        np.dtype(np.int64): nccl.NCCL_INT64}

    def _dtype(self, buf):
        try:
            return self._dtypes[np.dtype(buf.dtype)]
        except KeyError:
            raise ValueError(f"nccl: unsupported dtype {buf.dtype}; expected one of "
                             f"{sorted(str(d) for d in self._dtypes)}") from None

    def _launch_allreduce(self, buf, op: str):
        stream = self._cupy.cuda.get_current_stream()
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf),
                             self._ops[op], stream.ptr)
        return stream

    def allreduce_(self, buf, op: str) -> None:
        self._launch_allreduce(buf, op).synchronize()

    def iallreduce_(self, buf, op: str) -> tuple[Callable[[], bool], Callable[[], None]]:
        event = self._launch_allreduce(buf, op).record()
        return (lambda: event.done), event.synchronize

    def bcast_(self, buf, root: int) -> None:
        stream = self._cupy.cuda.get_current_stream()
        self._comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, stream.ptr)
        stream.synchronize()

    def destroy(self) -> None:
        self._comm.destroy()


def _discard(nccl_comm) -> None:
    """Release a communicator that will not be used; abort() does not wait for peers."""
    try:
        abort = getattr(nccl_comm, "abort", None)
        (abort or nccl_comm.destroy)()
    except Exception:
        try:
            nccl_comm.destroy()
        except Exception:
            pass


def _init_timeout_s() -> float:
    text = os.environ.get(NCCL_INIT_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_NCCL_INIT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{NCCL_INIT_TIMEOUT_ENV}: expected a positive number of seconds, "
                         f"got {text!r}")
    return seconds


def visible_devices_color(env=None) -> int:
    """An MPI split colour for the GPUs this process sees: equal for equal
    ``CUDA_VISIBLE_DEVICES`` (unset being one value of its own), so ranks of a
    node are numbered apart per set of visible GPUs.

    Example::

        node.Split(visible_devices_color(), key=local_rank)   # ranks seeing these GPUs
    """
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    text = "unset" if value is None else "set:" + value.replace(" ", "")
    return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


def device_identity(cupy) -> dict:
    """This rank's host, current CUDA device id and (when CuPy tells) its PCI bus id.

    Example::

        device_identity(cupy)   # {'host': 'n1', 'device': 0, 'pci': '0000:3B:00.0'}
    """
    device = cupy.cuda.Device()
    try:
        pci = device.pci_bus_id   # absent from stand-ins and old CuPy; never essential
    except Exception:
        pci = None
    return {"host": socket.gethostname(), "device": int(device.id),
            "pci": str(pci) if pci else None}


def shared_device(identities: list) -> str:
    """'ranks 0 and 1 share GPU 0 on host n1' for the first GPU used twice, else ''.

    PCI bus ids identify a GPU when every rank has one: two ranks may both see
    device 0 through different CUDA_VISIBLE_DEVICES and still use distinct GPUs.

    Example::

        shared_device([{"host": "n1", "device": 0, "pci": None}] * 2)
    """
    by_pci = all(identity.get("pci") for identity in identities)
    owners: dict = {}
    for rank, identity in enumerate(identities):
        key = (identity["host"], identity["pci"] if by_pci else identity["device"])
        owners.setdefault(key, []).append(rank)
    for (host, _), ranks in owners.items():
        if len(ranks) > 1:
            first = identities[ranks[0]]
            gpu = f"GPU {first['device']}" + (f" (PCI {first['pci']})" if by_pci else "")
            return f"{_rank_list(ranks)} share {gpu} on host {host}"
    return ""


def _communicator_in_any_form(nccl, size: int, rank: int, raw: bytes, first_form: int):
    """NcclCommunicator from the first form of the id this CuPy accepts.

    TypeError/OverflowError come from converting the id argument, before NCCL
    is called, so trying the next form cannot leave a peer half-joined.
    """
    rejected = []
    for form in forms_to_try(first_form):
        try:
            return nccl.NcclCommunicator(size, unique_id_from_bytes(raw, form), rank)
        except (TypeError, OverflowError) as exc:
            rejected.append(f"{ID_FORM_NAMES[form]}: {_one_line(exc)}")
    raise TypeError("NcclCommunicator accepted no form of the unique id ("
                    + "; ".join(rejected) + ")")


# Outcomes of one rank's NCCL init, exchanged after the wait.
_INIT_OK, _INIT_FAILED, _INIT_TIMED_OUT, _INIT_GAVE_UP = 0, 1, 2, 3
_NOTICE_TAG = 1


def _init_with_watchdog(mpi_comm, start: Callable[[], object], timeout_s: float):
    """Collective: run ``start`` (NCCL's blocking init) in a thread on every rank.

    ``(communicator, '')`` when every rank succeeded, else ``(None, reason)``
    with the communicator discarded.  NCCL init blocks until every rank has
    joined, so a rank that fails or times out first tells the others over a
    private duplicate of ``mpi_comm``; they stop waiting and all ranks then
    agree.  A thread still blocked in NCCL is left behind (it cannot be
    cancelled); it holds no MPI call.
    """
    control = mpi_comm.Dup()   # notices never meet the caller's own messages
    rank, size = control.Get_rank(), control.Get_size()
    result: dict = {}

    def run():
        try:
            result["comm"] = start()
        except BaseException as exc:   # reported to every rank, not raised in the thread
            result["error"] = exc

    worker = threading.Thread(target=run, name="mpitrain-nccl-init", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    probe_status = MPI.Status()
    notice = np.zeros(1, dtype=np.int64)
    heard_from = set()
    while True:
        worker.join(0.002)
        if not worker.is_alive():
            outcome = _INIT_OK if "comm" in result else _INIT_FAILED
            break
        if control.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=probe_status):
            control.Recv(notice, source=probe_status.Get_source(), tag=_NOTICE_TAG)
            heard_from.add(probe_status.Get_source())
            outcome = _INIT_GAVE_UP
            break
        if time.monotonic() > deadline:
            outcome = _INIT_TIMED_OUT
            break
    sends = []
    if outcome in (_INIT_FAILED, _INIT_TIMED_OUT):
        # Peers may be blocked in NCCL init waiting for this rank: tell them now.
        mine = np.array([outcome], dtype=np.int64)
        sends = [control.Isend(mine, dest=peer, tag=_NOTICE_TAG)
                 for peer in range(size) if peer != rank]
    outcomes = np.empty(size, dtype=np.int64)
    control.Allgather(np.array([outcome], dtype=np.int64), outcomes)
    # Collect every notice sent to this rank, so none is left in flight.
    for peer in range(size):
        if peer != rank and peer not in heard_from and \
                outcomes[peer] in (_INIT_FAILED, _INIT_TIMED_OUT):
            control.Recv(notice, source=peer, tag=_NOTICE_TAG)
    MPI.Request.Waitall(sends)
    if (outcomes == _INIT_OK).all():
        control.Free()
        return result["comm"], ""
    error = None
    if outcome == _INIT_FAILED:
        error = result["error"]
    elif outcome == _INIT_TIMED_OUT:
        error = f"no answer within {timeout_s:g} s"
    failures = _failures(control, error)
    control.Free()
    if "comm" in result:
        _discard(result["comm"])
    return None, _describe(failures, size, "NCCL init failed{where}: {error}")


def create_nccl(mpi_comm, cupy) -> tuple[Optional[NcclCollectives], str]:
    """Collective: ``(NCCL collectives, '')`` over ``mpi_comm``'s ranks, or ``(None, why not)``.

    Steps, each agreed by all ranks before the next: the binding loads; no
    two ranks use one GPU (NCCL refuses that); rank 0's unique id reaches
    every rank as 128 raw bytes plus its form; every rank's NcclCommunicator
    comes up within ``MPITRAIN_NCCL_INIT_TIMEOUT`` seconds.  Every rank gets
    the same answer and the same reason.

    Example::

        nccl, why_not = create_nccl(MPI.COMM_WORLD, cupy)
        if nccl is None:
            print(f"NCCL not used: {why_not}")
    """
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()

    # 1. The binding, on every rank.
    try:
        nccl, error = _load_nccl(cupy), None
        if nccl is None:
            error = "cannot be imported or reports available=False"
    except Exception as exc:
        nccl, error = None, exc
    failures = _failures(mpi_comm, error)
    if failures:
        return None, _describe(failures, size, "cupy.cuda.nccl unavailable{where}: {error}")

    # 2. One GPU per rank: NCCL refuses two ranks on one device.
    try:
        identity, error = device_identity(cupy), None
    except Exception as exc:
        identity, error = {}, exc
    failures = _failures(mpi_comm, error)
    if failures:
        return None, _describe(failures, size, "could not tell which GPU is used{where}: {error}")
    identities = [json.loads(text) for text in
                  _gather_bytes(mpi_comm, json.dumps(identity).encode("utf-8"))]
    sharing = shared_device(identities)
    if sharing:
        return None, sharing

    # 3. Rank 0's unique id as [ok, form, 128 bytes]: one uint8 Bcast, no pickle.
    message = np.zeros(2 + NCCL_UNIQUE_ID_BYTES, dtype=np.uint8)
    error = None
    if rank == 0:
        try:
            raw, form = unique_id_to_bytes(nccl.get_unique_id())
            message[0], message[1] = 1, form
            message[2:] = np.frombuffer(raw, dtype=np.uint8)
        except Exception as exc:
            error = exc
    mpi_comm.Bcast(message, root=0)
    if message[0]:
        try:
            raw, form = message[2:].tobytes(), int(message[1])
            unique_id_from_bytes(raw, form)   # a form this rank cannot build fails here
        except Exception as exc:
            error = exc
    failures = _failures(mpi_comm, error)
    if failures:
        return None, _describe(failures, size, "NCCL unique id not shared{where}: {error}")

    # 4. The communicators, each rank on its own GPU, with a watchdog.
    try:
        timeout_s, error = _init_timeout_s(), None
    except ValueError as exc:
        timeout_s, error = DEFAULT_NCCL_INIT_TIMEOUT_S, exc
    failures = _failures(mpi_comm, error)
    if failures:
        return None, _describe(failures, size, "NCCL init not attempted{where}: {error}")
    device_id = identity["device"]

    def start():
        # The init thread has its own current device: make it this rank's GPU.
        cupy.cuda.Device(device_id).use()
        return _communicator_in_any_form(nccl, size, rank, raw, form)

    nccl_comm, why_not = _init_with_watchdog(mpi_comm, start, timeout_s)
    if nccl_comm is None:
        return None, why_not
    return NcclCollectives(nccl, nccl_comm, cupy), ""


# ------------------------------------------------------------- CUDA-aware MPI

def query_cuda_support() -> Optional[bool]:
    """What the MPI library says about device pointers; None when it cannot say."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            pass
    try:
        # MPICH and Open MPI both export MPIX_Query_cuda_support from libmpi.
        function = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return bool(function())


def check_cuda_aware_mpi(mpi_comm, cupy) -> tuple[bool, str]:
    """Collective: ``(True, '')`` when every rank can Allreduce a device buffer
    correctly, else ``(False, why not)`` (the same on every rank).

    The device Allreduce is only tried when the library claims support (or
    MPITRAIN_CUDA_AWARE_MPI=1): handing a device pointer to an MPI without it
    can crash instead of raising.

    Example::

        aware, why_not = check_cuda_aware_mpi(MPI.COMM_WORLD, cupy)
    """
    size = mpi_comm.Get_size()
    claimed, error = cuda_aware_setting()
    if claimed is None:
        claimed = query_cuda_support()
        error = None if claimed else (
            "not claimed by the library" if claimed is False else
            f"support cannot be queried from the library (set {CUDA_AWARE_ENV}=1 to probe it)")
    failures = _failures(mpi_comm, error)
    if failures:
        return False, _describe(failures, size, "CUDA-aware MPI {error}{where}")

    # Every rank holds its probe buffer before any rank enters the Allreduce.
    try:
        probe, error = cupy.full(4, mpi_comm.Get_rank() + 1, dtype=cupy.float32), None
        backend.synchronize(cupy)
    except Exception as exc:
        probe, error = None, exc
    failures = _failures(mpi_comm, error)
    if failures:
        return False, _describe(failures, size,
                                "CUDA-aware MPI probe buffer failed{where}: {error}")
    try:
        mpi_comm.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM)
        expected = size * (size + 1) / 2
        got = cupy.asnumpy(probe)
        error = None if np.all(got == expected) else \
            f"device Allreduce gave {got.tolist()}, expected {expected:g}"
    except Exception as exc:
        error = exc
    failures = _failures(mpi_comm, error)
    if failures:
        return False, _describe(failures, size, "CUDA-aware MPI probe failed{where}: {error}")
    return True, ""


def probe_cuda_aware_mpi(mpi_comm, cupy) -> bool:
    """Collective: True when every rank can Allreduce a device buffer correctly.

    Example::

        if probe_cuda_aware_mpi(MPI.COMM_WORLD, cupy): ...
    """
    return check_cuda_aware_mpi(mpi_comm, cupy)[0]


# ------------------------------------------------------------------- choosing

@dataclass
class DeviceTransport:
    """The device route chosen for one communicator: ``path`` for MPI calls,
    ``nccl`` (or None) for the buffer collectives, ``reason`` in one line for logs.

    Example::

        print(f"transport {transport.name} ({transport.reason})")
    """

    path: object
    nccl: Optional[NcclCollectives] = None
    reason: str = ""

    @property
    def name(self) -> str:
        return self.nccl.name if self.nccl is not None else self.path.name

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None


class ForcedRouteError(RuntimeError):
    """A route forced by ``device_transport`` that cannot be used.

    Every rank raises it at the same point, with the same reason (the ranks
    agreed on the outcome), so the job ends without an abort and one rank
    alone says why (``agreed``); the setting is the configuration's
    (``setting``).  The command line reads both attributes, as on
    ``mpitrain.train.errors.TrainingError``.
    """

    agreed = True
    setting = True


def _forced_route_error(route: str, why_not: str) -> ForcedRouteError:
    return ForcedRouteError(f"device transport {route!r} was requested (device_transport) "
                            f"but cannot be used: {why_not}")


def choose_device_transport(mpi_comm, cupy, *, prefer: str = "auto") -> DeviceTransport:
    """Collective: pick the fastest device route every rank supports, and say why.

    Order: NCCL, then CUDA-aware MPI, then pinned host staging.  ``prefer``
    forces one route ('nccl', 'cuda-aware-mpi', 'host-staged'); a forced route
    that does not work raises RuntimeError on every rank, with the reason.

    Example::

        transport = choose_device_transport(MPI.COMM_WORLD, cupy)
        print(f"transport {transport.name} ({transport.reason})")
    """
    if prefer not in PREFERENCES:
        raise ValueError(f"device transport: expected one of {', '.join(PREFERENCES)}, "
                         f"got {prefer!r}")
    if prefer == "host-staged":
        return DeviceTransport(PinnedStagingPath(cupy),
                               reason=_with_sharing("host-staged requested by device_transport",
                                                    mpi_comm, cupy))
    nccl, nccl_why_not = None, ""
    if prefer in ("auto", "nccl"):
        nccl, nccl_why_not = create_nccl(mpi_comm, cupy)
    if prefer == "nccl" and nccl is None:
        raise _forced_route_error("nccl", nccl_why_not)
    aware, aware_why_not = check_cuda_aware_mpi(mpi_comm, cupy)
    if prefer == "cuda-aware-mpi" and not aware:
        if nccl is not None:
            nccl.destroy()
        raise _forced_route_error("cuda-aware-mpi", aware_why_not)
    path = CudaAwarePath() if aware else PinnedStagingPath(cupy)
    if nccl is not None:
        ranks = mpi_comm.Get_size()
        over = "1 rank" if ranks == 1 else f"{ranks} ranks on distinct GPUs"
        reason = f"NCCL over {over}; point to point {path.name}"
    elif prefer == "cuda-aware-mpi":
        reason = "cuda-aware-mpi requested by device_transport; probe passed"
    elif aware:
        reason = f"NCCL not used: {nccl_why_not}; CUDA-aware MPI probe passed"
    else:
        reason = f"NCCL not used: {nccl_why_not}; {aware_why_not}"
    if nccl is None:       # (NCCL itself is never set up on a shared GPU)
        reason = _with_sharing(reason, mpi_comm, cupy)
    return DeviceTransport(path, nccl, reason=reason)


def _with_sharing(reason: str, mpi_comm, cupy) -> str:
    """Collective: ``reason``, and which ranks share a GPU when some do and the
    reason does not say it yet, so that sharing never goes unmentioned."""
    try:
        identity = device_identity(cupy)
    except Exception:
        identity = None
    identities = [json.loads(text) for text in
                  _gather_bytes(mpi_comm, json.dumps(identity).encode("utf-8"))]
    if any(identity is None for identity in identities):
        return reason
    sharing = shared_device(identities)
    if not sharing or sharing in reason:
        return reason
    return f"{reason}; {sharing}"
