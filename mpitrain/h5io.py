"""HDF5 helpers: atomic writes, checksums, and reads that trust nothing in the file.

A file is written under a temporary name in the same directory, flushed and
fsynced, then renamed over the target, so a crash never leaves a half-written
model or checkpoint under the real name.

Models and checkpoints carry a checksum of everything they hold, so a file
damaged on disk (bit rot, a bad copy) is refused instead of resumed.  It is a
stored SHA-256 digest rather than HDF5's fletcher32 filter: fletcher32 covers
chunked datasets only, and much of what must survive intact is not in one --
scalar state and the trainer's figures are attributes, step, frame count and
config are root attributes, and NG-SGD's empty buffers cannot be chunked.
Datasets also stay contiguous, so the storage checks below stay exact.  The
digest (:func:`write_checksums`) covers, in one canonical order (members
sorted by name, depth first), every object's path and kind, every attribute's
name and value, and every dataset's dtype, shape and the SHA-256 of its bytes;
it is stored as the root attribute ``checksum`` (``"sha256:<hex>"``).  Each
dataset also keeps its own digest in its attribute ``sha256``, so damaged data
is reported by dataset name, and a file whose ``checksum`` itself was lost is
still told apart from one written before checksums existed.  Such older files
have no digest anywhere and load unverified.  :func:`verify_file` reads the
whole file, whichever part the caller needs, so every MPI rank reaches the
same verdict on the same file; it also refuses NaN and infinity in any float
dataset or attribute (what a diverged or damaged model holds), in old files
too.  Writing runs the same walk, so a non-finite model is never written.

Files we read may come from anyone.  HDF5 lets a file declare a dataset of any
shape without storing its bytes (unwritten chunks read as the fill value), so
reading one in full could allocate far more memory than the file holds.  Every
dataset mpitrain reads in full is therefore checked first
(:func:`dataset_problem`): reached by a hard link (no links into other files),
its bytes inside this file (no virtual or external storage), and its declared
size no larger than the bytes actually stored, which are no more than the
file's size.  mpitrain writes datasets uncompressed, so this holds for every
file it writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re

from .files import atomic_open, special_file


def h5py_module():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a hard dependency
        raise RuntimeError("mpitrain needs h5py: pip install h5py") from exc
    return h5py


@contextlib.contextmanager
def atomic_h5_file(path, *, checksum: bool = False, what: str = "file"):
    """Yield an h5py File open for writing; it appears at ``path`` only on success.

    With ``checksum`` the file's digest is stored when the block ends
    (:func:`write_checksums`); a non-finite float value is refused then.
    HDF5 builds the file in memory and plain file writes put it on disk:
    HDF5 itself never meets a full disk, which leaves its caches broken
    (later errors, even a crash at exit) instead of one clean error.  The
    price is the file's size in memory while it is written.

    Example::

        with atomic_h5_file("model.h5", checksum=True, what="model") as f:
            f["params"] = params
    """
    import io
    h5py = h5py_module()
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        yield f
        if checksum:
            write_checksums(f, path, what=what)
    view = image.getbuffer()
    try:
        with atomic_open(path, "wb") as fh:
            for start in range(0, len(view), _WRITE_BYTES):
                fh.write(view[start:start + _WRITE_BYTES])
    finally:
        view.release()


# Written to disk this many bytes at a time, so no second copy of the image is made.
_WRITE_BYTES = 64 << 20


def h5_reader(path):
    """``path`` open read-only in h5py, without HDF5's file lock.

    HDF5 locks a file it opens, and fails the open where the filesystem cannot
    lock (a parallel filesystem mounted without locks: "unable to lock file,
    errno = 38" or 524) or where another program holds a write lock.  mpitrain
    reads files that are complete when they appear (every writer here writes a
    temporary file and renames it), so its reads need no lock; the lock would
    only stop ranks on such a filesystem from reading their corpus at all.
    """
    if special_file(path):
        # HDF5 would open a named pipe and wait for a writer for ever
        raise OSError("not a regular file (a named pipe, socket or device)")
    f = h5py_module().File(path, "r", locking=False)
    try:
        problem = _sequence_attribute(f) or _global_heap_problem(f)
    except BaseException:
        f.close()
        raise
    if problem:
        f.close()
        raise OSError(problem)
    return f


def _global_heap_problem(f) -> str | None:
    """How a global heap collection of the file is damaged so that HDF5 would loop
    for ever or read past it; None when none is.

    Text (attributes, utterance ids) lives in global heap collections ("GCOL"
    blocks).  HDF5 walks a collection's objects by their declared sizes: one whose
    size a flipped bit set to zero (a free-space entry) never moves the walk on,
    and reading any text of the file then hangs in HDF5 (no signal but SIGKILL
    ends it), where a damaged checkpoint must be skipped for the previous one.
    The collections lie outside the datasets' raw data, so only the bytes
    between those (the file's metadata) are searched."""
    try:
        # the bytes HDF5 opened (a file renamed over the path meanwhile is not them)
        fd = f.id.get_vfd_handle()
        stat = os.fstat(fd)
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if identity in _SOUND_HEAPS or _size_of_lengths(fd, stat.st_size) != 8:
            return None      # (objects' sizes of another width: the walk below reads 8)
        extents = _raw_extents(f)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, AttributeError):
        # (the readers name this damage where they meet it; AttributeError: an HDF5
        # older than 1.10.5 tells no chunk's place, and the heaps go unchecked)
        return None
    size = stat.st_size
    at = 0
    for start, end in extents + [(size, size)]:
        # (a damaged chunk index may place data past the file's end)
        start, end = min(start, size), min(end, size)
        if start > at:
            problem = _collections_between(fd, at, start, size)
            if problem:
                return problem
        at = max(at, end)
    if len(_SOUND_HEAPS) > 100_000:
        _SOUND_HEAPS.clear()
    _SOUND_HEAPS.add(identity)
    return None


# Files whose heaps were found sound, by (device, inode, size, modification time):
# a shard is opened again for every chunk read, and the walk costs a few
# milliseconds per thousand utterances.
_SOUND_HEAPS = set()


def _raw_extents(f) -> list:
    """Sorted (start, end) byte ranges of every dataset's stored data."""
    h5py = h5py_module()
    extents = []

    def visit(_, obj):
        if isinstance(obj, h5py.Dataset):
            offset = obj.id.get_offset()
            if offset is not None:
                extents.append((offset, offset + obj.id.get_storage_size()))
            elif obj.chunks is not None:
                extents.extend(_chunk_extents(obj.id))
    f.visititems(visit)
    return sorted(extents)


def _chunk_extents(dsid) -> list:
    """(start, end) byte ranges of a chunked dataset's stored chunks.  h5py has
    ``chunk_iter`` (one pass) only from 3.8 on and where its HDF5 is 1.12.3 or
    later (not the HDF5 1.12.2 of some wheels); elsewhere each chunk is asked for."""
    extents = []
    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(lambda chunk: extents.append(
            (chunk.byte_offset, chunk.byte_offset + chunk.size)))
        return extents
    for index in range(dsid.get_num_chunks()):
        chunk = dsid.get_chunk_info(index)
        extents.append((chunk.byte_offset, chunk.byte_offset + chunk.size))
    return extents


_GCOL = b"GCOL"
_SEARCH_BYTES = 1 << 20
_SUPERBLOCK = b"\x89HDF\r\n\x1a\n"


def _size_of_lengths(fd: int, size: int) -> int | None:
    """The superblock's "size of lengths" (bytes of every size field, a heap
    object's included; 8 as HDF5 writes by default); None where no superblock is
    found.  The superblock is at byte 0, or 512, 1024, ... after a user block."""
    at = 0
    while at + 16 <= size:
        head = os.pread(fd, 16, at)
        if head[:8] == _SUPERBLOCK:
            # versions 0 and 1: sizes of offsets and lengths at bytes 13, 14; later: 9, 10
            return head[14] if head[8] in (0, 1) else head[10]
        at = 512 if at == 0 else at * 2
    return None


def _collections_between(fd: int, start: int, stop: int, size: int) -> str | None:
    """Check each global heap collection whose signature lies in [start, stop)."""
    at = start
    while at < stop:
        block = os.pread(fd, min(_SEARCH_BYTES, stop - at) + len(_GCOL) - 1, at)
        if not block:
            break
        found = block.find(_GCOL)
        while found != -1 and at + found < stop:
            problem = _collection_problem(fd, at + found, size)
            if problem:
                return problem
            found = block.find(_GCOL, found + 1)
        at += _SEARCH_BYTES
    return None


def _collection_problem(fd: int, at: int, size: int) -> str | None:
    """Walk the collection at byte ``at`` as HDF5 does (H5HG's decoding)."""
    header = os.pread(fd, 16, at)
    if len(header) < 16 or header[4] != 1 or header[5:8] != b"\0\0\0":
        return None      # not a collection HDF5 reads as one (it refuses it itself)
    length = int.from_bytes(header[8:16], "little")
    if length < 16 or at + length > size:
        return None      # (HDF5 refuses a collection past the file's end)
    body = os.pread(fd, length - 16, at + 16)
    end, p = length - 16, 0
    while p + 16 <= end:
        index = int.from_bytes(body[p:p + 2], "little")
        declared = int.from_bytes(body[p + 8:p + 16], "little")
        need = 16 + (declared + 7) // 8 * 8 if index else declared
        if need == 0:
            return (f"its global heap collection at byte {at} is damaged: an empty entry "
                    f"at byte {at + 16 + p} (HDF5 would read the collection for ever)")
        if need > end - p:
            return (f"its global heap collection at byte {at} is damaged: object {index} "
                    f"at byte {at + 16 + p} declares {declared} bytes, past the "
                    "collection's end")
        p += need
    return None


def _sequence_attribute(f) -> str | None:
    """The first attribute whose datatype is (or holds) a variable-length sequence,
    in words; None when there is none.

    mpitrain writes numbers and text only.  A damaged datatype message (a single
    flipped bit turns a text attribute's into a sequence of an unknown kind)
    makes HDF5 crash the process while converting the value on reading, before
    any check could see it; the type itself is read without the value.  A file
    damaged otherwise is left to the readers, which name the damage."""
    h5py = h5py_module()
    vlen = h5py.h5t.VLEN

    def check(obj):
        for name in obj.attrs:
            kind = h5py.h5a.open(obj.id, _name_bytes(name)).get_type()
            if kind.get_class() == vlen or kind.detect_class(vlen):
                where = obj.name.strip("/")
                return (f"attribute '{f'{where}/' if where else ''}{name}' has a "
                        "variable-length sequence type, which no mpitrain file holds "
                        "(a damaged datatype)")
        return None

    try:
        return check(f) or f.visititems(lambda _, obj: check(obj))
    except (OSError, RuntimeError, KeyError, TypeError, ValueError):
        return None      # (the readers name this damage where they meet it)


def open_h5_for_reading(path, what: str):
    """Open ``path`` read-only, turning h5py's errors into one clear message."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        return h5_reader(path)
    except OSError as exc:
        raise ValueError(f"{path}: not a readable HDF5 {what} ({exc})") from exc


@contextlib.contextmanager
def reading_errors(path, what: str):
    """Turn what h5py raises on a damaged file into one ValueError naming the file.

    Our own ValueErrors (they start with the file name) pass unchanged.

    Example::

        with open_h5_for_reading(path, "model") as f, reading_errors(path, "model"):
            ...
    """
    try:
        yield
    except ValueError as exc:
        if str(exc).startswith(f"{path}:"):
            raise
        raise ValueError(f"{path}: damaged {what} ({_one_line(exc)})") from None
    except (OSError, RuntimeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: damaged {what} ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def link_problem(group, name: str, path, *, what: str) -> str | None:
    """Why ``group[name]`` may not be followed (missing, or a soft or external link).

    Example::

        problem = link_problem(f, "model", "ckpt.h5", what="checkpoint")   # None if fine
    """
    link = group.get(name, getlink=True)
    where = _member(group, name)
    if link is None:
        return f"{path}: {what} has no '{where}'"
    if not isinstance(link, h5py_module().HardLink):
        # External links open other files; soft links can form cycles.
        return (f"{path}: '{where}' is a link ({type(link).__name__}); only objects stored "
                "in this file are read")
    return None


def dataset_problem(group, name: str, path, *, what: str) -> str | None:
    """Why reading dataset ``group[name]`` in full is unsafe, or None.

    The checks read metadata only; nothing of the dataset's size is allocated.

    Example::

        problem = dataset_problem(f, "params", "final.h5", what="model")
        if problem: raise ValueError(problem)
    """
    problem = link_problem(group, name, path, what=what)
    if problem:
        return problem
    h5py = h5py_module()
    obj = group[name]
    where = _member(group, name)
    if not isinstance(obj, h5py.Dataset):
        return f"{path}: '{where}' is a {_kind(obj)}, expected a dataset"
    plist = obj.id.get_create_plist()
    if obj.is_virtual or plist.get_external_count():
        return (f"{path}: dataset '{where}' keeps its data outside this file "
                "(virtual or external storage); not accepted")
    declared = _product(obj.shape) * obj.id.get_type().get_size()
    stored = int(obj.id.get_storage_size())
    size = os.path.getsize(obj.file.filename)
    if declared > stored or stored > size:
        squeezed = _compression(plist)
        if squeezed and stored <= size:
            return (f"{path}: dataset '{where}' is stored compressed ({squeezed}; "
                    f"{stored} bytes for a declared {declared}), which is not accepted: a "
                    "declared size can be checked only against the bytes stored; write it "
                    "again without compression")
        return (f"{path}: dataset '{where}' declares shape {obj.shape} ({declared} bytes) but "
                f"the file stores {min(stored, size)} bytes of it (unwritten or compressed "
                "data is not accepted)")
    return None


def _kind(obj) -> str:
    """What an HDF5 object is, in words: a file may hold named datatypes too."""
    h5py = h5py_module()
    return ("dataset" if isinstance(obj, h5py.Dataset) else
            "group" if isinstance(obj, h5py.Group) else "named datatype")


def _compression(plist) -> str:
    """The compression filters of a dataset's creation list, in words ('' if none):
    shuffle and fletcher32 change no size."""
    h5z = h5py_module().h5z
    names = {h5z.FILTER_DEFLATE: "gzip", h5z.FILTER_LZF: "lzf", h5z.FILTER_SZIP: "szip"}
    found = []
    for i in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(i)
        if code not in (h5z.FILTER_SHUFFLE, h5z.FILTER_FLETCHER32):
            found.append(names.get(code) or name.decode("ascii", "replace") or f"filter {code}")
    return ", ".join(found)


def require_dataset(f, name: str, path, *, what: str):
    """``f[name]`` after :func:`dataset_problem` found nothing; ValueError otherwise.

    Example::

        params = require_dataset(f, "params", "final.h5", what="model")[...]
    """
    problem = dataset_problem(f, name, path, what=what)
    if problem:
        raise ValueError(problem)
    return f[name]


def _member(group, name: str) -> str:
    parent = group.name.strip("/")
    return f"{parent}/{name}" if parent else name


def _product(shape) -> int:
    n = 1
    for extent in shape or ():
        n *= int(extent)
    return n


def write_state(group, state: dict) -> None:
    """Store a nested dict: arrays become datasets, scalars attributes, dicts groups.

    Example::

        write_state(f.create_group("optimizer"), {"num_steps": 3, "delta": arr})
    """
    import numpy as np
    for key, value in state.items():
        key = str(key)
        if isinstance(value, dict):
            write_state(group.create_group(key), value)
        elif isinstance(value, np.ndarray):
            group.create_dataset(key, data=value)
        elif value is None:
            group.attrs[key] = "__none__"
        elif isinstance(value, (bool, int, float, str, np.generic)):
            group.attrs[key] = value
        else:
            raise TypeError(f"cannot store {key!r} of type {type(value).__name__} in HDF5")


# Deeper nesting than any state we write means a crafted (or cyclic) file.
MAX_STATE_DEPTH = 16


def read_state(group, path=None, *, what: str = "file", _depth: int = 0) -> dict:
    """Inverse of :func:`write_state`; each dataset is checked before it is read.

    Only hard links are followed, nesting is at most ``MAX_STATE_DEPTH`` groups
    deep, and datasets must hold numbers; ValueError names file and member.

    Example::

        state = read_state(f["ranks/00000"], "ckpt-00000100.h5", what="checkpoint")
    """
    import numpy as np
    path = group.file.filename if path is None else path
    if _depth > MAX_STATE_DEPTH:
        raise ValueError(f"{path}: group '{group.name.strip('/')}' is nested more than "
                         f"{MAX_STATE_DEPTH} deep")
    state = {}
    for key, value in group.attrs.items():
        if isinstance(value, str) and value == "__none__":
            state[key] = None
        elif isinstance(value, np.generic) and value.dtype.kind in "biuf":
            state[key] = value.item()
        elif isinstance(value, (str, bool, int, float)):
            state[key] = value
        else:
            # write_state stores arrays as datasets: an attribute holds one number or text
            raise ValueError(f"{path}: attribute '{_member(group, key)}': expected a number "
                             f"or text, got {_attr_kind(value)}")
    h5py = h5py_module()
    for key in group.keys():
        problem = link_problem(group, key, path, what=what)
        if problem:
            raise ValueError(problem)
        item = group[key]
        if isinstance(item, h5py.Group):
            state[key] = read_state(item, path, what=what, _depth=_depth + 1)
            continue
        problem = dataset_problem(group, key, path, what=what)
        if problem:
            raise ValueError(problem)
        if item.dtype.kind not in "biuf":
            raise ValueError(f"{path}: dataset '{_member(group, key)}' has dtype {item.dtype}; "
                             "expected numbers")
        state[key] = item[...]
    return state


def _attr_kind(value) -> str:
    import numpy as np
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    if isinstance(value, h5py_module().Empty):
        return "an empty value"
    return f"{type(value).__name__} {value!r:.40}"


# -- checksums ---------------------------------------------------------------------------

#: Root attribute: ``"sha256:"`` and the hex digest of the whole file.
CHECKSUM_ATTR = "checksum"
#: Dataset attribute: the hex SHA-256 of the dataset's bytes.
DIGEST_ATTR = "sha256"
_CHECKSUM_TEXT = re.compile(r"sha256:[0-9a-f]{64}")
# Datasets are read this many bytes at a time, so checking never holds a whole file.
_BLOCK_BYTES = 16 << 20
# Deeper than any model or checkpoint (ranks/r/optimizer/... plus state nesting).
MAX_DEPTH = MAX_STATE_DEPTH + 8


def write_checksums(f, path, *, what: str = "file") -> None:
    """Store the digests of the open, fully written file ``f`` (see the module docstring).

    ValueError (``"<path>: not written: ..."``) if a float is not finite.

    Example::

        with h5py.File(tmp, "w") as f:
            f["params"] = params
            write_checksums(f, "final.h5", what="model")
    """
    digest = _Walk(f, path, what, mode="write").run()
    f.attrs[CHECKSUM_ATTR] = "sha256:" + digest


def verify_file(f, path, *, what: str = "file") -> bool:
    """Check the whole open file ``f``: its digests, finite floats, only hard links.

    Returns True when a stored checksum matched, False for a file written
    before checksums (checked for finite values only).  ValueError naming
    the file and what failed otherwise.

    Example::

        with open_h5_for_reading("final.h5", "model") as f:
            verify_file(f, "final.h5", what="model")
    """
    stored = f.attrs.get(CHECKSUM_ATTR)
    if stored is None:
        _Walk(f, path, what, mode="check").run()
        return False
    if not isinstance(stored, str) or not _CHECKSUM_TEXT.fullmatch(stored):
        raise ValueError(f"{path}: damaged {what}: attribute '{CHECKSUM_ATTR}' is not "
                         "'sha256:' and 64 hex digits")
    if _Walk(f, path, what, mode="verify").run() != stored[len("sha256:"):]:
        raise ValueError(f"{path}: damaged {what}: its attributes or layout do not match "
                         "the stored SHA-256 checksum")
    return True


def stored_checksum(path) -> str | None:
    """The SHA-256 checksum a file written here says it has (its root attribute, not
    verified: the whole file is not read), as hex; None when the file cannot be
    opened or holds none.  What names a file's content cheaply, wherever it lies.

    Example::

        stored_checksum("runs/pre/pretrain.h5")      # "3f0a..." (64 hex digits)
    """
    try:
        with h5_reader(path) as f:
            stored = f.attrs.get(CHECKSUM_ATTR)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(stored, str) or not _CHECKSUM_TEXT.fullmatch(stored):
        return None
    return stored[len("sha256:"):]


def _field(h, tag: bytes, payload: bytes) -> None:
    """One length-prefixed record, so no two layouts hash the same byte stream."""
    h.update(tag + len(payload).to_bytes(8, "little") + payload)


def _name_bytes(name) -> bytes:
    # h5py hands back names it cannot decode as bytes
    return name if isinstance(name, bytes) else name.encode("utf-8", "surrogatepass")


def _attr_bytes(value) -> bytes:
    """A canonical encoding of an attribute value as h5py reads it back."""
    import numpy as np
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, h5py_module().Empty):
        return b"e" + str(value.dtype).encode()
    array = np.asarray(value)
    shape = repr(tuple(array.shape)).encode()
    if array.dtype.kind in "OSU":
        parts = b"".join(len(p).to_bytes(8, "little") + p
                         for p in (_attr_bytes(item) for item in array.ravel().tolist()))
        return b"l" + shape + b";" + parts
    return b"n" + array.dtype.str.encode() + shape + b";" + array.tobytes()


class _Walk:
    """One pass over every object of a file, in canonical order.

    ``mode``: "write" stores each dataset's digest, "verify" compares it,
    "check" (files without checksums) only checks values.  ``run`` returns
    the hex digest of the whole file ("check": of nothing useful).
    """

    def __init__(self, f, path, what: str, *, mode: str):
        self.f, self.path, self.what, self.mode = f, path, what, mode
        self.prefix = f"{path}: not written:" if mode == "write" else f"{path}:"
        self.hash = hashlib.sha256()
        self.seen = set()
        self.digests_found = False

    def run(self) -> str:
        self._visit(self.f, "", 0)
        if self.mode == "check" and self.digests_found:
            # A dataset digest without the file's: the 'checksum' attribute was lost.
            raise ValueError(f"{self.path}: damaged {self.what}: attribute "
                             f"'{CHECKSUM_ATTR}' is missing but its datasets carry checksums")
        return self.hash.hexdigest()

    def _visit(self, obj, name: str, depth: int) -> None:
        h5py = h5py_module()
        if depth > MAX_DEPTH:
            raise ValueError(f"{self.prefix} '{name}' is nested more than {MAX_DEPTH} deep")
        if obj.id in self.seen:
            # Hard links may form cycles; each object is stored once in files we write.
            raise ValueError(f"{self.prefix} '{name}' is reached by more than one link")
        self.seen.add(obj.id)
        is_dataset = isinstance(obj, h5py.Dataset)
        _field(self.hash, b"D" if is_dataset else b"G", _name_bytes(name))
        reserved = DIGEST_ATTR if is_dataset else (CHECKSUM_ATTR if depth == 0 else None)
        for key in sorted(obj.attrs.keys(), key=_name_bytes):
            if key == reserved:
                continue
            value = obj.attrs[key]
            self._check_finite_attr(value, f"{name}/{key}" if name else key)
            _field(self.hash, b"A", _name_bytes(key))
            _field(self.hash, b"V", _attr_bytes(value))
        if is_dataset:
            self._dataset(obj, name)
            return
        for key in sorted(obj.keys(), key=_name_bytes):
            problem = link_problem(obj, key, self.path, what=self.what)
            if problem:
                raise ValueError(problem)
            child = f"{name}/{key}" if name else key
            item = obj[key]
            if not isinstance(item, (h5py.Dataset, h5py.Group)):
                raise ValueError(f"{self.prefix} '{child}' is a {_kind(item)}; expected "
                                 "groups and datasets only")
            if isinstance(item, h5py.Dataset) and self.mode != "write":
                problem = dataset_problem(obj, key, self.path, what=self.what)
                if problem:
                    raise ValueError(problem)
            self._visit(item, child, depth + 1)

    def _check_finite_attr(self, value, where: str) -> None:
        import numpy as np
        if isinstance(value, (np.floating, np.complexfloating, float)) or (
                isinstance(value, np.ndarray) and value.dtype.kind in "fc"):
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{self.prefix} attribute '{where}' is not finite "
                                 f"({value!r})")

    def _dataset(self, data, name: str) -> None:
        import numpy as np
        if data.dtype.kind not in "biuf":
            raise ValueError(f"{self.prefix} dataset '{name}' has dtype {data.dtype}; "
                             "expected numbers")
        digest = hashlib.sha256() if self.mode != "check" else None
        for offset, block in _blocks(data):
            if data.dtype.kind == "f" and not np.isfinite(block).all():
                index = offset + int(np.flatnonzero(~np.isfinite(block.ravel()))[0])
                raise ValueError(f"{self.prefix} dataset '{name}' holds a non-finite value "
                                 f"({block.ravel()[index - offset]} at flat index {index})")
            if digest is not None:
                digest.update(np.ascontiguousarray(block).view(np.uint8).ravel())
        stored = data.attrs.get(DIGEST_ATTR)
        self.digests_found |= stored is not None
        if self.mode == "write":
            data.attrs[DIGEST_ATTR] = digest.hexdigest()
        elif self.mode == "verify":
            if stored is None:
                raise ValueError(f"{self.path}: damaged {self.what}: dataset '{name}' has no "
                                 f"'{DIGEST_ATTR}' checksum attribute")
            if stored != digest.hexdigest():
                raise ValueError(f"{self.path}: damaged {self.what}: the data of dataset "
                                 f"'{name}' does not match its SHA-256 checksum")
        _field(self.hash, b"T", data.dtype.str.encode())
        _field(self.hash, b"S", repr(tuple(data.shape)).encode())
        if digest is not None:
            _field(self.hash, b"H", digest.digest())


def _blocks(data):
    """(flat offset, array) pieces of dataset ``data``, at most ~_BLOCK_BYTES each."""
    import numpy as np
    if data.shape == ():
        yield 0, np.asarray(data[()]).reshape(1)
        return
    if _product(data.shape) == 0:
        return
    row = _product(data.shape[1:])
    rows = max(1, _BLOCK_BYTES // max(1, row * data.dtype.itemsize))
    for start in range(0, data.shape[0], rows):
        yield start * row, data[start:start + rows]
