"""Checkpoints: everything needed to continue a run exactly, in one HDF5 file.

Layout::

    /model                      the network (same as a model file)
    /ranks/<r>/optimizer        rank r's optimizer and preconditioner state
    /ranks/<r>/reader           rank r's reader position
    /ranks/<r>/window           rank r's sums of the log window the checkpoint cut
    /ranks/<r>/strategy         rank r's own model, where the ranks' models differ (ADPSGD)
    /strategy                   the parallel strategy's state (identical on all ranks)
    /trainer                    the trainer's own scalars (learning-rate scale, counts)
    attrs: format, step, frames_seen, num_ranks, config (YAML text), checksum

Files are named ``ckpt-<step>.h5`` and written atomically (temporary name,
fsync, rename); only rank 0 writes.  Checkpoints are ordered by the training
they hold (frames seen, then step), not by the step in the name alone: a run
resumed on more ranks numbers its steps lower than the checkpoint it came
from.  Rotation keeps the one just written and the ``keep - 1`` before it,
never fewer than two in all, so a damaged newest still leaves a good one;
checkpoints after the one written belong to a timeline the run abandoned (it
resumed from before them) and go.

Loading validates every declared size before reading (see ``load_checkpoint``)
and then verifies the whole file -- its SHA-256 checksum and that every float
is finite (``h5io.verify_file``; the module docstring there says why a stored
digest and not HDF5's fletcher32) -- before anything is copied into a network.
Files written before checksums existed load unverified.
:func:`load_latest_good_checkpoint` falls back from a damaged newest
checkpoint to the newest one that verifies.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np

from ..data.batcher import POSITION_FIELDS
from ..files import remove_stale_temporaries
from ..h5io import (atomic_h5_file, dataset_problem, h5_reader, h5py_module, link_problem,
                    open_h5_for_reading, read_state, reading_errors, verify_file, write_state)
from ..nn.model_file import ModelMismatchError, read_stored_model, write_model_group
from ..words import shown

__all__ = ["Checkpoint", "MIN_KEEP", "checkpoint_path", "gather_rank_states",
           "list_checkpoints", "load_checkpoint", "load_latest_good_checkpoint",
           "remove_stale_temporaries", "rotate_checkpoints", "save_checkpoint"]

FORMAT = "mpitrain-checkpoint"
_NAME = re.compile(r"ckpt-(\d+)\.h5$")
#: Checkpoints rotation always leaves, so a damaged newest one has a fallback.
MIN_KEEP = 2


def checkpoint_path(run_dir, step: int) -> str:
    return os.path.join(run_dir, f"ckpt-{step:08d}.h5")


def _numbered(run_dir) -> list:
    found = []
    for path in glob.glob(os.path.join(glob.escape(os.fspath(run_dir)), "ckpt-*.h5")):
        m = _NAME.search(os.path.basename(path))
        # a directory of that name is not a checkpoint: never counted, never removed;
        # nor is a named pipe or a device (opening a pipe waits for a writer for ever)
        if m and not (os.path.exists(path) and not os.path.isfile(path)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _progress(path):
    """(frames seen, step) of a checkpoint, by its attributes and name; None when
    the file cannot be read (damaged: it is never a fallback)."""
    try:
        with h5_reader(path) as f:
            frames = f.attrs.get("frames_seen")
            if not isinstance(frames, (int, np.integer)):
                return None
            named = _NAME.search(os.path.basename(os.fspath(path)))
            return int(frames), int(named.group(1)) if named else 0
    except (OSError, ValueError, RuntimeError, TypeError, KeyError):
        return None


def _in_training_order(run_dir) -> list:
    """[(progress, step, path)], oldest first (``progress``: see :func:`_progress`).
    A file that cannot be read keeps its place by step after the readable ones
    of lower steps, so a resume still tries it where its name puts it."""
    ordered, unreadable = [], []
    for step, path in _numbered(run_dir):
        progress = _progress(path)
        (unreadable if progress is None else ordered).append((progress, step, path))
    ordered.sort()
    for entry in unreadable:
        place = max((i + 1 for i, (_, step, _) in enumerate(ordered) if step < entry[1]),
                    default=0)
        ordered.insert(place, entry)
    return ordered


def list_checkpoints(run_dir) -> list:
    """Complete checkpoints in ``run_dir``, oldest first in the training they hold
    (frames seen, then step; an unreadable file by its step)."""
    return [path for _, _, path in _in_training_order(run_dir)]


def _trainer_scalars(state: dict) -> dict:
    """``state`` if it holds only named scalars (what group 'trainer' stores)."""
    for key, value in state.items():
        if not isinstance(key, str) or not (value is None or isinstance(
                value, (bool, int, float, str, np.bool_, np.integer, np.floating))):
            raise TypeError(f"trainer_state[{shown(key)}]: expected a scalar, got "
                            f"{type(value).__name__}")
    return state


def save_checkpoint(path, *, net, step: int, frames_seen: int, config_yaml: str,
                    rank_states: list, strategy_state: dict, class_priors=None,
                    keep: int | None = None, trainer_state: dict | None = None) -> None:
    """Write one checkpoint; ``rank_states[r]`` = {"optimizer": ..., "reader": ...}
    (and ``"window"``, ``"strategy"`` where the trainer has them).

    ``trainer_state``: the trainer's scalars (stored in group 'trainer').
    ``keep``: checkpoints left in the directory, at least ``MIN_KEEP``
    (None or 0: all).  The file gets a checksum; a non-finite float anywhere
    in it is refused (ValueError) before it replaces anything.  A full disk
    raises :class:`~mpitrain.files.DiskFullError` naming ``path``; either
    way no temporary file is left.

    Example::

        save_checkpoint(checkpoint_path(run_dir, 100), net=net, step=100, frames_seen=25600,
                        config_yaml=text, rank_states=[{"optimizer": {}, "reader": {}}],
                        strategy_state={}, keep=3, trainer_state={"lr_scale": 1.0})
    """
    if trainer_state is not None:
        _trainer_scalars(trainer_state)
    if os.path.exists(path) and not os.path.isfile(path):
        # a pipe or a device is written as a stream (files.written_in_place): the
        # checkpoint would wait for a reader for ever, or be lost in /dev/null
        raise ValueError(f"{path}: is not a regular file (a directory, named pipe or "
                         "device), so no checkpoint can be written there; move it out "
                         "of the run directory")
    with atomic_h5_file(path, checksum=True, what="checkpoint") as f:
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
        if trainer_state is not None:
            write_state(f.create_group("trainer"), trainer_state)
    if keep:
        rotate_checkpoints(path, max(int(keep), MIN_KEEP))


def rotate_checkpoints(path, keep: int, *, spare=None) -> None:
    """Keep ``path`` (just written) and the ``keep - 1`` checkpoints before it in
    training order; remove older ones and those after it (an abandoned timeline).
    A file that cannot be read is removed when its step is higher than the one
    written, or lower than the oldest one kept.  ``path`` not named by step
    (``ckpt-<step>.h5``): the newest ``keep`` others are kept, none taken for
    abandoned.  ``spare(path)`` true: a readable checkpoint before ``path`` that
    is kept and not counted (pretraining's layer ends)."""
    written = _progress(path)
    named = _NAME.search(os.path.basename(os.fspath(path)))
    found = [entry for entry in _in_training_order(os.path.dirname(os.path.abspath(path)))
             if os.path.abspath(entry[2]) != os.path.abspath(path)]
    if named is None:
        for _, _, old in found[:-keep]:
            os.remove(old)
        return
    step = int(named.group(1))
    older, unreadable, doomed = [], [], []
    for progress, found_step, found_path in found:
        if written is None:
            # (the file just written cannot be read back: go by the steps alone)
            (doomed if found_step > step else older).append((found_step, found_path))
        elif progress is None:
            if found_step > step:
                doomed.append((found_step, found_path))
            else:
                unreadable.append((found_step, found_path))
        elif progress > written:
            doomed.append((found_step, found_path))
        elif spare is None or not spare(found_path):
            older.append((found_step, found_path))
    cut = max(len(older) - (keep - 1), 0)
    doomed += older[:cut]
    kept_steps = [s for s, _ in older[cut:]] + [step]
    doomed += [(s, p) for s, p in unreadable if s < min(kept_steps)]
    for _, old in doomed:
        os.remove(old)


class Checkpoint:
    """A loaded checkpoint.

    Example::

        ckpt = load_checkpoint(list_checkpoints(run_dir)[-1])
        ckpt.step, ckpt.rank_state(0)["reader"]
    """

    def __init__(self, path, attrs, net, priors, ranks, strategy, trainer=None):
        self.path = path
        self.step = int(attrs["step"])
        self.frames_seen = int(attrs["frames_seen"])
        self.num_ranks = int(attrs["num_ranks"])
        self.config_yaml = str(attrs["config"])
        self.net, self.class_priors = net, priors
        self._ranks, self.strategy_state = ranks, strategy
        # the trainer's own counts (learning-rate scale, roll backs); {} in older files
        self.trainer_state = trainer or {}

    def rank_state(self, rank: int) -> dict:
        return self._ranks[f"{rank:05d}"]


# More ranks than any machine has: a larger count is a damaged or crafted file.
MAX_RANKS = 1 << 20
# State buffers shaped like the flat parameters, checked against the model.
_PARAM_SIZED = {"optimizer": ("delta",),
                "strategy": ("start", "delta", "global_model", "current", "average")}


def _count_attr(f, name: str, path, *, low: int = 0, high: int = 1 << 62) -> int:
    value = f.attrs.get(name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
            or not low <= int(value) <= high:
        raise ValueError(f"{path}: checkpoint attribute '{name}': expected an int in "
                         f"[{low}, {high}], got {shown(value)}")
    return int(value)


def _group(parent, name: str, path):
    problem = link_problem(parent, name, path, what="checkpoint")
    if problem:
        raise ValueError(problem)
    group = parent[name]
    if not isinstance(group, h5py_module().Group):
        raise ValueError(f"{path}: '{group.name.strip('/')}' is a dataset, expected a group")
    return group


def _check_param_sized(group, names, num_params: int, path) -> None:
    """Buffers that must match the model, checked by shape before they are read."""
    for name in names:
        if name in group:
            problem = dataset_problem(group, name, path, what="checkpoint")
            if problem:
                raise ValueError(problem)
            data = group[name]
            if data.shape != (num_params,) or data.dtype.kind != "f":
                raise ValueError(f"{path}: dataset '{data.name.strip('/')}' has shape "
                                 f"{data.shape} and dtype {data.dtype}; expected "
                                 f"({num_params},) floats like the model's parameters")


def _rank_state(ranks, name: str, num_params: int, path) -> dict:
    group = _group(ranks, name, path)
    for part in ("optimizer", "reader"):
        _group(group, part, path)
    _check_param_sized(group["optimizer"], _PARAM_SIZED["optimizer"], num_params, path)
    state = read_state(group, path, what="checkpoint")
    check_reader_state(state["reader"], f"ranks/{name}", path)
    window = state.get("window")
    if window is not None and not _window_sums(window):
        got = (f"shape {window.shape} and dtype {window.dtype}"
               if isinstance(window, np.ndarray) else "a group")
        raise ValueError(f"{path}: 'ranks/{name}/window' has {got}; expected the log "
                         "window's 4 float sums (cross-entropy, correct, frames, skipped "
                         "steps), the last two whole counts")
    return state


def check_reader_state(reader, name: str, path, *, complete: bool = False) -> None:
    """A rank's reader position (``MinibatchStream.state_dict``): each field a
    non-negative int, and with ``complete`` every field there; ValueError naming the
    file and the field.  (A checkpoint's reader may be empty: one written for its
    model alone; a resume names a missing field, ``MinibatchStream.load_state_dict``.)"""
    if not isinstance(reader, dict):
        raise ValueError(f"{path}: '{name}/reader' is not a group of reader positions")
    for key in POSITION_FIELDS if complete else ():
        if key not in reader:
            raise ValueError(f"{path}: field '{name}/reader/{key}' is missing")
    for key, value in reader.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}: field '{name}/reader/{key}': expected a "
                             f"non-negative int, got {shown(value)}")


