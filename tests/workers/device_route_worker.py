"""Device-buffer routing of MpiCommunicator, checked without a GPU.

A stand-in for cupy (fake_cupy.py: host memory behind a cupy-like interface,
``get``/``set``, pinned allocation, stream synchronisation) is installed into
mpitrain.backend, so the route choice, the pinned staging path and the
CUDA-aware path run for real under ``mpiexec``; only the memory is host
memory.  Its device arrays are no host memory to NumPy or mpi4py (checked
first), and MPI takes them only while the stand-in MPI is CUDA-aware, so a
route that hands one to MPI unstaged fails here.  Run by tests/comm/test_gpu.py
with 2 ranks.
"""

import os

import numpy as np
from mpi4py import MPI

from fake_cupy import CountedDeviceArray, counts, device, install, set_cuda_aware_mpi
from mpitrain.comm import gpu
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.mpi import MpiCommunicator

# No NCCL binding registered: NCCL is out, the MPI routes are what is tested.
fake = install(device_id=MPI.COMM_WORLD.Get_rank())

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def exercise(comm, nonblocking_collectives=True):
    """Every buffer call on fake device arrays; values from rank and size only
    (``nonblocking_collectives`` False: all but the non-blocking collectives)."""
    base = np.arange(300, dtype=np.float64)
    triangle = size * (size + 1) / 2
    buf = device(base * (rank + 1))
    comm.allreduce_(buf, op="mean")
    np.testing.assert_allclose(fake.asnumpy(buf), base * triangle / size, rtol=1e-6)
    assert isinstance(buf, CountedDeviceArray) and not isinstance(buf, np.ndarray)

    if nonblocking_collectives:
        first, second = device(base * (rank + 1)), device([rank] * 5, np.float64)
        requests = [comm.iallreduce_(first, op="sum"), comm.iallreduce_(second, op="max")]
        comm.waitall(requests)
        np.testing.assert_allclose(fake.asnumpy(first), base * triangle, rtol=1e-6)
        assert (fake.asnumpy(second) == size - 1).all()

    buf = device([rank] * 40) if rank == 0 else device(np.full(40, -1.0))
    comm.bcast_(buf, root=0)
    assert (fake.asnumpy(buf) == 0).all()

    right, left = (rank + 1) % size, (rank - 1) % size
    recv = device(np.zeros(17))
    comm.sendrecv(device([rank] * 17), right, recv, left, tag=4)
    assert (fake.asnumpy(recv) == left).all()

    inbox = device(np.zeros(9))
    receiving = comm.irecv(inbox, source=left, tag=8)
    sending = comm.isend(device([rank * 10] * 9), right, tag=8)
    comm.waitall([sending, receiving])
    assert (fake.asnumpy(inbox) == left * 10).all() and receiving.source == left

    # blocking point to point: even ranks send first, odd ranks receive first
    back = device(np.zeros(6))
    for turn in ((0, 1) if rank % 2 == 0 else (1, 0)):
        if turn == 0:
            comm.send(device([rank + 100] * 6), right, tag=9)
        else:
            assert comm.recv(back, source=left, tag=9) == (left, 9)
    assert (fake.asnumpy(back) == left + 100).all()


install_abort_hook(MpiCommunicator())

# 0. A device array is no host memory: NumPy, the buffer protocol and an MPI
# without CUDA support (mpi4py) refuse it, as on a GPU; a CUDA-aware MPI takes it.
probe = device([rank + 1.0] * 4)
for host_use in (lambda: np.asarray(probe), lambda: memoryview(probe),
                 lambda: world.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM),
                 lambda: world.Bcast(probe, root=0),
                 lambda: world.Isend(probe[1:], dest=(rank + 1) % size)):
    try:
        host_use()
    except TypeError:
        pass
    else:
        raise AssertionError("a device array passed as host memory")
set_cuda_aware_mpi(True)
world.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM)
assert (fake.asnumpy(probe) == size * (size + 1) / 2).all()
set_cuda_aware_mpi(False)
# a staging route that forgot to stage is caught
unstaged = MpiCommunicator(world.Dup(), device_transport="host-staged")
staging_enter = gpu.PinnedStagingPath.enter
gpu.PinnedStagingPath.enter = lambda path, buf, *, copy_in: (buf, None)
try:
    unstaged.allreduce_(device([1.0] * 4), op="sum")
