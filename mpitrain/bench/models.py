"""The benchmarks' models and data: named model specs and a synthetic in-memory chunk.

A :class:`ModelSpec` is the acoustic model every benchmark trains: 40-dim
frames spliced with +-5 frames of context, ReLU hidden layers, a softmax
output, and the minibatch it trains at.  Two tables name them, one per family
of commands, because the same name has long meant different sizes there:

- :data:`THROUGHPUT_MODELS` (``throughput``, ``ngsgd_overhead``): quick,
  small, large = 440-4x2048-4000 at minibatch 512;
- :data:`PARALLEL_MODELS` (``scaling``, ``ddp_compare``): tiny, quickstart,
  large = 440-4x1024-2000 at minibatch 256.

:func:`synthetic_chunk` is the data: a chunk as the minibatch stream yields
it (random utterance boundaries, features and labels) and a shuffled frame
order, so a benchmark splices from memory and reads no corpus.

Example::

    model = PARALLEL_MODELS["quickstart"]
    model.describe()                       # '440-3x512-120, minibatch 256'
    chunk, order = synthetic_chunk(model, 20_000, seed=1)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: spliced input, ReLU hidden layers, softmax output.

    ``default_steps``: timed steps per round of the throughput benchmark (a
    fraction of a second on one CPU thread).

    Example::

        ModelSpec("tiny", hidden_layers=2, hidden_dim=64, num_classes=10,
                  minibatch=32).layer_dims     # [440, 64, 64, 10]
    """

    name: str
    hidden_layers: int
    hidden_dim: int
    num_classes: int
    minibatch: int
    feat_dim: int = 40
    left_context: int = 5
    right_context: int = 5
    default_steps: int = 3

    @property
    def input_dim(self) -> int:
        return self.feat_dim * (self.left_context + 1 + self.right_context)

    @property
    def layer_dims(self) -> list:
        return [self.input_dim] + [self.hidden_dim] * self.hidden_layers + [self.num_classes]

    def describe(self) -> str:
        return (f"{self.input_dim}-{self.hidden_layers}x{self.hidden_dim}-{self.num_classes}, "
                f"minibatch {self.minibatch}")


#: Single-rank throughput (``--models`` of throughput.py): docs/benchmarks.md's
#: "quick", "small" and "large".
THROUGHPUT_MODELS = {
    "quick": ModelSpec("quick", hidden_layers=3, hidden_dim=512, num_classes=120,
                       minibatch=256, default_steps=5),
    "small": ModelSpec("small", hidden_layers=4, hidden_dim=1024, num_classes=2000,
                       minibatch=256, default_steps=3),
    "large": ModelSpec("large", hidden_layers=4, hidden_dim=2048, num_classes=4000,
                       minibatch=512, default_steps=1),
}

#: Parallel training on several ranks (``--model`` of scaling.py and ddp_compare.py).
PARALLEL_MODELS = {
    "tiny": ModelSpec("tiny", hidden_layers=2, hidden_dim=64, num_classes=32, minibatch=64),
    "quickstart": ModelSpec("quickstart", hidden_layers=3, hidden_dim=512, num_classes=120,
                            minibatch=256),
    "large": ModelSpec("large", hidden_layers=4, hidden_dim=1024, num_classes=2000,
                       minibatch=256),
}


def synthetic_chunk(model: ModelSpec, frames: int, *, seed: int = 0):
    """A normalised in-memory chunk with random utterance boundaries and labels.

    Returns ``(chunk, order)``: a :class:`~mpitrain.data.batcher.Chunk` as the
    minibatch stream yields it (on the host), and a shuffled frame order.

    Example::

        chunk, order = synthetic_chunk(PARALLEL_MODELS["tiny"], 4096, seed=0)
    """
    from mpitrain.data.batcher import Chunk, ChunkSpec
    from mpitrain.data.splice import frame_utterance_bounds

    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 1000, size=frames // 100 + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.append(offsets[offsets < frames], frames)
    start, end = frame_utterance_bounds(offsets)
    feats = rng.standard_normal((frames, model.feat_dim), dtype=np.float32)
    labels = rng.integers(0, model.num_classes, size=frames).astype(np.int32)
    spec = ChunkSpec(0, 0, len(offsets) - 1, frames)
    return Chunk(spec, feats, labels, start, end), rng.permutation(frames)


def torch_network(model: ModelSpec):
    """The same model in PyTorch: ``nn.Sequential`` of ``Linear`` + ``ReLU``.

    Weights come from torch's generator: seed it first.  PyTorch is a
    benchmark-only dependency, imported here.

    Example::

        torch.manual_seed(1)
        net = torch_network(THROUGHPUT_MODELS["quick"])
    """
    import torch

    dims = model.layer_dims
    layers = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(d_in, d_out))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)
