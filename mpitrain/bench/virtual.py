"""Benchmark mode on virtual ranks (``python -m mpitrain bench CONFIG --virtual 1,2,...,128``).

For each size N a :class:`~mpitrain.comm.virtual.VirtualCluster` of N ranks
runs the same two phases as the real-rank mode (:mod:`mpitrain.bench.phases`,
the trainer itself on every rank), on the simulated clock: each step costs the
compute model's time (:class:`~mpitrain.train.virtual.ComputeModel`: given as
``--compute-ms`` or measured once here), each collective its cost on the
network model.  The report is the real-rank mode's
(:func:`mpitrain.bench.report.build_report`): every measured row carries
``"simulated": true``, the frames each rank trained on and the number of
synchronisations (averages, or gradient allreduces for ``allreduce``), and
``report["virtual"]`` states the compute and network assumptions.

Example::

    report = run_virtual_bench(cfg, out_dir="runs/vbench",
                               options=BenchOptions(sizes=(1, 2, 4, 8)),
                               compute=ComputeModel(step_seconds=0.002))
    write_report(report, "runs/vbench")
"""

from __future__ import annotations

import os
import sys
import time

from ..comm.single import SingleCommunicator
from ..comm.virtual import VirtualCluster
from ..words import plural
from .machine import environment, load_average
from .mode import _accuracy_line, _throughput_line
from .options import BenchOptions
from .phases import (check_bench, steps_per_epoch_one_rank, sync_period, throughput_phase,
                     time_to_accuracy)
from .report import build_report, partial_report


def _syncs(steps: int, period: int) -> int:
    # one per full block, and the finalize's one for a last short block
    return -(-int(steps) // max(1, int(period)))


def assumptions(options: BenchOptions, compute) -> list:
    """What the simulated points assume, as sentences for the report.

    Example::

        assumptions(BenchOptions(), ComputeModel(step_seconds=0.002))
    """
    return [
        "Virtual ranks: N ranks in one process run the trainer's own code; times are "
        "simulated, not measured.",
        f"Compute: {compute.describe()} for every step a rank trains ("
        + ("given with --compute-ms" if options.compute_seconds else
           "measured once on this machine for the model") + ").",
        f"Network: {options.network.describe()}; broadcasts, gathers and point-to-point "
        "messages priced by the same links (comm/netmodel.py).",
        "At each collective every rank waits for the last to arrive; nothing overlaps "
        "computing with communicating; held-out evaluation and checkpoints take no time.",
    ]


def _report(throughput, accuracy, sizes, methods, options, env, cfg, compute) -> dict:
    report = build_report(throughput, accuracy, sizes=sizes, methods=methods, options=options,
                          environment=env, config=cfg.to_dict())
    report["virtual"] = {"compute": compute.to_dict(), "network": options.network.to_dict(),
                         "assumptions": assumptions(options, compute)}
    return report


def run_virtual_bench(cfg, *, out_dir: str, options: BenchOptions, compute,
                      stream=None, on_size_done=None) -> dict:
    """Every size of ``options.sizes`` and every method on virtual ranks; the report.
    ``on_size_done`` is given the report of the sizes measured so far after each
    size but the last (:func:`~mpitrain.bench.report.partial_report`).

    Example::

        report = run_virtual_bench(cfg, out_dir="runs/vbench",
                                   options=BenchOptions(sizes=(1, 2, 4)),
                                   compute=ComputeModel(step_seconds=0.002))
    """
    from threadpoolctl import threadpool_limits
    out = stream or sys.stdout
    sizes = tuple(sorted(set(options.sizes))) or (1,)
    _, methods = options.resolve(max(sizes))
    check_bench(cfg, options, sizes, methods)
    env = environment(SingleCommunicator(), cfg)
    env.update(ranks=max(sizes), virtual=True, oversubscribed=False)
    print(f"bench (virtual ranks): sizes {', '.join(map(str, sizes))}; methods "
          f"{', '.join(methods)}; compute {compute.describe()}; "
          f"{options.network.describe()}", file=out, flush=True)
    if "accuracy" in options.phases and options.target_accuracy is None:
        print("no --target-accuracy given: skipping the time-to-accuracy phase", file=out)
    throughput, accuracy = [], []
    steps_1 = steps_per_epoch_one_rank(cfg) if options.measures_accuracy else None
    started = time.perf_counter()
    for size in sizes:
        def rank_main(comm):
            rows, acc = [], []
            sync = {}
            if "throughput" in options.phases:
                rows = throughput_phase(cfg, comm, methods=methods, options=options,
                                        out_dir=out_dir, compute=compute)
                sync = {row["method"]: row["sync_period"] for row in rows}
            if options.measures_accuracy:
                for method in methods:
                    if method not in sync:
                        sync[method] = sync_period(cfg, comm, method)
                    acc.append(time_to_accuracy(
                        cfg, comm, method=method, options=options, sync_period=sync[method],
                        steps_per_epoch_1=steps_1, compute=compute,
                        run_dir=os.path.join(out_dir, "runs", f"accuracy-{method}-n{size}")))
            return rows, acc, sync

        size_started = time.perf_counter()
        with threadpool_limits(cfg.blas_threads or 1):
            rows, acc, sync = VirtualCluster(size, network=options.network).run(rank_main)[0]
        wall = time.perf_counter() - size_started
        steps = options.warmup_steps + options.throughput_steps
        for row in rows:
            done = row.get("steps", steps)      # (fewer when it diverged)
            row.update(simulated=True, size_wall_seconds=wall, steps=done,
                       frames_per_rank=done * row["minibatch"],
                       syncs=_syncs(done, row["sync_period"]) if size > 1 else 0)
            throughput.append(row)
            print(_throughput_line(row) + f", {plural(row['syncs'], 'sync')} (simulated)", file=out,
                  flush=True)
        for row in acc:
            row.update(simulated=True, size_wall_seconds=wall, frames_per_rank=row["frames"] / size,
                       syncs=_syncs(row["steps"], sync[row["method"]]) if size > 1 else 0)
            accuracy.append(row)
            print(_accuracy_line(row) + " (simulated)", file=out, flush=True)
        if on_size_done is not None and size != sizes[-1]:
            done = sizes[:sizes.index(size) + 1]
            on_size_done(partial_report(_report(list(throughput), list(accuracy), done,
                                                methods, options, env, cfg, compute),
                                        planned=sizes))
    report = _report(throughput, accuracy, sizes, methods, options, env, cfg, compute)
    report["wall_seconds"] = time.perf_counter() - started
    report["environment"]["load_average_at_end"] = load_average()
    return report
