"""``model.init_from``: a network's hidden layers from a pretrained RBM stack.

Each RBM's ``[W | b]`` block is exactly the hidden affine layer's block
(:mod:`mpitrain.nn.rbm`), so layer i of the network takes RBM i's block as
is; the output layer keeps its own initialisation (zeros, as Kaldi adds it).
The stack must have been trained on the same input (feature dimension and
splicing context) with the network's hidden layer count and width; any
difference is one line naming ``model.init_from`` and the field.
"""

from __future__ import annotations

import os

from ..nn.affine import Affine
from ..nn.rbm_file import load_rbm_stack


def init_from_pretrained(net, cfg) -> None:
    """Copy the stack at ``cfg.model.init_from`` into ``net``'s hidden affine layers.

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
    for rbm, layer in zip(stack.rbms, hidden):
        layer.block[...] = rbm.block
