"""Held-out accuracy against frames: random init and RBM init of a sigmoid DNN,
model averaging on 1, 4, 8 or 16 virtual ranks, plain SGD or NG-SGD, three seeds.

Usage: python scripts/pretrain_curves.py OUT_DIR [--hours 0.5] [--seeds 1,2,3]
           [--ranks 1,4] [--optimizer sgd[,ngsgd]] [--inits random,rbm]

Writes OUT_DIR/<optimizer>-<init>-n<ranks>-s<seed>/ for each run,
OUT_DIR/pretrain_init-<optimizer>.png for each optimizer and prints a Markdown
table per optimizer of the final held-out accuracy and cross-entropy.  The
stack of each seed is pretrained once on one rank (OUT_DIR/pre-s<seed>) and
used by every run of that seed, whatever the ranks or optimizer.  Every run
trains `training.epochs` (2) epochs, so every run sees the same frames in all
(on N ranks each rank sees 1/N of the corpus per epoch); held-out accuracy is
taken every 40,000 frames of all ranks.  Runs whose final.h5 exists are not
trained again, so several invocations with disjoint --ranks/--optimizer can
run side by side on one OUT_DIR and a last one with the whole grid plots it.
"""

import argparse
import json
import os
import subprocess
import sys

CONFIG = os.path.join(os.path.dirname(__file__), "..", "jobs", "configs", "pretrain.yaml")
EVAL_FRAMES_ALL_RANKS = 40000


def mpitrain(*args):
    subprocess.run([sys.executable, "-m", "mpitrain", *args], check=True,
                   stdout=subprocess.DEVNULL)


def evals(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    return [(r["frames"], r["dev_acc"], r["dev_xent"]) for r in records if r["type"] == "eval"]


def ints(text):
    return [int(s) for s in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", metavar="OUT_DIR",
                        help="gets the corpus, the stacks, one directory per run and the plots")
    parser.add_argument("--hours", type=float, default=0.5,
                        help="hours of the synthetic training corpus")
    parser.add_argument("--seeds", default="1,2,3", help="training.seed values, comma-separated")
    parser.add_argument("--ranks", default="1,4", help="virtual rank counts, comma-separated")
    parser.add_argument("--optimizer", default="sgd",
                        help="optimizer.name values, comma-separated: sgd, ngsgd")
    parser.add_argument("--inits", default="random,rbm",
                        help="random (no pretraining), rbm (model.init_from the seed's stack)")
    args = parser.parse_args()
    seeds, rank_counts = ints(args.seeds), ints(args.ranks)
    optimizers, inits = args.optimizer.split(","), args.inits.split(",")
    corpus = os.path.join(args.out, "corpus")
    if not os.path.isdir(corpus):
        mpitrain("synth", corpus, "--hours", str(args.hours))
    data = [f"data.train={corpus}/train", f"data.dev={corpus}/dev",
            "training.eval_max_frames=20000", "training.checkpoint_interval=0"]
    runs = {}
    for seed in seeds:
        common = data + [f"training.seed={seed}"]
        pre = os.path.join(args.out, f"pre-s{seed}")
        if "rbm" in inits and not os.path.exists(os.path.join(pre, "pretrain.h5")):
            mpitrain("pretrain", CONFIG, "--run-dir", pre, "--overwrite",
                     *sum((["--set", s] for s in common), []))
        for opt in optimizers:
            for init in inits:
                for ranks in rank_counts:
                    name = f"{opt}-{init}-n{ranks}-s{seed}"
                    run = os.path.join(args.out, name)
                    extra = common + [f"optimizer.name={opt}",
                                      f"training.eval_interval={EVAL_FRAMES_ALL_RANKS // ranks}"]
                    if init == "rbm":
                        extra.append(f"model.init_from={pre}/pretrain.h5")
                    if not os.path.exists(os.path.join(run, "final.h5")):
                        print(f"training {name}", flush=True)
                        mpitrain("train", CONFIG, "--run-dir", run, "--overwrite",
                                 "--virtual", str(ranks), *sum((["--set", s] for s in extra), []))
                    runs[(opt, init, ranks, seed)] = evals(run)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {1: "tab:blue", 4: "tab:green", 8: "tab:orange", 16: "tab:red"}
    styles = {"random": "--", "rbm": "-"}
    for opt in optimizers:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        print(f"\n{opt}: final held-out accuracy / cross-entropy after 2 epochs\n")
        print(f"| init | virtual ranks | accuracy, seeds {' / '.join(map(str, seeds))} | mean"
              " | cross-entropy, seeds | mean |")
        print("|---|---|---|---|---|---|")
        for init in inits:
            for ranks in rank_counts:
                finals = []
                for seed in seeds:
                    points = runs[(opt, init, ranks, seed)]
                    label = (f"{'RBM' if init == 'rbm' else init} init, {ranks} virtual rank(s)"
                             if seed == seeds[0] else None)
                    ax.plot([p[0] for p in points], [p[1] for p in points],
                            color=colors.get(ranks), linestyle=styles.get(init), label=label,
                            alpha=0.8)
                    finals.append(points[-1])
                accs = [f[1] for f in finals]
                xents = [f[2] for f in finals]
                print(f"| {'RBM' if init == 'rbm' else init} | {ranks} | "
                      f"{' / '.join(f'{a:.3f}' for a in accs)} | {sum(accs) / len(accs):.3f} | "
                      f"{' / '.join(f'{x:.3f}' for x in xents)} | {sum(xents) / len(xents):.3f} |")
        ax.set_xlabel("frames trained (all ranks)")
        ax.set_ylabel("held-out frame accuracy")
        name = {"sgd": "SGD", "ngsgd": "NG-SGD"}.get(opt, opt)
        ax.set_title(f"sigmoid 3x256 DNN, {name}, model averaging K=8; "
                     f"{len(seeds)} seeds")
        ax.legend(fontsize=8, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        png = os.path.join(args.out, f"pretrain_init-{opt}.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
