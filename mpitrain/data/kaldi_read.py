"""Reading Kaldi rspecifiers: the one reader of ``prepare`` and ``export``.

Rspecifiers are parsed by kaldiio's ``parse_specifier``, so every Kaldi form
works: ``ark:feats.ark``, ``ark,t:ali.txt``, ``ark,s,cs:-`` (stdin),
``scp:feats.scp`` (entries ``utt file.ark:offset``, ``utt file.mat`` or
``utt cmd |``, each with an optional Kaldi range ``[r1:r2,c1:c2]``), and pipes, ``ark:gunzip -c feats.ark.gz |`` or
``scp:cmd |``.  A bare path is read as an scp if it ends in ``.scp``, else as
an ark.  Pipes are run by the shell as in Kaldi; one that exits non-zero is
an error naming the command (with the last line it wrote to stderr), raised
after the records it wrote, so callers that write files commit nothing.

Archives are data from anyone.  kaldiio's ``read_kaldi`` dispatches on a
record's first bytes and unpickles a record marked ``PKL`` (it also loads
``NPY`` payloads and audio), so it is never called: each record's type token
is read and checked here first, anything but a Kaldi matrix (features) or
int32 vector (alignments) is refused by key, and the declared size is
checked before its payload is read: against the bytes left in a file, and
for a pipe by reading the payload in bounded blocks, so memory follows the
bytes that arrive, never the header.  Only then is a binary record decoded:
a compressed matrix by :func:`decompress`, as Kaldi decodes it, the others by
kaldiio's ``read_matrix_or_vector`` from those bytes.

CMVN stats (:func:`read_cmvn_stats`) are read as features are, text kept in
float64, and must be 2 x (D+1) (or 1 x (D+1) without variances); utt2spk
(:func:`read_utt2spk`) is plain text.

Example::

    for utt, feats in read_feature_matrices("ark:gunzip -c feats.ark.gz |"):
        feats.shape        # (frames, feat_dim)
    ali = read_alignments("ark:ali-to-pdf final.mdl 'ark:gunzip -c ali.1.gz|' ark:- |")
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections import OrderedDict

import numpy as np

from .corpus import CorpusError

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
_BLOCK = 1 << 20           # a payload from a pipe is read this much at a time
_OPTIONS = {"ark", "scp", "t", "b", "o", "p", "f", "s", "cs", "ns", "nf"}


# ---------------------------------------------------------------- specifiers

def split_rspecifier(spec: str, what: str) -> tuple[str, str]:
    """('scp' | 'ark' | 'text', target) of a Kaldi rspecifier or a bare path.

    Example::

        split_rspecifier("ark,s,cs:gunzip -c f.ark.gz |", "feats")  # ('ark', 'gunzip ... |')
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what}: expected a Kaldi rspecifier such as 'scp:feats.scp', "
                         f"got {spec!r}")
    prefix, colon, _ = spec.partition(":")
    if not colon or not set(prefix.split(",")) <= _OPTIONS or \
            not {"ark", "scp"} & set(prefix.split(",")):
        # a bare path (it may itself contain a colon)
        return ("scp" if spec.endswith(".scp") else "ark"), spec
    from kaldiio.utils import parse_specifier
    try:
        # kaldiio knows no 'b', 'ns', 'nf' (Kaldi's binary / not-sorted / not-flush)
        parsed = parse_specifier(",".join(o for o in prefix.split(",")
                                          if o not in ("b", "ns", "nf"))
                                 + spec[len(prefix):])
    except ValueError as exc:
        raise ValueError(f"{what}: {spec!r}: {exc}") from None
    if parsed["ark"] is not None and parsed["scp"] is not None:
        raise ValueError(f"{what}: {spec!r}: an rspecifier names an ark or an scp, not both")
    if parsed["scp"] is not None:
        return "scp", parsed["scp"]
    return ("text" if parsed["t"] else "ark"), parsed["ark"]


_OFFSET = re.compile(r"(.+):([0-9]+)")


def split_offset(target: str) -> tuple[str, int | None]:
    """(path, offset) of Kaldi's offset form ``file.ark:1234`` (read from that
    byte on, as Kaldi's rxfilenames are), else (target, None); a file whose own
    name ends in ``:digits`` is that file."""
    match = _OFFSET.fullmatch(target)
    if match and not os.path.isfile(target) and os.path.isfile(match[1]):
        return match[1], int(match[2])
    return target, None


def is_pipe(target: str) -> bool:
    return target.strip().endswith("|") or target.strip().startswith("|")


# ---------------------------------------------------------------- inputs

