"""Checkpoints: everything needed to continue a run exactly, in one HDF5 file.

Layout::

    /model                      the network (same as a model file)
    /ranks/<r>/optimizer        rank r's optimizer and preconditioner state
    /ranks/<r>/reader           rank r's reader position
    /strategy                   the parallel strategy's state (identical on all ranks)
    attrs: format, step, frames_seen, num_ranks, config (YAML text)

Files are named ``ckpt-<step>.h5`` and written atomically (temporary name,
fsync, rename); only the newest ``keep`` are kept.  Only rank 0 writes.
"""

from __future__ import annotations

import glob
import os
import re

from ..h5io import atomic_h5_file, open_h5_for_reading, read_state, write_state
from ..nn.model_file import read_model_group, write_model_group

FORMAT = "mpitrain-checkpoint"
_NAME = re.compile(r"ckpt-(\d+)\.h5$")


def checkpoint_path(run_dir, step: int) -> str:
    return os.path.join(run_dir, f"ckpt-{step:08d}.h5")


def list_checkpoints(run_dir) -> list:
    """Complete checkpoints in ``run_dir``, oldest first."""
    found = []
    for path in glob.glob(os.path.join(run_dir, "ckpt-*.h5")):
        m = _NAME.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def save_checkpoint(path, *, net, step: int, frames_seen: int, config_yaml: str,
                    rank_states: list, strategy_state: dict, class_priors=None,
                    keep: int | None = None) -> None:
    """Write one checkpoint; ``rank_states[r]`` = {"optimizer": ..., "reader": ...}.

    Example::

        save_checkpoint(checkpoint_path(run_dir, 100), net=net, step=100, frames_seen=25600,
                        config_yaml=text, rank_states=[{"optimizer": {}, "reader": {}}],
                        strategy_state={}, keep=3)
    """
    with atomic_h5_file(path) as f:
        f.attrs["format"] = FORMAT
        f.attrs["step"] = int(step)
        f.attrs["frames_seen"] = int(frames_seen)
        f.attrs["num_ranks"] = len(rank_states)
        f.attrs["config"] = config_yaml
        write_model_group(f.create_group("model"), net, class_priors=class_priors)
        ranks = f.create_group("ranks")
        for r, state in enumerate(rank_states):
            write_state(ranks.create_group(f"{r:05d}"), state)
        write_state(f.create_group("strategy"), strategy_state)
    if keep:
        for old in list_checkpoints(os.path.dirname(os.path.abspath(path)))[:-keep]:
            os.remove(old)


class Checkpoint:
    """A loaded checkpoint.

    Example::

        ckpt = load_checkpoint(list_checkpoints(run_dir)[-1])
        ckpt.step, ckpt.rank_state(0)["reader"]
    """

    def __init__(self, path, attrs, net, priors, ranks, strategy):
        self.path = path
        self.step = int(attrs["step"])
        self.frames_seen = int(attrs["frames_seen"])
        self.num_ranks = int(attrs["num_ranks"])
        self.config_yaml = str(attrs["config"])
        self.net, self.class_priors = net, priors
        self._ranks, self.strategy_state = ranks, strategy

    def rank_state(self, rank: int) -> dict:
        return self._ranks[f"{rank:05d}"]


def load_checkpoint(path, *, xp=None, ranks=None) -> Checkpoint:
    """Read a checkpoint (``ranks``: which ranks' state to read; default all)."""
    import numpy as np
    xp = np if xp is None else xp
    with open_h5_for_reading(path, "checkpoint") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path}: not an mpitrain checkpoint (attribute 'format' is "
                             f"{f.attrs.get('format')!r})")
        if "model" not in f or "ranks" not in f:
            raise ValueError(f"{path}: checkpoint lacks the 'model' or 'ranks' group")
        net, priors = read_model_group(f["model"], path, xp=xp)
        names = list(f["ranks"].keys()) if ranks is None else [f"{r:05d}" for r in ranks]
        rank_states = {}
        for name in names:
            if name not in f["ranks"]:
                raise ValueError(f"{path}: no state for rank {int(name)} in group 'ranks'")
            rank_states[name] = read_state(f["ranks"][name])
        strategy = read_state(f["strategy"]) if "strategy" in f else {}
        return Checkpoint(path, dict(f.attrs), net, priors, rank_states, strategy)


_ARRAY_TAG = 7301


def _skeleton(state: dict, arrays: list) -> dict:
    """JSON-able copy of ``state`` with arrays replaced by their shape and dtype."""
    import numpy as np
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _skeleton(value, arrays)
        elif isinstance(value, np.ndarray):
            arrays.append(np.ascontiguousarray(value))
            out[key] = {"__array__": [list(value.shape), value.dtype.str]}
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    return out


def _fill(skeleton: dict, receive) -> dict:
    out = {}
    for key, value in skeleton.items():
        if isinstance(value, dict) and "__array__" in value:
            shape, dtype = value["__array__"]
            out[key] = receive(tuple(shape), dtype)
        elif isinstance(value, dict):
            out[key] = _fill(value, receive)
        else:
            out[key] = value
    return out


def gather_rank_states(comm, state: dict):
    """Collect every rank's state dict on rank 0 (others get None).

    Scalars travel as JSON, arrays as raw buffers in a fixed order, so no
    pickling is involved and large optimizer buffers are not re-encoded.
    """
    import numpy as np
    if comm.size == 1:
        return [state]
    arrays: list = []
    skeletons = comm.gather_obj(_skeleton(state, arrays), root=0)
    if comm.rank != 0:
        for array in arrays:
            comm.send(array, 0, tag=_ARRAY_TAG)
        return None
    states = [state]
    for source in range(1, comm.size):
        def receive(shape, dtype, source=source):
            buf = np.empty(shape, dtype=np.dtype(dtype))
            comm.recv(buf, source, tag=_ARRAY_TAG)
            return buf
        states.append(_fill(skeletons[source], receive))
    return states
