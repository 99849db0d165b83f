"""Pseudo log-likelihoods for Kaldi's decoders.

For each utterance: CMVN and splicing as in training, forward pass, then
log p(s|x) - log p(s), the log posterior minus the log prior of the class
(priors from the training corpus' class counts).  Written with kaldiio as a
Kaldi matrix archive, so ``latgen-faster-mapped`` and friends read it directly.
"""

from __future__ import annotations

import numpy as np

from . import backend
from .data.splice import frame_utterance_bounds, splice, splice_indices
from .nn.loss import log_softmax
from .nn.model_file import load_model


def utterance_loglikes(net, feats, log_priors, *, batch: int = 4096) -> np.ndarray:
    """(T, num_classes) pseudo log-likelihoods of one utterance's raw features."""
    xp = net.xp
    frames = net.normalize_frames(backend.to_device(np.array(feats, dtype=np.float32), xp))
    n = frames.shape[0]
    start, end = frame_utterance_bounds(xp.asarray([0, n]))
    out = np.empty((n, net.num_classes), dtype=np.float32)
    for lo in range(0, n, batch):
        idx = xp.arange(lo, min(lo + batch, n))
        ctx = splice_indices(idx, start[idx], end[idx], net.left_context, net.right_context)
        logp = log_softmax(net.forward(splice(frames, ctx)))
        out[lo:lo + len(idx)] = backend.to_host(logp) - log_priors
    return out


def export_loglikes(model_path, feats_rspec: str, out_wspec: str, *, corpus_dir=None,
                    batch: int = 4096) -> int:
    """Write loglikes for every utterance of ``feats_rspec``; returns the count.

    Example::

        export_loglikes("runs/x/final.h5", "scp:data/test/feats.scp", "ark:loglikes.ark")
    """
    import kaldiio
    net, priors = load_model(model_path)
    if corpus_dir is not None:
        from .data.corpus import load_manifest
        priors = load_manifest(corpus_dir).class_priors()
    if priors is None:
        raise ValueError(f"{model_path}: the model stores no class priors; "
                         "pass --corpus with the training corpus")
    priors = np.asarray(priors, dtype=np.float64)
    if priors.shape != (net.num_classes,):
        raise ValueError(f"priors have {priors.shape[0]} classes, the model "
                         f"{model_path} has {net.num_classes}")
    log_priors = np.log(np.maximum(priors, 1e-20)).astype(np.float32)
    count = 0
    with kaldiio.WriteHelper(out_wspec) as writer:
        for utt, feats in _read_feats(feats_rspec):
            if feats.ndim != 2 or feats.shape[1] != net.feat_dim:
                raise ValueError(f"{feats_rspec}: utterance {utt} has features of shape "
                                 f"{feats.shape}, the model expects dim {net.feat_dim}")
            writer(utt, utterance_loglikes(net, feats, log_priors, batch=batch))
            count += 1
    return count


def _read_feats(rspec: str):
    import kaldiio
    kind, _, path = rspec.partition(":")
    if not path:
        raise ValueError(f"--feats {rspec}: expected scp:PATH or ark:PATH")
    if kind.split(",")[0] == "scp":
        yield from kaldiio.load_scp_sequential(path)
    elif kind.split(",")[0] == "ark":
        yield from kaldiio.load_ark(path)
    else:
        raise ValueError(f"--feats {rspec}: expected scp:PATH or ark:PATH")