class Input:
    """A forward-only binary input (file, pipe or stdin) with a look-ahead buffer.

    ``name`` is what messages call it: the path, or the pipe command.  For a
    regular file ``bytes_left()`` is known; for a pipe or stdin it is None.
    Closing a pipe waits for its command; :meth:`finish` raises if it failed.

    Example::

        with Input.open("gunzip -c feats.ark.gz |", "feats") as source:
            source.peek(4)
    """

    def __init__(self, handle, name: str, *, proc=None, stderr=None):
        self.handle, self.name = handle, name
        self._proc, self._stderr = proc, stderr
        self._buffer = b""
        self._size = None      # known for regular files only: the bound on what follows
        with contextlib.suppress(OSError, AttributeError, io.UnsupportedOperation):
            if proc is None and _is_regular(handle):
                self._size = os.fstat(handle.fileno()).st_size

    @classmethod
    def open(cls, target: str, what: str) -> "Input":
        """Open a path, ``-`` (stdin) or a pipe command ``cmd |``."""
        target = target.strip() if is_pipe(target) else target
        if is_pipe(target):
            command = target.strip("|").strip()
            stderr = tempfile.TemporaryFile()
            # the shell runs it, as Kaldi's and kaldiio's popen do
            proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=stderr,
                                    stdin=subprocess.DEVNULL)
            return cls(proc.stdout, target, proc=proc, stderr=stderr)
        if target == "-":
            if sys.stdin is None:
                raise CorpusError(f"-: standard input is closed; there is no {what} to read "
                                  "from it")
            return cls(sys.stdin.buffer, "stdin")
        path, offset = split_offset(target)
        if not path or not os.path.isfile(path):
            raise CorpusError(f"{target or what}: {what} file not found or not a regular file")
        try:
            source = cls(open(path, "rb"), target)
        except OSError as exc:
            raise CorpusError(f"{target}: cannot read {what} file ({exc.strerror})") from None
        if offset is not None:
            if offset >= source._size:
                source.abandon()
                raise CorpusError(f"{target}: offset {offset} is at or past the end of "
                                  f"{path!r} ({source._size} bytes)")
            source.seek(offset)
        return source

    # -- reading
    def peek(self, n: int) -> bytes:
        while len(self._buffer) < n:
            block = self.handle.read(max(n - len(self._buffer), 1 << 16))
            if not block:
                break
            self._buffer += block
        return self._buffer[:n]

    def read(self, n: int) -> bytes:
        data = self.peek(n)
        self._buffer = self._buffer[len(data):]
        return data

    def read_payload(self, n: int) -> bytes:
        """Up to ``n`` bytes, in blocks: a short result means the input ended."""
        parts, got = [], 0
        while got < n:
            block = self.read(min(_BLOCK, n - got))
            if not block:
                break
            parts.append(block)
            got += len(block)
        return b"".join(parts)

    def read_until(self, byte: bytes) -> bytes | None:
        """The bytes up to and including ``byte``; None if the input ends first (the
        bytes read stay unread: a last line without a line break is still a line)."""
        out = bytearray()
        while True:
            if not self._buffer and not self.peek(1):
                self._buffer = bytes(out)
                return None
            i = self._buffer.find(byte)
            if i >= 0:
                out += self._buffer[:i + 1]
                self._buffer = self._buffer[i + 1:]
                return bytes(out)
            out += self._buffer
            self._buffer = b""

    def bytes_left(self) -> int | None:
        if self._size is None:
            return None
        return self._size - self.handle.tell() + len(self._buffer)

    def seek(self, offset: int) -> None:
        """Files only (scp offsets)."""
        self.handle.seek(offset)
        self._buffer = b""

    def lines(self):
        while True:
            line = self.read_until(b"\n")
            if line is None:
                rest, self._buffer = self._buffer, b""
                if rest:
                    yield rest
                return
            yield line

    # -- ending
    def finish(self) -> None:
        """Close; for a pipe, wait for its command and raise if it failed."""
        self.handle.close()
        if self._proc is None:
            return
        status = self._proc.wait()
        last = ""
        with self._stderr:
            self._stderr.seek(0)
            lines = [ln for ln in self._stderr.read().decode("utf-8", "replace").splitlines()
                     if ln.strip()]
            last = lines[-1].strip() if lines else ""
        if status != 0:
            raise CorpusError(f"{self.name}: the command failed with exit status {status}"
                              + (f": {last}" if last else ""))

    def failure(self) -> CorpusError | None:
        """For a pipe whose command has failed (waiting a moment for it): the error."""
        if self._proc is None:
            return None
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None
        if self._proc.returncode == 0:
            return None
        try:
            self.finish()
        except CorpusError as exc:
            return exc
        return None

    def abandon(self) -> None:
        """Close without judging: a pipe's command is stopped."""
        with contextlib.suppress(Exception):
            self.handle.close()
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.kill()
                self._proc.wait()
            with contextlib.suppress(Exception):
                self._stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abandon()


