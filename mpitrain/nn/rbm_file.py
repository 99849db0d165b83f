"""Saving and loading pretrained RBM stacks as HDF5 (no pickle).

A stack file holds, in one group: attribute ``format`` = ``mpitrain-rbm-stack``,
``layers`` (JSON: each RBM's visible type and dimensions), ``feat_dim`` and
the splicing context; datasets ``layer_NNN`` (each RBM's flat parameters,
``[W | b]`` then the visible bias) and the CMVN the first layer was trained
with, and (attribute ``speaker_cmvn``, JSON) the per-speaker CMVN of the
corpus it was trained on: ``null`` or ``{"norm_vars": bool}``.  Files are written atomically with a SHA-256 checksum, like model files
(:mod:`mpitrain.nn.model_file`), and every declared size is checked against
the stored datasets and fixed bounds before anything is allocated; then the
whole file is verified.
"""

from __future__ import annotations

import json

import numpy as np

from ..backend import to_host
from ..h5io import (atomic_h5_file, link_problem, open_h5_for_reading, reading_errors,
                    require_dataset, verify_file)
from ..state_fields import FLOAT32_MAX
from ..words import shown
from .model_file import (MAX_CONTEXT, MAX_FEAT_DIM, MAX_LAYER_DIM, MAX_PARAMS, _speaker_cmvn,
                         check_cmvn_scale, check_version)
from .rbm import RBM, UNRECORDED, VISIBLE_TYPES, RBMStack

FORMAT = "mpitrain-rbm-stack"
VERSION = 1
MAX_LAYERS = 100


def write_stack_group(group, stack: RBMStack) -> None:
    """Write ``stack`` into an open HDF5 group (also used inside pretraining checkpoints)."""
    group.attrs["format"] = FORMAT
    group.attrs["version"] = VERSION
    group.attrs["layers"] = json.dumps([rbm.spec() for rbm in stack.rbms])
    group.attrs["feat_dim"] = stack.feat_dim
    group.attrs["left_context"] = stack.left_context
    group.attrs["right_context"] = stack.right_context
    for i, rbm in enumerate(stack.rbms):
        group[f"layer_{i:03d}"] = to_host(rbm.params)
    group["cmvn_mean"] = np.asarray(stack.cmvn_mean, dtype=np.float32)
    group["cmvn_scale"] = np.asarray(stack.cmvn_scale, dtype=np.float32)
    if stack.speaker_cmvn != UNRECORDED:
        # (JSON null: the corpus had none; absent: a file older than this record)
        group.attrs["speaker_cmvn"] = json.dumps(
            None if stack.speaker_cmvn is None
            else {"norm_vars": bool(stack.speaker_cmvn.get("norm_vars", False))})


