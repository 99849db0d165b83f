"""Keep the best held-out model; stop when held-out results stop improving.

After each held-out evaluation (the same figures on every rank, so every
rank decides alike) the figure ``training.select_by`` names is compared with
the best so far:

- better than the best (accuracy higher, or cross-entropy lower): the model
  evaluated becomes the best, and rank 0 writes it to ``RUN_DIR/best.h5``
  with the figures and the step as attributes;
- better than the figure at the last gain by more than
  ``training.early_stop.min_delta``: a gain, the count of evaluations without
  one restarts; otherwise the count grows, and reaching
  ``training.early_stop.patience`` (when > 0) stops training.

Figures are compared only with figures over as many held-out frames of the
same held-out set: an evaluation over another number (``data.dev`` or
``training.eval_max_frames`` changed on resume) or over another set (``data.dev``
naming another corpus, or its corpus written again, with the frames capped
alike) starts the selection afresh, and that evaluation becomes the best
(``Verdict.restarted_from_frames``); so does a checkpoint's selection made by the
other figure (``training.select_by`` changed with ``--accept-changes``), which
:meth:`ModelSelection.load_state_dict` refuses.

While a dropout schedule raises the proportion, held-out figures dip and
recover (measured in docs/benchmarks.md); evaluations before
``patience_from_step`` (the end of the schedule's last rise) keep the best
model but do not count towards patience, and counting starts afresh there.

The counters travel in checkpoints, so a resumed run goes on deciding as the
uninterrupted one would.

Example::

    selection = ModelSelection(select_by="acc", patience=3, min_delta=0.001)
    verdict = selection.observe({"dev_acc": 0.81, "dev_xent": 0.62}, step=400)
    verdict.improved, verdict.stop
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass

from ..h5io import atomic_h5_file
from ..nn.model_file import BEST_MODEL, write_model_group
from ..state_fields import FLOAT32_MAX, count, flag, number
_KEYS = {"acc": "dev_acc", "xent": "dev_xent"}


@dataclass(frozen=True)
class Verdict:
    improved: bool        # a new best model (write it)
    gained: bool          # a gain of more than min_delta (the patience count restarts)
    stop: bool            # patience exhausted: stop training
    since_gain: int       # evaluations in a row without a gain
    # the figures so far were over another number of held-out frames (or, with
    # other_set, another held-out set): forgotten
    restarted_from_frames: int = 0
    other_set: bool = False


class ModelSelection:
    """The best held-out figure so far, and the evaluations since the last gain."""

    def __init__(self, *, select_by: str = "acc", patience: int = 0, min_delta: float = 0.0,
                 patience_from_step: int = 0, held_out_set: int = 0):
        if select_by not in _KEYS:
            raise ValueError(f"select_by must be one of {', '.join(_KEYS)}, got {select_by!r}")
        if patience < 0 or min_delta < 0:
            raise ValueError("patience and min_delta must be >= 0")
        self.select_by, self.patience, self.min_delta = select_by, int(patience), float(min_delta)
        self.patience_from_step = int(patience_from_step)
        self.best_value = math.nan      # nan: nothing evaluated yet
        self.best_step = -1
        self.reference = math.nan       # the figure at the last gain
        self.since_gain = 0
        self.held_out_frames = 0        # the frames the figures so far were over; 0: none
        # this run's held-out set (held_out_identity) and the one the figures so far
        # were over; 0: not known
        self.held_out_set, self.figures_set = int(held_out_set), 0

    def _better(self, value: float, than: float, margin: float = 0.0) -> bool:
        if math.isnan(than):
            return True
        return value > than + margin if self.select_by == "acc" else value < than - margin

    def better(self, result: dict, than: dict) -> bool:
        """Whether held-out ``result`` is better than ``than`` by ``select_by`` (a tie is
        not; a result with a figure that is not finite never is, and beats any such)."""
        def finite(r):
            return all(math.isfinite(float(r.get(key, math.nan))) for key in _KEYS.values())
        if not finite(result):
            return False
        if not finite(than):
            return True
        key = _KEYS[self.select_by]
        return self._better(float(result[key]), float(than[key]))

    def observe(self, result: dict, *, step: int) -> Verdict:
        """Take one evaluation's ``result`` (``dev_acc``, ``dev_xent``) at ``step``."""
        value = float(result[_KEYS[self.select_by]])
        frames = int(result.get("dev_frames", 0))
        restarted_from = 0
        other_set = bool(self.held_out_set and self.figures_set
                         and self.held_out_set != self.figures_set)
        if frames and self.held_out_frames and (frames != self.held_out_frames or other_set):
            # figures of another held-out set (or another cap on it) do not compare
            restarted_from = self.held_out_frames
            self.best_value, self.best_step = math.nan, -1
            self.reference, self.since_gain = math.nan, 0
        if frames:
            self.held_out_frames = frames
            self.figures_set = self.held_out_set or self.figures_set
        # a diverged model is never the best, nor one whose other figure is not
        # finite (a held-out set that overflows it: its file could not be written)
        if not all(math.isfinite(float(result.get(key, 0.0))) for key in _KEYS.values()):
            self.since_gain += 1
            return Verdict(False, False, self._exhausted(), self.since_gain, restarted_from,
                           other_set)
        improved = self._better(value, self.best_value)
        if improved:
            self.best_value, self.best_step = value, int(step)
        if step < self.patience_from_step:         # not counted: the next one starts afresh
            self.reference, self.since_gain = math.nan, 0
            return Verdict(improved, False, False, 0, restarted_from, other_set)
        gained = self._better(value, self.reference, self.min_delta)
        if gained:
            self.reference, self.since_gain = value, 0
        else:
            self.since_gain += 1
        return Verdict(improved, gained, self._exhausted(), self.since_gain, restarted_from,
                       other_set)

    def _exhausted(self) -> bool:
        return self.patience > 0 and self.since_gain >= self.patience

    def describe(self) -> str:
        if self.best_step < 0:
            return "no held-out evaluation yet"
        return f"held-out {self.select_by} {self.best_value:.4f} at step {self.best_step}"

    def forget_best(self) -> None:
        """The best model's file is lost: the next evaluation's model is the best so
        far.  Early stopping, which counts from its own reference, goes on as it was."""
        self.best_value, self.best_step = math.nan, -1

    def keep_later_best(self, value: float, step: int, frames: int) -> bool:
        """Take a best model found after the state this selection was loaded from
        (best.h5 of a run cut off past its newest checkpoint) when its figure is
        better and over the same held-out frames; whether it was taken."""
        if not math.isfinite(value) or not self._better(value, self.best_value):
            return False
        if self.held_out_set and self.figures_set and self.held_out_set != self.figures_set:
            return False        # the next evaluation starts the selection afresh
        if self.held_out_frames and frames != self.held_out_frames:
            return False
        self.best_value, self.best_step = float(value), int(step)
        if frames:
            self.held_out_frames = int(frames)
            self.figures_set = self.held_out_set or self.figures_set
        return True

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        # finite numbers only (checkpoints refuse NaN): no best yet is best_step -1
        started = self.best_step >= 0
        counting = not math.isnan(self.reference)
        return {"best_value": self.best_value if started else 0.0,
                "best_step": self.best_step,
                "reference": self.reference if counting else 0.0,
                "counting": int(counting), "since_gain": self.since_gain,
                "by_xent": int(self.select_by == "xent"),
                "held_out_frames": self.held_out_frames, "held_out_set": self.figures_set}

    def load_state_dict(self, state: dict) -> None:
        """ValueError (nothing loaded) for a selection made by the other figure (its best
        value is not one of ``select_by``'s), or a field no evaluation gives: a figure
        out of its range (accuracy in [0, 1], cross-entropy >= 0), a count that is not
        a whole number >= 0.

        The best step and the evaluations without a gain are not bounded by the
        checkpoint's step: a roll back returns to an older checkpoint and keeps the
        best model found past it (and its count), as does a resume that finds a later
        best.h5; the checkpoints written after that hold a best step ahead of theirs."""
        where = "the model selection"
        if "by_xent" in state:          # (checkpoints from before it was stored: alike)
            saved = "xent" if flag(state, "by_xent", where) else "acc"
            if saved != self.select_by:
                raise ValueError(f"it selected the best model by {saved}, now by "
                                 f"{self.select_by}")
        best_step = count(state, "best_step", where, default=-1, low=-1)
        started = best_step >= 0
        top = 1.0 if self.select_by == "acc" else FLOAT32_MAX
        best_value = number(state, "best_value", where, low=0.0, high=top) \
            if started else math.nan
        counting = flag(state, "counting", where, default=1)
        reference = number(state, "reference", where, low=0.0, high=top) \
            if started and counting else math.nan
        since_gain = count(state, "since_gain", where, default=0)
        frames = count(state, "held_out_frames", where, default=0)
        figures_set = count(state, "held_out_set", where, default=0, high=0xFFFFFFFF)
        self.best_step, self.best_value, self.reference = best_step, best_value, reference
        self.since_gain, self.held_out_frames, self.figures_set = since_gain, frames, figures_set


