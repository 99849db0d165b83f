"""NCCL unique ids as plain bytes, whatever form the CuPy release uses.

``cupy.cuda.nccl.get_unique_id()`` returned a tuple of 128 signed chars up to
CuPy 13 and returns ``bytes`` from CuPy 14, and ``NcclCommunicator`` takes
the form of its own release.  Ranks therefore exchange the id as 128 raw
bytes plus the form rank 0 got, and each rank rebuilds that form (or another
one its CuPy accepts) before creating its communicator.  No MPI here, so the
conversions can be tested without a launcher.

Example::

    raw, form = unique_id_to_bytes(nccl.get_unique_id())    # 128 bytes, ID_AS_BYTES
    unique_id_from_bytes(raw, ID_AS_SIGNED)[:2]             # e.g. (-98, 12)
"""

from __future__ import annotations

NCCL_UNIQUE_ID_BYTES = 128

#: The forms a unique id takes: bytes (CuPy 14), a tuple of signed chars
#: (CuPy 12/13), or a tuple of unsigned chars (other bindings).
ID_AS_BYTES, ID_AS_SIGNED, ID_AS_UNSIGNED = 0, 1, 2
ID_FORMS = (ID_AS_BYTES, ID_AS_SIGNED, ID_AS_UNSIGNED)
ID_FORM_NAMES = {ID_AS_BYTES: "bytes", ID_AS_SIGNED: "tuple of signed chars",
                 ID_AS_UNSIGNED: "tuple of unsigned chars"}


def unique_id_to_bytes(uid) -> tuple[bytes, int]:
    """``(128 raw bytes, form)`` of an id given as bytes/bytearray or a tuple/list of ints.

    A sequence with a value above 127 is unsigned; otherwise it counts as
    signed (CuPy's own form), which reads the same bytes either way.

    Example::

        unique_id_to_bytes((-1,) + (0,) * 127)    # (b'\\xff\\x00...', ID_AS_SIGNED)
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        raw, form = bytes(uid), ID_AS_BYTES
    elif isinstance(uid, (tuple, list)):
        values = [int(value) for value in uid]
        if any(not -128 <= value <= 255 for value in values):
            raise ValueError("NCCL unique id: values must be chars (-128..255), got "
                             f"{min(values)}..{max(values)}")
        if any(value < 0 for value in values) and any(value > 127 for value in values):
            raise ValueError("NCCL unique id: mixes negative values and values above 127")
        raw = bytes(value & 0xFF for value in values)
        form = ID_AS_UNSIGNED if any(value > 127 for value in values) else ID_AS_SIGNED
    else:
        raise TypeError(f"NCCL unique id: expected bytes or a tuple of ints, "
                        f"got {type(uid).__name__}")
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id: expected {NCCL_UNIQUE_ID_BYTES} bytes, "
                         f"got {len(raw)}")
    return raw, form


def unique_id_from_bytes(raw: bytes, form: int):
    """The id in ``form`` (one of :data:`ID_FORMS`) from its raw bytes.

    Example::

        unique_id_from_bytes(b"\\xff" * 128, ID_AS_SIGNED)[0]      # -1
        unique_id_from_bytes(b"\\xff" * 128, ID_AS_UNSIGNED)[0]    # 255
    """
    raw = bytes(raw)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id: expected {NCCL_UNIQUE_ID_BYTES} bytes, "
                         f"got {len(raw)}")
    if form == ID_AS_BYTES:
        return raw
    if form == ID_AS_SIGNED:
        return tuple(value - 256 if value > 127 else value for value in raw)
    if form == ID_AS_UNSIGNED:
        return tuple(raw)
    raise ValueError(f"NCCL unique id: unknown form {form!r}; expected one of {ID_FORMS}")


def forms_to_try(first: int) -> list[int]:
    """``first`` (the form rank 0's CuPy produced), then the other forms.

    Example::

        forms_to_try(ID_AS_SIGNED)    # [ID_AS_SIGNED, ID_AS_BYTES, ID_AS_UNSIGNED]
    """
    return [first] + [form for form in ID_FORMS if form != first]
