"""The data layer: corpus directories of HDF5 shards, their readers and producers.

Importing this package is cheap: h5py and kaldiio are imported only when a
shard is opened or a Kaldi import runs.

Example::

    from mpitrain.data import load_manifest, ShardReader, assign_shards
    manifest = load_manifest("data/train")
    with ShardReader(manifest.shard_path(0)) as shard:
        feats, labels, offsets = shard.read(0, shard.num_utterances)
"""

from .check import check_corpus
from .corpus import (CorpusError, CorpusManifest, ShardInfo, load_manifest,
                     write_manifest)
from .kaldi import ImportReport, import_kaldi, read_alignments
from .sharding import ShardSlice, assign_shards, plan_shards
from .shards import ShardReader, write_shard
from .writer import CorpusWriter
from .splice import (apply_cmvn, cmvn_coefficients, frame_utterance_bounds, splice,
                     splice_indices)
from .synthetic import SyntheticParams, synthesize
from .validate import validate_corpus, validate_slices

__all__ = [
    "CorpusError", "CorpusManifest", "CorpusWriter", "ShardInfo", "load_manifest",
    "write_manifest", "ShardReader", "write_shard", "ShardSlice", "assign_shards",
    "plan_shards", "splice_indices", "frame_utterance_bounds", "splice", "cmvn_coefficients",
    "apply_cmvn", "synthesize", "SyntheticParams", "import_kaldi", "read_alignments",
    "ImportReport", "check_corpus", "validate_slices", "validate_corpus",
]
