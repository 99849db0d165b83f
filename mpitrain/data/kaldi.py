"""Import Kaldi features and frame alignments into a corpus directory.

Features come as ``scp:feats.scp`` or ``ark:feats.ark`` (binary or text
matrices, compressed or not; decoded by kaldiio).  Alignments are per-frame
pdf ids, as written by ``ali-to-pdf``: ``ark:ali.ark`` (binary int vectors),
``ark,t:ali.txt`` or a plain text file with lines ``uttid 3 3 3 5 ...``.

Utterances without an alignment, or whose alignment length differs from the
number of feature frames, are skipped and listed in the report, which is
also written to ``out_dir/import-report.yaml``.

Records are decoded with kaldiio, but never through its pickle branch, and
scp entries that are shell pipes are refused: run the pipe into an ark first.

Example::

    report = import_kaldi("scp:data/train/feats.scp", "ark:exp/tri3_ali/pdf.ark",
                          "corpora/train", shards=8, num_classes=3456)
    print(report.summary())
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import yaml

from .corpus import CorpusError, CorpusWriter

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
    alignments_without_features: int = 0
    empty_features: list = field(default_factory=list)         # utterances with 0 frames
    num_classes: int = 0
    feat_dim: int = 0
    feats: str = ""
    ali: str = ""
    out_dir: str = ""

    @property
    def skipped(self) -> int:
        return len(self.missing_alignment) + len(self.length_mismatch) + len(self.empty_features)

    def summary(self) -> str:
        lines = [f"imported {self.imported} utterances, {self.frames} frames "
                 f"(feat_dim {self.feat_dim}, {self.num_classes} classes) into {self.out_dir}",
                 f"skipped {len(self.missing_alignment)} without alignment, "
                 f"{len(self.length_mismatch)} with length mismatch, "
                 f"{len(self.empty_features)} with no frames; "
                 f"{self.alignments_without_features} alignments had no features"]
        for utt, feat_len, ali_len in self.length_mismatch[:5]:
            lines.append(f"  length mismatch: {utt}: {feat_len} frames, {ali_len} labels")
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
                "empty_features": list(self.empty_features),
                "alignments_without_features": self.alignments_without_features}


# ---------------------------------------------------------------- specifiers

def _split_spec(spec: str, what: str) -> tuple[str, str]:
    """('scp' | 'ark' | 'text', path) from a Kaldi rspecifier or a bare path."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{what}: expected a Kaldi rspecifier such as 'scp:feats.scp', "
                         f"got {spec!r}")
    if ":" in spec:
        prefix, path = spec.split(":", 1)
        options = set(prefix.split(","))
        if "scp" in options:
            return "scp", path
        if "ark" in options:
            return ("text" if "t" in options else "ark"), path
    # A bare path (it may itself contain a colon).
    return ("scp" if spec.endswith(".scp") else "ark"), spec


def _check_plain_file(path: str, what: str) -> None:
    if path.strip().endswith("|") or path.strip().startswith("|") or path in ("-", ""):
        raise CorpusError(f"{path or what}: {what}: pipes and stdin are not supported; "
                          "write the data to a file first")
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: {what} file not found or not a regular file")


# ---------------------------------------------------------------- reading records

def _kaldiio_matio():
    import kaldiio.matio
    return kaldiio.matio


def _read_record(fd, path: str, key: str):
    """Decode one Kaldi object at the current position, refusing pickled payloads."""
    head = fd.read(5)
    fd.seek(-len(head), os.SEEK_CUR)
    if head[:3] == b"PKL":
        raise CorpusError(f"{path}: entry {key!r} holds a pickled Python object; "
                          "refusing to load it (only Kaldi matrices and vectors are read)")
    try:
        return _kaldiio_matio().read_kaldi(fd)
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{path}: entry {key!r} cannot be decoded as a Kaldi matrix "
                          f"({type(exc).__name__}: {exc})") from exc


def _ark_keys(fd, path: str):
    """The utterance ids of an open ark file; the caller reads each value after its id."""
    read_token = _kaldiio_matio().read_token
    while True:
        try:
            key = read_token(fd)
        except Exception as exc:
            raise CorpusError(f"{path}: cannot read the next utterance id ({exc})") from exc
        if key is None:
            return
        yield key


def _iter_ark(path: str):
    """(key, object) of every entry of an ark file."""
    _check_plain_file(path, "ark")
    with open(path, "rb") as fd:
        for key in _ark_keys(fd, path):
            yield key, _read_record(fd, path, key)


def _parse_scp(path: str) -> list[tuple[str, str, int | None]]:
    """[(key, ark_path, offset)] of an scp file; relative ark paths are kept as written."""
    _check_plain_file(path, "scp")
    entries = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path}: cannot read scp file ({exc})") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise CorpusError(f"{path}:{lineno}: expected 'uttid ark_path:offset', got {line!r}")
        key, location = parts[0], parts[1].strip()
        if location.endswith("|") or location.startswith("|"):
            raise CorpusError(f"{path}:{lineno}: utterance {key!r} is read through a pipe "
                              f"({location!r}); pipes are not supported, run it into an ark first")
        if location.endswith("]"):
            raise CorpusError(f"{path}:{lineno}: utterance {key!r}: row/column ranges "
                              f"({location!r}) are not supported")
        ark, offset = location, None
        if ":" in location:
            head, tail = location.rsplit(":", 1)
            if tail.isdigit():
                ark, offset = head, int(tail)
        entries.append((key, ark, offset))
    return entries


def _iter_scp(path: str, *, max_open: int = 16):
    """(key, object) for each scp entry, in scp order, keeping a few arks open."""
    handles: OrderedDict[str, object] = OrderedDict()
    try:
        for key, ark, offset in _parse_scp(path):
            fd = handles.get(ark)
            if fd is None:
                if not os.path.isfile(ark):
                    raise CorpusError(f"{path}: utterance {key!r} points to {ark!r}, "
                                      "which is not a readable file")
                fd = open(ark, "rb")
                handles[ark] = fd
                if len(handles) > max_open:
                    handles.popitem(last=False)[1].close()
            else:
                handles.move_to_end(ark)
            # Without an offset the file holds one bare object (no key), as in Kaldi.
            fd.seek(offset or 0)
            yield key, _read_record(fd, ark, key)
    finally:
        for fd in handles.values():
            fd.close()


def _iter_features(spec: str):
    kind, path = _split_spec(spec, "feats")
    if kind == "scp":
        return _iter_scp(path)
    return _iter_ark(path)     # kaldiio tells binary from text matrices itself


# ---------------------------------------------------------------- alignments

def _is_binary_ark(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    space = head.find(b" ")
    return space > 0 and head[space + 1:space + 3] == b"\0B"


def _read_text_alignments(path: str) -> dict[str, np.ndarray]:
    alignments = {}
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read alignment file ({exc})") from exc
    with f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            # Kaldi writes "utt 3 3 5"; kaldiio's text mode brackets it: "utt [ 3 3 5 ]".
            key, values = parts[0], [v for v in parts[1:] if v not in ("[", "]")]
            try:
                labels = np.array([int(v) for v in values], dtype=np.int64)
            except ValueError:
                bad = next(v for v in values if not _is_int_token(v))
                raise CorpusError(f"{path}:{lineno}: utterance {key!r}: expected integer pdf ids, "
                                  f"got {bad!r}") from None
            if key in alignments:
                raise CorpusError(f"{path}:{lineno}: utterance {key!r} appears twice")
            alignments[key] = _as_pdf_ids(path, key, labels)
    return alignments


def _as_pdf_ids(path: str, key: str, labels: np.ndarray) -> np.ndarray:
    if labels.size and (labels.min() < 0 or labels.max() > np.iinfo(np.int32).max):
        bad = labels.min() if labels.min() < 0 else labels.max()
        raise CorpusError(f"{path}: utterance {key!r}: pdf id {bad} is not a valid class index")
    return labels.astype(np.int32)


def _is_int_token(token: str) -> bool:
    try:
        int(token)
        return True
    except ValueError:
        return False


def _read_binary_int_vector(fd, path: str, key: str) -> np.ndarray:
    """Kaldi binary int32 vector: '\\0B' '\\4' <int32 n> then n x ('\\4' <int32>)."""
    header = fd.read(7)
    if len(header) != 7 or header[:3] != b"\0B\4":
        raise CorpusError(f"{path}: entry {key!r} is not a binary integer vector "
                          "(expected pdf ids from ali-to-pdf)")
    count = int(np.frombuffer(header[3:7], dtype="<i4")[0])
    body = fd.read(5 * count)
    if count < 0 or len(body) != 5 * count:
        raise CorpusError(f"{path}: entry {key!r} is truncated")
    # Vectorised decode of the (size byte, value) pairs; kaldiio loops in Python.
    pairs = np.frombuffer(body, dtype=np.dtype([("size", "u1"), ("value", "<i4")]))
    if count and not (pairs["size"] == 4).all():
        raise CorpusError(f"{path}: entry {key!r} has non-int32 elements")
    return _as_pdf_ids(path, key, pairs["value"].astype(np.int64))


def _read_binary_alignments(path: str) -> dict[str, np.ndarray]:
    alignments = {}
    with open(path, "rb") as fd:
        for key in _ark_keys(fd, path):
            head = fd.read(2)
            fd.seek(-len(head), os.SEEK_CUR)
            if head != b"\0B":
                raise CorpusError(f"{path}: entry {key!r} is text inside a binary ark")
            if key in alignments:
                raise CorpusError(f"{path}: utterance {key!r} appears twice")
            alignments[key] = _read_binary_int_vector(fd, path, key)
    return alignments


def read_alignments(spec: str) -> dict[str, np.ndarray]:
    """Per-frame pdf ids by utterance, from 'ark:', 'ark,t:' or a plain text file.

    Example::

        ali = read_alignments("ark,t:exp/tri3_ali/pdf.txt")
        ali["spk1-utt1"][:5]
    """
    kind, path = _split_spec(spec, "ali")
    if kind == "scp":
        raise ValueError(f"ali: {spec!r}: alignments are read from an ark or text file, not an scp")
    _check_plain_file(path, "alignment")
    if kind == "ark" and _is_binary_ark(path):
        return _read_binary_alignments(path)
    return _read_text_alignments(path)


# ---------------------------------------------------------------- import

def _as_features(path: str, key: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 2 or value.dtype.kind != "f":
        shape = getattr(value, "shape", None)
        raise CorpusError(f"{path}: utterance {key!r}: expected a float matrix of features, "
                          f"got {type(value).__name__} with shape {shape}")
    return value.astype(np.float32, copy=False)


def import_kaldi(feats: str, ali: str, out_dir: str, *, shards: int = 1,
                 num_classes: int | None = None, overwrite: bool = False) -> ImportReport:
    """Convert Kaldi features + pdf alignments into a corpus directory.

    ``num_classes`` should be the number of pdfs of the tree (``tree-info``);
    it defaults to the largest pdf id in the alignment file plus one.

    Example::

        report = import_kaldi("scp:data/train/feats.scp", "ark:exp/ali/pdf.ark", "corpora/train")
        report.imported, report.length_mismatch
    """
    if int(shards) != shards or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    _, feats_path = _split_spec(feats, "feats")
    alignments = read_alignments(ali)
    _, ali_path = _split_spec(ali, "ali")
    if not alignments:
        raise CorpusError(f"{ali_path}: no alignments found")
    largest = max((int(labels.max()) for labels in alignments.values() if labels.size),
                  default=0)
    if num_classes is None:
        num_classes = largest + 1
    elif int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    elif largest >= num_classes:
        worst = next(k for k, v in alignments.items() if v.size and v.max() == largest)
        raise CorpusError(f"{ali_path}: utterance {worst!r}: pdf id {largest} is outside "
                          f"[0, {num_classes}) (num_classes={num_classes})")

    report = ImportReport(num_classes=int(num_classes), feats=feats, ali=ali,
                          out_dir=str(out_dir))
    seen: set[str] = set()
    writer = None
    try:
        for key, value in _iter_features(feats):
            matrix = _as_features(feats_path, key, value)
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
                report.length_mismatch.append((key, int(matrix.shape[0]), int(labels.shape[0])))
                continue
            if writer is None:
                report.feat_dim = int(matrix.shape[1])
                writer = CorpusWriter(out_dir, feat_dim=report.feat_dim,
                                      num_classes=int(num_classes), num_shards=int(shards),
                                      source={"kind": "kaldi", "feats": feats, "ali": ali},
                                      overwrite=overwrite)
            elif matrix.shape[1] != report.feat_dim:
                raise CorpusError(f"{feats_path}: utterance {key!r} has feature dimension "
                                  f"{matrix.shape[1]}, expected {report.feat_dim} "
                                  "like the utterances before it")
            if not np.isfinite(matrix).all():
                raise CorpusError(f"{feats_path}: utterance {key!r} contains NaN or inf")
            writer.add(key, matrix, labels)
            report.imported += 1
            report.frames += int(matrix.shape[0])
        if writer is None:
            raise CorpusError(f"{feats_path}: no utterance has a matching alignment in "
                              f"{ali_path}; nothing to import")
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    report.alignments_without_features = sum(1 for key in alignments if key not in seen)
    _write_report(report, out_dir)
    return report


def _write_report(report: ImportReport, out_dir: str) -> None:
    path = os.path.join(str(out_dir), REPORT_NAME)
    tmp = os.path.join(str(out_dir), f".{REPORT_NAME}.partial")
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(report.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)