def _is_regular(handle) -> bool:
    return stat.S_ISREG(os.fstat(handle.fileno()).st_mode)


@contextlib.contextmanager
def _opened(target: str, what: str):
    """An :class:`Input` that is finished on a clean exit, abandoned otherwise
    (also when a generator using it is closed early)."""
    source = Input.open(target, what)
    try:
        _refuse_gzip(source, what)
        yield source
    except CorpusError as exc:
        # a record cut short by a failed command: the command is the news
        failure = source.failure()
        source.abandon()
        if failure is not None:
            raise failure from exc
        raise
    except BaseException:
        source.abandon()
        raise
    source.finish()


def _refuse_gzip(source: Input, what: str) -> None:
    """A gzip stream (``ali.1.gz`` given as it is) is named as such, not decoded
    as a garbled archive."""
    if source.peek(2) != b"\x1f\x8b":
        return
    if source.name == "stdin" or is_pipe(source.name):
        how = "decompress it with gunzip -c first"
    else:
        prefix = {"scp": "scp:", "ark": "ark:", "alignment": "ark:"}.get(what, "")
        how = f"read it through gunzip, e.g. '{prefix}gunzip -c {source.name} |'"
    raise CorpusError(f"{source.name}: gzip-compressed data, not a Kaldi {what}; {how}")


# ---------------------------------------------------------------- records

def _refuse(name: str, key: str, found: str, expected: str) -> CorpusError:
    return CorpusError(f"{name}: entry {key!r} holds {found}; expected {expected}")


def _read_exact(src: Input, n: int, key: str) -> bytes:
    data = src.read(n)
    if len(data) != n:
        raise CorpusError(f"{src.name}: entry {key!r} is truncated")
    return data


def _binary_type(src: Input, key: str) -> tuple[str, bytes]:
    """The type token after '\\0B' ('FM', 'CM2', ...) or '\\4', and the bytes read."""
    head = src.read(2)
    if head != b"\0B":
        raise CorpusError(f"{src.name}: entry {key!r} is not a binary Kaldi object")
    token = b""
    while len(token) < 4:
        c = src.peek(1)
        if c in (b" ", b""):
            break
        token += src.read(1)
        if token == b"\4":
            return "\4", head + token
    if src.peek(1) == b" ":
        return token.decode("latin-1"), head + token + src.read(1)
    return token.decode("latin-1"), head + token


def _payload(src: Input, key: str, kind: str, shape: str, need: int, rows: int,
             cols: int) -> bytes:
    """The ``need`` bytes a header declared, checked before they are allocated."""
    left = src.bytes_left()
    if rows < 0 or cols < 0:
        raise CorpusError(f"{src.name}: entry {key!r}: {kind} header declares {shape}: a "
                          "negative size")
    if left is not None and need > left:
        raise CorpusError(f"{src.name}: entry {key!r}: {kind} header declares {shape} "
                          f"({need} bytes of data) but only {left} bytes follow in the file")
    data = src.read_payload(need)
    if len(data) < need:
        raise CorpusError(f"{src.name}: entry {key!r}: {kind} header declares {shape} "
                          f"({need} bytes of data) but only {len(data)} bytes follow in "
                          "the stream")
    return data


def _read_binary_matrix(src: Input, key: str, kind: str, head: bytes) -> np.ndarray:
    if kind in _COMPRESSED:
        header = _read_exact(src, 16, key)
        rows, cols = (int(v) for v in np.frombuffer(header[8:16], dtype="<i4"))
        need = {"CM": 8 * cols + rows * cols, "CM2": 2 * rows * cols,
                "CM3": rows * cols}[kind]
    else:
        header, counts = b"", []
        for _ in range(2 if kind.endswith("M") else 1):
            part = _read_exact(src, 5, key)
            if part[:1] != b"\4":
                raise CorpusError(f"{src.name}: entry {key!r}: malformed {kind} header")
            header += part
            counts.append(int(np.frombuffer(part[1:], dtype="<i4")[0]))
        rows, cols = counts[0], counts[-1] if len(counts) == 2 else 1
        need = rows * cols * _FLOAT_SIZES[kind]
    shape = f"{rows} x {cols}" if kind.endswith(("M", "M2", "M3")) else f"{rows}"
    body = _payload(src, key, kind, shape, max(need, 0), rows, cols)
    if kind in _COMPRESSED:
        return decompress(kind, header, body)
    import kaldiio.matio
    try:
        return kaldiio.matio.read_matrix_or_vector(io.BytesIO(head + header + body))
    except Exception as exc:
        raise CorpusError(f"{src.name}: entry {key!r} cannot be decoded as a Kaldi {kind} "
                          f"({type(exc).__name__}: {exc})") from exc


