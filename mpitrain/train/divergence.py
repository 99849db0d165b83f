"""Divergence: seen by every rank at the same step, counted, and rolled back.

Rule, applied at every progress line to figures already combined over all
ranks (so every rank takes the same decision at the same step)::

    events += s_w                       minibatches skipped in the window:
                                        their loss or update was not finite
    x_w = window cross-entropy per frame
    if s_w == 0 and x_w is not finite:  events += 1
    elif m exists and x_w > f * m:      events += 1      (the objective exploded)
    else:                               m <- x_w if m is None else (1 - a) m + a x_w
    if events > E:                      roll back

A window of fewer than ``MIN_JUDGED_FRAMES`` frames (a small minibatch and
log interval) is pooled with the next ones until they hold that many, and the
explosion test and the running mean take the pool's cross-entropy: one frame's
swings far past f x m in a run that learns.  Skipped minibatches and
non-finite windows count at once.

``m`` is a running mean of the good windows (a = 0.3 follows the falling
objective of early training without letting one window move it far), seeded
with the initial model's cross-entropy ``x_0`` (ln C: the output layer starts
at zero, so every class gets 1/C), so that a model that blows up within its
first window is judged too instead of becoming the reference; ``f``
is ``training.divergence_factor`` and ``E`` ``training.max_divergence_events``.
The event count restarts at each checkpoint written, so rare bad minibatches
are only skipped.  A roll back reloads the newest good checkpoint (or the
initial model if none was written yet) and multiplies the learning rate by
``training.rollback_lr_factor``; after ``training.max_rollbacks`` of them the
run stops with :class:`Diverged`.  A checkpoint is written only when the
parameters are finite on every rank, the last window was good and so is the
part of the window under way (a checkpoint between log lines), so a roll
back never returns to a model that was already diverging, and the windows
after it are judged against the running mean of the model it returns to
(``x_0`` for the initial model).

Example::

    guard = DivergenceGuard(factor=3.0, max_events=10, max_rollbacks=3,
                            initial_xent=math.log(120))
    verdict = guard.observe(xent=2.1, skipped=0)     # "ok", "event" or "roll back"
"""

from __future__ import annotations

import glob
import math
import os
import sys

from ..config import STRONG_L2_SHRINK, l2_shrink
from ..state_fields import count, number

#: Weight of a new window in the running mean of the objective.
MEAN_WEIGHT = 0.3

OK, EVENT, ROLL_BACK = "ok", "event", "roll back"

#: Frames (all ranks') a window must hold to be judged for an explosion; smaller
#: ones are pooled until they do (windows of one frame, minibatch 1 and log
#: interval 1, counted the noise of single frames as explosions: a run that was
#: learning rolled back three times and stopped as diverged)
MIN_JUDGED_FRAMES = 1000


class Diverged(RuntimeError):
    """Training diverged more often than the configured roll backs allow."""


def divergence_advice(cfg) -> str:
    """What to change when a run keeps diverging: the rate and max-change, and the
    settings of ``cfg`` that enlarge the step beyond plain SGD's.

    Example::

        divergence_advice(cfg)   # 'lower optimizer.initial_learning_rate or the
                                 #  max-change values, or optimizer.l2_regularize (0.5)'
    """
    opt = cfg.optimizer
    if not any(getattr(opt, key) for key in ("max_change_per_layer", "max_change_output",
                                             "max_change", "max_change_per_sample")):
        # (every limit at 0 is off: lowering them changes nothing)
        advice = ("lower optimizer.initial_learning_rate, or turn max-change on "
                  "(optimizer.max_change_per_layer, max_change_output and max_change "
                  "are all 0: off)")
    else:
        advice = "lower optimizer.initial_learning_rate or the max-change values"
    suspects = _step_suspects(cfg)
    if suspects:
        advice += ", or " + suspects
    return advice + _factor_note(cfg)


