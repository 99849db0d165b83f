"""Check the frames a rank will train on, before step 1, in bounded memory.

A bad frame found mid-run costs the hours before it and surfaces as a numpy
traceback, or not at all (NaN features train to a NaN model).  So every rank
checks its own part of the corpus first: each shard opens as HDF5, its
datasets pass :func:`shards.shard_storage_problems` and
:func:`shards.shard_layout_problems`, its frames and utterances match the
manifest, ``feats`` has the manifest's ``feat_dim``, and the rank's frames
are scanned in blocks of :data:`BLOCK_FRAMES` for NaN or inf features and
labels outside ``[0, num_classes)``.  Every problem is one line naming the
file, the dataset and the record.

:class:`ShardCheck` does the work for one shard; ``check.check_corpus`` uses
it too, for every frame of every shard.

Example::

    slices = plan_shards(manifest.shards, size, utt_offsets_of=offsets_of)[rank]
    problems = validate_slices(manifest, slices, num_classes=manifest.num_classes)
    problems += validate_corpus(dev_manifest, rank=rank, size=size,
                                num_classes=manifest.num_classes)
    if problems:
        raise CorpusError("\\n".join(problems))
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from ..h5io import h5_reader
from .corpus import CorpusError
from .shards import (FEATS, HDF5_ERRORS, LABELS, UTT_IDS, UTT_OFFSETS, ShardFile, hdf5_reason,
                     read_utt_ids, shard_layout_problems, shard_storage_problems)

# Frames per read, at most: 10 MiB of float32 features at D = 40, so memory stays
# small and numpy's per-call cost is spread over many frames.  Wider features
# are read in fewer frames, never more than BLOCK_BYTES of them.
BLOCK_FRAMES = 1 << 16
BLOCK_BYTES = 10 << 20


def _h5py():
    import h5py
    return h5py


def _dataset(f, name):
    obj = f.get(name)
    return obj if isinstance(obj, _h5py().Dataset) else None


class ShardCheck(ShardFile):
    """One shard opened for checking; each problem found is a line in ``problems``.

    Opening checks that the file exists and opens as HDF5, the storage and
    layout of its datasets, and ``feat_dim``; nothing is scanned until
    :meth:`scan`.  A file damaged on disk gives a line naming it (and the
    dataset, where the damage is in one) instead of h5py's exception.

    Example::

        with ShardCheck("corpus/shard-00000.h5", feat_dim=40) as shard:
            shard.compare_listing(0, frames=90138, utterances=293,
                                  manifest="corpus/corpus.yaml")
            shard.scan(0, shard.num_frames, num_classes=120)
        assert shard.problems == []
    """

    def __init__(self, path: str, *, feat_dim: int | None = None, listed_as: str = ""):
        self.path = str(path)
        self.problems: list[str] = []
        self.num_frames: int | None = None        # rows of 'feats', when 2-D
        self.num_utterances: int | None = None    # entries of 'utt_offsets' minus one
        self._file = None
        self._unsafe = False
        self._offsets: np.ndarray | None = None   # set only when consistent with 'feats'
        self._scannable = False
        if not os.path.isfile(self.path):
            where = f" (listed as {listed_as})" if listed_as else ""
            # (a directory or a pipe there is not "missing": the user looks for the file)
            what = ("is a directory, not a shard file" if os.path.isdir(self.path) else
                    "is not a regular file (a named pipe, socket or device), not a shard "
                    "file" if os.path.exists(self.path) else "shard file is missing")
            self.problems.append(f"{self.path}: {what}{where}")
            return
        try:
            self._file = h5_reader(self.path)
        except OSError as exc:
            self.problems.append(f"{self.path}: cannot open as HDF5 ({exc})")
            return
        try:
            self._inspect(feat_dim)
        except HDF5_ERRORS as exc:
            self._scannable = False
            self.problems.append(f"{self.path}: cannot read the shard's structure "
                                 f"({hdf5_reason(exc)}); the file is damaged")
        except BaseException:
            self.close()
            raise

    def _inspect(self, feat_dim) -> None:
        f, path = self._file, self.path
        unsafe = shard_storage_problems(f, path)
        if unsafe:
            # Declared sizes the file does not back: reading would allocate them,
            # so nothing of this file is read (utt_ids included).
            self.problems.extend(unsafe)
            self._unsafe = True
            return
        self.problems.extend(shard_layout_problems(f, path))
        feats, labels, offsets = _dataset(f, FEATS), _dataset(f, LABELS), _dataset(f, UTT_OFFSETS)
        if feats is not None and feats.ndim == 2:
            self.num_frames = int(feats.shape[0])
        if offsets is not None and offsets.ndim == 1 and offsets.shape[0] >= 1:
            self.num_utterances = int(offsets.shape[0]) - 1
            if (offsets.dtype.kind in "iu" and self.num_frames is not None
                    and offsets.shape[0] <= self.num_frames + 1):
                values = np.asarray(offsets[()], dtype=np.int64)
                # Utterance names in messages only where the offsets can be trusted.
                if values[0] == 0 and values[-1] == self.num_frames \
                        and bool(np.all(values[1:] > values[:-1])):
                    self._offsets = values
        if feat_dim and self.num_frames is not None and feats.shape[1] != feat_dim:
            self.problems.append(f"{path}: dataset '{FEATS}' has {feats.shape[1]} columns; "
                                 f"expected feat_dim = {feat_dim} from the manifest")
            return
        # Scanned where values can be read as numbers; shard_layout_problems names the rest.
        self._scannable = (self.num_frames is not None and labels is not None
                           and labels.ndim == 1 and labels.shape[0] == self.num_frames
                           and feats.dtype.kind == "f" and labels.dtype.kind in "iu")

    def compare_listing(self, index: int, *, frames: int | None, utterances: int | None,
                        manifest: str) -> None:
        """Frames and utterances of the shard against ``shards[index]`` of the manifest.

        Example::

            shard.compare_listing(3, frames=90045, utterances=302, manifest="corpus.yaml")
        """
        if frames is not None and self.num_frames is not None and self.num_frames != frames:
            self.problems.append(f"{self.path}: dataset '{FEATS}' has {self.num_frames} "
                                 f"frames; the manifest {manifest} (shards[{index}].frames) "
                                 f"says {frames}")
        if utterances is not None and self.num_utterances is not None \
                and self.num_utterances != utterances:
            self.problems.append(f"{self.path}: dataset '{UTT_OFFSETS}' lists "
                                 f"{self.num_utterances} utterances; the manifest {manifest} "
                                 f"(shards[{index}].utterances) says {utterances}")

    def frame_range(self, start_utt: int, end_utt: int) -> tuple[int, int] | None:
        """Frames ``(first, end)`` of utterances ``start_utt:end_utt``; None if unknown.

        Example::

            first, end = shard.frame_range(0, 10)
        """
        if self._offsets is None:
            return None              # shard_layout_problems has said why
        count = self._offsets.shape[0] - 1
        if not 0 <= start_utt <= end_utt <= count:
            self.problems.append(f"{self.path}: dataset '{UTT_OFFSETS}': utterances "
                                 f"{start_utt}:{end_utt} are planned for reading but the "
                                 f"shard holds 0:{count}")
            return None
        return int(self._offsets[start_utt]), int(self._offsets[end_utt])

    def utt_ids(self) -> list[str] | None:
        """All utterance ids, or None where ``utt_ids`` is unusable (a problem says why).

        Example::

            ids = shard.utt_ids()
        """
        if self._unsafe:
            return None
        ids = _dataset(self._file, UTT_IDS) if self._file is not None else None
        if ids is None or ids.ndim != 1 or _h5py().check_string_dtype(ids.dtype) is None:
            return None
        try:
            return read_utt_ids(self._file, self.path)
        except CorpusError as exc:
            self.problems.append(str(exc))
            return None
        except HDF5_ERRORS as exc:
            self.problems.append(f"{self.path}: dataset '{UTT_IDS}' cannot be read "
                                 f"({hdf5_reason(exc)}); the file is damaged")
            return None

    def _record(self, frame: int) -> str:
        """'frame F (utterance 'u', frame k of it)': where a bad value sits."""
        if self._offsets is None:
            return f"frame {frame}"
        u = int(np.searchsorted(self._offsets, frame, side="right")) - 1
        name = f"#{u}"
        ids = _dataset(self._file, UTT_IDS)
        if ids is not None and ids.ndim == 1 and ids.shape[0] > u \
                and _h5py().check_string_dtype(ids.dtype) is not None:
            try:
                # an id that is not UTF-8 is shown with its bytes escaped
                name = repr(ids.asstr(errors="backslashreplace")[u])
            except HDF5_ERRORS:
                pass                 # the index still names the record
        return f"frame {frame} (utterance {name}, frame {frame - int(self._offsets[u])} of it)"

    def scan(self, first: int, end: int, *, num_classes: int | None,
             on_block: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        """Scan frames ``first:end`` for NaN or inf features and labels outside the classes.

        Reads :data:`BLOCK_FRAMES` frames (at most :data:`BLOCK_BYTES` of
        features) at a time.  ``num_classes=None`` leaves labels unchecked.
        ``on_block(feats, labels)`` is called with every block found sound
        (when ``num_classes`` is given), for totals.

        Example::

            shard.scan(0, shard.num_frames, num_classes=120)
        """
        if not self._scannable:
            return
        # A span the manifest planned past the frames stored (compare_listing
        # names the mismatch) is scanned as far as the shard goes.
        end = min(end, self.num_frames)
        if end <= first:
            return
        feats, labels = self._file[FEATS], self._file[LABELS]
        row_bytes = feats.shape[1] * feats.dtype.itemsize
        block = max(1, min(BLOCK_FRAMES, BLOCK_BYTES // max(row_bytes, 1), end - first))
        feat_buf = np.empty((block, feats.shape[1]), dtype=feats.dtype)
        label_buf = np.empty(block, dtype=labels.dtype)
        bad_feats = bad_labels = 0
        first_feat = first_label = None
        for start in range(first, end, block):
            stop = min(start + block, end)
            fb, lb = feat_buf[:stop - start], label_buf[:stop - start]
            for name, ds, buf in ((FEATS, feats, fb), (LABELS, labels, lb)):
                try:
                    ds.read_direct(buf, np.s_[start:stop])
                except HDF5_ERRORS as exc:
                    self.problems.append(f"{self.path}: dataset '{name}': cannot read frames "
                                         f"{start}:{stop} ({hdf5_reason(exc)}); the file is "
                                         "damaged")
                    return
            sound = True
            if not np.isfinite(fb).all():
                rows = ~np.isfinite(fb).all(axis=1)
                bad_feats += int(rows.sum())
                if first_feat is None:
                    first_feat = start + int(np.argmax(rows))
                sound = False
            if num_classes is not None:
                if lb.min() < 0 or lb.max() >= num_classes:
                    outside = (lb < 0) | (lb >= num_classes)
                    bad_labels += int(outside.sum())
                    if first_label is None:
                        k = int(np.argmax(outside))
                        first_label = (start + k, int(lb[k]))
                    sound = False
                if sound and on_block is not None:
                    on_block(fb, lb)
        part = "" if (first, end) == (0, self.num_frames) else f" (of frames {first}:{end})"
        if bad_feats:
            self.problems.append(f"{self.path}: dataset '{FEATS}': {bad_feats} frame(s){part} "
                                 f"contain NaN or inf, the first at {self._record(first_feat)}; "
                                 "expected finite features")
        if bad_labels:
            self.problems.append(f"{self.path}: dataset '{LABELS}': {bad_labels} label(s){part} "
                                 f"outside [0, {num_classes}), the first is {first_label[1]} at "
                                 f"{self._record(first_label[0])}")


def _check_shard(manifest, index: int, num_classes: int, *, utterances=(), frames=()):
    """Open shard ``index``, compare it with the manifest, scan the given spans.

    ``utterances`` are (start_utt, end_utt) pairs, ``frames`` (first, end) pairs.
    """
    info = manifest.shards[index]
    with ShardCheck(manifest.shard_path(index), feat_dim=manifest.feat_dim,
                    listed_as=f"shards[{index}].path in {manifest.manifest_path}") as shard:
        shard.compare_listing(index, frames=info.frames, utterances=info.utterances,
                              manifest=manifest.manifest_path)
        spans = [shard.frame_range(start, end) for start, end in utterances] + list(frames)
        for span in spans:
            if span is not None:
                shard.scan(*span, num_classes=num_classes)
    return shard.problems


def validate_slices(manifest, slices: Sequence, *, num_classes: int | None = None) -> list[str]:
    """Every problem of the shard slices one rank reads, as lines naming file and record.

    ``slices`` are ``sharding.ShardSlice`` (a rank's part of ``plan_shards``);
    ``num_classes`` is the model's output count (default: the manifest's).
    Only the slices' shards are opened and only their frames scanned, so the
    cost is one sequential read of the rank's data.  ``[]`` means sound.

    Example::

        slices = assign_shards(manifest.shards, rank, size)
        for line in validate_slices(manifest, slices, num_classes=120):
            print(line)
    """
    num_classes = manifest.num_classes if num_classes is None else int(num_classes)
    by_shard: dict[int, list] = {}
    for sl in slices:
        by_shard.setdefault(int(sl.shard_index), []).append(sl)
    problems: list[str] = []
    for index, group in sorted(by_shard.items()):
        if not 0 <= index < len(manifest.shards):
            problems.append(f"{manifest.manifest_path}: field 'shards': a slice names shard "
                            f"{index} but the manifest lists {len(manifest.shards)}")
            continue
        problems += _check_shard(manifest, index, num_classes,
                                 utterances=[(sl.start_utt, sl.end_utt) for sl in group])
    return problems


def empty_corpus_problems(manifest) -> list[str]:
    """One line if the manifest lists no frames or no utterances; ``[]`` otherwise.

    Example::

        empty_corpus_problems(load_manifest("data/train"))    # [] for a usable corpus
    """
    where = manifest.manifest_path
    if manifest.num_frames == 0:
        return [f"{where}: field 'num_frames' is 0 ({len(manifest.shards)} shard(s), "
                f"{manifest.num_utterances} utterance(s)); expected a corpus with at least "
                "one frame"]
    if manifest.num_utterances == 0:
        return [f"{where}: field 'num_utterances' is 0 but 'num_frames' is "
                f"{manifest.num_frames}; expected at least one utterance"]
    return []


def corpus_frame_ranges(manifest, rank: int, size: int) -> dict[int, tuple[int, int]]:
    """Rank ``rank``'s share of all frames for checking: shard index -> (first, end).

    The corpus's frames, shard after shard, are cut into ``size`` near-equal
    runs by the manifest's counts alone (no file is read).  A shard holding
    no frames goes to rank ``index % size``, so that its layout is checked.

    Example::

        corpus_frame_ranges(manifest, 0, 2)    # {0: (0, 90138), 1: (0, 89964)}
    """
    total = sum(s.frames for s in manifest.shards)
    low, high = total * rank // size, total * (rank + 1) // size
    ranges, base = {}, 0
    for index, info in enumerate(manifest.shards):
        first, end = max(low - base, 0), min(high - base, info.frames)
        if first < end or (info.frames == 0 and index % size == rank):
            ranges[index] = (first, max(first, end))
        base += info.frames
    return ranges


def validate_corpus(manifest, *, rank: int = 0, size: int = 1,
                    num_classes: int | None = None) -> list[str]:
    """Every problem of rank ``rank``'s ``1/size`` share of a whole corpus (e.g. held-out).

    The same checks as :func:`validate_slices`, over the frames
    :func:`corpus_frame_ranges` gives this rank; with the defaults, the whole
    corpus.  An empty corpus is a problem on every rank.

    Example::

        problems = validate_corpus(load_manifest("data/dev"), rank=rank, size=size,
                                   num_classes=120)
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    num_classes = manifest.num_classes if num_classes is None else int(num_classes)
    problems = empty_corpus_problems(manifest)
    for index, frames in corpus_frame_ranges(manifest, rank, size).items():
        problems += _check_shard(manifest, index, num_classes, frames=[frames])
    return problems
