"""Checks of MpiCommunicator, run under ``mpiexec -n N`` by tests/comm/test_mpi.py.

Usage: comm_worker.py NRANKS [--xp numpy|cupy] [--transport auto|host-staged|...]

Every expected value is computed from rank and size, independently of the
communicator.  A failed assertion aborts the whole job (abort hook) with the
traceback on stderr; rank 0 prints one "ok <check>" line per check.
"""

import argparse
import sys
import time

import mpitrain
import mpitrain.comm
import mpitrain.testing  # noqa: F401  (imported only to show it does not start MPI)

# Importing the package must not start MPI: checked before anything else runs.
assert "mpi4py" not in sys.modules, "importing mpitrain.comm imported mpi4py"

import numpy as np

from mpitrain import backend
from mpitrain.comm import ANY_SOURCE, create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.testing.mpirun import skip_worker

parser = argparse.ArgumentParser()
parser.add_argument("nranks", type=int)
parser.add_argument("--xp", default="numpy", choices=["numpy", "cupy"])
parser.add_argument("--transport", default="auto")
args = parser.parse_args()

comm = create_communicator("auto", device_transport=args.transport)
install_abort_hook(comm)
from mpi4py import MPI  # noqa: E402  (already imported by create_communicator)

assert MPI.Is_initialized()
assert comm.name == "mpi", comm.name
rank, size = comm.rank, comm.size
assert size == args.nranks, (size, args.nranks)

if args.xp == "cupy":
    if not backend.gpu_available():
        skip_worker("cupy with a CUDA device is needed for --xp cupy")
    xp = backend.select("gpu", local_rank=comm.local_rank)
else:
    xp = np


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def host(array):
    return backend.to_host(array)


def assert_raises(exc_type, function, *a, **kw):
    try:
        function(*a, **kw)
    except exc_type:
        return
    raise AssertionError(f"{function.__name__} did not raise {exc_type.__name__}")


triangle = size * (size + 1) // 2          # sum over ranks of (rank + 1)
base = np.arange(1000, dtype=np.float64)

# ---- identity
assert 0 <= rank < size
assert comm.local_size == size and comm.local_rank == rank   # one node
assert comm.transport == "host" and comm.transport_reason == ""
assert isinstance(comm.thread_multiple, bool)
ok("identity")

# ---- allreduce_ with every op, float32 and float64
for dtype in (np.float32, np.float64):
    for op, expected in (("sum", base * triangle), ("mean", base * triangle / size),
                         ("max", base * size), ("min", base)):
        buf = xp.asarray(base * (rank + 1), dtype=dtype)
        result = comm.allreduce_(buf, op=op)
        assert result is buf
        np.testing.assert_allclose(host(buf), expected, rtol=1e-6, err_msg=f"{op} {dtype}")
ints = xp.full(7, rank + 1, dtype=np.int64)
comm.allreduce_(ints, op="sum")
assert (host(ints) == triangle).all()
assert_raises(ValueError, comm.allreduce_, xp.zeros(3, dtype=np.int32), "mean")
assert_raises(ValueError, comm.allreduce_, xp.zeros(3, dtype=np.float32), "avg")
assert_raises(ValueError, comm.allreduce_, xp.zeros((4, 4), dtype=np.float32)[:, 0], "sum")
ok("allreduce_")

# ---- large host buffers go in pieces, each scaled on its own: shrink the piece
# size so a small buffer takes that path (several whole pieces plus a remainder)
if type(comm).__name__ == "MpiCommunicator" and xp is np:
    import mpitrain.comm.mpi as mpi_module
    saved_piece = mpi_module.HOST_PIECE_BYTES
    mpi_module.HOST_PIECE_BYTES = 64                     # 16 float32 per piece
    try:
        values = np.arange(101, dtype=np.float32)
        for op, expected in (("sum", values * triangle), ("mean", values * triangle / size),
                             ("max", values * size)):
            buf = values * (rank + 1)
            comm.allreduce_(buf, op=op)
            np.testing.assert_allclose(buf, expected, rtol=1e-6, err_msg=f"pieces {op}")
    finally:
        mpi_module.HOST_PIECE_BYTES = saved_piece
    ok("allreduce_ in pieces")

