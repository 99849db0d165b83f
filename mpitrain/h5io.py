"""HDF5 helpers: atomic writes, and reads that trust nothing in the file.

A file is written under a temporary name in the same directory, flushed and
fsynced, then renamed over the target, so a crash never leaves a half-written
model or checkpoint under the real name.

Files we read may come from anyone.  HDF5 lets a file declare a dataset of any
shape without storing its bytes (unwritten chunks read as the fill value), so
reading one in full could allocate far more memory than the file holds.  Every
dataset mpitrain reads in full is therefore checked first
(:func:`dataset_problem`): reached by a hard link (no links into other files),
its bytes inside this file (no virtual or external storage), and its declared
size no larger than the bytes actually stored, which are no more than the
file's size.  mpitrain writes datasets uncompressed, so this holds for every
file it writes.
"""

from __future__ import annotations

import contextlib
import os

from .files import atomic_path


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
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            yield f
            f.flush()


def open_h5_for_reading(path, what: str):
    """Open ``path`` read-only, turning h5py's errors into one clear message."""
    h5py = h5py_module()
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"{path}: not a readable HDF5 {what} ({exc})") from exc


def link_problem(group, name: str, path, *, what: str) -> str | None:
    """Why ``group[name]`` may not be followed (missing, or a soft or external link).

    Example::

        problem = link_problem(f, "model", "ckpt.h5", what="checkpoint")   # None if fine
    """
    link = group.get(name, getlink=True)
    where = _member(group, name)
    if link is None:
        return f"{path}: {what} has no '{where}'"
    if not isinstance(link, h5py_module().HardLink):
        # External links open other files; soft links can form cycles.
        return (f"{path}: '{where}' is a link ({type(link).__name__}); only objects stored "
                "in this file are read")
    return None


def dataset_problem(group, name: str, path, *, what: str) -> str | None:
    """Why reading dataset ``group[name]`` in full is unsafe, or None.

    The checks read metadata only; nothing of the dataset's size is allocated.

    Example::

        problem = dataset_problem(f, "params", "final.h5", what="model")
        if problem: raise ValueError(problem)
    """
    problem = link_problem(group, name, path, what=what)
    if problem:
        return problem
    h5py = h5py_module()
    obj = group[name]
    where = _member(group, name)
    if not isinstance(obj, h5py.Dataset):
        return f"{path}: '{where}' is a group, expected a dataset"
    plist = obj.id.get_create_plist()
    if obj.is_virtual or plist.get_external_count():
        return (f"{path}: dataset '{where}' keeps its data outside this file "
                "(virtual or external storage); not accepted")
    declared = _product(obj.shape) * obj.id.get_type().get_size()
    stored = int(obj.id.get_storage_size())
    size = os.path.getsize(obj.file.filename)
    if declared > stored or stored > size:
        return (f"{path}: dataset '{where}' declares shape {obj.shape} ({declared} bytes) but "
                f"the file stores {min(stored, size)} bytes of it (unwritten or compressed "
                "data is not accepted)")
    return None


def require_dataset(f, name: str, path, *, what: str):
    """``f[name]`` after :func:`dataset_problem` found nothing; ValueError otherwise.

    Example::

        params = require_dataset(f, "params", "final.h5", what="model")[...]
    """
    problem = dataset_problem(f, name, path, what=what)
    if problem:
        raise ValueError(problem)
    return f[name]


def _member(group, name: str) -> str:
    parent = group.name.strip("/")
    return f"{parent}/{name}" if parent else name


def _product(shape) -> int:
    n = 1
    for extent in shape or ():
        n *= int(extent)
    return n


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


# Deeper nesting than any state we write means a crafted (or cyclic) file.
MAX_STATE_DEPTH = 16


def read_state(group, path=None, *, what: str = "file", _depth: int = 0) -> dict:
    """Inverse of :func:`write_state`; each dataset is checked before it is read.

    Only hard links are followed, nesting is at most ``MAX_STATE_DEPTH`` groups
    deep, and datasets must hold numbers; ValueError names file and member.

    Example::

        state = read_state(f["ranks/00000"], "ckpt-00000100.h5", what="checkpoint")
    """
    import numpy as np
    path = group.file.filename if path is None else path
    if _depth > MAX_STATE_DEPTH:
        raise ValueError(f"{path}: group '{group.name.strip('/')}' is nested more than "
                         f"{MAX_STATE_DEPTH} deep")
    state = {}
    for key, value in group.attrs.items():
        if isinstance(value, str) and value == "__none__":
            state[key] = None
        elif isinstance(value, np.generic):
            state[key] = value.item()
        else:
            state[key] = value
    h5py = h5py_module()
    for key in group.keys():
        problem = link_problem(group, key, path, what=what)
        if problem:
            raise ValueError(problem)
        item = group[key]
        if isinstance(item, h5py.Group):
            state[key] = read_state(item, path, what=what, _depth=_depth + 1)
            continue
        problem = dataset_problem(group, key, path, what=what)
        if problem:
            raise ValueError(problem)
        if item.dtype.kind not in "biuf":
            raise ValueError(f"{path}: dataset '{_member(group, key)}' has dtype {item.dtype}; "
                             "expected numbers")
        state[key] = item[...]
    return state
