"""HDF5 shard files: many utterances of frames and frame labels in one file.

A shard holds four datasets (see docs/data-format.md):

- ``feats``       float32 (T, D), chunked along frames, uncompressed
- ``labels``      int32 (T,), chunked like ``feats``
- ``utt_offsets`` int64 (U+1,), ``utt_offsets[0] == 0`` and ``utt_offsets[-1] == T``
- ``utt_ids``     variable-length UTF-8 strings (U,)

and the file attribute ``format_version``.  Utterance ``u`` owns the frames
``utt_offsets[u]:utt_offsets[u+1]``, so reading a run of utterances is one
contiguous slice of ``feats`` and ``labels``.

h5py is imported only when a shard is opened or written.

Example::

    write_shard("shard-00000.h5", ["a", "b"], [feats_a, feats_b], [labels_a, labels_b])
    with ShardReader("shard-00000.h5") as shard:
        feats, labels, offsets = shard.read(0, shard.num_utterances)
"""

from __future__ import annotations

import contextlib
import io
import numbers
import os
from typing import Sequence

import numpy as np

from ..files import WriteError, commit, discard, disk_full_error, temporary_path
from ..h5io import h5_reader
from .corpus import CorpusError

FORMAT_VERSION = 1
FEATS = "feats"
LABELS = "labels"
UTT_OFFSETS = "utt_offsets"
UTT_IDS = "utt_ids"

# Wider frames than any speech feature: a larger width is a damaged or crafted file.
MAX_FEAT_DIM = 1 << 16

# What h5py raises where a file's bytes are damaged: a bad object header is a
# KeyError, a bad B-tree or symbol table a RuntimeError, unreadable data an OSError.
HDF5_ERRORS = (OSError, KeyError, RuntimeError)

def hdf5_reason(exc: BaseException) -> str:
    """h5py's message of one of :data:`HDF5_ERRORS`, without a KeyError's quotes.

    Example::

        hdf5_reason(KeyError("Unable to open object"))    # 'Unable to open object'
    """
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


# Aim for chunks of about 512 KiB of features: big enough that a contiguous
# range read touches few chunks, small enough that a short read stays cheap.
_CHUNK_BYTES = 512 * 1024


def _h5py():
    import h5py
    return h5py


