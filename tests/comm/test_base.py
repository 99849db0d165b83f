"""The object wire format: JSON text, never pickle."""

import numpy as np

from mpitrain.comm.base import decode_obj, encode_obj


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
