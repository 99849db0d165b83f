"""How often max-change clips SGD's step, on one rank of the 440-2x256-120 model.

Trains 1,500 steps of the quick start (rate 0.004) on the 20-hour synthetic
corpus, records each layer's change norm before clipping, and prints the share
of steps a rate of 1, 4, ..., 64 times as large would clip (per layer: norm x
factor > that layer's max-change).  docs/benchmarks.md, "Simulated scaling to
64 ranks", quotes its output.

    python -m mpitrain synth /tmp/vc/synth20 --hours 20 --shards 64
    python scripts/max_change_share.py --corpus /tmp/vc/synth20
"""
import argparse
import os
import sys
import tempfile

import numpy as np

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs", "configs",
                      "quickstart.yaml")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", default="/tmp/vc/synth20",
                        help="the output of `mpitrain synth` (its train/ is trained on)")
    parser.add_argument("--steps", type=int, default=1500, help="steps trained")
    args = parser.parse_args(argv)
    train = os.path.join(args.corpus, "train")
    if not os.path.isfile(os.path.join(train, "corpus.yaml")):
        parser.error(f"--corpus: {train}/corpus.yaml not found; write the corpus with "
                     f"python -m mpitrain synth {args.corpus} --hours 20 --shards 64")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.config import load_config
    from mpitrain.optim import sgd as S
    from mpitrain.train.trainer import Trainer
    rec = []
    orig = S.SGD._scales

    def patched(self, norms, q):
        rec.append([float(x) for x in norms])
        return orig(self, norms, q)
    S.SGD._scales = patched
    cfg = load_config(CONFIG, [
        f"data.train={train}", "data.dev=", "model.hidden_dim=256", "model.hidden_layers=2",
        "training.epochs=1", f"training.max_steps={args.steps}",
        "training.checkpoint_interval=0", "training.log_interval=500"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(), comm=SingleCommunicator())
    t.run()
    t.close()
    n = np.array(rec)  # per layer change norms at lr 0.004 (before clipping)
    lim = np.array(t.optimizer.layer_max_change)
    for f in (1, 4, 8, 16, 32, 64):
        per = (f * n > lim).mean(0)
        tot = (np.sqrt(((np.minimum(f * n, lim)) ** 2).sum(1)) > 2.0).mean()
        print(f"lr x{f}: share of steps clipped per layer {np.round(per, 3).tolist()}, "
              f"total cap {tot:.3f}")
    third = max(1, len(n) // 15)
    for lo, hi in ((0, third), (third, 5 * third), (5 * third, len(n))):
        print(lo, hi, "median norms", np.round(np.median(n[lo:hi], 0), 4).tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
