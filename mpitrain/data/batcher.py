"""Shuffled minibatches from chunks of a rank's shards.

A rank's data (its shard slices) is cut into chunks of whole utterances of
about ``chunk_frames`` frames.  Each epoch visits the chunks in a shuffled
order; inside a chunk the frames are shuffled and cut into minibatches (the
remainder of a chunk, less than one minibatch, is dropped, as Kaldi does).
The next chunk is read by a background thread while the current one trains.

Every random order is derived from (seed, rank, epoch, chunk position), so the
reader's whole state is its position ``(epoch, chunk, batch)``: a resumed run
draws exactly the minibatches an uninterrupted run would.
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass

import numpy as np

from ..backend import to_device
from .corpus import CorpusError
from .shards import ShardReader
from .splice import frame_utterance_bounds


#: The fields of a reader's position (:meth:`MinibatchStream.state_dict`).
POSITION_FIELDS = ("epoch", "chunk_pos", "batch_pos", "steps_in_epoch")


@dataclass(frozen=True)
class ChunkSpec:
    """A run of whole utterances in one shard."""
    shard_index: int
    start_utt: int
    end_utt: int
    frames: int


@dataclass
class Chunk:
    """A chunk in memory: normalised features, labels, per-frame utterance bounds."""
    spec: ChunkSpec
    feats: object
    labels: object
    utt_start: object
    utt_end: object

    @property
    def frames(self) -> int:
        return self.spec.frames


def plan_chunks(manifest, slices, chunk_frames: int) -> list:
    """Cut shard slices (from ``sharding.assign_shards``) into chunks.

    Example::

        chunks = plan_chunks(manifest, assign_shards(manifest.shards, 0, 1), 200_000)
    """
    chunks = []
    for sl in slices:
        with ShardReader(manifest.shard_path(sl.shard_index)) as reader:
            offsets = np.asarray(reader.utt_offsets)
        start = sl.start_utt
        while start < sl.end_utt:
            # whole utterances until the chunk reaches chunk_frames
            target = offsets[start] + chunk_frames
            end = int(np.searchsorted(offsets, target, side="left"))
            end = min(max(end, start + 1), sl.end_utt)
            chunks.append(ChunkSpec(sl.shard_index, start, end,
                                    int(offsets[end] - offsets[start])))
            start = end
    return chunks


def shard_stamp(path: str) -> tuple:
    """What tells a shard file from one written again at its path: its inode
    (a new file renamed into place), size and modification time (one rewritten
    in place)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def stamp_shards(manifest, chunks) -> None:
    """Note the identity of the shards ``chunks`` read, as they are now (the start
    of a run), in ``manifest.stamps``; a shard that cannot be looked at now is
    noted at its first read (which names the problem)."""
    for index in sorted({c.shard_index for c in chunks}):
        try:
            manifest.stamps.setdefault(index, shard_stamp(manifest.shard_path(index)))
        except OSError:
            pass


def read_chunk(manifest, spec: ChunkSpec, cmvn_mean, cmvn_scale) -> tuple:
    """Read and normalise one chunk on the host (runs in the prefetch thread).

    The shard must still be the one planned from: a shard written again since
    (``prepare``/``synth``/``merge --overwrite`` into the corpus of a running
    job) is a :class:`CorpusError` naming it, never frames of other utterances
    or other labels of the same ones.  The sizes are compared with the
    manifest's, and the file with the one this run first read
    (:func:`shard_stamp`, after the read, so that a file replaced during the
    read is caught too).
    """
    path = manifest.shard_path(spec.shard_index)
    listed = manifest.shards[spec.shard_index]
    with ShardReader(path) as reader:
        held = reader.utt_offsets
        if (reader.num_frames, reader.num_utterances) != (listed.frames, listed.utterances):
            now = (f"{manifest.manifest_path} listed {listed.frames} frames in "
                   f"{listed.utterances} utterances when the run began, it holds "
                   f"{reader.num_frames} in {reader.num_utterances} now")
        elif int(held[spec.end_utt] - held[spec.start_utt]) != spec.frames:
            now = (f"utterances {spec.start_utt}:{spec.end_utt} held {spec.frames} frames when "
                   f"the run began, {int(held[spec.end_utt] - held[spec.start_utt])} now")
        else:
            now = None
        if now is not None:
            raise CorpusError(
                f"{path}: the shard changed while this run read it ({now}); a corpus must "
                "not be written again (prepare, synth, merge --overwrite) while a run reads "
                "it: restore it and --resume, or start a new run")
        feats, labels, offsets = reader.read(spec.start_utt, spec.end_utt)
        stamp = shard_stamp(path)
    if manifest.stamps.setdefault(spec.shard_index, stamp) != stamp:
        raise CorpusError(
            f"{path}: the shard changed while this run read it (the file was replaced or "
            "rewritten since the run first read it); a corpus must not be written again "
            "(prepare, synth, merge --overwrite) while a run reads it: restore it and "
            "--resume, or start a new run")
    feats = np.ascontiguousarray(feats, dtype=np.float32)
    feats -= cmvn_mean
    feats *= cmvn_scale
    start, end = frame_utterance_bounds(np.asarray(offsets))
    return feats, np.ascontiguousarray(labels, dtype=np.int32), start, end


