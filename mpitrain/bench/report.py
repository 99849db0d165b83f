"""The report of ``mpitrain bench``: what it holds, and the files it is written to.

:func:`build_report` turns the measured rows into the report: speedups over
one rank (throughput and time to target), statistical efficiency, each
method's projection beyond the machine (:mod:`mpitrain.bench.projection`),
the stated assumptions, notes on the machine and the papers' figures.
:func:`write_report` writes it into the output directory as ``bench.json``
(everything), ``bench.md`` (summary tables), ``bench-speedup.png`` (speedup
against ranks: measured, projected, ideal, papers) and ``bench-accuracy.png``
(held-out accuracy against frames and seconds).

Example::

    report = build_report(throughput_rows, accuracy_rows, sizes=(1, 2),
                          methods=("model_averaging",), options=BenchOptions(),
                          environment=environment(comm, cfg), config=cfg.to_dict())
    paths = write_report(report, "runs/bench")
    paths["speedup_png"]       # 'runs/bench/bench-speedup.png'
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import numpy as np

from ..files import atomic_open, atomic_path, nearest_existing
from .options import BenchOptions
from .projection import active_ranks_of, assumptions, exchange_kind, project_method

#: Where the papers' numbers come from (plotted and tabulated next to ours).
PAPER_POINTS = ({"source": "Su & Chen 2015 (SWB-300h, model averaging)", "ranks": 16,
                 "speedup": 9.3},
                {"source": "Su & Chen 2015 (SWB-300h, model averaging)", "ranks": 32,
                 "speedup": 17.0})


# -- what the report holds ---------------------------------------------------------------------

def _by(rows, method, ranks):
    for row in rows:
        if row["method"] == method and row["ranks"] == ranks:
            return row
    return None


def build_report(throughput: list, accuracy: list, *, sizes, methods, options: BenchOptions,
                 environment: dict, config: dict) -> dict:
    """Measured speedups, statistical efficiency and projections, per method.

    Example::

        report = build_report(thr_rows, acc_rows, sizes=(1, 2), methods=("bmuf",),
                              options=BenchOptions(), environment={}, config={})
    """
    speedups, projections = [], {}
    network = options.network
    for method in methods:
        base_t, base_a = _by(throughput, method, 1), _by(accuracy, method, 1)
        frames = {}
        for n in sizes:
            thr, acc = _by(throughput, method, n), _by(accuracy, method, n)
            row = {"method": method, "ranks": n, "throughput_speedup": None,
                   "time_to_target_speedup": None, "statistical_efficiency": None,
                   "target_bound": None}
            if thr and thr.get("diverged"):
                row["throughput_diverged"] = True
            elif thr and base_t and not base_t.get("diverged"):
                row["throughput_speedup"] = thr["frames_per_sec"] / base_t["frames_per_sec"]
            if acc and base_a and acc["reached"] and base_a["reached"]:
                # (one rank against itself: exactly 1, bound or not)
                bound = None if acc is base_a else ratio_bound(_upper_bound(base_a),
                                                               _upper_bound(acc))
                row["target_bound"] = bound
                if bound != "undetermined":
                    row["time_to_target_speedup"] = (base_a["seconds_to_target"]
                                                     / acc["seconds_to_target"])
                    row["statistical_efficiency"] = (base_a["frames_to_target"]
                                                     / acc["frames_to_target"])
            if acc and acc["reached"] and not _upper_bound(acc):
                # a crossing before the first evaluation is only bounded: not fitted
                frames[n] = acc["frames_to_target"]
            speedups.append(row)
        if base_t is None or base_t.get("diverged"):
            continue        # (the projection starts from one rank's measured step)
        parallel = (config or {}).get("parallel", {})
        exchange, ranks_per_node = exchange_kind(method, parallel)
        projections[method] = project_method(
            sorted(set(sizes) | set(options.project_to)),
            measured_compute_seconds=base_t["compute_seconds_per_step"],
            num_params=base_t["num_params"], sync_every=base_t["sync_period"],
            frames_to_target=frames, network=network,
            compute_seconds=options.compute_seconds,
            exchange=exchange, ranks_per_node=ranks_per_node,
            active=active_ranks_of(method, parallel))
    return {"format": "mpitrain-bench/1", "sizes": list(sizes), "methods": list(methods),
            "options": options.to_dict(), "environment": environment,
            "network_model": network.to_dict(),
            "assumptions": assumptions(network, options.compute_seconds),
            "notes": _notes(environment, options),
            "throughput": throughput, "accuracy": accuracy, "speedups": speedups,
            "projections": projections, "paper_points": list(PAPER_POINTS), "config": config}


def partial_report(report: dict, *, planned) -> dict:
    """``report`` of the sizes measured so far, marked as one of a benchmark that
    plans ``planned`` sizes (bench.json and bench.md say so until it ends).

    Example::

        partial_report(build_report(...sizes=(1, 2)...), planned=(1, 2, 4))["partial"]
        # {'sizes_measured': [1, 2], 'sizes_planned': [1, 2, 4]}
    """
    return dict(report, partial={"sizes_measured": list(report["sizes"]),
                                 "sizes_planned": list(planned)})


def _upper_bound(acc: dict) -> bool:
    """The target was reached at the first evaluation: frames and seconds there
    are upper bounds (the crossing lies somewhere before it)."""
    return bool(acc.get("reached")) and acc.get("interpolated") is False


def ratio_bound(base_upper: bool, size_upper: bool):
    """What one rank's figure over N ranks' is when either is an upper bound:
    None (exact), "at least" (N's is an upper bound), "at most" (one rank's
    is), or "undetermined" (both are).

    Example::

        ratio_bound(False, True)      # 'at least'
    """
    if base_upper and size_upper:
        return "undetermined"
    return "at most" if base_upper else "at least" if size_upper else None


def _notes(env: dict, options: BenchOptions) -> list:
    notes = [
        "Frames/s: the trainer's progress windows after the first (warm-up), each timed "
        "where the ranks summed it, so the slowest rank's pace counts; per rank = "
        "total / ranks. comm = time inside the communicator, waiting for slower ranks "
        "included; compute = the rest of the step.",
        "Time to target: training seconds (held-out evaluations and checkpoints excluded) "
        "and frames summed over ranks, interpolated linearly between the evaluation before "
        "and the first evaluation at or above the target.",
    ]
    if env.get("virtual"):
        # the machine's load changes the wall time, not the simulated clock
        return notes + ["Virtual ranks: seconds and frames/s are on the simulated clock "
                        "(compute and network models), not measured on this machine."]
    notes.append("Idle ranks sleep while a smaller group runs; every rank keeps the BLAS "
                 "threads it was started with.")
    load = env.get("load_average_at_start")
    if load and load[0] > env.get("cpu_count", 1):
        notes.append(f"Busy machine: load average {load[0]} on {env.get('cpu_count')} cores "
                     "when the benchmark started; other processes slow the runs unevenly.")
    if env.get("oversubscribed"):
        notes.append("Oversubscribed: more ranks than cores on a host; the largest sizes "
                     "share cores and their figures understate what separate cores give.")
    return notes


# -- outputs -----------------------------------------------------------------------------------

#: The report's files in the output directory (the runs are under ``runs/``).
REPORT_FILES = ("bench.json", "bench.md", "bench-speedup.png", "bench-accuracy.png")
#: Names of the benchmark's run directories under ``runs/`` (phases.py, mode.py).
_RUN_NAME = re.compile(r"(throughput|accuracy)-\w+-n\d+(-r\d+)?")


def earlier_bench(out_dir: str) -> list:
    """The outputs of an earlier benchmark found in ``out_dir`` (its report files
    and its run directories under ``runs/``), sorted.

    Example::

        earlier_bench("runs/bench")     # ['runs/bench/bench.json', ..., 'runs/bench/runs/...']
    """
    if not os.path.isdir(out_dir):
        return []
    found = [os.path.join(out_dir, name) for name in REPORT_FILES
             if os.path.lexists(os.path.join(out_dir, name))]
    runs = os.path.join(out_dir, "runs")
    if os.path.isdir(runs):
        found += [os.path.join(runs, name) for name in os.listdir(runs)
                  if _RUN_NAME.fullmatch(name) and os.path.isdir(os.path.join(runs, name))]
    return sorted(found)


def out_dir_problem(out_dir: str, *, overwrite: bool):
    """Why the benchmark cannot write into ``out_dir``, as one line; None when it can.

    An earlier benchmark there (finished or interrupted) is refused unless
    ``overwrite``: its report would be replaced and its runs mixed with the new
    ones.

    Example::

        out_dir_problem("runs/bench", overwrite=False)
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"{out_dir}: --out exists and is not a directory"
    above = nearest_existing(out_dir)
    if not os.path.isdir(above):
        # (found before measuring: a bare "Not a directory" came after the first size)
        return f"{out_dir}: --out cannot be made ({above} is not a directory)"
    if os.path.exists(os.path.join(out_dir, "runs")) and \
            not os.path.isdir(os.path.join(out_dir, "runs")):
        return f"{os.path.join(out_dir, 'runs')}: exists and is not a directory"
    cannot = _cannot_write_in(out_dir)
    if cannot:
        # (found when the first run made its directory, after the checks and the
        # header, as an OS error naming no option)
        return f"{out_dir}: --out cannot be written ({cannot}); choose another --out"
    found = earlier_bench(out_dir)
    if found and not overwrite:
        runs_dir = os.path.join(out_dir, "runs")
        files = [os.path.basename(p) for p in found if os.path.dirname(p) != runs_dir]
        runs = len(found) - len(files)
        what = ", ".join(files + ([f"{runs} run(s) in runs/"] if runs else []))
        return (f"{out_dir}: holds an earlier benchmark ({what}); replace it with "
                "--overwrite, or choose another --out")
    return None