def held_out_identity(manifest) -> int:
    """A number that tells held-out sets apart (0: none): their frames, utterances,
    frames per class and features' mean and variance, not where the corpus lies
    (one staged to a node's local disk is the same set)."""
    if manifest is None:
        return 0
    content = json.dumps([int(manifest.num_frames), int(manifest.num_utterances),
                          [int(c) for c in manifest.class_counts],
                          [float(v) for v in manifest.cmvn_mean],
                          [float(v) for v in manifest.cmvn_var]])
    return zlib.crc32(content.encode("utf-8")) or 1


def save_best_model(run_dir, net, *, class_priors, result: dict, step: int,
                    select_by: str) -> str:
    """Write ``RUN_DIR/best.h5``: the model, and what made it the best."""
    path = os.path.join(run_dir, BEST_MODEL)
    with atomic_h5_file(path, checksum=True, what="model") as f:
        write_model_group(f, net, class_priors=class_priors)
        f.attrs["selected_by"] = select_by
        f.attrs["selected_at_step"] = int(step)
        for key in ("dev_acc", "dev_xent"):
            if key in result:
                f.attrs[f"selected_{key}"] = float(result[key])
        if "dev_frames" in result:   # the figures' frames (training.eval_max_frames caps them)
            f.attrs["selected_dev_frames"] = int(result["dev_frames"])
    return path
