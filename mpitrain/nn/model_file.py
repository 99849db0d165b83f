"""Saving and loading models as HDF5 (no pickle).

A model file holds the component specs (JSON in an attribute), the flat
parameter buffer, the input transform (CMVN, context) and, optionally, the
class priors used to turn posteriors into pseudo log-likelihoods.
"""

from __future__ import annotations

import json

import numpy as np

from ..backend import to_host
from ..h5io import atomic_h5_file, open_h5_for_reading, require_dataset
from .network import Network, build_component

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


def read_model_group(group, path, *, xp=np):
    """Return (network, class_priors or None) from an HDF5 group."""
    if group.attrs.get("format") != FORMAT:
        raise ValueError(f"{path}: not an mpitrain model (attribute 'format' is "
                         f"{group.attrs.get('format')!r}, expected {FORMAT!r})")
    try:
        specs = json.loads(group.attrs["components"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: attribute 'components' missing or not JSON") from exc
    net = Network([build_component(s) for s in specs], feat_dim=int(group.attrs["feat_dim"]),
                  left_context=int(group.attrs["left_context"]),
                  right_context=int(group.attrs["right_context"]), xp=xp)
    params = require_dataset(group, "params", path, what="model")[...]
    if params.shape != (net.num_params,):
        raise ValueError(f"{path}: dataset 'params' has shape {params.shape}, "
                         f"expected ({net.num_params},) for the stored components")
    net.params[...] = xp.asarray(params)
    net.cmvn_mean[...] = xp.asarray(require_dataset(group, "cmvn_mean", path, what="model")[...])
    net.cmvn_scale[...] = xp.asarray(require_dataset(group, "cmvn_scale", path, what="model")[...])
    priors = group["class_priors"][...] if "class_priors" in group else None
    return net, priors


def save_model(path, net: Network, *, class_priors=None) -> None:
    """Example::

        save_model("final.h5", net, class_priors=manifest.class_priors())
    """
    with atomic_h5_file(path) as f:
        write_model_group(f, net, class_priors=class_priors)


def load_model(path, *, xp=np):
    """Return (network, class_priors or None).  Reads plain models and checkpoints."""
    with open_h5_for_reading(path, "model") as f:
        group = f["model"] if "model" in f else f
        return read_model_group(group, path, xp=xp)
