"""ADPSGD's exchange on a device whose kernels run late, under ``mpiexec -n 2``.

Usage: adpsgd_lazy_device_worker.py

Run by tests/parallel/test_adpsgd.py.  A stand-in device (fake_cupy.py) whose
in-place writes are queued, as kernels on a stream are, and run only at a
stream synchronisation or a blocking copy to the host: MPI that reads device
memory (the CUDA-aware route) or a staging copy then sees a buffer only if
the code synchronised before handing it over.  Lock-step ADPSGD, with and
without delay-by-one, over host staging and the CUDA-aware route, must end
with the parameters of the same run on NumPy, bit for bit.  Rank 0 prints one
"ok <check>" line per combination; a failed assertion aborts the job.
"""

import os

import numpy as np
from mpi4py import MPI

import fake_cupy
from fake_cupy import install
from mpitrain import backend
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.mpi import MpiCommunicator
from mpitrain.parallel.adpsgd import RingMixing

world = MPI.COMM_WORLD
rank = world.Get_rank()
QUEUE = []          # the stream: writes waiting to run


def run_queue():
    while QUEUE:
        QUEUE.pop(0)()


class LateArray(fake_cupy.FakeDeviceArray):
    """Device memory whose in-place writes run when the stream is synchronised."""

    def _memory(self):
        return self.view(np.ndarray)

    def _later(self, ufunc, other):
        other = other.view(np.ndarray) if isinstance(other, np.ndarray) else other
        QUEUE.append(lambda: ufunc(self._memory(), other, out=self._memory()))
        return self

    def __setitem__(self, index, value):
        value = value.view(np.ndarray) if isinstance(value, np.ndarray) else value
        QUEUE.append(lambda: np.ndarray.__setitem__(self._memory(), index, value))

    def __iadd__(self, other):
        return self._later(np.add, other)

    def __isub__(self, other):
        return self._later(np.subtract, other)

    def __imul__(self, other):
        return self._later(np.multiply, other)

    def get(self, out=None):            # a blocking copy waits for the stream
        run_queue()
        fake_cupy.counts["get"] += 1
        out[...] = self._memory()
        return out

    def set(self, array):
        fake_cupy.counts["set"] += 1
        self._memory()[...] = array

    def copy(self):
        run_queue()
        return np.array(self._memory()).view(LateArray)


class Stream:
    ptr = 0

    def synchronize(self):
        fake_cupy.counts["sync"] += 1
        run_queue()

    def record(self):
        return fake_cupy._Event()


fake = install(device_id=rank)
fake.ndarray = LateArray
fake.get_array_module = lambda *arrays: fake if any(
    isinstance(a, LateArray) for a in arrays) else np
fake.cuda.get_current_stream = Stream
fake.empty_like = lambda a: np.full_like(a.view(np.ndarray), np.nan).view(LateArray)
fake.zeros_like = lambda a: np.zeros_like(a.view(np.ndarray)).view(LateArray)
fake.asarray = lambda a: np.array(a).view(LateArray)
backend.is_gpu_array = lambda a: isinstance(a, LateArray)
install_abort_hook(MpiCommunicator())


class Net:
    """What RingMixing touches of a network: flat parameters and gradients."""

    def __init__(self, xp, size=64):
        start = np.arange(size, dtype=np.float32) * (rank + 1)
        self.xp = xp
        self.params = start if xp is np else start.view(LateArray)
        self.grads = np.zeros(size, np.float32)
        if xp is not np:
            self.grads = self.grads.view(LateArray)


def train(xp, delay_by_one, comm, steps=8, lr=np.float32(0.1)):
    net = Net(xp)
    ring = RingMixing(comm, topology="fixed_ring", delay_by_one=delay_by_one)
    ring.setup(net, None)
    for k in range(steps):
        gradient = np.random.default_rng([rank, k]).standard_normal(64).astype(np.float32)
        net.grads[...] = gradient if xp is np else gradient.view(LateArray)
        ring.reduce_gradients(net)
        params, grads = net.params, net.grads
        if xp is np:
            params -= lr * grads
        else:                           # the optimizer's kernel, run with the stream
            QUEUE.append(lambda: np.subtract(params.view(np.ndarray),
                                             lr * grads.view(np.ndarray),
                                             out=params.view(np.ndarray)))
        ring.after_update(net, None, k + 1)
    ring.drain()
    Stream().synchronize()
    return np.array(net.params.view(np.ndarray))


for delay_by_one in (False, True):
    expected = train(np, delay_by_one, MpiCommunicator(world.Dup()))
    for aware, route in (("0", "host-staged"), ("1", "cuda-aware-mpi")):
        os.environ["MPITRAIN_CUDA_AWARE_MPI"] = aware
        comm = MpiCommunicator(world.Dup())
        comm.setup_device_transport(fake)
        assert comm.transport == route, comm.transport
        got = train(fake, delay_by_one, comm)
        assert np.array_equal(got, expected), np.abs(got - expected).max()
        comm.free()
        if rank == 0:
            print(f"ok {route}{' delay_by_one' if delay_by_one else ''}", flush=True)
world.Barrier()
