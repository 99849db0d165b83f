"""HDF5 helpers: atomic writes and clear errors on read.

A file is written under a temporary name in the same directory, flushed and
fsynced, then renamed over the target, so a crash never leaves a half-written
model or checkpoint under the real name.
"""

from __future__ import annotations

import contextlib
import os


def h5py_module():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a hard dependency
        raise RuntimeError("mpitrain needs h5py: pip install h5py") from exc
    return h5py


@contextlib.contextmanager
def atomic_h5_file(path):
    """Yield an h5py File open for writing; it appears at ``path`` only on success.

    Example::

        with atomic_h5_file("model.h5") as f:
            f["params"] = params
    """
    h5py = h5py_module()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            yield f
            f.flush()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def open_h5_for_reading(path, what: str):
    """Open ``path`` read-only, turning h5py's errors into one clear message."""
    h5py = h5py_module()
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"{path}: not a readable HDF5 {what} ({exc})") from exc


def require_dataset(f, name: str, path, *, what: str):
    if name not in f:
        raise ValueError(f"{path}: {what} has no dataset '{name}'")
    return f[name]


def write_state(group, state: dict) -> None:
    """Store a nested dict: arrays become datasets, scalars attributes, dicts groups.

    Example::

        write_state(f.create_group("optimizer"), {"num_steps": 3, "delta": arr})
    """
    import numpy as np
    for key, value in state.items():
        key = str(key)
        if isinstance(value, dict):
            write_state(group.create_group(key), value)
        elif isinstance(value, np.ndarray):
            group.create_dataset(key, data=value)
        elif value is None:
            group.attrs[key] = "__none__"
        elif isinstance(value, (bool, int, float, str, np.generic)):
            group.attrs[key] = value
        else:
            raise TypeError(f"cannot store {key!r} of type {type(value).__name__} in HDF5")


def read_state(group) -> dict:
    """Inverse of :func:`write_state`."""
    import numpy as np
    state = {}
    for key, value in group.attrs.items():
        if isinstance(value, str) and value == "__none__":
            state[key] = None
        elif isinstance(value, np.generic):
            state[key] = value.item()
        else:
            state[key] = value
    for key, item in group.items():
        state[key] = read_state(item) if hasattr(item, "keys") else item[...]
    return state