def _cannot_write_in(out_dir: str):
    """Why a file cannot be made in ``out_dir`` (made with its missing parents, if need
    be), as the system says it; None when one can.  A file made and the directories
    made to try are removed again.  (Permission bits alone do not tell: root passes
    them, and a read-only or virtual file system refuses whoever asks.)"""
    made, path = [], os.path.abspath(out_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".bench-probe-")
        os.close(fd)
        os.remove(probe)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for path in made:               # the deepest first
            try:
                os.rmdir(path)
            except OSError:
                pass


def clear_earlier_bench(out_dir: str) -> list:
    """Remove an earlier benchmark's outputs from ``out_dir`` (``--overwrite``);
    the paths removed.  Nothing else there is touched."""
    removed = earlier_bench(out_dir)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return removed

def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"bench.json: cannot store {type(obj).__name__}")


def write_report(report: dict, out_dir: str, *, dpi: int = 100, plots: bool = True) -> dict:
    """Write bench.json, bench.md and (``plots``) the PNG plots into ``out_dir``;
    their paths.

    Example::

        paths = write_report(report, "runs/bench")
        paths["speedup_png"]       # 'runs/bench/bench-speedup.png'
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"),
             "markdown": os.path.join(out_dir, "bench.md"),
             "speedup_png": os.path.join(out_dir, "bench-speedup.png"),
             "accuracy_png": os.path.join(out_dir, "bench-accuracy.png")}
    if not report["accuracy"] or not plots:
        del paths["accuracy_png"]
    if not plots:
        del paths["speedup_png"]
    try:
        import matplotlib  # noqa: F401
    except (ImportError, ValueError) as exc:
        # the measurements are kept whatever happens to the pictures (ValueError: an
        # MPLBACKEND that matplotlib does not know fails its import)
        for key in [k for k in paths if k.endswith("_png")]:
            del paths[key]
        why = "matplotlib is not installed (pip install matplotlib)" \
            if isinstance(exc, ImportError) else f"matplotlib could not start ({exc})"
        report = dict(report, notes=list(report.get("notes", [])) + [
            f"Plots not drawn: {why}."])
    # bench.json first lists only the tables, and again each plot once it is drawn: a
    # benchmark stopped while plotting keeps its measurements, and what bench.json
    # lists is there
    tables = {k: v for k, v in paths.items() if not k.endswith("_png")}
    _write_json(report, paths["json"], tables)
    with atomic_open(paths["markdown"]) as fh:
        fh.write(summary_markdown(report))
    drawn = dict(tables)
    for key, draw in (("speedup_png", plot_speedup), ("accuracy_png", plot_accuracy)):
        if key in paths:
            draw(report, paths[key], dpi=dpi)
            drawn[key] = paths[key]
            _write_json(report, paths["json"], drawn)
    return paths


def _write_json(report: dict, path: str, outputs: dict) -> None:
    with atomic_open(path) as fh:
        json.dump(dict(report, outputs={k: os.path.basename(v) for k, v in outputs.items()}),
                  fh, indent=1, default=_json_default, allow_nan=False)


def _fmt(value, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def seconds_text(seconds) -> str:
    """Seconds with at least three significant digits below 100 s, so the ratios
    of the table can be checked from it (0.2 and 0.1 s would not show 2.10x).

    Example::

        seconds_text(0.19982)     # '0.200'
    """
    if seconds is None:
        return "—"
    digits = 3 if seconds < 1 else 2 if seconds < 10 else 1 if seconds < 100 else 0
    return f"{seconds:.{digits}f}" if seconds >= 0.01 or seconds == 0 else f"{seconds:.2g}"


def _bounded(value, bound) -> str:
    if bound == "undetermined":
        return "— (bounds only)"
    return {"at least": ">= ", "at most": "<= "}.get(bound, "") + _fmt(value, ".2f")


def summary_markdown(report: dict) -> str:
    """The tables of bench.md: measurements, speedups, projection, assumptions.

    Example::

        print(summary_markdown(report))
    """
    env = report["environment"]
    simulated = bool(report.get("virtual"))
    ranks = (f"Up to {env.get('ranks')} virtual ranks simulated in one process (times on the "
             f"simulated clock, not measured) on" if simulated else f"{env.get('ranks')} ranks on")
    lines = [f"# mpitrain bench: {', '.join(report['methods'])}", "",
             f"{ranks} {', '.join(env.get('hosts', []))} "
             f"({env.get('cpu_count')} cores per host"
             f"{', oversubscribed' if env.get('oversubscribed') else ''}), device "
             f"{env.get('device')}; MPI: "
             f"{' '.join((env.get('mpi', {}).get('library_version') or 'none').splitlines()[0].split())}"
             f"; load average at start {env.get('load_average_at_start')}"
             # (a partial report is written before the end)
             + (f", at end {env['load_average_at_end']}"
                if env.get("load_average_at_end") is not None else ""), ""]
    partial = report.get("partial")
    if partial:
        lines += [f"**Partial report**: sizes {', '.join(map(str, partial['sizes_measured']))} "
                  f"measured of {', '.join(map(str, partial['sizes_planned']))}; the benchmark "
                  "had not finished when this was written.", ""]
    # a throughput-only benchmark (no --target-accuracy) has no time-to-target columns
    to_target = bool(report["accuracy"])
    lines += [("## Throughput and time to target" if to_target else "## Throughput")
              + (" (simulated)" if simulated else ""), "",
              "| method | ranks | frames/s | per rank | step ms | comm | throughput speedup |"
              + (" frames to target | s to target | time-to-target speedup | stat. efficiency |"
                 if to_target else ""),
              "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if to_target else "")]
    bounded = False
    for s in report["speedups"]:
        thr = _by(report["throughput"], s["method"], s["ranks"]) or {}
        acc = _by(report["accuracy"], s["method"], s["ranks"]) or {}
        frames = acc.get("frames_to_target")
        secs = acc.get("seconds_to_target")
        if acc and not acc.get("reached"):
            frames_text = secs_text = f"not reached ({acc.get('stopped_by')})"
        else:
            frames_text, secs_text = _fmt(frames, ",.0f"), seconds_text(secs)
            if _upper_bound(acc):
                frames_text, secs_text = f"<= {frames_text}", f"<= {secs_text}"
                bounded = True
        fps_text = "diverged" if thr.get("diverged") else _fmt(thr.get("frames_per_sec"),
                                                                ",.0f")
        lines.append(
            f"| {s['method']} | {s['ranks']} | {fps_text} | "
            f"{_fmt(thr.get('frames_per_sec_per_rank'), ',.0f')} | "
            f"{_fmt(thr.get('step_seconds') and thr['step_seconds'] * 1e3, '.1f')} | "
            f"{_fmt(thr.get('comm_fraction'), '.1%')} | "
            f"{_fmt(s['throughput_speedup'], '.2f')} |"
            + (f" {frames_text} | {secs_text} | "
               f"{_bounded(s['time_to_target_speedup'], s.get('target_bound'))} | "
               f"{_bounded(s['statistical_efficiency'], s.get('target_bound'))} |"
               if to_target else ""))
    if any(r.get("diverged") for r in report["throughput"]):
        lines += ["", "diverged: the throughput run diverged past its roll backs (its "
                      "train.log under runs/ says where); no speed was measured there, "
                      "and the other points went on."]
    if report["accuracy"]:
        lines += ["", f"Target held-out frame accuracy: "
                      f"{report['options']['target_accuracy']}."]
    if bounded:
        lines += ["", "<= : the target was already reached at the first held-out evaluation, "
                      "so the frames and seconds there are upper bounds (the crossing lies "
                      "before it); a ratio built on one is a bound (>= or <=), on two it is "
                      "undetermined (—), and neither is fitted by the projection.  A lower "
                      "target or closer evaluations (--eval-frames) measure it."]
    lines += ["", "## Projection (a model's output, not measured)", ""]
    if report["projections"]:
        first = next(iter(report["projections"].values()))["rows"]
        lines += ["| method | compute ms/step | MB per exchange | sync every | b | "
                  + " | ".join(f"N={r['ranks']}" for r in first) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(first)]
    else:
        lines.append("None: the projection needs the throughput phase.")
    for method, proj in report["projections"].items():
        cells = []
        for r in proj["rows"]:
            tt = r["time_to_target_speedup"]
            cells.append(f"{r['throughput_speedup']:.1f}"
                         + (f" / {tt:.1f}" if tt is not None else "")
                         + _range_text(r.get("time_to_target_range")))
        swap = {"pairwise": " (pairwise)",
                "hierarchical": f" (hierarchical, {proj.get('ranks_per_node')} per node)"
                }.get(proj.get("exchange"), "")
        lines.append(f"| {method} | {proj['compute_seconds_per_step'] * 1e3:.1f} | "
                     f"{proj['bytes_per_allreduce'] / 1e6:.2f}{swap} | "
                     f"{proj['sync_every_steps']} | "
                     f"{_fmt(proj['frames_exponent'], '.2f')}"
                     f"{_range_text(proj.get('frames_exponent_range'), '.2f')} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Cells: projected throughput speedup / projected time-to-target speedup "
                  "(in brackets: its range over refits of b leaving out one measured size; "
                  "none with fewer than two sizes above 1).  Only the measured table above "
                  "compares with the papers' measured figures.", "",
              "Papers (measured): " + "; ".join(f"{p['source']}: {p['speedup']}x on {p['ranks']} GPUs"
                                     for p in report["paper_points"]) + ".",
              ""]
    lines += _virtual_markdown(report)
    lines += ["## Assumptions of the projection", ""]
    lines += [f"- {a}" for a in report["assumptions"]]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


def _range_text(span, spec: str = ".1f") -> str:
    return "" if not span else f" ({span[0]:{spec}}-{span[1]:{spec}})"


def projection_lines(report: dict) -> list:
    """One console line per method: the projection at the largest size, labelled.

    Example::

        print("\n".join(projection_lines(report)))
    """
    lines = []
    for method, proj in report["projections"].items():
        r = proj["rows"][-1]
        tt = r["time_to_target_speedup"]
        text = (f"projected (not measured), {method} at N={r['ranks']}: throughput "
                f"{r['throughput_speedup']:.1f}x")
        if tt is not None:
            text += (f", time to target {tt:.1f}x{_range_text(r.get('time_to_target_range'))}"
                     f" from b={proj['frames_exponent']:.2f} fitted on sizes "
                     f"{','.join(str(n) for n in proj.get('fitted_sizes', []))}")
        lines.append(text)
    return lines


def _virtual_markdown(report: dict) -> list:
    """The simulated points' assumptions and, per point, frames per rank and syncs."""
    virtual = report.get("virtual")
    if not virtual:
        return []
    lines = ["## Simulated points (virtual ranks)", "",
             "Every row above is simulated (`\"simulated\": true` in bench.json).", ""]
    lines += [f"- {a}" for a in virtual["assumptions"]]
    lines += ["", "| phase | method | ranks | steps | frames per rank | syncs | "
                  "simulated s |", "|---|---|---:|---:|---:|---:|---:|"]
    for phase, rows in (("throughput", report["throughput"]), ("accuracy", report["accuracy"])):
        for r in rows:
            seconds = r.get("measured_seconds") if phase == "throughput" \
                else r.get("training_seconds")
            lines.append(f"| {phase} | {r['method']} | {r['ranks']} | {r.get('steps', '—')} | "
                         f"{_fmt(r.get('frames_per_rank'), ',.0f')} | {r.get('syncs', '—')} | "
                         f"{_fmt(seconds, '.3f')} |")
    # (a throughput row's frames per rank over its seconds is not its rate: the
    # warm-up is in one and not the other)
    lines += ["", "Syncs: model averages (gradient allreduces for `allreduce`) each rank took "
                  "part in.  Steps, frames per rank and syncs are the whole run's, a "
                  "throughput run's warm-up included; simulated s: a throughput run's "
                  "measured windows after warm-up, an accuracy run's training seconds to its "
                  "last evaluation.", ""]
    return lines


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedup(report: dict, path: str, *, dpi: int = 100) -> None:
    """Speedup against ranks: measured points, projected lines, the ideal line, and
    the projection's assumptions printed beside.

    Example::

        plot_speedup(report, "runs/bench/bench-speedup.png")
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    methods = report["methods"]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    all_ranks = sorted({r["ranks"] for p in report["projections"].values() for r in p["rows"]}
                       | set(report["sizes"]))
    for ax, key, title in ((axes[0], "throughput_speedup", "throughput (frames/s)"),
                           (axes[1], "time_to_target_speedup", "time to target accuracy")):
        ax.plot(all_ranks, all_ranks, color="0.6", lw=1, ls=":", label="ideal")
        bound_labelled = False
        for method in methods:
            proj = report["projections"].get(method)
            if proj:
                pts = [(r["ranks"], r[key]) for r in proj["rows"] if r[key] is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colors[method], ls="--", lw=1.2)
            rows = [s for s in report["speedups"] if s["method"] == method and s[key] is not None]
            # a ratio that is only a bound (target at the first evaluation) is no point
            # of the curve: an open triangle pointing where the true value lies
            exact = key == "throughput_speedup"
            meas = [(s["ranks"], s[key]) for s in rows if exact or not s.get("target_bound")]
            if meas:
                kind = "simulated" if report.get("virtual") else "measured"
                ax.plot(*zip(*meas), color=colors[method], marker="o", lw=2,
                        label=f"{method} ({kind}; dashed: projected)")
            if exact:
                # a diverged point has no speed: an x on the axis at its ranks
                gone = [s["ranks"] for s in report["speedups"]
                        if s["method"] == method and s.get("throughput_diverged")]
                if gone:
                    ax.plot(gone, [0.03] * len(gone), ls="none", marker="x", ms=8,
                            color=colors[method], transform=ax.get_xaxis_transform(),
                            clip_on=False, label=f"{method}: diverged")
            for s in rows if not exact else ():
                if s.get("target_bound") in ("at least", "at most"):
                    ax.plot([s["ranks"]], [s[key]], ls="none", mfc="none", ms=8,
                            color=colors[method],
                            marker="^" if s["target_bound"] == "at least" else "v",
                            label=None if bound_labelled else
                            "bound: target at the first evaluation (^ at least, v at most)")
                    bound_labelled = True
        if key == "time_to_target_speedup":
            ax.plot([p["ranks"] for p in report["paper_points"]],
                    [p["speedup"] for p in report["paper_points"]], "k*", ms=10,
                    label="Su & Chen 2015, 16/32 GPUs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel("speedup over one rank")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    text = "Projection model:\n" + "\n".join(
        _wrap(a, 150) for a in report["assumptions"])
    fig.text(0.01, 0.01, text, fontsize=6.5, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)


def _wrap(text: str, width: int) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(text, width, initial_indent="- ", subsequent_indent="  "))


def _thousands():
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda x, _: f"{x / 1e6:g}M" if abs(x) >= 1e6 else
                         f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}")


def plot_accuracy(report: dict, path: str, *, dpi: int = 100) -> None:
    """Held-out accuracy against frames and against training seconds, one row per
    method, one line per group size, the target as a dashed line.

    Example::

        plot_accuracy(report, "runs/bench/bench-accuracy.png")
    """
    plt = _pyplot()
    methods = [m for m in report["methods"] if any(a["method"] == m for a in report["accuracy"])]
    fig, axes = plt.subplots(len(methods), 2, figsize=(10, 2.6 * len(methods) + 0.4),
                             squeeze=False)
    target = report["options"]["target_accuracy"]
    for row, method in zip(axes, methods):
        for i, acc in enumerate(a for a in report["accuracy"] if a["method"] == method):
            pts = acc["points"]
            for ax, key in ((row[0], "frames"), (row[1], "seconds")):
                ax.plot([p[key] for p in pts], [p["dev_acc"] for p in pts], marker=".",
                        color=f"C{i}", label=f"{acc['ranks']} rank(s)")
        row[0].xaxis.set_major_formatter(_thousands())
        for ax, label in ((row[0], "frames (all ranks)"), (row[1], "training seconds")):
            ax.axhline(target, color="0.5", ls="--", lw=1)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out frame acc.")
            ax.set_title(method, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
