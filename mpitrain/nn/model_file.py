"""Saving and loading models as HDF5 (no pickle).

A model file holds the component specs (JSON in an attribute), the flat
parameter buffer, the input transform (CMVN, context) and, optionally, the
class priors used to turn posteriors into pseudo log-likelihoods.

Model files may come from anyone, so loading checks every declared size
(layer widths, context, parameter count, vector lengths) against the stored
datasets and fixed bounds before the network allocates anything.  The whole
file is then verified (:func:`~mpitrain.h5io.verify_file`: its SHA-256
checksum and finite values; files written before checksums load unverified)
before anything reaches a network, so a damaged file leaves the network as
it was.
"""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

from ..backend import to_host
from ..h5io import (atomic_h5_file, link_problem, open_h5_for_reading, reading_errors,
                    require_dataset, verify_file)
from ..words import shown
from .network import ABSOLUTE_VARIANCE_FLOOR, Network, build_component

FORMAT = "mpitrain-model"
VERSION = 1


def write_model_group(group, net: Network, *, class_priors=None) -> None:
    """Write ``net`` into an open HDF5 group (also used inside checkpoints)."""
    group.attrs["format"] = FORMAT
    group.attrs["version"] = VERSION
    group.attrs["components"] = json.dumps(net.specs())
    group.attrs["feat_dim"] = net.feat_dim
    group.attrs["left_context"] = net.left_context
    group.attrs["right_context"] = net.right_context
    group["params"] = to_host(net.params)
    group["cmvn_mean"] = to_host(net.cmvn_mean)
    group["cmvn_scale"] = to_host(net.cmvn_scale)
    if class_priors is not None:
        group["class_priors"] = np.asarray(class_priors, dtype=np.float64)
    if net.speaker_cmvn is not None:
        group.attrs["speaker_cmvn"] = json.dumps(
            {"norm_vars": bool(net.speaker_cmvn.get("norm_vars", False))})


# Bounds on what a model file may declare, checked before anything is allocated.
# They are far above any acoustic model (Kaldi's widest layers are a few
# thousand units) and keep a crafted file from asking for hundreds of GiB.
MAX_FEAT_DIM = 1 << 16
MAX_CONTEXT = 1000             # frames on each side
MAX_LAYER_DIM = 1 << 20
MAX_COMPONENTS = 1000
MAX_PARAMS = 1 << 31           # 8 GiB of float32
_MAX_SPEC_CHARS = 1 << 20


def _attr(group, name, path):
    if name not in group.attrs:
        raise ValueError(f"{path}: model attribute '{name}' is missing")
    return group.attrs[name]


def _int_attr(group, name, path, low, high) -> int:
    value = _attr(group, name, path)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
            or not low <= int(value) <= high:
        raise ValueError(f"{path}: model attribute '{name}': expected an int in "
                         f"[{low}, {high}], got {shown(value)}")
    return int(value)


def check_version(group, path, *, what: str, newest: int) -> None:
    """Refuse a file written in a newer format than this program reads (a file
    without the attribute is read as the first version)."""
    if "version" not in group.attrs:
        return
    version = group.attrs["version"]
    if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)) \
            or int(version) < 1:
        raise ValueError(f"{path}: {what} attribute 'version': expected a positive int, "
                         f"got {shown(version)}")
    if int(version) > newest:
        raise ValueError(f"{path}: {what} format version {int(version)} is newer than this "
                         f"mpitrain reads (up to {newest}); use a newer mpitrain")


