"""A tiny model file for tests that export (no training)."""

import numpy as np


def tiny_model(path, *, feat_dim=3, num_classes=5):
    from mpitrain.nn.affine import Affine
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import Network
    from mpitrain.nn.nonlinear import ReLU
    net = Network([Affine(feat_dim * 3, 8), ReLU(8), Affine(8, num_classes)],
                  feat_dim=feat_dim, left_context=1, right_context=1)
    net.init_params(seed=1)
    save_model(path, net, class_priors=np.full(num_classes, 1.0 / num_classes))
    return path