def chunk_rows(feat_dim: int) -> int:
    """Rows per HDF5 chunk for features of width ``feat_dim``.

    Example::

        chunk_rows(40)   # 3276 rows = 512 KiB of float32
    """
    return max(64, _CHUNK_BYTES // (4 * max(1, int(feat_dim))))


def check_utterance(where: str, utt_id: str, feats, labels, feat_dim: int | None = None):
    """Validate one utterance and return it as (float32 (T, D), int32 (T,)).

    ``where`` names the file being written, for the error message.

    Example::

        feats, labels = check_utterance("out/shard-00000.h5", "utt1", feats, labels, 40)
    """
    if not isinstance(utt_id, str) or not utt_id:
        raise ValueError(f"{where}: utterance id must be a non-empty string, got {utt_id!r}")
    if any(letter.isspace() for letter in utt_id):
        # a Kaldi archive key ends at the first space: export would write another id
        raise ValueError(f"{where}: utterance id {utt_id!r} holds whitespace, which a Kaldi "
                         "id cannot (export writes the ids as archive keys)")
    try:
        feats, labels = np.asarray(feats), np.asarray(labels)
    except (ValueError, TypeError):
        # (rows of different lengths: NumPy's message named neither utterance nor argument)
        raise ValueError(f"{where}: utterance {utt_id!r}: feats and labels must each be "
                         "one rectangular array of numbers") from None
    if feats.ndim != 2:
        raise ValueError(f"{where}: utterance {utt_id!r}: feats must be 2-D (frames, dim), "
                         f"got shape {feats.shape}")
    if feats.dtype.kind not in "fiu":
        # (a complex array lost its imaginary part without a word; bool became 0/1)
        raise ValueError(f"{where}: utterance {utt_id!r}: feats must be float or integer "
                         f"numbers, got dtype {feats.dtype}")
    if feats.shape[0] == 0:
        raise ValueError(f"{where}: utterance {utt_id!r}: feats has no frames")
    if feat_dim is not None and feats.shape[1] != feat_dim:
        raise ValueError(f"{where}: utterance {utt_id!r}: feats has dimension {feats.shape[1]}, "
                         f"expected {feat_dim}")
    if labels.ndim != 1 or labels.shape[0] != feats.shape[0]:
        raise ValueError(f"{where}: utterance {utt_id!r}: labels must have shape "
                         f"({feats.shape[0]},) to match feats, got {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{where}: utterance {utt_id!r}: labels must be integers, "
                         f"got dtype {labels.dtype}")
    if feats.dtype.kind == "f" and feats.dtype.itemsize > 4:
        # a finite double beyond float32's range would be stored as inf, then called
        # "NaN or inf", which the caller's array did not hold (the Kaldi import's rule)
        with np.errstate(invalid="ignore"):
            beyond = np.isfinite(feats) & (np.abs(feats) > np.finfo(np.float32).max)
        if beyond.any():
            row, col = (int(i) for i in np.argwhere(beyond)[0])
            raise ValueError(f"{where}: utterance {utt_id!r}: {int(beyond.sum())} value(s) "
                             f"beyond the float32 range features are stored in, the first "
                             f"{feats[row, col]:.6g} at frame {row}, dimension {col}")
    return np.ascontiguousarray(feats, dtype=np.float32), labels.astype(np.int32, copy=False)


class _WriteGuard(io.RawIOBase):
    """The file HDF5 writes a shard through, which never tells HDF5 of a failed
    write: the first failure (a full disk, a quota, a file size limit) is kept in
    ``error`` and later writes are dropped.  HDF5 that meets a failed write is left
    with broken caches: its next calls fail too and the process crashed at exit
    (a bus error) after the error was reported."""

    def __init__(self, path: str):
        super().__init__()
        self._fh = open(path, "w+b", buffering=0)
        self.error = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos, whence=0):
        return self._fh.seek(pos, whence)

    def tell(self):
        return self._fh.tell()

    def readinto(self, buffer):
        return self._fh.readinto(buffer)

    def write(self, data):
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += self._fh.write(view[done:])
                return len(view)
            except OSError as exc:
                self.error = exc
        self._fh.seek(len(view), os.SEEK_CUR)     # dropped: the shard is discarded
        return len(view)

    def truncate(self, size=None):
        if self.error is None:
            try:
                return self._fh.truncate(size)
            except OSError as exc:
                self.error = exc
        return size

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self._fh.close()
        super().close()


