"""mpitrain's parallel training against PyTorch DDP on the same model, in one run.

Launched with the same launcher as mpitrain::

    mpiexec -n 2 python -m mpitrain.bench.ddp_compare --model quickstart --rounds 15

Every rank runs six contenders in interleaved rounds (order rotating every
round, :func:`~mpitrain.bench.rounds.time_contenders`), same model, same
minibatches, same threads (``--threads`` BLAS and torch threads per rank):

- ``torch no comm``: an ``nn.Sequential`` of ``Linear`` + ``ReLU``, summed
  ``CrossEntropyLoss``, ``torch.optim.SGD``, every rank alone;
- ``torch DDP``: the same wrapped in ``DistributedDataParallel`` over gloo
  (gradient allreduce every step, bucketed and overlapped with backward);
- ``torch averager/K``: the local model plus
  ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``
  every K steps;
- ``mpitrain no comm``, ``mpitrain allreduce``, ``mpitrain averaging/K``: the
  trainer's own step (``TrainingStep`` through
  :class:`~mpitrain.bench.steps.TrainerSteps`) with the trainer's network,
  optimizer (SGD with max-change) and strategies.

Both libraries train on the same minibatches, taken in the same order from
one synthetic chunk per rank.  mpitrain splices each minibatch from the
unspliced chunk, as the trainer does; PyTorch's input is pre-spliced (a pool
of contiguous minibatches, no gather), which favours PyTorch.

torch.distributed finds its peers from PMI_RANK / PMI_SIZE (set by the
launcher), MASTER_ADDR 127.0.0.1 and MASTER_PORT: taken from the environment
when set, otherwise a free port chosen by rank 0 and sent to the others over
MPI.  PyTorch is a benchmark-only dependency: imported inside the functions
that need it.

Example::

    result = run(create_communicator(), parse_args(["--model", "tiny", "--rounds", "2"]))
    result["ratios"]["allreduce"]      # mpitrain frames/s over DDP's
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
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from .models import PARALLEL_MODELS as MODELS  # noqa: E402
from .models import ModelSpec, synthetic_chunk, torch_network  # noqa: E402
from .rounds import time_contenders  # noqa: E402
from .steps import TrainerSteps  # noqa: E402

POOL_BATCHES = 16   # minibatches per rank, walked in turn by every contender


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpitrain.bench.ddp_compare", formatter_class=DefaultsFormatter,
        description="mpitrain allreduce / model averaging vs PyTorch DDP / "
                    "PeriodicModelAverager, same model and batches, one run")
    parser.add_argument("--model", default="quickstart", choices=sorted(MODELS),
                        help="the model and minibatch timed")
    parser.add_argument("--every", type=int, default=8,
                        help="steps between model averages (both libraries)")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    parser.add_argument("--skip", type=int, default=8, help="untimed warm-up steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS and torch threads per rank")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_json_option(parser, args.json)
    if min(args.every, args.steps, args.rounds, args.threads) < 1 or args.skip < 0:
        parser.error("--every, --steps, --rounds and --threads must be >= 1, --skip >= 0")
    return args


# -- the data ---------------------------------------------------------------------------------

def rank_chunk(model: ModelSpec, rank: int, *, batches: int = POOL_BATCHES):
    """This rank's synthetic chunk of ``batches`` minibatches, and its shuffled order.

    Example::

        chunk, order = rank_chunk(MODELS["tiny"], comm.rank)
    """
    return synthetic_chunk(model, batches * model.minibatch, seed=11 + 7 * rank)


def minibatch_pool(model: ModelSpec, chunk, order):
    """The chunk's minibatches in ``order``, pre-spliced for PyTorch:
    ``[(x (B, input_dim) float32, labels (B,) int32), ...]``."""
    from mpitrain.data.splice import splice, splice_indices
    b = model.minibatch
    pool = []
    for i in range(len(order) // b):
        idx = order[i * b:(i + 1) * b]
        ctx = splice_indices(idx, chunk.utt_start[idx], chunk.utt_end[idx],
                             model.left_context, model.right_context)
        pool.append((np.ascontiguousarray(splice(chunk.feats, ctx)), chunk.labels[idx].copy()))
    return pool


# -- PyTorch ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_torch_distributed(comm, threads: int):
    """Start torch.distributed (gloo) over the ranks the launcher started; returns torch."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    rank = int(os.environ.get("PMI_RANK", comm.rank))
    size = int(os.environ.get("PMI_SIZE", comm.size))
    if (rank, size) != (comm.rank, comm.size):
        raise RuntimeError(f"PMI_RANK/PMI_SIZE say rank {rank} of {size}, MPI says "
                           f"{comm.rank} of {comm.size}")
    port = os.environ.get("MASTER_PORT") or comm.bcast_obj(
        _free_port() if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    return torch


class TorchSteps:
    """The same model in PyTorch: ``mode`` is 'local', 'ddp' or 'averager'.

    Example::

        steps = TorchSteps(MODELS["tiny"], "ddp", pool)
        steps.run(8)
    """

    def __init__(self, model: ModelSpec, mode: str, pool, *, every: int = 8, lr: float = 0.004):
        import torch
        if mode not in ("local", "ddp", "averager"):
            raise ValueError(f"mode must be 'local', 'ddp' or 'averager', got {mode!r}")
        torch.manual_seed(1)
        net = torch_network(model)
        self.averager = None
        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(net)
        elif mode == "averager":
            from torch.distributed.algorithms.model_averaging.averagers import (
                PeriodicModelAverager)
            self.averager = PeriodicModelAverager(period=every, warmup_steps=0)
        self.model = net
        self.loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        self.optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        self.pool = [(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)))
                     for x, y in pool]
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x, y = self.pool[self.step % len(self.pool)]
            self.optimizer.zero_grad(set_to_none=False)
            self.loss_fn(self.model(x), y).backward()
            self.optimizer.step()
            if self.averager is not None:
                self.averager.average_parameters(self.model.parameters())
            self.step += 1


