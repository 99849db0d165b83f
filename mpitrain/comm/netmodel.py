"""What messages and collectives cost on a modelled network (the alpha-beta model).

Every rank sits on its own link of latency alpha (``latency_s``) and bandwidth
1/beta (``bandwidth_bytes_per_s``).  For N ranks and a buffer of n bytes:

- point to point:            alpha + n beta
- ring allreduce:            2 (N-1) alpha + 2 (N-1)/N n beta
- tree allreduce (recursive doubling, what MPI uses for small buffers):
                             ceil(log2 N) (alpha + n beta)
- broadcast:                 the cheaper of a binomial tree, ceil(log2 N) (alpha + n beta),
                             and scatter + ring allgather, (log2 N + N-1) alpha + 2 (N-1)/N n beta
- allgather / gather (ring): (N-1) alpha + (N-1)/N n_total beta
- barrier:                   ceil(log2 N) alpha

``allreduce_algorithm`` picks "ring", "tree", or "auto" (the cheaper of the
two for each buffer, as a tuned MPI library would).  One model serves the
benchmark's projection (:mod:`mpitrain.bench.projection`) and the simulated
clock of the virtual cluster (:mod:`mpitrain.comm.virtual`).

Example::

    net = NetworkModel(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)   # 100 Gbit/s
    net.allreduce_seconds(4e6, 16)        # one 4 MB model average on 16 ranks
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

ALLREDUCE_ALGORITHMS = ("ring", "tree", "auto")


def _log2_ceil(ranks: int) -> int:
    return max(0, math.ceil(math.log2(ranks))) if ranks > 1 else 0


def _check_ranks(ranks: int) -> None:
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")


def ring_allreduce_seconds(nbytes: float, ranks: int, *, latency_s: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Seconds for one ring allreduce of ``nbytes`` over ``ranks`` ranks.

    Example::

        ring_allreduce_seconds(1e6, 4, latency_s=1e-5, bandwidth_bytes_per_s=1e9)  # 0.00156
    """
    _check_ranks(ranks)
    if ranks == 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s \
        + 2.0 * (ranks - 1) * latency_s


def tree_allreduce_seconds(nbytes: float, ranks: int, *, latency_s: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Seconds for one recursive-doubling allreduce: ceil(log2 N) rounds of a whole message.

    Example::

        tree_allreduce_seconds(8, 4, latency_s=1e-5, bandwidth_bytes_per_s=1e9)  # 2.0016e-05
    """
    _check_ranks(ranks)
    return _log2_ceil(ranks) * (latency_s + nbytes / bandwidth_bytes_per_s)


@dataclass(frozen=True)
class NetworkModel:
    """Latency and bandwidth of one link; every rank sits on its own link.

    Defaults describe a 100 Gbit/s InfiniBand-class link (12.5 GB/s, 5 us)
    with ring allreduce.

    Example::

        NetworkModel(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9).allreduce_seconds(4e6, 2)
    """

    latency_s: float = 5e-6
    bandwidth_bytes_per_s: float = 12.5e9
    allreduce_algorithm: str = "ring"

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"NetworkModel: latency_s must be a finite number >= 0, "
                             f"got {self.latency_s!r}")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(f"NetworkModel: bandwidth_bytes_per_s must be a finite number "
                             f"> 0, got {self.bandwidth_bytes_per_s!r}")
        if self.allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"NetworkModel: allreduce_algorithm must be one of "
                             f"{', '.join(ALLREDUCE_ALGORITHMS)}, got "
                             f"{self.allreduce_algorithm!r}")

    def _links(self) -> dict:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        ring = ring_allreduce_seconds(nbytes, ranks, **self._links())
        if self.allreduce_algorithm == "ring":
            return ring
        tree = tree_allreduce_seconds(nbytes, ranks, **self._links())
        return tree if self.allreduce_algorithm == "tree" else min(ring, tree)

    def p2p_seconds(self, nbytes: float) -> float:
        """One message from one rank to another."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def bcast_seconds(self, nbytes: float, ranks: int) -> float:
        _check_ranks(ranks)
        if ranks == 1:
            return 0.0
        rounds = _log2_ceil(ranks)
        binomial = rounds * self.p2p_seconds(nbytes)
        scatter_allgather = (rounds + ranks - 1) * self.latency_s \
            + 2.0 * (ranks - 1) / ranks * nbytes / self.bandwidth_bytes_per_s
        return min(binomial, scatter_allgather)

    def allgather_seconds(self, total_bytes: float, ranks: int) -> float:
        """Every rank ends with every rank's part; ``total_bytes`` summed over the parts."""
        _check_ranks(ranks)
        if ranks == 1:
            return 0.0
        return (ranks - 1) * self.latency_s \
            + (ranks - 1) / ranks * total_bytes / self.bandwidth_bytes_per_s

    def barrier_seconds(self, ranks: int) -> float:
        _check_ranks(ranks)
        return _log2_ceil(ranks) * self.latency_s

    def describe(self) -> str:
        formula = {"ring": "2(N-1)/N * bytes / bandwidth + 2(N-1) * latency",
                   "tree": "ceil(log2 N) * (latency + bytes / bandwidth)",
                   "auto": "the cheaper of ring, 2(N-1)/N * bytes / bandwidth + 2(N-1) * "
                           "latency, and tree, ceil(log2 N) * (latency + bytes / bandwidth)"}
        name = "ring" if self.allreduce_algorithm == "ring" else \
            "tree" if self.allreduce_algorithm == "tree" else "ring or tree"
        return (f"{name} allreduce over links of {self.bandwidth_bytes_per_s * 8 / 1e9:g} "
                f"Gbit/s and {self.latency_s * 1e6:g} us latency: "
                f"{formula[self.allreduce_algorithm]}")

    def to_dict(self) -> dict:
        return asdict(self)
