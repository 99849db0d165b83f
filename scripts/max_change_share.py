"""How often max-change clips SGD's step, on one rank of the 440-2x256-120 model.

Trains 1,500 steps of the quick start (rate 0.004) on the 20-hour synthetic
corpus, records each layer's change norm before clipping, and prints the share
of steps a rate of 1, 4, ..., 64 times as large would clip (per layer: norm x
factor > that layer's max-change).  docs/benchmarks.md, "Simulated scaling to
64 ranks", quotes its output.

    python scripts/max_change_share.py        # corpus: python -m mpitrain synth /tmp/vc/synth20 --hours 20 --shards 64
"""
import tempfile
import numpy as np
from mpitrain.optim import sgd as S
rec = []
orig = S.SGD._scales
def patched(self, norms, q):
    rec.append([float(x) for x in norms]); return orig(self, norms, q)
S.SGD._scales = patched
from mpitrain.config import load_config
from mpitrain.train.trainer import Trainer
cfg = load_config("jobs/configs/quickstart.yaml", [
 "data.train=/tmp/vc/synth20/train", "data.dev=", "model.hidden_dim=256", "model.hidden_layers=2",
 "training.epochs=1", "training.max_steps=1500", "training.checkpoint_interval=0", "training.log_interval=500"])
from mpitrain.comm.single import SingleCommunicator
t = Trainer(cfg, run_dir=tempfile.mkdtemp(), comm=SingleCommunicator()); t.run(); t.close()
n = np.array(rec)  # per layer change norms at lr 0.004 (before clipping)
lim = np.array(t.optimizer.layer_max_change)
for f in (1, 4, 8, 16, 32, 64):
    per = (f * n > lim).mean(0); tot = (np.sqrt(((np.minimum(f*n, lim))**2).sum(1)) > 2.0).mean()
    print(f"lr x{f}: share of steps clipped per layer {np.round(per,3).tolist()}, total cap {tot:.3f}")
for lo, hi in ((0, 100), (100, 500), (500, 1500)):
    print(lo, hi, "median norms", np.round(np.median(n[lo:hi], 0), 4).tolist())
