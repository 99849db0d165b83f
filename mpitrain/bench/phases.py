"""The two measured phases of ``mpitrain bench``, each a run of the trainer on one group.

1. Throughput (:func:`throughput_phase`, :func:`measure_throughput`): a fixed
   number of steps without held-out evaluation; frames/s in total and per
   rank, and the share of each step spent inside the communicator (waiting
   for a slower rank included) versus computing, from the trainer's own
   progress windows with the first (warm-up) dropped, timed where the ranks
   have summed each window (every rank done with its steps).  A run that diverges
   (past its roll backs) gives a row marked ``diverged``, without figures.
2. Time to accuracy (:func:`time_to_accuracy`): training with the config's
   schedule and epochs until the held-out frame accuracy reaches the target
   or a budget runs out.  Frames and training seconds (evaluations and
   checkpoints excluded, :class:`BenchTrainer`) at the target are
   interpolated linearly between the two evaluations around the first
   crossing.  Evaluations are placed at sync points of the method, so they
   see the model all ranks agree on.

Each run is the trainer itself (``Trainer.run``, the one ``TrainingStep``),
configured by a validated copy of the user's config.  Times come from the
communicator's clock; on virtual ranks (``compute``, a
:class:`~mpitrain.train.virtual.ComputeModel`) they are simulated.

Example::

    rows = throughput_phase(cfg, group, methods=("bmuf",), options=BenchOptions(),
                            out_dir="runs/b")
    row = time_to_accuracy(cfg, group, method="bmuf", run_dir="runs/b/a-bmuf-n2",
                           options=BenchOptions(target_accuracy=0.4), sync_period=8,
                           steps_per_epoch_1=1400)
"""

from __future__ import annotations

import glob
import math
import os
from typing import Optional, Sequence

import numpy as np

from ..config import ONE_METHOD_SETTINGS, ParallelConfig, config_from_dict
from ..parallel.registry import build_strategy, straggler_of
from ..train.errors import TrainingError
from ..train.trainer import Trainer
from .options import BenchOptions, BenchSettingsError, check_benchable

#: Evaluations per epoch (of the one-rank run) when neither option nor config says.
DEFAULT_EVALS_PER_EPOCH = 20


def scaled_rates(cfg, options: BenchOptions, ranks: int) -> dict:
    """``_with`` overrides of the learning rates for ``ranks`` ranks under
    ``options.lr_scale`` (empty when the rates stay the config's).

    Example::

        scaled_rates(cfg, BenchOptions(lr_scale="linear"), 4)
        # {'optimizer__initial_learning_rate': 0.016, 'optimizer__final_learning_rate': 0.0016}
    """
    factor = options.lr_factor(ranks)
    if factor == 1.0:
        return {}
    opt = cfg.optimizer
    return {"optimizer__initial_learning_rate": opt.initial_learning_rate * factor,
            "optimizer__final_learning_rate": opt.final_learning_rate * factor}


def _with(cfg, **dotted):
    """A validated copy of ``cfg`` with ``section__key=value`` replaced."""
    data = cfg.to_dict()
    for key, value in dotted.items():
        node = data
        *parents, leaf = key.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config_from_dict(data)


def jobs_within(cfg, ranks: int) -> dict:
    """``parallel.num_jobs_initial/final`` capped at ``ranks``, as ``_with`` overrides:
    a Kaldi job ramp set for the largest group still runs on the smaller ones
    (one rank: one job).

    Example::

        jobs_within(cfg, 1)    # {'parallel__num_jobs_initial': 1, ...} when set above 1
    """
    par = cfg.parallel
    return {f"parallel__{key}": min(value, ranks)
            for key, value in (("num_jobs_initial", par.num_jobs_initial),
                               ("num_jobs_final", par.num_jobs_final)) if value > ranks}


