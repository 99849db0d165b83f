"""Micro-benchmark: the cost of natural-gradient preconditioning on the CPU.

Times ``OnlineNaturalGradient.precondition`` on (N, D) float32 rows in steady
state (past the 11 initial updates, so one call in ``update_period`` updates
the Fisher estimate) next to one N x 2048 x 2048 GEMM, then estimates the NG
overhead on a whole training step of a ReLU model: per affine layer, plain SGD
costs three GEMMs (forward, input derivative, weight gradient) and NG adds the
two preconditioner calls and the copy of the input rows.  Only GEMMs count as
SGD cost, so the step ratio printed is an upper bound.  Unlike the other
benchmarks it times one component, not the training step
(``ngsgd_overhead`` times the whole NG-SGD step).

    python -m mpitrain.bench.precondition                  # 1 BLAS thread
    python -m mpitrain.bench.precondition --threads 2 --model 440-4x2048-4000

Example::

    import numpy
    time_precondition(numpy, 512, 2048, 80, update_period=4, calls=40)["mean"]   # ms/call
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mpitrain.threads import BLAS_ENV
from mpitrain.words import DefaultsFormatter


def parse_model(text: str) -> list[tuple[int, int]]:
    """'440-4x2048-4000' -> the (in, out) dims of its affine layers.

    Example::

        parse_model("440-2x1024-2000")   # [(440, 1024), (1024, 1024), (1024, 2000)]
    """
    dims = []
    for part in text.split("-"):
        count, _, width = part.rpartition("x")
        try:
            repeat, size = (int(count) if count else 1), int(width)
        except ValueError:
            repeat = size = 0
        if repeat < 1 or size < 1:
            dims = []
            break
        dims += [size] * repeat
    if len(dims) < 2:
        raise ValueError(f"--model: expected dims like 440-4x2048-4000, got {text!r}")
    return list(zip(dims[:-1], dims[1:]))


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def time_precondition(np, num_rows: int, dim: int, rank: int, *, update_period: int,
                      calls: int, rounds: int = 3, seed: int = 0) -> dict:
    """ms per steady-state call (best round's mean), and for update and plain calls.

    The machine may be shared, so the best of ``rounds`` rounds is reported.
    """
    from mpitrain.optim.natural_gradient import NUM_INITIAL_UPDATES, OnlineNaturalGradient

    rng = np.random.default_rng(seed)
    # A decaying spectrum, like real activations, so the update does real work.
    scales = (0.97 ** np.arange(dim)).astype(np.float32)
    source = rng.standard_normal((num_rows, dim)).astype(np.float32) * scales
    rows = np.empty_like(source)
    prec = OnlineNaturalGradient(rank=rank, update_period=update_period)
    for _ in range(NUM_INITIAL_UPDATES + 1):
        rows[...] = source
        prec.precondition(rows)
    best = None
    for _ in range(rounds):
        update_ms, plain_ms = [], []
        for _ in range(calls):
            rows[...] = source
            updating = prec.updating()
            start = time.perf_counter()
            prec.precondition(rows)
            elapsed = (time.perf_counter() - start) * 1e3
            (update_ms if updating else plain_ms).append(elapsed)
        total = update_ms + plain_ms
        # (None: no call of that kind was timed, e.g. fewer calls than update_period;
        # a mean of 0.00 ms read as a free update)
        result = {"mean": sum(total) / len(total),
                  "update": sum(update_ms) / len(update_ms) if update_ms else None,
                  "plain": sum(plain_ms) / len(plain_ms) if plain_ms else None}
        if best is None or result["mean"] < best["mean"]:
            best = result
    return best


def _ms(value) -> str:
    return "none timed" if value is None else f"{value:.2f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpitrain.bench.precondition",
                                     formatter_class=DefaultsFormatter,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    parser.add_argument("--batch", type=int, default=512, help="minibatch rows N")
    parser.add_argument("--update-period", type=int, default=4,
                        help="calls per Fisher update in steady state (optimizer.ngsgd's)")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per shape")
    parser.add_argument("--model", default="440-4x2048-4000",
                        help="ReLU model dims for the step estimate ('' to skip)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # said before the timings, not as a traceback after them
    for flag in ("threads", "batch", "update_period", "calls"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    layers = []
    if args.model:
        try:
            layers = parse_model(args.model)
        except ValueError as exc:
            parser.error(str(exc))

    if "numpy" in sys.modules:
        print("warning: numpy was imported before the thread count was set", file=sys.stderr)
    for var in BLAS_ENV:
        os.environ[var] = str(args.threads)
    import numpy as np

    n = args.batch
    a = np.random.default_rng(1).standard_normal((n, 2048)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((2048, 2048)).astype(np.float32)
    c = np.empty((n, 2048), np.float32)
    gemm_ms = _best_ms(lambda: np.matmul(a, b, out=c), 5)
    print(f"GEMM {n}x2048x2048: {gemm_ms:.2f} ms "
          f"({2 * n * 2048 * 2048 / gemm_ms / 1e6:.1f} GFLOP/s), {args.threads} BLAS thread(s)")
    for dim, rank in ((2049, 20), (2048, 80), (4000, 80)):
        t = time_precondition(np, n, dim, rank, update_period=args.update_period,
                              calls=args.calls)
        print(f"precondition N={n} D={dim} r={rank}: {t['mean']:.2f} ms/call "
              f"(update {_ms(t['update'])}, plain {_ms(t['plain'])}); "
              f"ratio to the GEMM {t['mean'] / gemm_ms:.3f}")

    if args.model:
        from mpitrain.optim.natural_gradient import default_ranks
        sgd_ms = ng_ms = 0.0
        for in_dim, out_dim in layers:
            rng = np.random.default_rng(in_dim)
            x = rng.standard_normal((n, in_dim + 1)).astype(np.float32)
            w = (rng.standard_normal((out_dim, in_dim + 1)) / in_dim ** 0.5).astype(np.float32)
            y = np.empty((n, out_dim), np.float32)
            dx = np.empty((n, in_dim + 1), np.float32)
            grad = np.empty_like(w)
            rows = np.empty_like(x)

            def sgd_gemms():
                np.matmul(x, w.T, out=y)
                np.matmul(y, w, out=dx)
                np.matmul(y.T, x, out=grad)
            sgd_ms += _best_ms(sgd_gemms, 2)
            ng_ms += _best_ms(lambda: np.copyto(rows, x), 10)
            rank_in, rank_out = default_ranks(in_dim, out_dim)
            ng_ms += time_precondition(np, n, in_dim + 1, rank_in, calls=args.calls,
                                       update_period=args.update_period)["mean"]
            ng_ms += time_precondition(np, n, out_dim, rank_out, calls=args.calls,
                                       update_period=args.update_period)["mean"]
        print(f"model {args.model}, minibatch {n}: SGD GEMMs {sgd_ms:.1f} ms/step, "
              f"NG extra {ng_ms:.1f} ms/step; NG-SGD / SGD <= {(sgd_ms + ng_ms) / sgd_ms:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
