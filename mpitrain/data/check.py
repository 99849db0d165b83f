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

from .corpus import (MAX_CLASSES, CorpusError, MomentAccumulator, manifest_path,
                     manifest_problems, read_manifest_data)
from .shards import MAX_FEAT_DIM, UTT_IDS
from .validate import ShardCheck, empty_corpus_problems


def _positive_int(value, limit: int):
    """``value`` when it is an int in [1, limit], else None: a size the manifest
    declares is used to allocate only within the limit its check enforces."""
    return value if isinstance(value, int) and not isinstance(value, bool) \
        and 0 < value <= limit else None


def _shard_entries(data) -> list[tuple[int, str, int | None, int | None]]:
    """(index, relative path, frames, utterances) of the shard entries usable as such."""
    entries = []
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list):
        return entries
    for i, entry in enumerate(shards):
        path = entry.get("path") if isinstance(entry, dict) else None
        # a path outside the corpus directory is reported by the manifest check and
        # never opened
        if isinstance(path, str) and path and not os.path.isabs(path) \
                and ".." not in path.replace("\\", "/").split("/"):
            frames, utts = entry.get("frames"), entry.get("utterances")
            entries.append((i, entry["path"],
                            frames if isinstance(frames, int) else None,
                            utts if isinstance(utts, int) else None))
    return entries


class _Totals:
    """What the shards hold, summed for the corpus-wide comparisons."""

    def __init__(self, feat_dim, num_classes):
        self.num_classes = num_classes
        self.counts = np.zeros(num_classes or 1, dtype=np.int64)
        self.moments = MomentAccumulator(feat_dim) if feat_dim else None
        self.utt_ids: dict[str, str] = {}
        self.complete = True          # every shard was scanned in full and found sound

    def add_block(self, feats, labels) -> None:
        self.counts += np.bincount(labels, minlength=self.num_classes)
        if self.moments is not None:
            self.moments.add(feats)


def _check_shard(directory, index, rel, frames, utts, feat_dim, num_classes, totals,
                 problems) -> None:
    path = os.path.join(directory, rel)
    with ShardCheck(path, feat_dim=feat_dim,
                    listed_as=f"shards[{index}].path in {manifest_path(directory)}") as shard:
        shard.compare_listing(index, frames=frames, utterances=utts,
                              manifest=manifest_path(directory))
        if shard.num_frames is not None:
            shard.scan(0, shard.num_frames, num_classes=num_classes, on_block=totals.add_block)
        ids = shard.utt_ids() or ()
    problems.extend(shard.problems)
    if shard.problems:
        totals.complete = False
    for utt in ids:
        # (what the corpus writer refuses: export writes the ids as Kaldi archive keys)
        if not utt or any(letter.isspace() for letter in utt):
            problems.append(f"{path}: dataset '{UTT_IDS}': utterance id {utt!r} is empty or "
                            "holds whitespace, which a Kaldi id cannot")
            break
        if utt in totals.utt_ids:
            where = "twice in this shard" if totals.utt_ids[utt] == path else \
                f"also in {totals.utt_ids[utt]}"
            problems.append(f"{path}: dataset '{UTT_IDS}': utterance {utt!r} appears {where}")
            break
        totals.utt_ids[utt] = path


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
    if manifest is not None:
        problems += empty_corpus_problems(manifest)
    # (a declared size over its limit is a problem reported above; the shards are
    # still checked, without the totals that would need it)
    feat_dim = _positive_int(data.get("feat_dim"), MAX_FEAT_DIM) \
        if isinstance(data, dict) else None
    num_classes = _positive_int(data.get("num_classes"), MAX_CLASSES) \
        if isinstance(data, dict) else None

    totals = _Totals(feat_dim, num_classes)
    for index, rel, frames, utts in _shard_entries(data):
        _check_shard(directory, index, rel, frames, utts, feat_dim, num_classes, totals, problems)
    if manifest is not None and totals.complete:
        _compare_totals(manifest, totals, problems)
    return problems