# ---- bcast_
for root in {0, size - 1}:
    buf = xp.full(513, float(rank), dtype=np.float32)
    comm.bcast_(buf, root=root)
    assert (host(buf) == root).all(), (root, host(buf)[:3])
payload = np.random.default_rng(7).standard_normal(2049).astype(np.float32)
buf = xp.asarray(payload) if rank == 0 else xp.zeros(2049, dtype=np.float32)
comm.bcast_(buf, root=0)
assert np.array_equal(host(buf), payload)
ok("bcast_")

# ---- sendrecv around a ring
right, left = (rank + 1) % size, (rank - 1) % size
send = xp.full(100, float(rank), dtype=np.float32)
recv = xp.zeros(100, dtype=np.float32)
comm.sendrecv(send, right, recv, left, tag=3)
assert (host(recv) == left).all()
ok("sendrecv ring")

# ---- isend / irecv to and from every rank
requests, inboxes = [], {}
for peer in range(size):
    if peer == rank:
        continue
    inboxes[peer] = xp.zeros(64, dtype=np.float64)
    requests.append(comm.irecv(inboxes[peer], source=peer, tag=peer))
outboxes = [xp.full(64, rank * 100.0 + peer, dtype=np.float64) for peer in range(size)]
for peer in range(size):
    if peer != rank:
        requests.append(comm.isend(outboxes[peer], peer, tag=rank))
comm.waitall(requests)
for peer, inbox in inboxes.items():
    assert (host(inbox) == peer * 100.0 + rank).all(), (peer, host(inbox)[:2])
ok("isend/irecv")

# ---- wildcard receive reports the source; blocking send/recv; iprobe
if rank == 0:
    seen = set()
    for _ in range(size - 1):
        inbox = xp.zeros(8, dtype=np.float32)
        request = comm.irecv(inbox, source=ANY_SOURCE, tag=11)
        request.wait()
        assert request.source is not None and request.tag == 11
        assert (host(inbox) == request.source).all()
        seen.add(request.source)
    assert seen == set(range(1, size)), seen
else:
    comm.send(xp.full(8, float(rank), dtype=np.float32), 0, tag=11)
if size > 1:
    if rank == 1:
        comm.send(xp.full(5, 42.0, dtype=np.float32), 0, tag=7)
    if rank == 0:
        deadline = time.monotonic() + 20
        found = None
        while found is None and time.monotonic() < deadline:
            found = comm.iprobe(source=ANY_SOURCE, tag=7)
        assert found == (1, 7), found
        inbox = xp.zeros(5, dtype=np.float32)
        assert comm.recv(inbox, source=ANY_SOURCE, tag=7) == (1, 7)
        assert (host(inbox) == 42.0).all()
        assert comm.iprobe(source=1, tag=7) is None
comm.barrier()
ok("send/recv/iprobe")

# ---- iallreduce_: two in flight, polled, the mean scaled exactly once
first = xp.asarray(base * (rank + 1), dtype=np.float32)
second = xp.full(10, float(rank), dtype=np.float64)
r1 = comm.iallreduce_(first, op="mean")
r2 = comm.iallreduce_(second, op="max")
deadline = time.monotonic() + 20
while not r1.test():
    assert time.monotonic() < deadline, "iallreduce_ never completed"
r1.wait()          # already done: must not scale again
assert r1.test() and r1.done
comm.waitall([r2, r1])
np.testing.assert_allclose(host(first), base * triangle / size, rtol=1e-6)
assert (host(second) == size - 1).all()
ok("iallreduce_")

# ---- split into two groups (the last rank opts out when there are 3 or more)
color = None if (size >= 3 and rank == size - 1) else rank % 2
sub = comm.split(color, key=-rank)          # key reverses the order inside a group
if color is None:
    assert sub is None
