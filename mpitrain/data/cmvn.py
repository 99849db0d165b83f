"""Per-speaker CMVN as Kaldi's ``compute-cmvn-stats`` and ``apply-cmvn`` do it.

A speaker's stats are Kaldi's 2 x (D+1) matrix: row 0 holds the sums of each
dimension and, last, the frame count; row 1 the sums of squares (its last
entry unused).  Applying them subtracts the speaker's mean and, with
``norm_vars``, divides by the speaker's standard deviation, the variance
floored at 1e-20 as in Kaldi.  Stats are looked up by speaker through
utt2spk, or by utterance when there is no utt2spk (Kaldi's per-utterance
CMVN).  ``prepare`` applies this to the stored features; ``export`` applies
it to its input when the model says it was trained so.

Example::

    cmvn = SpeakerCmvn.load(utt2spk="data/train/utt2spk", cmvn="scp:data/train/cmvn.scp")
    for utt, feats in read_feature_matrices("scp:data/train/feats.scp"):
        normalised = cmvn.apply(utt, feats)
"""

from __future__ import annotations

import numpy as np

from .corpus import CorpusError
from .kaldi_read import read_cmvn_stats, read_feature_matrices, read_utt2spk

# Kaldi's apply-cmvn floors the variance here (and warns) before 1/sqrt
VAR_FLOOR = 1e-20


def accumulate_stats(feats: np.ndarray, stats: np.ndarray | None = None) -> np.ndarray:
    """Add one utterance's frames to a 2 x (D+1) stats matrix (float64), as
    ``compute-cmvn-stats`` does.

    Example::

        stats = accumulate_stats(np.ones((3, 2)))    # [[3, 3, 3], [3, 3, 0]]
    """
    feats = np.asarray(feats, dtype=np.float64)
    if stats is None:
        stats = np.zeros((2, feats.shape[1] + 1), dtype=np.float64)
    stats[0, :-1] += feats.sum(axis=0)
    stats[0, -1] += feats.shape[0]
    stats[1, :-1] += (feats * feats).sum(axis=0)
    return stats


def apply_cmvn(feats: np.ndarray, stats: np.ndarray, *, norm_vars: bool = False) -> np.ndarray:
    """``apply-cmvn``: (feats - mean) [/ std] with mean and var from ``stats``,
    computed as Kaldi's ApplyCmvn computes it: the offset -mean (and the scale
    1/std, the offset -mean/std) in float64, then stored as float32 and applied to
    the float32 features, a multiply and an add, so the result is Kaldi's bit for
    bit.

    Example::

        apply_cmvn(feats, stats, norm_vars=True)    # float32, zero mean, unit variance
    """
    scale, offset, _ = cmvn_transform(stats, norm_vars=norm_vars)
    feats = np.asarray(feats, dtype=np.float32)
    return feats + offset if scale is None else feats * scale + offset


def cmvn_transform(stats: np.ndarray, *, norm_vars: bool = False):
    """``(scale, offset, var)`` of :func:`apply_cmvn`: float32 ``scale`` (None without
    ``norm_vars``) and ``offset``, and the float64 variance they came from (None
    without ``norm_vars``).

    Example::

        scale, offset, var = cmvn_transform(stats, norm_vars=True)
    """
    f32 = np.float32
    count = stats[0, -1]
    with np.errstate(over="ignore", invalid="ignore"):
        mean = stats[0, :-1] / count
        if not norm_vars:
            return None, (-mean).astype(f32), None
        var = np.maximum(stats[1, :-1] / count - mean * mean, VAR_FLOOR)
        scale = 1.0 / np.sqrt(var)
        return scale.astype(f32), (-(mean * scale)).astype(f32), var


#: How the stats computed from the features (no --cmvn) are named in errors.
_COMPUTED = "stats computed from "