def _component_specs(group, path) -> list:
    text = _attr(group, "components", path)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or len(text) > _MAX_SPEC_CHARS:
        raise ValueError(f"{path}: model attribute 'components': expected JSON text of at "
                         f"most {_MAX_SPEC_CHARS} characters")
    try:
        specs = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: model attribute 'components' is not JSON "
                         f"({type(exc).__name__})") from None
    if not isinstance(specs, list) or not 1 <= len(specs) <= MAX_COMPONENTS:
        raise ValueError(f"{path}: model attribute 'components': expected a list of 1 to "
                         f"{MAX_COMPONENTS} component specs")
    for i, spec in enumerate(specs):
        where = f"{path}: model attribute 'components': component {i}"
        if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
            raise ValueError(f"{where}: expected a mapping with a 'kind'")
        for key in ("in_dim", "out_dim"):
            dim = spec.get(key)
            if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= MAX_LAYER_DIM:
                raise ValueError(f"{where} ({spec['kind']}): field '{key}': expected an int in "
                                 f"[1, {MAX_LAYER_DIM}], got {dim!r}")
        for key, value in spec.items():
            # Options are plain numbers or flags; anything else is not ours.
            if key != "kind" and not _finite_option(value):
                raise ValueError(f"{where} ({spec['kind']}): field '{key}': expected a finite "
                                 f"number, got {shown(value, limit=40)}")
    return specs


