"""Merge corpora written side by side (e.g. by a Slurm job array) into one corpus.

Each part is an ordinary corpus directory inside the merged one, e.g.
``corpora/train/part-00003/``.  The merged ``corpora/train/corpus.yaml`` lists
the parts' shards by their relative paths (``part-00003/shard-00000.h5``), so
nothing is copied: the trainer reads the shards where the parts wrote them.
Class counts are summed and the global CMVN statistics are pooled exactly
from each part's frame count, mean and variance.

Example::

    manifest = merge_corpora("corpora/train",
                             ["corpora/train/part-00000", "corpora/train/part-00001"])
    manifest.num_frames         # frames of both parts
"""

from __future__ import annotations

import os

import numpy as np

from ..files import read_yaml, write_yaml
from .corpus import (CorpusError, CorpusManifest, ShardInfo, load_manifest, manifest_path,
                     speaker_cmvn_kind, write_manifest)
from .kaldi import REPORT_NAME

__all__ = ["merge_corpora", "merge_import_reports"]


def merge_corpora(out_dir: str, parts, *, num_classes: int | None = None,
                  overwrite: bool = False) -> CorpusManifest:
    """Write ``out_dir/corpus.yaml`` covering the shards of every corpus in ``parts``.

    ``parts`` are corpus directories inside ``out_dir`` (shard paths in a
    manifest must stay inside its directory).  All parts need the same
    ``feat_dim``; ``num_classes`` defaults to the largest of the parts' (a part
    whose alignments never reach the top pdf ids has fewer classes; its counts
    are padded with zeros).  Utterance ids must be unique across parts.  When
    the parts hold ``import-report.yaml`` files, a merged one is written too.

    Example::

        merge_corpora("corpora/train", [f"corpora/train/part-{i:05d}" for i in range(8)],
                      num_classes=3456)
    """
    parts = [str(p) for p in parts]
    if not parts:
        raise ValueError(f"{out_dir}: no part corpora to merge")
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, int) or num_classes < 1):
        raise ValueError(f"--num-classes (num_classes=): expected a positive int, "
                         f"got {num_classes!r}")
    out_dir = os.path.abspath(str(out_dir))
    target = manifest_path(out_dir)
    if os.path.exists(target) and not overwrite:
        raise CorpusError(f"{target}: a corpus already exists here; choose another "
                          "directory or pass --overwrite (overwrite=True)")

    manifests = []
    seen_dirs: set[str] = set()
    for part in parts:
        directory = os.path.abspath(part)
        if directory in seen_dirs:
            raise ValueError(f"{part}: listed twice among the parts to merge")
        seen_dirs.add(directory)
        if directory == out_dir or os.path.commonpath([out_dir, directory]) != out_dir:
            raise ValueError(f"{part}: a part must be a subdirectory of the merged corpus "
                             f"{out_dir}, because shard paths in corpus.yaml are relative "
                             "to it")
        manifests.append(load_manifest(directory))
    # a part inside another (a merged corpus and one of its own parts): its shards
    # would be listed, and counted, twice
    resolved = [os.path.abspath(p) for p in parts]
    for part, directory in zip(parts, resolved):
        for other_part, other in zip(parts, resolved):
            if other != directory and os.path.commonpath([directory, other]) == other:
                raise ValueError(f"{part}: lies inside {other_part}, another part to merge; "
                                 "its shards would be counted twice")

    feat_dim = manifests[0].feat_dim
    for part, m in zip(parts, manifests):
        if m.feat_dim != feat_dim:
            raise CorpusError(f"{manifest_path(part)}: field 'feat_dim': expected {feat_dim} "
                              f"like {manifest_path(parts[0])}, got {m.feat_dim}")
    largest = max(m.num_classes for m in manifests)
    if num_classes is None:
        num_classes = largest
    elif largest > num_classes:
        worst = next(p for p, m in zip(parts, manifests) if m.num_classes == largest)
        raise CorpusError(f"{manifest_path(worst)}: field 'num_classes': {largest} is more "
                          f"than the {num_classes} classes asked for the merged corpus")

    part_utterances = _check_unique_utterances(parts, manifests)

    counts = np.zeros(num_classes, dtype=np.int64)
    shards = []
    for m in manifests:
        counts[:m.num_classes] += np.asarray(m.class_counts, dtype=np.int64)
        for i, shard in enumerate(m.shards):
            rel = os.path.relpath(m.shard_path(i), out_dir).replace(os.sep, "/")
            shards.append(ShardInfo(rel, shard.frames, shard.utterances))
    mean, var = pooled_moments([m.num_frames for m in manifests],
                               [m.cmvn_mean for m in manifests],
                               [m.cmvn_var for m in manifests])
    # features normalised differently cannot train one model
    kinds = [speaker_cmvn_kind(m.speaker_cmvn) for m in manifests]
    for m, kind in zip(manifests, kinds):
        if kind != kinds[0]:
            raise CorpusError(f"{manifest_path(m.directory)}: {kind}, but "
                              f"{manifest_path(manifests[0].directory)}: {kinds[0]}; "
                              "prepare every part alike")
    _check_speakers_in_one_part(manifests, part_utterances)
    merged = CorpusManifest(
        feat_dim=feat_dim, num_classes=int(num_classes),
        num_frames=sum(m.num_frames for m in manifests),
        num_utterances=sum(m.num_utterances for m in manifests),
        class_counts=[int(c) for c in counts],
        cmvn_mean=[float(v) for v in mean], cmvn_var=[float(v) for v in var],
        shards=shards,
        source={"kind": "merged",
                "parts": [{"path": os.path.relpath(m.directory, out_dir).replace(os.sep, "/"),
                           "source": dict(m.source)} for m in manifests]},
        directory=out_dir)
    report = merge_import_reports(parts)
    if report is not None:
        _write_yaml(os.path.join(out_dir, REPORT_NAME), report)
    elif os.path.isfile(os.path.join(out_dir, REPORT_NAME)):
        # the report of the corpus replaced (another merge's parts): it would stand
        # beside a corpus.yaml it does not describe
        os.remove(os.path.join(out_dir, REPORT_NAME))
    write_manifest(merged)
    return merged