# -- the run ------------------------------------------------------------------------------------

def run(comm, args: argparse.Namespace) -> dict:
    """Time all contenders; returns per-contender rows and mpitrain/torch ratios."""
    model = MODELS[args.model]
    init_torch_distributed(comm, args.threads)
    chunk, order = rank_chunk(model, comm.rank)
    pool = minibatch_pool(model, chunk, order)
    k = args.every
    pairs = {  # method -> (mpitrain contender, torch contender)
        "no communication": ("mpitrain no comm", "torch no comm"),
        "allreduce": ("mpitrain allreduce", "torch DDP"),
        "model averaging": (f"mpitrain averaging/{k}", f"torch averager/{k}"),
    }

    def ours(method, **kwargs):
        # the initial rate at every step, as the PyTorch contenders keep theirs
        return TrainerSteps(model, chunk, order, comm=comm, method=method, lr_decay=False,
                            **kwargs).run

    contenders = {
        "mpitrain no comm": ours(None),
        "mpitrain allreduce": ours("allreduce"),
        f"mpitrain averaging/{k}": ours("model_averaging", every=k),
        "torch no comm": TorchSteps(model, "local", pool).run,
        "torch DDP": TorchSteps(model, "ddp", pool).run,
        f"torch averager/{k}": TorchSteps(model, "averager", pool, every=k).run,
    }
    times = time_contenders(comm, contenders, rounds=args.rounds, steps=args.steps,
                            skip=args.skip)
    frames = args.steps * model.minibatch * comm.size
    rates = {name: [frames / s for s in t["seconds"]] for name, t in times.items()}
    med = statistics.median
    rows = []
    for ours, theirs in pairs.values():
        for name, local in ((ours, "mpitrain no comm"), (theirs, "torch no comm")):
            rows.append({"contender": name, "fps": med(rates[name]),
                         "vs_own_no_comm": med(a / b for a, b in zip(rates[name], rates[local])),
                         "comm_fraction": med(times[name]["comm"])
                         if name.startswith("mpitrain") else None})
    ratios = {method: med(a / b for a, b in zip(rates[ours], rates[theirs]))
              for method, (ours, theirs) in pairs.items()}
    return {"ranks": comm.size, "model": model.describe(), "every": k, "steps": args.steps,
            "rounds": args.rounds, "threads": args.threads, "rows": rows, "ratios": ratios,
            "per_round": times}


def format_result(result: dict) -> str:
    lines = [f"mpitrain vs PyTorch (gloo), {result['ranks']} ranks x {result['threads']} "
             f"thread(s), model {result['model']}; median of {result['rounds']} rounds of "
             f"{result['steps']} steps",
             f"{'contender':<22} {'frames/s':>10} {'vs own no comm':>15} {'comm':>7}"]
    for r in result["rows"]:
        comm = "-" if r["comm_fraction"] is None else f"{r['comm_fraction']:.1%}"
        lines.append(f"{r['contender']:<22} {r['fps']:>10,.0f} {r['vs_own_no_comm']:>15.3f} "
                     f"{comm:>7}")
    lines.append("mpitrain / torch frames/s: " + ", ".join(
        f"{method} {ratio:.2f}" for method, ratio in result["ratios"].items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mpitrain.comm import create_communicator
    from mpitrain.comm.abort import install_abort_hook
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits
    threadpool_limits(args.threads)
    comm = create_communicator("auto")
    try:
        import torch  # noqa: F401  (every rank's environment alike: all stop here together)
    except ImportError:
        if comm.rank == 0:
            print("mpitrain.bench.ddp_compare: error: PyTorch is not installed; this "
                  "benchmark compares with it: pip install torch (CPU wheel: pip install "
                  "torch --index-url https://download.pytorch.org/whl/cpu)",
                  file=sys.stderr, flush=True)
        return 2
    install_abort_hook(comm)     # a failing rank ends the job instead of hanging the others
    result = run(comm, args)
    if comm.rank == 0:
        print(format_result(result), flush=True)
        if args.json:
            with atomic_open(args.json) as handle:
                json.dump(result, handle, indent=2)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
