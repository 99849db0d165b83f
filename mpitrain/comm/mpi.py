"""The MPI communicator (mpi4py, uppercase buffer calls only).

Importing this module initialises MPI; :func:`mpitrain.comm.create_communicator`
imports it only when the process was started by an MPI launcher.

Host (numpy) buffers go straight to MPI.  Device (cupy) buffers take the
route chosen once per communicator by :mod:`mpitrain.comm.gpu`; the choice is
collective and happens at the first device collective, or earlier through
:meth:`MpiCommunicator.setup_device_transport`.

Example::

    comm = MpiCommunicator()                      # COMM_WORLD
    comm.allreduce_(flat_params, op="mean")       # Allreduce(IN_PLACE) + scale
    half = comm.split(color=comm.rank % 2)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from .. import backend
from . import gpu
from .base import (ANY_SOURCE, ANY_TAG, CallbackRequest, Communicator, PeerLost, Request,
                   check_buffer, check_mean_dtype, check_op, decode_obj, encode_obj,
                   scalar_dtype, scalar_result, scale_)

_MPI_OPS = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _source(source: int) -> int:
    return MPI.ANY_SOURCE if source == ANY_SOURCE else int(source)


def _tag(tag: int) -> int:
    return MPI.ANY_TAG if tag == ANY_TAG else int(tag)


def _encode_or_flag(obj: Any):
    """(bytes, None) or (empty, error): a rank that cannot encode tells the others
    with length -1 so that every rank raises instead of some hanging."""
    try:
        return encode_obj(obj), None
    except (TypeError, ValueError) as exc:
        return np.zeros(0, dtype=np.uint8), exc


#: Error classes of a call that was itself wrong (a bug here), or of this rank's
#: own memory, not of its peer.
_CALL_ERRORS = (MPI.ERR_BUFFER, MPI.ERR_COUNT, MPI.ERR_TYPE, MPI.ERR_TAG, MPI.ERR_RANK,
                MPI.ERR_TRUNCATE, MPI.ERR_ARG, MPI.ERR_COMM, MPI.ERR_REQUEST, MPI.ERR_NO_MEM)


def _naming_the_peer(call, rank: int, peer: int, doing: str):
    """``call`` whose MPI error names ``peer``, as :class:`PeerLost`: a killed rank
    showed on the others as MPI's own error stack ("Other MPI error ... MPI_Recv_c
    ... process_vm_readv failed"), naming no rank in words."""
    def named(*args):
        try:
            return call(*args)
        except MPI.Exception as exc:
            if peer == ANY_SOURCE or exc.Get_error_class() in _CALL_ERRORS:
                raise
            said = MPI.Get_error_string(exc.Get_error_class())
            raise PeerLost(f"comm: rank {peer} is gone (ended, killed or its node lost) or "
                           f"the link to it broke while rank {rank} {doing} it (MPI: {said})",
                           peer=peer) from None
    return named


# Large host buffers are reduced in pieces of this size (see _allreduce_host_).
HOST_PIECE_BYTES = 4 << 20
#: Seconds between a rank's last words and its abort (see :meth:`MpiCommunicator.abort`).
ABORT_FLUSH_S = 0.5


