"""Overfitting on a small corpus: held-out accuracy against epochs on seen and unseen speakers.

A grid of variants (a name and KEY=VALUE config overrides) times seeds, each
run trained in this process on one CPU rank.  ``data.dev`` is a held-out set
of the TRAINING speakers (the corpus's ``dev_seen``, as Kaldi's valid set): it
is what the trainer evaluates, keeps the best model by and stops early on.
At every evaluation the same network is also scored on the corpus's ``dev``
(UNSEEN speakers); both go to OUT/results.jsonl.

Commands (from the repository root, in the venv)::

    python scripts/generalization.py build runs/gen/corpus
    python scripts/generalization.py run runs/gen --corpus runs/gen/corpus --seeds 1,2,3 \\
        --variant plain: \\
        --variant "l2:optimizer.l2_regularize=5e-5" \\
        --variant "recipe:optimizer.l2_regularize=5e-5 model.dropout_schedule=0,0@0.2,0.3@0.5,0 \\
                   training.select_by=xent training.early_stop.patience=3"
    python scripts/generalization.py summary runs/gen [--baseline plain]
    python scripts/generalization.py plot runs/gen curves.png [--variants plain,l2]

``--variant NAME:KEY=VALUE KEY=VALUE ...`` (overrides split at spaces; a
repeated NAME adds to it) or ``--grid GRID.yaml`` (YAML or JSON)::

    seeds: [1, 2, 3]
    variants:
      plain: []
      l2: [optimizer.l2_regularize=5e-5]
      recipe: {optimizer.l2_regularize: 5e-5, training.select_by: xent}

The base config is BASE_CONFIG below (the calibrated overfitting setup:
~0.3 h of training frames from 60 speakers, 3x512 ReLU, NG-SGD, 10 epochs,
held-out evaluation at each epoch end, one BLAS thread: about a minute a run)
unless ``--config FILE`` is given;
``--set KEY=VALUE`` applies to every variant, the variant's overrides last.
Each run trains into OUT/runs/<variant>-s<seed> (train.log holds its
progress lines); a (variant, seed) whose results are complete is skipped, so
an interrupted grid resumes where it stopped.

results.jsonl rows (all with variant, seed): ``eval`` at each evaluation
(step, epoch, seen_acc, seen_xent, unseen_acc, unseen_xent), ``kept`` (the
kept model, RUN_DIR/best.h5 if the run wrote one, else final.h5, scored on
both sets), ``train`` (the last training record: acc, xent) and ``done``
(seconds, cpu_seconds, steps).  ``summary`` prints per variant the mean and
min/max over seeds at each epoch, then the best epoch's seen accuracy, the
kept model's seen and unseen accuracy and "kept minus best epoch" in
accuracy points (target: never below -0.5), and the kept model's unseen
accuracy against the baseline variant's last epoch (same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time

import numpy as np

from mpitrain.comm.single import SingleCommunicator
from mpitrain.config import ConfigError, load_config
from mpitrain.data.corpus import load_manifest
from mpitrain.data.synthetic import synthesize
from mpitrain.files import atomic_open, parse_yaml, read_yaml
from mpitrain.nn.model_file import load_model
from mpitrain.threads import apply_blas_threads
from mpitrain.train.evaluate import evaluate_chunks, load_eval_chunks
from mpitrain.train.trainer import Trainer, TrainingError

# The calibrated base, on the corpus `build` writes by default (0.3 h, 60
# speakers): plain training overfits.  Seeds 1 and 2: train accuracy 1.000
# (xent 0.003) against 0.824 on held-out speech of the training speakers and
# 0.802 on unseen speakers after 10 epochs; held-out xent is lowest at epoch 2
# (0.683 seen, 0.782 unseen) and rises to 0.775 and 0.886 by epoch 10, while
# accuracy flattens from epoch 7.  One run: 56 s on one core (blas_threads 1;
# 2 threads ran 1.3x faster on idle cores but stalled behind other work).
# data.train and data.dev are set from --corpus.
BASE_CONFIG = """
data:
  left_context: 5
  right_context: 5
  chunk_frames: 200000
model:
  hidden_layers: 3
  hidden_dim: 512
  nonlinearity: relu
optimizer:
  name: ngsgd
  initial_learning_rate: 0.004
  final_learning_rate: 0.0004
  max_change_per_layer: 0.75
  max_change_output: 1.5
  max_change: 2.0