#: Kaldi's 1/65535 as the float constant of its Uint16ToFloat.
_UINT16_STEP = np.float32(1.52590218966964e-05)


def decompress(kind: str, header: bytes, body: bytes) -> np.ndarray:
    """A Kaldi compressed matrix (``CM``, ``CM2``, ``CM3``) as Kaldi's CopyToMat
    decodes it, operation for operation in float32 and float64 as its C++ does
    (kaldiio rounds otherwise: values an ulp or a few apart).  ``header``: the 16
    bytes after the token (min, range as float32; rows, cols as int32); ``body``:
    the data, its size already checked.

    Example::

        decompress("CM2", header, body).shape      # (rows, cols), float32
    """
    f32 = np.float32
    low, span = (f32(v) for v in np.frombuffer(header[:8], dtype="<f4"))
    rows, cols = (int(v) for v in np.frombuffer(header[8:16], dtype="<i4"))
    if rows * cols == 0:
        # its declared shape, as an FM's: rows without columns are refused alike
        return np.zeros((rows, cols), dtype=f32)
    if kind in ("CM2", "CM3"):
        # increment = range * (1.0 / 65535.0): a double product stored in a float
        step = f32(np.float64(span) * (1.0 / (65535.0 if kind == "CM2" else 255.0)))
        codes = np.frombuffer(body, dtype="<u2" if kind == "CM2" else "u1",
                              count=rows * cols).reshape(rows, cols)
        return low + codes.astype(f32) * step           # row-major, all in float
    # CM: per column four percentiles (uint16 codes), then the bytes column by column
    quantiles = np.frombuffer(body, dtype="<u2", count=4 * cols).reshape(cols, 4)
    p0, p25, p75, p100 = (low + (span * _UINT16_STEP) * quantiles[:, k].astype(f32)
                          for k in range(4))
    codes = np.frombuffer(body, dtype="u1", count=rows * cols,
                          offset=8 * cols).reshape(cols, rows).T.astype(f32)
    # p + (q - p) * code * (1 / n): the float product, then double arithmetic
    lower = np.float64(p0) + np.float64((p25 - p0) * codes) * (1 / 64.0)
    middle = np.float64(p25) + np.float64((p75 - p25) * (codes - f32(64))) * (1 / 128.0)
    upper = np.float64(p75) + np.float64((p100 - p75) * (codes - f32(192))) * (1 / 63.0)
    return np.where(codes <= 64, lower, np.where(codes <= 192, middle, upper)).astype(f32)


def _read_text_matrix(src: Input, key: str, dtype=np.float32) -> np.ndarray:
    """A Kaldi text matrix ' [\\n  1 2\\n  3 4 ]' (one row: ' [ 1 2 ]') as ``dtype``."""
    text = src.read_until(b"]")
    if text is None:
        raise CorpusError(f"{src.name}: entry {key!r}: text matrix has no closing ']'")
    if src.peek(1) == b"\n":
        src.read(1)
    try:
        body = text[:-1].decode("ascii").strip()[1:]       # between '[' and ']'
        # rows end at line breaks, or at ';' as Kaldi also reads them
        rows = [line.split() for line in body.replace(";", "\n").splitlines()
                if line.strip()]
        if not rows:
            return np.zeros((0, 0), dtype=dtype)     # Kaldi's empty matrix ' [ ]'
        if "\n" not in body and ";" not in body:
            # ' [ 1 2 3 ]' on one line: Kaldi reads a matrix written so as one row
            return np.array(rows[:1], dtype=dtype)
        if len({len(row) for row in rows}) > 1:
            raise ValueError("rows of different lengths")
        # Python's float() takes '1_0' as 10; Kaldi's reader refuses it
        bad = next((v for row in rows for v in row if "_" in v), None)
        if bad is not None:
            raise ValueError(f"could not convert string to float: {bad[:40]!r}")
        return np.array(rows, dtype=dtype)
    except ValueError as exc:    # also UnicodeDecodeError
        raise CorpusError(f"{src.name}: entry {key!r}: not a Kaldi text matrix ({exc})") \
            from None


