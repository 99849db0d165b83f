"""Import Kaldi features and frame alignments into a corpus directory.

Features come as ``scp:feats.scp`` or ``ark:feats.ark`` (binary or text
matrices, compressed or not).  Alignments are per-frame
pdf ids, as written by ``ali-to-pdf``: ``ark:ali.ark`` (binary int vectors),
``ark,t:ali.txt`` or a plain text file with lines ``uttid 3 3 3 5 ...``.

Utterances without an alignment, or whose alignment length differs from the
number of feature frames, are skipped and listed in the report, which is
also written to ``out_dir/import-report.yaml``.

Archives are data from anyone: each record's type is checked before it is
decoded, and only Kaldi matrices (features) and int32 vectors (alignments) are
read; everything else -- kaldiio's pickled objects above all -- is refused by
key.  A record whose header declares more data than the file holds is refused
before anything is allocated.  scp entries that are shell pipes are refused:
run the pipe into an ark first.

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

from ..files import write_yaml
from .corpus import CorpusError
from .writer import CorpusWriter

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
#
# kaldiio's read_kaldi dispatches on a record's first bytes and unpickles a
# record that starts with "PKL" (it also loads "NPY" payloads and audio).  An
# archive is data from anyone, so read_kaldi is never called: each record's
# type token is peeked and checked here, its declared size compared with the
# bytes left in the file, and only then is it decoded (binary matrices and
# vectors by kaldiio's read_matrix_or_vector, text matrices by our own parser).

_FLOAT_SIZES = {"FM": 4, "FV": 4, "DM": 8, "DV": 8}
_COMPRESSED = ("CM", "CM2", "CM3")
_MATRIX_TYPES = tuple(_FLOAT_SIZES) + _COMPRESSED
EXPECTED_FEATURES = ("a Kaldi float matrix (binary FM, DM, compressed CM, CM2, CM3, "
                     "or text '[ ... ]')")
EXPECTED_ALIGNMENT = "a binary int32 vector (pdf ids from ali-to-pdf)"
# Payloads kaldiio can store besides Kaldi objects; none is ever decoded here.
_FOREIGN = ((b"PKL", "a pickled Python object"), (b"NPY", "a NumPy .npy payload"),
            (b"RIFF", "WAV audio"), (b"fLaC", "FLAC audio"), (b"AUDIO", "audio"))
_MAX_KEY_BYTES = 4096
_WHITESPACE = b" \t\n\r"


def _kaldiio_matio():
    import kaldiio.matio
    return kaldiio.matio


def _refuse(path: str, key: str, found: str, expected: str) -> CorpusError:
    return CorpusError(f"{path}: entry {key!r} holds {found}; expected {expected}")


def _bytes_left(fd) -> int:
    return os.fstat(fd.fileno()).st_size - fd.tell()


def _read_exact(fd, n: int, path: str, key: str) -> bytes:
    data = fd.read(n)
    if len(data) != n:
        raise CorpusError(f"{path}: entry {key!r} is truncated")
    return data


def _binary_type(fd, path: str, key: str) -> str:
    """The type token after '\\0B' ('FM', 'CM2', ...), or '\\4' for an int32 vector."""
    if fd.read(2) != b"\0B":
        raise CorpusError(f"{path}: entry {key!r} is not a binary Kaldi object")
    token = b""
    while len(token) < 4:
        c = fd.read(1)
        if c in (b" ", b""):
            break
        token += c
        if token == b"\4":
            return "\4"
    return token.decode("latin-1")


def _check_matrix_header(fd, path: str, key: str, kind: str) -> None:
    """Compare the declared rows and columns with the bytes that follow them."""
    if kind in _COMPRESSED:
        header = _read_exact(fd, 16, path, key)
        rows, cols = (int(v) for v in np.frombuffer(header[8:16], dtype="<i4"))
        sizes = {"CM": 8 * cols + rows * cols, "CM2": 2 * rows * cols, "CM3": rows * cols}
        need = sizes[kind]
    else:
        counts = []
        for _ in range(2 if kind.endswith("M") else 1):
            header = _read_exact(fd, 5, path, key)
            if header[:1] != b"\4":
                raise CorpusError(f"{path}: entry {key!r}: malformed {kind} header")
            counts.append(int(np.frombuffer(header[1:], dtype="<i4")[0]))
        rows, cols = counts[0], counts[-1] if len(counts) == 2 else 1
        need = rows * cols * _FLOAT_SIZES[kind]
    left = _bytes_left(fd)
    if rows < 0 or cols < 0 or need > left:
        shape = f"{rows} x {cols}" if kind.endswith(("M", "M2", "M3")) else f"{rows}"
        raise CorpusError(f"{path}: entry {key!r}: {kind} header declares {shape} "
                          f"({need} bytes of data) but only {left} bytes follow in the file")


def _read_text_matrix(fd, path: str, key: str) -> np.ndarray:
    """A Kaldi text matrix ' [\\n  1 2\\n  3 4 ]' (or vector ' [ 1 2 ]') as float32."""
    text = bytearray()
    while True:
        # Read in blocks up to the closing bracket; the file size bounds the text.
        block = fd.read(1 << 16)
        if not block:
            raise CorpusError(f"{path}: entry {key!r}: text matrix has no closing ']'")
        close = block.find(b"]")
        if close >= 0:
            text += block[:close]
            fd.seek(close + 1 - len(block), os.SEEK_CUR)
            if fd.read(1) not in (b"\n", b""):
                fd.seek(-1, os.SEEK_CUR)
            break
        text += block
    try:
        body = text.decode("ascii").strip()[1:]       # after the '['
        rows = [line.split() for line in body.splitlines() if line.strip()]
        if not rows:
            return np.zeros((0, 0), dtype=np.float32)     # Kaldi's empty matrix ' [ ]'
        if "\n" not in body:
            return np.array(rows[0], dtype=np.float32)    # a vector ' [ 1 2 ]'
        if len({len(row) for row in rows}) > 1:
            raise ValueError("rows of different lengths")
        return np.array(rows, dtype=np.float32)
    except ValueError as exc:    # also UnicodeDecodeError
        raise CorpusError(f"{path}: entry {key!r}: not a Kaldi text matrix ({exc})") from None


def _read_record(fd, path: str, key: str, *, expect: str = "matrix"):
    """Decode the record at the current position if it is of the kind expected.

    ``expect`` is "matrix" (features: float matrices and vectors, binary,
    compressed or text) or "ints" (alignments: binary int32 vectors).  Any
    other record is refused by key before a byte of its payload is decoded.
    """
    expected = EXPECTED_FEATURES if expect == "matrix" else EXPECTED_ALIGNMENT
    start = fd.tell()
    head = fd.read(64)
    fd.seek(start)
    for marker, what in _FOREIGN:
        if head.startswith(marker):
            raise _refuse(path, key, what, expected)
    if head.startswith(b"\0B"):
        kind = _binary_type(fd, path, key)
        if kind == "\4":
            if expect != "ints":
                raise _refuse(path, key, "a binary int32 vector", expected)
            fd.seek(start)
            return _read_binary_int_vector(fd, path, key)
        if kind not in _MATRIX_TYPES:
            raise _refuse(path, key, f"a binary object of type {kind!r}", expected)
        if expect != "matrix":
            raise _refuse(path, key, f"a Kaldi {kind} matrix or vector", expected)
        _check_matrix_header(fd, path, key, kind)
        fd.seek(start)
        try:
            return _kaldiio_matio().read_matrix_or_vector(fd)
        except Exception as exc:
            raise CorpusError(f"{path}: entry {key!r} cannot be decoded as a Kaldi {kind} "
                              f"({type(exc).__name__}: {exc})") from exc
    if expect == "matrix" and head.lstrip(_WHITESPACE)[:1] == b"[":
        return _read_text_matrix(fd, path, key)
    raise _refuse(path, key, f"an unknown record (it starts with {head[:8]!r})", expected)


def _read_key(fd, path: str) -> str | None:
    """The next utterance id of an ark (None at the end); the value follows it."""
    c = fd.read(1)
    while c and c in _WHITESPACE:
        c = fd.read(1)
    key = b""
    while c not in (b" ", b""):
        key += c
        if len(key) > _MAX_KEY_BYTES:
            raise CorpusError(f"{path}: an utterance id is longer than {_MAX_KEY_BYTES} bytes; "
                              "not a Kaldi archive")
        c = fd.read(1)
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{path}: utterance id {bytes(key[:40])!r} is not UTF-8; "
                          "not a Kaldi archive") from None


def _ark_keys(fd, path: str):
    """The utterance ids of an open ark file; the caller reads each value after its id."""
    while True:
        key = _read_key(fd, path)
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
            if (offset or 0) >= os.fstat(fd.fileno()).st_size:
                raise CorpusError(f"{path}: utterance {key!r} points to offset {offset} of "
                                  f"{ark!r}, at or past its end")
            # Without an offset the file holds one bare object (no key), as in Kaldi.
            fd.seek(offset or 0)
            yield key, _read_record(fd, ark, key)
    finally:
        for fd in handles.values():
            fd.close()


def read_feature_matrices(spec: str):
    """(utterance id, float32 matrix (T, D)) for each entry of an 'scp:' or 'ark:' rspecifier.

    Only Kaldi float matrices are accepted (binary, compressed or text); any
    other record is refused by key with a :class:`CorpusError` naming the file.

    Example::

        for utt, feats in read_feature_matrices("scp:data/test/feats.scp"):
            feats.shape        # (frames, feat_dim)
    """
    kind, path = _split_spec(spec, "feats")
    records = _iter_scp(path) if kind == "scp" else _iter_ark(path)   # ark: binary or text
    for key, value in records:
        yield key, _as_features(path, key, value)


# ---------------------------------------------------------------- alignments

def _is_binary_ark(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    space = head.find(b" ")
    return space > 0 and head[space + 1:space + 3] == b"\0B"


def _read_text_alignments(path: str) -> dict[str, np.ndarray]:
    alignments = {}
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read alignment file ({exc})") from exc
    with f:
        for lineno, raw in enumerate(f, 1):
            # Decoded leniently: a line that is not text fails below as a bad pdf id.
            parts = raw.decode("utf-8", errors="replace").split()
            if not parts:
                continue
            # Kaldi writes "utt 3 3 5"; kaldiio's text mode brackets it: "utt [ 3 3 5 ]".
            key, values = parts[0], [v for v in parts[1:] if v not in ("[", "]")]
            try:
                labels = np.array([int(v) for v in values], dtype=np.int64)
            except ValueError:
                bad = next(v for v in values if not _is_int_token(v))
                raise CorpusError(f"{path}:{lineno}: utterance {key!r}: expected integer pdf ids, "
                                  f"got {bad[:40]!r}") from None
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
    left = _bytes_left(fd)
    # Checked before reading: the count alone must not decide what is allocated.
    if count < 0 or 5 * count > left:
        raise CorpusError(f"{path}: entry {key!r}: int32 vector header declares {count} "
                          f"elements ({5 * count} bytes) but only {left} bytes follow in the file")
    body = fd.read(5 * count)
    # Vectorised decode of the (size byte, value) pairs; kaldiio loops in Python.
    pairs = np.frombuffer(body, dtype=np.dtype([("size", "u1"), ("value", "<i4")]))
    if count and not (pairs["size"] == 4).all():
        raise CorpusError(f"{path}: entry {key!r} has non-int32 elements")
    return _as_pdf_ids(path, key, pairs["value"].astype(np.int64))


def _read_binary_alignments(path: str) -> dict[str, np.ndarray]:
    alignments = {}
    with open(path, "rb") as fd:
        for key in _ark_keys(fd, path):
            labels = _read_record(fd, path, key, expect="ints")
            if key in alignments:
                raise CorpusError(f"{path}: utterance {key!r} appears twice")
            alignments[key] = labels
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
    if value.shape[0] and not value.shape[1]:
        raise CorpusError(f"{path}: utterance {key!r}: feature matrix has {value.shape[0]} "
                          "rows and no columns")
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
        for key, matrix in read_feature_matrices(feats):
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
    write_yaml(os.path.join(str(out_dir), REPORT_NAME), report.to_dict())