def _step_suspects(cfg) -> str:
    """The settings of ``cfg`` besides the rate that enlarge the step, with their
    values ('optimizer.l2_regularize (0.5)'); empty when none does."""
    opt, par = cfg.optimizer, cfg.parallel
    # past a tenth of the weights a step at the largest rate, L2 is what blows up
    suspects = [(f"optimizer.{key}", f"{getattr(opt, key):g}")
                for key in ("l2_regularize", "l2_regularize_output")
                if l2_shrink(cfg, key) >= STRONG_L2_SHRINK]
    if par.method == "bmuf":
        # its block step is block_lr times the averaged change, carried on by its momentum
        if par.block_lr > 1:
            suspects.append(("parallel.block_lr", f"{par.block_lr:g}"))
        suspects.append(("parallel.block_momentum", f"{par.block_momentum:g}"
                         if par.block_momentum >= 0 else "1 - 1/ranks"))
    return ", ".join(f"{key} ({value})" for key, value in suspects)


def _factor_note(cfg) -> str:
    factor = cfg.training.divergence_factor
    if 0 < factor < 1.5:
        # a window only a little above the running mean counts as exploding
        return (f"; or raise training.divergence_factor ({factor:g}: a window above that "
                "many times the running mean counts as exploding)")
    return ""


