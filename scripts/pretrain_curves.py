"""Held-out accuracy against frames: random init and RBM init of a sigmoid DNN,
model averaging on 1 and 4 virtual ranks, plain SGD, three seeds.

Usage: python scripts/pretrain_curves.py OUT_DIR [--hours 0.5] [--seeds 1,2,3]

Writes OUT_DIR/<run>/ for each run, OUT_DIR/pretrain_init.png and prints a
Markdown table of the final held-out accuracy and cross-entropy.  The stack of
each seed is pretrained once on one rank and used by the 1- and 4-rank runs.
"""

import argparse
import json
import os
import subprocess
import sys

CONFIG = os.path.join(os.path.dirname(__file__), "..", "jobs", "configs", "pretrain.yaml")


def mpitrain(*args):
    subprocess.run([sys.executable, "-m", "mpitrain", *args], check=True,
                   stdout=subprocess.DEVNULL)


def evals(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    return [(r["frames"], r["dev_acc"], r["dev_xent"]) for r in records if r["type"] == "eval"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hours", type=float, default=0.5)
    parser.add_argument("--seeds", default="1,2,3")
    args = parser.parse_args()
    corpus = os.path.join(args.out, "corpus")
    if not os.path.isdir(corpus):
        mpitrain("synth", corpus, "--hours", str(args.hours))
    data = [f"data.train={corpus}/train", f"data.dev={corpus}/dev",
            "training.eval_max_frames=20000", "training.checkpoint_interval=0"]
    runs = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        common = data + [f"training.seed={seed}"]
        pre = os.path.join(args.out, f"pre-s{seed}")
        if not os.path.exists(os.path.join(pre, "pretrain.h5")):
            mpitrain("pretrain", CONFIG, "--run-dir", pre, "--overwrite",
                     *sum((["--set", s] for s in common), []))
        for init in ("random", "rbm"):
            for ranks in (1, 4):
                name = f"{init}-n{ranks}-s{seed}"
                run = os.path.join(args.out, name)
                extra = common + [f"training.eval_interval={40000 // ranks}"]
                if init == "rbm":
                    extra.append(f"model.init_from={pre}/pretrain.h5")
                if not os.path.exists(os.path.join(run, "final.h5")):
                    mpitrain("train", CONFIG, "--run-dir", run, "--overwrite",
                             "--virtual", str(ranks), *sum((["--set", s] for s in extra), []))
                runs[name] = evals(run)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {("random", 1): "tab:gray", ("random", 4): "tab:orange",
              ("rbm", 1): "tab:blue", ("rbm", 4): "tab:green"}
    print("| init | ranks | seed | final held-out acc | final held-out xent |")
    print("|---|---|---|---|---|")
    for name, points in sorted(runs.items()):
        init, ranks, seed = name.split("-")
        key = (init, int(ranks[1:]))
        label = f"{init} init, {key[1]} rank(s)" if seed == "s1" else None
        ax.plot([p[0] for p in points], [p[1] for p in points], color=colors[key],
                label=label, alpha=0.8)
        print(f"| {init} | {key[1]} | {seed[1:]} | {points[-1][1]:.4f} | {points[-1][2]:.4f} |")
    ax.set_xlabel("frames trained (all ranks)")
    ax.set_ylabel("held-out frame accuracy")
    ax.set_title("sigmoid 3x256 DNN, SGD, model averaging K=8; 3 seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "pretrain_init.png")
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
