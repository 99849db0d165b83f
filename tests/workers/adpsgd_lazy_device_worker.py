"""ADPSGD's exchange on a device whose kernels run late, under ``mpiexec -n 2``.

Usage: adpsgd_lazy_device_worker.py

Run by tests/parallel/test_adpsgd.py.  A stand-in device (fake_cupy.py) whose
in-place writes are queued, as kernels on a stream are, and run only at a
stream synchronisation or a blocking copy to the host: MPI that reads device
memory (the CUDA-aware route) or a staging copy then sees a buffer only if
the code synchronised before handing it over.  MPI takes device arrays on the
CUDA-aware route only (the stand-in MPI is CUDA-aware there alone).
Lock-step ADPSGD, with and without delay-by-one, over host staging and the
CUDA-aware route, must end with the parameters of the same run on NumPy, bit
for bit.  Rank 0 prints one "ok <check>" line per combination; a failed
assertion aborts the job.
"""

import contextlib
import os

import numpy as np
from mpi4py import MPI

import fake_cupy
from fake_cupy import install
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.mpi import MpiCommunicator
from mpitrain.parallel.adpsgd import RingMixing
from mpitrain.testing import standin_cupy

world = MPI.COMM_WORLD
rank = world.Get_rank()


class LateArray(fake_cupy.CountedDeviceArray):
    """Device memory whose in-place writes run when the stream is synchronised
    (queued with the stand-in's device work, which its stream, events and
    blocking reads wait for)."""

    __slots__ = ()

    def _later(self, write):
        standin_cupy.queue_device_work(write)
        return self

    def __setitem__(self, index, value):
        self._later(lambda: standin_cupy.DeviceArray.__setitem__(self, index, value))

    def __iadd__(self, other):
        return self._later(lambda: np.add(self, other, out=self))

    def __isub__(self, other):
        return self._later(lambda: np.subtract(self, other, out=self))

    def __imul__(self, other):
        return self._later(lambda: np.multiply(self, other, out=self))

    def copy(self):                     # a copy on the stream follows the queued writes
        fake.cuda.get_current_stream().synchronize()
        return late(fake.asnumpy(self))


def late(values, dtype=None):
    return LateArray._holding(np.array(values, dtype=dtype))


# (held for the worker's life: a context let go of would end with it)
DEVICE_WORK = contextlib.ExitStack()
DEVICE_WORK.enter_context(standin_cupy.deferred_copies())
fake = install(device_id=rank)
fake.empty_like = lambda a: late(np.full(a.shape, np.nan, a.dtype))
fake.zeros_like = lambda a: late(np.zeros(a.shape, a.dtype))
fake.asarray = lambda a, dtype=None: late(a if isinstance(a, np.ndarray) or np.isscalar(a)
                                          else fake.asnumpy(a), dtype)
install_abort_hook(MpiCommunicator())


class Net:
    """What RingMixing touches of a network: flat parameters and gradients."""

    def __init__(self, xp, size=64):
        start = np.arange(size, dtype=np.float32) * (rank + 1)
        self.xp = xp
        self.params = start if xp is np else late(start)
        self.grads = np.zeros(size, np.float32) if xp is np else late(np.zeros(size, np.float32))


def train(xp, delay_by_one, comm, steps=8, lr=np.float32(0.1)):
    net = Net(xp)
    ring = RingMixing(comm, topology="fixed_ring", delay_by_one=delay_by_one)
    ring.setup(net, None)
    for k in range(steps):
        gradient = np.random.default_rng([rank, k]).standard_normal(64).astype(np.float32)
        net.grads[...] = gradient if xp is np else late(gradient)
        ring.reduce_gradients(net)
        params, grads = net.params, net.grads
        if xp is np:
            params -= lr * grads
        else:                           # the optimizer's kernel, run with the stream
            standin_cupy.queue_device_work(lambda: np.subtract(params, lr * grads, out=params))
        ring.after_update(net, None, k + 1)
    ring.drain()
    return net.params if xp is np else fake.asnumpy(net.params)


for delay_by_one in (False, True):
    expected = train(np, delay_by_one, MpiCommunicator(world.Dup()))
    for aware, route in (("0", "host-staged"), ("1", "cuda-aware-mpi")):
        os.environ["MPITRAIN_CUDA_AWARE_MPI"] = aware
        fake_cupy.set_cuda_aware_mpi(aware == "1")
        comm = MpiCommunicator(world.Dup())
        comm.setup_device_transport(fake)
        assert comm.transport == route, comm.transport
        got = train(fake, delay_by_one, comm)
        assert np.array_equal(got, expected), np.abs(got - expected).max()
        comm.free()
        if rank == 0:
            print(f"ok {route}{' delay_by_one' if delay_by_one else ''}", flush=True)
world.Barrier()
