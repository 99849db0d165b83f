"""The minibatch stream: what it keeps in memory while it reads ahead."""

import os

import pytest

from mpitrain.data.batcher import MinibatchStream, plan_chunks
from mpitrain.data.corpus import load_manifest
from mpitrain.data.sharding import assign_shards


@pytest.mark.parametrize("prefetch", [True, False])
def test_chunks_read_ahead_for_skipped_positions_are_not_kept(small_corpus, prefetch):
    """An epoch that ends before the rank's last chunks (equal step counts on all
    ranks) leaves a chunk read ahead behind: it must not pile up epoch after epoch."""
    manifest = load_manifest(os.path.join(small_corpus, "train"))
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 2000)
    local = sum(c.frames // 256 for c in chunks)
    stream = MinibatchStream(manifest, chunks, minibatch=256, seed=1, rank=0,
                             cmvn=(manifest.cmvn_mean, [1.0] * manifest.feat_dim),
                             steps_per_epoch=local // 2, prefetch=prefetch)
    try:
        held = []
        for _ in range(8 * (local // 2)):           # eight epochs
            stream.next_batch()
            held.append(len(stream._pending))
        assert max(held) <= 1, held
    finally:
        stream.close()
