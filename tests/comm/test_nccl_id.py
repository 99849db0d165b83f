"""NCCL unique ids: every form CuPy has used, through bytes and back."""

import pytest

from mpitrain.comm import nccl_id


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


@pytest.mark.gpu
def test_this_cupys_nccl_takes_its_own_unique_id_and_reduces_on_one_rank(cp):
    """With the CuPy installed: get_unique_id's form (bytes from CuPy 14, a tuple
    before) goes through bytes into a one-rank NcclCommunicator, and allReduce,
    bcast and destroy take the arguments the NCCL route passes.  Two ranks on one
    GPU fall back from NCCL, so a one-GPU machine exercises the binding only here."""
    import numpy as np

    from mpitrain import backend
    from mpitrain.comm import gpu

    nccl = backend.nccl_module(cp)
    if nccl is None:
        pytest.skip("this CuPy has no usable NCCL binding")
    raw, form = nccl_id.unique_id_to_bytes(nccl.get_unique_id())
    if cp.__version__.split(".")[0].isdigit() and int(cp.__version__.split(".")[0]) >= 14:
        assert form == nccl_id.ID_AS_BYTES
    collectives = gpu.NcclCollectives(
        nccl, gpu._communicator_in_any_form(nccl, 1, 0, raw, form), cp)
    try:
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            buf = cp.arange(5, dtype=dtype)
            collectives.allreduce_(buf, "sum")
            collectives.bcast_(buf, 0)
            assert backend.to_host(buf).tolist() == list(range(5))
        buf = cp.ones(3, dtype=cp.float32)
        done, wait = collectives.iallreduce_(buf, "max")
        wait()
        assert done() and backend.to_host(buf).tolist() == [1.0, 1.0, 1.0]
    finally:
        collectives.destroy()
