"""``search``: You & Xu's ASGD-search, one pass with a rate chosen by trials per chunk.

Rule.  The run is cut into chunks of ``chunk_steps`` minibatches (about an
hour of frames over all ranks: ``optimizer.search_chunk_frames``).  Before
each chunk, for every factor f in ``optimizer.search_factors`` (0.5, 1, 2),
a trial trains ``trial_steps`` minibatches (``search_trial_fraction``, ~3% of
the chunk, at least two) at rate ``r f`` from the current weights; the trial's objective is
its training cross-entropy per frame over all ranks' frames (each minibatch is
scored before its update: progressive validation).  The chunk is trained at
``r <- r f*`` with f* the factor of the lowest objective (the first one on a
tie; a non-finite trial never wins; if all are non-finite the smallest rate is
kept).  ``r`` starts at ``optimizer.initial_learning_rate``.

After a roll back (training diverged; the trainer's rate scale was lowered)
the next search tries no factor above 1: otherwise a short trial, which does
not see the divergence, picks the higher rate and the scale's cut is undone
(factor 2 after a halving retrains at the rate that diverged).

A factor that puts the rate at ``rate_limit`` or above is not tried: there the
L2 term alone zeroes or flips the weights each step (the config's bound holds
at the initial rate only), and a model it has worn down to chance scores alike
at every rate, so the choice among them is noise that can climb past it.

This class decides; running a trial (and putting the weights, the optimizer
and the reader back afterwards) is the trainer's (``train/search.py``), given
as the ``trial`` callable, so the objectives arrive already combined over ranks
and every rank picks the same rate.

Example::

    sched = SearchSchedule(0.008, factors=(0.5, 1.0, 2.0), chunk_steps=1400, trial_steps=42)
    if sched.search_due(step):
        found = sched.search(step, trial)     # trial(rate) -> (objective, frames)
    rate = sched.rate(step)
"""

from __future__ import annotations

import math

from ..state_fields import count, flag, number
from .schedule import Schedule


class SearchSchedule(Schedule):
    """See the module docstring."""

    name = "search"

    def __init__(self, initial: float, *, factors, chunk_steps: int, trial_steps: int,
                 rate_limit: float = math.inf):
        factors = tuple(float(f) for f in factors)
        if initial <= 0 or not factors or min(factors) <= 0:
            raise ValueError(f"search schedule: need initial > 0 and positive factors, got "
                             f"{initial}, {factors}")
        if chunk_steps < 1 or trial_steps < 1:
            raise ValueError(f"search schedule: chunk_steps and trial_steps must be >= 1, got "
                             f"{chunk_steps}, {trial_steps}")
        self.factors = factors
        self.chunk_steps, self.trial_steps = int(chunk_steps), int(trial_steps)
        self.initial = self.current = float(initial)
        self.searched_at = -1        # the step whose chunk already has its rate
        self.searches = 0
        self.trial_frames = 0        # frames the trials trained on, summed over ranks
        self.held_back = False       # the next search tries no factor above 1
        self.rate_limit = float(rate_limit)

    def rate(self, step: int) -> float:
        return self.current

    def search_due(self, step: int) -> bool:
        return step % self.chunk_steps == 0 and step != self.searched_at

    def search(self, step: int, trial) -> dict:
        """Try every factor with ``trial(rate) -> (objective, frames)`` and keep the best
        rate; returns the rates tried, their objectives and the choice."""
        factors = self.factors
        if self.held_back:
            factors = tuple(f for f in factors if f <= 1.0) or (min(factors),)
            self.held_back = False
        factors = tuple(f for f in factors if self.current * f < self.rate_limit) \
            or (min(factors),)
        rates = [self.current * f for f in factors]
        objectives = []
        for rate in rates:
            objective, frames = trial(rate)
            objective = float(objective)
            objectives.append(objective if math.isfinite(objective) else math.inf)
            self.trial_frames += int(frames)
        if all(math.isinf(o) for o in objectives):
            best = min(range(len(rates)), key=lambda i: rates[i])
        else:
            best = min(range(len(rates)), key=lambda i: objectives[i])
        self.current = rates[best]
        self.searched_at = int(step)
        self.searches += 1
        return {"rates": rates, "objectives": objectives, "chosen": self.current}

    def after_roll_back(self) -> None:
        self.held_back = True

    def state_dict(self) -> dict:
        return {"rate": self.current, "searched_at": self.searched_at,
                "searches": self.searches, "trial_frames": self.trial_frames,
                "held_back": int(self.held_back)}

    def load_state_dict(self, state: dict) -> None:
        where = "search schedule state"
        if "rate" not in state:
            raise ValueError(f"{where}: missing 'rate'")
        searches = count(state, "searches", where, default=0)
        # each search multiplies the rate by one of the factors: no more than the
        # largest to the number of searches (in logarithms: that power overflows)
        rate = number(state, "rate", where, low=0.0, low_open=True)
        grown = math.log(rate / self.initial)
        if grown > searches * math.log(max(max(self.factors), 1.0)) + 1e-9 \
                or grown < searches * math.log(min(min(self.factors), 1.0)) - 1e-9:
            raise ValueError(f"{where}: field 'rate': {rate:g} is not the initial rate "
                             f"{self.initial:g} times {searches} of the factors "
                             f"{list(self.factors)}")
        searched_at = count(state, "searched_at", where, default=-1, low=-1)
        trial_frames = count(state, "trial_frames", where, default=0)
        held_back = flag(state, "held_back", where, default=False)
        self.current, self.searched_at, self.searches = rate, searched_at, searches
        self.trial_frames, self.held_back = trial_frames, held_back