def _own_models_on_every_rank_or_none(rank_group, names, path) -> None:
    """A rank that restores its own model restarts its exchanges with the others
    (ADPSGD): were it stored for some ranks only, each rank would wait for one that
    does not come.  Every rank reads the whole group, so all refuse the file alike."""
    holding = [name for name in names if isinstance(rank_group.get(name), h5py_module().Group)
               and "strategy/params" in rank_group[name]]
    if holding and len(holding) != len(names):
        lacking = next(name for name in names if name not in holding)
        raise ValueError(f"{path}: 'ranks/{holding[0]}/strategy/params' (a rank's own model) "
                         f"is stored for {len(holding)} of {len(names)} ranks, not for rank "
                         f"{int(lacking)}; expected it for every rank or none")


def _window_sums(window) -> bool:
    """The shape of a rank's log-window sums (``TrainingStep.window_state``)."""
    if not isinstance(window, np.ndarray) or window.shape != (4,) or window.dtype.kind != "f":
        return False
    counts = window[2:]
    return bool(np.all((counts >= 0) & (counts <= 1 << 62) & (counts == np.floor(counts))))


def _trainer_state(f, path) -> dict:
    """Group 'trainer': attributes only (scalars), so nothing of a declared size is read."""
    if "trainer" not in f:
        return {}
    group = _group(f, "trainer", path)
    members = list(group.keys())
    if members:
        raise ValueError(f"{path}: checkpoint group 'trainer' holds '{members[0]}'; "
                         "expected scalars only")
    state = read_state(group, path, what="checkpoint")
    for key, value in state.items():
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ValueError(f"{path}: field 'trainer/{key}': expected a scalar, got "
                             f"{type(value).__name__}")
        if isinstance(value, str) and not key.startswith(_TEXT_PREFIX):
            # (the resume's int() and float() of it named neither file nor field)
            raise ValueError(f"{path}: field 'trainer/{key}': expected a number, got "
                             f"{shown(value)}")
    return state


