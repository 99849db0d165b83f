"""NCCL set-up and the device route fallbacks under ``mpiexec -n 2``, without a GPU.

Usage: nccl_setup_worker.py SCENARIO RENDEZVOUS_DIR

Each scenario installs the cupy stand-in of fake_cupy.py with an NCCL binding
that mimics one CuPy API variant (or a failure), lets MpiCommunicator choose
its device route, and checks the route's name, its reason (the same on every
rank) and reduced values.  Run by tests/comm/test_gpu.py, one launch per
scenario, with a timeout so a hang fails the test.
"""

import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import fake_cupy
from fake_cupy import CountedDeviceArray, counts, device
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.mpi import MpiCommunicator

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
scenario, rendezvous_dir = sys.argv[1], sys.argv[2]
host = socket.gethostname()
STAGED_REASON_TAIL = "; CUDA-aware MPI not claimed by the library"

# What each scenario sets up (per rank where it differs) and what it must give.
# Keys: nccl (make_nccl arguments, None: no binding), device/pci (per rank),
# prefer, timeout, transport, reason (substrings), error (substrings), max_seconds.
OK_REASON = "NCCL over 2 ranks on distinct GPUs; point to point host-staged"
SCENARIOS = {
    # CuPy 12/13: a tuple of signed chars both ways.
    "cupy13-tuple": dict(nccl=dict(id_form="signed-tuple", accepts="signed-tuple"),
                         transport="nccl", reason=[OK_REASON]),
    # CuPy 14: bytes both ways (the crash this guards against).
    "cupy14-bytes": dict(nccl=dict(id_form="bytes", accepts="bytes"),
                         transport="nccl", reason=[OK_REASON]),
    # A tuple id with a constructor that takes bytes only: TypeError, next form.
    "tuple-id-bytes-init": dict(nccl=dict(id_form="signed-tuple", accepts="bytes"),
                                transport="nccl", reason=[OK_REASON]),
    # An unsigned tuple id with a signed-char constructor: OverflowError, next form.
    "unsigned-id-signed-init": dict(nccl=dict(id_form="unsigned-tuple",
                                              accepts="signed-tuple"),
                                    transport="nccl", reason=[OK_REASON]),
    # Rank 1's init raises; rank 0 is blocked in the init and must be released.
    "init-fails-on-one-rank": dict(
        nccl=dict(id_form="bytes", accepts="bytes", fail_init=[False, True]),
        timeout=60, max_seconds=15, transport="host-staged",
        reason=["NCCL not used: NCCL init failed on rank 1: RuntimeError: NCCL error: "
                "invalid usage (injected on this rank)", STAGED_REASON_TAIL]),
    # Rank 1's init never returns: both ranks give up after the timeout.
    "init-hangs-on-one-rank": dict(
        nccl=dict(id_form="bytes", accepts="bytes", hang_init=[False, True]),
        timeout=2, max_seconds=20, transport="host-staged",
        reason=["NCCL not used: NCCL init failed", "no answer within 2 s",
                STAGED_REASON_TAIL]),
    "unique-id-fails": dict(
        nccl=dict(id_form="bytes", accepts="bytes", fail_unique_id=[True, False]),
        transport="host-staged", init_calls=0,
        reason=["NCCL not used: NCCL unique id not shared on rank 0: RuntimeError: "
                "NCCL error: unhandled system error (injected)"]),
    "nccl-unavailable": dict(
        nccl=dict(id_form="bytes", accepts="bytes", available=False),
        transport="host-staged", init_calls=0,
        reason=["NCCL not used: cupy.cuda.nccl unavailable: cannot be imported or "
                "reports available=False" + STAGED_REASON_TAIL]),
    "nccl-missing-on-one-rank": dict(
        nccl=[dict(id_form="bytes", accepts="bytes"), None],
        transport="host-staged", init_calls=0,
        reason=["NCCL not used: cupy.cuda.nccl unavailable on rank 1: cannot be "
                "imported or reports available=False" + STAGED_REASON_TAIL]),
    # One GPU for both ranks (local_rank % device_count): NCCL is never tried.
    "shared-gpu": dict(
        nccl=dict(id_form="bytes", accepts="bytes"), device=[0, 0],
        pci=["0000:3B:00.0", "0000:3B:00.0"], transport="host-staged", init_calls=0,
        reason=[f"NCCL not used: ranks 0 and 1 share GPU 0 (PCI 0000:3B:00.0) on host "
                f"{host}" + STAGED_REASON_TAIL]),
    "shared-gpu-without-pci": dict(
        nccl=dict(id_form="bytes", accepts="bytes"), device=[0, 0],
        transport="host-staged", init_calls=0,
        reason=[f"NCCL not used: ranks 0 and 1 share GPU 0 on host {host}"
                + STAGED_REASON_TAIL]),
    # Both see device 0 (CUDA_VISIBLE_DEVICES per rank) but the bus ids differ.
    "same-id-distinct-pci": dict(
        nccl=dict(id_form="bytes", accepts="bytes"), device=[0, 0],
        pci=["0000:3B:00.0", "0000:5E:00.0"], transport="nccl", reason=[OK_REASON]),
    "forced-nccl-works": dict(nccl=dict(id_form="signed-tuple", accepts="bytes"),
                              prefer="nccl", transport="nccl", reason=[OK_REASON]),
    "forced-nccl-init-fails": dict(
        nccl=dict(id_form="bytes", accepts="bytes", fail_init=[True, False]),
        prefer="nccl", timeout=60, max_seconds=15,
        error=["device transport 'nccl' was requested (device_transport) but cannot be "
               "used: NCCL init failed on rank 0: RuntimeError: NCCL error: invalid usage"]),
    "forced-nccl-shared-gpu": dict(
        nccl=dict(id_form="bytes", accepts="bytes"), device=[0, 0], prefer="nccl",
        error=["device transport 'nccl'", f"ranks 0 and 1 share GPU 0 on host {host}"]),
}


