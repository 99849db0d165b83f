"""Overhead of ``Communicator.allreduce_`` over the bare mpi4py call.

For each size, one flat float32 buffer is reduced many times by three methods,
interleaved within one run (order rotating every repetition, a Barrier
before each call): the bare ``comm.Allreduce(MPI.IN_PLACE, buf)``, our
``allreduce_(buf, op="sum")`` and our ``allreduce_(buf, op="mean")`` (sum plus
the in-place scale model averaging uses).  A repetition's time is the slowest
rank's; rank 0 prints medians and ratios to the bare call.

Usage::

    mpiexec -n 2 python -m mpitrain.bench.collectives --sizes 1,8,21.6,82.7

Example::

    rows = run(create_communicator("mpi"), parse_args(["--sizes", "1", "--repeats", "5"]))
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import numpy as np

from mpitrain.files import atomic_open, check_json_option
from mpitrain.words import DefaultsFormatter

METHODS = ("bare", "ours_sum", "ours_mean")
MB = 1_000_000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpitrain.bench.collectives", formatter_class=DefaultsFormatter,
        description="allreduce_ of one flat float32 buffer vs the bare mpi4py Allreduce")
    parser.add_argument("--sizes", default="1,8,21.6,82.7",
                        help="buffer sizes in MB (10^6 bytes), comma-separated")
    parser.add_argument("--repeats", type=int, default=40,
                        help="timed repetitions per size and method")
    parser.add_argument("--skip", type=int, default=3,
                        help="untimed warm-up repetitions per size and method")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_json_option(parser, args.json)
    try:
        args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes: expected comma-separated numbers of MB, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) <= 0:
        parser.error("--sizes: expected positive sizes")
    if args.repeats < 1 or args.skip < 0:
        parser.error("--repeats must be >= 1 and --skip >= 0")
    return args


def _time_once(comm, method: str, buf) -> float:
    from mpitrain.comm.mpi import bare_allreduce_sum_
    comm.barrier()
    start = comm.wtime()
    if method == "bare":
        bare_allreduce_sum_(comm, buf)
    elif method == "ours_sum":
        comm.allreduce_(buf, op="sum")
    else:
        comm.allreduce_(buf, op="mean")
    return comm.wtime() - start


def run(comm, args: argparse.Namespace) -> list[dict]:
    """Time every size; returns one row per size (same on every rank)."""
    rows = []
    for size_mb in args.sizes:
        count = max(1, int(round(size_mb * MB / 4)))
        # One buffer for all methods, so each finds it equally warm in cache; zeros
        # stay zeros under repeated sums, so the arithmetic cost never changes.
        buf = np.zeros(count, dtype=np.float32)
        for _ in range(args.skip):
            for method in METHODS:
                _time_once(comm, method, buf)
        times = np.zeros((len(METHODS), args.repeats))
        for rep in range(args.repeats):
            # Rotate the order so no method always runs first or after the same one.
            for k in range(len(METHODS)):
                m = (rep + k) % len(METHODS)
                times[m, rep] = _time_once(comm, METHODS[m], buf)
        comm.allreduce_(times.reshape(-1), op="max")      # slowest rank per repetition
        medians = {method: float(np.median(times[m])) for m, method in enumerate(METHODS)}
        nbytes = count * 4
        ring_bytes = 2 * (comm.size - 1) / comm.size * nbytes
        rows.append({
            "ranks": comm.size, "mb": nbytes / MB, "repeats": args.repeats,
            "bare_ms": medians["bare"] * 1e3,
            "ours_sum_ms": medians["ours_sum"] * 1e3,
            "ours_mean_ms": medians["ours_mean"] * 1e3,
            "ratio_sum": medians["ours_sum"] / medians["bare"],
            "ratio_mean": medians["ours_mean"] / medians["bare"],
            "bare_busbw_gbs": ring_bytes / medians["bare"] / 1e9,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"allreduce of one float32 buffer, {rows[0]['ranks']} ranks, "
             f"median of {rows[0]['repeats']} (slowest rank per repetition)",
             f"{'MB':>7} {'bare ms':>9} {'sum ms':>9} {'mean ms':>9} "
             f"{'sum/bare':>9} {'mean/bare':>10} {'busbw GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['mb']:7.3g} {r['bare_ms']:9.3f} {r['ours_sum_ms']:9.3f} "
                     f"{r['ours_mean_ms']:9.3f} {r['ratio_sum']:9.3f} {r['ratio_mean']:10.3f} "
                     f"{r['bare_busbw_gbs']:11.2f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mpitrain.comm import create_communicator
    from mpitrain.comm.abort import install_abort_hook
    args = parse_args(argv)
    comm = create_communicator("mpi")
    install_abort_hook(comm)     # a failing rank ends the job instead of hanging the others
    rows = run(comm, args)
    if comm.rank == 0:
        print(format_table(rows), flush=True)
        if args.json:
            with atomic_open(args.json) as handle:
                json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
