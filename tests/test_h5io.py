"""HDF5 reads that trust nothing in the file: what a dataset's storage must be."""

import os

import h5py
import numpy as np

from mpitrain.h5io import dataset_problem


def test_a_compressed_dataset_is_named_as_compressed(tmp_path):
    # it was "declares shape (4000, 8) ... but the file stores N bytes of it", read
    # as a damaged or crafted file by whoever had only asked h5py for gzip
    path = str(tmp_path / "s.h5")
    data = np.zeros((4000, 8), dtype=np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("gz", data=data, compression="gzip")
        f.create_dataset("lzf", data=data, compression="lzf")
        f.create_dataset("checked", data=data, shuffle=True, fletcher32=True)
        f.create_dataset("unwritten", shape=(4000, 8), dtype=np.float32, chunks=(100, 8))
    with h5py.File(path, "r") as f:
        for name, kind in (("gz", "gzip"), ("lzf", "lzf")):
            problem = dataset_problem(f, name, path, what="shard")
            assert problem.startswith(f"{path}: dataset '{name}' is stored compressed ({kind}; ")
            assert "write it again without compression" in problem and "\n" not in problem
        assert dataset_problem(f, "checked", path, what="shard") is None
        assert "declares shape (4000, 8)" in dataset_problem(f, "unwritten", path, what="shard")


def test_a_files_heaps_are_walked_once_until_it_changes(tmp_path, monkeypatch):
    # a shard is opened again for every chunk read: its text heaps (a walk of every
    # utterance id) are checked at the first open, and again only once it changed
    from mpitrain import h5io

    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("utt_ids", data=[b"a", b"b"], dtype=h5py.string_dtype())
    walks = []
    checked = h5io._collection_problem
    monkeypatch.setattr(h5io, "_collection_problem",
                        lambda *args: walks.append(args) or checked(*args))
    for _ in range(3):
        h5io.h5_reader(path).close()
    assert len(walks) == 1
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    h5io.h5_reader(path).close()
    assert len(walks) == 2


class _DatasetIdWithoutChunkIter:
    """A dataset's low-level id as h5py < 3.8, or one built on HDF5 1.12.2, has it."""

    def __init__(self, dsid):
        self._dsid = dsid

    def __getattr__(self, name):
        if name == "chunk_iter":
            raise AttributeError(name)
        return getattr(self._dsid, name)


def test_the_heap_check_finds_chunks_where_h5py_has_no_chunk_iter(tmp_path, monkeypatch):
    # opening any file with a chunked dataset (every shard) failed with a traceback,
    # "'h5py.h5d.DatasetID' object has no attribute 'chunk_iter'"
    from mpitrain import h5io

    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("feats", data=np.arange(4000, dtype=np.float32).reshape(500, 8),
                         chunks=(100, 8))
        f.create_dataset("utt_ids", data=[b"a", b"bb"], dtype=h5py.string_dtype())
    with h5py.File(path, "r") as f:
        expected = h5io._raw_extents(f)
    assert len(expected) == 5 + 1      # the chunks and the ids' contiguous data
    monkeypatch.setattr(h5py.Dataset, "id",
                        property(lambda self: _DatasetIdWithoutChunkIter(self._id)))
    with h5py.File(path, "r") as f:
        assert h5io._raw_extents(f) == expected
    h5io.h5_reader(path).close()
    # and a damaged heap is still found: its free-space entry declaring 0 bytes
    data = bytearray(path.read_bytes())
    at = data.index(b"GCOL") + 16
    while int.from_bytes(data[at:at + 2], "little") != 0:
        at += 16 + (int.from_bytes(data[at + 8:at + 16], "little") + 7) // 8 * 8
    data[at + 8:at + 16] = bytes(8)
    path.write_bytes(bytes(data))
    monkeypatch.setattr(h5io, "_SOUND_HEAPS", set())     # (whatever the clock's grain)
    try:
        h5io.h5_reader(path).close()
    except OSError as exc:
        assert "is damaged: an empty entry at byte" in str(exc)
    else:
        raise AssertionError("a heap HDF5 would read for ever was not refused")


def test_a_file_of_4_byte_lengths_is_read_and_its_heaps_not_walked_as_8_byte(tmp_path,
                                                                               monkeypatch):
    # the heap walk reads HDF5's default 8-byte sizes: a file written with another
    # width (another writer's choice) must not be judged by it
    from mpitrain import h5io

    path = tmp_path / "l4.h5"
    create = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    create.set_sizes(8, 4)
    with h5py.File(h5py.h5f.create(str(path).encode(), h5py.h5f.ACC_TRUNC, fcpl=create)) as f:
        f.create_dataset("utt_ids", data=[b"u0", b"u1"], dtype=h5py.string_dtype())
    walks = []
    monkeypatch.setattr(h5io, "_collection_problem", lambda *args: walks.append(args))
    with h5io.h5_reader(path) as f:
        assert list(f["utt_ids"][:]) == [b"u0", b"u1"]
    assert not walks
    with open(path, "rb") as raw:
        assert h5io._size_of_lengths(raw.fileno(), path.stat().st_size) == 4


def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    """HDF5 opened a named pipe given as a shard, model or checkpoint and waited
    for a writer for ever (`merge`, `eval`, `export` and `convert` hung); it is
    one line naming the file."""
    import subprocess
    import sys
    os.mkfifo(tmp_path / "pipe.h5")
    script = (
        "import sys\n"
        "from mpitrain.data.shards import ShardReader\n"
        "from mpitrain.nn.model_file import load_model\n"
        "for read in (ShardReader, load_model):\n"
        "    try:\n"
        "        read(sys.argv[1])\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "pipe.h5")],
                          cwd=root, capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done
    for line in lines:
        assert line.startswith(f"{tmp_path}/pipe.h5: ") and "not a regular file" in line, line
