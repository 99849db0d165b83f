"""Training as N virtual ranks in one process, on a simulated clock.

Every virtual rank (a thread of :class:`~mpitrain.comm.virtual.VirtualCluster`)
builds its own trainer — network, optimizer, strategy, data reader — exactly
as a rank under ``mpiexec`` does, and runs the same loop; the ranks meet only
in the communicator.  Rank 0 logs and writes the run directory as usual.

The clock: each training step a rank takes (a step where the strategy has it
train) advances that rank's clock by the step time of :class:`ComputeModel`:

    t_step(rank, k) = step_seconds * slowdown[rank] * exp(jitter * z - jitter^2 / 2)

with z ~ N(0, 1) drawn from a generator seeded by (seed, rank), so the
jitter has mean 1 and the same seed gives the same times (a benchmark's
repeat k > 0 of a run: seeded by (seed, rank, k), a draw of its own).  ``step_seconds``
is given (``--compute-ms``, e.g. a GPU's step) or measured once on this
machine for the model (:func:`measure_step_seconds`).  Communication time
comes from the network model at each collective
(:mod:`mpitrain.comm.virtual`).  The trainer's progress lines and metrics
then show simulated frames/s, communication share and seconds.

Only one virtual rank computes at a time, with one BLAS thread unless
``blas_threads`` says otherwise.

Memory: each virtual rank holds its network, optimizer state and data
reader, i.e. N models and about the whole corpus's share of chunks (one
chunk, plus one being read ahead, per rank).

Example::

    result = train_virtual(cfg, size=16, run_dir="runs/v16",
                           network=NetworkModel(), compute=ComputeModel(step_seconds=0.002))
    result["dev_acc"], result["seconds"]          # seconds: simulated
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from ..comm.virtual import VirtualCluster
from .metrics import MetricsLog
from .trainer import Trainer


#: The largest --jitter: the sigma of the log of a step time's factor.
MAX_JITTER = 10.0
#: The largest --slowdown factor: a rank a million times slower is past any straggler.
MAX_SLOWDOWN = 1e6
#: The most virtual ranks: each is a thread of this process holding its own model.
MAX_VIRTUAL_RANKS = 4096


@dataclass(frozen=True)
class ComputeModel:
    """Seconds of computing per training step, per rank.

    ``slowdown``: rank -> factor (a rank not named runs at 1); ``jitter``:
    the standard deviation of the log of a step's time factor (0: none).

    Example::

        model = ComputeModel(step_seconds=0.002, slowdown={3: 2.0}, jitter=0.1, seed=1)
        clock = model.step_times(3)
        next(clock)      # about 0.004
    """

    step_seconds: float
    slowdown: dict = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (self.step_seconds >= 0 and math.isfinite(self.step_seconds)):
            raise ValueError(f"compute: step time must be a finite number >= 0 seconds, "
                             f"got {self.step_seconds!r}")
        for rank, factor in self.slowdown.items():
            if int(rank) != rank or rank < 0:
                raise ValueError(f"slowdown: expected a rank >= 0, got {rank}={factor:g}")
            # (a factor of 1e308 ran, and its simulated times came out 300 digits long)
            if not 0 < factor <= MAX_SLOWDOWN:
                raise ValueError(f"slowdown: expected a factor in (0, {MAX_SLOWDOWN:g}] for "
                                 f"rank {rank}, got {rank}={factor:g}")
        # exp(jitter z - jitter^2 / 2) overflows past about 37 (an OverflowError
        # traceback mid-run); a spread of e^10 is already far beyond any machine's
        if not 0 <= self.jitter <= MAX_JITTER:
            raise ValueError(f"jitter: expected a number in [0, {MAX_JITTER:g}], "
                             f"got {self.jitter:g}")

    def step_times(self, rank: int, repeat: int = 0):
        """An endless iterator of this rank's step times, in seconds.  ``repeat``:
        a benchmark's repeat of a run, each its own jitter draw (from the seed,
        the rank and the repeat; repeat 0 is the draw of a single run)."""
        base = self.step_seconds * float(self.slowdown.get(rank, 1.0))
        if not self.jitter:
            while True:
                yield base
        rng = np.random.default_rng([int(self.seed), int(rank)] +
                                    ([int(repeat)] if repeat else []))
        shift = self.jitter ** 2 / 2      # keeps the mean factor at 1
        while True:
            yield base * math.exp(self.jitter * rng.standard_normal() - shift)

    def describe(self) -> str:
        text = f"{self.step_seconds * 1e3:.3g} ms per step"
        if self.slowdown:
            text += "; slower ranks " + ", ".join(f"{r}: x{f:g}"
                                                  for r, f in sorted(self.slowdown.items()))
        if self.jitter:
            text += f"; log-normal jitter {self.jitter:g} (seed {self.seed})"
        return text

    def to_dict(self) -> dict:
        return {"step_seconds": self.step_seconds,
                "slowdown": {str(r): f for r, f in sorted(self.slowdown.items())},
                "jitter": self.jitter, "seed": self.seed}


class ClockedStream:
    """The trainer's minibatch stream, charging a step's compute time per minibatch.

    A rank takes a minibatch exactly when it trains a step, so the charge
    lands before the step's collectives, as the computing would.

    Example::

        trainer.stream = ClockedStream(trainer.stream, comm, model.step_times(comm.rank))
    """

    def __init__(self, stream, comm, step_times):
        self._stream, self._comm, self._times = stream, comm, step_times

    def next_batch(self):
        self._comm.advance(next(self._times))
        return self._stream.next_batch()

    def __getattr__(self, name):
        # epoch, state_dict, load_state_dict, close: the stream's own
        return getattr(self._stream, name)


def measure_step_seconds(cfg, *, feat_dim: int, num_classes: int, steps: int = 20,
                         warmup: int = 5) -> float:
    """Seconds of one training step of ``cfg``'s model on this machine (one rank,
    no communication; the median of three timed runs of ``steps`` steps).

    Example::

        measure_step_seconds(cfg, feat_dim=40, num_classes=120)    # e.g. 0.0021
    """
    from .. import backend
    from ..comm.single import SingleCommunicator
    from ..data.batcher import Chunk, ChunkSpec
    from ..nn.network import build_network
    from ..optim.factory import build_optimizer
    from ..parallel.base import Strategy
    from .step import TrainingStep

    xp = backend.select(cfg.device, 0)
    batch = cfg.training.minibatch
    net = build_network(
        feat_dim=feat_dim, num_classes=num_classes, left_context=cfg.data.left_context,
        right_context=cfg.data.right_context, hidden_layers=cfg.model.hidden_layers,
        hidden_dim=cfg.model.hidden_dim, nonlinearity=cfg.model.nonlinearity,
        pnorm_output_dim=cfg.model.pnorm_output_dim, pnorm_p=cfg.model.pnorm_p,
        normalize=cfg.model.normalize, xp=xp)
    net.init_params(seed=cfg.training.seed)
    optimizer = build_optimizer(cfg.optimizer, net, minibatch=cfg.training.minibatch)
    rng = np.random.default_rng(0)
    frames = 8 * batch
    chunk = Chunk(ChunkSpec(0, 0, 1, frames),
                  *(backend.to_device(a, xp) for a in (
                      rng.standard_normal((frames, feat_dim), dtype=np.float32),
                      rng.integers(0, num_classes, frames).astype(np.int32),
                      np.zeros(frames, dtype=np.int64), np.full(frames, frames, np.int64))))
    order = backend.to_device(rng.permutation(frames), xp)
    step = TrainingStep(net, optimizer, Strategy(SingleCommunicator()), minibatch=batch,
                        left_context=cfg.data.left_context,
                        right_context=cfg.data.right_context)
    lr = cfg.optimizer.initial_learning_rate
    count = [0]

    def next_batch():
        k = count[0] % 8
        count[0] += 1
        return chunk, order[k * batch:(k + 1) * batch]

    for n in range(warmup):
        step.run(n, lr, next_batch)
    timings = []
    for _ in range(3):
        backend.synchronize(xp)
        start = time.perf_counter()
        for n in range(steps):
            step.run(n, lr, next_batch)
        step.take_sums()                 # waits for the device
        timings.append((time.perf_counter() - start) / steps)
    return sorted(timings)[1]


def compute_model(cfg, *, step_ms: float = 0.0, slowdown: Optional[dict] = None,
                  jitter: float = 0.0, seed: int = 0, measure_later: bool = False):
    """The step times of a virtual run: ``step_ms`` when > 0, else measured once here
    for ``cfg``'s model (:func:`measure_step_seconds`) with the BLAS threads the
    virtual ranks run with (``cfg.blas_threads``, else one).

    With ``measure_later`` a step time still to be measured is not measured now:
    a function that measures it and returns the model comes back instead (the
    options are checked now), for :func:`train_virtual` to call once the ranks
    have checked the settings, or for a caller to call after its own checks.

    Example::

        compute_model(cfg, step_ms=2.0, slowdown={0: 1.5})     # a GPU-class step
    """
    if not 0 <= step_ms < math.inf:
        # (a negative time was taken for 0: measured, without a word)
        raise ValueError(f"--compute-ms: expected a step time in ms >= 0 (0: measured "
                         f"here), got {step_ms!r}")
    try:
        model = ComputeModel(step_seconds=step_ms * 1e-3, slowdown=dict(slowdown or {}),
                             jitter=jitter, seed=seed)
    except ValueError as exc:       # (named by the options that set them)
        raise ValueError(f"--{exc}") from None
    if model.step_seconds > 0:
        return model

    def measured() -> ComputeModel:
        from threadpoolctl import threadpool_limits
        from ..data.corpus import load_manifest
        manifest = load_manifest(cfg.data.train)
        # with the BLAS threads the virtual ranks then run with
        with threadpool_limits(cfg.blas_threads or 1):
            seconds = measure_step_seconds(cfg, feat_dim=manifest.feat_dim,
                                           num_classes=manifest.num_classes)
        return replace(model, step_seconds=seconds)
    return measured if measure_later else measured()


def _resolved(compute):
    """``compute`` as a :class:`ComputeModel` and a function that gives it, measuring
    a deferred one (from ``compute_model(..., measure_later=True)``) at its first call
    only, and the wall seconds that took."""
    done: list = []

    def get() -> ComputeModel:
        if not done:
            started = time.perf_counter()
            done.append(compute if isinstance(compute, ComputeModel) else compute())
            done.append(time.perf_counter() - started)
        return done[0]
    return get, lambda: done[1] if done else 0.0


def run_virtual_trainers(cfg, *, size: int, run_dir: str, compute, network=None,
                         trainer_class=Trainer, stream=None, **trainer_kwargs) -> list:
    """Build and run one trainer per virtual rank; every rank's (trainer, result).

    Each rank's minibatches charge ``compute``'s step times to its clock.
    ``compute``: a :class:`ComputeModel`, or a function that returns one (a step
    time still to be measured), called once rank 0's trainer is built: the
    settings these ranks cannot run are said before minutes of measuring.
    Runs with one BLAS thread unless ``cfg.blas_threads`` says otherwise: with
    many calling threads a multi-threaded OpenBLAS ran a 32-rank run 20x
    slower on 2 cores.

    Example::

        pairs = run_virtual_trainers(cfg, size=4, run_dir="runs/v4",
                                     compute=ComputeModel(step_seconds=0.002))
        pairs[0][1]["dev_acc"]
    """
    from threadpoolctl import threadpool_limits
    cluster = VirtualCluster(size, network=network)
    model = compute if isinstance(compute, ComputeModel) else _resolved(compute)[0]

    def rank_main(comm):
        trainer = trainer_class(cfg, run_dir=run_dir, comm=comm,
                                stream=stream if comm.rank == 0 else None, **trainer_kwargs)
        try:
            step_model = model if isinstance(model, ComputeModel) else model()
            trainer.stream = ClockedStream(trainer.stream, comm,
                                           step_model.step_times(comm.rank))
            result = trainer.run()
        finally:
            trainer.close()
        return trainer, result

    with threadpool_limits(cfg.blas_threads or 1):
        return cluster.run(rank_main)


def plan_virtual(cfg, *, size: int, run_dir: str, **trainer_kwargs) -> list:
    """What a run on ``size`` virtual ranks would say before its first step
    (``train --virtual N --dry-run``): every rank's trainer is built, and so
    checked, then closed; nothing is trained or written.

    Example::

        print("\n".join(plan_virtual(cfg, size=32, run_dir="runs/v32")))
    """
    cluster = VirtualCluster(size)

    def rank_main(comm):
        trainer = Trainer(cfg, run_dir=run_dir, comm=comm, **trainer_kwargs)
        try:
            return trainer.dry_run_lines()
        finally:
            trainer.close()
    return cluster.run(rank_main)[0]


def train_virtual(cfg, *, size: int, run_dir: str, compute, network=None,
                  stream=None, **trainer_kwargs) -> dict:
    """Train ``cfg`` as ``size`` virtual ranks; rank 0's result (``seconds``: simulated).

    Rank 0 adds a "virtual" record to ``metrics.jsonl``: the ranks, the
    network and compute models, simulated and wall seconds.  ``network``
    prices communication (None: free).  ``compute``: as for
    :func:`run_virtual_trainers` (a step time to measure is measured once the
    ranks' trainers are built, and left out of the wall seconds).

    Example::

        train_virtual(cfg, size=4, run_dir="runs/v4", network=NetworkModel(),
                      compute=ComputeModel(step_seconds=0.002))["dev_acc"]
    """
    started = time.perf_counter()
    model, measuring = _resolved(compute)
    trainer, result = run_virtual_trainers(cfg, size=size, run_dir=run_dir, compute=model,
                                           network=network, stream=stream,
                                           **trainer_kwargs)[0]
    wall = time.perf_counter() - started - measuring()
    compute = model()
    network_text = "free communication" if network is None else network.describe()
    record = {"ranks": size, "compute": compute.to_dict(),
              "network": None if network is None else network.to_dict(),
              "simulated_seconds": result["seconds"], "wall_seconds": wall}
    # the run's own log is closed: this one continues its clock
    log = MetricsLog(run_dir, stream=stream, append=True, start=trainer.log.start)
    try:
        log.write("virtual", **record)
        log.say(f"virtual cluster: {size} ranks in {wall:.1f} s of wall time; simulated "
                f"{result['seconds']:.2f} s with compute {compute.describe()} and "
                f"{network_text}")
    finally:
        log.close()
    return dict(result, wall_seconds=wall)
