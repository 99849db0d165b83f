"""Parallel training throughput on one machine: 1 rank against N ranks, per method.

Run under the launcher with one BLAS thread per rank::

    mpiexec -n 2 python -m mpitrain.bench.scaling --model quickstart --rounds 15

Contenders, each with its own copy of the same model, run in interleaved
rounds within one launch (the order rotates every round, so load from other
processes on a shared machine hits all alike):

- ``1 rank``: rank 0 trains alone while the other ranks sleep (they wait on
  a non-blocking receive polled with sleeps, so they take no core);
- ``no communication``: every rank trains alone, the same steps (the
  ``Strategy`` base class: no collective at all);
- ``model_averaging``, ``allreduce``, ``kaldi``, ``bmuf``: the trainer's
  strategies from :func:`~mpitrain.parallel.registry.build_strategy`, averaging
  every ``--every`` minibatches (Kaldi with every rank active).

A step is the per-step work of ``Trainer.run`` on the trainer's own objects
(``build_network``, ``build_optimizer``, the strategy hooks): minibatch
indices from a shuffled in-memory chunk, ``splice_indices`` + ``splice``,
``forward_backward``, the strategy's gradient hook, SGD with max-change, the
strategy's after-update hook.  A contender's round time is its slowest rank's;
frames/s and ratios are medians over rounds (ratios are medians of per-round
ratios).  ``comm`` is the fraction of a rank's round spent inside the
communicator (waiting for a slower rank included), averaged over ranks.

Example::

    rows = run(create_communicator(), parse_args(["--model", "tiny", "--rounds", "2"]))
"""

from __future__ import annotations

import os

# One BLAS thread per rank unless the caller says otherwise: set before numpy loads.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402

SINGLE, LOCAL = "1 rank", "no communication"
METHODS = ("model_averaging", "allreduce", "kaldi", "bmuf")
IDLE_POLL_SECONDS = 0.002
_TOKEN_TAG = 31


@dataclass(frozen=True)
class ModelSize:
    """A benchmark model: 40-dim frames spliced +-5, ReLU hidden layers.

    Example::

        MODELS["quickstart"].describe()     # '440-3x512-120, minibatch 256'
    """

    hidden_layers: int
    hidden_dim: int
    num_classes: int
    minibatch: int = 256
    feat_dim: int = 40
    context: int = 5

    def describe(self) -> str:
        return (f"{self.feat_dim * (2 * self.context + 1)}-{self.hidden_layers}x"
                f"{self.hidden_dim}-{self.num_classes}, minibatch {self.minibatch}")


MODELS = {
    "tiny": ModelSize(2, 64, 32, minibatch=64),
    "quickstart": ModelSize(3, 512, 120),
    "large": ModelSize(4, 1024, 2000),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mpitrain.bench.scaling",
        description="training throughput on 1 rank vs all ranks for each parallel method")
    parser.add_argument("--model", default="quickstart", choices=sorted(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--every", type=int, default=8,
                        help="minibatches between averages (model_averaging, kaldi, bmuf)")
    parser.add_argument("--steps", type=int, default=16,
                        help="timed steps per contender and round (a multiple of --every "
                             "keeps the averages per round constant)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    parser.add_argument("--skip", type=int, default=8,
                        help="untimed warm-up steps per contender before the first round")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; expected some of "
                     f"{', '.join(METHODS)}")
    if min(args.every, args.steps, args.rounds, args.threads) < 1 or args.skip < 0:
        parser.error("--every, --steps, --rounds and --threads must be >= 1, --skip >= 0")
    return args


# -- what one contender does ------------------------------------------------------------

def synthetic_chunk(size: ModelSize, frames: int, *, seed: int):
    """An in-memory chunk as the minibatch stream yields it, and a shuffled frame order.

    Example::

        chunk, order = synthetic_chunk(MODELS["tiny"], 4096, seed=0)
    """
    from mpitrain.data.batcher import Chunk, ChunkSpec
    from mpitrain.data.splice import frame_utterance_bounds
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 1000, size=frames // 100 + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.append(offsets[offsets < frames], frames)
    start, end = frame_utterance_bounds(offsets)
    feats = rng.standard_normal((frames, size.feat_dim), dtype=np.float32)
    labels = rng.integers(0, size.num_classes, size=frames).astype(np.int32)
    return Chunk(ChunkSpec(0, 0, len(offsets) - 1, frames), feats, labels, start, end), \
        rng.permutation(frames)