class MpiCommunicator(Communicator):
    """Communicator over an mpi4py communicator (COMM_WORLD by default).

    Construction is collective over ``mpi_comm`` (it asks which ranks share
    a node).  ``device_transport`` is 'auto', 'nccl', 'cuda-aware-mpi' or
    'host-staged' and only matters for cupy buffers.

    Example::

        comm = MpiCommunicator()
        total = comm.allreduce_scalar(local_frames, op="sum")
        comm.bcast_(flat_params, root=0)
    """

    name = "mpi"

    def __init__(self, mpi_comm=None, *, device_transport: str = "auto",
                 _owns_comm: bool = False):
        super().__init__()
        if device_transport not in gpu.PREFERENCES:
            raise ValueError(f"MpiCommunicator: device_transport must be one of "
                             f"{', '.join(gpu.PREFERENCES)}, got {device_transport!r}")
        comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise ValueError(f"MpiCommunicator: mpi_comm must be a valid mpi4py "
                             f"communicator, got {comm!r}")
        self._comm = comm
        self._owns_comm = _owns_comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self._local_rank, self._local_size = node.Get_rank(), node.Get_size()
        # Ranks of the node that see the same GPUs count apart from those that see
        # others: with per-rank CUDA_VISIBLE_DEVICES lists (srun --gpu-bind=closest
        # with tasks alternating sockets) the node's local rank mod the count of
        # visible GPUs would put two ranks on one GPU and leave others idle.
        peers = node.Split(gpu.visible_devices_color(), key=self._local_rank)
        self._device_rank = peers.Get_rank()
        peers.Free()
        node.Free()
        self._prefer = device_transport
        self._device: Optional[gpu.DeviceTransport] = None
        # staging for device p2p before any collective chose a route, and for
        # non-blocking collectives that CUDA-aware MPI does not take
        self._staging = None

    # ---- identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_size(self) -> int:
        return self._local_size

    @property
    def device_rank(self) -> int:
        return self._device_rank

    @property
    def mpi_comm(self):
        """The wrapped mpi4py communicator (for code inside mpitrain.comm)."""
        return self._comm

    @property
    def transport(self) -> str:
        return self._device.name if self._device is not None else "host"

    @property
    def transport_reason(self) -> str:
        """Why :attr:`transport` was chosen, in one line; '' before a device route exists."""
        return self._device.reason if self._device is not None else ""

    @property
    def thread_multiple(self) -> bool:
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def wtime(self) -> float:
        # the monotonic clock: MPICH's MPI_Wtime follows the system clock, and a step
        # of it (NTP, an administrator's date) would move every duration measured
        # (checkpoint_minutes, the stop poll, rates and ETAs)
        return time.perf_counter()

    # ---- device routes
    def setup_device_transport(self, xp, *, prefer: Optional[str] = None) -> str:
        """Collective: choose how ``xp``'s (cupy) buffers travel; returns the route name.

        For numpy this is a no-op returning 'host'.  Call it once after the
        GPU was selected so the log can name the route, and
        :attr:`transport_reason` why, before training.  A route forced by
        ``device_transport`` that cannot work raises RuntimeError on every rank.

        Example::

            xp = backend.select("gpu", local_rank=comm.device_rank)
            name = comm.setup_device_transport(xp)
            log(f"transport {name} ({comm.transport_reason})")
        """
        if xp is np:
            return "host"
        prefer = self._prefer if prefer is None else prefer
        if self._device is not None:
            self._device.close()
            self._device = None
        self._device = gpu.choose_device_transport(self._comm, xp, prefer=prefer)
        return self._device.name

    def _route(self, buf, *, collective: bool):
        """(MPI path, NCCL collectives or None) for ``buf``."""
        if not backend.is_gpu_array(buf):
            return gpu.HOST_PATH, None
        if self._device is None:
            if collective:
                self.setup_device_transport(backend.get_array_module(buf))
            else:
                # Point to point needs no agreement between ranks: staging always works.
                return self._host_staging(buf), None
        return self._device.path, self._device.nccl

    def _host_staging(self, buf):
        """The pinned host staging path for ``buf``'s device (made once)."""
        if self._staging is None:
            self._staging = gpu.PinnedStagingPath(backend.get_array_module(buf))
        return self._staging

    # ---- buffer collectives
    def allreduce_(self, buf, op: str = "mean"):
        check_op(op, where="allreduce_")
        check_buffer(buf, where="allreduce_")
        check_mean_dtype(buf, op, where="allreduce_")
        start = time.perf_counter()
        if type(buf) is np.ndarray:
            # The hot path of model averaging: straight to MPI, in cache-sized
            # pieces when the buffer is large (see _allreduce_host_).
            self._allreduce_host_(buf, op)
            self._comm_time += time.perf_counter() - start
            return buf
        else:
            path, nccl = self._route(buf, collective=True)
            if nccl is not None:
                nccl.allreduce_(buf, op)
            else:
                staged, token = path.enter(buf, copy_in=True)
                self._comm.Allreduce(MPI.IN_PLACE, staged, op=_MPI_OPS[op])
                path.leave(buf, token, copy_out=True)
        self._comm_time += time.perf_counter() - start
        if op == "mean" and self._size > 1:
            scale_(buf, 1.0 / self._size)
        return buf

    def _allreduce_host_(self, buf: np.ndarray, op: str) -> None:
        """In-place Allreduce of a host buffer; "mean" scales each piece while hot.

        A large buffer goes in pieces of ``HOST_PIECE_BYTES``: each piece's
        reduction and its 1/size scaling then stay in the last-level cache.
        Measured with MPICH on 2 ranks (docs/benchmarks.md), 4 MB pieces made a
        whole "mean" as fast as one bare Allreduce of the buffer, where a
        separate scaling pass added 15-35%.
        """
        mpi_op = _MPI_OPS[op]
        flat = buf.reshape(-1)
        piece = max(1, HOST_PIECE_BYTES // flat.itemsize)
        factor = flat.dtype.type(1.0 / self._size) if op == "mean" and self._size > 1 else None
        if flat.size <= 2 * piece:
            self._comm.Allreduce(MPI.IN_PLACE, flat, op=mpi_op)
            if factor is not None:
                flat *= factor
            return
        for lo in range(0, flat.size, piece):
            part = flat[lo:lo + piece]
            self._comm.Allreduce(MPI.IN_PLACE, part, op=mpi_op)
            if factor is not None:
                part *= factor

    def iallreduce_(self, buf, op: str = "mean") -> Request:
        check_op(op, where="iallreduce_")
        check_buffer(buf, where="iallreduce_")
        check_mean_dtype(buf, op, where="iallreduce_")
        size = self._size
        with self._timed():
            path, nccl = self._route(buf, collective=True)
            if nccl is None and not path.nonblocking_collectives:
                path = self._host_staging(buf)
            if nccl is not None:
                test_fn, wait_fn = nccl.iallreduce_(buf, op)
                token = None
            else:
                staged, token = path.enter(buf, copy_in=True)
                mpi_request = self._comm.Iallreduce(MPI.IN_PLACE, staged, op=_MPI_OPS[op])
                test_fn, wait_fn = mpi_request.Test, mpi_request.Wait

        def finish():
            if nccl is None:
                path.leave(buf, token, copy_out=True)
            if op == "mean" and size > 1:
                scale_(buf, 1.0 / size)

        return CallbackRequest(test_fn=test_fn, wait_fn=wait_fn, on_complete=finish, comm=self)

    def bcast_(self, buf, root: int = 0):
        self._check_peer(root, where="bcast_")
        check_buffer(buf, where="bcast_")
        is_root = self._rank == root
        with self._timed():
            path, nccl = self._route(buf, collective=True)
            if nccl is not None:
                nccl.bcast_(buf, root)
            else:
                staged, token = path.enter(buf, copy_in=is_root)
                self._comm.Bcast(staged, root=root)
                path.leave(buf, token, copy_out=not is_root)
        return buf

    # ---- point to point
    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        self._check_peer(dest, where="sendrecv")
        self._check_peer(source, where="sendrecv", wildcard=True)
        check_buffer(sendbuf, where="sendrecv", writable=False)
        check_buffer(recvbuf, where="sendrecv")
        with self._timed():
            send_path, _ = self._route(sendbuf, collective=False)
            recv_path, _ = self._route(recvbuf, collective=False)
            send_staged, send_token = send_path.enter(sendbuf, copy_in=True)
            recv_staged, recv_token = recv_path.enter(recvbuf, copy_in=False)
            self._comm.Sendrecv(send_staged, dest=dest, sendtag=int(tag),
                                recvbuf=recv_staged, source=_source(source), recvtag=int(tag))
            send_path.leave(sendbuf, send_token, copy_out=False)
            recv_path.leave(recvbuf, recv_token, copy_out=True)
        return recvbuf

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self._check_peer(dest, where="send")
        check_buffer(buf, where="send", writable=False)
        with self._timed():
            path, _ = self._route(buf, collective=False)
            staged, token = path.enter(buf, copy_in=True)
            _naming_the_peer(self._comm.Send, self._rank, dest, "sent to")(
                staged, dest, int(tag))
            path.leave(buf, token, copy_out=False)

    def recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple:
        self._check_peer(source, where="recv", wildcard=True)
        check_buffer(buf, where="recv")
        status = MPI.Status()
        with self._timed():
            path, _ = self._route(buf, collective=False)
            staged, token = path.enter(buf, copy_in=False)
            _naming_the_peer(self._comm.Recv, self._rank, source, "received from")(
                staged, _source(source), _tag(tag), status)
            path.leave(buf, token, copy_out=True)
        return status.Get_source(), status.Get_tag()

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        self._check_peer(dest, where="isend")
        check_buffer(buf, where="isend", writable=False)
        with self._timed():
            path, _ = self._route(buf, collective=False)
            staged, token = path.enter(buf, copy_in=True)
            mpi_request = self._comm.Isend(staged, dest=dest, tag=int(tag))
        return CallbackRequest(test_fn=_naming_the_peer(mpi_request.Test, self._rank, dest,
                                                        "sent to"),
                               wait_fn=_naming_the_peer(mpi_request.Wait, self._rank, dest,
                                                        "sent to"),
                               on_complete=lambda: path.leave(buf, token, copy_out=False),
                               comm=self)

    def irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        self._check_peer(source, where="irecv", wildcard=True)
        check_buffer(buf, where="irecv")
        status = MPI.Status()
        with self._timed():
            path, _ = self._route(buf, collective=False)
            staged, token = path.enter(buf, copy_in=False)
            mpi_request = self._comm.Irecv(staged, source=_source(source), tag=_tag(tag))
        return CallbackRequest(test_fn=_naming_the_peer(lambda: mpi_request.Test(status),
                                                        self._rank, source, "received from"),
                               wait_fn=_naming_the_peer(lambda: mpi_request.Wait(status),
                                                        self._rank, source, "received from"),
                               on_complete=lambda: path.leave(buf, token, copy_out=True),
                               comm=self, status=status)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Optional[tuple]:
        self._check_peer(source, where="iprobe", wildcard=True)
        status = MPI.Status()
        with self._timed():
            found = self._comm.Iprobe(source=_source(source), tag=_tag(tag), status=status)
        return (status.Get_source(), status.Get_tag()) if found else None

    # ---- small host values
    def allreduce_scalar(self, value, op: str = "sum"):
        check_op(op, where="allreduce_scalar")
        cell = np.array([value], dtype=scalar_dtype(value, where="allreduce_scalar"))
        with self._timed():
            self._comm.Allreduce(MPI.IN_PLACE, cell, op=_MPI_OPS[op])
        reduced = cell[0] / self._size if op == "mean" else cell[0]
        return scalar_result(reduced, value, op)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root, where="bcast_obj")
        error = None
        length = np.zeros(1, dtype=np.int64)
        if self._rank == root:
            data, error = _encode_or_flag(obj)
            length[0] = -1 if error is not None else data.size
        with self._timed():
            self._comm.Bcast(length, root=root)
            if length[0] < 0:
                raise ValueError(f"bcast_obj: rank {root} could not encode its object: "
                                 f"{error or 'see that rank'}")
            if self._rank != root:
                data = np.empty(int(length[0]), dtype=np.uint8)
            self._comm.Bcast([data, MPI.BYTE], root=root)
        return decode_obj(data)

    def _gather_lengths(self, data, error, *, where: str) -> np.ndarray:
        lengths = np.empty(self._size, dtype=np.int64)
        mine = np.array([-1 if error is not None else data.size], dtype=np.int64)
        self._comm.Allgather(mine, lengths)
        failed = [rank for rank in range(self._size) if lengths[rank] < 0]
        if failed:
            raise ValueError(f"{where}: rank(s) {failed} could not encode their object: "
                             f"{error or 'see those ranks'}")
        return lengths

    def allgather_obj(self, obj: Any) -> list:
        data, error = _encode_or_flag(obj)
        with self._timed():
            lengths = self._gather_lengths(data, error, where="allgather_obj")
            offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            received = np.empty(int(lengths.sum()), dtype=np.uint8)
            self._comm.Allgatherv([data, MPI.BYTE], [received, lengths, offsets, MPI.BYTE])
        return [decode_obj(received[o:o + n]) for o, n in zip(offsets, lengths)]

    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list]:
        self._check_peer(root, where="gather_obj")
        data, error = _encode_or_flag(obj)
        with self._timed():
            # Lengths go to every rank so an encoding failure stops all of them alike.
            lengths = self._gather_lengths(data, error, where="gather_obj")
            offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            if self._rank == root:
                received = np.empty(int(lengths.sum()), dtype=np.uint8)
                self._comm.Gatherv([data, MPI.BYTE], [received, lengths, offsets, MPI.BYTE],
                                   root=root)
            else:
                self._comm.Gatherv([data, MPI.BYTE], None, root=root)
        if self._rank != root:
            return None
        return [decode_obj(received[o:o + n]) for o, n in zip(offsets, lengths)]

    # ---- groups and control
    def split(self, color: Optional[int], key: int = 0) -> Optional["MpiCommunicator"]:
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split: color must be a non-negative int or None, got {color!r}")
        mpi_color = MPI.UNDEFINED if color is None else int(color)
        with self._timed():
            new_comm = self._comm.Split(mpi_color, int(key))
        if new_comm == MPI.COMM_NULL:
            return None
        return MpiCommunicator(new_comm, device_transport=self._prefer, _owns_comm=True)

    def dup(self) -> "MpiCommunicator":
        return MpiCommunicator(self._comm.Dup(), device_transport=self._prefer,
                               _owns_comm=True)

    def free(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._owns_comm and self._comm != MPI.COMM_NULL:
            self._comm.Free()
            self._owns_comm = False

    def barrier(self) -> None:
        with self._timed():
            self._comm.Barrier()

    def abort(self, code: int = 1, message: str = "") -> None:
        if message:
            sys.stderr.write(f"[rank {self._rank}/{self._size}] {message}\n")
        if sys.stdout is not None:      # (None: started with it closed)
            sys.stdout.flush()
        sys.stderr.flush()
        # The launcher forwards a rank's output through its own processes, and an
        # abort ends them: without a pause the lines just written (a traceback,
        # the reason) were sometimes lost on a loaded machine.
        time.sleep(ABORT_FLUSH_S)
        # COMM_WORLD, not the wrapped group: the whole job must end.
        MPI.COMM_WORLD.Abort(int(code))
        # MPI_Abort may return in the rank that called it before the launcher ends
        # the job (MPICH): that rank must not run on (a second report, exit 0)
        os._exit(int(code))


def abort_world(code: int) -> None:
    """MPI_Abort of the whole job from a rank that holds no communicator (MPI
    started by importing this module, if it had not been)."""
    if sys.stdout is not None:      # (None: started with it closed)
        sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_FLUSH_S)       # (see MpiCommunicator.abort)
    MPI.COMM_WORLD.Abort(int(code))
    os._exit(int(code))             # (see MpiCommunicator.abort)


def bare_allreduce_sum_(comm: MpiCommunicator, buf):
    """The bare mpi4py call ``Allreduce(IN_PLACE, buf, SUM)`` with no checks or timing.

    The baseline that benchmarks compare :meth:`MpiCommunicator.allreduce_` with.

    Example::

        bare_allreduce_sum_(comm, numpy.ones(1 << 20, dtype=numpy.float32))
    """
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf
