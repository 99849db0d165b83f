"""Tables and a plot of simulated speedup curves from several `bench --virtual` runs.

Each run is one `python -m mpitrain bench CONFIG --virtual 1,2,...` output
directory (its bench.json) or a copy of its bench.json, given as LABEL=PATH
(LABEL=PATH#METHOD for one method of a run that measured several); a
directory without bench.json (a run still going) gives its finished sizes.  Per run and group size N:
frames and simulated seconds to the target, the statistical efficiency
(frames to target on one rank over frames on N) and the time-to-target
speedup (seconds on one rank over seconds on N), both against a one-rank
baseline per optimizer (``--baseline OPT=LABEL``: that run's N = 1 point;
default: each run's own N = 1), and the share of the simulated time spent
communicating (1 - compute time / simulated time, compute time = steps per
rank x the step time).  Every figure is simulated.

    D=docs/data/virtual-scaling
    python scripts/virtual_scaling.py --out $D/sweep --png docs/img/virtual-scaling-sweep.png \
        --also-targets 0.65 --baseline sgd="SGD avg K=8 x1" --baseline ngsgd="NG-SGD avg K=8 x1" \
        --plot "SGD avg K=8 x1,SGD avg K=1 x1,SGD allreduce xN,NG-SGD avg K=8 x1,NG-SGD avg K=1 x1,NG-SGD avg K=64 x1,NG-SGD allreduce xN,NG-SGD bmuf K=8" \
        "SGD avg K=8 x1=$D/ma-sgd-k8.bench.json" "SGD kaldi K=8 xN=$D/ka-sgd-k8.bench.json" \
        "SGD avg K=1 x1=$D/ma-sgd-k1.bench.json" "SGD avg K=64 x1=$D/ma-sgd-k64.bench.json" \
        "SGD allreduce xN=$D/ar-sgd-lin.bench.json" "SGD bmuf K=8=$D/bmuf-sgd-k8.bench.json" \
        "SGD kaldi K=8 xN, max-change xN=$D/kmc-sgd-n16.bench.json" \
        "NG-SGD avg K=8 x1=$D/ma-ng-k8.bench.json" "NG-SGD kaldi K=8 xN=$D/ka-ng-k8.bench.json" \
        "NG-SGD avg K=1 x1=$D/ma-ng-k1.bench.json" "NG-SGD avg K=4 x1=$D/ma-ng-k4.bench.json" \
        "NG-SGD avg K=16 x1=$D/ma-ng-k16.bench.json" "NG-SGD avg K=64 x1=$D/ma-ng-k64.bench.json" \
        "NG-SGD allreduce xN=$D/ar-ng-lin.bench.json" "NG-SGD bmuf K=8=$D/bmuf-ng-k8.bench.json" \
        "NG-SGD kaldi K=8 xN, max-change xN (16)=$D/kmc-ng-n16.bench.json" \
        "NG-SGD kaldi K=8 xN, max-change xN (64)=$D/kmc-ng-n64.bench.json"

writes OUT.json (the rows), OUT.md (one table per run and a summary) and
OUT.png (efficiency and speedup against N).
"""

from __future__ import annotations

import argparse
import json
import os

PAPER = [(16, 9.3), (32, 17.0)]       # Su & Chen 2015, SWB-300h, model averaging on GPUs


