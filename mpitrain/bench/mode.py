"""Benchmark mode (``python -m mpitrain bench``): speedup curves per parallel method.

For each group size N in turn the world is split into one group of N ranks
(the others wait, sleeping, and all rejoin before the next size).  The group
runs the trainer itself, once per method from the strategy registry
(:data:`mpitrain.parallel.registry.METHODS`), in two phases:

1. throughput: a fixed number of steps without held-out evaluation; frames/s
   in total and per rank, and the share of each step spent inside the
   communicator (waiting for a slower rank included) versus computing.  The
   trainer's own progress windows are used; the first (warm-up) is dropped.
2. time to accuracy: training (the config's schedule and epochs) until the
   held-out frame accuracy reaches the target or a budget runs out.  Frames and
   training seconds (evaluations and checkpoints excluded) at the target are
   interpolated linearly between the two evaluations around the first
   crossing.  Evaluations are placed at sync points of the method, so they see
   the model all ranks agree on.

Then rank 0 projects speedups beyond the machine with the network model of
:mod:`mpitrain.bench.projection` and writes ``bench.json``, ``bench.md``,
``bench-speedup.png`` and ``bench-accuracy.png``.

Example::

    report = run_bench(cfg, comm, out_dir="runs/bench",
                       options=BenchOptions(sizes=(1, 2), target_accuracy=0.3))
    if comm.rank == 0:
        write_report(report, "runs/bench")
"""

from __future__ import annotations

import glob
import json
import math
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..config import config_from_dict
from ..parallel.registry import METHODS, build_strategy
from ..train.trainer import Trainer
from .projection import NetworkModel, assumptions, fit_frames_exponent, project_speedups

#: Where the papers' numbers come from (plotted and tabulated next to ours).
PAPER_POINTS = ({"source": "Su & Chen 2015 (SWB-300h, model averaging)", "ranks": 16,
                 "speedup": 9.3},
                {"source": "Su & Chen 2015 (SWB-300h, model averaging)", "ranks": 32,
                 "speedup": 17.0})