class SpeakerCmvn:
    """Stats by speaker (or by utterance) and the utt2spk map, ready to apply.

    Example::

        cmvn = SpeakerCmvn.load(utt2spk="utt2spk", feats="scp:feats.scp", norm_vars=True)
        cmvn.apply("spk1-utt1", feats)
    """

    def __init__(self, stats: dict, utt2spk: dict | None, *, norm_vars: bool,
                 stats_name: str, utt2spk_name: str | None):
        self.stats, self.utt2spk, self.norm_vars = stats, utt2spk, bool(norm_vars)
        self.stats_name, self.utt2spk_name = stats_name, utt2spk_name

    @classmethod
    def load(cls, *, utt2spk: str | None = None, cmvn: str | None = None,
             feats: str | None = None, norm_vars: bool = False,
             scp_commands: bool = False) -> "SpeakerCmvn":
        """Read ``cmvn`` (an rspecifier of stats matrices), or compute the stats
        per speaker of ``utt2spk`` from ``feats`` (a second pass over them);
        ``scp_commands`` as for :func:`~mpitrain.data.kaldi_read.read_feature_matrices`."""
        spk_map = read_utt2spk(utt2spk) if utt2spk else None
        if cmvn:
            return cls(read_cmvn_stats(cmvn, scp_commands=scp_commands), spk_map, norm_vars=norm_vars, stats_name=cmvn,
                       utt2spk_name=utt2spk)
        if spk_map is None:
            raise ValueError("per-speaker CMVN needs --utt2spk (stats computed per speaker) "
                             "or --cmvn (Kaldi's stats)")
        stats: dict = {}
        for utt, matrix in read_feature_matrices(feats, scp_commands=scp_commands):
            spk = _speaker(spk_map, utt2spk, utt)
            if matrix.shape[0] == 0:
                continue        # no frames (Kaldi writes them 0 x 0, of no dimension)
            if spk in stats and stats[spk].shape[1] != matrix.shape[1] + 1:
                continue        # the import names the dimension mismatch itself
            stats[spk] = accumulate_stats(matrix, stats.get(spk))
        return cls(stats, spk_map, norm_vars=norm_vars, stats_name=f"{_COMPUTED}{feats}",
                   utt2spk_name=utt2spk)

    def describe(self) -> dict:
        """What a manifest records about it."""
        return {"norm_vars": self.norm_vars, "stats": self.stats_name,
                "utt2spk": self.utt2spk_name}

    def apply(self, utt: str, feats: np.ndarray) -> np.ndarray:
        """One utterance normalised with its speaker's stats; one-line errors name the file."""
        key = _speaker(self.utt2spk, self.utt2spk_name, utt) if self.utt2spk is not None else utt
        if feats.shape[0] == 0:
            # nothing to normalise: a speaker of empty utterances only has no stats
            # (compute-cmvn-stats writes none for it)
            return np.asarray(feats, dtype=np.float32)
        stats = self.stats.get(key)
        if stats is None:
            who = f"speaker {key!r} (of utterance {utt!r})" if self.utt2spk is not None \
                else (f"utterance {utt!r} (without --utt2spk stats are looked up by "
                      "utterance; per-speaker stats need --utt2spk)")
            raise CorpusError(f"{self.stats_name}: no CMVN stats for {who}")
        if stats.shape[1] != feats.shape[1] + 1:
            raise CorpusError(f"{self.stats_name}: CMVN stats of {key!r} are {stats.shape[0]} x "
                              f"{stats.shape[1]}; features of dimension {feats.shape[1]} "
                              f"(utterance {utt!r}) need 2 x {feats.shape[1] + 1}")
        if self.norm_vars and stats.shape[0] < 2:
            raise CorpusError(f"{self.stats_name}: CMVN stats of {key!r} have no sums of "
                              "squares (one row), which --norm-vars needs")
        if not stats[0, -1] >= 1:
            # (Kaldi's apply-cmvn refuses a count below one frame too)
            raise CorpusError(f"{self.stats_name}: CMVN stats of {key!r} have a frame count "
                              f"of {stats[0, -1]:g}; expected at least 1")
        rows = stats if self.norm_vars else stats[:1]     # the sums of squares: norm_vars
        if not np.isfinite(rows).all():
            row, col = (int(i) for i in np.argwhere(~np.isfinite(rows))[0])
            raise CorpusError(f"{self.stats_name}: CMVN stats of {key!r} hold "
                              f"{rows[row, col]} at row {row}, column {col}")
        scale, offset, var = cmvn_transform(stats, norm_vars=self.norm_vars)
        for name, values in (("variance", var), ("scale", scale), ("offset", offset)):
            if values is not None and not np.isfinite(values).all():
                # finite sums whose mean (or variance) float32, or float64, cannot hold:
                # every feature of the speaker would be inf or NaN, or silently zero
                dim = int(np.flatnonzero(~np.isfinite(values))[0])
                raise CorpusError(f"{self.stats_name}: CMVN stats of {key!r} give an "
                                  f"infinite {name} at dimension {dim} (sum "
                                  f"{stats[0, dim]:g}, sum of squares "
                                  f"{stats[min(1, len(stats) - 1), dim]:g}, count "
                                  f"{stats[0, -1]:g}); {self._what_to_check(key)}")
        return apply_cmvn(feats, stats, norm_vars=self.norm_vars)

    def _what_to_check(self, key: str) -> str:
        """Where stats too large for float32 come from: the file given, or the
        features they were computed from."""
        if not self.stats_name.startswith(_COMPUTED):
            return f"check the stats of {key!r} in {self.stats_name}"
        return f"check the features of speaker {key!r} for values too large to normalise in float32"


def _speaker(spk_map: dict, name: str | None, utt: str) -> str:
    spk = spk_map.get(utt)
    if spk is None:
        raise CorpusError(f"{name}: utterance {utt!r} has no speaker")
    return spk