def _finite_option(value) -> bool:
    """A flag, or a number a float holds (JSON's integers have no bound, and the
    layers take their options as floats)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        try:
            return math.isfinite(float(value))
        except OverflowError:
            return False
    return False


def _build_components(specs, path) -> list:
    components = []
    for i, spec in enumerate(specs):
        try:
            # Constructors only record dimensions; parameters come with the Network.
            components.append(build_component(spec))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: model attribute 'components': component {i}: "
                             f"{exc}") from None
    return components


def _float_vector(group, name, path, length: int, *, what: str):
    """The 1-D float dataset ``name``, checked for shape and storage before reading."""
    data = require_dataset(group, name, path, what="model")
    if data.shape != (length,) or data.dtype.kind != "f":
        raise ValueError(f"{path}: dataset '{name}' has shape {data.shape} and dtype "
                         f"{data.dtype}; expected {length} floats ({what})")
    return data[...]


class ModelMismatchError(ValueError):
    """The stored model is not the network it is to be loaded into (not damage)."""


class StoredModel:
    """A model read and checked from a file, not yet in any network.

    Example::

        stored = read_stored_model(f, "final.h5")
        net, priors = stored.install()
    """

    def __init__(self, path, components, feat_dim, left, right, arrays, priors,
                 speaker_cmvn=None):
        self.speaker_cmvn = speaker_cmvn
        self.path, self.components = path, components
        self.feat_dim, self.left_context, self.right_context = feat_dim, left, right
        self.arrays, self.class_priors = arrays, priors

    def check_fits(self, into: Network) -> None:
        """ModelMismatchError unless ``into`` has these layers, feature dim and context."""
        stored = ([c.spec() for c in self.components], self.feat_dim, self.left_context,
                  self.right_context)
        wanted = (into.specs(), into.feat_dim, into.left_context, into.right_context)
        if stored != wanted:
            mine, theirs = _describe(*stored), _describe(*wanted)
            if mine == theirs:          # the same outline: name the first component that differs
                i = next(i for i, (a, b) in enumerate(zip(stored[0], wanted[0])) if a != b)
                mine += f"; component {i}: {_spec_text(stored[0][i])}"
                theirs += f"; component {i}: {_spec_text(wanted[0][i])}"
            raise ModelMismatchError(f"{self.path}: the stored model ({mine}) is not the "
                                     f"one the config builds ({theirs})")

    def install(self, *, xp=np, into: Network | None = None):
        """Return (network, class_priors): ``into`` filled in, or a new network."""
        if into is not None:
            self.check_fits(into)
            net, xp = into, into.xp
        else:
            try:
                net = Network(self.components, feat_dim=self.feat_dim,
                              left_context=self.left_context,
                              right_context=self.right_context, xp=xp)
            except ValueError as exc:
                raise ValueError(f"{self.path}: model attribute 'components': {exc}") from None
        net.params[...] = xp.asarray(self.arrays["params"])
        net.cmvn_mean[...] = xp.asarray(self.arrays["cmvn_mean"])
        net.cmvn_scale[...] = xp.asarray(self.arrays["cmvn_scale"])
        net.speaker_cmvn = None if self.speaker_cmvn is None else dict(self.speaker_cmvn)
        return net, self.class_priors


#: The files of a pretraining run, which hold RBMs and no model: what each is.
_PRETRAINING_FORMATS = {"mpitrain-rbm-stack": "an RBM stack",
                        "mpitrain-pretrain-checkpoint": "a checkpoint"}


def read_stored_model(group, path) -> StoredModel:
    """Read the model in an HDF5 group into host arrays, checking it first.

    Every declared size is checked against the stored datasets and the bounds
    above before anything of that size is read; errors name the file and the
    field.  Nothing is verified against the checksum here: that is the whole
    file's (:func:`load_model`, checkpoints).

    Example::

        with h5py.File("final.h5", "r") as f:
            stored = read_stored_model(f, "final.h5")
    """
    fmt = group.attrs.get("format")
    if isinstance(fmt, bytes):      # a fixed-length string, as other HDF5 writers store it
        fmt = fmt.decode("utf-8", "replace")
    if isinstance(fmt, str) and fmt in _PRETRAINING_FORMATS:
        raise ValueError(f"{path}: {_PRETRAINING_FORMATS[fmt]} of `mpitrain pretrain`, not a "
                         "model: train a model from the run's pretrain.h5 (--set "
                         "model.init_from=RUN/pretrain.h5) and give that")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise ValueError(f"{path}: not an mpitrain model (attribute 'format' is "
                         f"{shown(fmt)}, expected {FORMAT!r})")
    # before the checksum is verified: a newer format may sum its contents otherwise
    check_version(group, path, what="model", newest=VERSION)
    components = _build_components(_component_specs(group, path), path)
    feat_dim = _int_attr(group, "feat_dim", path, 1, MAX_FEAT_DIM)
    left = _int_attr(group, "left_context", path, 0, MAX_CONTEXT)
    right = _int_attr(group, "right_context", path, 0, MAX_CONTEXT)
    num_params = sum(int(c.num_params) for c in components)
    if num_params > MAX_PARAMS:
        raise ValueError(f"{path}: model attribute 'components' declares {num_params} "
                         f"parameters; at most {MAX_PARAMS} are accepted")
    params = require_dataset(group, "params", path, what="model")
    if params.shape != (num_params,) or params.dtype.kind != "f":
        raise ValueError(f"{path}: dataset 'params' has shape {params.shape} and dtype "
                         f"{params.dtype}; the stored components need ({num_params},) floats")
    num_classes = components[-1].out_dim
    cmvn_mean = _float_vector(group, "cmvn_mean", path, feat_dim, what="feat_dim")
    cmvn_scale = _float_vector(group, "cmvn_scale", path, feat_dim, what="feat_dim")
    check_cmvn_scale(cmvn_scale, path)
    priors = None
    if "class_priors" in group:
        priors = _float_vector(group, "class_priors", path, num_classes,
                               what="one per output class")
        # shares of the training frames: a negative or an all-zero set is damage
        # (export would score every class as never seen)
        # (a non-finite value is named as such further on)
        if np.isfinite(priors).all() and (np.any(priors < 0) or not np.sum(priors) > 0):
            raise ValueError(f"{path}: dataset 'class_priors' holds "
                             + ("a negative value" if np.any(priors < 0) else "only zeros")
                             + "; priors are the classes' shares of the training frames")
    arrays = {"params": params[...], "cmvn_mean": cmvn_mean, "cmvn_scale": cmvn_scale}
    return StoredModel(path, components, feat_dim, left, right, arrays, priors,
                       _speaker_cmvn(group, path))


#: The largest scale a written model holds: 1/sqrt of the variance floor (float32's
#: rounding of it allowed for).
MAX_CMVN_SCALE = float(np.float32(ABSOLUTE_VARIANCE_FLOOR ** -0.5))


def check_cmvn_scale(scale, path) -> None:
    """ValueError naming the file when a stored ``cmvn_scale`` (1/sqrt of a variance,
    floored at 1e-60 when written) is not in (0, 1e30]: that is damage, which would
    flip or erase a feature dimension, or blow every output up (blamed on the
    features).  (A non-finite value is named further on.)"""
    bad = np.flatnonzero(np.isfinite(scale) & ((scale <= 0) | (scale > MAX_CMVN_SCALE)))
    if bad.size:
        raise ValueError(f"{path}: dataset 'cmvn_scale' holds {scale[bad[0]]:g} at dimension "
                         f"{int(bad[0])}; the scales are 1/sqrt(variance), in (0, 1e+30]")


def _speaker_cmvn(group, path, *, what: str = "model", null: bool = False) -> dict | None:
    """The optional ``speaker_cmvn`` attribute: JSON ``{"norm_vars": bool}`` (or,
    with ``null``, ``null``: recorded as none)."""
    if "speaker_cmvn" not in group.attrs:
        return None
    text = group.attrs["speaker_cmvn"]
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        value = json.loads(text) if isinstance(text, str) and len(text) < 1000 else None
    except json.JSONDecodeError:
        value = None
    if null and value is None and text == "null":
        return None
    if not isinstance(value, dict) or set(value) != {"norm_vars"} \
            or not isinstance(value["norm_vars"], bool):
        raise ValueError(f"{path}: {what} attribute 'speaker_cmvn': expected JSON "
                         f'{{"norm_vars": true|false}}' + (" or null" if null else "")
                         + f", got {str(text)[:80]!r}")
    return value


def read_model_group(group, path, *, xp=np, into: Network | None = None):
    """Return (network, class_priors or None) from an HDF5 group.

    Checked as in :func:`read_stored_model`.  With ``into`` no network is
    built: the stored one must have ``into``'s layers, feature dimension and
    context (else :class:`ModelMismatchError`), and its parameters and CMVN
    are loaded into ``into``.

    Example::

        with h5py.File("final.h5", "r") as f:
            net, priors = read_model_group(f, "final.h5")
    """
    return read_stored_model(group, path).install(xp=xp, into=into)


def _describe(specs, feat_dim, left, right) -> str:
    """``440-64-64-120 relu with 5 components, ...``: the affine sizes and what
    follows each hidden affine (``pnorm+normalize``; several: each layer's, by ``/``)."""
    dims = [specs[0]["in_dim"]] + [spec["out_dim"] for spec in specs
                                   if spec["kind"] == "affine"]
    layers, current = [], None
    for spec in specs:
        if spec["kind"] == "affine":
            current = []
            layers.append(current)
        elif current is not None:
            current.append(spec["kind"])
    hidden = ["+".join(kinds) for kinds in layers[:-1] if kinds]
    kinds = " " + "/".join(dict.fromkeys(hidden)) if hidden else ""
    return (f"{'-'.join(str(d) for d in dims)}{kinds} with {len(specs)} components, "
            f"feat_dim {feat_dim}, context {left}+{right}")


def _spec_text(spec: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in spec.items())


def save_model(path, net: Network, *, class_priors=None) -> None:
    """Example::

        save_model("final.h5", net, class_priors=manifest.class_priors())
    """
    with atomic_h5_file(path, checksum=True, what="model") as f:
        write_model_group(f, net, class_priors=class_priors)


def load_model(path, *, xp=np):
    """Return (network, class_priors or None).  Reads plain models and checkpoints.

    The model is checked as in :func:`read_stored_model`, then the whole file
    is verified (checksum, finite values) before a network is built.

    Example::

        net, priors = load_model("runs/quickstart/final.h5")
    """
    with open_h5_for_reading(path, "model") as f, reading_errors(path, "model"):
        group = f
        if "model" in f:
            problem = link_problem(f, "model", path, what="model")
            if problem:
                raise ValueError(problem)
            group = f["model"]
        stored = read_stored_model(group, path)
        verify_file(f, path, what="model")
    return stored.install(xp=xp)


#: The best held-out model of a run directory (train/selection.py writes it).
BEST_MODEL = "best.h5"


def model_in_run_dir(path) -> tuple:
    """(model file, why) for a model path or a run directory.

    A run directory gives its ``best.h5`` when there is one, else its
    ``final.h5``; ``why`` says which and, for best.h5, what made it the best.
    A file is taken as it is (why is "").
    """
    if not os.path.isdir(path):
        return path, ""
    best, final = os.path.join(path, BEST_MODEL), os.path.join(path, "final.h5")
    if os.path.exists(best):
        try:
            with open_h5_for_reading(best, "model") as f:
                attrs = dict(f.attrs)
            by = str(attrs.get("selected_by", "?"))
            figure = attrs.get(f"selected_dev_{by}")
            frames = attrs.get("selected_dev_frames")
            # a figure over part of a held-out set (training.eval_max_frames) is not what
            # scoring the whole set gives: say over how many frames it was
            over = f" over {int(frames)} frames" if frames is not None else ""
            detail = f" (best held-out {by} {float(figure):.4f}{over} at step " \
                      f"{int(attrs.get('selected_at_step', -1))})" if figure is not None else ""
        except (OSError, ValueError, TypeError, OverflowError, KeyError, RuntimeError):
            # (an array or an infinite step where a number belongs; h5py's KeyError or
            # RuntimeError from a damaged object header or attribute heap)
            detail = ""       # the model loader names the damage
        return best, f"using {best}{detail}"
    if os.path.exists(final):
        # a held-out set whose every result was NaN or inf leaves no best.h5 either
        return final, (f"using {final} (the run kept no best.h5: no held-out set, or no "
                       "finite held-out result)")
    if os.path.exists(os.path.join(path, "pretrain.h5")):
        raise FileNotFoundError(
            f"{path}: a pretraining run's directory: its pretrain.h5 is an RBM stack, not a "
            "model; train a model from it (--set model.init_from="
            f"{os.path.join(path, 'pretrain.h5')}) and give that run")
    checkpoints = glob.glob(os.path.join(glob.escape(path), "ckpt-*.h5"))
    if checkpoints:
        # a run stopped before its end and before a held-out evaluation: its model
        # is in the checkpoints, which every command that reads a model takes
        newest = max(checkpoints, key=_modified)
        if _format_of(newest) in _PRETRAINING_FORMATS:
            raise FileNotFoundError(
                f"{path}: a pretraining run's directory, without its pretrain.h5 yet: it "
                "holds RBMs, not a model; resume the pretraining, then train a model from "
                "its pretrain.h5 (model.init_from)")
        raise FileNotFoundError(f"{path}: a run directory without best.h5 or final.h5 (the "
                                "run has not ended, nor kept a best held-out model); give "
                                f"a checkpoint as the model, e.g. the newest, {newest}")
    if os.path.exists(os.path.join(path, "corpus.yaml")):
        # (the arguments of `eval MODEL CORPUS` swapped: it was called a run directory)
        raise FileNotFoundError(f"{path}: a corpus directory (it holds corpus.yaml), not a "
                                "model; give a model file or the run directory that holds "
                                "one")
    if os.path.isfile(os.path.join(path, "bench.json")):
        # a benchmark's --out: each measurement trained in a run directory of its own
        raise FileNotFoundError(f"{path}: a benchmark's report (bench.md, bench.json), not a "
                                "model; give one of its runs, "
                                f"{os.path.join(path, 'runs', '*')}")
    raise FileNotFoundError(f"{path}: a run directory without best.h5 or final.h5")


def _format_of(path: str):
    """The ``format`` attribute of an HDF5 file, or None where it cannot be read."""
    try:
        with open_h5_for_reading(path, "checkpoint") as f:
            return f.attrs.get("format")
    except (OSError, ValueError, TypeError, KeyError, RuntimeError):
        return None         # (the model loader names the damage of the file given)


def _modified(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:         # (removed meanwhile: by a run rotating its checkpoints)
        return -math.inf
