"""``model.init_from``: a network's hidden layers from a pretrained RBM stack.

Each RBM's ``[W | b]`` block is exactly the hidden affine layer's block
(:mod:`mpitrain.nn.rbm`), so layer i of the network takes RBM i's block as
is; the output layer keeps its own initialisation (zeros, as Kaldi adds it).
The stack must have been trained on the same input (feature dimension,
splicing context, per-speaker CMVN or none) with the network's hidden layer
count and width; any difference is one line naming ``model.init_from`` and
the field.

The stack also holds the input normalisation (global CMVN) its first layer
was trained on.  As Kaldi keeps the pretraining's feature transform for the
fine-tuning, the network starts from the function the stack computes on
features normalised that way: where the training corpus's CMVN differs (a
stack pretrained on other data), the first layer is rewritten so that, on
the network's own normalisation (the corpus's, which the model file keeps),
it gives exactly the stack's first layer on the stack's.
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import to_host
from ..data.corpus import speaker_cmvn_kind
from ..nn.affine import Affine
from ..nn.rbm import UNRECORDED
from ..nn.rbm_file import load_rbm_stack


def init_from_pretrained(net, cfg) -> bool:
    """Copy the stack at ``cfg.model.init_from`` into ``net``'s hidden affine layers;
    True when its input normalisation differed from ``net``'s and the first layer
    was rewritten for it.

    Example::

        net = build_network(..., nonlinearity="sigmoid")
        init_from_pretrained(net, cfg)        # cfg.model.init_from = "runs/pre/pretrain.h5"
    """
    path = cfg.model.init_from
    where = f"model.init_from: {path}"
    if os.path.isdir(path):
        raise ValueError(f"{where}: is a directory; name the RBM stack file in it (the "
                         "pretraining run's pretrain.h5)")
    try:
        stack = load_rbm_stack(path, xp=net.xp)
    except FileNotFoundError:
        raise ValueError(f"{where}: RBM stack not found (run `mpitrain pretrain` first, or "
                         "fix the path)") from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"model.init_from: {' '.join(str(exc).split())}") from None
    hidden = [c for c in net.components if isinstance(c, Affine)][:-1]
    checks = [("feat_dim", stack.feat_dim, net.feat_dim, "the training corpus's feat_dim"),
              ("left_context", stack.left_context, net.left_context, "data.left_context"),
              ("right_context", stack.right_context, net.right_context, "data.right_context"),
              ("layers", len(stack.rbms), len(hidden), "model.hidden_layers")]
    checks += [(f"layer {i + 1} hidden units", rbm.hidden_dim, layer.out_dim,
                "model.hidden_dim") for i, (rbm, layer) in enumerate(zip(stack.rbms, hidden))]
    for field, stored, wanted, key in checks:
        if stored != wanted:
            raise ValueError(f"{where}: the stack's {field} is {stored}, but the config "
                             f"builds {wanted} ({key})")
    # features normalised per speaker, or not, are other inputs: no rescaling of
    # the first layer maps one onto the other
    if stack.speaker_cmvn != UNRECORDED \
            and speaker_cmvn_kind(stack.speaker_cmvn) != speaker_cmvn_kind(net.speaker_cmvn):
        raise ValueError(f"{where}: the stack was pretrained on features with "
                         f"{speaker_cmvn_kind(stack.speaker_cmvn)}, but the training corpus "
                         f"has {speaker_cmvn_kind(net.speaker_cmvn)}; pretrain on a corpus "
                         "prepared alike")
    for rbm, layer in zip(stack.rbms, hidden):
        layer.block[...] = rbm.block
    return _refit_first_layer(hidden[0], stack, net) if hidden else False


def _refit_first_layer(layer, stack, net) -> bool:
    """Rewrite ``layer`` ([W | b] on inputs normalised as the stack's) for the
    network's normalisation: with the network's x_n = (x - m_n) s_n and the
    stack's x_s = (x - m_s) s_s = x_n (s_s / s_n) + (m_n - m_s) s_s, per feature,
    W x_s + b = W' x_n + b' with W' = W diag(s_s / s_n), b' = b + W (m_n - m_s) s_s.
    """
    net_mean = to_host(net.cmvn_mean).astype(np.float64)
    net_scale = to_host(net.cmvn_scale).astype(np.float64)
    mean = np.asarray(stack.cmvn_mean, dtype=np.float64)
    scale = np.asarray(stack.cmvn_scale, dtype=np.float64)
    if np.array_equal(mean, net_mean) and np.array_equal(scale, net_scale):
        return False
    width = net.left_context + 1 + net.right_context        # spliced frames, feature-minor
    ratio = np.tile(scale / net_scale, width)
    shift = np.tile((net_mean - mean) * scale, width)
    block = to_host(layer.block).astype(np.float64)
    weight = block[:, :layer.in_dim]
    bias = block[:, layer.in_dim] + weight @ shift
    block[:, :layer.in_dim] = weight * ratio
    block[:, layer.in_dim] = bias
    layer.block[...] = net.xp.asarray(block.astype(np.float32))
    return True
