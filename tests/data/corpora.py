"""Small corpora for the checking tests, and the ways to damage them.

Damage is done as it happens to real files: h5py edits (a dataset deleted or
rewritten with another dtype or shape) and bytes overwritten on disk at the
places h5py reports (an object header, the first chunk of a dataset).
"""

import os
import shutil
import tempfile

import h5py
import numpy as np
import yaml

from mpitrain.data.corpus import manifest_path
from mpitrain.data.writer import CorpusWriter

from .utterances import make_utterances

FEAT_DIM, NUM_CLASSES = 4, 6


# Written once per shape, then copied: the writer fsyncs every file, which
# costs seconds on a disk shared with other jobs.
_TEMPLATES = tempfile.TemporaryDirectory(prefix="mpitrain-corpora-")


def write_corpus(out, *, num_shards=2, num_utts=12, seed=0):
    """A sound corpus of ``num_utts`` short utterances in ``num_shards`` shards; its path."""
    template = os.path.join(_TEMPLATES.name, f"{num_shards}-{num_utts}-{seed}")
    if not os.path.exists(manifest_path(template)):
        with CorpusWriter(template, feat_dim=FEAT_DIM, num_classes=NUM_CLASSES,
                          num_shards=num_shards, overwrite=True) as writer:
            for utt_id, feats, labels in make_utterances(num_utts, FEAT_DIM, NUM_CLASSES, seed):
                writer.add(utt_id, feats, labels)
    shutil.copytree(template, str(out))
    return str(out)


def shard(corpus, i=0):
    return os.path.join(corpus, f"shard-{i:05d}.h5")


def one_problem_naming(problems, *parts):
    """Some one line of ``problems`` holds every one of ``parts``; each problem is one line."""
    assert problems, "expected a problem"
    assert all("\n" not in p for p in problems), problems
    assert any(all(p in msg for p in parts) for msg in problems), problems


def utterance_at(path, frame):
    """(utterance id, frame within it) of frame ``frame`` of a shard."""
    with h5py.File(path, "r") as f:
        offsets = f["utt_offsets"][()]
        u = int(np.searchsorted(offsets, frame, side="right")) - 1
        return f["utt_ids"].asstr()[u], frame - int(offsets[u])


def replace_dataset(path, name, data):
    """Rewrite dataset ``name`` of a shard with ``data`` (another dtype or shape)."""
    with h5py.File(path, "a") as f:
        del f[name]
        f[name] = data


def edit_manifest(corpus, change):
    """Apply ``change(data)`` to the parsed corpus.yaml and write it back."""
    path = manifest_path(corpus)
    with open(path) as fh:
        data = yaml.safe_load(fh)
    change(data)
    with open(path, "w") as fh:
        yaml.safe_dump(data, fh)
    return path


def overwrite(path, offset, data: bytes):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def object_header_offset(path, name):
    """Byte offset in the file of dataset ``name``'s object header."""
    with h5py.File(path, "r") as f:
        return int(h5py.h5o.get_info(f[name].id).addr)


def first_chunk_offset(path, name):
    """Byte offset in the file of the first stored chunk of dataset ``name``."""
    with h5py.File(path, "r") as f:
        return int(f[name].id.get_chunk_info(0).byte_offset)


def signature_offsets(path, signatures=(b"TREE", b"HEAP", b"SNOD", b"GCOL")):
    """(signature, byte offset) of every HDF5 structure a shard marks with one of these.

    B-trees (``TREE``: the group index, each dataset's chunk index), local and
    global heaps (``HEAP``: names, ``GCOL``: the utterance ids' strings) and
    symbol table nodes (``SNOD``) each begin with their signature.
    """
    with open(path, "rb") as fh:
        data = fh.read()
    found = []
    for signature in signatures:
        start = data.find(signature)
        while start >= 0:
            found.append((signature, start))
            start = data.find(signature, start + 1)
    return found


# ---------------------------------------------------------------- layout damage, named

def _rewritten(name, change):
    def damage(path):
        with h5py.File(path, "r") as f:
            data = f[name][()]
        replace_dataset(path, name, change(data))
    return damage


def _edited(change):
    def damage(path):
        with h5py.File(path, "a") as f:
            change(f)
    return damage


def _header_overwritten(name):
    def damage(path):
        overwrite(path, object_header_offset(path, name), b"\xa5" * 64)
    return damage


def _deleted(f, name):
    del f[name]


def _offsets_repeat(f):
    f["utt_offsets"][3] = f["utt_offsets"][2]


def _labels_cut(f):
    f["labels"].resize(f["labels"].shape[0] - 2, axis=0)


#: (case, damage(shard path), what the one line naming the shard also says).
LAYOUT_DAMAGE = [
    ("feat-dim-wider", _rewritten("feats", lambda x: np.concatenate([x, x[:, :1]], axis=1)),
     ["dataset 'feats'", f"has {FEAT_DIM + 1} columns", f"expected feat_dim = {FEAT_DIM}"]),
    ("feat-dim-narrower", _rewritten("feats", lambda x: x[:, 1:]),
     ["dataset 'feats'", f"has {FEAT_DIM - 1} columns", f"expected feat_dim = {FEAT_DIM}"]),
    ("feats-float64", _rewritten("feats", lambda x: x.astype(np.float64)),
     ["dataset 'feats'", "dtype float64", "expected float32"]),
    ("feats-int16", _rewritten("feats", lambda x: x.astype(np.int16)),
     ["dataset 'feats'", "dtype int16", "expected float32"]),
    ("labels-float32", _rewritten("labels", lambda x: x.astype(np.float32)),
     ["dataset 'labels'", "dtype float32", "expected int32"]),
    ("labels-int64", _rewritten("labels", lambda x: x.astype(np.int64)),
     ["dataset 'labels'", "dtype int64", "expected int32"]),
    ("labels-2d", _rewritten("labels", lambda x: x[:, None]),
     ["dataset 'labels'", "shape (", "expected 1-D"]),
    ("labels-short", _edited(_labels_cut),
     ["dataset 'labels'", "entries; expected", "rows of 'feats'"]),
    ("offsets-repeat", _edited(_offsets_repeat),
     ["dataset 'utt_offsets'", "not strictly increasing at utterance 2"]),
] + [
    (f"no-{name}", _edited(lambda f, name=name: _deleted(f, name)),
     [f"dataset '{name}' is missing"]) for name in ("feats", "labels", "utt_offsets", "utt_ids")
] + [
    (f"header-{name}", _header_overwritten(name),
     [f"dataset '{name}' cannot be opened", "the file is damaged"])
    for name in ("feats", "labels", "utt_offsets", "utt_ids")
]


def layout_damage_cases():
    """LAYOUT_DAMAGE as pytest parameters (damage, parts), with the case names as ids."""
    import pytest
    return [pytest.param(damage, parts, id=case) for case, damage, parts in LAYOUT_DAMAGE]