#: The trainer's only text: where the corpora and init_from were (run_dir.corpus_places).
_TEXT_PREFIX = "place_"


def load_checkpoint(path, *, xp=None, ranks=None, into=None) -> Checkpoint:
    """Read a checkpoint (``ranks``: which ranks' state to read; default all).

    With ``into`` (a network) the stored model must be that network's
    (else :class:`~mpitrain.nn.model_file.ModelMismatchError`), and its
    parameters are loaded into it: no second network is built.

    The model is checked as in :func:`~mpitrain.nn.model_file.read_stored_model`;
    rank count, rank names, and the optimizer and strategy buffers are checked
    against it, and every dataset against the bytes the file stores, before
    anything is read.  Then the whole file, every rank's part included, is
    verified (checksum, finite floats; ``h5io.verify_file``), so all ranks
    judge a file alike; only then is ``into`` written.  Errors are one line
    naming the file and the field.

    Example::

        ckpt = load_checkpoint("runs/x/ckpt-00000100.h5", ranks=[0])
    """
    xp = np if xp is None else xp
    with open_h5_for_reading(path, "checkpoint") as f, reading_errors(path, "checkpoint"):
        fmt = f.attrs.get("format")
        if not isinstance(fmt, str) or fmt != FORMAT:
            raise ValueError(f"{path}: not an mpitrain checkpoint (attribute 'format' is "
                             f"{shown(fmt)})")
        if "model" not in f or "ranks" not in f:
            raise ValueError(f"{path}: checkpoint lacks the 'model' or 'ranks' group")
        attrs = {"step": _count_attr(f, "step", path),
                 "frames_seen": _count_attr(f, "frames_seen", path),
                 "num_ranks": _count_attr(f, "num_ranks", path, low=1, high=MAX_RANKS),
                 "config": f.attrs.get("config")}
        named = _NAME.search(os.path.basename(os.fspath(path)))
        if named and int(named.group(1)) != attrs["step"]:
            # (a copy under another checkpoint's name, or a crafted file: resumed, it
            # takes its place in the order by its name and its step by the attribute)
            raise ValueError(f"{path}: checkpoint attribute 'step' is {attrs['step']}, but "
                             f"the file's name says step {int(named.group(1))}")
        if not isinstance(attrs["config"], str):
            raise ValueError(f"{path}: checkpoint attribute 'config': expected YAML text, "
                             f"got {type(attrs['config']).__name__}")
        model = read_stored_model(_group(f, "model", path), path)
        if into is not None:
            model.check_fits(into)
        num_params = int(model.arrays["params"].shape[0])
        rank_group = _group(f, "ranks", path)
        stored = list(rank_group.keys())
        expected = [f"{r:05d}" for r in range(attrs["num_ranks"])]
        if sorted(stored) != expected:
            raise ValueError(f"{path}: group 'ranks' holds {len(stored)} entries; expected "
                             f"ranks 00000..{expected[-1]} (attribute 'num_ranks' is "
                             f"{attrs['num_ranks']})")
        _own_models_on_every_rank_or_none(rank_group, stored, path)
        names = stored if ranks is None else [f"{r:05d}" for r in ranks]
        rank_states = {}
        for name in names:
            if name not in rank_group:
                raise ValueError(f"{path}: no state for rank {int(name)} in group 'ranks'")
            rank_states[name] = _rank_state(rank_group, name, num_params, path)
        strategy = {}
        if "strategy" in f:
            group = _group(f, "strategy", path)
            _check_param_sized(group, _PARAM_SIZED["strategy"], num_params, path)
            strategy = read_state(group, path, what="checkpoint")
        trainer = _trainer_state(f, path)
        verify_file(f, path, what="checkpoint")
    net, priors = model.install(xp=xp, into=into)
    return Checkpoint(path, attrs, net, priors, rank_states, strategy, trainer)