class TrainerSteps:
    """The trainer's per-step work with one strategy, on a synthetic chunk.

    ``method`` is a ``parallel.method`` name, or None for no communication.

    Example::

        steps = TrainerSteps(comm, MODELS["tiny"], "model_averaging", every=8)
        steps.run(16)
    """

    def __init__(self, comm, size: ModelSize, method: Optional[str], *, every: int = 8,
                 total_steps: int = 10_000, seed: int = 1, chunk_frames: int = 20_000):
        from mpitrain.config import RunConfig
        from mpitrain.nn.network import build_network
        from mpitrain.optim.factory import build_optimizer
        from mpitrain.parallel.base import Strategy
        from mpitrain.parallel.registry import build_strategy
        from mpitrain.train.step import TrainingStep
        cfg = RunConfig()
        cfg.model.hidden_layers, cfg.model.hidden_dim = size.hidden_layers, size.hidden_dim
        cfg.training.minibatch = size.minibatch
        cfg.parallel.average_every = every
        self.size, self.lr = size, cfg.optimizer.initial_learning_rate
        self.net = build_network(feat_dim=size.feat_dim, num_classes=size.num_classes,
                                 left_context=size.context, right_context=size.context,
                                 hidden_layers=size.hidden_layers, hidden_dim=size.hidden_dim)
        self.net.init_params(seed=seed)
        self.optimizer = build_optimizer(cfg.optimizer, self.net)
        if method is None:
            self.strategy = Strategy(comm)
        else:
            cfg.parallel.method = method
            self.strategy = build_strategy(cfg, comm, total_steps=total_steps)
        self.strategy.setup(self.net, self.optimizer)
        # every rank reads its own data, as with its own shards
        self.chunk, self.order = synthetic_chunk(size, chunk_frames, seed=seed + 7 * comm.rank)
        self.batches = chunk_frames // size.minibatch
        # the trainer's own step: splice, forward/backward, strategy hooks, SGD
        self.training_step = TrainingStep(self.net, self.optimizer, self.strategy,
                                          minibatch=size.minibatch, left_context=size.context,
                                          right_context=size.context)
        self.step = 0

    def _next_batch(self):
        b = self.size.minibatch
        pos = self.step % self.batches
        return self.chunk, self.order[pos * b:(pos + 1) * b]

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.training_step.run(self.step, self.lr, self._next_batch)
            self.step += 1


# -- timing ---------------------------------------------------------------------------------

def wait_idle(comm, source: int = 0) -> None:
    """Block until ``source`` sends a token, without keeping a core busy (MPI waits spin)."""
    token = np.zeros(1, dtype=np.int32)
    request = comm.irecv(token, source=source, tag=_TOKEN_TAG)
    while not request.test():
        time.sleep(IDLE_POLL_SECONDS)


def release_idle(comm) -> None:
    token = np.ones(1, dtype=np.int32)
    comm.waitall([comm.isend(token, dest=r, tag=_TOKEN_TAG) for r in range(1, comm.size)])


def time_contenders(comm, contenders: dict, *, rounds: int, steps: int, skip: int,
                    root_only: Sequence[str] = ()) -> dict:
    """Interleaved timing: ``{name: {"seconds": [...], "comm": [...]}}`` per round.

    ``contenders`` maps a name to a callable ``run(steps)``.  Names in
    ``root_only`` run on rank 0 alone while the other ranks sleep.  A round's
    seconds are the slowest rank's; ``comm`` is the mean over ranks of the
    fraction of the round spent inside ``comm``.  Identical on every rank.

    Example::

        times = time_contenders(comm, {"local": steps.run}, rounds=3, steps=8, skip=2)
    """
    names = list(contenders)

    def one(name, count):
        alone = name in root_only
        comm.barrier()
        before = comm.comm_time
        start = time.perf_counter()
        if not alone or comm.rank == 0:
            contenders[name](count)
        elapsed = time.perf_counter() - start
        spent = comm.comm_time - before
        if alone and comm.size > 1:
            release_idle(comm) if comm.rank == 0 else wait_idle(comm)
            if comm.rank != 0:
                elapsed = spent = 0.0
        return elapsed, spent

    for name in names:
        one(name, skip)
    seconds = np.zeros((len(names), rounds))
    fractions = np.zeros((len(names), rounds))
    for r in range(rounds):
        for k in range(len(names)):
            i = (r + k) % len(names)
            elapsed, spent = one(names[i], steps)
            seconds[i, r] = elapsed
            fractions[i, r] = spent / elapsed if elapsed > 0 else 0.0
    comm.allreduce_(seconds.reshape(-1), op="max")
    comm.allreduce_(fractions.reshape(-1), op="sum")
    result = {}
    for i, name in enumerate(names):
        ranks = 1 if name in root_only else comm.size
        result[name] = {"seconds": seconds[i].tolist(),
                        "comm": (fractions[i] / ranks).tolist(), "ranks": ranks}
    return result


