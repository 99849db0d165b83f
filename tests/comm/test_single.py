"""SingleCommunicator semantics: every call of one rank, on NumPy and CuPy buffers."""

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.comm import ANY_SOURCE


def test_identity(comm):
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    assert comm.name == "single" and comm.transport == "host"
    assert comm.transport_reason == ""


def test_device_transport_of_one_rank(comm, xp):
    # One rank sends nothing anywhere: 'local' for device arrays, never a reason.
    expected = "host" if xp is np else "local"
    assert comm.setup_device_transport(xp, prefer="nccl") == expected
    assert comm.transport == expected and comm.transport_reason == ""
    assert comm.dup().transport == expected
    assert comm.setup_device_transport(np) == "host" and comm.transport == "host"


@pytest.mark.parametrize("op", ["mean", "sum", "max", "min"])
def test_allreduce_is_identity_in_place(comm, xp, op):
    values = np.arange(-3, 7, dtype=np.float32) * 0.5
    buf = xp.asarray(values)
    assert comm.allreduce_(buf, op=op) is buf
    np.testing.assert_array_equal(backend.to_host(buf), values)
    request = comm.iallreduce_(buf, op=op)
    assert request.test()
    request.wait()
    np.testing.assert_array_equal(backend.to_host(buf), values)


def test_allreduce_rejects_bad_arguments(comm, xp):
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce_(xp.zeros(3, dtype=np.float32), op="avg")
    with pytest.raises(ValueError, match="floating-point"):
        comm.allreduce_(xp.zeros(3, dtype=np.int32), op="mean")
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allreduce_(xp.zeros((4, 4), dtype=np.float32)[:, 1], op="sum")
    with pytest.raises(TypeError, match="numpy or cupy array"):
        comm.allreduce_([1.0, 2.0], op="sum")


def test_read_only_buffer_is_rejected(comm):
    frozen = np.zeros(4, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.bcast_(frozen)


def test_bcast_and_root_check(comm):
    buf = np.arange(5, dtype=np.float64)
    assert comm.bcast_(buf, root=0) is buf
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        comm.bcast_(buf, root=1)


def test_sendrecv_to_self_copies(comm, xp):
    send = xp.asarray(np.arange(6, dtype=np.float32))
    recv = xp.zeros(6, dtype=np.float32)
    assert comm.sendrecv(send, 0, recv, 0) is recv
    np.testing.assert_array_equal(backend.to_host(recv), np.arange(6))
    with pytest.raises(ValueError, match="does not match"):
        comm.sendrecv(send, 0, xp.zeros(5, dtype=np.float32), 0)


def test_isend_then_irecv_matches_by_tag_and_copies(comm):
    first = np.full(3, 1.0)
    second = np.full(3, 2.0)
    comm.isend(second, 0, tag=2).wait()
    comm.isend(first, 0, tag=1).wait()
    first[:] = -1.0        # the message was taken at send time
    assert comm.iprobe(tag=1) == (0, 1)
    inbox = np.zeros(3)
    request = comm.irecv(inbox, source=0, tag=1)
    assert request.test() and (request.source, request.tag) == (0, 1)
    assert (inbox == 1.0).all()
    assert comm.recv(inbox, source=ANY_SOURCE) == (0, 2)
    assert (inbox == 2.0).all()
    assert comm.iprobe() is None


def test_irecv_posted_before_isend_completes_on_send(comm):
    inbox = np.zeros(4, dtype=np.float32)
    request = comm.irecv(inbox, tag=5)
    assert not request.test()
    comm.isend(np.full(4, 9.0, dtype=np.float32), 0, tag=5)
    assert request.test() and request.tag == 5
    assert (inbox == 9.0).all()


def test_waiting_on_a_receive_that_can_never_arrive_raises(comm):
    request = comm.irecv(np.zeros(2), tag=0)
    with pytest.raises(RuntimeError, match="never sent"):
        comm.waitall([request])


def test_allreduce_scalar_keeps_type(comm):
    assert comm.allreduce_scalar(7) == 7 and isinstance(comm.allreduce_scalar(7), int)
    assert isinstance(comm.allreduce_scalar(np.int32(3), op="max"), int)
    assert comm.allreduce_scalar(2.5, op="min") == 2.5
    assert isinstance(comm.allreduce_scalar(4, op="mean"), float)
    with pytest.raises(TypeError, match="int or float"):
        comm.allreduce_scalar("3")


def test_objects_take_the_json_round_trip(comm):
    obj = {"lr": 0.008, "layers": (440, 1024), 3: "three", "ok": True, "none": None}
    expected = {"lr": 0.008, "layers": [440, 1024], "3": "three", "ok": True, "none": None}
    assert comm.bcast_obj(obj) == expected
    assert comm.allgather_obj(obj) == [expected]
    assert comm.gather_obj(obj, root=0) == [expected]
    with pytest.raises(TypeError, match="cannot be sent between ranks"):
        comm.bcast_obj({"s": {1, 2}})


def test_split_dup_and_barrier(comm):
    assert comm.split(0) is comm
    assert comm.split(5, key=3) is comm
    assert comm.split(None) is None
    with pytest.raises(ValueError, match="non-negative"):
        comm.split(-1)
    twin = comm.dup()
    assert twin is not comm and twin.size == 1
    comm.barrier()
    twin.free()


def test_comm_time_starts_at_zero_counts_and_resets(comm):
    import time
    assert comm.comm_time == 0.0
    with comm._timed():
        time.sleep(0.02)
    assert 0.015 <= comm.comm_time < 5.0
    comm.reset_comm_time()
    assert comm.comm_time == 0.0
    start = comm.wtime()
    time.sleep(0.02)
    assert 0.015 <= comm.wtime() - start < 5.0
