"""SingleCommunicator semantics, the JSON object wire format, and the factory."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.comm import (ANY_SOURCE, create_communicator, launched_by_mpi,
                           local_rank_from_env, world_size_from_env)
from mpitrain.comm.abort import abort_on_error, install_abort_hook
from mpitrain.comm import nccl_id
from mpitrain.comm.base import decode_obj, encode_obj
from mpitrain.comm.single import SingleCommunicator

LAUNCHER_VARS = ["PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                 "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "MV2_COMM_WORLD_SIZE", "PALS_RANKID",
                 "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"]


@pytest.fixture
def comm():
    return SingleCommunicator()


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


RAW_ID = bytes([0xFF, 0x01, 0x80, 0x7F]) + bytes(range(124))


@pytest.mark.parametrize("form,uid", [
    (nccl_id.ID_AS_BYTES, RAW_ID),
    (nccl_id.ID_AS_BYTES, bytearray(RAW_ID)),
    (nccl_id.ID_AS_SIGNED, tuple(b - 256 if b > 127 else b for b in RAW_ID)),
    (nccl_id.ID_AS_SIGNED, [b - 256 if b > 127 else b for b in RAW_ID]),
    (nccl_id.ID_AS_UNSIGNED, tuple(RAW_ID)),
], ids=["bytes", "bytearray", "signed tuple", "signed list", "unsigned tuple"])
def test_nccl_unique_id_round_trips_through_bytes(form, uid):
    raw, got_form = nccl_id.unique_id_to_bytes(uid)
    assert (raw, got_form) == (RAW_ID, form)
    rebuilt = nccl_id.unique_id_from_bytes(raw, form)
    assert rebuilt == (bytes(uid) if form == nccl_id.ID_AS_BYTES else tuple(uid))
    assert nccl_id.unique_id_from_bytes(raw, nccl_id.ID_AS_SIGNED)[:4] == (-1, 1, -128, 127)
    assert nccl_id.unique_id_from_bytes(raw, nccl_id.ID_AS_UNSIGNED)[:4] == (255, 1, 128, 127)


def test_nccl_unique_id_rejects_what_is_not_an_id():
    with pytest.raises(ValueError, match="expected 128 bytes, got 127"):
        nccl_id.unique_id_to_bytes(RAW_ID[:-1])
    with pytest.raises(ValueError, match="chars"):
        nccl_id.unique_id_to_bytes((256,) * 128)
    with pytest.raises(ValueError, match="mixes"):
        nccl_id.unique_id_to_bytes((-1, 200) + (0,) * 126)
    with pytest.raises(TypeError, match="expected bytes or a tuple"):
        nccl_id.unique_id_to_bytes("not an id")
    with pytest.raises(ValueError, match="unknown form"):
        nccl_id.unique_id_from_bytes(RAW_ID, 7)
    assert nccl_id.forms_to_try(nccl_id.ID_AS_SIGNED) == [
        nccl_id.ID_AS_SIGNED, nccl_id.ID_AS_BYTES, nccl_id.ID_AS_UNSIGNED]


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


def test_json_wire_format_round_trip():
    obj = {"name": "fbank-40 é", "frames": np.int64(123), "loss": np.float32(0.25),
           "counts": np.arange(3), "nested": [{"a": [1, 2.5, None]}], "nan": float("nan")}
    data = encode_obj(obj)
    assert data.dtype == np.uint8 and data.ndim == 1
    assert data.tobytes().startswith(b"{")          # JSON text, not pickle
    back = decode_obj(data)
    assert back["name"] == "fbank-40 é" and back["frames"] == 123
    assert back["loss"] == 0.25 and back["counts"] == [0, 1, 2]
    assert back["nested"] == [{"a": [1, 2.5, None]}]
    assert np.isnan(back["nan"])


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


def test_abort_helpers_let_a_single_rank_fail_normally(comm):
    with pytest.raises(KeyError):
        with abort_on_error(comm):
            raise KeyError("single rank: the exception propagates")
    with pytest.raises(SystemExit):
        with abort_on_error(comm):
            sys.exit(2)
    previous = install_abort_hook(comm)
    try:
        assert sys.excepthook is not previous
    finally:
        sys.excepthook = previous


def test_create_communicator_without_launcher_is_single(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert isinstance(create_communicator(), SingleCommunicator)
    assert isinstance(create_communicator("single"), SingleCommunicator)
    with pytest.raises(ValueError, match="kind must be one of"):
        create_communicator("nccl")


def test_launcher_detection_from_environment():
    assert not launched_by_mpi({})
    assert launched_by_mpi({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    # A batch script has SLURM variables but a one-task step: not an MPI launch.
    assert not launched_by_mpi({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert launched_by_mpi({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8"})
    assert world_size_from_env({"PMI_SIZE": "6"}) == 6
    assert world_size_from_env({"HYDI_CONTROL_FD": "7"}) is None
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert local_rank_from_env({"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "5"}) == 1
    assert local_rank_from_env({}) == 0


def test_launcher_of_one_rank_gives_single_without_mpi():
    # `mpiexec -n 1` announces size 1: no reason to start MPI.
    env_code = textwrap.dedent("""
        import os, sys
        os.environ.update(PMI_RANK="0", PMI_SIZE="1")
        from mpitrain.comm import create_communicator
        comm = create_communicator("auto")
        assert comm.name == "single", comm.name
        assert "mpi4py" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", env_code], check=True, timeout=60)


def test_importing_mpitrain_does_not_start_mpi():
    code = textwrap.dedent("""
        import os, sys
        for name in %r:
            os.environ.pop(name, None)
        import mpitrain, mpitrain.comm, mpitrain.comm.abort, mpitrain.testing
        assert "mpi4py" not in sys.modules, "import started mpi4py"
        comm = mpitrain.comm.create_communicator("auto")
        assert comm.name == "single"
        assert "mpi4py" not in sys.modules, "single communicator imported mpi4py"
        print("clean")
    """ % (LAUNCHER_VARS,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_launcher_announcing_many_tasks_but_world_of_one_is_an_error(tmp_path):
    # A 2-task launcher whose tasks each see an MPI world of 1 must not train
    # silently as independent single ranks.
    import subprocess
    import sys
    code = ("from mpitrain.comm import create_communicator\n"
            "try:\n    create_communicator()\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PMI_", "OMPI_", "MPI_LOCAL", "HYD", "SLURM_", "PMIX_"))}
    env.update({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    if "MPI sees a world of 1" not in out.stdout and "MPI_INIT failed" in out.stderr:
        # e.g. Open MPI 4 in a container without ssh cannot start a singleton at all
        pytest.skip("this MPI library cannot start a process without a launcher here")
    assert "MPI sees a world of 1" in out.stdout, out.stdout + out.stderr
