"""Check a corpus directory thoroughly before a long training run.

``check_corpus`` reads the manifest and every shard in full (in blocks, so
memory stays small) and reports every problem it finds, each naming the file
and the field or dataset.  An empty list means the corpus is sound.

Example::

    problems = check_corpus("data/train")
    for line in problems:
        print(line)
"""

from __future__ import annotations

import os

import numpy as np

from .corpus import (CorpusError, MomentAccumulator, manifest_path, manifest_problems,
                     read_manifest_data)
from .shards import FEATS, LABELS, UTT_IDS, shard_layout_problems, shard_storage_problems

_BLOCK_FRAMES = 1 << 16


def _h5py():
    import h5py
    return h5py


def _positive_int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _shard_entries(data) -> list[tuple[int, str, int | None, int | None]]:
    """(index, relative path, frames, utterances) of the shard entries usable as such."""
    entries = []
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list):
        return entries
    for i, entry in enumerate(shards):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"]:
            frames, utts = entry.get("frames"), entry.get("utterances")
            entries.append((i, entry["path"],
                            frames if isinstance(frames, int) else None,
                            utts if isinstance(utts, int) else None))
    return entries


class _Totals:
    """What the shards hold, summed for the corpus-wide comparisons."""

    def __init__(self, feat_dim, num_classes):
        self.counts = np.zeros(num_classes or 1, dtype=np.int64)
        self.moments = MomentAccumulator(feat_dim) if feat_dim else None
        self.utt_ids: dict[str, str] = {}
        self.complete = True          # every shard was scanned in full


def _scan_shard(f, path, feat_dim, num_classes, totals, problems) -> None:
    feats, labels = f.get(FEATS), f.get(LABELS)
    usable = (hasattr(feats, "dtype") and hasattr(labels, "dtype") and feats.ndim == 2
              and labels.ndim == 1 and feats.shape[0] == labels.shape[0]
              and feats.dtype.kind == "f" and labels.dtype.kind in "iu")
    if not usable:
        totals.complete = False
        return
    if feat_dim and feats.shape[1] != feat_dim:
        problems.append(f"{path}: dataset '{FEATS}' has {feats.shape[1]} columns; "
                        f"expected feat_dim = {feat_dim} from the manifest")
        totals.complete = False
        return
    bad_labels = bad_feats = 0
    first_label = first_feat = None
    for start in range(0, feats.shape[0], _BLOCK_FRAMES):
        end = min(start + _BLOCK_FRAMES, feats.shape[0])
        block = np.asarray(feats[start:end], dtype=np.float32)
        finite = np.isfinite(block).all(axis=1)
        if not finite.all():
            bad_feats += int((~finite).sum())
            if first_feat is None:
                first_feat = start + int(np.argmin(finite))
        elif totals.moments is not None:
            totals.moments.add(block)
        lab = np.asarray(labels[start:end], dtype=np.int64)
        if num_classes:
            outside = (lab < 0) | (lab >= num_classes)
            if outside.any():
                bad_labels += int(outside.sum())
                if first_label is None:
                    k = int(np.argmax(outside))
                    first_label = (start + k, int(lab[k]))
                lab = lab[~outside]
            totals.counts += np.bincount(lab, minlength=num_classes)
    if bad_feats:
        problems.append(f"{path}: dataset '{FEATS}': {bad_feats} frame(s) contain NaN or inf, "
                        f"the first at frame {first_feat}")
        totals.complete = False
    if bad_labels:
        problems.append(f"{path}: dataset '{LABELS}': {bad_labels} label(s) outside "
                        f"[0, {num_classes}), the first is {first_label[1]} at frame "
                        f"{first_label[0]}")
        totals.complete = False


