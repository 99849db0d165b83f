"""Held-out evaluation: cross-entropy per frame and frame accuracy."""

from __future__ import annotations

import numpy as np

from .. import backend
from ..data.batcher import plan_chunks, read_chunk
from ..data.corpus import ShardInfo
from ..data.sharding import plan_shards
from ..data.shards import ShardReader
from ..data.splice import splice, splice_indices

EVAL_BATCH = 4096


def shard_offsets_reader(manifest):
    """Callback giving a shard's utterance offsets (for splitting shards between ranks)."""
    def offsets(i):
        with ShardReader(manifest.shard_path(i)) as reader:
            return np.asarray(reader.utt_offsets)
    return offsets


def load_eval_chunks(manifest, net, *, rank: int = 0, size: int = 1, max_frames: int = 0):
    """This rank's part of a corpus, normalised with the network's CMVN, on its device,
    all in memory (for a set scored again and again: the held-out set of a run).

    Example::

        chunks = load_eval_chunks(load_manifest("corpus/dev"), net)
    """
    return list(iter_eval_chunks(manifest, net, rank=rank, size=size, max_frames=max_frames))


def iter_eval_chunks(manifest, net, *, rank: int = 0, size: int = 1, max_frames: int = 0):
    """The chunks of :func:`load_eval_chunks`, each read when the one before has been
    taken: scoring a corpus once holds one chunk in memory, not the corpus.

    Example::

        evaluate_chunks(net, iter_eval_chunks(load_manifest("corpus/test"), net))
    """
    if max_frames < 0:
        raise ValueError(f"max_frames must be >= 0 (0: all frames), got {max_frames}")
    offsets_of = shard_offsets_reader(manifest)
    shards, past = manifest.shards, 0
    if max_frames:
        # the first max_frames frames in shard order, however many ranks share them:
        # the figures are those of `eval --max-frames` (each rank's first frames
        # made another subset for every rank count)
        shards, offsets_of, past = first_frames(manifest.shards, offsets_of, max_frames)
    if size > 1 and sum(s.utterances for s in shards) < size:
        # rank 0 holds the whole (small) set
        plan = plan_shards(shards, 1, utt_offsets_of=offsets_of) + [[]] * (size - 1)
    else:
        plan = plan_shards(shards, size, utt_offsets_of=offsets_of, split=True if max_frames
                           else None)
    slices = plan[rank]
    # the last utterance is cut at the cap on the rank that holds it (the last frames
    # of its share)
    holds_last = past and any(s.end_utt == shards[-1].utterances
                              and s.shard_index == len(shards) - 1 for s in slices)
    limit = sum(s.frames for s in slices) - past if holds_last else None
    mean, scale = backend.to_host(net.cmvn_mean), backend.to_host(net.cmvn_scale)
    return _read_eval_chunks(manifest, net, plan_chunks(manifest, slices, 100_000), limit,
                             mean, scale)


def first_frames(shards, offsets_of, max_frames: int) -> tuple:
    """The part of ``shards`` that holds their first ``max_frames`` frames: (shards, in
    order, the last cut after the utterance that reaches the cap; their offsets'
    callback; the frames of that utterance past the cap).

    Example::

        first_frames(manifest.shards, shard_offsets_reader(manifest), 5000)
    """
    taken = 0
    for i, info in enumerate(shards):
        if taken + info.frames < max_frames:
            taken += info.frames
            continue
        offsets = np.asarray(offsets_of(i))
        end = int(np.searchsorted(offsets, max_frames - taken, side="left"))
        cut = offsets[:end + 1]
        part = list(shards[:i]) + [ShardInfo(info.path, int(cut[-1]), end)]
        return (part, lambda j: cut if j == i else offsets_of(j),
                taken + int(cut[-1]) - max_frames)
    return list(shards), offsets_of, 0


def _read_eval_chunks(manifest, net, specs, limit, mean, scale):
    taken = 0
    for spec in specs:
        feats, labels, start, end = read_chunk(manifest, spec, mean, scale)
        if limit is not None and taken + len(labels) > limit:
            keep = limit - taken
            # the last kept frames still see their right context, as uncut
            reach = min(len(labels), keep + net.right_context)
            feats, labels = feats[:reach], labels[:keep]
            start, end = start[:keep], np.minimum(end[:keep], reach)
        chunk = tuple(backend.to_device(a, net.xp) for a in (feats, labels, start, end))
        del feats, labels, start, end        # only the caller holds the chunk now
        taken += len(chunk[1])
        yield chunk
        del chunk
        if limit is not None and taken >= limit:
            break


def evaluate_chunks(net, chunks) -> tuple:
    """Local sums (cross-entropy, correct, frames) over the chunks."""
    xp = net.xp
    sums = xp.zeros(2, dtype=xp.float64)     # cross-entropy, correct: read once at the end
    frames = 0
    for feats, labels, start, end in chunks:
        for lo in range(0, len(labels), EVAL_BATCH):
            idx = xp.arange(lo, min(lo + EVAL_BATCH, len(labels)))
            ctx = splice_indices(idx, start[idx], end[idx], net.left_context, net.right_context)
            # each chunk's last, shorter batch: buffers of its own size, not kept
            net.evaluate_batch(splice(feats, ctx), labels[idx], into=sums,
                               keep_buffers=len(idx) == EVAL_BATCH)
            frames += len(idx)
    total, correct = backend.to_host(sums)
    return float(total), int(round(correct)), frames


def overflow_site(net, chunks) -> str | None:
    """Where ``net`` itself overflows (:meth:`~mpitrain.nn.network.Network.overflow_site`)
    on the first minibatch of ``chunks`` whose log posteriors are not finite; None when
    only features far outside the training range overflow it (or none does).  For the
    error of a score that was not finite: the chunks are scored again up to that batch."""
    from ..nn.loss import log_softmax
    xp = net.xp
    for feats, labels, start, end in chunks:
        for lo in range(0, len(labels), EVAL_BATCH):
            idx = xp.arange(lo, min(lo + EVAL_BATCH, len(labels)))
            rows = splice(feats, splice_indices(idx, start[idx], end[idx], net.left_context,
                                                net.right_context))
            with np.errstate(all="ignore"):
                finite = bool(xp.isfinite(log_softmax(
                    net.forward(rows, keep_buffers=False))).all())
            if not finite:
                return net.overflow_site(rows)
    return None


class WholeHeldOut:
    """The whole held-out set, scored by one rank alone while the others train (an
    asynchronous method's rank 0); its chunks are read at the first score.

    Example::

        held_out = WholeHeldOut(dev_manifest, max_frames=0)
        xent, acc, frames = held_out.score(net)
    """

    def __init__(self, manifest, *, max_frames: int = 0):
        self.manifest, self.max_frames = manifest, int(max_frames)
        self._chunks = None

    def score(self, net) -> tuple:
        """(cross-entropy per frame, frame accuracy, frames) of ``net``'s parameters."""
        if self._chunks is None:
            self._chunks = load_eval_chunks(self.manifest, net, rank=0, size=1,
                                            max_frames=self.max_frames)
        total, correct, frames = evaluate_chunks(net, self._chunks)
        frames = max(frames, 1)
        return total / frames, correct / frames, frames