class ShardBuilder:
    """Append utterances to one shard file; ``close()`` renames it into place.

    The file is written under a temporary name, so an interrupted write never
    leaves a file that looks finished.  Frames are buffered and written in
    blocks of whole chunks, which keeps the HDF5 calls few.  A write that fails
    (a full disk) is raised naming the shard at the next flush or at
    :meth:`finish`, and :meth:`abort` discards the file.

    Example::

        builder = ShardBuilder("out/shard-00000.h5", feat_dim=40)
        builder.add("utt1", feats, labels)
        builder.close()          # or builder.abort() to discard
    """

    def __init__(self, path: str, *, feat_dim: int):
        if int(feat_dim) <= 0:
            raise ValueError(f"{path}: feat_dim must be positive, got {feat_dim}")
        self.path = str(path)
        self.feat_dim = int(feat_dim)
        self._tmp = temporary_path(self.path)
        self.temporary = self._tmp        # where it is written until commit()
        self._finished = False
        self._rows = chunk_rows(self.feat_dim)
        try:
            self._raw = _WriteGuard(self._tmp)
        except OSError as exc:
            raise _write_error(exc, self.path) from exc
        self._file = _h5py().File(self._raw, "w")
        self._file.attrs["format_version"] = FORMAT_VERSION
        self._feats = self._file.create_dataset(
            FEATS, shape=(0, self.feat_dim), maxshape=(None, self.feat_dim),
            dtype=np.float32, chunks=(self._rows, self.feat_dim))
        self._labels = self._file.create_dataset(
            LABELS, shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(self._rows,))
        self._utt_ids: list[str] = []
        self._offsets: list[int] = [0]
        self._pending_feats: list[np.ndarray] = []
        self._pending_labels: list[np.ndarray] = []
        self._pending_frames = 0
        self._written = 0

    @property
    def num_frames(self) -> int:
        return self._offsets[-1]

    @property
    def num_utterances(self) -> int:
        return len(self._utt_ids)

    def add(self, utt_id: str, feats, labels) -> None:
        feats, labels = check_utterance(self.path, utt_id, feats, labels, self.feat_dim)
        self._utt_ids.append(utt_id)
        self._offsets.append(self._offsets[-1] + feats.shape[0])
        self._pending_feats.append(feats)
        self._pending_labels.append(labels)
        self._pending_frames += feats.shape[0]
        if self._pending_frames >= 4 * self._rows:
            self._flush()

    def _flush(self) -> None:
        if not self._pending_frames:
            return
        start, end = self._written, self._written + self._pending_frames
        self._feats.resize(end, axis=0)
        self._labels.resize(end, axis=0)
        self._feats[start:end] = np.concatenate(self._pending_feats)
        self._labels[start:end] = np.concatenate(self._pending_labels)
        self._written = end
        self._pending_feats.clear()
        self._pending_labels.clear()
        self._pending_frames = 0
        self._check_writes()

    def _check_writes(self) -> None:
        if self._raw.error is not None:
            raise _write_error(self._raw.error, self.path) from self._raw.error

    def close(self) -> None:
        """Write the utterance index, close the file and rename it into place."""
        self.finish()
        self.commit()

    def finish(self) -> None:
        """Write the utterance index and close the file, still under its temporary
        name (:meth:`commit` puts it in place)."""
        if self._file is None:
            return
        self._flush()
        self._file.create_dataset(UTT_OFFSETS, data=np.asarray(self._offsets, dtype=np.int64))
        self._file.create_dataset(UTT_IDS, data=self._utt_ids,
                                  dtype=_h5py().string_dtype("utf-8"))
        self._file.flush()
        self._file.close()
        self._file = None
        self._raw.close()
        self._check_writes()
        self._finished = True

    def commit(self) -> None:
        """Rename the finished file into place."""
        if self._finished:
            commit(self._tmp, self.path)
            self._finished = False

    def abort(self) -> None:
        """Discard the partial (or finished but not committed) file."""
        if self._file is not None:
            # closing can fail again (a full disk): the temporary goes all the same
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None
        with contextlib.suppress(OSError):
            self._raw.close()
        self._finished = False
        discard(self._tmp)


def _write_error(exc: OSError, path: str) -> OSError:
    """One line naming the shard for a write that failed."""
    return disk_full_error(exc, path) or WriteError(
        exc.errno, f"cannot write {path}: {exc.strerror or exc}")


def write_shard(path: str, utt_ids: Sequence[str], feats_list: Sequence, labels_list: Sequence,
                *, feat_dim: int | None = None) -> None:
    """Write one shard file from parallel lists of utterances.

    ``feat_dim`` is needed only when the lists are empty.

    Example::

        write_shard("shard-00000.h5", ["a"], [np.zeros((5, 40), np.float32)], [np.zeros(5, int)])
    """
    if not (len(utt_ids) == len(feats_list) == len(labels_list)):
        raise ValueError(f"{path}: utt_ids, feats_list and labels_list must have the same "
                         f"length, got {len(utt_ids)}, {len(feats_list)}, {len(labels_list)}")
    if feat_dim is None:
        if not feats_list:
            raise ValueError(f"{path}: feat_dim is needed to write a shard with no utterances")
        feat_dim = np.asarray(feats_list[0]).shape[-1]
    if len(set(utt_ids)) != len(utt_ids):
        raise ValueError(f"{path}: utt_ids contains duplicates")
    builder = ShardBuilder(path, feat_dim=feat_dim)
    try:
        for utt_id, feats, labels in zip(utt_ids, feats_list, labels_list):
            builder.add(utt_id, feats, labels)
        builder.close()
    except BaseException:
        builder.abort()
        raise