def mine(value):
    """A per-rank setting ([rank 0, rank 1]) or one for all ranks."""
    return value[rank] if isinstance(value, list) else value


def ok(name):
    if rank == 0:
        print(f"ok {name}", flush=True)


def exercise(comm):
    """Buffer collectives with values from rank and size only; p2p takes an MPI path."""
    base = np.arange(300, dtype=np.float64)
    triangle = size * (size + 1) / 2
    for dtype in (np.float32, np.float64):
        for op, expected in (("sum", base * triangle), ("mean", base * triangle / size),
                             ("max", base * size), ("min", base)):
            buf = device(base * (rank + 1), dtype)
            assert comm.allreduce_(buf, op=op) is buf
            np.testing.assert_allclose(fake.asnumpy(buf), expected, rtol=1e-6,
                                       err_msg=f"{op} {dtype.__name__}")
    ints = device([rank + 1] * 7, np.int64)
    comm.allreduce_(ints, op="sum")
    assert (fake.asnumpy(ints) == triangle).all()
    first, second = device(base * (rank + 1)), device([rank] * 5, np.float64)
    comm.waitall([comm.iallreduce_(first, op="sum"), comm.iallreduce_(second, op="max")])
    np.testing.assert_allclose(fake.asnumpy(first), base * triangle, rtol=1e-6)
    assert (fake.asnumpy(second) == size - 1).all()
    buf = device([7.0] * 40) if rank == 1 else device(np.full(40, -1.0))
    comm.bcast_(buf, root=1)
    assert (fake.asnumpy(buf) == 7.0).all()
    recv = device(np.zeros(17))
    comm.sendrecv(device([rank] * 17), (rank + 1) % size, recv, (rank - 1) % size, tag=4)
    assert (fake.asnumpy(recv) == (rank - 1) % size).all()
    assert isinstance(buf, CountedDeviceArray) and not isinstance(buf, np.ndarray)


spec = SCENARIOS[scenario]
os.environ["MPITRAIN_NCCL_INIT_TIMEOUT"] = str(spec.get("timeout", 30))
nccl_args = mine(spec["nccl"])
nccl = None if nccl_args is None else fake_cupy.make_nccl(
    rendezvous_dir=rendezvous_dir, **{key: mine(value) for key, value in nccl_args.items()})
fake = fake_cupy.install(device_id=mine(spec.get("device", [0, 1])),
                         pci_bus_id=mine(spec.get("pci", None)), nccl=nccl)
install_abort_hook(MpiCommunicator())

comm = MpiCommunicator(world.Dup(), device_transport=spec.get("prefer", "auto"))
assert comm.transport == "host" and comm.transport_reason == ""
started = time.monotonic()
error = None
try:
    name = comm.setup_device_transport(fake)
except RuntimeError as exc:
    error = str(exc)
elapsed = time.monotonic() - started
if rank == 0:
    print(f"transport {comm.transport} ({comm.transport_reason}) in {elapsed:.2f} s"
          if error is None else f"error: {error}", flush=True)
assert elapsed < spec.get("max_seconds", 10), f"route choice took {elapsed:.1f} s"

if "error" in spec:
    # Every rank raised, with one line that names the route and the reason.
    assert error is not None, f"rank {rank}: forced route did not raise"
    assert "\n" not in error, error
    for part in spec["error"]:
        assert part in error, (part, error)
    assert comm.allgather_obj(error) == [error] * size
    ok(f"{scenario}: RuntimeError on every rank")
else:
    assert error is None, f"rank {rank}: {error}"
    assert name == comm.transport == spec["transport"], (name, comm.transport)
    reason = comm.transport_reason
    for part in spec["reason"]:
        assert part in reason, (part, reason)
    assert "\n" not in reason, reason
    assert comm.allgather_obj(reason) == [reason] * size, reason
    if "init_calls" in spec:
        assert counts["nccl_init"] == spec["init_calls"], counts
    before = dict(counts)
    exercise(comm)
    if comm.transport == "nccl":
        # The collectives went through the NCCL stand-in, never through staging.
        assert counts["nccl_allreduce"] - before["nccl_allreduce"] == 11, counts
        assert counts["nccl_bcast"] - before["nccl_bcast"] == 1, counts
        assert counts["set"] - before["set"] == 1, counts         # the sendrecv only
    else:
        assert counts["nccl_allreduce"] == counts["nccl_bcast"] == 0, counts
        assert counts["set"] - before["set"] >= 12, counts
    ok(f"{scenario}: {comm.transport}")

chosen = comm.transport
comm.free()
# Only a communicator that is used stays alive, and free() releases it.
assert counts["nccl_destroy"] == (1 if chosen == "nccl" else 0), counts
world.Barrier()
if rank == 0:
    print(f"nccl_setup_worker: {scenario} passed", flush=True)
