"""A trained model for use from Python: posteriors and pseudo log-likelihoods.

``mpitrain.load_model(path)`` opens ``final.h5`` (or a checkpoint) with every
check of :func:`mpitrain.nn.model_file.load_model` and returns an
:class:`AcousticModel`.  Features are one utterance's raw (T, feat_dim)
frames: CMVN and splicing are applied as in training (context does not cross
the utterance's ends; the edge frames are repeated), exactly as ``mpitrain
export`` does.

Example::

    import mpitrain
    model = mpitrain.load_model("runs/quickstart/final.h5")
    post = model.predict(feats)               # (T, num_classes), rows sum to 1
    ll = model.log_likelihoods(feats)         # log p(s|x) - log p(s), as export writes

Threads may share a model: its calls take turns (the network computes in
buffers of its own).
"""

from __future__ import annotations

import numbers
import os
import threading

import numpy as np

from .export import prior_offsets, utterance_loglikes
from .nn.model_file import load_model as _load_network
from .nn.model_file import model_in_run_dir


class AcousticModel:
    """A network with its input transform and class priors, on the host (NumPy).

    Example::

        model = AcousticModel.load("final.h5")
        model.feat_dim, model.num_classes, model.context    # 40, 120, (5, 5)
    """

    def __init__(self, net, class_priors, path):
        self.net, self.path = net, str(path)
        self.class_priors = None if class_priors is None else np.asarray(class_priors)
        # the network computes in buffers of its own: one utterance at a time, so
        # that threads sharing the model get right results (in turn)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path) -> "AcousticModel":
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            # (None reached os.stat, whose message names neither the call nor the argument;
            # an integer was taken as a file descriptor)
            raise TypeError(f"load_model: path: expected a model file or run directory "
                            f"(str or os.PathLike), got {type(path).__name__}")
        path, _ = model_in_run_dir(path)
        net, priors = _load_network(path)
        return cls(net, priors, path)

    @property
    def feat_dim(self) -> int:
        return self.net.feat_dim

    @property
    def num_classes(self) -> int:
        return self.net.num_classes

    @property
    def speaker_cmvn(self) -> dict | None:
        """{"norm_vars": bool} when the model expects features that already had
        per-speaker CMVN (:func:`mpitrain.data.cmvn.apply_cmvn`), else None."""
        return self.net.speaker_cmvn

    @property
    def context(self) -> tuple[int, int]:
        return self.net.left_context, self.net.right_context

    def _frames(self, feats) -> np.ndarray:
        try:
            feats = np.asarray(feats)
        except (ValueError, TypeError):
            # (a list of rows of different lengths: NumPy's own message names nothing)
            raise ValueError(f"{self.path}: expected one utterance's features of shape "
                             f"(frames, {self.feat_dim}), got a {type(feats).__name__} that "
                             "is not one rectangular array of numbers") from None
        if feats.shape == (0, 0):
            # an utterance of no frames as Kaldi writes it (export takes it too)
            feats = feats.reshape(0, self.feat_dim)
        if feats.ndim != 2 or feats.shape[1] != self.feat_dim:
            hint = " (one frame: feats[None], or feats.reshape(1, -1))" \
                if feats.shape == (self.feat_dim,) else ""
            raise ValueError(f"{self.path}: expected one utterance's features of shape "
                             f"(frames, {self.feat_dim}), got {feats.dtype} {feats.shape}{hint}")
        if feats.dtype.kind not in "fiu":
            raise ValueError(f"{self.path}: expected features of a float or integer dtype, "
                             f"got {feats.dtype}")
        if feats.dtype.kind == "f":
            # NaN, inf, or beyond float32 (the model's precision): NaN scores otherwise
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(feats) <= np.finfo(np.float32).max).all(axis=1)
            if bad.any():
                raise ValueError(f"{self.path}: frame {int(np.argmax(bad))} of the features "
                                 "holds NaN, inf or a value beyond float32")
        return feats

    def _scores(self, feats, offsets, batch) -> np.ndarray:
        frames = self._frames(feats)
        with self._lock:
            try:
                return utterance_loglikes(self.net, frames, offsets, batch=batch)
            except ValueError as exc:
                raise ValueError(f"{self.path}: {exc}") from None

    def log_posteriors(self, feats, *, batch: int = 4096) -> np.ndarray:
        """(T, num_classes) log p(s|x), float32."""
        return self._scores(feats, np.zeros(self.num_classes, dtype=np.float32), batch)

    def predict(self, feats, *, batch: int = 4096) -> np.ndarray:
        """(T, num_classes) posteriors p(s|x): each row sums to 1."""
        return np.exp(self.log_posteriors(feats, batch=batch))

    def log_likelihoods(self, feats, *, prior_scale: float = 1.0,
                        batch: int = 4096) -> np.ndarray:
        """(T, num_classes) log p(s|x) - prior_scale * log p(s), as ``export`` writes them.

        Pdfs never seen in training get ``mpitrain.export.UNSEEN_SCORE``.
        """
        if self.class_priors is None:
            raise ValueError(f"{self.path}: the model stores no class priors; use predict()")
        if isinstance(prior_scale, bool) or not isinstance(prior_scale, numbers.Real) \
                or not 0 <= prior_scale < float("inf"):
            raise ValueError(f"prior_scale: expected a number >= 0, got {prior_scale!r}")
        offsets, _ = prior_offsets(self.class_priors, scale=prior_scale)
        return self._scores(feats, offsets, batch)


def load_model(path) -> AcousticModel:
    """Open a model file (or checkpoint), checked and verified, for inference; a run
    directory gives its best.h5 (else its final.h5).

    Example::

        model = load_model("runs/quickstart/final.h5")
        model = load_model("runs/quickstart")        # its best held-out model
        model.predict(feats).argmax(axis=1)       # the most likely pdf of each frame
    """
    return AcousticModel.load(path)