def shard_storage_problems(h5file, path: str) -> list[str]:
    """Declared sizes a shard does not back with stored bytes, or that exceed the bounds.

    Reads metadata only.  Until this list is empty nothing of the shard may be
    read: a crafted file can declare datasets far larger than itself.  Each
    message names the file and the dataset.

    Example::

        with h5py.File(path, "r") as f:
            assert shard_storage_problems(f, path) == []
    """
    from ..h5io import dataset_problem
    problems = []
    try:
        present = [name for name in (FEATS, LABELS, UTT_OFFSETS, UTT_IDS) if name in h5file]
    except HDF5_ERRORS as exc:
        return [f"{path}: the index of its datasets cannot be read ({hdf5_reason(exc)}); "
                "the file is damaged"]
    for name in present:
        try:
            problem = dataset_problem(h5file, name, path, what="shard")
            if not problem and hasattr(h5file[name], "dtype"):
                h5file[name].dtype       # (h5py maps the file's datatype here)
        except HDF5_ERRORS as exc:
            problem = (f"{path}: dataset '{name}' cannot be opened ({hdf5_reason(exc)}); "
                       "the file is damaged")
        except (ValueError, TypeError) as exc:
            # a damaged datatype message: a float of no numpy precision, a string of
            # an unknown encoding (a line naming nothing, or a TypeError traceback)
            problem = (f"{path}: dataset '{name}' has a datatype that cannot be read "
                       f"({' '.join(str(exc).split())}); the file is damaged")
        if problem:
            problems.append(problem)
    feats = h5file.get(FEATS)
    if not problems and isinstance(feats, _h5py().Dataset) and feats.ndim == 2 \
            and feats.shape[1] > MAX_FEAT_DIM:
        problems.append(f"{path}: dataset '{FEATS}' has {feats.shape[1]} columns; at most "
                        f"{MAX_FEAT_DIM} are accepted")
    return problems


def read_utt_ids(h5file, path: str) -> list[str]:
    """The shard's utterance ids as text; :class:`CorpusError` names the first id
    that is not UTF-8 (a shard written by another program).

    Example::

        with h5py.File(path, "r") as f:
            ids = read_utt_ids(f, path)
    """
    try:
        ids = list(h5file[UTT_IDS].asstr(errors="surrogateescape")[()])
    except HDF5_ERRORS as exc:
        # (merge read them bare: "Can't synchronously read data (bad global heap
        # collection signature)", naming nothing)
        raise CorpusError(f"{path}: dataset '{UTT_IDS}' cannot be read ({hdf5_reason(exc)}); "
                          "the file is damaged") from None
    for u, utt in enumerate(ids):
        try:
            utt.encode("utf-8")
        except UnicodeEncodeError:
            raw = utt.encode("utf-8", "surrogateescape")
            raise CorpusError(f"{path}: dataset '{UTT_IDS}': the id of utterance {u} is not "
                              f"UTF-8 text ({raw[:40]!r}); utterance ids must be UTF-8 "
                              "(convert them, e.g. with iconv, and write the shard again)") \
                from None
    return ids


def _is_format_version(value) -> bool:
    """Whether an attribute read from a file is the integer FORMAT_VERSION (a text,
    a float such as 1.5 or NaN, a boolean or an array is not)."""
    return (np.isscalar(value) and isinstance(value, (int, np.integer))
            and not isinstance(value, (bool, np.bool_)) and int(value) == FORMAT_VERSION)


def _native(dtype) -> np.dtype:
    """``dtype`` in this machine's byte order: a big-endian float32 written by another
    program is float32 all the same (reads convert it into native buffers)."""
    return dtype.newbyteorder("=") if dtype.kind in "iuf" else dtype