def _check_shard(directory, index, rel, frames, utts, feat_dim, num_classes, totals,
                 problems) -> None:
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
        problems.append(f"{path}: shard file is missing (listed as shards[{index}].path in "
                        f"{manifest_path(directory)})")
        totals.complete = False
        return
    try:
        f = _h5py().File(path, "r")
    except OSError as exc:
        problems.append(f"{path}: cannot open as HDF5 ({exc})")
        totals.complete = False
        return
    with f:
        unsafe = shard_storage_problems(f, path)
        if unsafe:
            # Declared sizes the file does not back: reading would allocate them.
            problems.extend(unsafe)
            totals.complete = False
            return
        layout = shard_layout_problems(f, path)
        problems.extend(layout)
        if layout:
            totals.complete = False
        feats = f.get(FEATS)
        offsets = f.get("utt_offsets")
        if frames is not None and hasattr(feats, "shape") and feats.shape[0] != frames:
            problems.append(f"{path}: dataset '{FEATS}' has {feats.shape[0]} frames; the manifest "
                            f"(shards[{index}].frames) says {frames}")
        if utts is not None and hasattr(offsets, "shape") and offsets.shape[0] - 1 != utts:
            problems.append(f"{path}: dataset 'utt_offsets' lists {offsets.shape[0] - 1} "
                            f"utterances; the manifest (shards[{index}].utterances) says {utts}")
        ids = f.get(UTT_IDS)
        if hasattr(ids, "dtype") and ids.ndim == 1 and _h5py().check_string_dtype(ids.dtype):
            for utt in ids.asstr()[()]:
                if utt in totals.utt_ids:
                    problems.append(f"{path}: dataset '{UTT_IDS}': utterance {utt!r} also "
                                    f"appears in {totals.utt_ids[utt]}")
                    break
                totals.utt_ids[utt] = path
        _scan_shard(f, path, feat_dim, num_classes, totals, problems)


def _compare_totals(manifest, totals, problems) -> None:
    where = manifest.manifest_path
    counts = totals.counts
    expected = np.asarray(manifest.class_counts, dtype=np.int64)
    if not np.array_equal(counts, expected):
        differ = np.flatnonzero(counts != expected)[:5]
        shown = ", ".join(f"class {c}: data {counts[c]}, manifest {expected[c]}" for c in differ)
        problems.append(f"{where}: field 'class_counts' does not match the shards' labels "
                        f"({shown})")
    moments = totals.moments
    if moments is None or moments.count == 0:
        return
    mean, var = np.asarray(manifest.cmvn_mean), np.asarray(manifest.cmvn_var)
    scale = np.sqrt(np.maximum(moments.var, 1e-12))
    # Stored as decimal text: allow rounding, not a different corpus.
    if np.max(np.abs(moments.mean - mean) / scale) > 1e-3:
        problems.append(f"{where}: field 'cmvn.mean' does not match the mean of the shards' "
                        "features")
    if np.max(np.abs(moments.var - var) / np.maximum(moments.var, 1e-12)) > 1e-3:
        problems.append(f"{where}: field 'cmvn.var' does not match the variance of the shards' "
                        "features")


def check_corpus(corpus_dir: str) -> list[str]:
    """Every problem of a corpus directory as messages naming file and field; [] when sound.

    Checks the manifest fields, that each shard exists and opens, its datasets
    (presence, dtype, shape), offsets (start 0, strictly increasing, end at T),
    labels in ``[0, num_classes)``, finite features, frames and utterances
    against the manifest, class counts, CMVN statistics and unique utterance ids.

    Example::

        assert check_corpus("data/train") == []
    """
    directory = os.path.abspath(str(corpus_dir))
    path = manifest_path(directory)
    try:
        data = read_manifest_data(path)
    except CorpusError as exc:
        return [str(exc)]
    manifest, problems = manifest_problems(data, path)
    feat_dim = _positive_int(data.get("feat_dim")) if isinstance(data, dict) else None
    num_classes = _positive_int(data.get("num_classes")) if isinstance(data, dict) else None

    totals = _Totals(feat_dim, num_classes)
    for index, rel, frames, utts in _shard_entries(data):
        _check_shard(directory, index, rel, frames, utts, feat_dim, num_classes, totals, problems)
    if manifest is not None and totals.complete:
        _compare_totals(manifest, totals, problems)
    return problems