training:
  epochs: 10
  minibatch: 256
  log_interval: 100
  eval_interval: 0
  checkpoint_interval: 0
parallel:
  method: model_averaging
  average_every: 8
blas_threads: 1
"""

RESULTS = "results.jsonl"
NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


# -- build ----------------------------------------------------------------------------

def cmd_build(args) -> None:
    info = synthesize(args.out, hours=args.hours, speakers=args.speakers, shards=args.shards,
                      seed=args.seed, dev_hours=args.dev_hours, dev_speakers=args.dev_speakers,
                      seen_dev_hours=args.seen_dev_hours, overwrite=args.overwrite)
    print(f"train:    {info['train_dir']}: {info['train_frames']} frames, "
          f"{len(info['train_speakers'])} speakers")
    print(f"dev_seen: {info['seen_dev_dir']}: {info['seen_dev_frames']} frames, "
          f"{len(info['seen_dev_speakers'])} training speakers")
    print(f"dev:      {info['dev_dir']}: {info['dev_frames']} frames, "
          f"{len(info['dev_speakers'])} unseen speakers ({info['seconds']:.1f} s)")


# -- the grid -------------------------------------------------------------------------

def parse_variant(text: str) -> tuple:
    """'l2:optimizer.l2_regularize=5e-5 model.dropout=0.1' -> ('l2', [overrides])."""
    name, sep, rest = text.partition(":")
    if not sep or not NAME.match(name):
        raise SystemExit(f"--variant {text!r}: expected NAME:KEY=VALUE ... (NAME of letters, "
                         "digits, _ . + -)")
    return name, rest.split()


def overrides_of(value, where: str) -> list:
    """A grid file's variant: a list of 'KEY=VALUE' strings or a {KEY: VALUE} mapping."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{key}={json.dumps(val) if isinstance(val, str) else val}"
                for key, val in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise SystemExit(f"{where}: expected a list of KEY=VALUE or a mapping, got {value!r}")


def read_grid(args) -> tuple:
    """(variants {name: overrides}, seeds) from --grid, then --variant, then --seeds."""
    variants, seeds = {}, None
    if args.grid:
        grid = read_yaml(args.grid, what="grid file") or {}
        for name, value in (grid.get("variants") or {}).items():
            if not NAME.match(str(name)):
                raise SystemExit(f"{args.grid}: bad variant name {name!r}")
            variants[str(name)] = overrides_of(value, f"{args.grid}: variants.{name}")
        seeds = grid.get("seeds")
    for text in args.variant or ():
        name, items = parse_variant(text)
        variants.setdefault(name, []).extend(items)
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    return variants or {"plain": []}, [int(s) for s in seeds or [1]]


def base_config_path(args) -> str:
    """--config, else BASE_CONFIG written to OUT/base.yaml."""
    if args.config:
        return args.config
    path = os.path.join(args.out, "base.yaml")
    parse_yaml(BASE_CONFIG, where="BASE_CONFIG")        # fail here, not in the trainer
    with atomic_open(path) as fh:
        fh.write(BASE_CONFIG.lstrip())
    return path


# -- results.jsonl --------------------------------------------------------------------