def shard_layout_problems(h5file, path: str) -> list[str]:
    """Problems with the datasets of an open shard: storage, presence, dtype, shape, offsets.

    Reads only ``utt_offsets`` (small, and only once :func:`shard_storage_problems`
    found nothing); it does not scan features or labels.  Each message names
    the file and the dataset.

    Example::

        with h5py.File(path, "r") as f:
            problems = shard_layout_problems(f, path)
    """
    problems = shard_storage_problems(h5file, path)
    if problems:
        return problems
    version = h5file.attrs.get("format_version")
    if version is None:
        problems.append(f"{path}: attribute 'format_version' is missing; expected {FORMAT_VERSION}")
    elif not _is_format_version(version):
        shown = repr(version)
        problems.append(f"{path}: attribute 'format_version' is "
                        f"{shown if len(shown) <= 60 else shown[:57] + '...'}; "
                        f"expected the integer {FORMAT_VERSION}")

    def dataset(name):
        obj = h5file.get(name)
        if obj is None:
            problems.append(f"{path}: dataset '{name}' is missing")
            return None
        if not hasattr(obj, "dtype"):
            problems.append(f"{path}: '{name}' is a group, expected a dataset")
            return None
        return obj

    feats, labels = dataset(FEATS), dataset(LABELS)
    offsets_ds, ids = dataset(UTT_OFFSETS), dataset(UTT_IDS)
    num_frames = None
    if feats is not None:
        if feats.ndim != 2:
            problems.append(f"{path}: dataset '{FEATS}' has shape {feats.shape}; "
                            "expected 2-D (frames, feat_dim)")
        else:
            num_frames = feats.shape[0]
        if _native(feats.dtype) != np.float32:
            problems.append(f"{path}: dataset '{FEATS}' has dtype {feats.dtype}; expected float32")
    if labels is not None:
        if _native(labels.dtype) != np.int32:
            problems.append(f"{path}: dataset '{LABELS}' has dtype {labels.dtype}; expected int32")
        if labels.ndim != 1:
            problems.append(f"{path}: dataset '{LABELS}' has shape {labels.shape}; expected 1-D")
        elif num_frames is not None and labels.shape[0] != num_frames:
            problems.append(f"{path}: dataset '{LABELS}' has {labels.shape[0]} entries; "
                            f"expected {num_frames} (rows of '{FEATS}')")
    num_utts = None
    if offsets_ds is not None:
        if _native(offsets_ds.dtype) != np.int64:
            problems.append(f"{path}: dataset '{UTT_OFFSETS}' has dtype {offsets_ds.dtype}; "
                            "expected int64")
        if offsets_ds.ndim != 1 or offsets_ds.shape[0] < 1:
            problems.append(f"{path}: dataset '{UTT_OFFSETS}' has shape {offsets_ds.shape}; "
                            "expected 1-D with U+1 entries")
        elif num_frames is not None and offsets_ds.shape[0] > num_frames + 1:
            # Utterances are never empty, so there are at most T + 1 offsets.
            problems.append(f"{path}: dataset '{UTT_OFFSETS}' has {offsets_ds.shape[0]} "
                            f"entries; expected at most {num_frames + 1} for {num_frames} "
                            f"rows of '{FEATS}'")
        elif offsets_ds.dtype.kind in "iu":
            try:
                offsets = offsets_ds[()]
            except HDF5_ERRORS as exc:
                problems.append(f"{path}: dataset '{UTT_OFFSETS}' cannot be read "
                                f"({hdf5_reason(exc)}); the file is damaged")
                return problems
            num_utts = offsets.shape[0] - 1
            if offsets[0] != 0:
                problems.append(f"{path}: dataset '{UTT_OFFSETS}' starts at {offsets[0]}; "
                                "expected 0")
            steps = np.diff(offsets)
            if steps.size and steps.min() <= 0:
                bad = int(np.argmax(steps <= 0))
                problems.append(f"{path}: dataset '{UTT_OFFSETS}' is not strictly increasing "
                                f"at utterance {bad} ({offsets[bad]} -> {offsets[bad + 1]})")
            if num_frames is not None and offsets[-1] != num_frames:
                problems.append(f"{path}: dataset '{UTT_OFFSETS}' ends at {offsets[-1]}; "
                                f"expected {num_frames} (rows of '{FEATS}')")
    if ids is not None:
        if ids.dtype.kind != "O" or _h5py().check_string_dtype(ids.dtype) is None:
            problems.append(f"{path}: dataset '{UTT_IDS}' has dtype {ids.dtype}; "
                            "expected variable-length UTF-8 strings")
        if ids.ndim != 1:
            problems.append(f"{path}: dataset '{UTT_IDS}' has shape {ids.shape}; expected 1-D")
        elif num_utts is not None and ids.shape[0] != num_utts:
            problems.append(f"{path}: dataset '{UTT_IDS}' has {ids.shape[0]} entries; "
                            f"expected {num_utts} (entries of '{UTT_OFFSETS}' minus one)")
    return problems