def straggler_within(cfg, ranks: int) -> dict:
    """``parallel.straggler.ranks`` cut to the group's ranks, as ``_with`` overrides: a
    slow rank 1 is slow in every group that has a rank 1 (the one-rank group has none).

    Example::

        straggler_within(cfg, 1)    # {'parallel__straggler__ranks': ()} when ranks is (1,)
    """
    slow = tuple(cfg.parallel.straggler.ranks)
    inside = tuple(r for r in slow if r < ranks)
    return {"parallel__straggler__ranks": inside} if inside != slow else {}


def without_own_method_settings(cfg, methods) -> tuple:
    """``(cfg, left_out)``: a benchmark runs each of ``methods`` as ``parallel.method``,
    so when the config's own method is not among them, its settings that only it
    takes (``parallel.servers`` of a ``param_server`` config) concern no run and
    are left out (set to their defaults); ``left_out``: those settings as given
    (``"parallel.servers=2"``), empty when none.

    Example::

        cfg, left_out = without_own_method_settings(cfg, ("model_averaging",))
    """
    own = cfg.parallel.method
    if own in methods:
        return cfg, []
    defaults = ParallelConfig()
    given = {key: getattr(cfg.parallel, key) for key, is_set, method in ONE_METHOD_SETTINGS
             if method == own and is_set(getattr(cfg.parallel, key))}
    if not given:
        return cfg, []
    left_out = [f"parallel.{key}={str(value).lower() if isinstance(value, bool) else value}"
                for key, value in given.items()]
    return _with(cfg, **{f"parallel__{key}": getattr(defaults, key) for key in given}), left_out


def group_settings(cfg, method: str, ranks: int) -> dict:
    """The ``_with`` overrides every run of ``method`` on a group of ``ranks`` takes."""
    return dict(parallel__method=method, **jobs_within(cfg, ranks),
                **straggler_within(cfg, ranks))


def check_groups(cfg, methods, sizes) -> None:
    """Refuse, before anything is measured, a config that some method or group size
    of the benchmark cannot take (a setting of one method, as
    ``parallel.straggler_policy: adapt`` with ``allreduce``): BenchSettingsError
    naming the methods that take it at every size."""
    outside = [r for r in cfg.parallel.straggler.ranks if r >= max(sizes)]
    if outside:
        # a slow rank is slow in the groups that have it; one that none has would
        # be dropped without a word
        raise BenchSettingsError(f"parallel.straggler.ranks: rank {outside[0]} is in none of "
                                 f"the benchmark's groups (the largest has {max(sizes)} "
                                 f"rank(s): ranks 0..{max(sizes) - 1})")
    problems = {}
    for method in methods:
        for ranks in sizes:
            try:
                _with(cfg, **group_settings(cfg, method, ranks))
            except ValueError as exc:
                problems[method] = str(exc)
                break
    if problems:
        method, message = next(iter(problems.items()))
        fits = [m for m in methods if m not in problems]
        hint = (f"benchmark the methods the config's settings fit (--methods "
                f"{','.join(fits)})" if fits else "no method asked for takes them")
        raise BenchSettingsError(f"{message}; the benchmark runs the config with "
                                 f"parallel.method {method}: {hint}, or leave the setting out")


def check_runs(cfg, options: BenchOptions, methods, sizes) -> None:
    """Refuse, before anything is measured, a config that one of the benchmark's runs
    cannot take once its rates are scaled (an L2 bounded at the config's rate but not
    at N times it): BenchSettingsError naming the run (phase, method, ranks) and the
    rate scale.  Every size is tried in turn, so the smallest that fails is named."""
    for ranks in sizes:
        for method in methods:
            for phase in options.phases:
                if phase == "accuracy" and not options.measures_accuracy:
                    continue    # (skipped with a notice)
                try:
                    _with(cfg, **phase_settings(cfg, options, phase, method, ranks))
                except ValueError as exc:
                    factor = options.lr_factor(ranks)
                    scaled = (f" scales the config's rates x{factor:g} (--lr-scale "
                              f"{options.lr_scale})" if factor != 1.0 else "")
                    timed = (" times newbob's rates as an exponential schedule"
                             if phase == "throughput" and cfg.optimizer.schedule == "newbob"
                             else "")
                    raise BenchSettingsError(
                        f"{exc}; the benchmark's {phase} run of {method} on {ranks} "
                        f"rank(s){scaled}{' and' if scaled and timed else ''}{timed}: "
                        "lower the setting" + (", or give a smaller --lr-scale or group "
                                               "sizes" if scaled else "")) from None


