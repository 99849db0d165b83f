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