except TypeError:
    pass
else:
    raise AssertionError("a host-staged route handed a device array to MPI unnoticed")
finally:
    gpu.PinnedStagingPath.enter = staging_enter
unstaged.free()
ok("device arrays are no host memory")

# 1. No NCCL, MPICH without GPU support: the pinned staging route.
staged = MpiCommunicator(world.Dup(), device_transport="auto")
assert staged.transport == "host"
before = dict(counts)
exercise(staged)
assert staged.transport == "host-staged", staged.transport
assert staged.transport_reason == (
    "NCCL not used: cupy.cuda.nccl unavailable: cannot be imported or reports "
    "available=False; CUDA-aware MPI not claimed by the library"), staged.transport_reason
assert counts["get"] > before["get"] and counts["set"] > before["set"], counts
pinned_after_first = counts["pinned"]
exercise(staged)
# Staging buffers are reused: a second round of the same sizes allocates nothing.
assert counts["pinned"] == pinned_after_first, counts
ok("host-staged route")

# 2. Point to point before any collective uses staging without a collective choice.
lazy = MpiCommunicator(world.Dup())
recv = device(np.zeros(3))
lazy.sendrecv(device([rank] * 3), (rank + 1) % size, recv, (rank - 1) % size)
assert (fake.asnumpy(recv) == (rank - 1) % size).all()
assert lazy.transport == "host" and lazy.transport_reason == "", lazy.transport
ok("point to point before setup")

# 3. A forced CUDA-aware route that the library does not claim fails on every rank.
forced = MpiCommunicator(world.Dup(), device_transport="cuda-aware-mpi")
try:
    forced.setup_device_transport(fake)
except RuntimeError as exc:
    assert str(exc) == ("device transport 'cuda-aware-mpi' was requested (device_transport) "
                        "but cannot be used: CUDA-aware MPI not claimed by the library"), exc
else:
    raise AssertionError("forced cuda-aware-mpi without support did not raise")
ok("forced route refused")

# 4. The probe override: device arrays go straight to MPI after a stream sync.
os.environ["MPITRAIN_CUDA_AWARE_MPI"] = "1"
set_cuda_aware_mpi(True)
aware = MpiCommunicator(world.Dup(), device_transport="auto")
assert aware.setup_device_transport(fake) == "cuda-aware-mpi"
before = dict(counts)
exercise(aware, nonblocking_collectives=False)
assert counts["get"] == before["get"] and counts["set"] == before["set"], counts
assert counts["sync"] > before["sync"], counts
# a non-blocking collective goes through the host: Open MPI's CUDA support takes
# device memory in point to point and blocking collectives only
before = dict(counts)
buf = device(np.arange(50, dtype=np.float64) * (rank + 1))
aware.iallreduce_(buf, op="sum").wait()
np.testing.assert_allclose(fake.asnumpy(buf), np.arange(50) * size * (size + 1) / 2)
assert counts["get"] > before["get"] and counts["set"] > before["set"], counts
assert aware.transport == "cuda-aware-mpi"
assert aware.transport_reason == ("NCCL not used: cupy.cuda.nccl unavailable: cannot be "
                                  "imported or reports available=False; CUDA-aware MPI "
                                  "probe passed"), aware.transport_reason
ok("cuda-aware route")

# 5. Forced staging skips every probe (and MPI is given no device array).
set_cuda_aware_mpi(False)
forced_staging = MpiCommunicator(world.Dup(), device_transport="host-staged")
assert forced_staging.setup_device_transport(fake) == "host-staged"
assert forced_staging.transport_reason == "host-staged requested by device_transport"
assert forced_staging.setup_device_transport(np) == "host"
exercise(forced_staging)
ok("forced host-staged")

for comm in (staged, lazy, forced, aware, forced_staging):
    comm.free()
world.Barrier()
if rank == 0:
    print("device_route_worker: all checks passed", flush=True)