def phase_settings(cfg, options: BenchOptions, phase: str, method: str, ranks: int) -> dict:
    """The ``_with`` overrides of the config that decide whether a run of ``phase``
    can take it (budgets and intervals, set at run time, are valid by construction)."""
    if phase == "accuracy":
        return dict(**scaled_rates(cfg, options, ranks), **group_settings(cfg, method, ranks))
    return throughput_settings(cfg, options, method, ranks)


def throughput_settings(cfg, options: BenchOptions, method: str, ranks: int) -> dict:
    """The ``_with`` overrides of a throughput run of ``method`` on ``ranks`` ranks."""
    # no held-out set here, so nothing that decides on one: newbob's rate rule and
    # early stopping (the rate a step is timed at does not change its time)
    held_out_free = {"training__early_stop__patience": 0}
    if cfg.optimizer.schedule == "newbob":
        held_out_free["optimizer__schedule"] = "exponential"
    # every rank active: a Kaldi job ramp spans the planned run (1000 epochs here), so
    # it would stay at num_jobs_initial and the group's other ranks would only wait
    return dict(**scaled_rates(cfg, options, ranks), **held_out_free,
                parallel__num_jobs_initial=0, parallel__num_jobs_final=0,
                **straggler_within(cfg, ranks),
                parallel__method=method, data__dev="",
                training__max_steps=options.warmup_steps + options.throughput_steps,
                training__epochs=1000.0, training__log_interval=options.warmup_steps,
                training__checkpoint_interval=0)


def check_bench(cfg, options, sizes, methods) -> None:
    """Everything the benchmark refuses before it measures or writes anything
    (BenchSettingsError, one line; every rank finds it alike)."""
    check_benchable(cfg, methods)
    if options.measures_accuracy and not cfg.data.dev:
        raise BenchSettingsError("data.dev: the time-to-accuracy phase needs a held-out "
                                 "corpus (set data.dev, or run with --phases throughput)")
    check_groups(cfg, methods, sizes)
    check_runs(cfg, options, methods, sizes)