DEFAULT_PROJECT_TO = (16, 32, 64, 128)
#: Evaluations per epoch (of the one-rank run) when neither option nor config says.
DEFAULT_EVALS_PER_EPOCH = 20
IDLE_POLL_SECONDS = 0.01
_RELEASE_TAG = 7101
_PHASES = ("throughput", "accuracy")


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

    Example::

        BenchOptions(sizes=(1, 2, 4), methods=("model_averaging", "bmuf"),
                     target_accuracy=0.5, max_seconds=120)
    """

    sizes: tuple = ()
    methods: tuple = ()
    target_accuracy: Optional[float] = None
    phases: tuple = _PHASES
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

    def __post_init__(self):
        if any(int(n) != n or n < 1 for n in self.sizes):
            raise ValueError(f"--sizes: expected positive integers, got {list(self.sizes)}")
        if self.sizes and 1 not in self.sizes:
            raise ValueError(f"--sizes: must include 1 (speedups are relative to one rank), "
                             f"got {list(self.sizes)}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(unknown)}; expected some of "
                             f"{', '.join(METHODS)}")
        bad_phases = [p for p in self.phases if p not in _PHASES]
        if bad_phases or not self.phases:
            raise ValueError(f"--phases: expected some of {', '.join(_PHASES)}, "
                             f"got {list(self.phases)}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy < 1:
            raise ValueError(f"--target-accuracy: expected a frame accuracy in (0, 1), "
                             f"got {self.target_accuracy}")
        for name in ("throughput_steps", "warmup_steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        for name in ("eval_frames", "max_steps", "max_frames", "max_seconds",
                     "compute_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a number >= 0, got {getattr(self, name)}")
        if any(int(n) != n or n < 2 for n in self.project_to):
            raise ValueError(f"--project-to: expected integers >= 2, got {list(self.project_to)}")

    def resolve(self, world_size: int) -> tuple:
        """(sizes, methods) for a world of ``world_size`` ranks."""
        sizes = tuple(sorted(set(self.sizes))) if self.sizes else default_sizes(world_size)
        if sizes[-1] > world_size:
            raise ValueError(f"--sizes: {sizes[-1]} ranks asked for, but the job has "
                             f"{world_size}; launch with mpiexec -n {sizes[-1]} or more")
        return sizes, tuple(self.methods) or tuple(METHODS)

    @property
    def measures_accuracy(self) -> bool:
        return "accuracy" in self.phases and self.target_accuracy is not None


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


# -- runs on one group -----------------------------------------------------------------

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


class BenchTrainer(Trainer):
    """The trainer, timing what is not training and stopping at the target.

    Training seconds exclude held-out evaluations and checkpoints; each
    evaluation is recorded as a point (step, frames, seconds, accuracy).

    Example::

        trainer = BenchTrainer(cfg, run_dir="runs/b", comm=group, target=0.6)
        trainer.run()
        trainer.points[-1]["dev_acc"]
    """

    def __init__(self, cfg, *, target: Optional[float] = None, max_seconds: float = 0.0,
                 **kwargs):
        super().__init__(cfg, **kwargs)
        self.target, self.max_seconds = target, max_seconds
        self.points, self.stop_reason = [], None
        self.outside_seconds, self._t0 = 0.0, None

    def training_seconds(self) -> float:
        return time.perf_counter() - self._t0 - self.outside_seconds

    def run(self) -> dict:
        self._t0 = time.perf_counter()
        return super().run()

    def evaluate(self) -> dict:
        self.comm.barrier()       # the slowest rank's training time counts
        start = time.perf_counter()
        seconds = start - self._t0 - self.outside_seconds
        result = super().evaluate()
        self.outside_seconds += time.perf_counter() - start
        if result:
            self.points.append({"step": self.step, "frames": self.frames_seen,
                                "seconds": seconds, "dev_acc": float(result["dev_acc"]),
                                "dev_xent": float(result["dev_xent"])})
        return result

    def save_checkpoint(self) -> None:
        start = time.perf_counter()
        super().save_checkpoint()
        self.outside_seconds += time.perf_counter() - start

    def on_eval(self, result: dict) -> bool:
        reached = self.target is not None and result.get("dev_acc", 0.0) >= self.target
        late = bool(self.max_seconds) and self.training_seconds() >= self.max_seconds
        # clocks differ between ranks: agree, or some ranks would train on alone
        flags = self.comm.allreduce_scalar(int(reached) * 2 + int(late), op="max")
        if flags:
            self.stop_reason = "target" if flags >= 2 else "max_seconds"
        return bool(flags)


def _run_trainer(cfg, group, run_dir: str, **kwargs):
    """Build, run and close one trainer; rank 0 of the group logs into ``run_dir``."""
    log = None
    if group.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        log = open(os.path.join(run_dir, "train.log"), "w", encoding="utf-8")
    try:
        trainer = BenchTrainer(cfg, run_dir=run_dir, comm=group, stream=log, **kwargs)
        try:
            result = trainer.run()
        finally:
            trainer.close()
    finally:
        if log is not None:
            log.close()
    if group.rank == 0:
        # keep the metrics and log; models and checkpoints of a benchmark are not needed
        for path in glob.glob(os.path.join(run_dir, "ckpt-*.h5")) + \
                [os.path.join(run_dir, "final.h5")]:
            if os.path.exists(path):
                os.remove(path)
    return trainer, result


def _records(run_dir: str, kind: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r.get("type") == kind]


def throughput_from_records(records: Sequence[dict], *, ranks: int) -> dict:
    """Frames/s and compute/communication split from the trainer's progress records,
    dropping the first window (warm-up).

    Each record covers the steps since the previous one: its frames are the
    difference of the cumulative ``frames``, its seconds those frames over its
    ``frames_per_sec``, its communication seconds ``comm_fraction`` of that.

    Example::

        throughput_from_records(_records(run_dir, "train"), ranks=2)["frames_per_sec"]
    """
    if len(records) < 2:
        raise ValueError("throughput: need at least two progress records (warm-up and one "
                         f"measured window), got {len(records)}")
    frames = seconds = comm = steps = 0.0
    for prev, rec in zip(records, records[1:]):
        window = rec["frames"] - prev["frames"]
        elapsed = window / rec["frames_per_sec"]
        frames += window
        seconds += elapsed
        comm += rec["comm_fraction"] * elapsed
        steps += rec["step"] - prev["step"]
    comm_fraction = comm / seconds
    step_s = seconds / steps
    return {"frames_per_sec": frames / seconds, "frames_per_sec_per_rank": frames / seconds / ranks,
            "measured_steps": int(steps), "measured_seconds": seconds,
            "step_seconds": step_s, "comm_fraction": comm_fraction,
            "compute_seconds_per_step": step_s * (1 - comm_fraction),
            "comm_seconds_per_step": step_s * comm_fraction}


def measure_throughput(cfg, group, *, method: str, run_dir: str, options: BenchOptions) -> dict:
    """Phase 1 for one method on ``group``; the dict is complete on group rank 0.

    Example::

        row = measure_throughput(cfg, group, method="bmuf", run_dir="runs/b/t-bmuf-n2",
                                 options=BenchOptions())
    """
    steps = options.warmup_steps + options.throughput_steps
    run_cfg = _with(cfg, parallel__method=method, data__dev="", training__max_steps=steps,
                    training__epochs=1000.0, training__log_interval=options.warmup_steps,
                    training__checkpoint_interval=0)
    trainer, _ = _run_trainer(run_cfg, group, run_dir)
    row = {"method": method, "ranks": group.size, "minibatch": run_cfg.training.minibatch,
           "num_params": int(trainer.net.num_params),
           "sync_period": int(trainer.strategy.sync_period), "run_dir": run_dir}
    if group.rank == 0:
        row.update(throughput_from_records(_records(run_dir, "train"), ranks=group.size))
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


def time_to_accuracy(cfg, group, *, method: str, run_dir: str, options: BenchOptions,
                     sync_period: int, steps_per_epoch_1: int) -> dict:
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
    caps = [c for c in (cfg.training.max_steps, options.max_steps,
                        math.ceil(options.max_frames / (batch * n)) if options.max_frames else 0)
            if c]
    run_cfg = _with(cfg, parallel__method=method, training__eval_interval=interval,
                    training__max_steps=min(caps) if caps else 0,
                    training__checkpoint_interval=0)
    trainer, result = _run_trainer(run_cfg, group, run_dir, target=options.target_accuracy,
                                   max_seconds=options.max_seconds)
    points = trainer.points
    if points:
        points[-1]["final"] = True      # after the strategy's finalize (e.g. a last average)
    crossing = first_crossing(points, options.target_accuracy)
    stopped = trainer.stop_reason or "budget (epochs/max steps)"
    return {"method": method, "ranks": n, "target_accuracy": options.target_accuracy,
            "reached": crossing is not None, "stopped_by": stopped,
            "frames_to_target": crossing["frames"] if crossing else None,
            "seconds_to_target": crossing["seconds"] if crossing else None,
            "interpolated": crossing["interpolated"] if crossing else None,
            "eval_interval_frames_per_rank": interval, "steps": int(result["steps"]),
            "frames": int(result["frames"]),
            "training_seconds": points[-1]["seconds"] if points else None,
            "outside_seconds": trainer.outside_seconds, "final_dev_acc": result.get("dev_acc"),
            "points": points, "run_dir": run_dir}


# -- idle ranks ------------------------------------------------------------------------------

def _release_idle(world, size: int) -> None:
    token = np.zeros(1, dtype=np.int32)
    for rank in range(size, world.size):
        world.send(token, rank, tag=_RELEASE_TAG)


def _wait_released(world) -> None:
    # a sleeping poll instead of a barrier: MPI barriers spin and would take a core
    token = np.zeros(1, dtype=np.int32)
    request = world.irecv(token, source=0, tag=_RELEASE_TAG)
    while not request.test():
        time.sleep(IDLE_POLL_SECONDS)


# -- the whole benchmark -----------------------------------------------------------------------

def _say(world, stream, text: str) -> None:
    if world.rank == 0:
        print(text, file=stream or sys.stdout, flush=True)


def run_bench(cfg, world, *, out_dir: str, options: BenchOptions, stream=None) -> Optional[dict]:
    """Run every size and method; collective over ``world``.  The report on rank 0,
    None on the other ranks.

    Example::

        report = run_bench(load_config("jobs/configs/bench.yaml"), comm, out_dir="runs/bench",
                           options=BenchOptions(target_accuracy=0.5))
    """
    sizes, methods = options.resolve(world.size)
    env = environment(world, cfg)
    if options.measures_accuracy and not cfg.data.dev:
        raise ValueError("data.dev: the time-to-accuracy phase needs a held-out corpus "
                         "(set data.dev, or run with --phases throughput)")
    if "accuracy" in options.phases and options.target_accuracy is None:
        _say(world, stream, "no --target-accuracy given: skipping the time-to-accuracy phase")
    _say(world, stream, f"bench: sizes {', '.join(map(str, sizes))}; methods "
                        f"{', '.join(methods)}; {world.size} ranks on "
                        f"{', '.join(env['hosts'])} ({env['cpu_count']} cores per host"
                        f"{', oversubscribed' if env['oversubscribed'] else ''})")
    throughput, accuracy = [], []
    steps_per_epoch_1 = None
    started = time.perf_counter()
    for size in sizes:
        group = world.split(0 if world.rank < size else None, key=world.rank)
        if group is None:
            _wait_released(world)
        else:
            try:
                sync = {}
                if "throughput" in options.phases:
                    rows = _throughput_phase(cfg, group, methods=methods, options=options,
                                             out_dir=out_dir)
                    sync = {row["method"]: row["sync_period"] for row in rows}
                    if world.rank == 0:
                        throughput += rows
                        for row in rows:
                            _say(world, stream, _throughput_line(row))
                if options.measures_accuracy:
                    if steps_per_epoch_1 is None:
                        steps_per_epoch_1 = _steps_per_epoch_one_rank(cfg)
                    for method in methods:
                        if method not in sync:
                            sync[method] = _sync_period(cfg, group, method)
                        row = time_to_accuracy(
                            cfg, group, method=method, options=options,
                            sync_period=sync[method], steps_per_epoch_1=steps_per_epoch_1,
                            run_dir=os.path.join(out_dir, "runs", f"accuracy-{method}-n{size}"))
                        if world.rank == 0:
                            accuracy.append(row)
                            _say(world, stream, _accuracy_line(row))
            finally:
                group.free()
            if world.rank == 0:
                _release_idle(world, size)
        world.barrier()
    if world.rank != 0:
        return None
    report = build_report(throughput, accuracy, sizes=sizes, methods=methods, options=options,
                          environment=env, config=cfg.to_dict())
    report["wall_seconds"] = time.perf_counter() - started
    report["environment"]["load_average_at_end"] = _load_average()
    return report


def _throughput_phase(cfg, group, *, methods, options: BenchOptions, out_dir: str) -> list:
    """Every method ``options.repeats`` times, the order rotating each round so load
    from other processes hits all alike; per method the run of median frames/s."""
    runs = {m: [] for m in methods}
    for rep in range(options.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            name = f"throughput-{method}-n{group.size}" + (
                f"-r{rep + 1}" if options.repeats > 1 else "")
            runs[method].append(measure_throughput(
                cfg, group, method=method, options=options,
                run_dir=os.path.join(out_dir, "runs", name)))
    rows = []
    for method in methods:
        done = runs[method]
        if group.rank != 0:
            rows.append(done[0])
            continue
        ranked = sorted(done, key=lambda r: r["frames_per_sec"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["repeat_frames_per_sec"] = [r["frames_per_sec"] for r in done]
        rows.append(row)
    return rows


def _sync_period(cfg, group, method: str) -> int:
    # building a strategy communicates nothing; only its period is needed here
    return int(build_strategy(_with(cfg, parallel__method=method), group,
                              total_steps=1).sync_period)


def _steps_per_epoch_one_rank(cfg) -> int:
    from ..data.corpus import load_manifest
    return max(1, load_manifest(cfg.data.train).num_frames // cfg.training.minibatch)


def _throughput_line(row: dict) -> str:
    return (f"  n={row['ranks']} {row['method']:<16} throughput {row['frames_per_sec']:>10,.0f} "
            f"fr/s ({row['frames_per_sec_per_rank']:,.0f} per rank), step "
            f"{row['step_seconds'] * 1e3:.1f} ms, comm {row['comm_fraction']:.1%}")


def _accuracy_line(row: dict) -> str:
    if not row["reached"]:
        return (f"  n={row['ranks']} {row['method']:<16} target {row['target_accuracy']} not "
                f"reached (stopped by {row['stopped_by']}; final acc {row['final_dev_acc']})")
    return (f"  n={row['ranks']} {row['method']:<16} target {row['target_accuracy']} after "
            f"{row['frames_to_target']:,.0f} frames, {row['seconds_to_target']:.1f} s")


# -- report ------------------------------------------------------------------------------------

def _versions(cfg) -> dict:
    import h5py
    from .. import __version__
    versions = {"mpitrain": __version__, "python": sys.version.split()[0],
                "numpy": np.__version__, "h5py": h5py.__version__}
    try:
        import matplotlib
        versions["matplotlib"] = matplotlib.__version__
    except ImportError:
        versions["matplotlib"] = None
    if cfg.device == "gpu":
        from .. import backend
        versions["cupy"] = backend.select("gpu").__version__
    return versions


def _blas_info() -> list:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"note": "threadpoolctl not installed"}]
    keep = ("user_api", "internal_api", "version", "num_threads", "threading_layer",
            "architecture")
    # no file paths: they name this machine's directories
    return [{k: pool.get(k) for k in keep if k in pool} for pool in threadpool_info()]


def environment(world, cfg) -> dict:
    """Ranks, hosts, cores, BLAS, GPU, MPI library and versions; collective.

    Example::

        environment(comm, cfg)["mpi"]["library_version"]
    """
    from ..comm.info import mpi_info
    host = socket.gethostname()
    gpu = "not used (device: cpu)"
    if cfg.device == "gpu":
        from .. import backend
        gpu = backend.device_name(backend.select("gpu", world.local_rank))
    per_rank = world.allgather_obj({"host": host, "gpu": gpu})
    hosts = sorted({r["host"] for r in per_rank})
    ranks_per_host = {h: sum(r["host"] == h for r in per_rank) for h in hosts}
    cores = os.cpu_count() or 1
    return {"ranks": world.size, "hosts": hosts, "ranks_per_host": ranks_per_host,
            "cpu_count": cores, "oversubscribed": max(ranks_per_host.values()) > cores,
            "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "device": cfg.device,
            "gpus": sorted({r["gpu"] for r in per_rank}), "blas": _blas_info(),
            "blas_threads_env": {k: os.environ.get(k) for k in
                                 ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
            "mpi": mpi_info(world), "versions": _versions(cfg),
            "load_average_at_start": _load_average(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _load_average() -> Optional[list]:
    # other work on a shared machine shows here, and in every timing
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _by(rows, method, ranks):
    for row in rows:
        if row["method"] == method and row["ranks"] == ranks:
            return row
    return None


def build_report(throughput: list, accuracy: list, *, sizes, methods, options: BenchOptions,
                 environment: dict, config: dict) -> dict:
    """Measured speedups, statistical efficiency and projections, per method.

    Example::

        report = build_report(thr_rows, acc_rows, sizes=(1, 2), methods=("bmuf",),
                              options=BenchOptions(), environment={}, config={})
    """
    speedups, projections = [], {}
    network = options.network
    for method in methods:
        base_t, base_a = _by(throughput, method, 1), _by(accuracy, method, 1)
        frames = {}
        for n in sizes:
            thr, acc = _by(throughput, method, n), _by(accuracy, method, n)
            row = {"method": method, "ranks": n, "throughput_speedup": None,
                   "time_to_target_speedup": None, "statistical_efficiency": None}
            if thr and base_t:
                row["throughput_speedup"] = thr["frames_per_sec"] / base_t["frames_per_sec"]
            if acc and base_a and acc["reached"] and base_a["reached"]:
                row["time_to_target_speedup"] = (base_a["seconds_to_target"]
                                                 / acc["seconds_to_target"])
                row["statistical_efficiency"] = (base_a["frames_to_target"]
                                                 / acc["frames_to_target"])
            if acc and acc["reached"]:
                frames[n] = acc["frames_to_target"]
            speedups.append(row)
        if base_t is None:
            continue
        compute = options.compute_seconds or base_t["compute_seconds_per_step"]
        exponent = fit_frames_exponent(frames)
        project_sizes = sorted(set(sizes) | set(options.project_to))
        projections[method] = {
            "compute_seconds_per_step": compute,
            "compute_seconds_source": "option" if options.compute_seconds
            else "measured on one rank",
            "bytes_per_allreduce": 4 * base_t["num_params"],
            "sync_every_steps": base_t["sync_period"], "frames_exponent": exponent,
            "rows": project_speedups(project_sizes, compute_seconds=compute,
                                     nbytes=4 * base_t["num_params"],
                                     sync_every=base_t["sync_period"], network=network,
                                     frames_exponent=exponent)}
    return {"format": "mpitrain-bench/1", "sizes": list(sizes), "methods": list(methods),
            "options": _options_dict(options), "environment": environment,
            "network_model": network.to_dict(), "assumptions": assumptions(network),
            "notes": _notes(environment, options),
            "throughput": throughput, "accuracy": accuracy, "speedups": speedups,
            "projections": projections, "paper_points": list(PAPER_POINTS), "config": config}


def _options_dict(options: BenchOptions) -> dict:
    out = {k: getattr(options, k) for k in (
        "target_accuracy", "phases", "throughput_steps", "warmup_steps", "repeats",
        "eval_frames",
        "max_steps", "max_frames", "max_seconds", "project_to", "compute_seconds")}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _notes(env: dict, options: BenchOptions) -> list:
    notes = [
        "Frames/s: the trainer's progress windows after the first (warm-up); per rank = "
        "total / ranks. comm = time inside the communicator, waiting for slower ranks "
        "included; compute = the rest of the step.",
        "Time to target: training seconds (held-out evaluations and checkpoints excluded) "
        "and frames summed over ranks, interpolated linearly between the evaluation before "
        "and the first evaluation at or above the target.",
        "Idle ranks sleep while a smaller group runs; every rank keeps the BLAS threads it "
        "was started with.",
    ]
    load = env.get("load_average_at_start")
    if load and load[0] > env.get("cpu_count", 1):
        notes.append(f"Busy machine: load average {load[0]} on {env.get('cpu_count')} cores "
                     "when the benchmark started; other processes slow the runs unevenly.")
    if env.get("oversubscribed"):
        notes.append("Oversubscribed: more ranks than cores on a host; the largest sizes "
                     "share cores and their figures understate what separate cores give.")
    return notes


# -- outputs -----------------------------------------------------------------------------------

def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"bench.json: cannot store {type(obj).__name__}")


def write_report(report: dict, out_dir: str, *, dpi: int = 100) -> dict:
    """Write bench.json, bench.md and the PNG plots into ``out_dir``; their paths.

    Example::

        paths = write_report(report, "runs/bench")
        paths["speedup_png"]       # 'runs/bench/bench-speedup.png'
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"),
             "markdown": os.path.join(out_dir, "bench.md"),
             "speedup_png": os.path.join(out_dir, "bench-speedup.png"),
             "accuracy_png": os.path.join(out_dir, "bench-accuracy.png")}
    plot_speedup(report, paths["speedup_png"], dpi=dpi)
    if report["accuracy"]:
        plot_accuracy(report, paths["accuracy_png"], dpi=dpi)
    else:
        del paths["accuracy_png"]
    report = dict(report, outputs={k: os.path.basename(v) for k, v in paths.items()})
    with open(paths["json"], "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, default=_json_default, allow_nan=False)
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(summary_markdown(report))
    return paths


def _fmt(value, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def summary_markdown(report: dict) -> str:
    """The tables of bench.md: measurements, speedups, projection, assumptions.

    Example::

        print(summary_markdown(report))
    """
    env = report["environment"]
    lines = [f"# mpitrain bench: {', '.join(report['methods'])}", "",
             f"{env.get('ranks')} ranks on {', '.join(env.get('hosts', []))} "
             f"({env.get('cpu_count')} cores per host"
             f"{', oversubscribed' if env.get('oversubscribed') else ''}), device "
             f"{env.get('device')}; MPI: "
             f"{' '.join((env.get('mpi', {}).get('library_version') or 'none').splitlines()[0].split())}"
             f"; load average at start {env.get('load_average_at_start')}, at end "
             f"{env.get('load_average_at_end')}", "",
             "## Throughput and time to target", "",
             "| method | ranks | frames/s | per rank | step ms | comm | throughput speedup "
             "| frames to target | s to target | time-to-target speedup | stat. efficiency |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["speedups"]:
        thr = _by(report["throughput"], s["method"], s["ranks"]) or {}
        acc = _by(report["accuracy"], s["method"], s["ranks"]) or {}
        frames = acc.get("frames_to_target")
        secs = acc.get("seconds_to_target")
        if acc and not acc.get("reached"):
            frames_text = secs_text = f"not reached ({acc.get('stopped_by')})"
        else:
            frames_text, secs_text = _fmt(frames, ",.0f"), _fmt(secs, ".1f")
        lines.append(
            f"| {s['method']} | {s['ranks']} | {_fmt(thr.get('frames_per_sec'), ',.0f')} | "
            f"{_fmt(thr.get('frames_per_sec_per_rank'), ',.0f')} | "
            f"{_fmt(thr.get('step_seconds') and thr['step_seconds'] * 1e3, '.1f')} | "
            f"{_fmt(thr.get('comm_fraction'), '.1%')} | "
            f"{_fmt(s['throughput_speedup'], '.2f')} | {frames_text} | {secs_text} | "
            f"{_fmt(s['time_to_target_speedup'], '.2f')} | "
            f"{_fmt(s['statistical_efficiency'], '.2f')} |")
    if report["accuracy"]:
        lines += ["", f"Target held-out frame accuracy: "
                      f"{report['options']['target_accuracy']}."]
    lines += ["", "## Projection", "",
              "| method | compute ms/step | MB per allreduce | sync every | b | "
              + " | ".join(f"N={r['ranks']}" for r in next(iter(
                  report["projections"].values()), {"rows": []})["rows"]) + " |"]
    if report["projections"]:
        ncols = len(next(iter(report["projections"].values()))["rows"])
        lines.append("|---|---:|---:|---:|---:|" + "---:|" * ncols)
    for method, proj in report["projections"].items():
        cells = []
        for r in proj["rows"]:
            tt = r["time_to_target_speedup"]
            cells.append(f"{r['throughput_speedup']:.1f}"
                         + (f" / {tt:.1f}" if tt is not None else ""))
        lines.append(f"| {method} | {proj['compute_seconds_per_step'] * 1e3:.1f} | "
                     f"{proj['bytes_per_allreduce'] / 1e6:.2f} | {proj['sync_every_steps']} | "
                     f"{_fmt(proj['frames_exponent'], '.2f')} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: projected throughput speedup / time-to-target speedup.", "",
              "Papers: " + "; ".join(f"{p['source']}: {p['speedup']}x on {p['ranks']} GPUs"
                                     for p in report["paper_points"]) + ".",
              "", "## Assumptions of the projection", ""]
    lines += [f"- {a}" for a in report["assumptions"]]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedup(report: dict, path: str, *, dpi: int = 100) -> None:
    """Speedup against ranks: measured points, projected lines, the ideal line, and
    the projection's assumptions printed beside.

    Example::

        plot_speedup(report, "runs/bench/bench-speedup.png")
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    methods = report["methods"]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    all_ranks = sorted({r["ranks"] for p in report["projections"].values() for r in p["rows"]}
                       | set(report["sizes"]))
    for ax, key, title in ((axes[0], "throughput_speedup", "throughput (frames/s)"),
                           (axes[1], "time_to_target_speedup", "time to target accuracy")):
        ax.plot(all_ranks, all_ranks, color="0.6", lw=1, ls=":", label="ideal")
        for method in methods:
            proj = report["projections"].get(method)
            if proj:
                pts = [(r["ranks"], r[key]) for r in proj["rows"] if r[key] is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colors[method], ls="--", lw=1.2)
            meas = [(s["ranks"], s[key]) for s in report["speedups"]
                    if s["method"] == method and s[key] is not None]
            if meas:
                ax.plot(*zip(*meas), color=colors[method], marker="o", lw=2,
                        label=f"{method} (measured; dashed: projected)")
        if key == "time_to_target_speedup":
            ax.plot([p["ranks"] for p in report["paper_points"]],
                    [p["speedup"] for p in report["paper_points"]], "k*", ms=10,
                    label="Su & Chen 2015, 16/32 GPUs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel("speedup over one rank")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    text = "Projection model:\n" + "\n".join(
        _wrap(a, 150) for a in report["assumptions"])
    fig.text(0.01, 0.01, text, fontsize=6.5, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _wrap(text: str, width: int) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(text, width, initial_indent="- ", subsequent_indent="  "))


def _thousands():
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda x, _: f"{x / 1e6:g}M" if abs(x) >= 1e6 else
                         f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}")


def plot_accuracy(report: dict, path: str, *, dpi: int = 100) -> None:
    """Held-out accuracy against frames and against training seconds, one row per
    method, one line per group size, the target as a dashed line.

    Example::

        plot_accuracy(report, "runs/bench/bench-accuracy.png")
    """
    plt = _pyplot()
    methods = [m for m in report["methods"] if any(a["method"] == m for a in report["accuracy"])]
    fig, axes = plt.subplots(len(methods), 2, figsize=(10, 2.6 * len(methods) + 0.4),
                             squeeze=False)
    target = report["options"]["target_accuracy"]
    for row, method in zip(axes, methods):
        for i, acc in enumerate(a for a in report["accuracy"] if a["method"] == method):
            pts = acc["points"]
            for ax, key in ((row[0], "frames"), (row[1], "seconds")):
                ax.plot([p[key] for p in pts], [p["dev_acc"] for p in pts], marker=".",
                        color=f"C{i}", label=f"{acc['ranks']} rank(s)")
        row[0].xaxis.set_major_formatter(_thousands())
        for ax, label in ((row[0], "frames (all ranks)"), (row[1], "training seconds")):
            ax.axhline(target, color="0.5", ls="--", lw=1)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out frame acc.")
            ax.set_title(method, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
