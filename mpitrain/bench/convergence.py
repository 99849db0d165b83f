"""Convergence of SGD and NG-SGD: learning-rate sweep, then model averaging on many ranks.

For each optimizer, a few initial learning rates (final = initial / 10) are
trained on one rank; the rate with the best final held-out frame accuracy is
then trained with model averaging on more ranks.  Every run is a subprocess
of ``python -m mpitrain train`` (under the MPI launcher for more than one
rank) with its run directory under ``--out``; finished runs are reused unless
``--rerun`` is given.  Written into ``--out``: ``summary.json``,
``summary.md`` (a Markdown table), ``best.png`` (held-out curves of the best
rate of each optimizer on each rank count) and ``sweep.png``.  With
``--lr-factors 1,4`` the runs on more ranks also try each best rate times 4
(model averaging over N ranks may want a larger rate, as Kaldi's jobs get N
times theirs); ``lr-factors.png`` then shows them.

Usage::

    python -m mpitrain synth bench-out/synth
    python -m mpitrain.bench.convergence --corpus bench-out/synth --out bench-out/convergence \
        [--ranks 1,4] [--lrs 0.002,0.004,0.008] [--epochs 2] [--lr-factors 1,4]

Example::

    spec = RunSpec(optimizer="ngsgd", lr=0.004, ranks=1)
    row = summarize_run(f"bench-out/convergence/{spec.name}", spec, targets=(0.7,))
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..files import atomic_open
from ..plotting import plot_runs, read_metrics
from ..starter import example_configs
from ..words import DefaultsFormatter

#: The directory that holds this mpitrain package (the source tree's root, or
#: site-packages), put on the runs' PYTHONPATH.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: The example configuration the runs start from, unless --config names another.
BASE_EXAMPLE = "quickstart"
OPTIMIZERS = ("sgd", "ngsgd")
OPTIMIZER_NAMES = {"sgd": "SGD", "ngsgd": "NG-SGD"}


@dataclass(frozen=True)
class RunSpec:
    """One training run of the benchmark.

    Example::

        RunSpec(optimizer="sgd", lr=0.004, ranks=4).name    # 'sgd-lr0.004-4r'
    """

    optimizer: str
    lr: float
    ranks: int

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"RunSpec: optimizer: expected one of {OPTIMIZERS}, "
                             f"got {self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"RunSpec: lr: expected a positive rate, got {self.lr}")
        if self.ranks < 1:
            raise ValueError(f"RunSpec: ranks: expected at least 1, got {self.ranks}")

    @property
    def name(self) -> str:
        return f"{self.optimizer}-lr{self.lr:g}-{self.ranks}r"


def frames_to_reach(evals: Sequence[dict], target: float) -> Optional[float]:
    """Frames seen when held-out accuracy first reaches ``target``, or None.

    Linear interpolation between the two evaluations around the crossing
    (the evaluations are a few tens of thousands of frames apart).

    Example::

        frames_to_reach([{"frames": 0, "dev_acc": 0.1}, {"frames": 100, "dev_acc": 0.5}], 0.3)
        # 50.0
    """
    prev_frames, prev_acc = 0.0, None
    for record in evals:
        frames, acc = float(record["frames"]), float(record["dev_acc"])
        if acc >= target:
            if prev_acc is None or acc == prev_acc:
                return frames
            return prev_frames + (target - prev_acc) / (acc - prev_acc) * (frames - prev_frames)
        prev_frames, prev_acc = frames, acc
    return None


def summarize_run(run_dir, spec: RunSpec, *, targets: Sequence[float],
                  wall_seconds: Optional[float] = None) -> dict:
    """One summary row from a finished run directory.

    Example::

        row = summarize_run("bench-out/convergence/sgd-lr0.004-1r",
                            RunSpec("sgd", 0.004, 1), targets=(0.6, 0.7))
        row["final_dev_acc"], row["frames_to_acc"]["0.7"]
    """
    records = read_metrics(run_dir)
    if not records["end"]:
        raise ValueError(f"{run_dir}/metrics.jsonl: no 'end' record: the run did not finish")
    end, evals = records["end"][-1], records["eval"]
    train = records["train"]
    return {
        "name": spec.name, "optimizer": spec.optimizer, "lr": spec.lr,
        "final_lr": spec.lr / 10, "ranks": spec.ranks,
        "final_dev_acc": end.get("dev_acc"), "final_dev_xent": end.get("dev_xent"),
        "frames": end.get("frames"), "steps": end.get("steps"),
        "train_seconds": end.get("seconds"), "wall_seconds": wall_seconds,
        "frames_per_sec": (end["frames"] / end["seconds"]) if end.get("seconds") else None,
        "final_train_acc": train[-1].get("acc") if train else None,
        "frames_to_acc": {f"{a:g}": frames_to_reach(evals, a) for a in targets},
        "evals": [{"frames": e["frames"], "dev_acc": e["dev_acc"],
                   "dev_xent": e["dev_xent"], "time": e["time"]} for e in evals],
    }


class RunFailed(RuntimeError):
    """A training run of the study could not be started or did not finish."""


def _launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    from ..testing.mpirun import find_mpiexec
    launcher = find_mpiexec()
    if launcher is None:
        raise RunFailed("no MPI launcher for the multi-rank runs: set $MPIEXEC or "
                           "`pip install mpich` into the environment")
    # (not the locale's decoding: a launcher's banner may hold a byte it cannot read)
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             encoding="utf-8", errors="replace")
    # Open MPI refuses more ranks than cores without this; MPICH needs nothing.
    extra = ["--oversubscribe"] if "Open MPI" in version.stdout + version.stderr else []
    return [launcher, *extra, "-n", str(ranks), sys.executable]


def train_command(spec: RunSpec, run_dir: str, *, config: str, **options) -> list[str]:
    """The ``mpitrain train`` command line of one run.

    Example::

        cmd = train_command(RunSpec("sgd", 0.004, 1), "out/sgd", config="q.yaml",
                            corpus="data/synth", epochs=2, eval_frames=51200,
                            average_every=8)
    """
    # a run that is started again replaces what an unfinished one left there
    command = _launcher(spec.ranks) + ["-m", "mpitrain", "train", config, "--run-dir", run_dir,
                                       "--overwrite"]
    for key, value in train_settings(spec, **options).items():
        command += ["--set", f"{key}={value}"]
    return command


def train_settings(spec: RunSpec, *, corpus: str, epochs: float, eval_frames: int,
                   average_every: int) -> dict:
    """The ``--set`` values of one run, by key."""
    return {
        "data.train": os.path.join(corpus, "train"),
        "data.dev": os.path.join(corpus, "dev"),
        "optimizer.name": spec.optimizer,
        "optimizer.initial_learning_rate": f"{spec.lr:g}",
        "optimizer.final_learning_rate": f"{spec.lr / 10:g}",
        "training.epochs": f"{epochs:g}",
        # eval_interval counts frames per rank: the same total frames between points
        "training.eval_interval": str(max(1, eval_frames // spec.ranks)),
        "training.checkpoint_interval": "0",
        "parallel.method": "model_averaging",
        "parallel.average_every": str(average_every),
        "blas_threads": "1",
    }


def check_runs(specs: Sequence[RunSpec], *, config: str, **options) -> None:
    """Refuse, before the first run trains, a config one of ``specs`` cannot take (an
    L2 within its bound at the config's rate but not at a swept one): RunFailed
    naming the run, the config file and the key."""
    from ..config import ConfigError, load_config
    for spec in specs:
        sets = [f"{k}={v}" for k, v in train_settings(spec, **options).items()]
        try:
            load_config(config, sets)
        except ConfigError as exc:
            raise RunFailed(f"{spec.name}: {exc}") from None


def _child_env() -> dict:
    env = dict(os.environ)
    # Ranks share the cores: one BLAS thread each, for every run alike.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _finished(run_dir: str) -> bool:
    try:
        return bool(read_metrics(run_dir)["end"])
    except (FileNotFoundError, ValueError):
        return False


def run_one(spec: RunSpec, out_dir: str, *, rerun: bool, targets: Sequence[float],
            **options) -> dict:
    """Train one run (or reuse a finished one) and return its summary row.

    Example::

        row = run_one(RunSpec("sgd", 0.004, 1), "bench-out/convergence", rerun=False,
                      targets=(0.7,), config="jobs/configs/quickstart.yaml",
                      corpus="bench-out/synth", epochs=2, eval_frames=51200,
                      average_every=8)
    """
    run_dir = os.path.join(out_dir, spec.name)
    wall_file = os.path.join(run_dir, "wall_seconds.txt")
    if not rerun and _finished(run_dir):
        print(f"[convergence] {spec.name}: finished before, reusing {run_dir}", flush=True)
        wall = (float(Path(wall_file).read_text(encoding="utf-8"))
                if os.path.exists(wall_file) else None)
        return summarize_run(run_dir, spec, targets=targets, wall_seconds=wall)
    os.makedirs(run_dir, exist_ok=True)
    command = train_command(spec, run_dir, **options)
    print(f"[convergence] {spec.name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(os.path.join(run_dir, "train.log"), "w", encoding="utf-8") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env()).returncode
    wall = time.perf_counter() - start
    if status != 0:
        raise RunFailed(f"{spec.name}: `mpitrain train` exited with status {status}; "
                           f"see {run_dir}/train.log")
    with atomic_open(wall_file) as fh:
        fh.write(f"{wall:.1f}\n")
    row = summarize_run(run_dir, spec, targets=targets, wall_seconds=wall)
    print(f"[convergence] {spec.name}: dev acc {row['final_dev_acc']:.4f} "
          f"xent {row['final_dev_xent']:.4f} in {wall:.0f} s", flush=True)
    return row


def best_rates(rows: Sequence[dict], *, ranks: int) -> dict:
    """Each optimizer's initial rate with the highest final held-out accuracy.

    Example::

        best_rates([{"optimizer": "sgd", "lr": 0.004, "ranks": 1, "final_dev_acc": 0.8}],
                   ranks=1)                          # {'sgd': 0.004}
    """
    best = {}
    for row in rows:
        if row["ranks"] != ranks:
            continue
        current = best.get(row["optimizer"])
        if current is None or row["final_dev_acc"] > current["final_dev_acc"]:
            best[row["optimizer"]] = row
    return {name: row["lr"] for name, row in best.items()}


def _fmt_frames(value: Optional[float], first_eval: Optional[float]) -> str:
    if value is None:
        return "not reached"
    # reached by the first evaluation: only an upper bound is known
    return f"{'<= ' if value == first_eval else ''}{value / 1e3:,.0f}k"


def markdown_table(rows: Sequence[dict], targets: Sequence[float]) -> str:
    """A Markdown table of the runs (one line each, best rates marked with *).

    A target already reached at the first evaluation shows as ``<= frames``.

    Example::

        print(markdown_table(summary["runs"], summary["targets"]))
    """
    head = ["optimizer", "ranks", "initial lr", "final dev acc", "final dev xent",
            *[f"frames to acc {a:g}" for a in targets], "frames/s", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        mark = " *" if row.get("best") else ""
        first = row["evals"][0]["frames"] if row.get("evals") else None
        cells = [OPTIMIZER_NAMES[row["optimizer"]], str(row["ranks"]), f"{row['lr']:g}{mark}",
                 f"{row['final_dev_acc']:.4f}", f"{row['final_dev_xent']:.4f}",
                 *[_fmt_frames(row["frames_to_acc"][f"{a:g}"], first) for a in targets],
                 f"{row['frames_per_sec']:,.0f}" if row["frames_per_sec"] else "-",
                 f"{row['wall_seconds']:.0f}" if row["wall_seconds"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot_rows(out_dir: str, png: str, rows: Sequence[dict], *, title: str) -> None:
    rows = sorted(rows, key=lambda r: (r["ranks"], OPTIMIZERS.index(r["optimizer"]), r["lr"]))
    plot_runs([os.path.join(out_dir, r["name"]) for r in rows], os.path.join(out_dir, png),
              train=False, title=title,
              labels=[f"{OPTIMIZER_NAMES[r['optimizer']]} lr {r['lr']:g}, {r['ranks']} rank"
                      f"{'s' if r['ranks'] > 1 else ''}" for r in rows])


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _positive_floats(text: str) -> list[float]:
    values = _floats(text)
    if not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, "
                                         f"got {text!r}")
    return values


def _positive_int(text: str) -> int:
    # (0 or less would evaluate at every step: max(1, frames // ranks))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) or v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(v) for v in values]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpitrain.bench.convergence",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsFormatter)
    p.add_argument("--corpus", required=True, help="output of `mpitrain synth` (train/ and dev/)")
    p.add_argument("--out", required=True, help="directory for run directories and summaries")
    p.add_argument("--config", default=None,
                   help=f"base config (default: the {BASE_EXAMPLE} example shipped with "
                        "mpitrain, jobs/configs/quickstart.yaml)")
    p.add_argument("--ranks", type=_ints, default=[1, 4],
                   help="rank counts: the first runs the sweep, the others the best rates")
    p.add_argument("--lrs", type=_positive_floats, default=[0.002, 0.004, 0.008],
                   help="initial learning rates swept for SGD (final = initial / 10)")
    p.add_argument("--ngsgd-lrs", type=_positive_floats, default=None,
                   help="initial learning rates swept for NG-SGD (default: --lrs)")
    p.add_argument("--epochs", type=float, default=2.0,
                   help="training.epochs of every run")
    p.add_argument("--eval-frames", type=_positive_int, default=51200,
                   help="frames (all ranks) between held-out evaluations")
    p.add_argument("--lr-factors", type=_positive_floats, default=[1.0],
                   help="on more ranks, train each best rate times each of these factors")
    p.add_argument("--average-every", type=int, default=8,
                   help="minibatches between model averages on many ranks")
    p.add_argument("--targets", type=_floats, default=[0.6, 0.7, 0.75, 0.8],
                   help="held-out accuracies for 'frames to reach'")
    p.add_argument("--rerun", action="store_true", help="train again even if a run finished")
    return p


def base_config(given: Optional[str] = None) -> str:
    """The config the runs start from: ``given`` (--config), else the example shipped
    in the package (an installed mpitrain has no jobs/ beside it)."""
    return given or str(example_configs()[BASE_EXAMPLE])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    config = base_config(args.config)
    for split in ("train", "dev"):
        if not os.path.isdir(os.path.join(args.corpus, split)):
            print(f"convergence: --corpus {args.corpus}: no {split}/ corpus "
                  "(write one with `python -m mpitrain synth DIR`)", file=sys.stderr)
            return 2
    options = dict(config=config, corpus=args.corpus, epochs=args.epochs,
                   eval_frames=args.eval_frames, average_every=args.average_every)
    sweep_lrs = {"sgd": args.lrs, "ngsgd": args.ngsgd_lrs or args.lrs}
    sweep_ranks, more_ranks = args.ranks[0], args.ranks[1:]
    started = time.perf_counter()
    try:
        # every run the study may train: the sweep, and each swept rate (the best is
        # one) times each factor on more ranks
        check_runs([RunSpec(name, lr, sweep_ranks) for name in OPTIMIZERS
                    for lr in sweep_lrs[name]]
                   + [RunSpec(name, lr * factor, ranks) for ranks in more_ranks
                      for name in OPTIMIZERS for lr in sweep_lrs[name]
                      for factor in args.lr_factors], **options)
        rows = [run_one(RunSpec(name, lr, sweep_ranks), args.out, rerun=args.rerun,
                        targets=args.targets, **options)
                for name in OPTIMIZERS for lr in sweep_lrs[name]]
        best = best_rates(rows, ranks=sweep_ranks)
        for ranks in more_ranks:
            rows += [run_one(RunSpec(name, best[name] * factor, ranks), args.out,
                             rerun=args.rerun, targets=args.targets, **options)
                     for name in OPTIMIZERS for factor in args.lr_factors]
    except RunFailed as exc:
        # (the runs that finished are kept: --rerun is off, so a new start reuses them)
        print(f"convergence: error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        row["best"] = row["lr"] == best[row["optimizer"]]
        row["lr_factor"] = row["lr"] / best[row["optimizer"]]
    summary = {"corpus": args.corpus, "config": os.path.relpath(config), "epochs": args.epochs,
               "average_every": args.average_every, "eval_frames": args.eval_frames,
               "sweep_ranks": sweep_ranks, "best_lr": best, "lr_factors": args.lr_factors,
               "targets": args.targets,
               "total_wall_seconds": time.perf_counter() - started,
               # reused runs count here with the time they took when trained
               "runs_wall_seconds": sum(r["wall_seconds"] or 0.0 for r in rows), "runs": rows}
    os.makedirs(args.out, exist_ok=True)
    with atomic_open(os.path.join(args.out, "summary.json")) as fh:
        json.dump(summary, fh, indent=2)
    table = markdown_table(rows, args.targets)
    with atomic_open(os.path.join(args.out, "summary.md")) as fh:
        fh.write(table)
    pngs = ["best.png", "sweep.png"]
    _plot_rows(args.out, "best.png", [r for r in rows if r["best"]],
               title="best rate of each optimizer")
    if len(args.lr_factors) > 1:
        pngs.append("lr-factors.png")
        _plot_rows(args.out, "lr-factors.png",
                   [r for r in rows if r["best"] or r["ranks"] != sweep_ranks],
                   title="best rates, and scaled rates on more ranks")
    sweep_rows = [r for r in rows if r["ranks"] == sweep_ranks]
    plot_runs([os.path.join(args.out, r["name"]) for r in sweep_rows],
              os.path.join(args.out, "sweep.png"), train=False,
              labels=[f"{OPTIMIZER_NAMES[r['optimizer']]} lr {r['lr']:g}" for r in sweep_rows],
              title=f"learning-rate sweep, {sweep_ranks} rank{'s' if sweep_ranks > 1 else ''}")
    print(table)
    print(f"[convergence] wrote {args.out}/summary.json, summary.md, {', '.join(pngs)} "
          f"in {summary['total_wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
