"""A communicator of one rank that never touches MPI.

Lets ``python -m mpitrain train`` run without a launcher and lets unit tests
exercise every strategy in one process: reductions over one rank are the
identity, messages to self are copies.

Example::

    comm = SingleCommunicator()
    buf = numpy.ones(4, dtype=numpy.float32)
    comm.allreduce_(buf, op="mean")     # unchanged
    comm.split(color=3) is comm         # True
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any, Optional

import numpy as np

from .base import (ANY_SOURCE, ANY_TAG, CompletedRequest, Communicator, Request,
                   check_buffer, check_mean_dtype, check_op, json_copy, scalar_dtype,
                   scalar_result)


def _copy_into(dst, src, *, where: str) -> None:
    if dst.size != src.size or dst.dtype != src.dtype:
        raise ValueError(f"{where}: receive buffer ({dst.size} x {dst.dtype}) does not "
                         f"match the message ({src.size} x {src.dtype})")
    dst.reshape(-1)[...] = src.reshape(-1)


class _PendingRecv(Request):
    """A receive posted before its matching send to self."""

    def __init__(self, buf, tag: int):
        self.buf = buf
        self.wanted_tag = tag
        self._done = False

    def deliver(self, data, tag: int) -> None:
        _copy_into(self.buf, data, where="irecv")
        self.source, self.tag, self._done = 0, tag, True

    def test(self) -> bool:
        return self._done

    def wait(self) -> None:
        if not self._done:
            raise RuntimeError("irecv: waiting for a message to self that was never sent "
                               "(this would hang under MPI)")


class SingleCommunicator(Communicator):
    """Size 1, rank 0, no MPI.

    Example::

        comm = SingleCommunicator()
        comm.allgather_obj({"frames": 10})   # [{'frames': 10}]
    """

    name = "single"

    def __init__(self) -> None:
        super().__init__()
        self._outbox: deque = deque()      # (tag, copy of data) sent to self
        self._pending: deque = deque()     # receives posted before their send
        self._transport = "host"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def local_size(self) -> int:
        return 1

    @property
    def transport(self) -> str:
        return self._transport

    @property
    def transport_reason(self) -> str:
        return ""

    def setup_device_transport(self, xp, *, prefer: Optional[str] = None) -> str:
        """'host' for numpy, 'local' for a device module: one rank sends nothing anywhere.

        ``prefer`` (a ``device_transport`` value) does not matter for one rank.

        Example::

            SingleCommunicator().setup_device_transport(numpy)   # 'host'
        """
        self._transport = "host" if xp is np else "local"
        return self._transport

    def wtime(self) -> float:
        return time.perf_counter()

    # ---- collectives over one rank
    def allreduce_(self, buf, op: str = "mean"):
        check_op(op, where="allreduce_")
        check_buffer(buf, where="allreduce_")
        check_mean_dtype(buf, op, where="allreduce_")
        return buf

    def iallreduce_(self, buf, op: str = "mean") -> Request:
        self.allreduce_(buf, op)
        return CompletedRequest()

    def bcast_(self, buf, root: int = 0):
        self._check_peer(root, where="bcast_")
        check_buffer(buf, where="bcast_")
        return buf

    def allreduce_scalar(self, value, op: str = "sum"):
        check_op(op, where="allreduce_scalar")
        scalar_dtype(value, where="allreduce_scalar")
        return scalar_result(value, value, op)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root, where="bcast_obj")
        return json_copy(obj)

    def allgather_obj(self, obj: Any) -> list:
        return [json_copy(obj)]

    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list]:
        self._check_peer(root, where="gather_obj")
        return [json_copy(obj)]

    # ---- messages to self
    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        self._check_peer(dest, where="sendrecv")
        self._check_peer(source, where="sendrecv", wildcard=True)
        check_buffer(sendbuf, where="sendrecv", writable=False)
        check_buffer(recvbuf, where="sendrecv")
        _copy_into(recvbuf, sendbuf, where="sendrecv")
        return recvbuf

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.isend(buf, dest, tag)

    def recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple:
        request = self.irecv(buf, source, tag)
        request.wait()
        return request.source, request.tag

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        self._check_peer(dest, where="isend")
        check_buffer(buf, where="isend", writable=False)
        for pending in self._pending:
            if pending.wanted_tag in (ANY_TAG, tag):
                self._pending.remove(pending)
                pending.deliver(buf, tag)
                return CompletedRequest()
        self._outbox.append((tag, buf.copy()))
        return CompletedRequest()

    def irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        self._check_peer(source, where="irecv", wildcard=True)
        check_buffer(buf, where="irecv")
        for item in self._outbox:
            sent_tag, data = item
            if tag in (ANY_TAG, sent_tag):
                self._outbox.remove(item)
                _copy_into(buf, data, where="irecv")
                return CompletedRequest(source=0, tag=sent_tag)
        pending = _PendingRecv(buf, tag)
        self._pending.append(pending)
        return pending

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Optional[tuple]:
        for sent_tag, _ in self._outbox:
            if tag in (ANY_TAG, sent_tag):
                return 0, sent_tag
        return None

    # ---- groups and control
    def split(self, color: Optional[int], key: int = 0) -> Optional["SingleCommunicator"]:
        if color is None:
            return None
        if int(color) < 0:
            raise ValueError(f"split: color must be a non-negative int or None, got {color!r}")
        return self

    def dup(self) -> "SingleCommunicator":
        twin = SingleCommunicator()
        twin._transport = self._transport
        return twin

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1, message: str = "") -> None:
        if message:
            print(f"[rank 0/1] {message}", file=sys.stderr)
        if sys.stdout is not None:      # (None: started with it closed)
            sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

