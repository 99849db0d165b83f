"""Soak check: over a long run with frequent checkpoints, memory and step time stay flat.

Reads a run directory's ``metrics.jsonl``.  Each progress record carries rank
0's resident memory (``rss_mb``) and the window's frames per second; the
windows after a warm-up (the first tenth) are cut in quarters and the medians
of the first and the last quarter compared::

    memory growth = median rss(last quarter) - median rss(first quarter)     MiB
    slowdown      = median cpu(last quarter) / median cpu(first quarter)

where cpu is rank 0's CPU time per step (``cpu_ms_per_step``), which other
jobs on a shared machine do not inflate; the wall-clock figure (frames per
second) is reported beside it, and judged instead when a run predates the CPU
figure.  Medians, because a window holding a checkpoint or an evaluation is
slower by design; a leak or a slowdown that grows with the run moves the
whole quarter.

Example::

    python -m mpitrain train jobs/configs/quickstart.yaml --run-dir runs/soak \\
        --set training.epochs=20 --set training.checkpoint_interval=25
    python -m mpitrain.bench.soak runs/soak          # prints the table, exit 1 if not flat
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ..plotting import read_metrics
from ..words import DefaultsFormatter

#: Defaults of what counts as flat.
MAX_GROWTH_MB = 50.0
MAX_SLOWDOWN = 1.10


def _records(run_dir) -> dict:
    """The run's records by type, as ``plot`` and ``status`` read them: a resumed
    run on one clock, without the stretches it trained again after a resume or a
    roll back, nor a last line a running (or killed) run has not finished."""
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def summarize(run_dir, *, max_growth_mb: float = MAX_GROWTH_MB,
              max_slowdown: float = MAX_SLOWDOWN) -> dict:
    """Memory and speed at the start and the end of a run, and whether they are flat."""
    records = _records(run_dir)
    train = [r for r in records["train"]
             if r.get("rss_mb") is not None and r.get("frames_per_sec")]
    if len(train) < 8:
        raise ValueError(f"{run_dir}/metrics.jsonl: {len(train)} progress lines with memory "
                         "figures; a soak check needs at least 8 (log more often or run longer)")
    windows = train[len(train) // 10:]
    quarter = max(len(windows) // 4, 1)
    first, last = windows[:quarter], windows[-quarter:]
    rss_first = statistics.median(r["rss_mb"] for r in first)
    rss_last = statistics.median(r["rss_mb"] for r in last)
    fps_first = statistics.median(r["frames_per_sec"] for r in first)
    fps_last = statistics.median(r["frames_per_sec"] for r in last)
    wall_slowdown = fps_first / fps_last
    cpu = [r.get("cpu_ms_per_step") for r in windows]
    cpu_first = cpu_last = None
    if all(c is not None for c in cpu):
        cpu_first = statistics.median(cpu[:quarter])
        cpu_last = statistics.median(cpu[-quarter:])
    slowdown = cpu_last / cpu_first if cpu_first else wall_slowdown
    growth = rss_last - rss_first
    return {"windows": len(train), "steps": train[-1]["step"],
            "seconds": train[-1].get("time", 0.0),
            "rss_first_mb": rss_first, "rss_last_mb": rss_last, "rss_growth_mb": growth,
            "rss_peak_mb": max(r["rss_mb"] for r in train),
            "fps_first": fps_first, "fps_last": fps_last, "wall_slowdown": wall_slowdown,
            "cpu_ms_first": cpu_first, "cpu_ms_last": cpu_last, "slowdown": slowdown,
            "rollbacks": len(records.get("rollback", [])),
            "checkpoints": len(records.get("checkpoint", [])),
            "flat": growth <= max_growth_mb and slowdown <= max_slowdown}


def format_summary(run_dir, s: dict) -> str:
    return "\n".join([
        f"soak check of {run_dir}: {s['steps']} steps, {s['windows']} progress lines, "
        f"{s['checkpoints']} checkpoints, {s['rollbacks']} roll backs, "
        f"{s['seconds'] / 60:.1f} min",
        "| | first quarter | last quarter | change |",
        "|---|---:|---:|---:|",
        f"| rank 0 resident memory (MiB) | {s['rss_first_mb']:.1f} | {s['rss_last_mb']:.1f} "
        f"| {s['rss_growth_mb']:+.1f} (peak {s['rss_peak_mb']:.1f}) |",
        f"| frames/s (all ranks, wall clock) | {s['fps_first']:,.0f} | {s['fps_last']:,.0f} "
        f"| {_slower(s['wall_slowdown'])} |"] + ([
        f"| rank 0 CPU time per step (ms) | {s['cpu_ms_first']:.2f} | {s['cpu_ms_last']:.2f} "
        f"| x{s['slowdown']:.3f} |"] if s["cpu_ms_first"] else []) + [
        f"flat: {'yes' if s['flat'] else 'NO'}"])


def _slower(factor: float) -> str:
    return f"x{factor:.3f} slower" if factor >= 1 else f"x{1 / factor:.3f} faster"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpitrain.bench.soak",
                                     formatter_class=DefaultsFormatter,
                                     description="check that a long run's memory and speed "
                                                 "stayed flat (exit status 1 if not)")
    parser.add_argument("run_dir", help="the run directory (its metrics.jsonl)")
    parser.add_argument("--max-growth-mb", type=float, default=MAX_GROWTH_MB,
                        help="flat: rank 0's resident memory grew by less than this many MiB "
                             "from the first quarter to the last")
    parser.add_argument("--max-slowdown", type=float, default=MAX_SLOWDOWN,
                        help="flat: the last quarter's CPU time per step (wall time for a run "
                             "without it) is below this factor of the first quarter's")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = summarize(args.run_dir, max_growth_mb=args.max_growth_mb,
                            max_slowdown=args.max_slowdown)
    except ValueError as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(args.run_dir, summary))
    return 0 if summary["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