class BenchTrainer(Trainer):
    """The trainer, timing what is not training and stopping at the target.

    Training seconds exclude held-out evaluations (with their records, the model
    averaged for them and best.h5) and checkpoints; each evaluation is recorded
    as a point (step, frames, seconds, accuracy).

    Example::

        trainer = BenchTrainer(cfg, run_dir="runs/b", comm=group, target=0.6)
        trainer.run()
        trainer.points[-1]["dev_acc"]
    """

    def __init__(self, cfg, *, target: Optional[float] = None, max_seconds: float = 0.0,
                 compute=None, repeat: int = 0, **kwargs):
        super().__init__(cfg, **kwargs)
        self.target, self.max_seconds = target, max_seconds
        if repeat and self.strategy.straggler is not None:
            # real ranks slowed by parallel.straggler: each repeat its own jitter draw
            # (the same one N times measured nothing)
            self.strategy.straggler = straggler_of(cfg, self.comm, repeat=repeat)
        if compute is not None:
            # virtual ranks: each minibatch charges the compute model's step time (each
            # repeat of a throughput run its own jitter draw: the same one N times
            # measured nothing)
            from ..train.virtual import ClockedStream
            self.stream = ClockedStream(self.stream, self.comm,
                                        compute.step_times(self.comm.rank, repeat=repeat))
        self.points, self.stop_reason = [], None
        self.outside_seconds, self._t0 = 0.0, None
        self.windows = []

    # Times come from the communicator's clock: wall time under MPI, simulated
    # time on virtual ranks.
    def training_seconds(self) -> float:
        return self.comm.wtime() - self._t0 - self.outside_seconds

    def run(self) -> dict:
        self._t0 = self.comm.wtime()
        return super().run()

    def on_progress(self, frames: int, sum_seconds: float) -> None:
        # after the ranks summed the window: the group's pace, the wait for its
        # slowest rank at the sum included (the train record's window ends before it)
        self.windows.append({"steps": self._steps_trained, "frames": frames,
                             "seconds": self.comm.wtime(), "comm": self.comm.comm_time,
                             "sum_seconds": sum_seconds})

    def _log_eval(self, *, final: bool = False) -> dict:
        # the whole evaluation is untimed, not only the held-out pass: the average it
        # scores (ADPSGD), its records and rank 0's best.h5 (a model file written at
        # nearly every evaluation of a run that improves)
        self.comm.barrier()       # the slowest rank's training time counts
        start = self.comm.wtime()
        seconds = start - self._t0 - self.outside_seconds
        result = super()._log_eval(final=final)
        self.comm.barrier()       # every rank waits for rank 0's best.h5 here, untimed
        self.outside_seconds += self.comm.wtime() - start
        if result:
            self.points.append({"step": self.step, "frames": self.frames_seen,
                                "seconds": seconds, "dev_acc": float(result["dev_acc"]),
                                "dev_xent": float(result["dev_xent"])})
        return result

    def save_checkpoint(self) -> None:
        start = self.comm.wtime()
        super().save_checkpoint()
        self.outside_seconds += self.comm.wtime() - start

    def on_eval(self, result: dict) -> bool:
        reached = self.target is not None and result.get("dev_acc", 0.0) >= self.target
        late = bool(self.max_seconds) and self.training_seconds() >= self.max_seconds
        # clocks differ between ranks: agree, or some ranks would train on alone
        flags = self.comm.allreduce_scalar(int(reached) * 2 + int(late), op="max")
        if flags:
            self.stop_reason = "target" if flags >= 2 else "--max-seconds"
        return bool(flags)

    # the config's own stops end a run before its epochs too: name them, not "epochs"
    def _stops_early(self) -> bool:
        stop = super()._stops_early()
        if stop and self.stop_reason is None:
            self.stop_reason = "early stopping"
        return stop

    def _end_schedule_epoch(self, result: dict) -> bool:
        stop = super()._end_schedule_epoch(result)
        if stop and self.stop_reason is None:
            self.stop_reason = f"{self.schedule.name} schedule"
        return stop


def _run_trainer(cfg, group, run_dir: str, *, diverged_ends_it: bool = False, **kwargs):
    """Build, run and close one trainer; rank 0 of the group logs into ``run_dir``.
    ``diverged_ends_it``: a run that diverged (every rank of the group alike) returns
    its steps and frames so far and ``diverged`` (the reason) instead of raising."""
    log = None
    if group.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        # (surrogateescape: a path's bytes that are not UTF-8 are logged as they are,
        # as on the console)
        log = open(os.path.join(run_dir, "train.log"), "w", encoding="utf-8",
                   errors="surrogateescape")
    try:
        trainer = BenchTrainer(cfg, run_dir=run_dir, comm=group, stream=log, **kwargs)
        try:
            result = trainer.run()
        except TrainingError as exc:
            if not (diverged_ends_it and trainer.diverged):
                raise
            result = {"steps": trainer.step, "frames": trainer.frames_seen,
                      "diverged": " ".join(str(exc).split())}
        finally:
            trainer.close()
    finally:
        if log is not None:
            log.close()
    if group.rank == 0:
        # keep the metrics and log; models and checkpoints of a benchmark are not needed
        for path in glob.glob(os.path.join(run_dir, "ckpt-*.h5")) + \
                [os.path.join(run_dir, name) for name in ("final.h5", "best.h5")]:
            if os.path.exists(path):
                os.remove(path)
    return trainer, result


