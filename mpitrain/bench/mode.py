"""Benchmark mode (``python -m mpitrain bench``): speedup curves per parallel method.

This module runs the benchmark: for each group size N in turn the world is
split into one group of N ranks (the others sleep, :mod:`mpitrain.bench.idle`,
and all rejoin before the next size).  The group runs the trainer itself,
once per method from the strategy registry
(:data:`mpitrain.parallel.registry.METHODS`), in the two phases of
:mod:`mpitrain.bench.phases` (throughput, then time to accuracy), and rank 0
prints a line per measurement.  Rank 0 then assembles the report
(:func:`mpitrain.bench.report.build_report`: speedups and the projection of
:mod:`mpitrain.bench.projection`) with the machine it ran on
(:func:`mpitrain.bench.machine.environment`); the caller writes it with
:func:`mpitrain.bench.report.write_report`.  What to measure is a
:class:`~mpitrain.bench.options.BenchOptions`.

Example::

    report = run_bench(cfg, comm, out_dir="runs/bench",
                       options=BenchOptions(sizes=(1, 2), target_accuracy=0.3))
    if comm.rank == 0:
        write_report(report, "runs/bench")
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

from .idle import release_idle, wait_idle
from .machine import environment, load_average
from .options import BenchOptions
from .phases import (check_bench, steps_per_epoch_one_rank, sync_period, throughput_phase,
                     time_to_accuracy)
from .report import build_report, partial_report, seconds_text

#: Seconds between an idle rank's polls: a group runs for seconds, so a coarse
#: poll delays nothing that is timed and costs the measured ranks less.
IDLE_POLL_SECONDS = 0.01


def _say(world, stream, text: str) -> None:
    if world.rank == 0:
        print(text, file=stream or sys.stdout, flush=True)


def run_bench(cfg, world, *, out_dir: str, options: BenchOptions, stream=None,
              on_size_done: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
    """Run every size and method; collective over ``world``.  The report on rank 0,
    None on the other ranks.  ``on_size_done`` (rank 0) is given the report of
    the sizes measured so far after each size (:func:`partial_report`), so that
    a benchmark stopped halfway keeps them.

    Example::

        report = run_bench(load_config("jobs/configs/bench.yaml"), comm, out_dir="runs/bench",
                           options=BenchOptions(target_accuracy=0.5))
    """
    sizes, methods = options.resolve(world.size)
    check_bench(cfg, options, sizes, methods)
    env = environment(world, cfg)
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
            wait_idle(world, poll_seconds=IDLE_POLL_SECONDS)
        else:
            try:
                sync = {}
                if "throughput" in options.phases:
                    rows = throughput_phase(cfg, group, methods=methods, options=options,
                                            out_dir=out_dir)
                    sync = {row["method"]: row["sync_period"] for row in rows}
                    if world.rank == 0:
                        throughput += rows
                        for row in rows:
                            _say(world, stream, _throughput_line(row))
                if options.measures_accuracy:
                    if steps_per_epoch_1 is None:
                        steps_per_epoch_1 = steps_per_epoch_one_rank(cfg)
                    for method in methods:
                        if method not in sync:
                            sync[method] = sync_period(cfg, group, method)
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
                release_idle(world, range(size, world.size))
        world.barrier()
        if world.rank == 0 and on_size_done is not None and size != sizes[-1]:
            done = sizes[:sizes.index(size) + 1]
            on_size_done(partial_report(
                build_report(list(throughput), list(accuracy), sizes=done, methods=methods,
                             options=options, environment=env, config=cfg.to_dict()),
                planned=sizes))
    if world.rank != 0:
        return None
    report = build_report(throughput, accuracy, sizes=sizes, methods=methods, options=options,
                          environment=env, config=cfg.to_dict())
    report["wall_seconds"] = time.perf_counter() - started
    report["environment"]["load_average_at_end"] = load_average()
    return report


def _throughput_line(row: dict) -> str:
    if row.get("diverged"):
        return (f"  n={row['ranks']} {row['method']:<16} throughput not measured: diverged "
                f"after {row.get('steps')} steps ({row['diverged']})")
    return (f"  n={row['ranks']} {row['method']:<16} throughput {row['frames_per_sec']:>10,.0f} "
            f"fr/s ({row['frames_per_sec_per_rank']:,.0f} per rank), step "
            f"{row['step_seconds'] * 1e3:.1f} ms, comm {row['comm_fraction']:.1%}")


def _accuracy_line(row: dict) -> str:
    if not row["reached"]:
        final = row["final_dev_acc"]
        final = "none" if final is None else f"{final:.4f}"      # (None: it diverged)
        return (f"  n={row['ranks']} {row['method']:<16} target {row['target_accuracy']} not "
                f"reached (stopped by {row['stopped_by']}; final acc {final})")
    if row.get("interpolated") is False:
        return (f"  n={row['ranks']} {row['method']:<16} target {row['target_accuracy']} "
                f"already at the first evaluation: <= {row['frames_to_target']:,.0f} frames, "
                f"<= {seconds_text(row['seconds_to_target'])} s (upper bounds)")
    return (f"  n={row['ranks']} {row['method']:<16} target {row['target_accuracy']} after "
            f"{row['frames_to_target']:,.0f} frames, {seconds_text(row['seconds_to_target'])} s")
