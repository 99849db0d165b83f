"""Build the optimizer named in the config."""

from __future__ import annotations

from .sgd import SGD


def build_optimizer(opt_cfg, net):
    """Example::

        opt = build_optimizer(cfg.optimizer, net)    # SGD or NaturalGradientSGD
    """
    options = dict(momentum=opt_cfg.momentum, max_change_per_layer=opt_cfg.max_change_per_layer,
                   max_change_output=opt_cfg.max_change_output, max_change=opt_cfg.max_change)
    if opt_cfg.name == "sgd":
        return SGD(net, **options)
    from .ngsgd import NaturalGradientSGD
    ng = opt_cfg.ngsgd
    return NaturalGradientSGD(net, variant=ng.variant, rank_in=ng.rank_in, rank_out=ng.rank_out,
                              update_period=ng.update_period,
                              num_samples_history=ng.num_samples_history, alpha=ng.alpha,
                              reset_on_average=ng.reset_on_average, **options)