def read_rows(out: str) -> list:
    path = os.path.join(out, RESULTS)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def append_row(out: str, row: dict) -> None:
    with open(os.path.join(out, RESULTS), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def drop_rows(out: str, variant: str, seed: int) -> None:
    """Forget an incomplete attempt of (variant, seed) before running it again."""
    rows = [r for r in read_rows(out) if (r["variant"], r["seed"]) != (variant, seed)]
    with atomic_open(os.path.join(out, RESULTS)) as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


# -- scoring --------------------------------------------------------------------------

def score(net, chunks, comm=None) -> tuple:
    """(accuracy, cross-entropy per frame) of ``net`` on loaded eval chunks."""
    sums = evaluate_chunks(net, chunks)
    if comm is not None:                    # as Trainer.evaluate: sums over all ranks
        sums = np.array(sums, dtype=np.float64)
        comm.allreduce_(sums, op="sum")
    total, correct, frames = (float(s) for s in sums)
    return correct / frames, total / frames


class GeneralizationTrainer(Trainer):
    """A Trainer that also scores the unseen-speaker set at every evaluation."""

    def __init__(self, cfg, *, unseen_dir: str, record, **kwargs):
        super().__init__(cfg, **kwargs)
        self._unseen_manifest = load_manifest(unseen_dir)
        self._unseen = None
        self._record_row = record
        self.recorded_steps = set()

    def unseen_score(self) -> tuple:
        if self._unseen is None:
            self._unseen = load_eval_chunks(self._unseen_manifest, self.net,
                                            rank=self.comm.rank, size=self.comm.size,
                                            max_frames=self.cfg.training.eval_max_frames)
        return score(self.net, self._unseen, self.comm)

    def record_eval(self, result: dict) -> None:
        if not result or self.step in self.recorded_steps:
            return
        unseen_acc, unseen_xent = self.unseen_score()
        self.recorded_steps.add(self.step)
        self._record_row(kind="eval", step=self.step,
                         epoch=round(self.step / self.steps_per_epoch, 3),
                         seen_acc=result["dev_acc"], seen_xent=result["dev_xent"],
                         unseen_acc=unseen_acc, unseen_xent=unseen_xent)

    def on_eval(self, result: dict) -> bool:
        self.record_eval(result)
        return super().on_eval(result)      # the trainer's own decision, never ours


def last_train_record(run_dir: str) -> dict:
    last = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if record.get("type") == "train":
                last = record
    return last


def kept_model_row(run_dir: str, cfg, unseen_dir: str) -> dict:
    """The kept model (best.h5, else final.h5) scored on the seen and unseen sets."""
    name = "best.h5" if os.path.exists(os.path.join(run_dir, "best.h5")) else "final.h5"
    net, _ = load_model(os.path.join(run_dir, name))
    limit = cfg.training.eval_max_frames
    seen = score(net, load_eval_chunks(load_manifest(cfg.data.dev), net, max_frames=limit))
    unseen = score(net, load_eval_chunks(load_manifest(unseen_dir), net, max_frames=limit))
    return {"kind": "kept", "model": name, "seen_acc": seen[0], "seen_xent": seen[1],
            "unseen_acc": unseen[0], "unseen_xent": unseen[1]}


def run_config(config: str, overrides: list, seed: int, corpus: str):
    """The base config, the corpus's train and dev_seen, the overrides, the seed."""
    return load_config(config, [f"data.train={os.path.join(corpus, 'train')}",
                                f"data.dev={os.path.join(corpus, 'dev_seen')}",
                                *overrides, f"training.seed={seed}"])


def train_one(out: str, cfg, variant: str, seed: int, corpus: str) -> None:
    """Train (variant, seed) into OUT/runs/<variant>-s<seed> and append its rows."""
    run_dir = os.path.join(out, "runs", f"{variant}-s{seed}")
    unseen_dir = os.path.join(corpus, "dev")
    apply_blas_threads(cfg.blas_threads, device=cfg.device, ranks_on_node=1)

    def record(**fields):
        append_row(out, {"variant": variant, "seed": seed, **fields})

    shutil.rmtree(run_dir, ignore_errors=True)          # an interrupted attempt's files
    os.makedirs(run_dir)
    wall, cpu = time.perf_counter(), time.process_time()
    with open(os.path.join(run_dir, "train.log"), "w", encoding="utf-8") as log:
        trainer = GeneralizationTrainer(cfg, unseen_dir=unseen_dir, record=record,
                                        run_dir=run_dir, comm=SingleCommunicator(),
                                        overwrite=True, stream=log)
        try:
            result = trainer.run()
            trainer.record_eval(result)         # the end's evaluation calls no on_eval
        finally:
            trainer.close()
    seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
    record(**kept_model_row(run_dir, cfg, unseen_dir))
    train = last_train_record(run_dir)
    record(kind="train", step=train.get("step"), acc=train.get("acc"), xent=train.get("xent"))
    record(kind="done", steps=result["steps"], seconds=round(seconds, 1),
           cpu_seconds=round(cpu_seconds, 1))


def cmd_run(args) -> None:
    variants, seeds = read_grid(args)
    for split in ("train", "dev_seen", "dev"):
        if not os.path.isdir(os.path.join(args.corpus, split)):
            raise SystemExit(f"{args.corpus}/{split}: missing; build the corpus with "
                             f"`python scripts/generalization.py build {args.corpus}`")
    os.makedirs(args.out, exist_ok=True)
    config = base_config_path(args)
    overrides = {name: [*(args.set or ()), *items] for name, items in variants.items()}
    for name, items in overrides.items():      # every variant's config checked up front
        run_config(config, items, seeds[0], args.corpus)
    done = {(r["variant"], r["seed"]) for r in read_rows(args.out) if r["kind"] == "done"}
    for variant, items in overrides.items():
        for seed in seeds:
            if (variant, seed) in done:
                print(f"{variant} seed {seed}: done before, skipped")
                continue
            drop_rows(args.out, variant, seed)
            print(f"{variant} seed {seed}: training ({' '.join(variants[variant]) or 'base'})",
                  flush=True)
            train_one(args.out, run_config(config, items, seed, args.corpus), variant, seed,
                      args.corpus)
            print(run_line(read_rows(args.out), variant, seed), flush=True)


# -- summary --------------------------------------------------------------------------

def run_line(rows: list, variant: str, seed: int) -> str:
    mine = [r for r in rows if (r["variant"], r["seed"]) == (variant, seed)]
    evals = [r for r in mine if r["kind"] == "eval"]
    kept = next(r for r in mine if r["kind"] == "kept")
    train = next(r for r in mine if r["kind"] == "train")
    done = next(r for r in mine if r["kind"] == "done")
    best = max(evals, key=lambda r: r["seen_acc"])
    return (f"  train acc {train['acc']:.4f}; best seen acc {best['seen_acc']:.4f} at epoch "
            f"{best['epoch']:g}; last epoch seen {evals[-1]['seen_acc']:.4f} / unseen "
            f"{evals[-1]['unseen_acc']:.4f}; kept ({kept['model']}) seen "
            f"{kept['seen_acc']:.4f} / unseen {kept['unseen_acc']:.4f}; "
            f"{done['seconds']:.0f} s ({done['cpu_seconds']:.0f} s CPU)")


def spread(values: list, fmt: str = ".4f") -> str:
    """'mean [min, max]' over seeds (the mean alone for one seed)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def complete_runs(rows: list) -> dict:
    """{variant: {seed: {'eval': [...], 'kept': row, 'train': row, 'done': row}}}."""
    done = {(r["variant"], r["seed"]) for r in rows if r["kind"] == "done"}
    runs: dict = {}
    for r in rows:
        key = (r["variant"], r["seed"])
        if key not in done:
            continue
        run = runs.setdefault(r["variant"], {}).setdefault(r["seed"], {"eval": []})
        if r["kind"] == "eval":
            run["eval"].append(r)
        else:
            run[r["kind"]] = r
    return runs


def epoch_table(seeds: dict) -> list:
    lines = ["| epoch | seen acc | unseen acc | seen xent | unseen xent |", "|---|---|---|---|---|"]
    epochs = sorted({r["epoch"] for run in seeds.values() for r in run["eval"]})
    for epoch in epochs:
        at = [r for run in seeds.values() for r in run["eval"] if r["epoch"] == epoch]
        cells = [spread([r[k] for r in at]) for k in
                 ("seen_acc", "unseen_acc", "seen_xent", "unseen_xent")]
        lines.append(f"| {epoch:g} | " + " | ".join(cells) + (f" (n={len(at)})" if len(at) <
                                                               len(seeds) else "") + " |")
    return lines


def variant_row(name: str, seeds: dict, baseline: dict | None) -> str:
    best = [max(run["eval"], key=lambda r: r["seen_acc"]) for run in seeds.values()]
    kept = [run["kept"] for run in seeds.values()]
    gap = [100 * (k["seen_acc"] - b["seen_acc"]) for k, b in zip(kept, best)]
    gain = [100 * (run["kept"]["unseen_acc"] - baseline[seed]["eval"][-1]["unseen_acc"])
            for seed, run in seeds.items() if baseline and seed in baseline]
    cells = [str(len(seeds)), spread([run["train"]["acc"] for run in seeds.values()]),
             spread([b["seen_acc"] for b in best]), spread([b["epoch"] for b in best], "g"),
             spread([k["seen_acc"] for k in kept]), spread([k["unseen_acc"] for k in kept]),
             spread(gap, "+.2f") + (" ok" if min(gap) >= -0.5 else " **below -0.5**"),
             spread(gain, "+.2f") if gain else "-",
             spread([run["done"]["seconds"] for run in seeds.values()], ".0f")]
    return f"| {name} | " + " | ".join(cells) + " |"


def cmd_summary(args) -> None:
    runs = complete_runs(read_rows(args.out))
    if not runs:
        raise SystemExit(f"{args.out}/{RESULTS}: no complete run")
    for name, seeds in runs.items():
        print(f"\n### {name} (seeds {', '.join(map(str, sorted(seeds)))}): mean [min, max]\n")
        print("\n".join(epoch_table(seeds)))
    baseline = runs.get(args.baseline)
    print(f"\n### kept models (accuracy points; gain: kept unseen acc minus {args.baseline}'s "
          "last epoch, same seed)\n")
    print("| variant | seeds | train acc | best-epoch seen acc | best epoch | kept seen acc | "
          "kept unseen acc | kept minus best epoch | unseen gain | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, seeds in runs.items():
        print(variant_row(name, seeds, baseline))


def cmd_plot(args) -> None:
    """Held-out accuracy and cross-entropy against epochs, seen and unseen speakers:
    each variant's mean over seeds, its min-max band shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    runs = complete_runs(read_rows(args.out))
    names = args.variants.split(",") if args.variants else list(runs)
    missing = [n for n in names if n not in runs]
    if missing:
        raise SystemExit(f"{args.out}/{RESULTS}: no complete run of {', '.join(missing)}")
    fig = Figure(figsize=(10, 7), dpi=args.dpi)
    FigureCanvasAgg(fig)
    panels = [("seen_acc", "accuracy, seen speakers"), ("unseen_acc", "accuracy, unseen speakers"),
              ("seen_xent", "cross-entropy, seen speakers"),
              ("unseen_xent", "cross-entropy, unseen speakers")]
    for index, (key, title) in enumerate(panels):
        ax = fig.add_subplot(2, 2, index + 1)
        for name in names:
            seeds = runs[name]
            epochs = sorted({r["epoch"] for run in seeds.values() for r in run["eval"]})
            values = [[r[key] for run in seeds.values() for r in run["eval"]
                       if r["epoch"] == e] for e in epochs]
            mean = [sum(v) / len(v) for v in values]
            line, = ax.plot(epochs, mean, marker=".", label=f"{name} ({len(seeds)} seeds)")
            ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if index == 0:
            ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_open(args.png, "wb") as fh:
        fig.savefig(fh, format="png")
    print(f"wrote {args.png}")


# -- command line ---------------------------------------------------------------------

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the corpus: train, dev_seen, dev (unseen)")
    b.add_argument("out")
    b.add_argument("--hours", type=float, default=0.3, help="training speech")
    b.add_argument("--speakers", type=int, default=60, help="training speakers")
    b.add_argument("--seen-dev-hours", type=float, default=0.05,
                   help="held-out speech of the training speakers (dev_seen)")
    b.add_argument("--dev-hours", type=float, default=0.05, help="unseen-speaker speech (dev)")
    b.add_argument("--dev-speakers", type=int, default=8, help="unseen speakers")
    b.add_argument("--shards", type=int, default=2)
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--overwrite", action="store_true")
    r = sub.add_parser("run", help="train the grid of variants x seeds (resumable)")
    r.add_argument("out", help="work directory: base.yaml, results.jsonl, runs/")
    r.add_argument("--corpus", required=True, help="a directory written by `build`")
    r.add_argument("--config", help="base config file (default: BASE_CONFIG in this script)")
    r.add_argument("--grid", help="YAML/JSON file: variants {name: overrides}, seeds [...]")
    r.add_argument("--variant", action="append",
                   help="NAME:KEY=VALUE KEY=VALUE ... (repeatable; NAME: for the base alone)")
    r.add_argument("--seeds", help="comma-separated training seeds (default: the grid's, or 1)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override for every variant (repeatable)")
    s = sub.add_parser("summary", help="print Markdown tables of results.jsonl")
    s.add_argument("out")
    s.add_argument("--baseline", default="plain",
                   help="variant whose last epoch the unseen gain is measured against")
    p = sub.add_parser("plot", help="PNG of held-out accuracy and xent against epochs")
    p.add_argument("out")
    p.add_argument("png")
    p.add_argument("--variants", help="comma-separated variants (default: all)")
    p.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        {"build": cmd_build, "run": cmd_run, "summary": cmd_summary,
         "plot": cmd_plot}[args.command](args)
    except (ConfigError, TrainingError) as exc:
        raise SystemExit(f"generalization.py {args.command}: {exc}") from None


if __name__ == "__main__":
    main()
