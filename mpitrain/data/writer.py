"""Writing a whole corpus directory: balanced shards, then the manifest.

Example::

    with CorpusWriter("data/train", feat_dim=40, num_classes=120, num_shards=4,
                      source={"kind": "synthetic", "seed": 1}) as writer:
        writer.add("spk1-utt1", feats, labels)
    writer.manifest.num_frames
"""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np

from ..files import disk_full_error, remove_stale_temporaries
from .corpus import (MANIFEST_NAME, CorpusError, CorpusManifest, MomentAccumulator, ShardInfo,
                     manifest_path, shard_name, write_manifest)
from .shards import ShardBuilder, check_utterance

#: The files a corpus writer writes: their temporaries left by a killed writer go.
_CORPUS_FILES = re.compile(r"shard-[0-9]+\.h5|" + re.escape(MANIFEST_NAME))


class CorpusWriter:
    """Write a corpus directory: shards balanced by frames, then the manifest.

    Each utterance goes to the shard with the fewest frames so far, so shards
    differ by at most one utterance's length.  Shards and manifest are written
    under temporary names and renamed when complete; ``corpus.yaml`` comes
    last, so an interrupted write never leaves a corpus that looks finished.
    Leaving the ``with`` block on an exception discards the partial shards; a
    corpus that was there before (``overwrite``) is replaced only once the new
    one is complete, and its extra shards are removed then.

    Example::

        with CorpusWriter("data/train", feat_dim=40, num_classes=120, num_shards=2,
                          source={"kind": "synthetic", "seed": 1}) as writer:
            for utt_id, feats, labels in utterances:
                writer.add(utt_id, feats, labels)
        writer.manifest.num_frames
    """

    def __init__(self, out_dir: str, *, feat_dim: int, num_classes: int, num_shards: int,
                 source: dict | None = None, overwrite: bool = False):
        for name, value in (("feat_dim", feat_dim), ("num_classes", num_classes),
                            ("num_shards", num_shards)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{out_dir}: {name} must be a positive int, got {value!r}")
        if source is not None and not isinstance(source, dict):
            raise ValueError(f"{out_dir}: source must be a mapping, got {type(source).__name__}")
        self.out_dir = os.path.abspath(str(out_dir))
        self.feat_dim = feat_dim
        self.num_classes = num_classes
        self.num_shards = num_shards
        self.source = dict(source or {})
        self.manifest: CorpusManifest | None = None

        existing = manifest_path(self.out_dir)
        if os.path.exists(existing) and not overwrite:
            raise CorpusError(f"{existing}: a corpus already exists here; "
                              "choose another directory or pass --overwrite (overwrite=True)")
        # An existing corpus stays whole until the new one is complete (close()).
        self._made_dir = _first_missing(self.out_dir)    # removed again by abort()
        try:
            os.makedirs(self.out_dir, exist_ok=True)
        except OSError as exc:
            raise CorpusError(f"{self.out_dir}: cannot create the corpus directory "
                              f"({exc.strerror or exc}: {exc.filename})") from None
        # a writer killed here before (a job run again) left its partial shards
        self.removed_temporaries = remove_stale_temporaries(self.out_dir, of=_CORPUS_FILES)

        self._builders = []
        try:
            for i in range(num_shards):
                self._builders.append(ShardBuilder(os.path.join(self.out_dir, shard_name(i)),
                                                   feat_dim=feat_dim))
        except BaseException as exc:
            self.abort()
            raise _named(exc, os.path.join(self.out_dir, shard_name(len(self._builders))))
        self._counts = np.zeros(num_classes, dtype=np.int64)
        self._moments = MomentAccumulator(feat_dim)
        self._seen: set[str] = set()

    def add(self, utt_id: str, feats, labels) -> None:
        """Add one utterance: feats (T, D) float32, labels (T,) ints in [0, num_classes)."""
        if self._builders is None:
            raise CorpusError(f"{self.out_dir}: add() after close()")
        feats, labels = check_utterance(self.out_dir, utt_id, feats, labels, self.feat_dim)
        if utt_id in self._seen:
            raise ValueError(f"{self.out_dir}: utterance id {utt_id!r} was added twice")
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= self.num_classes:
            raise ValueError(f"{self.out_dir}: utterance {utt_id!r}: label "
                             f"{low if low < 0 else high} is outside [0, {self.num_classes})")
        if not np.isfinite(feats).all():
            raise ValueError(f"{self.out_dir}: utterance {utt_id!r}: feats contains NaN or inf")
        self._seen.add(utt_id)
        lightest = min(range(self.num_shards), key=lambda i: self._builders[i].num_frames)
        try:
            self._builders[lightest].add(utt_id, feats, labels)
        except BaseException as exc:
            raise _named(exc, self._builders[lightest].path)
        self._counts += np.bincount(labels, minlength=self.num_classes)
        self._moments.add(feats)

    def close(self) -> CorpusManifest:
        """Finish the shards, write ``corpus.yaml`` and return the manifest."""
        if self._builders is None:
            return self.manifest
        if not self._seen:
            self.abort()
            raise CorpusError(f"{self.out_dir}: no utterances were added; "
                              "refusing to write an empty corpus")
        builders = self._builders
        try:
            for builder in builders:
                try:
                    builder.finish()
                except BaseException as exc:
                    raise _named(exc, builder.path)
            self._replace_old_corpus(builders)
        except BaseException:
            self.abort()
            raise
        self._builders = None
        shards = [ShardInfo(os.path.basename(b.path), b.num_frames, b.num_utterances)
                  for b in builders]
        self.manifest = CorpusManifest(
            feat_dim=self.feat_dim, num_classes=self.num_classes,
            num_frames=sum(s.frames for s in shards),
            num_utterances=sum(s.utterances for s in shards),
            class_counts=[int(c) for c in self._counts],
            cmvn_mean=[float(v) for v in self._moments.mean],
            cmvn_var=[float(v) for v in self._moments.var],
            shards=shards, source=self.source, directory=self.out_dir)
        write_manifest(self.manifest)
        return self.manifest

    def _replace_old_corpus(self, builders) -> None:
        """Put the finished shards in place of a corpus written here before: its
        manifest goes first (a crash in between leaves no corpus that looks
        finished), then its shards beyond the new count."""
        for builder in builders:
            if not os.path.exists(builder.temporary):
                # a writer started later on this directory took it as a killed one's
                raise CorpusError(f"{self.out_dir}: another process wrote this corpus at the "
                                  f"same time (the partial {os.path.basename(builder.path)} "
                                  "is gone); write a corpus directory with one process")
        old_manifest = manifest_path(self.out_dir)
        if os.path.exists(old_manifest):
            os.remove(old_manifest)
        for builder in builders:
            builder.commit()
        stale = self.num_shards
        while os.path.exists(os.path.join(self.out_dir, shard_name(stale))):
            os.remove(os.path.join(self.out_dir, shard_name(stale)))
            stale += 1

    def abort(self) -> None:
        """Discard everything written so far (finished shards stay only if renamed)."""
        if self._builders is None:
            return
        for builder in self._builders:      # every one, whatever the others do
            with contextlib.suppress(Exception):
                builder.abort()
        self._builders = None
        # the directories this writer made, if nothing else was put there meanwhile
        directory = self.out_dir
        while self._made_dir is not None:
            try:
                os.rmdir(directory)
            except OSError:
                break
            if directory == self._made_dir:
                break
            directory = os.path.dirname(directory)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _first_missing(directory: str) -> str | None:
    """The outermost directory of ``directory``'s path that does not exist yet."""
    missing = None
    while not os.path.exists(directory):
        missing, directory = directory, os.path.dirname(directory)
        if directory == missing:
            break
    return missing


def _named(exc: BaseException, path: str) -> BaseException:
    """``exc``, or the one-line error naming ``path`` when it means the disk is full."""
    full = disk_full_error(exc, path)
    if full is None:
        return exc
    full.__cause__ = exc
    return full
