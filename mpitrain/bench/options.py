"""What ``mpitrain bench`` measures: group sizes, methods, phases and every budget.

:class:`BenchOptions` is checked when it is made, so a bad option stops the
command with one line naming it before any rank trains.  Methods come from
the strategy registry (:data:`mpitrain.parallel.registry.METHODS`), so a new
strategy is benchmarked without changes here; asynchronous ones
(``param_server``: no common steps, no one-rank group) are left out.

Example::

    options = BenchOptions(sizes=(1, 2, 4), methods=("model_averaging", "bmuf"),
                           target_accuracy=0.5, max_seconds=120)
    sizes, methods = options.resolve(world_size=4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..parallel.registry import ASYNCHRONOUS_METHODS, METHODS
from .projection import NetworkModel

DEFAULT_PROJECT_TO = (16, 32, 64, 128)
PHASES = ("throughput", "accuracy")
#: How ``--lr-scale`` sets the learning rate of N ranks from the config's (one rank's).
LR_SCALES = ("none", "linear", "sqrt")


def bench_methods() -> tuple:
    """The registry's methods whose ranks step together (the ones benchmarked).

    Example::

        bench_methods()     # ('model_averaging', 'allreduce', 'kaldi', 'bmuf', 'adpsgd')
    """
    return tuple(m for m in METHODS if m not in ASYNCHRONOUS_METHODS)


class BenchSettingsError(ValueError):
    """A setting the benchmark cannot run, found before anything is measured; every
    rank finds it alike, so one line from rank 0 says it."""


def check_benchable(cfg, methods) -> None:
    """Refuse (BenchSettingsError, one line) a config the benchmark cannot run as asked:
    asynchronous ADPSGD's ranks take no common steps to stop at a target together;
    hierarchical ADPSGD's projection needs ``parallel.ranks_per_node`` (the nodes of
    the projected sizes are not known from host names)."""
    if cfg.parallel.asynchronous and "adpsgd" in methods:
        raise BenchSettingsError("parallel.asynchronous: the benchmark mode runs ADPSGD "
                                 "lock-step; set parallel.asynchronous: false")
    if cfg.parallel.hierarchical and "adpsgd" in methods and not cfg.parallel.ranks_per_node:
        raise BenchSettingsError("parallel.ranks_per_node: the benchmark prices hierarchical "
                                 "ADPSGD's node allreduce at every size, so it needs the "
                                 "ranks per node; set parallel.ranks_per_node")


@dataclass(frozen=True)
class BenchOptions:
    """What to measure; every budget keeps each run finite.

    ``sizes``/``methods`` empty: powers of two up to the world size (and the
    world size), every registered method.  ``eval_frames``: total frames (all
    ranks) between held-out evaluations; 0: ``training.eval_interval`` of the
    config, or 1/20 of an epoch.  ``max_steps`` (per rank), ``max_frames``
    (all ranks) and ``max_seconds`` (training time) cap each time-to-accuracy
    run on top of the config's epochs; 0: no cap.  ``repeats``: throughput
    runs per method and size (the median is kept).  ``compute_seconds``:
    per-step compute time used by the projection instead of the measured one.
    ``lr_scale``: the learning rates (initial and final) of an N-rank run are
    the config's times 1 (``none``), N (``linear``) or sqrt(N) (``sqrt``), on
    top of the method's own rule (``kaldi`` already multiplies by its jobs).

    Example::

        BenchOptions(sizes=(1, 2, 4), methods=("model_averaging", "bmuf"),
                     target_accuracy=0.5, max_seconds=120)
    """

    sizes: tuple = ()
    methods: tuple = ()
    target_accuracy: Optional[float] = None
    phases: tuple = PHASES
    throughput_steps: int = 40
    repeats: int = 1
    warmup_steps: int = 10
    eval_frames: int = 0
    max_steps: int = 0
    max_frames: int = 0
    max_seconds: float = 0.0
    project_to: tuple = DEFAULT_PROJECT_TO
    network: NetworkModel = field(default_factory=NetworkModel)
    compute_seconds: float = 0.0
    lr_scale: str = "none"

    def __post_init__(self):
        if any(int(n) != n or n < 1 for n in self.sizes):
            raise ValueError(f"--sizes: expected positive integers, got {list(self.sizes)}")
        if self.sizes and 1 not in self.sizes:
            raise ValueError(f"--sizes: must include 1 (speedups are relative to one rank), "
                             f"got {list(self.sizes)}")
        unknown = [m for m in self.methods if m not in bench_methods()]
        if unknown:
            own_pace = [m for m in unknown if m in ASYNCHRONOUS_METHODS]
            what = (f"{', '.join(own_pace)}: ranks that do not step together are not "
                    "benchmarked" if own_pace else f"unknown {', '.join(unknown)}")
            raise ValueError(f"--methods: {what}; expected some of "
                             f"{', '.join(bench_methods())}")
        bad_phases = [p for p in self.phases if p not in PHASES]
        if bad_phases or not self.phases:
            raise ValueError(f"--phases: expected some of {', '.join(PHASES)}, "
                             f"got {list(self.phases)}")
        # a phase named twice runs once (and is recorded once)
        object.__setattr__(self, "phases", tuple(dict.fromkeys(self.phases)))
        if "throughput" not in self.phases and self.target_accuracy is None:
            raise ValueError("--phases accuracy: the time-to-accuracy phase needs "
                             "--target-accuracy (a held-out frame accuracy to reach)")
        if self.target_accuracy is not None and not 0 < self.target_accuracy < 1:
            raise ValueError(f"--target-accuracy: expected a frame accuracy in (0, 1), "
                             f"got {self.target_accuracy}")
        for name, flag in (("throughput_steps", "--steps"), ("warmup_steps", "--warmup-steps"),
                           ("repeats", "--repeats")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag}: expected an integer >= 1, got {getattr(self, name)}")
        for name, flag in (("eval_frames", "--eval-frames"), ("max_steps", "--max-steps"),
                           ("max_frames", "--max-frames"), ("max_seconds", "--max-seconds")):
            # (not nan: it passes every comparison, and a nan or inf budget reaches
            # bench.json, which cannot hold it, only after the whole benchmark ran)
            if not (0 <= getattr(self, name) < math.inf):
                raise ValueError(f"{flag}: expected a number >= 0 (0: no cap), "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.compute_seconds < math.inf:
            raise ValueError(f"--compute-ms: expected a step time in ms >= 0 (0: measured), "
                             f"got {self.compute_seconds * 1e3:g}")
        if self.lr_scale not in LR_SCALES:
            raise ValueError(f"--lr-scale: expected one of {', '.join(LR_SCALES)}, "
                             f"got {self.lr_scale!r}")
        if any(int(n) != n or n < 2 for n in self.project_to):
            raise ValueError(f"--project-to: expected integers >= 2, got {list(self.project_to)}")

    def resolve(self, world_size: int) -> tuple:
        """(sizes, methods) for a world of ``world_size`` ranks."""
        sizes = tuple(sorted(set(self.sizes))) if self.sizes else default_sizes(world_size)
        if sizes[-1] > world_size:
            raise ValueError(f"--sizes: {sizes[-1]} ranks asked for, but the job has "
                             f"{world_size}; launch with mpiexec -n {sizes[-1]} or more")
        # a method named twice is measured once (its runs share a directory)
        return sizes, tuple(dict.fromkeys(self.methods)) or bench_methods()

    def lr_factor(self, ranks: int) -> float:
        """The factor ``lr_scale`` applies to the learning rates of ``ranks`` ranks.

        Example::

            BenchOptions(lr_scale="linear").lr_factor(16)     # 16.0
        """
        return {"none": 1.0, "linear": float(ranks), "sqrt": float(ranks) ** 0.5}[self.lr_scale]

    @property
    def measures_accuracy(self) -> bool:
        return "accuracy" in self.phases and self.target_accuracy is not None

    def to_dict(self) -> dict:
        """The options a report records (JSON-able: tuples as lists)."""
        out = {k: getattr(self, k) for k in (
            "target_accuracy", "phases", "throughput_steps", "warmup_steps", "repeats",
            "eval_frames",
            "max_steps", "max_frames", "max_seconds", "project_to", "compute_seconds", "lr_scale")}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def default_sizes(world_size: int) -> tuple:
    """Powers of two up to ``world_size``, and ``world_size`` itself.

    Example::

        default_sizes(6)     # (1, 2, 4, 6)
    """
    sizes, n = [], 1
    while n <= world_size:
        sizes.append(n)
        n *= 2
    return tuple(sorted(set(sizes + [world_size])))