def _read_int_vector(src: Input, key: str) -> np.ndarray:
    """Kaldi binary int32 vector: '\\0B' '\\4' <int32 n> then n x ('\\4' <int32>)."""
    count = int(np.frombuffer(_read_exact(src, 4, key), dtype="<i4")[0])
    left = src.bytes_left()
    # Checked before reading: the count alone must not decide what is allocated.
    if count < 0 or (left is not None and 5 * count > left):
        raise CorpusError(f"{src.name}: entry {key!r}: int32 vector header declares {count} "
                          f"elements ({5 * count} bytes) but only {left} bytes follow in the "
                          "file")
    body = src.read_payload(5 * count)
    if len(body) < 5 * count:
        raise CorpusError(f"{src.name}: entry {key!r}: int32 vector header declares {count} "
                          f"elements ({5 * count} bytes) but only {len(body)} bytes follow "
                          "in the stream")
    # Vectorised decode of the (size byte, value) pairs; kaldiio loops in Python.
    pairs = np.frombuffer(body, dtype=np.dtype([("size", "u1"), ("value", "<i4")]))
    if count and not (pairs["size"] == 4).all():
        raise CorpusError(f"{src.name}: entry {key!r} has non-int32 elements")
    return as_pdf_ids(src.name, key, pairs["value"].astype(np.int64))


def read_record(src: Input, key: str, *, expect: str = "matrix"):
    """Decode the record at the current position if it is of the kind expected.

    ``expect`` is "matrix" (features: float matrices and vectors, binary,
    compressed or text), "stats" (the same kinds: CMVN sums) or "ints"
    (alignments: binary int32 vectors).  Text is read as float64, so that a
    value beyond float32 is found by :func:`as_features` rather than turned
    into inf by the parse.  Any other record is refused by key before a byte
    of its payload is decoded.
    """
    expect = "matrix" if expect == "stats" else expect
    expected = EXPECTED_FEATURES if expect == "matrix" else EXPECTED_ALIGNMENT
    head = src.peek(64)
    for marker, what in _FOREIGN:
        if head.startswith(marker):
            raise _refuse(src.name, key, what, expected)
    if head.startswith(b"\0B"):
        kind, read = _binary_type(src, key)
        if kind == "\4":
            if expect != "ints":
                raise _refuse(src.name, key, "a binary int32 vector", expected)
            return _read_int_vector(src, key)
        if kind not in _MATRIX_TYPES:
            raise _refuse(src.name, key, f"a binary object of type {kind!r}", expected)
        if expect != "matrix":
            raise _refuse(src.name, key, f"a Kaldi {kind} matrix or vector", expected)
        return _read_binary_matrix(src, key, kind, read)
    if expect == "matrix" and head.lstrip(_WHITESPACE)[:1] == b"[":
        return _read_text_matrix(src, key, np.float64)
    raise _refuse(src.name, key, f"an unknown record (it starts with {head[:8]!r})", expected)


def _read_key(src: Input) -> str | None:
    """The next utterance id of an ark (None at the end); the value follows it."""
    while src.peek(1) and src.peek(1) in _WHITESPACE:
        src.read(1)
    key = b""
    # the id ends at a space, a tab or a line break, as Kaldi's table reader reads
    # it; a space or a tab after it is part of the separator, a line break is not
    while src.peek(1) not in (b" ", b"\t", b"\n", b"\r", b""):
        key += src.read(1)
        if len(key) > _MAX_KEY_BYTES:
            raise CorpusError(f"{src.name}: an utterance id is longer than {_MAX_KEY_BYTES} "
                              "bytes; not a Kaldi archive")
    if src.peek(1) in (b" ", b"\t"):
        src.read(1)
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{src.name}: utterance id {bytes(key[:40])!r} is not UTF-8: "
                          f"{_NOT_UTF8}, or this is not a Kaldi archive") from None


# utterance and speaker ids are stored as text; Kaldi itself takes any bytes
_NOT_UTF8 = ("ids in another encoding (e.g. Latin-1) must be converted to UTF-8 first "
             "(iconv, then copy-feats/copy-int-vector)")


def iter_ark(target: str, *, expect: str = "matrix"):
    """(key, object) of every entry of an ark: a file, ``-`` or a pipe."""
    with _opened(target, "ark") as src:
        while True:
            key = _read_key(src)
            if key is None:
                return
            yield key, read_record(src, key, expect=expect)


# ---------------------------------------------------------------- scp