def pooled_moments(frames, means, variances) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population variance of the union of groups, from each group's moments.

    Example::

        mean, var = pooled_moments([100, 300], [[0.0], [1.0]], [[1.0], [1.0]])
        # mean [0.75], var [1.1875]
    """
    n = np.asarray(frames, dtype=np.float64)
    if n.ndim != 1 or n.size == 0 or (n < 0).any() or n.sum() <= 0:
        raise ValueError(f"frames must be non-negative group sizes with a positive sum, "
                         f"got {list(frames)}")
    m = np.asarray(means, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    total = n.sum()
    mean = (n[:, None] * m).sum(axis=0) / total
    # within-group spread plus the spread of the group means around the pooled mean
    var = (n[:, None] * (v + (m - mean) ** 2)).sum(axis=0) / total
    return mean, var


def merge_import_reports(parts) -> dict | None:
    """One import report for the parts' ``import-report.yaml`` files, or None without them.

    Counts and skip lists are concatenated.  When every part read the same
    alignment file, an alignment counts as "without features" only if no
    part had features for it.

    Example::

        merge_import_reports(["corpora/train/part-00000", "corpora/train/part-00001"])
    """
    reports = []
    for part in parts:
        path = os.path.join(str(part), REPORT_NAME)
        if not os.path.exists(path):
            return None
        data = read_yaml(path, what="import report")
        if not isinstance(data, dict):
            raise CorpusError(f"{path}: expected a mapping of import report fields")
        reports.append((path, data))

    def field(path, data, name, kind):
        value = data.get(name, kind())
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorpusError(f"{path}: field '{name}': expected {kind.__name__}, got {value!r}")
        return value

    merged = {"feats": [], "ali": [], "imported": 0, "frames": 0, "missing_alignment": [],
              "length_mismatch": [], "empty_features": []}
    aligned_seen, without = [], []
    for path, data in reports:
        merged["feats"].append(data.get("feats"))
        merged["ali"].append(data.get("ali"))
        for name in ("imported", "frames"):
            merged[name] += field(path, data, name, int)
        for name in ("missing_alignment", "length_mismatch", "empty_features"):
            merged[name] += field(path, data, name, list)
        aligned_seen.append(field(path, data, "imported", int)
                            + len(field(path, data, "length_mismatch", list))
                            + len(field(path, data, "empty_features", list)))
        without.append(field(path, data, "alignments_without_features", int))
    if len(set(map(str, merged["ali"]))) == 1:
        # every part read all alignments: total = without[k] + aligned_seen[k] for any k
        merged["ali"] = merged["ali"][0]
        merged["alignments_without_features"] = without[0] + aligned_seen[0] - sum(aligned_seen)
    else:
        merged["alignments_without_features"] = sum(without)
    return merged


def _check_unique_utterances(parts, manifests) -> list:
    """Each part's utterance ids (a list of lists); refuses an id in two parts."""
    from .shards import ShardReader
    owner: dict[str, str] = {}
    found = []
    for part, m in zip(parts, manifests):
        found.append([])
        for i in range(len(m.shards)):
            path = m.shard_path(i)
            with ShardReader(path) as reader:
                ids = list(reader.utt_ids)
            found[-1] += ids
            for utt in ids:
                first = owner.setdefault(utt, path)
                if first != path:
                    raise CorpusError(f"{path}: utterance id {utt!r} is also in {first}; "
                                      "utterance ids must be unique across the parts")
    return found


def _check_speakers_in_one_part(manifests, part_utterances) -> None:
    """Per-speaker CMVN computed by each part (``--utt2spk`` without ``--cmvn``) used
    the stats of the part's utterances of a speaker: a speaker split over parts was
    normalised differently in each, and otherwise than export will (stats of the
    whole speaker).  Checked where the parts' utt2spk files can still be read."""
    from .kaldi_read import read_utt2spk
    owner: dict[str, str] = {}
    for m, utterances in zip(manifests, part_utterances):
        spec = m.speaker_cmvn or {}
        stats, utt2spk = spec.get("stats"), spec.get("utt2spk")
        if not (isinstance(stats, str) and stats.startswith("stats computed from")
                and isinstance(utt2spk, str) and os.path.isfile(utt2spk)):
            continue
        speakers = read_utt2spk(utt2spk)
        for spk in sorted({speakers[u] for u in utterances if u in speakers}):
            first = owner.setdefault(spk, m.directory)
            if first != m.directory:
                raise CorpusError(
                    f"{manifest_path(m.directory)}: speaker {spk!r} is also in {first}, and "
                    "each part normalised it with CMVN stats of its own utterances of that "
                    "speaker; prepare each speaker's utterances in one part, or give every "
                    "part Kaldi's stats of whole speakers (--cmvn)")


def _write_yaml(path: str, data: dict) -> None:
    write_yaml(path, data, flow_leaves=True)