def throughput_from_windows(windows: Sequence[dict], *, ranks: int,
                            comm_seconds: Optional[float] = None,
                            overhead_seconds: float = 0.0) -> dict:
    """Frames/s and the compute/communication split over a run's progress windows
    (:meth:`BenchTrainer.on_progress`: cumulative ``steps``, ``seconds`` and
    ``comm`` taken where the ranks summed a window, ``frames`` of all ranks in the
    window), dropping the first window (warm-up).

    The time between two such points is the group's: every rank had finished its
    steps by then, the slowest included.  ``overhead_seconds``: the sums' own cost
    in the measured windows (not training), taken out of the time and of the
    communication.  ``comm_seconds``: the ranks' mean time inside the communicator
    over the measured windows, that cost taken out (default: this rank's, less it).

    Example::

        throughput_from_windows(trainer.windows, ranks=2)["frames_per_sec"]
    """
    if len(windows) < 2:
        raise ValueError("throughput: need at least two progress records (warm-up and one "
                         f"measured window), got {len(windows)}")
    first, last = windows[0], windows[-1]
    frames = float(sum(w["frames"] for w in windows[1:]))
    seconds = last["seconds"] - first["seconds"] - overhead_seconds
    steps = last["steps"] - first["steps"]
    comm = last["comm"] - first["comm"] - overhead_seconds if comm_seconds is None \
        else comm_seconds
    comm_fraction = min(1.0, max(0.0, comm / seconds))
    step_s = seconds / steps
    return {"frames_per_sec": frames / seconds, "frames_per_sec_per_rank": frames / seconds / ranks,
            "measured_steps": int(steps), "measured_seconds": seconds,
            "step_seconds": step_s, "comm_fraction": comm_fraction,
            "compute_seconds_per_step": step_s * (1 - comm_fraction),
            "comm_seconds_per_step": step_s * comm_fraction}


#: The figures :func:`throughput_from_windows` gives (None in a diverged point's row).
THROUGHPUT_FIGURES = ("frames_per_sec", "frames_per_sec_per_rank", "measured_steps",
                      "measured_seconds", "step_seconds", "comm_fraction",
                      "compute_seconds_per_step", "comm_seconds_per_step")


def measure_throughput(cfg, group, *, method: str, run_dir: str, options: BenchOptions,
                       compute=None, repeat: int = 0) -> dict:
    """Phase 1 for one method on ``group``; the dict is complete on group rank 0.
    ``repeat``: the index of this run among the method's repeats (with a jitter, its
    own draw: of the virtual ranks' step times, or of ``parallel.straggler``).

    Example::

        row = measure_throughput(cfg, group, method="bmuf", run_dir="runs/b/t-bmuf-n2",
                                 options=BenchOptions())
    """
    run_cfg = _with(cfg, **throughput_settings(cfg, options, method, group.size))
    # a method that diverges at this size is a result, not the end of the benchmark
    trainer, result = _run_trainer(run_cfg, group, run_dir, compute=compute, repeat=repeat,
                                   diverged_ends_it=True)
    row = {"method": method, "ranks": group.size, "minibatch": run_cfg.training.minibatch,
           "num_params": int(trainer.net.num_params),
           "sync_period": int(trainer.strategy.sync_period), "run_dir": run_dir,
           "initial_learning_rate": run_cfg.optimizer.initial_learning_rate}
    if "diverged" in result:
        # no speed is measured: windows of a blown-up model (skipped steps, roll
        # backs training steps again) time something else
        row.update(dict.fromkeys(THROUGHPUT_FIGURES), diverged=result["diverged"],
                   steps=int(result["steps"]))
    else:
        # every rank alike (its windows are the group's).  A window's sum cost the
        # rank that came last no wait: the least any rank spent in it is its own
        # cost, which a step of training does not have (the sums are every few
        # steps here; on many virtual ranks their latency would read as the method's)
        windows = trainer.windows
        sums = np.array([w["sum_seconds"] for w in windows[1:]] or [0.0])
        group.allreduce_(sums, op="min")
        overhead = float(sums.sum()) if len(windows) >= 2 else 0.0
        comm = np.array([windows[-1]["comm"] - windows[0]["comm"] - overhead]
                        if len(windows) >= 2 else [0.0])
        group.allreduce_(comm, op="sum")
        row.update(throughput_from_windows(windows, ranks=group.size,
                                           comm_seconds=float(comm[0]) / group.size,
                                           overhead_seconds=overhead))
    return row


