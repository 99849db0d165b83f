"""The component interface shared by every layer.

A component maps a minibatch of rows (N, in_dim) to (N, out_dim).  Layers with
parameters do not own their storage: the network hands them views into one flat
parameter buffer and one flat gradient buffer (see network.py), so averaging a
whole model across ranks is a single collective on one array.

Output buffers are allocated once per minibatch size and reused, because a
training step must not allocate: on the CPU an allocation of a few MB costs as
much as the elementwise work done in it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Component(ABC):
    """One layer.  Subclasses set ``in_dim`` and ``out_dim``.

    Example::

        relu = ReLU(512)
        y = relu.forward(x)            # x: (N, 512)
        dx = relu.backward(dy)         # gradient of the loss w.r.t. x
    """

    in_dim: int
    out_dim: int
    kind: str = "component"

    # -- parameters ------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return 0

    def bind(self, params, grads) -> None:
        """Receive views of the flat buffers, ``num_params`` elements each."""

    def init_params(self, rng, xp) -> None:
        """Fill the bound parameter view with initial values."""

    # -- computation -----------------------------------------------------------
    @abstractmethod
    def forward(self, x, *, out=None):
        """Compute the output; ``out`` is an optional (N, out_dim) view to write to."""

    @abstractmethod
    def backward(self, dy, *, need_input_grad: bool = True):
        """Gradient w.r.t. the input of the last forward; fills parameter grads."""

    # -- description -----------------------------------------------------------
    def spec(self) -> dict:
        """A JSON-able description from which ``build_component`` recreates it."""
        return {"kind": self.kind, "in_dim": self.in_dim, "out_dim": self.out_dim}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_dim}->{self.out_dim})"


class BufferCache:
    """Per-shape scratch arrays, reused across minibatches of the same size.

    Kept until released: a caller that passes rows of many different counts
    (one utterance at a time) releases what it no longer needs with
    :meth:`release_except`, or memory grows with every new count.
    """

    def __init__(self):
        self._arrays = {}

    def keys(self) -> set:
        """The buffers held now (to release later the ones added since)."""
        return set(self._arrays)

    def release_except(self, keep) -> None:
        """Forget every buffer whose key is not in ``keep``; arrays still referenced
        elsewhere stay valid, the rest are freed."""
        for key in [k for k in self._arrays if k not in keep]:
            del self._arrays[key]

    def get(self, name, shape, xp, dtype):
        key = (name, tuple(shape), dtype, xp.__name__)
        array = self._arrays.get(key)
        if array is None:
            array = xp.empty(shape, dtype=dtype)
            self._arrays[key] = array
        return array
