"""Step time of NG-SGD relative to plain SGD on the same model, in one run.

Copies of one model take the trainer's own step
(:class:`~mpitrain.train.step.TrainingStep`, through
:class:`~mpitrain.bench.steps.TrainerSteps`), one with SGD and one with
NG-SGD (more with ``--delayed-updates`` and ``--plan-threads``), on the same
synthetic chunk in interleaved rounds (so machine load hits all alike); the
ratios of median step times to SGD's are printed.  On a GPU each round starts
and ends with the GPU idle.

Usage::

    python -m mpitrain.bench.ngsgd_overhead [--hidden 2048 --layers 4 --classes 4000
                                             --minibatch 512 --rounds 7 --steps 5
                                             --device cpu|gpu --cuda-graph
                                             --reset-every K --delayed-updates
                                             --plan-threads 0,4]

Example::

    rows = measure(hidden=64, layers=2, classes=10, minibatch=32, rounds=2, steps=2)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ..files import atomic_open, check_json_option
from ..words import DefaultsFormatter
from .machine import device_problem


def measure(*, hidden=2048, layers=4, classes=4000, minibatch=512, rounds=7, steps=5,
            device="cpu", variant="online", cuda_graph: bool = False,
            reset_every: int = 0, delayed_updates: bool = False, plan_threads=(0,)) -> dict:
    """Median step times of SGD and NG-SGD; ``reset_every`` K > 0 starts NG-SGD's
    preconditioners afresh every K steps, as model averaging every K minibatches
    does on several ranks with ``optimizer.ngsgd.reset_on_average: true``;
    ``delayed_updates`` adds NG-SGD with ``optimizer.ngsgd.delayed_updates``
    (``delayed_ngsgd_step_ms``, ``delayed_ratio``); ``plan_threads``: the values
    of ``optimizer.ngsgd.plan_threads`` to time, each in both orders where
    delayed updates are asked (the first gives the named fields; every NG-SGD
    contender is in ``contenders``)."""
    from .. import backend
    from .models import ModelSpec, synthetic_chunk
    from .steps import TrainerSteps
    xp = backend.select(device)
    model = ModelSpec("ngsgd-overhead", hidden_layers=layers, hidden_dim=hidden,
                      num_classes=classes, minibatch=minibatch)
    chunk, perm = synthetic_chunk(model, max(20 * minibatch, 20_000))
    threads = list(dict.fromkeys(int(n) for n in plan_threads))
    contenders = {"sgd": ("sgd", False, 0)}
    for n in threads:
        for delayed in (False, True) if delayed_updates else (False,):
            name = "ngsgd" + ("-delayed" if delayed else "") \
                + ("" if n == threads[0] else f"-threads{n}")
            contenders[name] = ("ngsgd", delayed, n)
    runners = {name: TrainerSteps(model, chunk, perm, xp=xp, optimizer=optimizer,
                                  ngsgd_variant=variant, cuda_graph=cuda_graph,
                                  ngsgd_delayed_updates=delayed, plan_threads=n)
               for name, (optimizer, delayed, n) in contenders.items()}

    def run(name, n):
        backend.synchronize(xp)
        start = time.perf_counter()
        runner = runners[name]
        for _ in range(n):
            runner.step()
            if name != "sgd" and reset_every and runner.step_count % reset_every == 0:
                runner.optimizer.reset_preconditioners()
        backend.synchronize(xp)
        return (time.perf_counter() - start) / n

    from threadpoolctl import threadpool_limits
    # On a GPU the host's BLAS only sees NG-SGD's small r x r matrices: one
    # thread, as the trainer uses there.
    with threadpool_limits(limits=1 if device == "gpu" else None):
        for name in runners:           # warm-up: buffers, kernels, NG initialisation
            run(name, 12)
        times = {name: [] for name in runners}
        for r in range(rounds):
            order = list(runners) if r % 2 == 0 else list(runners)[::-1]
            for name in order:
                times[name].append(run(name, steps))
    med = {name: float(np.median(t)) for name, t in times.items()}
    # asked for, graphs may still be off (a capture that failed, an old cuBLAS): say so
    graph = runners["sgd"].training_step.graph
    graph_off = "" if graph is None or graph.replays else \
        (graph.why_not or "no step was replayed")
    result = {"model": f"440-{layers}x{hidden}-{classes}", "minibatch": minibatch,
              "device": backend.device_name(xp), "cuda_graph": cuda_graph and not graph_off,
              "cuda_graph_off_because": graph_off,
              "reset_every": reset_every, "sgd_step_ms": med["sgd"] * 1e3,
              "ngsgd_step_ms": med["ngsgd"] * 1e3, "ratio": med["ngsgd"] / med["sgd"]}
    if delayed_updates:
        result.update(delayed_ngsgd_step_ms=med["ngsgd-delayed"] * 1e3,
                      delayed_ratio=med["ngsgd-delayed"] / med["sgd"])
    result["contenders"] = [
        {"delayed_updates": delayed, "plan_threads": n, "ngsgd_step_ms": med[name] * 1e3,
         "ratio": med[name] / med["sgd"]}
        for name, (optimizer, delayed, n) in contenders.items() if optimizer == "ngsgd"]
    return result


def _setting(contender: dict) -> str:
    """``delayed_updates and 4 plan threads`` and the like, for a printed line."""
    words = ["delayed_updates"] if contender["delayed_updates"] else []
    if contender["plan_threads"]:
        words.append(f"{contender['plan_threads']} plan threads")
    return " and ".join(words) or "Kaldi's order on the training thread"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpitrain.bench.ngsgd_overhead",
                                formatter_class=DefaultsFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048, help="hidden layer width (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="hidden layers (default 4)")
    p.add_argument("--classes", type=int, default=4000, help="output classes (default 4000)")
    p.add_argument("--minibatch", type=int, default=512, help="frames per step (default 512)")
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved rounds of both optimizers (default 7)")
    p.add_argument("--steps", type=int, default=5, help="steps per round (default 5)")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                   help="gpu: the steps on the GPU, with CuPy")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU: replay fixed steps from captured CUDA graphs")
    p.add_argument("--reset-every", type=int, default=0, metavar="K",
                   help="NG-SGD's preconditioners start afresh every K steps, as model "
                        "averaging every K minibatches does on several ranks (0: never)")
    p.add_argument("--delayed-updates", action="store_true",
                   help="also time NG-SGD with optimizer.ngsgd.delayed_updates")
    p.add_argument("--plan-threads", default="0", metavar="N[,N...]",
                   help="optimizer.ngsgd.plan_threads of the NG-SGD contenders, one each "
                        "(default 0)")
    p.add_argument("--json", default=None, help="also write the result here")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_json_option(p, args.json)
    try:
        plan_threads = [int(n) for n in args.plan_threads.split(",")]
    except ValueError:
        plan_threads = [-1]
    if min(plan_threads) < 0:
        p.error(f"--plan-threads must be integers >= 0, got {args.plan_threads!r}")
    if args.reset_every < 0:
        p.error("--reset-every must be >= 0")
    if args.cuda_graph and args.device != "gpu":
        p.error("--cuda-graph needs --device gpu")
    for flag in ("hidden", "layers", "classes", "minibatch", "rounds", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    problem = device_problem(args.device)
    if problem:                           # no CuPy or no GPU: say so, no traceback
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        return 2
    result = measure(hidden=args.hidden, layers=args.layers, classes=args.classes,
                     minibatch=args.minibatch, rounds=args.rounds, steps=args.steps,
                     device=args.device, cuda_graph=args.cuda_graph,
                     reset_every=args.reset_every, delayed_updates=args.delayed_updates,
                     plan_threads=plan_threads)
    graphs = " (CUDA graphs)" if result["cuda_graph"] else ""
    if result["cuda_graph_off_because"]:
        graphs = f" (CUDA graphs not used: {result['cuda_graph_off_because']})"
    print(f"{result['model']} minibatch {result['minibatch']} on {result['device']}{graphs}"
          f"{f', NG-SGD reset every {args.reset_every} steps' if args.reset_every else ''}: "
          f"SGD {result['sgd_step_ms']:.1f} ms/step, NG-SGD {result['ngsgd_step_ms']:.1f} "
          f"ms/step, NG-SGD / SGD = {result['ratio']:.3f}")
    for other in result["contenders"][1:]:
        print(f"  with {_setting(other)}: NG-SGD {other['ngsgd_step_ms']:.1f} ms/step, "
              f"NG-SGD / SGD = {other['ratio']:.3f}")
    if args.json:
        with atomic_open(args.json) as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
