"""The object wire format: JSON text, never pickle."""

import numpy as np
import pytest

from mpitrain.comm.base import decode_obj, encode_obj
from mpitrain.testing import standin_cupy


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


def test_a_device_array_is_refused_as_cupy_refuses_it():
    # CuPy's arrays are no numpy.ndarray, so JSON cannot take them: a value meant for
    # another rank is read from the device on purpose (backend.to_host) first
    with standin_cupy.installed() as cp:
        for value in (cp.ones(3, dtype=cp.float32), cp.ones(3, dtype=cp.float32).sum()):
            with pytest.raises(TypeError, match="cannot be sent between ranks"):
                encode_obj({"loss": value})
        assert standin_cupy.READS["implicit"] == 0