else:
    members = [r for r in range(size) if r % 2 == color and not (size >= 3 and r == size - 1)]
    assert sub.size == len(members), (sub.size, members)
    assert sub.rank == sorted(members, reverse=True).index(rank)
    buf = xp.full(33, float(rank), dtype=np.float64)
    sub.allreduce_(buf, op="sum")
    assert (host(buf) == sum(members)).all(), (host(buf)[0], members)
    assert sub.allreduce_scalar(1) == len(members)
    assert sub.allgather_obj(rank) == sorted(members, reverse=True)
    sub.free()
assert_raises(ValueError, comm.split, -2)
comm.barrier()
ok("split")

# ---- dup is a separate communicator over the same ranks
twin = comm.dup()
assert (twin.rank, twin.size) == (rank, size)
assert twin.allreduce_scalar(rank, op="max") == size - 1
twin.free()
ok("dup")

# ---- allreduce_scalar keeps the caller's type
total = comm.allreduce_scalar(rank + 1, op="sum")
assert total == triangle and isinstance(total, int), total
assert comm.allreduce_scalar(float(rank), op="max") == float(size - 1)
assert isinstance(comm.allreduce_scalar(float(rank), op="max"), float)
assert comm.allreduce_scalar(rank + 1, op="min") == 1
assert comm.allreduce_scalar(rank + 1, op="mean") == triangle / size
assert comm.allreduce_scalar(bool(rank == size - 1), op="max") == 1
ok("allreduce_scalar")

# ---- JSON objects (no pickle): allgather, bcast, gather, encoding errors
mine = {"rank": rank, "name": "é" * rank, "values": [rank, 1.5, None, True],
        "metric": np.float32(rank) / 2}
gathered = comm.allgather_obj(mine)
assert gathered == [{"rank": r, "name": "é" * r, "values": [r, 1.5, None, True],
                     "metric": r / 2} for r in range(size)], gathered
root = size - 1
config = {"lr": 0.008, "layers": [440, 1024, 2000], "tuple": (1, 2)}
received = comm.bcast_obj(config if rank == root else None, root=root)
assert received == {"lr": 0.008, "layers": [440, 1024, 2000], "tuple": [1, 2]}, received
at_root = comm.gather_obj(rank * 10, root=0)
assert at_root == ([r * 10 for r in range(size)] if rank == 0 else None), at_root
assert comm.allgather_obj(None) == [None] * size
# A rank that cannot encode makes every rank raise, instead of some hanging.
assert_raises(ValueError, comm.allgather_obj, {1, 2} if rank == size - 1 else rank)
assert_raises(ValueError, comm.gather_obj, object() if rank == 0 else rank)
assert_raises(ValueError, comm.bcast_obj, {"x": {3}}, root=0)
ok("objects")

# ---- comm_time accumulates and resets
comm.reset_comm_time()
assert comm.comm_time == 0.0
big = xp.ones(200_000, dtype=np.float32)
for _ in range(3):
    comm.allreduce_(big, op="mean")
after_allreduce = comm.comm_time
assert after_allreduce > 0.0
request = comm.iallreduce_(big, op="sum")
request.wait()
comm.barrier()
assert comm.comm_time >= after_allreduce
comm.reset_comm_time()
assert comm.comm_time == 0.0
ok("comm_time")

# ---- wtime
t0 = comm.wtime()
assert comm.wtime() >= t0
# the monotonic clock, not MPI_Wtime (MPICH's follows the system clock, which may step)
assert abs(comm.wtime() - time.perf_counter()) < 1.0, (comm.wtime(), time.perf_counter())
ok("wtime")

# ---- the device route actually used (cupy only)
if xp is not np:
    assert comm.transport in ("nccl", "cuda-aware-mpi", "host-staged"), comm.transport
    if args.transport != "auto":
        assert comm.transport == args.transport, (comm.transport, args.transport)
    # Every rank took the same route for the same one-line reason.
    assert comm.transport_reason and "\n" not in comm.transport_reason
    assert comm.allgather_obj(comm.transport_reason) == [comm.transport_reason] * size
    if rank == 0:
        print(f"device transport: {comm.transport} ({comm.transport_reason})", flush=True)

comm.barrier()
if rank == 0:
    print(f"comm_worker: all checks passed on {size} ranks ({args.xp})", flush=True)