def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_scp(target: str, *, commands: bool = False) -> list[tuple]:
    """[(key, location, offset, ranges)] of an scp (a file, ``-`` or a pipe).

    ``location`` is an ark path (relative paths as written, like Kaldi) or a
    pipe command; ``offset`` is None for a whole file or a pipe; ``ranges`` is
    the text of a trailing Kaldi range (``file.ark:12[0:99]``,
    ``[0:99,0:12]``; see :func:`matrix_range`) or None.  An entry that is a
    command (``utt cmd |``) is refused unless ``commands``: an scp file is
    data, and one written elsewhere must not run anything here.
    """
    entries = []
    with _opened(target, "scp") as src:
        name = src.name
        for lineno, raw in enumerate(src.lines(), 1):
            # the location is a file name, bytes as Kaldi takes them (a directory
            # named in Latin-1): kept as Python's file functions hold such names
            line = raw.decode("utf-8", "surrogateescape")
            if not line.strip():
                continue
            parts = line.split(None, 1)
            if not _is_utf8(parts[0]):
                raise CorpusError(f"{name}:{lineno}: not UTF-8 text: {_NOT_UTF8}, or this is "
                                  "not an scp file")
            if len(parts) != 2:
                raise CorpusError(f"{name}:{lineno}: expected 'uttid ark_path:offset', "
                                  f"got {line.strip()!r}")
            # (the location's bytes as Python's file functions name them in this
            # locale: decoded as UTF-8, a Latin-1 locale opened other bytes)
            key, location = parts[0], os.fsdecode(
                parts[1].strip().encode("utf-8", "surrogateescape"))
            ranges = None
            if location.endswith("]") and "[" in location:
                location, ranges = location[:-1].rsplit("[", 1)
                location = location.rstrip()
            if is_pipe(location):
                if not commands:
                    raise CorpusError(
                        f"{name}:{lineno}: utterance {key!r}: the entry is a command "
                        f"({location!r}); commands inside an scp file run only with "
                        f"--scp-commands (scp_commands=True), for files you trust")
                entries.append((key, location, None, ranges))
                continue
            ark, offset = location, None
            # an offset of ASCII digits, as Kaldi parses it (Python's isdigit also
            # takes other scripts' digits and superscripts)
            found = _OFFSET.fullmatch(location)
            if found:
                ark, offset = found.group(1), int(found.group(2))
            entries.append((key, ark, offset, ranges))
    return entries


_INTEGER = re.compile(r"[+-]?[0-9]+")
#: Rows a Kaldi range may reach past a matrix's end (segments rounded to 10 ms
#: against frames of 25 ms): Kaldi warns and reads up to the last row.
_RANGE_ROW_SLACK = 3


def matrix_range(matrix: np.ndarray, ranges: str, where: str) -> np.ndarray:
    """``matrix`` cut to a Kaldi scp range: ``r1:r2`` (rows) or ``r1:r2,c1:c2``,
    inclusive, each part ``:`` for all; the last row may lie up to two past the
    matrix's end, which is read to its last row, as Kaldi's
    ParseMatrixRangeSpecifier allows.  ``where`` names the entry in errors.

    Example::

        matrix_range(np.zeros((100, 40)), "0:49,0:12", "feats.scp: 'utt1'").shape  # (50, 13)
    """
    rows, cols = matrix.shape
    parts = ranges.split(",")
    bounds = []
    try:
        if len(parts) > 2 or any(not p for p in parts):
            raise ValueError
        for part, size in zip(parts + [":"] * (2 - len(parts)), (rows, cols)):
            if part == ":":
                bounds.append((0, size - 1))
                continue
            first, last = part.split(":")
            if not (_INTEGER.fullmatch(first) and _INTEGER.fullmatch(last)):
                raise ValueError       # (plain ASCII digits only, as Kaldi reads them)
            bounds.append((int(first), int(last)))
    except ValueError:
        raise CorpusError(f"{where}: range [{ranges}] is not Kaldi's 'r1:r2' or "
                          "'r1:r2,c1:c2' (':' for all)") from None
    (r1, r2), (c1, c2) = bounds
    # (the first row must exist: Kaldi fails on a range that cuts no row)
    if not (0 <= r1 <= r2 < rows + _RANGE_ROW_SLACK and r1 < rows and 0 <= c1 <= c2 < cols):
        raise CorpusError(f"{where}: range [{ranges}] lies outside its {rows} x {cols} "
                          "matrix")
    return np.ascontiguousarray(matrix[r1:min(r2, rows - 1) + 1, c1:c2 + 1])


def iter_scp(target: str, *, max_open: int = 16, expect: str = "matrix",
             commands: bool = False):
    """(key, matrix) for each scp entry, in scp order, keeping a few arks open;
    ``commands``: run entries that are commands (see :func:`parse_scp`)."""
    handles: OrderedDict[str, Input] = OrderedDict()
    try:
        for key, location, offset, ranges in parse_scp(target, commands=commands):
            if ranges is not None and expect == "ints":
                raise CorpusError(f"{target}: utterance {key!r}: a range ([{ranges}]) on an "
                                  "alignment; ranges cut matrices only")
            if is_pipe(location):
                # one bare object (no key) on the command's stdout
                with _opened(location, "scp entry") as src:
                    value = read_record(src, key, expect=expect)
                yield key, _ranged(value, ranges, target, key)
                continue
            src = handles.get(location)
            if src is None:
                if not os.path.isfile(location):
                    raise CorpusError(f"{target}: utterance {key!r} points to {location!r}, "
                                      "which is not a readable file")
                src = Input.open(location, "ark")
                handles[location] = src
                if len(handles) > max_open:
                    handles.popitem(last=False)[1].abandon()
            else:
                handles.move_to_end(location)
            size = os.fstat(src.handle.fileno()).st_size
            if (offset or 0) >= size:
                raise CorpusError(f"{target}: utterance {key!r} points to offset {offset} of "
                                  f"{location!r}, at or past its end")
            # Without an offset the file holds one bare object (no key), as in Kaldi.
            src.seek(offset or 0)
            yield key, _ranged(read_record(src, key, expect=expect), ranges, target, key)
    finally:
        for src in handles.values():
            src.abandon()