def eval_interval_per_rank(total_frames: int, *, ranks: int, minibatch: int,
                           sync_period: int) -> int:
    """Frames per rank between evaluations: ``total_frames`` shared by the ranks,
    rounded up to whole sync periods so each evaluation sees the agreed model.

    Example::

        eval_interval_per_rank(20000, ranks=2, minibatch=256, sync_period=8)   # 10240
    """
    block = minibatch * sync_period
    return max(1, math.ceil(total_frames / ranks / block)) * block


def first_crossing(points: Sequence[dict], target: float) -> Optional[dict]:
    """Frames and seconds where accuracy first reaches ``target``, interpolated
    linearly between the evaluation before and the first one at or above it.

    The first evaluation already at the target gives its own figures (an upper
    bound, ``interpolated`` False).  None when the target is never reached.

    Example::

        first_crossing([{"frames": 100, "seconds": 1.0, "dev_acc": 0.2},
                        {"frames": 200, "seconds": 2.0, "dev_acc": 0.6}], 0.4)
        # {'frames': 150.0, 'seconds': 1.5, 'interpolated': True, ...}
    """
    prev = None
    for point in points:
        if point["dev_acc"] >= target:
            if prev is None:
                return {"frames": float(point["frames"]), "seconds": float(point["seconds"]),
                        "interpolated": False, "eval_step": point.get("step")}
            frac = (target - prev["dev_acc"]) / (point["dev_acc"] - prev["dev_acc"])
            return {"frames": prev["frames"] + frac * (point["frames"] - prev["frames"]),
                    "seconds": prev["seconds"] + frac * (point["seconds"] - prev["seconds"]),
                    "interpolated": True, "eval_step": point.get("step")}
        prev = point
    return None


def budget_reason(steps: int, caps: dict) -> str:
    """Which budget ended a run that took ``steps`` steps: the smallest of ``caps``
    (name -> steps per rank) when it was reached, else the config's epochs.

    Example::

        budget_reason(4, {"--max-steps": 10, "--max-frames": 4})    # '--max-frames'
    """
    if caps and steps >= min(caps.values()):
        return min(caps, key=caps.get)
    return "epochs"