class DivergenceGuard:
    """Counts divergence events between checkpoints and decides on roll backs.

    ``factor`` 0 turns the explosion test off (non-finite windows still count).
    ``initial_xent`` seeds the running mean (None: the first good window does);
    ``advice`` ends the message of :class:`Diverged` (what to change).
    """

    def __init__(self, *, factor: float, max_events: int, max_rollbacks: int,
                 lr_factor: float = 0.5, initial_xent: float | None = None,
                 advice: str = "lower optimizer.initial_learning_rate or the max-change "
                               "values"):
        self.factor, self.max_events = float(factor), int(max_events)
        self.max_rollbacks, self.lr_factor = int(max_rollbacks), float(lr_factor)
        self.initial_xent = None if initial_xent is None else float(initial_xent)
        self.advice = advice          # the last words of :class:`Diverged`
        self.running_mean = self.initial_xent
        self.events = 0              # since the last checkpoint or roll back
        self.last_window_good = True
        # kept in checkpoints: the run continues with what it learned
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.skipped_total = 0       # minibatches, summed over ranks
        self.exploded_total = 0      # windows
        # small windows not judged yet: their cross-entropy sum and frames
        self.pool_loss, self.pool_frames = 0.0, 0

    def observe(self, *, xent: float, skipped: int, frames: int | None = None) -> str:
        """Judge one log window (``xent`` per frame, ``skipped`` minibatches;
        ``frames``, all ranks', pools it with the next while under
        :data:`MIN_JUDGED_FRAMES`; None: judged alone)."""
        skipped = int(skipped)
        self.skipped_total += skipped
        new_events = skipped
        good = skipped == 0
        judged = xent if not math.isfinite(xent) else self._pooled(xent, frames)
        if not math.isfinite(xent):
            good = False
            self.pool_loss, self.pool_frames = 0.0, 0
            if skipped == 0:
                new_events += 1
                self.exploded_total += 1
        elif judged is None:
            pass                # too few frames yet to tell an explosion from noise
        elif self.factor > 0 and self.running_mean is not None \
                and judged > self.factor * self.running_mean:
            good = False
            new_events += 1
            self.exploded_total += 1
        elif skipped == 0:
            self.running_mean = judged if self.running_mean is None else \
                (1.0 - MEAN_WEIGHT) * self.running_mean + MEAN_WEIGHT * judged
        self.last_window_good = good
        self.events += new_events
        if self.events > self.max_events:
            return ROLL_BACK
        return OK if new_events == 0 else EVENT

    def part_is_good(self, *, xent: float | None, skipped: int,
                     frames: int | None = None) -> bool:
        """Whether the part of a log window run so far (``xent`` per frame, None when
        it has no frames yet; ``skipped`` minibatches; ``frames``, all ranks', pooled
        as :meth:`observe` pools them) would be judged good, counting nothing: a
        checkpoint written inside a window that has begun to blow up would be the
        model a roll back returns to."""
        if skipped:
            return False
        if xent is None:
            return True
        if not math.isfinite(xent):
            return False
        if frames is not None:
            pooled = self.pool_frames + int(frames)
            if pooled < MIN_JUDGED_FRAMES:
                return True         # too few frames yet to tell an explosion from noise
            xent = (self.pool_loss + xent * frames) / pooled
        return not (self.factor > 0 and self.running_mean is not None
                    and xent > self.factor * self.running_mean)

    def _pooled(self, xent: float, frames: int | None):
        """The cross-entropy to judge: the window's own when it is large enough (or
        its frames are not known), else the pool's once it has grown so; None
        while the pool is still too small."""
        if frames is None or (not self.pool_frames and frames >= MIN_JUDGED_FRAMES):
            return xent
        self.pool_loss += xent * frames
        self.pool_frames += int(frames)
        if self.pool_frames < MIN_JUDGED_FRAMES:
            return None
        judged = self.pool_loss / self.pool_frames
        self.pool_loss, self.pool_frames = 0.0, 0
        return judged

    def checkpoint_written(self) -> None:
        self.events = 0

    def roll_back(self) -> None:
        """Count a roll back and lower the rate; :class:`Diverged` past the limit."""
        if self.rollbacks >= self.max_rollbacks:
            raise Diverged(
                f"training diverged: {self.events} non-finite or exploding minibatches/"
                f"windows since the last checkpoint after {self.rollbacks} roll back(s) "
                f"(learning rate now x{self.lr_scale:g}); {self.advice}")
        self.rollbacks += 1
        # kept above 0 (a rate scale of 1e-300 squared is 0, which no state accepts):
        # the smallest positive double is no step at all in float32
        self.lr_scale = max(self.lr_scale * self.lr_factor, sys.float_info.min)
        self.events = 0
        self.running_mean = self.initial_xent   # the trainer sets the checkpoint's
        self.last_window_good = True
        self.pool_loss, self.pool_frames = 0.0, 0

    # -- checkpointed part ------------------------------------------------------------
    def state_dict(self) -> dict:
        # the running mean too, so that a resumed run judges its windows as the
        # uninterrupted run does (none before the first good window)
        mean = {} if self.running_mean is None else {"running_mean": self.running_mean}
        # and the small windows not judged yet, so a resumed run pools them alike
        pool = {"pool_loss": self.pool_loss, "pool_frames": self.pool_frames} \
            if self.pool_frames else {}
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale,
                "skipped_total": self.skipped_total, "exploded_total": self.exploded_total,
                **mean, **pool}

    def load_state_dict(self, state: dict) -> None:
        # (the field alone is named: the group holds the corpus digest and much else)
        where = "checkpoint group 'trainer'"
        self.rollbacks = count(state, "rollbacks", where, default=0)
        self.lr_scale = number(state, "lr_scale", where, default=1.0, low=0.0, low_open=True,
                               high=1.0)
        self.skipped_total = count(state, "skipped_total", where, default=0)
        self.exploded_total = count(state, "exploded_total", where, default=0)
        # absent: written before any good window
        self.running_mean = self.initial_xent if state.get("running_mean") is None else \
            number(state, "running_mean", where, low=0.0)
        self.pool_loss = number(state, "pool_loss", where, default=0.0, low=0.0)
        self.pool_frames = count(state, "pool_frames", where, default=0,
                                 high=MIN_JUDGED_FRAMES - 1)

def restart_advice(run_dir: str, cfg=None) -> str:
    """What to do after a run that cannot roll back diverged: resume with a lower
    rate when a checkpoint is there, else start again with one; with ``cfg``, the
    other settings that enlarge the step are named too (as :func:`divergence_advice`
    names them), for a rate may not be what blew the step up."""
    resume = any(not os.path.isdir(path) for path in
                 glob.glob(os.path.join(glob.escape(run_dir), "ckpt-*.h5")))
    advice = ("resume from the last checkpoint with a lower learning rate "
              "(--resume --accept-changes --set optimizer.initial_learning_rate=...)"
              if resume else
              "no checkpoint was written yet: start again with a lower learning rate "
              "(--overwrite --set optimizer.initial_learning_rate=...)")
    if cfg is None:
        return advice
    suspects = _step_suspects(cfg)
    return advice + (f", or lower {suspects}" if suspects else "") + _factor_note(cfg)
