"""Import Kaldi features and frame alignments into a corpus directory.

Features come as any Kaldi rspecifier (``scp:feats.scp``, ``ark:feats.ark``,
``ark:gunzip -c feats.ark.gz |``; binary or text matrices, compressed or
not).  Alignments are per-frame pdf ids, as written by ``ali-to-pdf``:
``ark:ali.ark`` (binary int vectors), ``ark,t:ali.txt``, a pipe, or a plain
text file with lines ``uttid 3 3 3 5 ...``.  Both are read by
:mod:`mpitrain.data.kaldi_read`, the reader ``export`` uses too.

Utterances without an alignment, or whose alignment length differs from the
number of feature frames, are skipped and listed in the report, which is
also written to ``out_dir/import-report.yaml``.  With ``length_tolerance``
N, a difference of at most N frames is forgiven instead, as nnet3's example
tools count it (Kaldi nnet1's ``--length-tolerance`` N forgives fewer than N):
features and labels are both cut to the shorter
length (features computed with other frame settings than the alignment's
often differ by a frame or two at the end).

Archives are data from anyone: each record's type is checked before it is
decoded, and only Kaldi matrices (features) and int32 vectors (alignments) are
read; everything else -- kaldiio's pickled objects above all -- is refused by
key.  A record whose header declares more data than the input holds is
refused before its payload is allocated.

Example::

    report = import_kaldi("scp:data/train/feats.scp", "ark:exp/tri3_ali/pdf.ark",
                          "corpora/train", shards=8, num_classes=3456)
    print(report.summary())
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..files import write_yaml
from .cmvn import SpeakerCmvn
from .corpus import MAX_CLASSES, CorpusError
# the one rspecifier reader; its names stay importable from here
from .kaldi_read import (EXPECTED_ALIGNMENT, EXPECTED_FEATURES, read_alignments,  # noqa: F401
                         read_feature_matrices, split_rspecifier)
from .writer import CorpusWriter
from ..words import plural

REPORT_NAME = "import-report.yaml"


@dataclass
class ImportReport:
    """What :func:`import_kaldi` imported and what it skipped.

    Example::

        report.imported, report.frames, len(report.missing_alignment)
        report.summary()    # one paragraph for the log
    """

    imported: int = 0
    frames: int = 0
    missing_alignment: list = field(default_factory=list)      # utterance ids
    length_mismatch: list = field(default_factory=list)        # (utt, feat_len, ali_len)
    trimmed: list = field(default_factory=list)    # (utt, feat_len, ali_len): cut, imported
    length_tolerance: int = 0
    alignments_without_features: int = 0
    empty_features: list = field(default_factory=list)         # utterances with 0 frames
    num_classes: int = 0
    feat_dim: int = 0
    feats: str = ""
    ali: str = ""
    out_dir: str = ""
    speaker_cmvn: dict | None = None      # what per-speaker CMVN was applied, if any
    warnings: list = field(default_factory=list)               # lines for stderr

    @property
    def skipped(self) -> int:
        return len(self.missing_alignment) + len(self.length_mismatch) + len(self.empty_features)

    def summary(self) -> str:
        lines = [f"imported {plural(self.imported, 'utterance')}, {self.frames} frames "
                 f"(feat_dim {self.feat_dim}, {self.num_classes} classes) into {self.out_dir}",
                 f"skipped {len(self.missing_alignment)} without alignment, "
                 f"{len(self.length_mismatch)} with length mismatch, "
                 f"{len(self.empty_features)} with no frames; "
                 f"{self.alignments_without_features} alignments had no features"]
        if self.speaker_cmvn:
            lines.append(f"per-speaker CMVN applied (norm_vars "
                         f"{str(self.speaker_cmvn['norm_vars']).lower()}; "
                         f"{self.speaker_cmvn['stats']})")
        if self.trimmed:
            lines.append(f"cut {plural(len(self.trimmed), 'utterance')} to the shorter of "
                         "features and labels (lengths differing by at most "
                         f"{self.length_tolerance})")
        for utt, feat_len, ali_len in self.length_mismatch[:5]:
            lines.append(f"  length mismatch: {utt}: {feat_len} frames, {ali_len} labels")
        if self.length_mismatch and not self.length_tolerance:
            lines.append("  (--length-tolerance N imports those differing by at most N "
                         "frames, cut to the shorter)")
        if self.missing_alignment[:5]:
            lines.append("  no alignment: " + ", ".join(self.missing_alignment[:5])
                         + (" ..." if len(self.missing_alignment) > 5 else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"feats": self.feats, "ali": self.ali, "imported": self.imported,
                "frames": self.frames, "feat_dim": self.feat_dim,
                "num_classes": self.num_classes,
                "missing_alignment": list(self.missing_alignment),
                "length_mismatch": [{"utt": u, "feat_frames": f, "ali_frames": a}
                                    for u, f, a in self.length_mismatch],
                "length_tolerance": self.length_tolerance,
                "trimmed": [{"utt": u, "feat_frames": f, "ali_frames": a}
                            for u, f, a in self.trimmed],
                "empty_features": list(self.empty_features),
                "alignments_without_features": self.alignments_without_features,
                "speaker_cmvn": self.speaker_cmvn, "warnings": list(self.warnings)}


# ---------------------------------------------------------------- import

def import_kaldi(feats: str, ali: str, out_dir: str, *, shards: int = 1,
                 num_classes: int | None = None, overwrite: bool = False,
                 utt2spk: str | None = None, cmvn: str | None = None,
                 norm_vars: bool = False, length_tolerance: int = 0,
                 scp_commands: bool = False) -> ImportReport:
    """Convert Kaldi features + pdf alignments into a corpus directory.

    ``num_classes`` should be the number of pdfs of the tree (``tree-info``);
    it defaults to the largest pdf id in the alignment file plus one.
    ``length_tolerance``: how many frames features and alignment may differ
    by and still be imported, both cut to the shorter (0: they must agree).
    With ``utt2spk`` or ``cmvn`` the stored features get per-speaker CMVN as
    Kaldi's ``apply-cmvn`` (``norm_vars`` as its ``--norm-vars``) applies it:
    with Kaldi's stats (``cmvn``, e.g. ``scp:cmvn.scp``) or with stats computed
    per speaker from the features; the manifest's ``source.speaker_cmvn``
    records it, and models trained on the corpus carry it to ``export``.
    ``scp_commands``: run the entries of scp files that are commands
    (``utt cmd |``); off, such an entry is refused (an scp file is data).

    Example::

        report = import_kaldi("scp:data/train/feats.scp", "ark:exp/ali/pdf.ark", "corpora/train")
        report.imported, report.length_mismatch
    """
    # the options first, named as on the command line: before a long read of the inputs
    if int(shards) != shards or shards < 1:
        raise ValueError(f"--shards (shards=): expected a positive int, got {shards!r}")
    if int(length_tolerance) != length_tolerance or length_tolerance < 0:
        raise ValueError(f"--length-tolerance (length_tolerance=): length tolerance must be "
                         f"a whole number of frames >= 0, got {length_tolerance!r}")
    if num_classes is not None and (int(num_classes) != num_classes or num_classes < 1):
        raise ValueError(f"--num-classes (num_classes=): expected a positive int, "
                         f"got {num_classes!r}")
    if num_classes is not None and num_classes > MAX_CLASSES:
        raise ValueError(f"num_classes (--num-classes) {num_classes}: at most {MAX_CLASSES} "
                         "classes (the largest output layer a model may have; a Kaldi tree "
                         "has thousands of pdfs: tree-info tells)")
    if norm_vars and not (utt2spk or cmvn):
        raise ValueError("--norm-vars needs per-speaker CMVN: pass --utt2spk or --cmvn")
    _, feats_path = split_rspecifier(feats, "feats")
    _, ali_path = split_rspecifier(ali, "ali")
    if feats_path.strip() == "-" and ali_path.strip() == "-":
        # the alignments would read the features' bytes (and refuse them as no alignment)
        raise ValueError("--feats and --ali both read standard input ('-'); one stream "
                         "holds one of them: give the other as a file or a pipe")
    if utt2spk and not cmvn and feats_path.strip() == "-":
        raise ValueError("--feats -: computing CMVN stats reads the features twice, "
                         "which stdin cannot give; pass --cmvn with Kaldi's stats")
    alignments = read_alignments(ali, scp_commands=scp_commands)
    if not alignments:
        raise CorpusError(f"{ali_path}: no alignments found")
    largest = max((int(labels.max()) for labels in alignments.values() if labels.size),
                  default=0)
    smallest = min((int(labels.min()) for labels in alignments.values() if labels.size),
                   default=0)
    warnings = []
    if num_classes is None and largest >= MAX_CLASSES:
        worst = next(k for k, v in alignments.items() if v.size and v.max() == largest)
        raise CorpusError(f"{ali_path}: utterance {worst!r}: label {largest} would make "
                          f"{largest + 1} classes, more than the {MAX_CLASSES} a model may "
                          "have: are these pdf ids (ali-to-pdf)? Pass --num-classes (tree-info)")
    if num_classes is None:
        num_classes = largest + 1
        if smallest > 0:
            # transition ids start at 1; pdf 0 (a silence state) is in nearly every
            # pdf alignment
            warnings.append(f"{ali_path}: no frame has label 0 (labels {smallest}..{largest}): "
                            f"transition ids rather than pdf ids? ali.*.gz holds transition "
                            f"ids; convert them with ali-to-pdf, and pass --num-classes "
                            f"(tree-info)")
    elif largest >= num_classes:
        worst = next(k for k, v in alignments.items() if v.size and v.max() == largest)
        raise CorpusError(f"{ali_path}: utterance {worst!r}: pdf id {largest} is outside "
                          f"[0, {num_classes}) (num_classes={num_classes}; transition ids "
                          "from ali.*.gz? convert them with ali-to-pdf)")

    speaker_cmvn = None
    if utt2spk or cmvn:
        speaker_cmvn = SpeakerCmvn.load(utt2spk=utt2spk, cmvn=cmvn, feats=feats,
                                        norm_vars=norm_vars, scp_commands=scp_commands)
    report = ImportReport(num_classes=int(num_classes), feats=feats, ali=ali,
                          out_dir=str(out_dir), warnings=warnings,
                          length_tolerance=int(length_tolerance))
    source = {"kind": "kaldi", "feats": feats, "ali": ali}
    if speaker_cmvn is not None:
        source["speaker_cmvn"] = report.speaker_cmvn = speaker_cmvn.describe()
    seen: set[str] = set()
    writer = None
    try:
        for key, matrix in read_feature_matrices(feats, scp_commands=scp_commands):
            if key in seen:
                raise CorpusError(f"{feats_path}: utterance {key!r} appears twice")
            seen.add(key)
            labels = alignments.get(key)
            if labels is None:
                report.missing_alignment.append(key)
                continue
            if matrix.shape[0] == 0:
                report.empty_features.append(key)
                continue
            if labels.shape[0] != matrix.shape[0]:
                lengths = (key, int(matrix.shape[0]), int(labels.shape[0]))
                # (an empty alignment is no utterance, whatever the tolerance)
                if abs(lengths[1] - lengths[2]) > length_tolerance or not lengths[2]:
                    report.length_mismatch.append(lengths)
                    continue
                report.trimmed.append(lengths)
                frames = min(lengths[1], lengths[2])
                matrix, labels = matrix[:frames], labels[:frames]
            if writer is None:
                report.feat_dim = int(matrix.shape[1])
                writer = CorpusWriter(out_dir, feat_dim=report.feat_dim,
                                      num_classes=int(num_classes), num_shards=int(shards),
                                      source=source,
                                      overwrite=overwrite)
            elif matrix.shape[1] != report.feat_dim:
                raise CorpusError(f"{feats_path}: utterance {key!r} has feature dimension "
                                  f"{matrix.shape[1]}, expected {report.feat_dim} "
                                  "like the utterances before it")
            if not np.isfinite(matrix).all():
                raise CorpusError(f"{feats_path}: utterance {key!r} contains NaN or inf")
            if speaker_cmvn is not None:
                matrix = speaker_cmvn.apply(key, matrix)
            writer.add(key, matrix, labels)
            report.imported += 1
            report.frames += int(matrix.shape[0])
        if writer is None:
            raise CorpusError(_nothing_imported(report, feats_path, ali_path))
        _refuse_cuts_to_subsampled_alignments(report, feats_path, ali_path)
        manifest = writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    report.alignments_without_features = sum(1 for key in alignments if key not in seen)
    empty = sum(1 for shard in manifest.shards if not shard.utterances)
    if empty:
        warnings.append(f"{out_dir}: {empty} of {len(manifest.shards)} shards hold no "
                        f"utterance ({report.imported} imported); --shards {report.imported} "
                        "or fewer leaves none empty")
    _write_report(report, out_dir)
    return report


def _nothing_imported(report, feats_path, ali_path) -> str:
    """Why no utterance could be imported, the commonest cause first."""
    if report.length_mismatch:
        # an empty alignment is no utterance whatever the tolerance: no tolerance to offer
        cuttable = [m for m in report.length_mismatch if m[2]]
        factor, example = _subsampling(cuttable)
        if factor:
            # cutting them to the shorter would pair each label with the wrong frames
            key, frames, labels = example
            why = (f"alignments at 1/{factor} of the features' frame rate, as a chain "
                   f"model's with frame subsampling factor {factor}? one label per feature "
                   "frame is needed: align at the features' rate, e.g. with a GMM or a "
                   "non-chain nnet3 model")
        elif cuttable:
            key, frames, labels = cuttable[0]
            why = (f"a frame shift or subsampling? --length-tolerance {abs(frames - labels)} "
                   "would cut them to the shorter")
        else:
            key, frames, labels = report.length_mismatch[0]
            why = "every such alignment is empty: align these utterances"
        return (f"{feats_path}: {len(report.length_mismatch)} utterance(s) have alignments "
                f"in {ali_path} of another length than their features (e.g. {key}: "
                f"{frames} frames, {labels} labels; {why}) and none match; nothing to import")
    if report.empty_features and not report.missing_alignment:
        return f"{feats_path}: every utterance with an alignment has no frames; nothing to import"
    return (f"{feats_path}: no utterance has an alignment in {ali_path} (ids differ?); "
            "nothing to import")


def _refuse_cuts_to_subsampled_alignments(report, feats_path, ali_path) -> None:
    """A tolerance wide enough to take alignments at 1/k of the frame rate cut the
    features to the labels' count: each label would sit on the wrong frame."""
    # (utterances of a few frames can look subsampled by chance)
    cut = [m for m in report.trimmed if m[2] >= 10]
    factor, (key, frames, labels) = _subsampling(cut)
    if factor:
        raise CorpusError(
            f"{feats_path}: --length-tolerance {report.length_tolerance} would cut "
            f"{plural(len(cut), 'utterance')} to alignments in {ali_path} at 1/{factor} of "
            f"the features' frame rate (e.g. {key}: {frames} frames, {labels} labels), "
            "pairing each label with the wrong frame; align at the features' rate, e.g. "
            "with a GMM or a non-chain nnet3 model; nothing imported")


def _subsampling(mismatches) -> tuple:
    """``(k, an example)`` when nine in ten (utt, frames, labels) have about
    frames / k labels for one k >= 2 (Kaldi's subsampled frame count is
    ceil(frames / k)), else ``(0, (None, 0, 0))``.  k is the commonest ratio, so
    a few bad alignments besides, the first among them too, do not hide it."""
    ratios = Counter(round(frames / labels) for _, frames, labels in mismatches if labels)
    k = ratios.most_common(1)[0][0] if ratios else 0
    fitting = [m for m in mismatches if m[2] and abs(m[2] - -(-m[1] // k)) <= 1] \
        if k >= 2 else []
    if not fitting or len(fitting) < 0.9 * len(mismatches):
        return 0, (None, 0, 0)
    return k, fitting[0]


def _write_report(report: ImportReport, out_dir: str) -> None:
    write_yaml(os.path.join(str(out_dir), REPORT_NAME), report.to_dict())