def _int_attr(group, name, path, low, high) -> int:
    value = group.attrs.get(name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
            or not low <= int(value) <= high:
        raise ValueError(f"{path}: RBM stack attribute '{name}': expected an int in "
                         f"[{low}, {high}], got {shown(value)}")
    return int(value)


def _layer_specs(group, path) -> list:
    text = group.attrs.get("layers")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        specs = json.loads(text) if isinstance(text, str) and len(text) < 1 << 20 else None
    except (json.JSONDecodeError, RecursionError):
        specs = None
    if not isinstance(specs, list) or len(specs) > MAX_LAYERS:
        raise ValueError(f"{path}: RBM stack attribute 'layers': expected JSON, a list of at "
                         f"most {MAX_LAYERS} layer specs")
    for i, spec in enumerate(specs):
        where = f"{path}: RBM stack attribute 'layers': layer {i}"
        if not isinstance(spec, dict) or spec.get("visible") not in VISIBLE_TYPES:
            raise ValueError(f"{where}: expected a mapping with 'visible' one of "
                             f"{', '.join(VISIBLE_TYPES)}")
        for key in ("visible_dim", "hidden_dim"):
            dim = spec.get(key)
            if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= MAX_LAYER_DIM:
                raise ValueError(f"{where}: field '{key}': expected an int in "
                                 f"[1, {MAX_LAYER_DIM}], got {dim!r}")
    return specs


def read_stack_group(group, path, *, xp=np) -> RBMStack:
    """The stack in an HDF5 group, every size checked before it is read.

    Example::

        with h5py.File("pretrain.h5", "r") as f:
            stack = read_stack_group(f, "pretrain.h5")
    """
    fmt = group.attrs.get("format")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise ValueError(f"{path}: not an mpitrain RBM stack (attribute 'format' is "
                         f"{fmt!r}, expected {FORMAT!r})")
    check_version(group, path, what="RBM stack", newest=VERSION)
    specs = _layer_specs(group, path)
    feat_dim = _int_attr(group, "feat_dim", path, 1, MAX_FEAT_DIM)
    left = _int_attr(group, "left_context", path, 0, MAX_CONTEXT)
    right = _int_attr(group, "right_context", path, 0, MAX_CONTEXT)
    speaker_cmvn = _speaker_cmvn(group, path, what="RBM stack", null=True) \
        if "speaker_cmvn" in group.attrs else UNRECORDED
    shapes = [spec["hidden_dim"] * (spec["visible_dim"] + 1) + spec["visible_dim"]
              for spec in specs]
    if sum(shapes) > MAX_PARAMS:
        raise ValueError(f"{path}: RBM stack attribute 'layers' declares {sum(shapes)} "
                         f"parameters; at most {MAX_PARAMS} are accepted")
    arrays = {}
    for name, length in [(f"layer_{i:03d}", n) for i, n in enumerate(shapes)] \
            + [("cmvn_mean", feat_dim), ("cmvn_scale", feat_dim)]:
        data = require_dataset(group, name, path, what="RBM stack")
        if data.shape != (length,) or data.dtype.kind != "f":
            raise ValueError(f"{path}: dataset '{name}' has shape {data.shape} and dtype "
                             f"{data.dtype}; expected ({length},) floats")
        arrays[name] = data[...]
        outside = ~(np.abs(arrays[name]) <= FLOAT32_MAX)
        if name.startswith("layer_") and outside.any():
            # (a float64 of 1e300 is finite in the file and infinite in the float32 layer)
            index = int(np.flatnonzero(outside)[0])
            raise ValueError(f"{path}: dataset '{name}' holds {arrays[name][index]:g} at index "
                             f"{index}; expected finite floats within float32's range")
    check_cmvn_scale(arrays["cmvn_scale"], path)
    rbms = []
    for i, spec in enumerate(specs):
        rbm = RBM(spec["visible_dim"], spec["hidden_dim"], visible=spec["visible"], xp=xp)
        rbm.params[...] = xp.asarray(arrays[f"layer_{i:03d}"].astype(np.float32))
        rbms.append(rbm)
    try:
        return RBMStack(rbms, feat_dim=feat_dim, left_context=left, right_context=right,
                        cmvn_mean=arrays["cmvn_mean"], cmvn_scale=arrays["cmvn_scale"],
                        speaker_cmvn=speaker_cmvn)
    except ValueError as exc:
        raise ValueError(f"{path}: RBM stack attribute 'layers': {exc}") from None


def save_rbm_stack(path, stack: RBMStack) -> None:
    """Example::

        save_rbm_stack("runs/pretrain/pretrain.h5", stack)
    """
    with atomic_h5_file(path, checksum=True, what="RBM stack") as f:
        write_stack_group(f, stack)


def load_rbm_stack(path, *, xp=np) -> RBMStack:
    """Read, check and verify (checksum, finite values) a stack file, or the stack
    of a pretraining checkpoint written at the end of a layer (one written inside
    a layer is refused: its top RBM is part-trained).

    Example::

        stack = load_rbm_stack("runs/pretrain/pretrain.h5")
        [rbm.hidden_dim for rbm in stack.rbms]
    """
    with open_h5_for_reading(path, "RBM stack") as f, reading_errors(path, "RBM stack"):
        group, done = f, None
        if "stack" in f:            # a pretraining checkpoint
            problem = link_problem(f, "stack", path, what="RBM stack")
            if problem:
                raise ValueError(problem)
            group = f["stack"]
            # it also holds the RBM being trained when it was written
            done = _int_attr(f, "layer", path, 0, MAX_LAYERS)
        stack = read_stack_group(group, path, xp=xp)
        if done is not None and len(stack.rbms) > done:
            raise ValueError(
                f"{path}: a pretraining checkpoint written during layer {done + 1} (step "
                f"{f.attrs.get('layer_step')} of {f.attrs.get('layer_steps')}), whose RBM is "
                "not fully trained; use the run's pretrain.h5, or a checkpoint written at "
                "the end of a layer")
        verify_file(f, path, what="RBM stack")
    return stack
