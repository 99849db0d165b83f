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

A step is the trainer's own step (``TrainingStep`` through
:class:`~mpitrain.bench.steps.TrainerSteps`) on the trainer's own objects
(``build_network``, ``build_optimizer``, the strategy hooks): minibatch
indices from a shuffled in-memory chunk (each rank its own), splicing,
``forward_backward``, the strategy's gradient hook, SGD with max-change, the
strategy's after-update hook; the initial learning rate at every step.
Rounds are timed by :func:`~mpitrain.bench.rounds.time_contenders`.  A
contender's round time is its slowest rank's; frames/s and ratios are
medians over rounds (ratios are medians of per-round ratios).  ``comm`` is
the fraction of a rank's round spent inside the communicator (waiting for a
slower rank included), averaged over ranks.

Example::

    rows = run(create_communicator(), parse_args(["--model", "tiny", "--rounds", "2"]))
"""

from __future__ import annotations

import os

from mpitrain.files import atomic_open, check_json_option
from mpitrain.threads import BLAS_ENV
from mpitrain.words import DefaultsFormatter

# One BLAS thread per rank unless the caller says otherwise: set before numpy loads.
for _name in BLAS_ENV:
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from .models import PARALLEL_MODELS as MODELS  # noqa: E402
from .models import ModelSpec, synthetic_chunk  # noqa: E402
from .rounds import time_contenders  # noqa: E402
from .steps import TrainerSteps  # noqa: E402

SINGLE, LOCAL = "1 rank", "no communication"
METHODS = ("model_averaging", "allreduce", "kaldi", "bmuf")
CHUNK_FRAMES = 20_000   # per rank: the data each rank trains on, round after round


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpitrain.bench.scaling", formatter_class=DefaultsFormatter,
        description="training throughput on 1 rank vs all ranks for each parallel method")
    parser.add_argument("--model", default="quickstart", choices=sorted(MODELS),
                        help="the model and minibatch timed")
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
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_json_option(parser, args.json)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; expected some of "
                     f"{', '.join(METHODS)}")
    if min(args.every, args.steps, args.rounds, args.threads) < 1 or args.skip < 0:
        parser.error("--every, --steps, --rounds and --threads must be >= 1, --skip >= 0")
    return args


# -- the contenders and their figures ----------------------------------------------------

def contender(comm, model: ModelSpec, method: Optional[str], *, every: int = 8,
              total_steps: int = 0, seed: int = 1):
    """``run(steps)`` of the trainer's step with ``method`` (None: no communication).

    Every rank reads its own data, as with its own shards; every contender of a
    rank the same data.  The rate stays at its initial value, so rounds are alike.

    Example::

        run = contender(comm, MODELS["tiny"], "model_averaging", every=8)
        run(16)
    """
    chunk, order = synthetic_chunk(model, CHUNK_FRAMES, seed=seed + 7 * comm.rank)
    return TrainerSteps(model, chunk, order, comm=comm, method=method, every=every,
                        total_steps=total_steps, lr_decay=False, seed=seed).run


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
    model = MODELS[args.model]
    contenders = {SINGLE: contender(comm, model, None), LOCAL: contender(comm, model, None)}
    total = args.skip + args.rounds * args.steps
    for method in args.methods:
        contenders[method] = contender(comm, model, method, every=args.every,
                                       total_steps=total)
    times = time_contenders(comm, contenders, rounds=args.rounds, steps=args.steps,
                            skip=args.skip, root_only=[SINGLE])
    rows = summarize(times, frames_per_round=args.steps * model.minibatch,
                     baseline=SINGLE, local=LOCAL)
    by_method = {r["method"]: r for r in rows}
    result = {"ranks": comm.size, "model": model.describe(), "every": args.every,
              "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
              "rows": rows, "per_round": times}
    if "model_averaging" in by_method:
        result["averaging_vs_no_comm"] = by_method["model_averaging"]["vs_no_comm"]
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mpitrain.comm import create_communicator
    from mpitrain.comm.abort import install_abort_hook
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits
    threadpool_limits(args.threads)
    comm = create_communicator("auto")
    install_abort_hook(comm)     # a failing rank ends the job instead of hanging the others
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
            with atomic_open(args.json) as handle:
                json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