def load_run(label: str, path: str) -> dict:
    """One run's rows; PATH#METHOD picks one method of a run that measured several."""
    path, _, method = path.partition("#")
    file = path if path.endswith(".json") else os.path.join(path, "bench.json")
    with open(file, encoding="utf-8") as fh:
        report = json.load(fh)
    methods = report["methods"]
    if not method:
        if len(methods) > 1:
            raise SystemExit(f"{label}={path}: the run measured {', '.join(methods)}; "
                             f"name one as {label}={path}#METHOD")
        method = methods[0]
    elif method not in methods:
        raise SystemExit(f"{label}={path}#{method}: the run measured {', '.join(methods)}")
    cfg = report["config"]
    step_s = report["virtual"]["compute"]["step_seconds"]
    batch = cfg["training"]["minibatch"]
    rows = []
    for r in report["accuracy"]:
        if r.get("method", method) != method:
            continue
        n = r["ranks"]
        frames, secs = r["frames_to_target"], r["seconds_to_target"]
        comm = None
        if r["reached"] and secs:
            comm = max(0.0, 1.0 - frames / n / batch * step_s / secs)
        rows.append({"ranks": n, "reached": r["reached"], "frames_to_target": frames,
                     "seconds_to_target": secs, "interpolated": r["interpolated"],
                     "eval_interval_frames": r["eval_interval_frames_per_rank"] * n,
                     "frames_trained": r["frames"], "final_dev_acc": r["final_dev_acc"],
                     "stopped_by": r["stopped_by"], "comm_share": comm,
                     "initial_learning_rate": r.get("initial_learning_rate",
                                                    cfg["optimizer"]["initial_learning_rate"]),
                     "points": [{k: p[k] for k in ("frames", "seconds", "dev_acc")}
                                for p in r["points"]]})
    return {"label": label, "dir": path, "method": method,
            "optimizer": cfg["optimizer"]["name"], "sync_every": cfg["parallel"]["average_every"],
            "lr_scale": report["options"].get("lr_scale", "none"),
            "target_accuracy": report["options"]["target_accuracy"],
            "step_seconds": step_s, "network": report["virtual"]["network"], "minibatch": batch,
            "rows": sorted(rows, key=lambda r: r["ranks"])}


