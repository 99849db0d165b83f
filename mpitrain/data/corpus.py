"""Corpus directories: the ``corpus.yaml`` manifest, read and written.

A corpus directory holds ``corpus.yaml`` and HDF5 shards ``shard-00000.h5``, ...
The manifest records sizes, class counts, global CMVN statistics and the list
of shards; docs/data-format.md describes every field.  Whole corpora are
written by :class:`mpitrain.data.writer.CorpusWriter`.

Example::

    manifest = load_manifest("data/train")
    manifest.shard_path(0)      # absolute path of shard-00000.h5
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..files import read_yaml, write_yaml

FORMAT_VERSION = 1
MANIFEST_NAME = "corpus.yaml"


# classes a corpus may have: the largest output layer a model file may hold
MAX_CLASSES = 1 << 20


class CorpusError(ValueError):
    """A corpus file is missing or malformed; the message names file and field.

    Example::

        raise CorpusError("data/train/corpus.yaml: field 'feat_dim': expected a positive int")
    """


@dataclass
class ShardInfo:
    """One shard as listed in the manifest; ``path`` is relative to the corpus directory.

    Example::

        ShardInfo(path="shard-00000.h5", frames=90000, utterances=300)
    """

    path: str
    frames: int
    utterances: int


@dataclass
class CorpusManifest:
    """The parsed ``corpus.yaml`` of one corpus directory.

    Example::

        manifest = load_manifest("data/train")
        priors = manifest.class_priors()          # (num_classes,) float64, sums to 1
        paths = [manifest.shard_path(i) for i in range(len(manifest.shards))]
    """

    feat_dim: int
    num_classes: int
    num_frames: int
    num_utterances: int
    class_counts: list[int]
    cmvn_mean: list[float]
    cmvn_var: list[float]
    shards: list[ShardInfo]
    source: dict = field(default_factory=dict)
    directory: str = "."
    #: shard index -> the file's identity when this run first met it (see
    #: :func:`mpitrain.data.batcher.read_chunk`); not part of corpus.yaml
    stamps: dict = field(default_factory=dict, repr=False, compare=False)

    def shard_path(self, i: int) -> str:
        """Absolute path of shard ``i``."""
        return os.path.abspath(os.path.join(self.directory, self.shards[i].path))

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.directory, MANIFEST_NAME)

    def class_priors(self, *, floor: float = 1e-8) -> np.ndarray:
        """Class frequencies, floored at ``floor`` so none is zero, summing to 1.

        Hybrid decoding divides posteriors by these priors, so a class never
        seen in training must not get a zero prior.
        """
        counts = np.asarray(self.class_counts, dtype=np.float64)
        total = counts.sum()
        priors = counts / total if total > 0 else np.full(counts.shape, 1.0 / counts.size)
        priors = np.maximum(priors, floor)
        return priors / priors.sum()

    @property
    def speaker_cmvn(self) -> dict | None:
        """{"norm_vars": bool, ...} when ``prepare`` applied per-speaker CMVN, else None."""
        return _speaker_cmvn(self.source)

    def to_dict(self) -> dict:
        """The manifest as plain YAML-ready data, in the documented field order."""
        return {
            "format_version": FORMAT_VERSION,
            "feat_dim": int(self.feat_dim),
            "num_classes": int(self.num_classes),
            "num_frames": int(self.num_frames),
            "num_utterances": int(self.num_utterances),
            "class_counts": [int(c) for c in self.class_counts],
            "cmvn": {"mean": [float(v) for v in self.cmvn_mean],
                     "var": [float(v) for v in self.cmvn_var]},
            "shards": [{"path": s.path, "frames": int(s.frames), "utterances": int(s.utterances)}
                       for s in self.shards],
            "source": dict(self.source),
        }


def manifest_path(corpus_dir: str) -> str:
    """Path of the manifest of ``corpus_dir``.

    Example::

        manifest_path("data/train")     # 'data/train/corpus.yaml'
    """
    return os.path.join(str(corpus_dir), MANIFEST_NAME)


def shard_name(index: int) -> str:
    """File name of shard ``index``.

    Example::

        shard_name(3)                   # 'shard-00003.h5'
    """
    return f"shard-{index:05d}.h5"


# ---------------------------------------------------------------- validation

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def manifest_problems(data, path: str) -> tuple[CorpusManifest | None, list[str]]:
    """Check parsed manifest data; return (manifest or None, problems).

    Every problem names ``path`` and the field.  The manifest is returned
    only when there are no problems.

    Example::

        manifest, problems = manifest_problems(parse_yaml(text), "corpus.yaml")
    """
    problems: list[str] = []

    def bad(field_name, expected, value):
        # YAML's own words for a boolean (`yes`, `on` and `true` read as one)
        shown = f"{str(value).lower()} (a boolean)" if isinstance(value, bool) else repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        problems.append(f"{path}: field '{field_name}': expected {expected}, got {shown}")

    if not isinstance(data, dict):
        bad("<top level>", "a mapping of manifest fields", data)
        return None, problems

    for name in ("format_version", "feat_dim", "num_classes", "num_frames",
                 "num_utterances", "class_counts", "cmvn", "shards"):
        if name not in data:
            problems.append(f"{path}: field '{name}' is missing")
    if problems:
        return None, problems

    if not _is_int(data["format_version"]) or data["format_version"] != FORMAT_VERSION:
        bad("format_version", str(FORMAT_VERSION), data["format_version"])
    for name in ("feat_dim", "num_classes"):
        if not _is_int(data[name]) or data[name] <= 0:
            bad(name, "a positive int", data[name])
    if _is_int(data["num_classes"]) and data["num_classes"] > MAX_CLASSES:
        bad("num_classes", f"at most {MAX_CLASSES} (a model's largest output layer)",
            data["num_classes"])
    for name in ("num_frames", "num_utterances"):
        if not _is_int(data[name]) or data[name] < 0:
            bad(name, "a non-negative int", data[name])
    if problems:
        return None, problems
    feat_dim, num_classes = data["feat_dim"], data["num_classes"]

    counts = data["class_counts"]
    if (not isinstance(counts, list) or len(counts) != num_classes
            or not all(_is_int(c) and c >= 0 for c in counts)):
        bad("class_counts", f"a list of {num_classes} non-negative ints", counts)
    elif sum(counts) != data["num_frames"]:
        problems.append(f"{path}: field 'class_counts': sums to {sum(counts)}, "
                        f"expected num_frames = {data['num_frames']}")

    cmvn = data["cmvn"]
    if not isinstance(cmvn, dict):
        bad("cmvn", "a mapping with 'mean' and 'var'", cmvn)
        cmvn = {}
    for key in ("mean", "var"):
        values = cmvn.get(key)
        if isinstance(values, list) and len(values) == feat_dim and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) \
                and not all(_is_number(v) for v in values):
            # moments of features that hold a NaN or inf (a shard written by hand)
            problems.append(f"{path}: field 'cmvn.{key}': holds a NaN or inf, as features "
                            "that hold one give; `mpitrain check` names the shard, "
                            "utterance and frame")
        elif (not isinstance(values, list) or len(values) != feat_dim
                or not all(_is_number(v) for v in values)):
            bad(f"cmvn.{key}", f"a list of {feat_dim} finite numbers", values)
        elif key == "var" and min(values) < 0:
            bad("cmvn.var", "non-negative variances", values)

    shards = []
    raw_shards = data["shards"]
    if not isinstance(raw_shards, list) or not raw_shards:
        bad("shards", "a non-empty list of {path, frames, utterances}", raw_shards)
        raw_shards = []
    listed: dict[str, int] = {}        # each shard's file, to find one listed twice
    for i, entry in enumerate(raw_shards):
        where = f"shards[{i}]"
        if not isinstance(entry, dict):
            bad(where, "a mapping {path, frames, utterances}", entry)
            continue
        shard_rel = entry.get("path")
        if (not isinstance(shard_rel, str) or not shard_rel or os.path.isabs(shard_rel)
                or ".." in shard_rel.replace("\\", "/").split("/")):
            bad(f"{where}.path", "a relative file name inside the corpus directory", shard_rel)
        else:
            # listed twice, its frames would be trained on twice (by two ranks at once)
            same = os.path.normpath(shard_rel.replace("\\", "/"))
            if same in listed:
                problems.append(f"{path}: field '{where}.path': {shard_rel!r} is listed "
                                f"again (shards[{listed[same]}] is the same file); list "
                                "each shard once")
            listed.setdefault(same, i)
        for key in ("frames", "utterances"):
            if not _is_int(entry.get(key)) or entry.get(key) < 0:
                bad(f"{where}.{key}", "a non-negative int", entry.get(key))
        shards.append(entry)
    if raw_shards and len(shards) == len(raw_shards) and not problems:
        frames = sum(s["frames"] for s in shards)
        utts = sum(s["utterances"] for s in shards)
        if frames != data["num_frames"]:
            problems.append(f"{path}: field 'shards': frames sum to {frames}, "
                            f"expected num_frames = {data['num_frames']}")
        if utts != data["num_utterances"]:
            problems.append(f"{path}: field 'shards': utterances sum to {utts}, "
                            f"expected num_utterances = {data['num_utterances']}")

    source = data.get("source", {})
    if source is None:
        source = {}
    if not isinstance(source, dict):
        bad("source", "a mapping", source)

    if problems:
        return None, problems
    manifest = CorpusManifest(
        feat_dim=feat_dim, num_classes=num_classes,
        num_frames=data["num_frames"], num_utterances=data["num_utterances"],
        class_counts=list(counts),
        cmvn_mean=[float(v) for v in cmvn["mean"]], cmvn_var=[float(v) for v in cmvn["var"]],
        shards=[ShardInfo(s["path"], s["frames"], s["utterances"]) for s in shards],
        source=source, directory=os.path.abspath(os.path.dirname(path)))
    return manifest, problems


def read_manifest_data(path: str):
    """Parse a manifest file (YAML); CorpusError names the file.

    Example::

        data = read_manifest_data("data/train/corpus.yaml")   # dict, not yet validated
    """
    try:
        os.stat(path)
    except PermissionError:
        raise CorpusError(f"{path}: cannot be read (permission denied on it or on a "
                          "directory above it)") from None
    except OSError:
        directory = os.path.dirname(path) or "."
        if os.path.isfile(directory):
            # the manifest (or another file) named where its directory belongs
            inside = os.path.dirname(directory) or "."
            hint = (f"; name its directory ({inside})"
                    if os.path.basename(directory) == MANIFEST_NAME else "")
            raise CorpusError(f"{directory}: is a file, not a corpus directory holding "
                              f"{MANIFEST_NAME}{hint}") from None
        # (a new user's first run: the example configs name a corpus not yet written)
        hint = ""
        inner = sorted(name for name in _names_in(directory)
                       if os.path.isfile(os.path.join(directory, name, MANIFEST_NAME)))
        if inner:
            # the directory synth writes (train/ and dev/) named for one corpus
            shown = ", ".join(os.path.join(directory, n) for n in inner[:4])
            hint = (f"; it holds the corpora {shown}{', ...' if len(inner) > 4 else ''}: "
                    "name one of them")
        raise CorpusError(f"{path}: not found; expected a corpus directory "
                          f"({directory}) holding {MANIFEST_NAME}, as `mpitrain synth`, "
                          f"`prepare` or `merge` write{hint}") from None
    if not os.path.isfile(path):
        # (a named pipe would be waited on for a writer that never comes)
        raise CorpusError(f"{path}: not a regular file (a directory, named pipe or "
                          "device); a corpus manifest is the file `merge` or `prepare` "
                          "writes")
    try:
        return read_yaml(path, what="corpus manifest")
    except ValueError as exc:
        raise CorpusError(str(exc)) from None


def _names_in(directory) -> list:
    """The names in ``directory``; none when it cannot be listed (missing, or
    searchable but not readable: the not-found line is said all the same)."""
    try:
        return os.listdir(directory)
    except OSError:
        return []


def speaker_cmvn_kind(speaker_cmvn: dict | None) -> str:
    """How features were normalised per speaker, in words; two corpora (or a corpus
    and a model) whose kinds differ hold features no one model fits.

    Example::

        speaker_cmvn_kind(None)                   # "no per-speaker CMVN"
        speaker_cmvn_kind({"norm_vars": True})    # "per-speaker CMVN, norm_vars true"
    """
    if speaker_cmvn is None:
        return "no per-speaker CMVN"
    return f"per-speaker CMVN, norm_vars {str(bool(speaker_cmvn.get('norm_vars'))).lower()}"


def _speaker_cmvn(source: dict) -> dict | None:
    found = source.get("speaker_cmvn")
    if isinstance(found, dict):
        return dict(found)
    parts = source.get("parts") if source.get("kind") == "merged" else None
    if isinstance(parts, list) and parts:
        # a merged corpus: the parts' own sources say it (the same for all of them)
        each = [_speaker_cmvn(p.get("source", {})) if isinstance(p, dict) else None
                for p in parts]
        if each[0] is not None and all(e is not None and e.get("norm_vars") ==
                                       each[0].get("norm_vars") for e in each):
            return each[0]
    return None


def load_manifest(corpus_dir: str) -> CorpusManifest:
    """Read and validate ``corpus_dir/corpus.yaml``.

    Raises :class:`CorpusError` listing every problem found, each naming the
    file and the field.

    Example::

        manifest = load_manifest("data/train")
        manifest.num_frames, manifest.feat_dim
    """
    path = manifest_path(corpus_dir)
    manifest, problems = manifest_problems(read_manifest_data(path), path)
    if problems:
        raise CorpusError("\n".join(problems))
    return manifest


def write_manifest(manifest: CorpusManifest) -> str:
    """Write ``corpus.yaml`` atomically (temporary name, fsync, rename); return its path.

    Example::

        manifest.source["note"] = "re-aligned"
        write_manifest(manifest)
    """
    # Flow style for the leaf lists keeps 120 class counts on one line.
    return write_yaml(manifest.manifest_path, manifest.to_dict(), flow_leaves=True)


# ---------------------------------------------------------------- writing

class MomentAccumulator:
    """Per-dimension mean and variance over many blocks, in float64.

    Blocks are merged with the pairwise (Chan et al.) update, which stays
    accurate where a running sum of squares would cancel.

    Example::

        acc = MomentAccumulator(40)
        acc.add(feats_a); acc.add(feats_b)
        mean, var = acc.mean, acc.var
    """

    def __init__(self, dim: int):
        self.count = 0
        self.mean = np.zeros(dim, dtype=np.float64)
        self._m2 = np.zeros(dim, dtype=np.float64)

    def add(self, block: np.ndarray) -> None:
        n = block.shape[0]
        if n == 0:
            return
        block = np.asarray(block, dtype=np.float64)
        block_mean = block.mean(axis=0)
        block_m2 = ((block - block_mean) ** 2).sum(axis=0)
        total = self.count + n
        delta = block_mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self._m2 = self._m2 + block_m2 + delta ** 2 * (self.count * n / total)
        self.count = total

    @property
    def var(self) -> np.ndarray:
        if self.count == 0:
            return np.ones_like(self.mean)
        return self._m2 / self.count
