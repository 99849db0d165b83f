"""Random utterances for the shard and corpus-writer tests."""

import numpy as np


def make_utterances(n, dim=6, num_classes=5, seed=0):
    rng = np.random.default_rng(seed)
    utts = []
    for i in range(n):
        t = int(rng.integers(3, 40))
        utts.append((f"utt{i:03d}", rng.normal(i, 1.0, (t, dim)).astype(np.float32),
                     rng.integers(0, num_classes, t)))
    return utts