def load_latest_good_checkpoint(run_dir, *, ranks=None, into=None, xp=None):
    """The newest checkpoint in ``run_dir`` that verifies, and the newer ones skipped.

    Returns ``(checkpoint, skipped)``, ``skipped`` a list of ``(path, reason)``
    for each newer checkpoint that failed to load, newest first; ``reason``
    is the one-line error without the path.  Loads as :func:`load_checkpoint`
    (``ranks``, ``into``, ``xp``); a file that fails leaves ``into`` as it
    was, since it is written only after the whole file verified.  A model that
    does not fit ``into`` is not damage: its ModelMismatchError is raised at
    once.  ValueError (one line listing every file tried and why) if none
    verifies or there is none.

    Example::

        ckpt, skipped = load_latest_good_checkpoint("runs/x", ranks=[0], into=net)
        # skipped: [("runs/x/ckpt-00000200.h5", "damaged checkpoint: the data of ...")]
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"{run_dir}: no checkpoint (ckpt-*.h5) found")
    skipped = []
    for path in reversed(found):
        try:
            return load_checkpoint(path, xp=xp, ranks=ranks, into=into), skipped
        except ModelMismatchError:
            raise
        except (ValueError, OSError) as exc:
            reason = str(exc)
            if reason.startswith(f"{path}: "):
                reason = reason[len(f"{path}: "):]
            skipped.append((path, reason))
    tried = "; ".join(f"{os.path.basename(p)} ({reason})" for p, reason in skipped)
    raise ValueError(f"{run_dir}: no checkpoint verifies; tried {tried}")


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