def load_unfinished(label: str, path: str, *, step_ms: float = 2.0, latency_us: float = 5.0,
                    bandwidth_gbit: float = 100.0) -> dict:
    """A run whose bench.json is not written yet (sizes still running or stopped):
    its finished sizes from each run directory's metrics.jsonl.

    metrics.jsonl times are wall times: the simulated seconds at an evaluation
    are its steps x the step time / (1 - the communication share of the last
    progress record), the share being steady without stragglers (checked
    against finished runs: within 1%).
    """
    import glob
    import yaml
    from mpitrain.bench.phases import first_crossing
    from mpitrain.bench.projection import NetworkModel
    net = NetworkModel(latency_s=latency_us * 1e-6, bandwidth_bytes_per_s=bandwidth_gbit * 1e9 / 8)
    rows, cfg, method, target = [], None, None, 0.70
    for run_dir in glob.glob(os.path.join(path, "runs", "accuracy-*-n*")):
        method, n = run_dir.rsplit("-n", 1)[0].split("accuracy-", 1)[1], int(run_dir.rsplit("-n", 1)[1])
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh]
        if not any(r["type"] == "end" for r in records):
            continue                      # still running
        evals = [r for r in records if r["type"] == "eval"]
        trains = [r for r in records if r["type"] == "train"]
        if trains:
            share = trains[-1]["comm_fraction"]

            def seconds(step):
                return step * step_ms * 1e-3 / (1 - share)
        else:
            # no progress record yet: one allreduce of the parameters per sync on the model
            period = 1 if method == "allreduce" else cfg["parallel"]["average_every"]
            cost = net.allreduce_seconds(4 * _num_params(cfg), n) if n > 1 else 0.0

            def seconds(step):
                return step * step_ms * 1e-3 + (step // period) * cost
        points = [{"frames": r["frames"], "seconds": seconds(r["step"]),
                   "dev_acc": r["dev_acc"]} for r in evals]
        hit = first_crossing(points, target)
        end = next(r for r in records if r["type"] == "end")
        rows.append({"ranks": n, "reached": hit is not None,
                     "frames_to_target": hit and hit["frames"],
                     "seconds_to_target": hit and hit["seconds"],
                     "interpolated": hit and hit["interpolated"],
                     "eval_interval_frames": cfg["training"]["eval_interval"] * n,
                     "frames_trained": end.get("frames", evals[-1]["frames"]),
                     "final_dev_acc": evals[-1]["dev_acc"], "stopped_by": "see metrics.jsonl",
                     "comm_share": None if hit is None else max(0.0, 1.0 - hit["frames"] / n / cfg[
                         "training"]["minibatch"] * step_ms * 1e-3 / hit["seconds"]),
                     "initial_learning_rate": cfg["optimizer"]["initial_learning_rate"],
                     "points": points, "from_metrics": True,
                     "comm_from": "progress records" if trains else "network model"})
    return {"label": label, "dir": path, "method": method, "optimizer": cfg["optimizer"]["name"],
            "sync_every": cfg["parallel"]["average_every"], "lr_scale": "see rates",
            "target_accuracy": target, "step_seconds": step_ms * 1e-3,
            "minibatch": cfg["training"]["minibatch"],
            "network": net.to_dict(), "rows": sorted(rows, key=lambda r: r["ranks"])}


def _num_params(cfg: dict) -> int:
    """Parameters of the ReLU DNN of ``cfg`` (weights and biases)."""
    import yaml
    with open(os.path.join(cfg["data"]["train"], "corpus.yaml"), encoding="utf-8") as fh:
        corpus = yaml.safe_load(fh)
    d = cfg["data"]
    dims = [corpus["feat_dim"] * (d["left_context"] + 1 + d["right_context"])] + \
        [cfg["model"]["hidden_dim"]] * cfg["model"]["hidden_layers"] + [corpus["num_classes"]]
    return sum((a + 1) * b for a, b in zip(dims, dims[1:]))


def load_any(label: str, path: str) -> dict:
    file = path.partition("#")[0]
    if file.endswith(".json") or os.path.exists(os.path.join(file, "bench.json")):
        return load_run(label, path)
    return load_unfinished(label, path)


def add_speedups(runs: list, baselines: dict) -> None:
    by_label = {r["label"]: r for r in runs}
    for run in runs:
        base_label = baselines.get(run["optimizer"])
        base_run = by_label[base_label] if base_label else run
        one = next(r for r in base_run["rows"] if r["ranks"] == 1)
        run["baseline"] = {"label": base_run["label"], "frames": one["frames_to_target"],
                           "seconds": one["seconds_to_target"]}
        for r in run["rows"]:
            ok = r["reached"] and one["reached"]
            r["statistical_efficiency"] = one["frames_to_target"] / r["frames_to_target"] \
                if ok else None
            r["speedup"] = one["seconds_to_target"] / r["seconds_to_target"] if ok else None
            if not r["reached"] and one["reached"]:
                # not reached by the end: bounds from the frames and time it ran
                r["efficiency_below"] = one["frames_to_target"] / r["frames_trained"]


def crossing(points: list, target: float):
    """(frames, seconds) of the first evaluation at or above ``target``, interpolated
    linearly from the one before (the bench's rule, mpitrain.bench.phases.first_crossing)."""
    from mpitrain.bench.phases import first_crossing
    hit = first_crossing(points, target)
    return None if hit is None else (hit["frames"], hit["seconds"])


def speedups_at(runs: list, target: float) -> dict:
    """label -> {N: (speedup, efficiency)} at another (lower) target, from the same points."""
    by_label = {r["label"]: r for r in runs}
    out = {}
    for run in runs:
        base = by_label[run["baseline"]["label"]]
        one = crossing(next(r for r in base["rows"] if r["ranks"] == 1)["points"], target)
        cells = {}
        for r in run["rows"]:
            hit = crossing(r["points"], target)
            cells[r["ranks"]] = None if hit is None or one is None else \
                (one[1] / hit[1], one[0] / hit[0])
        out[run["label"]] = cells
    return out


def summary_at(runs: list, target: float) -> str:
    table = speedups_at(runs, target)
    sizes = sorted({n for cells in table.values() for n in cells})
    out = [f"Target {target}:", "", "| setting | " + " | ".join(f"N={n}" for n in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for label, cells in table.items():
        out.append(f"| {label} | " + " | ".join(
            "" if n not in cells else "not reached" if cells[n] is None else
            f"{cells[n][0]:.1f} / {cells[n][1]:.2f}" for n in sizes) + " |")
    return "\n".join(out)


def _f(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(runs: list) -> str:
    out = []
    for run in runs:
        b = run["baseline"]
        out += [f"### {run['label']}", "",
                f"{run['method']}, {run['optimizer']}, sync every {run['sync_every']} "
                f"minibatches" + (", rate x jobs (the kaldi rule)" if run["method"] == "kaldi" else "")
                + (f", bench --lr-scale {run['lr_scale']}" if run["lr_scale"] not in (
                    "none", "see rates") else "") + "; one-rank baseline: "
                f"{b['label']} ({b['frames']:,.0f} frames, {b['seconds']:.3f} s)", "",
                "| N | initial rate | frames to target | steps per rank | simulated s | speedup "
                "| stat. efficiency | comm share | eval every (frames) |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in run["rows"]:
            if r["reached"]:
                frames = f"{r['frames_to_target']:,.0f}" + ("" if r["interpolated"] else " (≤)")
                cells = [frames, f"{r['frames_to_target'] / r['ranks'] / run['minibatch']:.0f}",
                         f"{r['seconds_to_target']:.3f}", _f(r["speedup"], ".2f"),
                         _f(r["statistical_efficiency"], ".2f"), _f(r["comm_share"], ".1%")]
            else:
                below = r.get("efficiency_below")
                cells = [f"not reached in {r['frames_trained']:,} (acc "
                         f"{_f(r['final_dev_acc'], '.3f')})", "—", "—", "—",
                         f"< {below:.2f}" if below else "—", "—"]
            rate = r["initial_learning_rate"] * (r["ranks"] if run["method"] == "kaldi" else 1)
            out.append(f"| {r['ranks']} | {rate:g} | "
                       + " | ".join(cells) + f" | {r['eval_interval_frames']:,} |")
        out.append("")
    return "\n".join(out)


def summary(runs: list) -> str:
    sizes = sorted({r["ranks"] for run in runs for r in run["rows"]})
    out = ["| setting | " + " | ".join(f"N={n}" for n in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for run in runs:
        cells = []
        for n in sizes:
            r = next((x for x in run["rows"] if x["ranks"] == n), None)
            if r is None:
                cells.append("")
            elif r["speedup"] is None:
                cells.append("not reached")
            else:
                cells.append(f"{r['speedup']:.1f} / {r['statistical_efficiency']:.2f}")
        out.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    out += ["", "Cells: time-to-target speedup / statistical efficiency, both against the "
                "one-rank baseline (simulated)."]
    return "\n".join(out)


def plot(runs: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    sizes = sorted({r["ranks"] for run in runs for r in run["rows"]})
    for run in runs:
        pts = [(r["ranks"], r["statistical_efficiency"], r["speedup"]) for r in run["rows"]
               if r["speedup"] is not None]
        if not pts:
            continue
        style = "-" if run["optimizer"] == "ngsgd" else "--"
        marker = "o" if run["optimizer"] == "ngsgd" else "s"
        n, eff, sp = zip(*pts)
        line, = ax1.plot(n, eff, style, marker=marker, label=run["label"])
        ax2.plot(n, sp, style, marker=marker, color=line.get_color(), label=run["label"])
    ax2.plot(sizes, sizes, ":", color="gray", label="ideal")
    ax2.plot(*zip(*PAPER), "k*", markersize=12, label="Su & Chen 2015 (GPUs)")
    ax2.plot([16, 32], [13, 25], "rv", markersize=9, label="goal (13x, 25x)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_xlabel("ranks N (virtual)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("statistical efficiency (frames on 1 / frames on N)")
    ax1.set_ylim(0, None)
    ax2.set_yscale("log", base=2)
    ax2.set_ylabel("time-to-target speedup against one rank")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH",
                   help="a `bench --virtual` output directory or a copy of its bench.json "
                        "(PATH#METHOD: one method of a run that measured several)")
    p.add_argument("--baseline", action="append", default=[], metavar="OPTIMIZER=LABEL",
                   help="the one-rank baseline of an optimizer (sgd, ngsgd): that run's N = 1 "
                        "point; repeat for each optimizer (default: each run's own N = 1)")
    p.add_argument("--out", required=True, help="path prefix of OUT.json, OUT.md, OUT.png")
    p.add_argument("--png", default="", help="where the plot goes (default OUT.png)")
    p.add_argument("--plot", default="", help="LABEL,LABEL,...: runs on the plot (default all)")
    p.add_argument("--also-targets", default="",
                   help="lower targets to tabulate from the same evaluations, e.g. 0.65,0.6")
    p.add_argument("--title", default="Simulated time to target on virtual ranks",
                   help="the plot's title")
    args = p.parse_args(argv)
    runs = [load_any(*item.rsplit("=", 1)) for item in args.runs]
    add_speedups(runs, dict(item.split("=", 1) for item in args.baseline))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump({"simulated": True, "runs": runs}, fh, indent=1)
    extra = [summary_at(runs, float(t)) for t in args.also_targets.split(",") if t]
    with open(args.out + ".md", "w", encoding="utf-8") as fh:
        fh.write("\n\n".join([summary(runs)] + extra + [markdown(runs)]))
    chosen = [s for s in args.plot.split(",") if s]
    plot([r for r in runs if not chosen or r["label"] in chosen], args.png or args.out + ".png",
         args.title)
    print("\n\n".join([summary(runs)] + extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