def _check_position(name: str, value: int, low: int, high) -> None:
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"field '{name}': {value} is out of range {bound} for this rank's "
                         "data")


class MinibatchStream:
    """Endless stream of (chunk, frame indices) minibatches over epochs.

    ``steps_per_epoch`` caps the batches taken per epoch; ranks pass the minimum
    over all ranks so that every rank makes the same number of collective calls.

    Example::

        stream = MinibatchStream(manifest, chunks, minibatch=256, seed=1, rank=0,
                                 cmvn=(mean, scale), xp=numpy)
        chunk, idx = stream.next_batch()
    """

    def __init__(self, manifest, chunks, *, minibatch: int, seed: int, rank: int,
                 cmvn, xp=np, steps_per_epoch: int | None = None, prefetch: bool = True):
        if minibatch < 1:
            raise ValueError(f"minibatch must be >= 1, got {minibatch}")
        self.manifest, self.chunks = manifest, list(chunks)
        self.minibatch, self.seed, self.rank, self.xp = int(minibatch), int(seed), int(rank), xp
        self.cmvn_mean = np.asarray(cmvn[0], dtype=np.float32)
        self.cmvn_scale = np.asarray(cmvn[1], dtype=np.float32)
        self.local_steps_per_epoch = sum(c.frames // self.minibatch for c in self.chunks)
        self.steps_per_epoch = self.local_steps_per_epoch if steps_per_epoch is None \
            else int(steps_per_epoch)
        if self.steps_per_epoch > self.local_steps_per_epoch:
            raise ValueError(f"steps_per_epoch {self.steps_per_epoch} exceeds the "
                             f"{self.local_steps_per_epoch} minibatches this rank holds")
        self.epoch = self.chunk_pos = self.batch_pos = 0
        self.steps_in_epoch = 0
        stamp_shards(manifest, self.chunks)
        self._executor = concurrent.futures.ThreadPoolExecutor(1) if prefetch else None
        self._pending = {}
        self._current_key = None
        self._current = None
        self._perm = None

    # -- deterministic orders ----------------------------------------------------
    def chunk_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.rank, epoch]).permutation(len(self.chunks))

    def frame_order(self, epoch: int, chunk_pos: int, frames: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, epoch, chunk_pos, 1])
        return rng.permutation(frames)

    # -- position ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position: one int per name of :data:`POSITION_FIELDS`."""
        return {"epoch": self.epoch, "chunk_pos": self.chunk_pos, "batch_pos": self.batch_pos,
                "steps_in_epoch": self.steps_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Stand where ``state`` (from :meth:`state_dict`) stood; ValueError naming the
        field when the position does not exist in this rank's chunks, or lacks one."""
        missing = [name for name in POSITION_FIELDS if name not in state]
        if missing:
            # (a KeyError traceback on resume)
            raise ValueError(f"field '{missing[0]}' is missing")
        epoch, chunk_pos = int(state["epoch"]), int(state["chunk_pos"])
        batch_pos, steps_in_epoch = int(state["batch_pos"]), int(state["steps_in_epoch"])
        _check_position("epoch", epoch, 0, None)
        _check_position("chunk_pos", chunk_pos, 0, max(len(self.chunks) - 1, 0))
        if self.chunks:
            batches = self._spec_at(epoch, chunk_pos).frames // self.minibatch
            _check_position("batch_pos", batch_pos, 0, batches)
        _check_position("steps_in_epoch", steps_in_epoch, 0, self.steps_per_epoch)
        self.epoch, self.chunk_pos = epoch, chunk_pos
        self.batch_pos, self.steps_in_epoch = batch_pos, steps_in_epoch
        # a chunk's content and order depend on its position alone: keep the one
        # loaded if the position is still in it (a search trial rewinds here)
        if self._current_key != (self.epoch, self.chunk_pos):
            self._current_key = None

    def seek(self, epoch: int, steps_in_epoch: int) -> None:
        """Stand before minibatch ``steps_in_epoch`` of ``epoch`` (to continue a run
        whose reader positions belong to another number of ranks)."""
        if not 0 <= steps_in_epoch < max(self.steps_per_epoch, 1):
            raise ValueError(f"steps_in_epoch must be in [0, {self.steps_per_epoch}), "
                             f"got {steps_in_epoch}")
        self.epoch, self.chunk_pos, self.batch_pos = int(epoch), 0, int(steps_in_epoch)
        order = self.chunk_order(self.epoch)
        # walk the epoch's chunk order, each chunk holding frames // minibatch batches
        for pos, index in enumerate(order):
            batches = self.chunks[int(index)].frames // self.minibatch
            if self.batch_pos < batches:
                self.chunk_pos = pos
                break
            self.batch_pos -= batches
        self.steps_in_epoch = int(steps_in_epoch)
        self._current_key = None

    # -- reading -----------------------------------------------------------------
    def _spec_at(self, epoch: int, chunk_pos: int) -> ChunkSpec:
        return self.chunks[int(self.chunk_order(epoch)[chunk_pos])]

    def _submit(self, epoch: int, chunk_pos: int):
        key = (epoch, chunk_pos)
        if key not in self._pending:
            spec = self._spec_at(epoch, chunk_pos)
            args = (self.manifest, spec, self.cmvn_mean, self.cmvn_scale)
            if self._executor is None:
                self._pending[key] = _Done(read_chunk(*args))
            else:
                self._pending[key] = self._executor.submit(read_chunk, *args)
        return self._pending[key]

    def _next_position(self, epoch: int, chunk_pos: int, steps_after: int):
        """The position of the chunk the reader takes after (epoch, chunk_pos), once
        ``steps_after`` steps of ``epoch`` are done: an epoch cut short by
        ``steps_per_epoch`` goes on with the next epoch, and a chunk too short for a
        minibatch is passed over (reading ahead either read a chunk for nothing, and
        the rank waited for the one it took)."""
        if steps_after >= self.steps_per_epoch:
            epoch, chunk_pos = epoch + 1, -1
        for _ in range(2):
            order = self.chunk_order(epoch)
            for pos in range(chunk_pos + 1, len(self.chunks)):
                if self.chunks[int(order[pos])].frames >= self.minibatch:
                    return epoch, pos
            epoch, chunk_pos = epoch + 1, -1
        return epoch, 0

    def _load_current(self) -> None:
        key = (self.epoch, self.chunk_pos)
        feats, labels, start, end = self._submit(*key).result()
        self._pending.pop(key, None)
        # chunks read ahead for positions now behind (an epoch that ended before its
        # last chunks, as equal step counts ask) would otherwise stay in memory
        for stale in [k for k in self._pending if k < key]:
            self._pending.pop(stale).cancel()
        spec = self._spec_at(*key)
        xp = self.xp
        self._current = Chunk(spec, to_device(feats, xp), to_device(labels, xp),
                              to_device(start, xp), to_device(end, xp))
        perm = self.frame_order(self.epoch, self.chunk_pos, spec.frames)
        self._perm = to_device(perm, xp)
        self._current_key = key
        # start reading the chunk after this one while this one trains (without a
        # reading thread, not at all: it was read here and held as a second chunk,
        # and a damaged one failed the run a chunk early)
        if self._executor is not None:
            left = spec.frames // self.minibatch - self.batch_pos
            self._submit(*self._next_position(*key, self.steps_in_epoch + left))

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.chunk_pos = self.batch_pos = self.steps_in_epoch = 0

    def next_batch(self):
        """Return (chunk, idx): ``idx`` indexes ``chunk.feats`` rows for one minibatch."""
        if self.steps_per_epoch == 0:
            raise ValueError("no complete minibatch in this rank's data: lower the minibatch "
                             "size or give the rank more data")
        if self.steps_in_epoch >= self.steps_per_epoch:
            self._advance_epoch()
        while True:
            spec = self._spec_at(self.epoch, self.chunk_pos)
            if self.batch_pos < spec.frames // self.minibatch:
                break
            self.chunk_pos, self.batch_pos = self.chunk_pos + 1, 0
            if self.chunk_pos >= len(self.chunks):
                self._advance_epoch()
        if self._current_key != (self.epoch, self.chunk_pos):
            self._load_current()
        b = self.minibatch
        idx = self._perm[self.batch_pos * b:(self.batch_pos + 1) * b]
        self.batch_pos += 1
        self.steps_in_epoch += 1
        return self._current, idx

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending.clear()


class _Done:
    """A finished result with the Future interface (no prefetch thread)."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value

    def cancel(self) -> bool:
        return False