def summarize(times: dict, *, frames_per_round: int, baseline: str, local: str) -> list:
    """One row per contender: frames/s and ratios to ``baseline`` (1 rank) and ``local``.

    Example::

        rows = summarize(times, frames_per_round=16 * 256, baseline=SINGLE, local=LOCAL)
    """
    med = statistics.median

    def fps(name):
        return [times[name]["ranks"] * frames_per_round / s for s in times[name]["seconds"]]

    rows = []
    for name in times:
        rate = fps(name)
        row = {"method": name, "ranks": times[name]["ranks"], "fps": med(rate),
               "comm_fraction": med(times[name]["comm"]), "rounds": len(rate)}
        if baseline in times:
            row["speedup"] = med(a / b for a, b in zip(rate, fps(baseline)))
        if local in times:
            row["vs_no_comm"] = med(a / b for a, b in zip(rate, fps(local)))
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict], *, title: str) -> str:
    """Rows from :func:`summarize` as an aligned text table."""
    lines = [title, f"{'method':<18} {'ranks':>5} {'frames/s':>10} {'vs 1 rank':>10} "
                    f"{'vs no comm':>11} {'comm':>7}"]
    for r in rows:
        speedup = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        ratio = f"{r['vs_no_comm']:.3f}" if "vs_no_comm" in r else "-"
        lines.append(f"{r['method']:<18} {r['ranks']:>5} {r['fps']:>10,.0f} {speedup:>10} "
                     f"{ratio:>11} {r['comm_fraction']:>7.1%}")
    return "\n".join(lines)


def run(comm, args: argparse.Namespace) -> dict:
    """Build the contenders, time them, and return the summary (same on every rank)."""
    size = MODELS[args.model]
    contenders = {SINGLE: TrainerSteps(comm, size, None).run,
                  LOCAL: TrainerSteps(comm, size, None).run}
    total = args.skip + args.rounds * args.steps
    for method in args.methods:
        contenders[method] = TrainerSteps(comm, size, method, every=args.every,
                                          total_steps=total).run
    times = time_contenders(comm, contenders, rounds=args.rounds, steps=args.steps,
                            skip=args.skip, root_only=[SINGLE])
    rows = summarize(times, frames_per_round=args.steps * size.minibatch,
                     baseline=SINGLE, local=LOCAL)
    by_method = {r["method"]: r for r in rows}
    result = {"ranks": comm.size, "model": size.describe(), "every": args.every,
              "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
              "rows": rows, "per_round": times}
    if "model_averaging" in by_method:
        result["averaging_vs_no_comm"] = by_method["model_averaging"]["vs_no_comm"]
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mpitrain.comm import create_communicator
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits
    threadpool_limits(args.threads)
    comm = create_communicator("auto")
    result = run(comm, args)
    if comm.rank == 0:
        title = (f"training throughput, {comm.size} ranks x {args.threads} BLAS thread(s), "
                 f"model {result['model']}, averaging every {args.every}; median of "
                 f"{args.rounds} rounds of {args.steps} steps")
        print(format_table(result["rows"], title=title))
        if "averaging_vs_no_comm" in result:
            print(f"model averaging every {args.every} / no communication: "
                  f"{result['averaging_vs_no_comm']:.3f} (target >= 0.97)", flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