class ShardFile:
    """A shard file held open in ``_file`` until ``close()`` or the end of a ``with`` block.

    Example::

        with ShardReader("corpus/shard-00000.h5") as shard:   # a ShardFile
            shard.num_frames
    """

    _file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ShardReader(ShardFile):
    """Read-only access to one shard file.

    Opening checks the layout (datasets, dtypes, shapes, offsets) and raises
    :class:`CorpusError` naming the file and dataset; it does not scan the
    frames (``mpitrain.data.check`` does).

    Example::

        with ShardReader("corpus/shard-00000.h5") as shard:
            feats, labels, offsets = shard.read(0, 10)    # first 10 utterances
            feats.shape == (offsets[-1], shard.feat_dim)  # True
    """

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise CorpusError(f"{self.path}: shard file not found")
        if os.path.isdir(self.path):
            raise CorpusError(f"{self.path}: is a directory, not a shard file")
        try:
            self._file = h5_reader(self.path)
        except OSError as exc:
            # HDF5's messages can hold line breaks (a time stamp): one line here
            raise CorpusError(f"{self.path}: cannot open as HDF5 "
                              f"({' '.join(str(exc).split())})") from exc
        try:
            problems = shard_layout_problems(self._file, self.path)
            if problems:
                # one line naming the file once (each problem names it, for check's list)
                named = f"{self.path}: "
                raise CorpusError(named + "; ".join(
                    p[len(named):] if p.startswith(named) else p for p in problems))
            self._feats = self._file[FEATS]
            self._labels = self._file[LABELS]
            self._offsets = np.asarray(self._file[UTT_OFFSETS][()], dtype=np.int64)
            self._utt_ids: list[str] | None = None
        except BaseException:
            self._file.close()
            self._file = None
            raise

    @property
    def num_frames(self) -> int:
        return int(self._offsets[-1])

    @property
    def num_utterances(self) -> int:
        return int(self._offsets.shape[0] - 1)

    @property
    def feat_dim(self) -> int:
        return int(self._feats.shape[1])

    @property
    def utt_offsets(self) -> np.ndarray:
        """Frame offsets of the utterances, int64 (U+1,); do not modify."""
        return self._offsets

    @property
    def utt_ids(self) -> list[str]:
        if self._utt_ids is None:
            self._utt_ids = read_utt_ids(self._file, self.path)
        return self._utt_ids

    def read(self, start_utt: int, end_utt: int):
        """Utterances ``start_utt:end_utt`` as (feats, labels, offsets).

        ``feats`` is float32 (T, D), ``labels`` int32 (T,) and ``offsets``
        int64 (n+1,) counts frames from the start of this read.
        """
        if self._file is None:
            raise CorpusError(f"{self.path}: read after close()")
        for name, value in (("start_utt", start_utt), ("end_utt", end_utt)):
            # (2.7 was read as 2; 'a' and None failed in int() naming neither)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
                    or int(value) != value:
                raise TypeError(f"{self.path}: read: {name}: expected an utterance index "
                                f"(an integer), got {value!r}")
        start_utt, end_utt = int(start_utt), int(end_utt)
        if not 0 <= start_utt <= end_utt <= self.num_utterances:
            raise ValueError(f"{self.path}: utterance range {start_utt}:{end_utt} is outside "
                             f"0:{self.num_utterances}")
        first, last = int(self._offsets[start_utt]), int(self._offsets[end_utt])
        feats = np.empty((last - first, self.feat_dim), dtype=np.float32)
        labels = np.empty(last - first, dtype=np.int32)
        if last > first:
            # read_direct fills our buffer without an intermediate copy.
            try:
                self._feats.read_direct(feats, np.s_[first:last])
                self._labels.read_direct(labels, np.s_[first:last])
            except HDF5_ERRORS as exc:   # damaged or truncated on disk since it was opened
                raise CorpusError(f"{self.path}: cannot read utterances {start_utt}:{end_utt} "
                                  f"({hdf5_reason(exc)})") from exc
        offsets = self._offsets[start_utt:end_utt + 1] - first
        return feats, labels, offsets
