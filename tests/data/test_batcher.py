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


@pytest.mark.parametrize("minibatch", [256, 1100])
@pytest.mark.parametrize("prefetch", [True, False])
def test_the_chunk_read_ahead_is_the_one_taken_next(small_corpus, monkeypatch, minibatch,
                                                   prefetch):
    """At an epoch cut short by equal step counts the chunk after it in the old
    epoch was read ahead, and the next epoch's first read while the rank waited;
    a chunk too short for a minibatch (1100 frames: some chunks) was read for
    nothing.  Without prefetch nothing is read ahead (it was, on the training
    thread, and held as a second chunk)."""
    import mpitrain.data.batcher as batcher
    manifest = load_manifest(os.path.join(small_corpus, "train"))
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 1000)
    assert any(c.frames < 1100 for c in chunks)
    local = sum(c.frames // minibatch for c in chunks)
    reads, read = [], batcher.read_chunk
    monkeypatch.setattr(batcher, "read_chunk",
                        lambda m, spec, *a: reads.append(spec) or read(m, spec, *a))
    stream = MinibatchStream(manifest, chunks, minibatch=minibatch, seed=1, rank=0,
                             cmvn=(manifest.cmvn_mean, [1.0] * manifest.feat_dim),
                             steps_per_epoch=local // 2, prefetch=prefetch)
    try:
        taken = []
        for _ in range(4 * (local // 2)):             # four epochs
            chunk, _ = stream.next_batch()
            if not taken or taken[-1] is not chunk:
                taken.append(chunk)
        for pending in list(stream._pending.values()):
            pending.result()                          # (the read-ahead under way)
        if not prefetch:
            assert reads == [c.spec for c in taken]
            return
        # every chunk read was taken, and the one read ahead at the end is the next
        assert reads[:-1] == [c.spec for c in taken]
        ahead = reads[-1]
        stream.next_batch()
        assert stream._current.spec == ahead
    finally:
        stream.close()


@pytest.mark.parametrize("num_utts", [6, 40])
def test_a_shard_rewritten_since_the_plan_is_named_not_read(tmp_path, num_utts):
    """A corpus prepared again (``--overwrite``) under a running job: the next chunk
    read stopped the run with an IndexError (fewer frames), or trained on frames
    of other utterances (more)."""
    import shutil

    from mpitrain.data.batcher import read_chunk
    from mpitrain.data.corpus import CorpusError

    from .corpora import write_corpus
    corpus = write_corpus(tmp_path / "c", num_utts=12)
    manifest = load_manifest(corpus)
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 1000)
    cmvn = ([0.0] * manifest.feat_dim, [1.0] * manifest.feat_dim)
    read_chunk(manifest, chunks[-1], *cmvn)            # as planned: read
    shutil.rmtree(corpus)
    write_corpus(tmp_path / "c", num_utts=num_utts, seed=1)
    with pytest.raises(CorpusError) as err:
        read_chunk(manifest, chunks[-1], *cmvn)
    shard = manifest.shard_path(chunks[-1].shard_index)
    assert str(err.value).startswith(f"{shard}: the shard changed while this run read it")


def test_a_shard_written_again_during_the_run_is_named_as_changed(tmp_path):
    # `synth`/`prepare --overwrite` of the corpus a run reads: the next chunk read
    # "utterance range 0:55 is outside 0:30" (or trained on other frames when the
    # file held as many utterances)
    from mpitrain.data.batcher import read_chunk
    from mpitrain.data.corpus import CorpusError
    from mpitrain.data.synthetic import synthesize
    synthesize(str(tmp_path / "c"), hours=0.01, speakers=2, shards=1, seed=1,
               dev_hours=0.002, dev_speakers=1)
    manifest = load_manifest(str(tmp_path / "c" / "train"))
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 10 ** 9)
    cmvn = (manifest.cmvn_mean, [1.0] * manifest.feat_dim)
    read_chunk(manifest, chunks[0], *cmvn)
    for hours, seed in ((0.005, 2), (0.03, 2)):    # fewer utterances; more, other lengths
        synthesize(str(tmp_path / "c"), hours=hours, speakers=2, shards=1, seed=seed,
                   dev_hours=0.002, dev_speakers=1, overwrite=True)
        with pytest.raises(CorpusError) as err:
            read_chunk(manifest, chunks[0], *cmvn)
        assert str(err.value).startswith(f"{manifest.shard_path(0)}: the shard changed while "
                                         "this run read it"), str(err.value)


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_shard_written_again_with_the_same_utterances_and_sizes_is_named(tmp_path, how):
    # new alignments of the same utterances: every size as planned, other labels
    import shutil

    import h5py

    from mpitrain.data.batcher import read_chunk
    from mpitrain.data.corpus import CorpusError

    from .corpora import write_corpus
    manifest = load_manifest(write_corpus(tmp_path / "c", num_utts=12))
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 1000)
    stream = MinibatchStream(manifest, chunks, minibatch=2, seed=0, rank=0, prefetch=False,
                             cmvn=([0.0] * manifest.feat_dim, [1.0] * manifest.feat_dim))
    stream.close()                       # (it noted the shards as they were at the start)
    shard = manifest.shard_path(chunks[0].shard_index)
    if how == "replaced":
        shutil.copy(shard, tmp_path / "new.h5")
        with h5py.File(tmp_path / "new.h5", "r+") as f:
            f["labels"][...] = (f["labels"][...] + 1) % 6
        os.replace(tmp_path / "new.h5", shard)
    else:
        with h5py.File(shard, "r+") as f:
            f["labels"][...] = (f["labels"][...] + 1) % 6
    with pytest.raises(CorpusError) as err:
        read_chunk(manifest, chunks[0], [0.0] * manifest.feat_dim, [1.0] * manifest.feat_dim)
    assert str(err.value).startswith(f"{shard}: the shard changed while this run read it (the "
                                     "file was replaced or rewritten since the run first read "
                                     "it)"), err.value


def test_a_position_outside_the_ranks_data_is_refused_naming_the_field(small_corpus):
    """A reader position from a damaged or hand-edited checkpoint: a chunk past the
    last one stopped the run with an IndexError; a minibatch past the chunk's end
    trained on silently."""
    manifest = load_manifest(os.path.join(small_corpus, "train"))
    chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 2000)
    stream = MinibatchStream(manifest, chunks, minibatch=256, seed=1, rank=0, prefetch=False,
                             cmvn=(manifest.cmvn_mean, [1.0] * manifest.feat_dim))
    try:
        for _ in range(3):
            stream.next_batch()
        good = stream.state_dict()
        batches = chunks[int(stream.chunk_order(0)[good["chunk_pos"]])].frames // 256
        for field, value, bound in [("chunk_pos", len(chunks), f"[0, {len(chunks) - 1}]"),
                                    ("chunk_pos", -1, "[0, "),
                                    ("batch_pos", batches + 1, f"[0, {batches}]"),
                                    ("steps_in_epoch", 10 ** 9, "[0, "),
                                    ("epoch", -2, ">= 0")]:
            with pytest.raises(ValueError) as err:
                stream.load_state_dict({**good, field: value})
            assert f"field '{field}': {value} is out of range {bound}" in str(err.value)
        assert stream.state_dict() == good            # nothing changed by a refusal
        stream.load_state_dict({**good, "batch_pos": batches})   # the chunk's end: fine
    finally:
        stream.close()