def _ranged(value, ranges, target: str, key: str):
    """A record cut to its scp entry's range (None: as it is; "" is refused)."""
    if ranges is None:
        return value
    return matrix_range(value, ranges, f"{target}: utterance {key!r}")


def read_feature_matrices(spec: str, *, scp_commands: bool = False):
    """(utterance id, float32 matrix (T, D)) for each entry of an rspecifier.

    Only Kaldi float matrices are accepted (binary, compressed or text); any
    other record is refused by key with a :class:`CorpusError` naming the
    file or command.  Entries of an scp file that are commands run only with
    ``scp_commands`` (a pipe in ``spec`` itself is the caller's own command).

    Example::

        for utt, feats in read_feature_matrices("scp:data/test/feats.scp"):
            feats.shape        # (frames, feat_dim)
    """
    kind, target = split_rspecifier(spec, "feats")
    records = iter_scp(target, commands=scp_commands) if kind == "scp" \
        else iter_ark(target)                                   # binary or text
    for key, value in records:
        yield key, as_features(target, key, value)


def as_features(name: str, key: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 2 or value.dtype.kind != "f":
        shape = getattr(value, "shape", None)
        raise CorpusError(f"{name}: utterance {key!r}: expected a float matrix of features, "
                          f"got {type(value).__name__} with shape {shape}")
    if value.shape[0] and not value.shape[1]:
        raise CorpusError(f"{name}: utterance {key!r}: feature matrix has {value.shape[0]} "
                          "rows and no columns")
    if value.dtype.itemsize > 4 and value.size:
        # a finite double beyond float32's range would be stored as inf
        beyond = np.abs(value) > np.finfo(np.float32).max
        beyond &= np.isfinite(value)
        if beyond.any():
            row, col = (int(i) for i in np.argwhere(beyond)[0])
            raise CorpusError(f"{name}: utterance {key!r}: {int(beyond.sum())} value(s) "
                              f"beyond the float32 range features are stored in, the first "
                              f"{value[row, col]:.6g} at frame {row}, dimension {col}")
    return value.astype(np.float32, copy=False)


# ---------------------------------------------------------------- CMVN and speakers

def read_cmvn_stats(spec: str, *, scp_commands: bool = False) -> dict[str, np.ndarray]:
    """Kaldi CMVN stats by speaker (or utterance): float64 matrices 2 x (D+1), or
    1 x (D+1) (the sums and the count alone, which Kaldi takes without
    ``--norm-vars``).

    Read like features (``scp:cmvn.scp``, ``ark:cmvn.ark``, text or binary),
    so only Kaldi float matrices are decoded; every other record is refused.
    The dimension is checked against the features where they are applied.
    ``scp_commands``: as for :func:`read_feature_matrices`.

    Example::

        stats = read_cmvn_stats("scp:data/train/cmvn.scp")
        stats["spk1"][0, -1]        # the speaker's frame count
    """
    kind, target = split_rspecifier(spec, "cmvn")
    records = iter_scp(target, expect="stats", commands=scp_commands) if kind == "scp" \
        else iter_ark(target, expect="stats")
    stats: dict[str, np.ndarray] = {}
    for key, value in records:
        if not isinstance(value, np.ndarray) or value.ndim != 2 \
                or value.shape[0] not in (1, 2) or value.shape[1] < 2:
            raise CorpusError(f"{target}: speaker {key!r}: expected a 2 x (dim+1) CMVN stats "
                              f"matrix (or 1 x (dim+1) without variances), got shape "
                              f"{getattr(value, 'shape', None)}")
        if key in stats:
            raise CorpusError(f"{target}: speaker {key!r} appears twice")
        stats[key] = value.astype(np.float64)
    if not stats:
        raise CorpusError(f"{target}: no CMVN stats found")
    return stats


def read_utt2spk(path: str) -> dict[str, str]:
    """Kaldi's utt2spk: lines ``utterance speaker``; a path, or an rspecifier as
    Kaldi's tools take it (``ark:data/train/utt2spk``, ``ark,t:...``, a pipe).

    Example::

        read_utt2spk("data/train/utt2spk")["spk1-utt1"]      # 'spk1'
    """
    kind, target = split_rspecifier(path, "utt2spk")
    if kind == "scp":
        raise ValueError(f"utt2spk: {path!r}: an utt2spk is a text file (or 'ark:FILE'), "
                         "not an scp")
    mapping: dict[str, str] = {}
    with _opened(target, "utt2spk") as src:
        for lineno, raw in enumerate(src.lines(), 1):
            try:
                parts = raw.decode("utf-8").split()
            except UnicodeDecodeError:
                raise CorpusError(f"{src.name}:{lineno}: not UTF-8 text: {_NOT_UTF8}, or "
                                  "this is not an utt2spk file") from None
            if not parts:
                continue
            if len(parts) != 2:
                raise CorpusError(f"{src.name}:{lineno}: expected 'utterance speaker', got "
                                  f"{' '.join(parts)[:80]!r}")
            if parts[0] in mapping:
                raise CorpusError(f"{src.name}:{lineno}: utterance {parts[0]!r} appears twice")
            mapping[parts[0]] = parts[1]
    return mapping


# ---------------------------------------------------------------- alignments

def as_pdf_ids(name: str, key: str, labels: np.ndarray) -> np.ndarray:
    if labels.size and (labels.min() < 0 or labels.max() > np.iinfo(np.int32).max):
        bad = labels.min() if labels.min() < 0 else labels.max()
        raise CorpusError(f"{name}: utterance {key!r}: pdf id {bad} is not a valid class index")
    return labels.astype(np.int32)


_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def _text_alignments(src: Input, alignments: dict) -> None:
    for lineno, raw in enumerate(src.lines(), 1):
        # Split at ASCII whitespace as Kaldi splits (not at a no-break space), and
        # decoded leniently: a line that is not text fails below as a bad pdf id.
        parts = [part.decode("utf-8", errors="replace") for part in raw.split()]
        if not parts:
            continue
        # Kaldi writes "utt 3 3 5"; kaldiio's text mode brackets it: "utt [ 3 3 5 ]".
        key, values = parts[0], [v for v in parts[1:] if v not in ("[", "]")]
        # ASCII digits only, as Kaldi reads them (Python's int() takes '1_0', and
        # other scripts' digits)
        bad = next((v for v in values if not _INTEGER.fullmatch(v)), None)
        if bad is not None:
            raise CorpusError(f"{src.name}:{lineno}: utterance {key!r}: expected integer pdf "
                              f"ids, got {bad[:40]!r}")
        numbers = [int(v) for v in values]
        # a number beyond int64 (a damaged file) would overflow the array below
        huge = next((n for n in numbers if not _INT64_MIN <= n <= _INT64_MAX), None)
        if huge is not None:
            shown = str(huge) if len(str(huge)) <= 40 else str(huge)[:37] + "..."
            raise CorpusError(f"{src.name}:{lineno}: utterance {key!r}: pdf id {shown} is "
                              "not a valid class index")
        labels = np.array(numbers, dtype=np.int64)
        if key in alignments:
            raise CorpusError(f"{src.name}:{lineno}: utterance {key!r} appears twice")
        alignments[key] = as_pdf_ids(src.name, key, labels)


def _binary_alignments(src: Input, alignments: dict) -> None:
    while True:
        key = _read_key(src)
        if key is None:
            return
        labels = read_record(src, key, expect="ints")
        if key in alignments:
            raise CorpusError(f"{src.name}: utterance {key!r} appears twice")
        alignments[key] = labels


def read_alignments(spec: str, *, scp_commands: bool = False) -> dict[str, np.ndarray]:
    """Per-frame pdf ids by utterance, from 'ark:', 'ark,t:', a pipe, a text file
    or 'scp:' (entries pointing at binary int32 vectors, as `copy-int-vector`
    writes them with 'ark,scp:'; ``scp_commands`` as for :func:`read_feature_matrices`).

    Example::

        ali = read_alignments("ark,t:exp/tri3_ali/pdf.txt")
        ali["spk1-utt1"][:5]
    """
    kind, target = split_rspecifier(spec, "ali")
    alignments: dict[str, np.ndarray] = {}
    if kind == "scp":
        for key, labels in iter_scp(target, expect="ints", commands=scp_commands):
            if key in alignments:
                raise CorpusError(f"{target}: utterance {key!r} appears twice")
            alignments[key] = as_pdf_ids(target, key, labels)
        return alignments
    with _opened(target, "alignment") as src:
        head = src.peek(4096)
        space = head.find(b" ")
        # binary or text whatever the options say ('ark,t:' too), as Kaldi reads
        if space > 0 and head[space + 1:space + 3] == b"\0B":
            _binary_alignments(src, alignments)
        else:
            _text_alignments(src, alignments)
    return alignments