def time_to_accuracy(cfg, group, *, method: str, run_dir: str, options: BenchOptions,
                     sync_period: int, steps_per_epoch_1: int, compute=None) -> dict:
    """Phase 2 for one method on ``group``; the dict is complete on group rank 0.

    Example::

        row = time_to_accuracy(cfg, group, method="kaldi", run_dir="runs/b/a-kaldi-n2",
                               options=BenchOptions(target_accuracy=0.4), sync_period=8,
                               steps_per_epoch_1=1400)
    """
    batch, n = cfg.training.minibatch, group.size
    total_between = options.eval_frames or cfg.training.eval_interval or max(
        batch, steps_per_epoch_1 * batch // DEFAULT_EVALS_PER_EPOCH)
    interval = eval_interval_per_rank(total_between, ranks=n, minibatch=batch,
                                      sync_period=sync_period)
    caps = {name: c for name, c in (
        ("training.max_steps", cfg.training.max_steps), ("--max-steps", options.max_steps),
        ("--max-frames", math.ceil(options.max_frames / (batch * n)) if options.max_frames
         else 0)) if c}
    # (the settings check_runs checked, and the budgets and interval, valid by construction)
    run_cfg = _with(cfg, **phase_settings(cfg, options, "accuracy", method, n),
                    training__eval_interval=interval,
                    training__max_steps=min(caps.values()) if caps else 0,
                    training__checkpoint_interval=0)
    # a method that diverges at this size is a result, not the end of the benchmark
    trainer, result = _run_trainer(run_cfg, group, run_dir, target=options.target_accuracy,
                                   max_seconds=options.max_seconds, compute=compute,
                                   diverged_ends_it=True)
    points = trainer.points
    if points and "diverged" not in result:
        points[-1]["final"] = True      # after the strategy's finalize (e.g. a last average)
    crossing = first_crossing(points, options.target_accuracy)
    stopped = "divergence" if "diverged" in result else \
        trainer.stop_reason or budget_reason(int(result["steps"]), caps)
    return {"method": method, "ranks": n, "target_accuracy": options.target_accuracy,
            "initial_learning_rate": run_cfg.optimizer.initial_learning_rate,
            "reached": crossing is not None, "stopped_by": stopped,
            "frames_to_target": crossing["frames"] if crossing else None,
            "seconds_to_target": crossing["seconds"] if crossing else None,
            "interpolated": crossing["interpolated"] if crossing else None,
            "eval_interval_frames_per_rank": interval, "steps": int(result["steps"]),
            "frames": int(result["frames"]),
            "training_seconds": points[-1]["seconds"] if points else None,
            "outside_seconds": trainer.outside_seconds, "final_dev_acc": result.get("dev_acc"),
            "points": points, "run_dir": run_dir}


def throughput_phase(cfg, group, *, methods, options: BenchOptions, out_dir: str,
                     compute=None) -> list:
    """Phase 1 on ``group``: every method ``options.repeats`` times, the order
    rotating each round so load from other processes hits all alike; per method
    the run of median frames/s among those that did not diverge (complete on
    group rank 0), or, when every run diverged, the first, with ``diverged``.

    Example::

        rows = throughput_phase(cfg, group, methods=("allreduce", "bmuf"),
                                options=BenchOptions(repeats=3), out_dir="runs/b")
    """
    runs = {m: [] for m in methods}
    for rep in range(options.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            name = f"throughput-{method}-n{group.size}" + (
                f"-r{rep + 1}" if options.repeats > 1 else "")
            runs[method].append(measure_throughput(
                cfg, group, method=method, options=options, compute=compute, repeat=rep,
                run_dir=os.path.join(out_dir, "runs", name)))
    rows = []
    for method in methods:
        done = runs[method]
        if group.rank != 0:
            rows.append(done[0])
            continue
        ranked = sorted((r for r in done if "diverged" not in r),
                        key=lambda r: r["frames_per_sec"])
        row = dict(ranked[(len(ranked) - 1) // 2] if ranked else done[0])
        row["repeat_frames_per_sec"] = [r["frames_per_sec"] for r in done]
        if ranked and len(ranked) < len(done):
            row["diverged_repeats"] = len(done) - len(ranked)
        rows.append(row)
    return rows


def sync_period(cfg, group, method: str) -> int:
    """Steps between the method's synchronisations under ``cfg`` (1: every step)."""
    # only its period is needed here (every rank of the group builds it)
    run_cfg = _with(cfg, **group_settings(cfg, method, group.size))
    strategy = build_strategy(run_cfg, group, total_steps=1)
    try:
        return int(strategy.sync_period)
    finally:
        strategy.close()


def steps_per_epoch_one_rank(cfg) -> int:
    """Steps of one epoch of the training corpus on one rank."""
    from ..data.corpus import load_manifest
    return max(1, load_manifest(cfg.data.train).num_frames // cfg.training.minibatch)
