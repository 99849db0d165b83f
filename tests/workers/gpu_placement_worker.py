"""Which GPU each rank picks, under ``mpiexec -n 4`` on one node, without a GPU.

Usage: gpu_placement_worker.py SCENARIO

Each rank sets ``CUDA_VISIBLE_DEVICES`` as a launcher would for SCENARIO,
installs the cupy stand-in of fake_cupy.py with as many devices as that
variable lists (a device's PCI bus id names the physical GPU behind it), lets
MpiCommunicator number the ranks and ``backend.select`` pick the device, and
reports the physical GPU and the device route's reason.  Rank 0 prints one
``placement`` line with every rank's physical GPU and one ``reason <route>``
line per route tried.  Run by tests/comm/test_gpu.py.
"""

import os
import sys

from mpi4py import MPI

from fake_cupy import install
from mpitrain import backend
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.mpi import MpiCommunicator

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
scenario = sys.argv[1]

# CUDA_VISIBLE_DEVICES per rank, as the launcher sets it
VISIBLE = {
    # srun --gpu-bind=closest on two sockets, tasks placed cyclically over them
    # (Slurm's default block:cyclic): even ranks see GPUs 0,1, odd ranks 2,3
    "closest-cyclic": lambda r: "0,1" if r % 2 == 0 else "2,3",
    # the same with the tasks placed block-wise
    "closest-block": lambda r: "0,1" if r < size // 2 else "2,3",
    # srun --gpus-per-task=1: one GPU each
    "one-per-task": lambda r: str(r),
    # mpirun: every rank sees the node's 4 GPUs
    "all-visible": lambda r: "0,1,2,3",
    # more ranks than GPUs: 4 ranks, 2 GPUs
    "more-ranks-than-gpus": lambda r: "0,1",
}
os.environ["CUDA_VISIBLE_DEVICES"] = VISIBLE[scenario](rank)
physical = [int(g) for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]

fake = install()
current = {"id": 0}


class Device:
    """cupy.cuda.Device over the GPUs CUDA_VISIBLE_DEVICES lists."""

    def __init__(self, device_id=None):
        self.id = current["id"] if device_id is None else device_id
        if not 0 <= self.id < len(physical):
            raise RuntimeError(f"invalid device ordinal {self.id}")
        self.pci_bus_id = f"0000:{0x10 + physical[self.id]:02X}:00.0"

    def use(self):
        current["id"] = self.id


fake.cuda.Device = Device
fake.cuda.is_available = lambda: True
fake.cuda.runtime = type("runtime", (), {"getDeviceCount": staticmethod(lambda: len(physical))})

comm = MpiCommunicator()
install_abort_hook(comm)
assert comm.local_size == size, "the test expects every rank on one node"
xp = backend.select("gpu", comm.device_rank)
mine = physical[current["id"]]
gpus = world.allgather(mine)
if rank == 0:
    print("placement " + " ".join(map(str, gpus)), flush=True)
for prefer in ("auto", "host-staged"):
    comm.setup_device_transport(xp, prefer=prefer)
    if rank == 0:
        print(f"reason {prefer}: {comm.transport_reason}", flush=True)
world.Barrier()
if rank == 0:
    print(f"gpu_placement_worker: {scenario} done", flush=True)
